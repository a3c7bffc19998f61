// SPDX-License-Identifier: Apache-2.0
// libferry-fault.so: a test-only backend whose failures are scripted, so the
// failover tests can break one backend on purpose and watch the policy move the
// transfer to another. Data moves with memcpy (the memory blob carries the
// address), so a transfer succeeds only between engines of one process; the
// scripted failures work across processes too (ferry-bench runs with a failing
// backend). Never installed.
//
// Settings (JSON): {"mode": M, "n": N}
//   ok                 copy and succeed
//   fail_submit        post() refuses the transfer
//   fail_complete      accept, then complete with FERRY_ERR_TRANSPORT
//   hang               accept and never complete (until fini): the core's deadline must act
//   lose               accept and never complete, not even at fini (an ABI breach):
//                      the core must still end the transfer when the engine goes
//   drop               accept, complete with "connection dropped" from another thread
//   fail_first_n       the first N transfers fail at completion, later ones succeed
//   notify_then_fail   copy, tell the target it landed, then report failure
//   deferred           copy in post(), but report success only from progress()
//                      (ABI 1.6, a waiting thread) - or fail it at fini: no
//                      thread of its own, so a transfer ends only if a waiter
//                      drives it
//   complete_again_at_fini  copy, complete, and complete it once more at fini
//                      (long after the core ended it): the core must ignore
//                      and count it, reading nothing of the ended transfer
//   complete_twice     copy, then complete the transfer twice inside post()
//                      with different outcomes (an ABI breach): the core
//                      must keep the first and ignore the second
//   overrun            copy and complete; describe() and counters() write 256
//                      bytes past the buffer they are given (an ABI breach):
//                      the core must ignore their text, not crash
//   init_overrun       init writes 64 bytes past its error buffer and succeeds
//                      (an ABI breach): the core must not use the plugin
//   call_after_fini    copy and complete; fini then leaves a thread behind (an
//                      ABI breach) that waits for a byte on "gate_fd" and calls
//                      the host's complete, inbound, log, ctrl_send,
//                      ctrl_try_send and auth_sign, long after the engine
//                      went; it writes the three return codes (int[3]) to
//                      "done_fd". The test keeps the library mapped.
//   chatter            copy and complete; the first post also starts a thread
//                      that fini never joins (an ABI breach): it calls the
//                      host's auth_sign in a loop, through the backend's
//                      removal, until 100 calls were refused with
//                      FERRY_ERR_BAD_STATE (or 5 million calls were made since
//                      a byte came on "gate_fd": the test's removal began), then
//                      writes how many calls it made and how many were refused
//                      (uint64_t[2]) to "done_fd". The test keeps the library
//                      mapped.
//   refuse_late        post() reads a byte from the descriptor "gate_fd" (the
//                      test's pipe: it writes once it saw what it waits for),
//                      then refuses the transfer - a post() slower than the
//                      core's watchdog time
// On success it notifies the target itself AND lacks FERRY_CAP_NATIVE_NOTIFY, so
// the core notifies too: the target must still see each transfer once.
// Built twice: as 'fault' (FERRY_CAP_POST_MORE) and, with FAULT_MULTI_PAIR, as
// 'faultmp', which also takes several region pairs in one post (ABI 1.7
// FERRY_CAP_MULTI_PAIR) and counts those posts and their pairs.
#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"

namespace {

enum class Mode {
  OK,
  FAIL_SUBMIT,
  FAIL_COMPLETE,
  HANG,
  LOSE,
  DROP,
  FAIL_FIRST_N,
  NOTIFY_THEN_FAIL,
  DEFERRED,
  COMPLETE_TWICE,
  COMPLETE_AGAIN_AT_FINI,
  CALL_AFTER_FINI,
  CHATTER,
  REFUSE_LATE,
  OVERRUN,
  INIT_OVERRUN
};

// A deferred transfer: copied, its success not reported yet.
struct Deferred {
  void* xfer_ctx;
  bool notify;
  std::string peer;
  uint64_t uid;
};

struct Instance {
  const ferry_host_v1* host;
  std::string key;
  Mode mode = Mode::OK;
  int n = 0;
  int gate_fd = -1;       // refuse_late, call_after_fini: the test's pipe
  int done_fd = -1;       // call_after_fini: where the late calls' results go
  std::string last_peer;  // call_after_fini: the peer of the last post, guarded by mu
  std::atomic<int> seen{0};
  std::mutex mu;
  std::vector<void*> hung;         // xfer_ctx of hung transfers, completed at fini
  std::vector<void*> again;        // xfer_ctx of completed transfers, completed again at fini
  std::vector<Deferred> deferred;  // guarded by mu: reported by progress()
  std::atomic<uint64_t> progress_calls{0}, by_progress{0};
  // Posts that came with FERRY_XFER_MORE, and those without it (it claims
  // FERRY_CAP_POST_MORE and ignores the flag, which is always correct).
  std::atomic<uint64_t> posts_more{0}, posts_last{0};
  // Posts over several region pairs (faultmp), and the pairs they carried.
  std::atomic<uint64_t> multi_posts{0}, multi_pairs{0};
  std::vector<std::thread> threads;
};

struct Peer {
  std::string key;
  bool same_process;  // data moves only then (memcpy); failures work anywhere
};
struct Mem {
  uint8_t* addr;
  uint64_t size;
};

struct Blob {
  uint64_t pid, addr, size;
};

int f_init(const ferry_host_v1* host, const char* key, const char*, const char* settings,
           void** ctx, char* err, size_t errlen) {
  auto* in = new Instance();
  in->host = host;
  in->key = key;
  auto j = nlohmann::json::parse(settings, nullptr, false);
  std::string mode = j.is_object() ? j.value("mode", "ok") : "?";
  in->n = j.is_object() ? j.value("n", 0) : 0;
  in->gate_fd = j.is_object() ? j.value("gate_fd", -1) : -1;
  in->done_fd = j.is_object() ? j.value("done_fd", -1) : -1;
  static const std::pair<const char*, Mode> modes[] = {
      {"ok", Mode::OK},
      {"fail_submit", Mode::FAIL_SUBMIT},
      {"fail_complete", Mode::FAIL_COMPLETE},
      {"hang", Mode::HANG},
      {"lose", Mode::LOSE},
      {"drop", Mode::DROP},
      {"fail_first_n", Mode::FAIL_FIRST_N},
      {"notify_then_fail", Mode::NOTIFY_THEN_FAIL},
      {"deferred", Mode::DEFERRED},
      {"complete_twice", Mode::COMPLETE_TWICE},
      {"complete_again_at_fini", Mode::COMPLETE_AGAIN_AT_FINI},
      {"call_after_fini", Mode::CALL_AFTER_FINI},
      {"chatter", Mode::CHATTER},
      {"refuse_late", Mode::REFUSE_LATE},
      {"overrun", Mode::OVERRUN},
      {"init_overrun", Mode::INIT_OVERRUN}};
  bool found = false;
  for (const auto& [name, m] : modes)
    if (mode == name) {
      in->mode = m;
      found = true;
    }
  if (!found) {
    std::snprintf(err, errlen, "fault: unknown mode '%s'", mode.c_str());
    delete in;
    return FERRY_ERR_INVALID_ARGS;
  }
  *ctx = in;
  if (in->mode == Mode::INIT_OVERRUN) std::memset(err, 'E', errlen + 64);
  return FERRY_OK;
}

// Blocks until the test's byte arrives on its gate pipe.
void wait_for_gate(int fd) {
  char b;
  while (::read(fd, &b, 1) < 0 && errno == EINTR) {
  }
}

// A report for the test on its pipe (a few bytes: one atomic write).
void report(int fd, const void* data, size_t len) {
  while (::write(fd, data, len) < 0 && errno == EINTR) {
  }
}

// call_after_fini: what fini leaves running. Copies only: the instance is gone.
void call_after_fini(const ferry_host_v1* host, std::vector<void*> done, std::string peer,
                     int gate_fd, int done_fd) {
  wait_for_gate(gate_fd);
  for (void* x : done) host->complete(host->host_ctx, x, FERRY_OK, nullptr);
  host->inbound(host->host_ctx, peer.c_str(), 7, FERRY_OK);
  host->log(host->host_ctx, FERRY_LOG_INFO, "fault: a line logged after fini");
  uint8_t mac[32];
  const int rc[3] = {host->ctrl_send(host->host_ctx, peer.c_str(), "x", 1),
                     host->ctrl_try_send(host->host_ctx, peer.c_str(), "x", 1),
                     host->auth_sign(host->host_ctx, "c", 1, mac)};
  report(done_fd, rc, sizeof rc);
}

// chatter: host calls from a thread nobody joins, before, during and after fini.
void chatter(const ferry_host_v1* host, int gate_fd, int done_fd) {
  uint64_t out[2] = {0, 0};  // calls, refused
  uint64_t cap = UINT64_MAX;
  uint8_t mac[32];
  for (; out[1] < 100 && out[0] < cap; ++out[0]) {
    if (host->auth_sign(host->host_ctx, "c", 1, mac) == FERRY_ERR_BAD_STATE) ++out[1];
    pollfd p{gate_fd, POLLIN, 0};
    if (cap == UINT64_MAX && out[0] % 1024 == 0 && ::poll(&p, 1, 0) == 1) cap = out[0] + 5000000;
  }
  report(done_fd, out, sizeof out);
}

void f_fini(void* ctx) {
  auto* in = static_cast<Instance*>(ctx);
  for (auto& t : in->threads) t.join();
  for (void* x : in->hung)
    in->host->complete(in->host->host_ctx, x, FERRY_ERR_BAD_STATE, "fault: shut down");
  if (in->mode == Mode::CALL_AFTER_FINI && !in->again.empty())  // the instance that posted
    std::thread(call_after_fini, in->host, in->again, in->last_peer, in->gate_fd, in->done_fd)
        .detach();
  else
    for (void* x : in->again)
      in->host->complete(in->host->host_ctx, x, FERRY_ERR_TRANSPORT, "fault: a late second report");
  for (const Deferred& d : in->deferred)
    in->host->complete(in->host->host_ctx, d.xfer_ctx, FERRY_ERR_BAD_STATE,
                       "fault: shut down before a waiter reported it");
  delete in;
}

int f_conn_info(void*, void* buf, size_t* len) {
  uint64_t pid = static_cast<uint64_t>(getpid());
  std::memcpy(buf, &pid, sizeof pid);
  *len = sizeof pid;
  return FERRY_OK;
}

int f_peer_add(void*, const ferry_peer_v1* p, void** h) {
  uint64_t pid = 0;
  if (p->conn_blob_len != sizeof pid) return FERRY_ERR_INVALID_ARGS;
  std::memcpy(&pid, p->conn_blob, sizeof pid);
  *h = new Peer{p->key, pid == static_cast<uint64_t>(getpid())};
  return FERRY_OK;
}
void f_peer_remove(void*, void* h) { delete static_cast<Peer*>(h); }

int f_mem_register(void*, const ferry_mem_v1* m, void** h, void* blob, size_t* len) {
  if (m->location != FERRY_MEM_CPU) return FERRY_ERR_UNSUPPORTED;
  Blob b{static_cast<uint64_t>(getpid()), reinterpret_cast<uint64_t>(m->addr), m->size};
  std::memcpy(blob, &b, sizeof b);
  *len = sizeof b;
  *h = new Mem{static_cast<uint8_t*>(m->addr), m->size};
  return FERRY_OK;
}
void f_mem_deregister(void*, void* h) { delete static_cast<Mem*>(h); }

int f_mem_import(void*, void*, uint64_t, uint64_t size, const void* blob, size_t len, void** h) {
  Blob b;
  if (len != sizeof b) return FERRY_ERR_INVALID_ARGS;
  std::memcpy(&b, blob, sizeof b);
  if (b.size != size) return FERRY_ERR_INVALID_ARGS;
  *h = new Mem{reinterpret_cast<uint8_t*>(b.addr), b.size};
  return FERRY_OK;
}
void f_mem_release(void*, void* h) { delete static_cast<Mem*>(h); }

void copy_items(uint32_t op, const Mem* l, const Mem* r, const ferry_iov_v1* iov, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    const auto& v = iov[i];
    if (op == FERRY_OP_WRITE)
      std::memcpy(r->addr + v.remote_off, l->addr + v.local_off, v.len);
    else
      std::memcpy(l->addr + v.local_off, r->addr + v.remote_off, v.len);
  }
}

// Several pairs (ABI 1.7): each pair's items over its own regions, in order.
bool has_pairs(const ferry_xfer_v1* x) {
  return FERRY_HAS_FIELD(ferry_xfer_v1, x, pairs) && x->n_pairs > 0;
}

void copy(const ferry_xfer_v1* x) {
  if (!has_pairs(x)) {
    copy_items(x->op, static_cast<Mem*>(x->local_mem), static_cast<Mem*>(x->remote_mem), x->iov,
               x->n_iov);
    return;
  }
  uint64_t at = 0;
  for (uint32_t p = 0; p < x->n_pairs; ++p) {
    const ferry_pair_v1& pr = x->pairs[p];
    copy_items(x->op, static_cast<Mem*>(pr.local_mem), static_cast<Mem*>(pr.remote_mem),
               x->iov + at, pr.n_iov);
    at += pr.n_iov;
  }
}

// Tell the target's instance that uid landed, over the core's control channel.
void notify_target(Instance* in, const ferry_xfer_v1* x) {
  if (!(x->flags & FERRY_XFER_NOTIFY)) return;
  auto* p = static_cast<Peer*>(x->peer);
  in->host->ctrl_send(in->host->host_ctx, p->key.c_str(), &x->uid, sizeof x->uid);
}

int f_post(void* ctx, const ferry_xfer_v1* x) {
  auto* in = static_cast<Instance*>(ctx);
  int nth = in->seen.fetch_add(1);
  ((x->flags & FERRY_XFER_MORE) ? in->posts_more : in->posts_last).fetch_add(1);
  if (has_pairs(x)) {
#ifndef FAULT_MULTI_PAIR
    return FERRY_ERR_INTERNAL;  // the core must never send pairs to a plugin without the cap
#endif
    uint64_t n = 0;
    for (uint32_t p = 0; p < x->n_pairs; ++p) n += x->pairs[p].n_iov;
    if (n != x->n_iov || x->pairs[0].local_mem != x->local_mem) return FERRY_ERR_INTERNAL;
    ++in->multi_posts;
    in->multi_pairs += x->n_pairs;
  }
  void* hc = in->host->host_ctx;
  switch (in->mode) {
    case Mode::FAIL_SUBMIT:
      if (FERRY_HAS_FIELD(ferry_xfer_v1, x, reason_len) && x->reason && x->reason_len)
        std::snprintf(x->reason, x->reason_len, "fault: scripted refusal in post()");
      return FERRY_ERR_TRANSPORT;
    case Mode::REFUSE_LATE:
      wait_for_gate(in->gate_fd);
      return FERRY_ERR_TRANSPORT;
    case Mode::FAIL_COMPLETE:
      in->host->complete(hc, x->xfer_ctx, FERRY_ERR_TRANSPORT,
                         "fault: scripted completion failure");
      return FERRY_OK;
    case Mode::HANG: {
      std::lock_guard<std::mutex> lk(in->mu);
      in->hung.push_back(x->xfer_ctx);
      return FERRY_OK;
    }
    case Mode::LOSE:
      return FERRY_OK;
    case Mode::DROP: {
      std::lock_guard<std::mutex> lk(in->mu);
      void* xc = x->xfer_ctx;
      in->threads.emplace_back([in, xc] {
        in->host->complete(in->host->host_ctx, xc, FERRY_ERR_TRANSPORT,
                           "fault: connection dropped");
      });
      return FERRY_OK;
    }
    case Mode::FAIL_FIRST_N:
      if (nth < in->n) {
        in->host->complete(hc, x->xfer_ctx, FERRY_ERR_TRANSPORT, "fault: failing the first N");
        return FERRY_OK;
      }
      break;
    case Mode::NOTIFY_THEN_FAIL:
      if (static_cast<Peer*>(x->peer)->same_process) copy(x);
      notify_target(in, x);
      in->host->complete(hc, x->xfer_ctx, FERRY_ERR_TRANSPORT, "fault: failed after notifying");
      return FERRY_OK;
    case Mode::DEFERRED:
      if (!static_cast<Peer*>(x->peer)->same_process) break;  // refused below
      copy(x);
      {
        std::lock_guard<std::mutex> lk(in->mu);
        in->deferred.push_back({x->xfer_ctx, (x->flags & FERRY_XFER_NOTIFY) != 0,
                                static_cast<Peer*>(x->peer)->key, x->uid});
      }
      return FERRY_OK;
    case Mode::COMPLETE_TWICE:
      if (!static_cast<Peer*>(x->peer)->same_process) break;  // refused below
      copy(x);
      notify_target(in, x);
      in->host->complete(hc, x->xfer_ctx, FERRY_OK, nullptr);
      in->host->complete(hc, x->xfer_ctx, FERRY_ERR_TRANSPORT, "fault: a second report");
      return FERRY_OK;
    case Mode::COMPLETE_AGAIN_AT_FINI:
    case Mode::CALL_AFTER_FINI: {
      if (!static_cast<Peer*>(x->peer)->same_process) break;  // refused below
      copy(x);
      notify_target(in, x);
      in->host->complete(hc, x->xfer_ctx, FERRY_OK, nullptr);
      std::lock_guard<std::mutex> lk(in->mu);
      in->again.push_back(x->xfer_ctx);  // completed again at (or after) fini
      in->last_peer = static_cast<Peer*>(x->peer)->key;
      return FERRY_OK;
    }
    case Mode::CHATTER:
      if (nth == 0) std::thread(chatter, in->host, in->gate_fd, in->done_fd).detach();
      break;
    case Mode::OK:
    case Mode::OVERRUN:
    case Mode::INIT_OVERRUN:
      break;
  }
  if (!static_cast<Peer*>(x->peer)->same_process) {
    in->host->complete(hc, x->xfer_ctx, FERRY_ERR_UNSUPPORTED,
                       "fault: moves data only within one process");
    return FERRY_OK;
  }
  copy(x);
  notify_target(in, x);
  in->host->complete(hc, x->xfer_ctx, FERRY_OK, nullptr);
  return FERRY_OK;
}

// ABI 1.6: a waiting thread reports the deferred transfers, each once.
int f_progress(void* ctx) {
  auto* in = static_cast<Instance*>(ctx);
  ++in->progress_calls;
  std::vector<Deferred> mine;
  {
    std::lock_guard<std::mutex> lk(in->mu);
    mine.swap(in->deferred);
  }
  for (const Deferred& d : mine) {
    if (d.notify) in->host->ctrl_send(in->host->host_ctx, d.peer.c_str(), &d.uid, sizeof d.uid);
    in->host->complete(in->host->host_ctx, d.xfer_ctx, FERRY_OK, nullptr);
  }
  in->by_progress += mine.size();
  return static_cast<int>(mine.size());
}

// The whole buffer and 256 bytes past it (overrun), then a terminator.
void overrun(char* buf, size_t len) {
  std::memset(buf, 'O', len + 255);
  buf[len + 255] = '\0';
}

int f_describe(void* ctx, char* buf, size_t len) {
  auto* in = static_cast<Instance*>(ctx);
  if (in->mode == Mode::OVERRUN)
    overrun(buf, len);
  else
    std::snprintf(buf, len, "fault plugin (scripted failures)");
  return FERRY_OK;
}

int f_counters(void* ctx, char* buf, size_t len) {
  auto* in = static_cast<Instance*>(ctx);
  if (in->mode == Mode::OVERRUN) {
    overrun(buf, len);
    return FERRY_OK;
  }
  std::snprintf(buf, len,
                "{\"progress_calls\":%llu,\"by_progress\":%llu,\"posts_more\":%llu,"
                "\"posts_last\":%llu,\"multi_posts\":%llu,\"multi_pairs\":%llu}",
                static_cast<unsigned long long>(in->progress_calls.load()),
                static_cast<unsigned long long>(in->by_progress.load()),
                static_cast<unsigned long long>(in->posts_more.load()),
                static_cast<unsigned long long>(in->posts_last.load()),
                static_cast<unsigned long long>(in->multi_posts.load()),
                static_cast<unsigned long long>(in->multi_pairs.load()));
  return FERRY_OK;
}

void f_on_ctrl(void* ctx, const char* peer, const void* msg, size_t len) {
  auto* in = static_cast<Instance*>(ctx);
  uint64_t uid;
  if (len != sizeof uid) return;
  std::memcpy(&uid, msg, sizeof uid);
  in->host->inbound(in->host->host_ctx, peer, uid, FERRY_OK);
}

}  // namespace

extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = {
    .struct_size = sizeof(ferry_plugin_ops_v1),
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
#ifdef FAULT_MULTI_PAIR
    .name = "faultmp",
#else
    .name = "fault",
#endif
    .version = "0.1-test",
    // A memcpy in post(): the initiator's own copy is the whole transfer.
    .caps = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE | FERRY_CAP_SAME_HOST_ONLY |
            FERRY_CAP_INITIATOR_COPY | FERRY_CAP_POST_MORE
#ifdef FAULT_MULTI_PAIR
            | FERRY_CAP_MULTI_PAIR
#endif
    ,
    .init = f_init,
    .fini = f_fini,
    .conn_info = f_conn_info,
    .peer_add = f_peer_add,
    .peer_remove = f_peer_remove,
    .mem_register = f_mem_register,
    .mem_deregister = f_mem_deregister,
    .mem_import = f_mem_import,
    .mem_release = f_mem_release,
    .post = f_post,
    .on_ctrl = f_on_ctrl,
    .describe = f_describe,
    .fence = nullptr,  // a memcpy in post() is the whole transfer
    .counters = f_counters,
    .progress = f_progress,
};
