/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cma_plugin.c - libferry-cma.so, a complete ferry backend in one C99 file.
 *
 * Backend "cma": Linux cross-memory attach. Both engines run on the same host;
 * a WRITE is process_vm_writev() from our registered region into the peer's,
 * a READ is process_vm_readv() the other way. The kernel copies the bytes
 * directly between the two address spaces, so a transfer is finished (the bytes
 * are in the destination memory) when the system call returns. The plugin
 * therefore has no threads, no sockets and no queues: post() moves the bytes
 * and calls host->complete() before it returns, which the ABI allows.
 *
 * Copy this folder to start your own plugin; README.md walks through every
 * function. All state lives in the instance struct that init() returns: the
 * only global is the exported ops table at the bottom of this file.
 */
#define _GNU_SOURCE /* process_vm_readv / process_vm_writev, GNU strerror_r */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include "cma_blob.h"
#include "ferry/plugin.h"

#ifndef CMA_PLUGIN_NAME       /* tests/plugins builds a copy named cma11 against plugin.h 1.1 */
#define CMA_PLUGIN_NAME "cma" /* also the prefix of init's error messages */
#endif
#define CMA_PLUGIN_VERSION "0.1.0"

/* This file also builds against older plugin.h headers (a 1.1 build proves that
 * an old plugin keeps working): what a newer minor added is left out there. */
#if FERRY_PLUGIN_ABI_MINOR >= 2
#define CMA_CAPS_SINCE_1_2 (FERRY_CAP_INITIATOR_COPY | FERRY_CAP_NO_TARGET_CHECK)
#else
#define CMA_CAPS_SINCE_1_2 0
#endif

/* iovec entries per system call: the kernel refuses more than IOV_MAX. */
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif
#ifndef CMA_IOV_BATCH
#define CMA_IOV_BATCH IOV_MAX
#endif

/* Bytes per system call. The kernel moves at most ~2 GiB per call anyway; a
 * smaller cap lets a huge transfer notice its deadline between calls. */
#ifndef CMA_MAX_CALL_BYTES
#define CMA_MAX_CALL_BYTES ((uint64_t)256 << 20)
#endif

/* ---- handles ---------------------------------------------------------------
 * Every handle the core holds for us (peer, local region, imported remote
 * region) starts with cma_obj: a tag saying what it is, the instance it
 * belongs to, and links into the instance's list of live handles so fini()
 * can free whatever the core did not release. The tag catches a handle passed
 * to the wrong function or to the wrong instance; it is a sanity check, not a
 * guarantee (the core never passes a handle after releasing it). */
#define CMA_TAG_PEER 0x52454550u   /* "PEER" */
#define CMA_TAG_REGION 0x4e474552u /* "REGN" */
#define CMA_TAG_IMPORT 0x54504d49u /* "IMPT" */
#define CMA_TAG_DEAD 0xdeadbeefu

struct cma_instance;

typedef struct cma_obj {
  uint32_t tag;
  unsigned inflight; /* post() calls using this handle right now (instance mu) */
  struct cma_instance* inst;
  struct cma_obj *prev, *next;
} cma_obj;

typedef struct cma_peer {
  cma_obj obj;
  pid_t pid;
  int pidfd;           /* refers to the peer process itself, not its number; -1 if unavailable */
  uint64_t start_time; /* its start time: without a pidfd, checked before and after each call */
  char* key;           /* plugin-owned copy of the peer's engine key, for messages */
} cma_peer;

typedef struct cma_region { /* local memory registered with mem_register */
  cma_obj obj;
  uint64_t id;
  uint8_t* addr;
  uint64_t size;
} cma_region;

typedef struct cma_import { /* a peer's memory, from mem_import */
  cma_obj obj;
  uint64_t id;
  uint64_t addr; /* in the peer's address space */
  uint64_t size;
  pid_t pid; /* the peer process it lives in */
} cma_import;

/* One instance per engine (init .. fini). */
typedef struct cma_instance {
  const ferry_host_v1* host; /* core-owned, valid until fini */
  int has_log, has_now;      /* optional host services present */
  pid_t pid;
  uint64_t start_time, pid_ns; /* who we are, beyond the pid (cma_blob.h) */
  char* node_id;
  size_t node_len;
  pthread_mutex_t mu;  /* guards `live`, handle tags and inflight counts */
  pthread_cond_t idle; /* signalled when a handle's inflight count drops to 0 */
  cma_obj live;        /* sentinel of the circular list of live handles */
} cma_instance;

/* ---- small helpers ----------------------------------------------------------- */

static void cma_log(const cma_instance* inst, int level, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static void cma_log(const cma_instance* inst, int level, const char* fmt, ...) {
  char line[512];
  va_list ap;
  if (inst == NULL || !inst->has_log) return;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  inst->host->log(inst->host->host_ctx, level, line);
}

static void set_err(char* err, size_t errlen, const char* msg) {
  if (err != NULL && errlen > 0) snprintf(err, errlen, "%s", msg);
}

static char* cma_strndup(const char* s, size_t n) {
  char* p = (char*)malloc(n + 1);
  if (p == NULL) return NULL;
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

/* strerror is not thread-safe; _GNU_SOURCE selects the GNU strerror_r. */
static const char* cma_strerror(int err, char* buf, size_t len) {
  return strerror_r(err, buf, len);
}

/* Link a freshly allocated handle into the instance's list. */
static void obj_link(cma_instance* inst, cma_obj* o, uint32_t tag) {
  o->tag = tag;
  o->inst = inst;
  pthread_mutex_lock(&inst->mu);
  o->next = inst->live.next;
  o->prev = &inst->live;
  inst->live.next->prev = o;
  inst->live.next = o;
  pthread_mutex_unlock(&inst->mu);
}

/* Take a handle out of service: new post() calls refuse it at once, and this
 * waits for the post() calls already using it, so the caller may free it. */
static void obj_retire(cma_instance* inst, cma_obj* o) {
  pthread_mutex_lock(&inst->mu);
  o->prev->next = o->next;
  o->next->prev = o->prev;
  o->tag = CMA_TAG_DEAD;
  while (o->inflight > 0) pthread_cond_wait(&inst->idle, &inst->mu);
  pthread_mutex_unlock(&inst->mu);
}

/* Call with inst->mu held when the answer must stay true (see cma_post). */
static cma_obj* obj_check(cma_instance* inst, void* handle, uint32_t tag) {
  cma_obj* o = (cma_obj*)handle;
  if (inst == NULL || o == NULL || o->tag != tag || o->inst != inst) return NULL;
  return o;
}

static cma_peer* as_peer(cma_instance* inst, void* h) {
  return (cma_peer*)obj_check(inst, h, CMA_TAG_PEER);
}
static cma_region* as_region(cma_instance* inst, void* h) {
  return (cma_region*)obj_check(inst, h, CMA_TAG_REGION);
}
static cma_import* as_import(cma_instance* inst, void* h) {
  return (cma_import*)obj_check(inst, h, CMA_TAG_IMPORT);
}

/* Free a handle of any kind (call after obj_retire, or from fini). */
static void free_obj(cma_obj* o, uint32_t tag) {
  if (tag == CMA_TAG_PEER) {
    cma_peer* p = (cma_peer*)o;
    if (p->pidfd >= 0) close(p->pidfd);
    free(p->key);
  }
  o->tag = CMA_TAG_DEAD;
  free(o);
}

/* ---- which process a pid means ------------------------------------------------
 * A pid is a number: after its process exits the number is handed to the next
 * process, and in another PID namespace (container) it names someone else.
 * Writing into "pid 1234" must never hit a process that is not our peer. */

/* Field 22 of /proc/<pid>/stat: start time in clock ticks after boot; 0 = unknown. */
static uint64_t proc_start_time(pid_t pid) {
  char path[64], buf[1024], *p;
  ssize_t n;
  int fd, field = 2;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  p = strrchr(buf, ')'); /* the command name in (...) may contain spaces */
  if (p == NULL) return 0;
  for (; *p != '\0' && field < 22; ++p)
    if (*p == ' ') ++field;
  return field == 22 ? strtoull(p, NULL, 10) : 0;
}

/* Inode of our PID namespace; 0 = unknown. */
static uint64_t pid_namespace(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* A file descriptor for the process itself (Linux >= 5.3), or -1 with errno. */
static int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return (int)syscall(SYS_pidfd_open, pid, 0);
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

/* 0 when the peer process has exited (its pid may already be someone else's). */
static int peer_alive(const cma_peer* p) {
  struct pollfd pfd;
  /* No pidfd (a kernel before 5.3): the pid still names the process that
   * started then, or it is another one now. */
  if (p->pidfd < 0) return proc_start_time(p->pid) == p->start_time;
  pfd.fd = p->pidfd;
  pfd.events = POLLIN; /* a pidfd becomes readable when the process exits */
  pfd.revents = 0;
  return !(poll(&pfd, 1, 0) == 1 && (pfd.revents & (POLLIN | POLLHUP | POLLERR)));
}

/* The only setting accepted is none: "{}" or an empty string, whitespace ignored. */
static int settings_are_empty(const char* s) {
  char compact[3];
  size_t n = 0;
  if (s == NULL) return 1;
  for (; *s != '\0'; ++s) {
    if (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r') continue;
    if (n == 2) return 0;
    compact[n++] = *s;
  }
  return n == 0 || (n == 2 && compact[0] == '{' && compact[1] == '}');
}

/* [off, off + len) inside [0, size), without overflow. */
static int range_ok(uint64_t off, uint64_t len, uint64_t size) {
  return off <= size && len <= size - off;
}

/* ---- init / fini --------------------------------------------------------------- */

static int cma_init(const ferry_host_v1* host, const char* engine_key, const char* node_id,
                    const char* settings_json, void** ctx, char* err, size_t errlen) {
  cma_instance* inst;
  size_t node_len;
  (void)engine_key; /* the core prefixes our log lines with the backend name */
  if (ctx == NULL) return FERRY_ERR_INVALID_ARGS;
  *ctx = NULL;
  if (host == NULL || !FERRY_HAS_FIELD(ferry_host_v1, host, complete) || host->complete == NULL) {
    set_err(err, errlen, CMA_PLUGIN_NAME ": host services table is missing or lacks complete()");
    return FERRY_ERR_INVALID_ARGS;
  }
  if (node_id == NULL || (node_len = strlen(node_id)) == 0 || node_len > CMA_MAX_NODE_ID) {
    set_err(err, errlen, CMA_PLUGIN_NAME ": node id must be 1..1024 bytes");
    return FERRY_ERR_INVALID_ARGS;
  }
  if (!settings_are_empty(settings_json)) {
    set_err(err, errlen,
            CMA_PLUGIN_NAME ": this backend takes no settings (expected {} or nothing)");
    return FERRY_ERR_INVALID_ARGS;
  }
  inst = (cma_instance*)calloc(1, sizeof *inst);
  if (inst == NULL) {
    set_err(err, errlen, CMA_PLUGIN_NAME ": out of memory");
    return FERRY_ERR_NO_MEMORY;
  }
  inst->node_id = cma_strndup(node_id, node_len);
  if (inst->node_id == NULL || pthread_mutex_init(&inst->mu, NULL) != 0) {
    free(inst->node_id);
    free(inst);
    set_err(err, errlen, CMA_PLUGIN_NAME ": out of memory");
    return FERRY_ERR_NO_MEMORY;
  }
  if (pthread_cond_init(&inst->idle, NULL) != 0) {
    pthread_mutex_destroy(&inst->mu);
    free(inst->node_id);
    free(inst);
    set_err(err, errlen, CMA_PLUGIN_NAME ": out of memory");
    return FERRY_ERR_NO_MEMORY;
  }
  inst->host = host;
  inst->has_log = FERRY_HAS_FIELD(ferry_host_v1, host, log) && host->log != NULL;
  inst->has_now = FERRY_HAS_FIELD(ferry_host_v1, host, now_ns) && host->now_ns != NULL;
  inst->pid = getpid();
  inst->start_time = proc_start_time(inst->pid);
  inst->pid_ns = pid_namespace();
  inst->node_len = node_len;
  inst->live.next = inst->live.prev = &inst->live;
  *ctx = inst;
  return FERRY_OK;
}

static void cma_fini(void* ctx) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_obj *o, *next;
  unsigned long left = 0;
  if (inst == NULL) return;
  /* post() completes every transfer before returning, so nothing is pending.
   * The core releases every handle before fini; free any it did not. */
  for (o = inst->live.next; o != &inst->live; o = next) {
    next = o->next;
    free_obj(o, o->tag);
    ++left;
  }
  if (left > 0)
    cma_log(inst, FERRY_LOG_WARN, "fini: freed %lu handles the core did not release", left);
  pthread_cond_destroy(&inst->idle);
  pthread_mutex_destroy(&inst->mu);
  free(inst->node_id);
  free(inst);
}

/* ---- connection info and peers ---------------------------------------------------- */

static int cma_conn_info(void* ctx, void* buf, size_t* len) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_conn me;
  size_t n;
  if (inst == NULL || buf == NULL || len == NULL) return FERRY_ERR_INVALID_ARGS;
  me.pid = (uint32_t)inst->pid;
  me.start_time = inst->start_time;
  me.pid_ns = inst->pid_ns;
  me.node_id = inst->node_id;
  me.node_len = inst->node_len;
  n = cma_conn_encode(buf, *len, &me);
  if (n == 0) {
    cma_log(inst, FERRY_LOG_ERROR, "conn_info: %zu bytes of room, need %zu", *len,
            cma_conn_blob_len(inst->node_len));
    return FERRY_ERR_INVALID_ARGS;
  }
  *len = n;
  return FERRY_OK;
}

static int cma_peer_add(void* ctx, const ferry_peer_v1* peer, void** peer_handle) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_peer* p;
  cma_conn c;
  const char* key;
  uint64_t start;
  int pidfd;
  if (inst == NULL || peer == NULL || peer_handle == NULL ||
      !FERRY_HAS_FIELD(ferry_peer_v1, peer, conn_blob_len))
    return FERRY_ERR_INVALID_ARGS;
  *peer_handle = NULL;
  key = peer->key != NULL ? peer->key : "?";
  if (!cma_conn_decode(peer->conn_blob, peer->conn_blob_len, &c)) {
    cma_log(inst, FERRY_LOG_WARN, "peer '%s': malformed cma connection info (%zu bytes)", key,
            peer->conn_blob_len);
    return FERRY_ERR_INVALID_ARGS;
  }
  if (peer->node_id != NULL &&
      (strlen(peer->node_id) != c.node_len || memcmp(peer->node_id, c.node_id, c.node_len) != 0)) {
    cma_log(inst, FERRY_LOG_WARN, "peer '%s': node id in its descriptor and in its cma info differ",
            key);
    return FERRY_ERR_INVALID_ARGS;
  }
  if (!peer->same_host || c.node_len != inst->node_len ||
      memcmp(c.node_id, inst->node_id, c.node_len) != 0) {
    cma_log(inst, FERRY_LOG_INFO, "peer '%s' is on another host; cma works on the same host only",
            key);
    return FERRY_ERR_UNSUPPORTED;
  }
  if (c.pid_ns != 0 && inst->pid_ns != 0 && c.pid_ns != inst->pid_ns) {
    cma_log(inst, FERRY_LOG_INFO,
            "peer '%s' is in another PID namespace (another container?); cma needs one namespace",
            key);
    return FERRY_ERR_UNSUPPORTED;
  }
  /* Hold the process, then check it is the one that wrote the blob. */
  pidfd = open_pidfd((pid_t)c.pid);
  if (pidfd < 0 && errno == ESRCH) {
    cma_log(inst, FERRY_LOG_WARN, "peer '%s': peer process is gone (pid %u)", key, (unsigned)c.pid);
    return FERRY_ERR_TRANSPORT;
  }
  if (pidfd < 0 && errno != ENOSYS) {
    /* Out of descriptors, or a sandbox: without a hold on the process every
     * later check would say "alive", and a reused pid would take our WRITEs. */
    char ebuf[128];
    cma_log(inst, FERRY_LOG_WARN, "peer '%s': cannot hold its process (pid %u): pidfd_open: %s",
            key, (unsigned)c.pid, cma_strerror(errno, ebuf, sizeof ebuf));
    return FERRY_ERR_TRANSPORT;
  }
  start = proc_start_time((pid_t)c.pid);
  if (pidfd < 0 && (start == 0 || c.start_time == 0)) {
    /* No pidfd and no start time to compare: nothing would tell its exit. */
    cma_log(inst, FERRY_LOG_WARN, "peer '%s': cannot tell its process (pid %u) from a later one",
            key, (unsigned)c.pid);
    return FERRY_ERR_TRANSPORT;
  }
  if (c.start_time != 0 && start != 0 && start != c.start_time) {
    cma_log(inst, FERRY_LOG_WARN,
            "peer '%s': pid %u now belongs to another process (the peer exited)", key,
            (unsigned)c.pid);
    if (pidfd >= 0) close(pidfd);
    return FERRY_ERR_TRANSPORT;
  }
  p = (cma_peer*)calloc(1, sizeof *p);
  if (p != NULL) p->key = cma_strndup(key, strlen(key));
  if (p == NULL || p->key == NULL) {
    free(p);
    if (pidfd >= 0) close(pidfd);
    return FERRY_ERR_NO_MEMORY;
  }
  p->pid = (pid_t)c.pid;
  p->pidfd = pidfd;
  p->start_time = start;
  obj_link(inst, &p->obj, CMA_TAG_PEER);
  *peer_handle = p;
  return FERRY_OK;
}

static void cma_peer_remove(void* ctx, void* peer_handle) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_peer* p = as_peer(inst, peer_handle);
  /* "Transfers to it are failed and completed before this returns": a post()
   * to this peer running on another thread finishes first (obj_retire waits).
   * Imports keep their own copy of the pid, so the core may release them later. */
  if (p == NULL) return;
  obj_retire(inst, &p->obj);
  free_obj(&p->obj, CMA_TAG_PEER);
}

/* ---- memory -------------------------------------------------------------------------- */

static int cma_mem_register(void* ctx, const ferry_mem_v1* mem, void** mem_handle, void* blob,
                            size_t* blob_len) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_region* r;
  uintptr_t a;
  if (inst == NULL || mem == NULL || mem_handle == NULL || blob == NULL || blob_len == NULL ||
      !FERRY_HAS_FIELD(ferry_mem_v1, mem, size))
    return FERRY_ERR_INVALID_ARGS;
  *mem_handle = NULL;
  if (mem->location != FERRY_MEM_CPU) return FERRY_ERR_UNSUPPORTED; /* GPU memory: not ours */
  a = (uintptr_t)mem->addr;
  if (mem->addr == NULL || mem->size == 0 || (uint64_t)(UINTPTR_MAX - a) < mem->size - 1) {
    cma_log(inst, FERRY_LOG_WARN, "mem_register: bad region (addr %p, %llu bytes)", mem->addr,
            (unsigned long long)mem->size);
    return FERRY_ERR_INVALID_ARGS;
  }
  if (*blob_len < CMA_MEM_BLOB_LEN) return FERRY_ERR_INVALID_ARGS;
  r = (cma_region*)calloc(1, sizeof *r);
  if (r == NULL) return FERRY_ERR_NO_MEMORY;
  r->id = mem->id;
  r->addr = (uint8_t*)mem->addr;
  r->size = mem->size;
  cma_mem_encode(blob, r->id, (uint64_t)a, r->size);
  *blob_len = CMA_MEM_BLOB_LEN;
  obj_link(inst, &r->obj, CMA_TAG_REGION);
  *mem_handle = r;
  return FERRY_OK;
}

static void cma_mem_deregister(void* ctx, void* mem_handle) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_region* r = as_region(inst, mem_handle);
  /* After this the handle is gone: post() can no longer use the region. NOTE:
   * with CMA a peer that kept our memory blob can still address this memory
   * with process_vm_*; the kernel offers no way to revoke that (README.md). */
  if (r == NULL) return;
  obj_retire(inst, &r->obj);
  free_obj(&r->obj, CMA_TAG_REGION);
}

static int cma_mem_import(void* ctx, void* peer_handle, uint64_t remote_id, uint64_t remote_size,
                          const void* blob, size_t blob_len, void** remote_handle) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_peer* p = as_peer(inst, peer_handle);
  cma_import* m;
  uint64_t id, addr, size;
  if (inst == NULL || remote_handle == NULL) return FERRY_ERR_INVALID_ARGS;
  *remote_handle = NULL;
  if (p == NULL) return FERRY_ERR_NOT_FOUND;
  if (!cma_mem_decode(blob, blob_len, &id, &addr, &size)) {
    cma_log(inst, FERRY_LOG_WARN, "mem_import from '%s': malformed cma memory info (%zu bytes)",
            p->key, blob_len);
    return FERRY_ERR_INVALID_ARGS;
  }
  if (id != remote_id || size != remote_size) {
    cma_log(inst, FERRY_LOG_WARN,
            "mem_import from '%s': cma info says region %llu of %llu bytes, the descriptor says "
            "region %llu of %llu bytes",
            p->key, (unsigned long long)id, (unsigned long long)size, (unsigned long long)remote_id,
            (unsigned long long)remote_size);
    return FERRY_ERR_INVALID_ARGS;
  }
  /* The address must be a valid pointer here too (same width) and not wrap. */
  if (addr == 0 || size == 0 || (uint64_t)(uintptr_t)addr != addr ||
      (uint64_t)(UINTPTR_MAX - (uintptr_t)addr) < size - 1) {
    cma_log(inst, FERRY_LOG_WARN, "mem_import from '%s': bad remote range", p->key);
    return FERRY_ERR_INVALID_ARGS;
  }
  m = (cma_import*)calloc(1, sizeof *m);
  if (m == NULL) return FERRY_ERR_NO_MEMORY;
  m->id = id;
  m->addr = addr;
  m->size = size;
  m->pid = p->pid;
  obj_link(inst, &m->obj, CMA_TAG_IMPORT);
  *remote_handle = m;
  return FERRY_OK;
}

static void cma_mem_release(void* ctx, void* remote_handle) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_import* m = as_import(inst, remote_handle);
  if (m == NULL) return;
  obj_retire(inst, &m->obj);
  free_obj(&m->obj, CMA_TAG_IMPORT);
}

/* ---- transfers ------------------------------------------------------------------------- */

/* Say what a failed process_vm_* call means, in words a user can act on. */
static int syscall_failure(const cma_peer* peer, int err, uint32_t op, uint64_t moved,
                           uint64_t total, char* msg, size_t msglen) {
  char ebuf[128];
  const char* call = op == FERRY_OP_WRITE ? "process_vm_writev" : "process_vm_readv";
  const char* es = cma_strerror(err, ebuf, sizeof ebuf);
  switch (err) {
    case ESRCH:
      snprintf(msg, msglen, "peer process is gone: '%s' (pid %d): %s: %s", peer->key,
               (int)peer->pid, call, es);
      break;
    case EPERM:
      snprintf(msg, msglen,
               "no ptrace permission over '%s' (pid %d) (see /proc/sys/kernel/yama/ptrace_scope): "
               "%s: %s",
               peer->key, (int)peer->pid, call, es);
      break;
    case EFAULT:
      snprintf(msg, msglen,
               "%s to '%s' (pid %d) hit unmapped memory after %llu of %llu bytes (was the "
               "region freed?): %s",
               call, peer->key, (int)peer->pid, (unsigned long long)moved,
               (unsigned long long)total, es);
      break;
    default:
      snprintf(msg, msglen, "%s to '%s' (pid %d) failed after %llu of %llu bytes: %s", call,
               peer->key, (int)peer->pid, (unsigned long long)moved, (unsigned long long)total, es);
      break;
  }
  return FERRY_ERR_TRANSPORT;
}

/* Move every byte of x, in as few system calls as the kernel allows. Returns
 * FERRY_OK, or an error with msg filled in. */
static int move_bytes(const cma_instance* inst, const ferry_xfer_v1* x, const cma_peer* peer,
                      const cma_region* local, const cma_import* remote, struct iovec* liov,
                      struct iovec* riov, int batch, char* msg, size_t msglen) {
  uint32_t i = 0;      /* first iov not fully moved */
  uint64_t done_i = 0; /* bytes of iov[i] already moved */
  uint64_t moved = 0, total = 0;
  uint32_t k;
  for (k = 0; k < x->n_iov; ++k) total += x->iov[k].len;
  while (i < x->n_iov) {
    int cnt = 0;
    uint64_t bytes = 0, off = done_i;
    uint32_t j = i;
    ssize_t n;
    /* Gather up to `batch` pieces / CMA_MAX_CALL_BYTES bytes from the cursor. */
    while (j < x->n_iov && cnt < batch && bytes < CMA_MAX_CALL_BYTES) {
      const ferry_iov_v1* v = &x->iov[j];
      uint64_t len = v->len - off;
      if (len > CMA_MAX_CALL_BYTES - bytes) len = CMA_MAX_CALL_BYTES - bytes;
      if (len > 0) {
        liov[cnt].iov_base = local->addr + v->local_off + off;
        liov[cnt].iov_len = (size_t)len;
        riov[cnt].iov_base = (void*)(uintptr_t)(remote->addr + v->remote_off + off);
        riov[cnt].iov_len = (size_t)len;
        ++cnt;
        bytes += len;
      }
      if (off + len < v->len) break; /* this piece continues in the next call */
      ++j;
      off = 0;
    }
    if (cnt == 0) { /* only empty pieces were left */
      i = j;
      done_i = 0;
      continue;
    }
    if (!peer_alive(peer)) {
      snprintf(msg, msglen, "peer process is gone: '%s' (pid %d) exited after %llu of %llu bytes",
               peer->key, (int)peer->pid, (unsigned long long)moved, (unsigned long long)total);
      return FERRY_ERR_TRANSPORT;
    }
    if (inst->has_now && x->deadline_ns != 0 &&
        inst->host->now_ns(inst->host->host_ctx) >= x->deadline_ns) {
      snprintf(msg, msglen, "deadline passed after %llu of %llu bytes", (unsigned long long)moved,
               (unsigned long long)total);
      return FERRY_ERR_TIMEOUT;
    }
    if (x->op == FERRY_OP_WRITE)
      n = process_vm_writev(peer->pid, liov, (unsigned long)cnt, riov, (unsigned long)cnt, 0);
    else
      n = process_vm_readv(peer->pid, liov, (unsigned long)cnt, riov, (unsigned long)cnt, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return syscall_failure(peer, errno, x->op, moved, total, msg, msglen);
    }
    if (x->op == FERRY_OP_WRITE && !peer_alive(peer)) {
      /* It exited during the call (a copy can wait on the target's page
       * faults): what went in went into a process that is gone. */
      snprintf(msg, msglen,
               "peer process is gone: '%s' (pid %d) exited during a copy, after %llu of %llu bytes",
               peer->key, (int)peer->pid, (unsigned long long)moved, (unsigned long long)total);
      return FERRY_ERR_TRANSPORT;
    }
    if (n == 0) /* no progress and no error: do not spin */
      return syscall_failure(peer, EFAULT, x->op, moved, total, msg, msglen);
    /* A partial transfer ends at an iovec boundary or inside one; advance the
     * cursor by exactly what moved and go again. */
    moved += (uint64_t)n;
    while (n > 0) {
      uint64_t rem = x->iov[i].len - done_i;
      if ((uint64_t)n >= rem) {
        n -= (ssize_t)rem;
        ++i;
        done_i = 0;
      } else {
        done_i += (uint64_t)n;
        n = 0;
      }
    }
  }
  return FERRY_OK;
}

static void unpin(cma_instance* inst, cma_obj* a, cma_obj* b, cma_obj* c) {
  pthread_mutex_lock(&inst->mu);
  --a->inflight;
  --b->inflight;
  --c->inflight;
  if (a->inflight == 0 || b->inflight == 0 || c->inflight == 0) pthread_cond_broadcast(&inst->idle);
  pthread_mutex_unlock(&inst->mu);
}

static int cma_post(void* ctx, const ferry_xfer_v1* x) {
  cma_instance* inst = (cma_instance*)ctx;
  cma_peer* peer;
  cma_region* local;
  cma_import* remote;
  struct iovec* liov = NULL;
  char msg[512];
  uint32_t k;
  int batch, status = FERRY_OK;
  if (inst == NULL || x == NULL || !FERRY_HAS_FIELD(ferry_xfer_v1, x, xfer_ctx))
    return FERRY_ERR_INVALID_ARGS;
  if ((x->op != FERRY_OP_READ && x->op != FERRY_OP_WRITE) || x->n_iov == 0 || x->iov == NULL)
    return FERRY_ERR_INVALID_ARGS;

  /* Pin the three handles: peer_remove / mem_deregister / mem_release on
   * another thread now wait until this post() is done with them. */
  pthread_mutex_lock(&inst->mu);
  peer = as_peer(inst, x->peer);
  local = as_region(inst, x->local_mem);
  remote = as_import(inst, x->remote_mem);
  if (peer != NULL && local != NULL && remote != NULL) {
    ++peer->obj.inflight;
    ++local->obj.inflight;
    ++remote->obj.inflight;
  }
  pthread_mutex_unlock(&inst->mu);
  if (peer == NULL || local == NULL || remote == NULL) {
    cma_log(inst, FERRY_LOG_ERROR, "post: unknown or removed %s handle",
            peer == NULL    ? "peer"
            : local == NULL ? "local memory"
                            : "remote memory");
    return FERRY_ERR_NOT_FOUND;
  }

  /* All or nothing: check everything before the first byte moves. */
  if (remote->pid != peer->pid) {
    cma_log(inst, FERRY_LOG_ERROR,
            "post: remote memory %llu was imported for another peer than '%s'",
            (unsigned long long)remote->id, peer->key);
    status = FERRY_ERR_INVALID_ARGS;
  }
  for (k = 0; status == FERRY_OK && k < x->n_iov; ++k) {
    const ferry_iov_v1* v = &x->iov[k];
    if (!range_ok(v->local_off, v->len, local->size)) {
      cma_log(inst, FERRY_LOG_ERROR,
              "post: item %u: local range [%llu, +%llu) outside region of %llu bytes", k,
              (unsigned long long)v->local_off, (unsigned long long)v->len,
              (unsigned long long)local->size);
      status = FERRY_ERR_INVALID_ARGS;
    } else if (!range_ok(v->remote_off, v->len, remote->size)) {
      cma_log(inst, FERRY_LOG_ERROR,
              "post: item %u: remote range [%llu, +%llu) outside region of %llu bytes", k,
              (unsigned long long)v->remote_off, (unsigned long long)v->len,
              (unsigned long long)remote->size);
      status = FERRY_ERR_INVALID_ARGS;
    }
  }
  batch = x->n_iov < (uint32_t)CMA_IOV_BATCH ? (int)x->n_iov : CMA_IOV_BATCH;
  if (status == FERRY_OK) {
    liov = (struct iovec*)malloc(2 * (size_t)batch * sizeof *liov);
    if (liov == NULL) status = FERRY_ERR_NO_MEMORY;
  }
  if (status != FERRY_OK) { /* refused: nothing started, complete() is not called */
    unpin(inst, &peer->obj, &local->obj, &remote->obj);
    return status;
  }

  /* Accepted: from here on the transfer ends through complete(), exactly once. */
  msg[0] = '\0';
  status = move_bytes(inst, x, peer, local, remote, liov, liov + batch, batch, msg, sizeof msg);
  free(liov);
  unpin(inst, &peer->obj, &local->obj, &remote->obj); /* before complete(): see README */
  if (status != FERRY_OK)
    cma_log(inst, FERRY_LOG_DEBUG, "transfer %llu: %s", (unsigned long long)x->uid, msg);
  /* Synchronous completion, from inside post(): the ABI allows it. The core may
   * do its follow-up work (notify the target, fail over) inside this call. */
  inst->host->complete(inst->host->host_ctx, x->xfer_ctx, status, status == FERRY_OK ? NULL : msg);
  return FERRY_OK;
}

/* ---- the rest ---------------------------------------------------------------------------- */

static void cma_on_ctrl(void* ctx, const char* peer_key, const void* msg, size_t len) {
  (void)msg;
  /* cma never calls host->ctrl_send, so a message here is unexpected; ignore it. */
  cma_log((cma_instance*)ctx, FERRY_LOG_DEBUG, "ignoring a %zu-byte control message from %s", len,
          peer_key != NULL ? peer_key : "?");
}

static int cma_describe(void* ctx, char* buf, size_t len) {
  cma_instance* inst = (cma_instance*)ctx;
  if (inst == NULL || buf == NULL || len == 0) return FERRY_ERR_INVALID_ARGS;
  snprintf(buf, len, "same-host process_vm_readv/writev; pid %d", (int)inst->pid);
  return FERRY_OK;
}

#if FERRY_PLUGIN_ABI_MINOR >= 5
/* ABI 1.5, optional: live counters for Engine::stats() and `ferry stats`, a JSON
 * object of non-negative integers (plugin.h says which keys the core keeps). */
static int cma_counters(void* ctx, char* buf, size_t len) {
  cma_instance* inst = (cma_instance*)ctx;
  unsigned long handles = 0;
  const cma_obj* o;
  if (inst == NULL || buf == NULL || len == 0) return FERRY_ERR_INVALID_ARGS;
  pthread_mutex_lock(&inst->mu);
  for (o = inst->live.next; o != &inst->live; o = o->next) ++handles;
  pthread_mutex_unlock(&inst->mu);
  snprintf(buf, len, "{\"live_handles\":%lu}", handles);
  return FERRY_OK;
}
#endif

/* The entry point: the one symbol this .so exports (see CMakeLists.txt).
 * Designated initialisers: a function put in the wrong slot does not compile
 * quietly (peer_remove, mem_deregister and mem_release share one signature). */
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = {
    .struct_size = sizeof(ferry_plugin_ops_v1), /* as built against this plugin.h */
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .name = CMA_PLUGIN_NAME, /* must match libferry-cma.so */
    .version = CMA_PLUGIN_VERSION,
    /* INITIATOR_COPY: process_vm_writev is the whole transfer - when it returns,
     * nothing more of it can land. NO_TARGET_CHECK: the target process is not
     * asked, so bounds and deregistration rest on the initiator's descriptor; the
     * core uses cma only where a policy rule opts in (trust_descriptors: true). */
    .caps = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE | FERRY_CAP_SAME_HOST_ONLY |
            CMA_CAPS_SINCE_1_2,
    .init = cma_init,
    .fini = cma_fini,
    .conn_info = cma_conn_info,
    .peer_add = cma_peer_add,
    .peer_remove = cma_peer_remove,
    .mem_register = cma_mem_register,
    .mem_deregister = cma_mem_deregister,
    .mem_import = cma_mem_import,
    .mem_release = cma_mem_release,
    .post = cma_post,
    .on_ctrl = cma_on_ctrl,
    .describe = cma_describe,
#if FERRY_PLUGIN_ABI_MINOR >= 5
    .fence = NULL, /* process_vm_writev is the whole transfer (INITIATOR_COPY) */
    .counters = cma_counters,
#endif
};
