/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ferry/plugin.h - the stable C ABI between the ferry core and a backend plugin.
 *
 * This header is all a backend author needs. It is C99 and carries no C++ types.
 *
 * Versioning (read this before changing anything here):
 *  - A plugin exports one data symbol per ABI major it serves. For major 1 that is
 *      const ferry_plugin_ops_v1 ferry_plugin_v1;
 *    A .so may export several majors; the core uses the newest it understands.
 *  - Every struct starts with uint32_t struct_size. Fields are only ever appended;
 *    a reader uses a field only when struct_size covers it (FERRY_HAS_FIELD), and
 *    calls an optional function only when it is covered and non-NULL.
 *  - The plugin states the ABI minor it was built against in abi_minor. A minor
 *    bump only appends fields; the core never requires a field newer than the
 *    plugin's minor.
 *  - Nothing throws across this boundary. Errors are negative FERRY_ERR_* codes
 *    with fixed meanings. FERRY_OK is 0.
 *
 * History: 1.0 the ops table and host services; 1.1 auth_sign / auth_verify and
 * the GPU runtime shim; 1.2 fencing (fence(), attempt_id, FERRY_ERR_NOT_SENT,
 * the FENCE / INITIATOR_COPY / NO_TARGET_CHECK capabilities); 1.3 a refusal
 * reason from post() (ferry_xfer_v1.reason); 1.4 access by descriptor
 * (link_prove / link_check: per-instance secrets on a plugin's own connections);
 * 1.5 counters() (a live instance's counters in Engine::stats() and `ferry
 * stats`), describe() called on live instances too, the unload rule stated;
 * 1.6 progress() (completions driven by a thread that waits for a transfer);
 * later in 1.6, with no struct change: FERRY_CAP_POST_MORE / FERRY_XFER_MORE
 * (the parts of one multi-region call may start as one), set by the core only
 * for a plugin that claims the capability, so neither side needs the other new.
 * 1.7 transfers over several region pairs in one post (FERRY_CAP_MULTI_PAIR,
 * ferry_xfer_v1.n_pairs / pairs), sent only to plugins that claim it; later in
 * 1.7, with no struct change: FERRY_CAP_FENCE_SELECTIVE (a cancel fences only
 * on a plugin that claims it). 1.8 a plugin's own notification in its
 * transfer's order (ctrl_try_send, interprocess events in the GPU shim,
 * NATIVE_NOTIFY_READ, FERRY_OK_NOTIFY_BY_CORE); 1.9 copy_segments_async in the
 * GPU shim (a batch's copy table written from the pieces by the runtime);
 * 1.10 host_register / host_unregister in the GPU shim (pinning memory the
 * plugin mapped itself).
 * A plugin built against any 1.x header keeps loading and working: CI builds the
 * plugin template against tests/plugins/abi-1.1 (a frozen copy of the 1.1 header)
 * and runs ferry-plugin-check on it (ctest plugin_check_abi11).
 *
 * Loading and unloading: each engine that uses a plugin dlopens it (RTLD_NOW |
 * RTLD_LOCAL) and dlcloses it after its instance's fini() returned; the .so is
 * unmapped when no engine of the process holds it any more, and a process that
 * creates and destroys engines may load it again. fini() must leave nothing behind that
 * runs code of the .so: join every thread, cancel every timer. A plugin that
 * cannot (a library it uses keeps threads or atexit handlers of its own, as some
 * libfabric providers do) links with -Wl,-z,nodelete, so dlclose leaves it mapped.
 *
 * Ownership is written next to every pointer: "borrowed" means valid only for the
 * duration of the call; "core-owned" / "plugin-owned" says who frees.
 *
 * Threads: the core may call any function from any thread, concurrently, except
 * init/fini (never concurrent with anything). A plugin calls the host services
 * from any thread, including its own progress threads, and may do so before the
 * function that triggered them returns. The core never holds a lock of its own
 * while calling into a plugin that could call back into the core, and never
 * calls fini(), peer_remove() or mem_deregister() from inside a host callback
 * (complete, inbound), so a plugin may join its own threads there.
 */
#ifndef FERRY_PLUGIN_H
#define FERRY_PLUGIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FERRY_PLUGIN_ABI_MAJOR 1
#define FERRY_PLUGIN_ABI_MINOR 10

/* Name of the entry symbol for ABI major 1 (for dlsym). */
#define FERRY_PLUGIN_SYMBOL_V1 "ferry_plugin_v1"

/* True when a struct of the given struct_size contains `field` entirely. */
#define FERRY_HAS_FIELD(type, ptr, field) \
  ((ptr) != NULL && (size_t)(ptr)->struct_size >= offsetof(type, field) + sizeof(((type*)0)->field))

/* ---- result codes: fixed meanings, never renumbered ---------------------- */
#define FERRY_OK 0
#define FERRY_ERR_INVALID_ARGS (-1) /* bad argument from the caller            */
#define FERRY_ERR_NOT_FOUND (-2)    /* unknown peer, memory or handle          */
#define FERRY_ERR_BAD_STATE (-3)    /* not initialised, shutting down, ...     */
#define FERRY_ERR_NO_MEMORY (-4)    /* allocation failed                       */
#define FERRY_ERR_UNSUPPORTED (-5)  /* this plugin cannot do that (e.g. GPU)   */
#define FERRY_ERR_TRANSPORT (-6)    /* connection refused/reset, link failure  */
#define FERRY_ERR_TIMEOUT (-7)      /* the transfer's deadline passed          */
#define FERRY_ERR_REMOTE (-8)       /* the target refused the request          */
#define FERRY_ERR_GPU (-9)          /* a GPU runtime call failed               */
#define FERRY_ERR_NO_DEVICE (-10)   /* the hardware this plugin needs is absent */
#define FERRY_ERR_PROTOCOL (-11)    /* malformed or unexpected frame from peer */
#define FERRY_ERR_INTERNAL (-12)    /* a bug; the message says where           */
/* ABI 1.2: the transfer failed before any of it left this engine (connect
 * refused, no lane could be opened): the target can apply none of it, so the
 * core fails over at once without fencing the target. Report it only when that
 * is certain; TRANSPORT / TIMEOUT otherwise. */
#define FERRY_ERR_NOT_SENT (-13)

/* ABI 1.8 - a status for complete() only, never returned: the transfer landed
 * (as FERRY_OK) but this plugin, though it has NATIVE_NOTIFY, did not tell the
 * target of it - the core does, as for a plugin without the cap (xgmi when no
 * interprocess event was free, or the control connection was busy at post).
 * Only to a core whose ferry_host_v1 covers ctrl_try_send (1.8): an older one
 * reads it as a failure. */
#define FERRY_OK_NOTIFY_BY_CORE 1

/* ---- capability flags (ferry_plugin_ops_v1.caps) ------------------------- */
#define FERRY_CAP_MEM_CPU (1ull << 0)         /* moves host memory               */
#define FERRY_CAP_MEM_GPU (1ull << 1)         /* moves GPU memory                */
#define FERRY_CAP_OP_READ (1ull << 2)         /* one-sided READ                  */
#define FERRY_CAP_OP_WRITE (1ull << 3)        /* one-sided WRITE                 */
#define FERRY_CAP_NATIVE_NOTIFY (1ull << 4)   /* tells the target itself (inbound) */
#define FERRY_CAP_SAME_HOST_ONLY (1ull << 5)  /* peers with the same node id only */
#define FERRY_CAP_TARGET_PROGRESS (1ull << 6) /* target needs a progress thread  */
/* ABI 1.2 - what the core does after a WRITE attempt whose outcome is unknown
 * (TIMEOUT, TRANSPORT, ... after bytes may have left) depends on these:
 *  FENCE: the plugin implements fence() on the target side; the core asks the
 *    target (over the control plane) to fence the attempt and follows its answer.
 *  INITIATOR_COPY: the initiator's own copy is the whole transfer (process_vm_*,
 *    GPU peer copies): when complete() is called no byte of it can land any more,
 *    so a failure is final without asking the target. The same holds for an
 *    error returned by post(): return one only while nothing was started; a
 *    copy call that fails after others were queued is reported through
 *    complete() once they have ended.
 *  Neither: the outcome cannot be settled. The transfer ends
 *    ferry::StatusCode::ERR_OUTCOME_UNKNOWN and the
 *    peer stays fenced - no transfer to it on any backend - until the application
 *    registers a new instance of it.
 * NO_TARGET_CHECK: the target side cannot check a request against its own
 *    registrations (bounds, deregistration, memory kind): it trusts the
 *    initiator's descriptor. The core routes to such a backend only where a
 *    policy rule names it and sets trust_descriptors: true. */
#define FERRY_CAP_FENCE (1ull << 7)
#define FERRY_CAP_INITIATOR_COPY (1ull << 8)
#define FERRY_CAP_NO_TARGET_CHECK (1ull << 9)
/* POST_MORE: the plugin understands FERRY_XFER_MORE (below). */
#define FERRY_CAP_POST_MORE (1ull << 10)
/* ABI 1.7 - MULTI_PAIR: post() takes one transfer over several region pairs of
 * one peer (ferry_xfer_v1.n_pairs > 0): one attempt, one completion, one fence
 * by its attempt_id for all of them. The core sends such a transfer only to a
 * plugin that claims this; a multi-region call whose route reaches a backend
 * without it runs there as one transfer per pair. */
#define FERRY_CAP_MULTI_PAIR (1ull << 11)
/* FENCE_SELECTIVE (with FENCE): fence() stops only the attempts it names - the
 * initiator's other transfers in flight to this target, on the same lanes or
 * QPs, go on and land. TransferStatus::Cancel() of a WRITE in flight fences its
 * attempt only on such a plugin; on another (rdma's fence retires every QP of
 * the initiator) the cancel waits for the plugin's completion instead, so one
 * cancel does not fail everything else in flight to that target. A plugin
 * that does not know the bit leaves it clear: its cancels wait, as before the
 * bit its fences also failed its other transfers. */
#define FERRY_CAP_FENCE_SELECTIVE (1ull << 12)
/* ABI 1.8 - NATIVE_NOTIFY_READ (with NATIVE_NOTIFY): the plugin's own
 * notification covers READ too - the target learns once the bytes read from it
 * are in the initiator's memory (xgmi: an interprocess event recorded after the
 * copy). Without it the core sends a READ's NOTIFY itself, after complete(). */
#define FERRY_CAP_NATIVE_NOTIFY_READ (1ull << 13)

/* ---- enums ---------------------------------------------------------------- */
#define FERRY_OP_READ 1u  /* remote -> local */
#define FERRY_OP_WRITE 2u /* local -> remote */

#define FERRY_MEM_CPU 1u
#define FERRY_MEM_GPU 2u

#define FERRY_LOG_ERROR 0
#define FERRY_LOG_WARN 1
#define FERRY_LOG_INFO 2
#define FERRY_LOG_DEBUG 3

/* Transfer flags (ferry_xfer_v1.flags) */
#define FERRY_XFER_NOTIFY (1u << 0) /* the target must learn of this transfer */
/* Set only for plugins with FERRY_CAP_POST_MORE, on every part of one
 * multi-region call but the last (each part is its own post and completes on
 * its own): more posts follow at once, so the plugin may hold this one's work
 * and start it together with them (one GPU launch for every part) when a post
 * without the flag comes. The last part may never reach the plugin (routed
 * elsewhere, refused): a plugin that holds work must start it on its own
 * within a short bound of the last post. Ignoring the flag is always correct. */
#define FERRY_XFER_MORE (1u << 1)

/* Largest opaque blob (connection info, memory info) a plugin may produce. */
#define FERRY_MAX_BLOB 4096u

/* ---- the GPU runtime shim (ABI 1.1) ---------------------------------------
 * The core dlopens the GPU runtime (libcudart or libamdhip64) at run time and
 * offers the few calls backends need through this table, so a plugin needs no
 * GPU SDK and one plugin serves both vendors. Every function returns FERRY_OK
 * or FERRY_ERR_GPU (last_error() then says why). Streams and events are opaque.
 * Device pointers and host pointers share one address space (unified
 * addressing), so memcpy_* take no direction. */
#define FERRY_GPU_NONE 0u
#define FERRY_GPU_CUDA 1u
#define FERRY_GPU_HIP 2u

/* ABI 1.9: one region pair's pieces for ferry_gpu_v1.copy_segments_async:
 * piece i copies iov[i].len bytes between local_base + iov[i].local_off and
 * remote_base + iov[i].remote_off. (ferry_iov_v1 is below.) */
struct ferry_iov_v1;
typedef struct ferry_gpu_seg_v1 {
  char* local_base;
  uint64_t local_size; /* bytes at local_base the pieces must stay inside  */
  char* remote_base;
  uint64_t remote_size;           /* bytes at remote_base the pieces must stay inside */
  const struct ferry_iov_v1* iov; /* n_iov pieces, borrowed for the call    */
  uint64_t n_iov;
} ferry_gpu_seg_v1;

typedef struct ferry_gpu_v1 {
  uint32_t struct_size;
  uint32_t vendor; /* FERRY_GPU_CUDA or FERRY_GPU_HIP */
  void* gpu_ctx;   /* core-owned; first argument of every call below */
  int device_count;
  int reserved;

  /* *device = the device that owns ptr, or -1 for host memory. */
  int (*pointer_device)(void* gpu_ctx, const void* ptr, int32_t* device);
  /* The allocation that contains ptr: its base and size (for IPC export). */
  int (*mem_range)(void* gpu_ctx, const void* ptr, void** base, size_t* size);
  int (*set_device)(void* gpu_ctx, int32_t device);
  int (*stream_create)(void* gpu_ctx, void** stream);
  int (*stream_destroy)(void* gpu_ctx, void* stream);
  int (*stream_sync)(void* gpu_ctx, void* stream);
  int (*memcpy_async)(void* gpu_ctx, void* dst, const void* src, size_t n, void* stream);
  int (*event_create)(void* gpu_ctx, void** event);
  int (*event_destroy)(void* gpu_ctx, void* event);
  int (*event_record)(void* gpu_ctx, void* event, void* stream);
  /* FERRY_OK when the work before the event is done, 1 when not yet. */
  int (*event_query)(void* gpu_ctx, void* event);
  int (*event_sync)(void* gpu_ctx, void* event);
  /* IPC: export the allocation at base_ptr (64-byte handle), open it in another
   * process on `device`, close what was opened. */
  int (*ipc_get_handle)(void* gpu_ctx, const void* base_ptr, uint8_t handle[64]);
  int (*ipc_open)(void* gpu_ctx, const uint8_t handle[64], int32_t device, void** ptr);
  int (*ipc_close)(void* gpu_ctx, void* ptr);
  int (*enable_peer_access)(void* gpu_ctx, int32_t device, int32_t peer_device);
  /* Pinned host memory for staging. */
  int (*host_alloc)(void* gpu_ctx, void** ptr, size_t n);
  int (*host_free)(void* gpu_ctx, void* ptr);
  /* Why the last call on this thread failed; static string. */
  const char* (*last_error)(void* gpu_ctx);
  /* Many copies in one call (one launch where the runtime can: CUDA >= 12.8);
   * FERRY_ERR_UNSUPPORTED when the runtime has no batched copy. */
  int (*memcpy_batch_async)(void* gpu_ctx, void* const* dsts, const void* const* srcs,
                            const size_t* sizes, size_t count, void* stream);
  /* "0000:1b:00.0" style PCI bus id of a device. */
  int (*device_bus_id)(void* gpu_ctx, int32_t device, char* buf, size_t len);
  /* ABI 1.6: FERRY_OK when all work queued on the stream is done, 1 when not
   * yet: a copy alone on its stream is waited for without recording an event. */
  int (*stream_query)(void* gpu_ctx, void* stream);
  /* ---- ABI 1.8: events another process waits for ---- */
  /* An interprocess event (no timing); destroy it with event_destroy. */
  int (*event_create_ipc)(void* gpu_ctx, void** event);
  /* The 64-byte handle another process opens it by. */
  int (*ipc_event_handle)(void* gpu_ctx, void* event, uint8_t handle[64]);
  /* Opens another process's event (not one of this process: that fails);
   * event_query / event_sync answer for its latest record in the exporting
   * process. Destroy it with event_destroy. */
  int (*ipc_event_open)(void* gpu_ctx, const uint8_t handle[64], void** event);
  /* ---- ABI 1.9: a batch straight from the transfer's pieces ---- */
  /* The pieces of n_segs segments as one batch on `stream`, to the remote
   * side for FERRY_OP_WRITE, from it for FERRY_OP_READ; a piece contiguous on
   * both sides with the one before it is copied with it. The runtime writes
   * its copy table from the pieces itself (memcpy_batch_async needs the
   * caller's pointer arrays first: one more pass over them). Every piece is
   * checked first: FERRY_ERR_INVALID_ARGS, nothing queued, when one is empty
   * or outside its segment's sizes. FERRY_ERR_UNSUPPORTED, nothing queued,
   * where the runtime cannot or memcpy_batch_async serves the batch better
   * (no gather kernel; a piece, or contiguous pieces, of 1 MiB or more: plain
   * copies; a batch that is one copy): use memcpy_batch_async - the pieces
   * may not all have been checked then, so the caller checks them itself
   * before it copies them another way. FERRY_OK with
   * nothing queued for no pieces. FERRY_ERR_GPU when queueing failed (copies
   * queued before may still run). */
  int (*copy_segments_async)(void* gpu_ctx, uint32_t op, const ferry_gpu_seg_v1* segs,
                             size_t n_segs, void* stream);
  /* ---- ABI 1.10: pinning host memory the caller already has ---- */
  /* Page-locks [ptr, ptr + n) for every device (cudaHostRegister /
   * hipHostRegister, portable), so device copies into and out of it run
   * asynchronously, by DMA (tcp stages GPU frames straight through its
   * same-host rings' shared memory this way). Unpin with host_unregister before
   * the memory is unmapped. NULL in a runtime that cannot. */
  int (*host_register)(void* gpu_ctx, void* ptr, size_t n);
  int (*host_unregister)(void* gpu_ctx, void* ptr);
} ferry_gpu_v1;

/* ---- services the core offers to a plugin --------------------------------- */
typedef struct ferry_host_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  void* host_ctx; /* core-owned; pass back as the first argument below */

  /* Log a line; msg borrowed. */
  void (*log)(void* host_ctx, int level, const char* msg);

  /* Monotonic clock in nanoseconds; the same clock as ferry_xfer_v1.deadline_ns. */
  uint64_t (*now_ns)(void* host_ctx);

  /* Send an opaque message to the plugin of the same name in the peer engine's
   * process, over the core's control connection. msg borrowed. Delivered in order
   * per (peer, plugin), at most once; the peer receives it in on_ctrl. Returns
   * FERRY_OK when queued, FERRY_ERR_NOT_FOUND for an unknown peer,
   * FERRY_ERR_TRANSPORT when the peer cannot be reached, FERRY_ERR_TIMEOUT when
   * it took nothing for 5 s (it stopped reading). */
  int (*ctrl_send)(void* host_ctx, const char* peer_key, const void* msg, size_t len);

  /* Report the end of a transfer accepted by post(): exactly once per accepted
   * transfer, from any thread. status is FERRY_OK or a FERRY_ERR_* code; message
   * borrowed, may be NULL, says what went wrong in words a user can act on. */
  void (*complete)(void* host_ctx, void* xfer_ctx, int status, const char* message);

  /* Target side, plugins with FERRY_CAP_NATIVE_NOTIFY: a transfer flagged
   * FERRY_XFER_NOTIFY from `peer_key` (borrowed) with `uid` has landed (or failed,
   * status < 0). The core records only landings (a failed attempt may be retried
   * on another backend, whose landing still counts) and de-duplicates them, so a
   * repeat is harmless. */
  void (*inbound)(void* host_ctx, const char* peer_key, uint64_t uid, int status);

  /* ---- ABI 1.1 ---- */

  /* The GPU runtime shim; NULL when no GPU runtime could be loaded. */
  const ferry_gpu_v1* gpu;

  /* Prove knowledge of the engine's shared secret without seeing it: writes
   * HMAC-SHA256(secret, challenge) into mac. FERRY_ERR_UNSUPPORTED when no
   * secret is configured (then connections are not authenticated). A plugin
   * that opens its own connections uses it for a challenge/response handshake
   * and compares with auth_verify. */
  int (*auth_sign)(void* host_ctx, const void* challenge, size_t len, uint8_t mac[32]);
  /* FERRY_OK when mac is HMAC-SHA256(secret, challenge) (constant-time compare),
   * FERRY_ERR_REMOTE when it is not, FERRY_ERR_UNSUPPORTED without a secret. */
  int (*auth_verify)(void* host_ctx, const void* challenge, size_t len, const uint8_t mac[32]);

  /* ---- ABI 1.4: access by descriptor ---- */
  /* Every engine instance has a random secret that travels only inside its
   * EngineDesc. A connection between two engines must prove knowledge of the
   * target's secret, and of the initiator's own when the target registered the
   * initiator's descriptor (nobody may claim the key of a known peer). A plugin
   * that opens its own connections has each side prove itself over a transcript
   * that binds the proof to that connection (both sides' fresh random nonces,
   * both engine keys, a direction label); the secrets stay in the core. The
   * cluster token (auth_sign) is mixed in by the core: a plugin using these
   * needs no auth_sign.
   *
   * link_prove: writes this engine's proof, in `role` (FERRY_LINK_*) on a link
   * with the engine `peer_key` (borrowed), into proof (FERRY_LINK_PROOF_SIZE
   * bytes). FERRY_ERR_NOT_FOUND when this engine is the initiator and peer_key
   * is not registered here (its secret is unknown).
   * link_check: FERRY_OK when `proof` is what the peer must send to this engine
   * in `role` (our role; the peer has the other). FERRY_ERR_REMOTE when it is
   * not; then why (core-owned, why_len bytes, may be NULL/0) says in words
   * (a stale descriptor, a claimed key, a different token). */
  int (*link_prove)(void* host_ctx, const char* peer_key, uint32_t role, const void* transcript,
                    size_t len, uint8_t* proof);
  int (*link_check)(void* host_ctx, const char* peer_key, uint32_t role, const void* transcript,
                    size_t len, const uint8_t* proof, char* why, size_t why_len);

  /* ---- ABI 1.8 ---- */
  /* ctrl_send that never waits, for a plugin's post(): FERRY_OK when the
   * message left at once, FERRY_ERR_NOT_SENT (nothing sent) when it could not
   * without waiting - no connection to the peer yet, another thread sending on
   * it, a full socket - or is too large; FERRY_ERR_TRANSPORT when the
   * connection broke while sending (what the peer got is unknown). */
  int (*ctrl_try_send)(void* host_ctx, const char* peer_key, const void* msg, size_t len);
} ferry_host_v1;

/* Roles and size for link_prove / link_check (ABI 1.4). */
#define FERRY_LINK_INITIATOR 1u /* this engine opened the connection  */
#define FERRY_LINK_TARGET 2u    /* this engine accepted it            */
#define FERRY_LINK_PROOF_SIZE 64u

/* ---- what the core tells a plugin ---------------------------------------- */

/* A remote engine the application registered. All pointers borrowed. */
typedef struct ferry_peer_v1 {
  uint32_t struct_size;
  uint32_t reserved;
  const char* key;     /* engine key, unique among the application's engines */
  const char* host;    /* host the peer's engine listens on                  */
  const char* node_id; /* same string = same host                            */
  uint16_t ctrl_port;  /* the peer engine's control port                     */
  uint16_t reserved2;
  uint32_t same_host;    /* 1 when node_id equals ours                        */
  const void* conn_blob; /* what the peer's plugin returned from conn_info()  */
  size_t conn_blob_len;  /* 0 when the peer did not load this plugin          */
} ferry_peer_v1;

/* A local memory region being registered. Pointers borrowed. */
typedef struct ferry_mem_v1 {
  uint32_t struct_size;
  uint32_t location; /* FERRY_MEM_CPU or FERRY_MEM_GPU */
  uint64_t id;       /* the core's id for this region; unique in this engine */
  void* addr;
  uint64_t size;
  int32_t device; /* GPU ordinal, -1 for CPU */
  uint32_t reserved;
} ferry_mem_v1;

/* One piece of a transfer: `len` bytes at local_off in the local region and at
 * remote_off in the remote region. The core has checked both ranges against the
 * region sizes it knows, and never passes len == 0. */
typedef struct ferry_iov_v1 {
  uint64_t local_off;
  uint64_t remote_off;
  uint64_t len;
} ferry_iov_v1;

/* ABI 1.7: one region pair of a multi-pair transfer (ferry_xfer_v1.pairs):
 * the next n_iov items of ferry_xfer_v1.iov are over these regions. */
typedef struct ferry_pair_v1 {
  void* local_mem;  /* plugin-owned handle from mem_register() */
  void* remote_mem; /* plugin-owned handle from mem_import()   */
  uint64_t n_iov;   /* >= 1                                     */
} ferry_pair_v1;

/* One transfer (single or batch). All pointers borrowed for the duration of
 * post(); a plugin that needs them later copies them. */
typedef struct ferry_xfer_v1 {
  uint32_t struct_size;
  uint32_t op;    /* FERRY_OP_READ or FERRY_OP_WRITE */
  uint32_t flags; /* FERRY_XFER_* */
  uint32_t n_iov;
  void* peer;              /* plugin-owned handle from peer_add()      */
  void* local_mem;         /* plugin-owned handle from mem_register()  */
  void* remote_mem;        /* plugin-owned handle from mem_import()    */
  const ferry_iov_v1* iov; /* n_iov entries, n_iov >= 1                */
  uint64_t uid;            /* the application's transfer uid (notification key) */
  uint64_t deadline_ns;    /* now_ns() value by which the transfer must end; the core
                            * always sets one (0 would mean "none") */
  void* xfer_ctx;          /* core-owned; hand back to host->complete()  */
  uint64_t total_bytes;    /* sum of iov[i].len                          */
  /* ---- ABI 1.2 ---- */
  /* Unique per attempt in the initiating engine, never 0, and growing: each
   * attempt's is above the last, also across the engine's restarts under its
   * key (ids start at the wall clock in ns). A FENCE plugin carries it to the
   * target, where fence() names attempts by it; a target may refuse a frame of
   * an id at or below one whose record it has forgotten. */
  uint64_t attempt_id;
  /* ---- ABI 1.3 ---- */
  /* Core-owned buffer of reason_len bytes (NUL-terminated, empty on entry).
   * When post() refuses (returns non-OK) it may write why there, truncated;
   * the core puts it in the transfer's message. Unused on FERRY_OK. */
  char* reason;
  size_t reason_len;
  /* ---- ABI 1.7 ---- */
  /* 0: one region pair (local_mem, remote_mem) for every item. Else (only for
   * plugins with FERRY_CAP_MULTI_PAIR, only when struct_size covers `pairs`):
   * n_pairs >= 2 region pairs of this one peer, in the order of iov - the first
   * pairs[0].n_iov items are over pairs[0]'s regions, the next pairs[1].n_iov
   * over pairs[1]'s, ...; the counts sum to n_iov. local_mem / remote_mem are
   * pairs[0]'s. The core has checked every item against its own pair's
   * regions; the target still checks what it serves. All or nothing as
   * always: post() refuses the whole, or accepts it and completes it once. */
  uint32_t n_pairs;
  uint32_t reserved2;
  const ferry_pair_v1* pairs; /* n_pairs entries; borrowed, NULL when n_pairs is 0 */
} ferry_xfer_v1;

/* ---- fencing (ABI 1.2) -----------------------------------------------------
 * Per fenced attempt, what the target's plugin found. */
#define FERRY_FENCE_NONE 0u    /* no byte of it landed, and none will          */
#define FERRY_FENCE_PARTIAL 1u /* some bytes landed; no more will              */
#define FERRY_FENCE_WHOLE                                \
  2u /* every byte landed (and the target was told, when \
      * it was a notify transfer)                    */
/* The plugin cannot tell (it no longer remembers the attempt); no more of it
 * will land. The core answers "unknown" for it (any state above WHOLE is
 * read so, also by cores older than this define). */
#define FERRY_FENCE_UNKNOWN 3u
typedef struct ferry_fence_result_v1 {
  uint64_t landed_bytes;
  uint32_t state; /* FERRY_FENCE_* */
  uint32_t reserved;
} ferry_fence_result_v1;

/* ---- the plugin's operations (exported as `ferry_plugin_v1`) ------------- */
typedef struct ferry_plugin_ops_v1 {
  uint32_t struct_size; /* sizeof(ferry_plugin_ops_v1) as the plugin was built */
  uint32_t abi_minor;   /* FERRY_PLUGIN_ABI_MINOR the plugin was built against */
  const char* name;     /* "tcp": must match libferry-<name>.so; static string */
  const char* version;  /* plugin's own version; static string                 */
  uint64_t caps;        /* FERRY_CAP_* this plugin can ever offer              */

  /* Create a plugin instance for one engine. `host` stays valid until fini().
   * `settings_json` (borrowed, never NULL, "{}" when empty) is the policy's
   * settings for this backend. `engine_key`/`node_id` borrowed. On success *ctx
   * is plugin-owned until fini(). On failure write a reason into err (errlen
   * bytes, NUL-terminated) and return < 0. */
  int (*init)(const ferry_host_v1* host, const char* engine_key, const char* node_id,
              const char* settings_json, void** ctx, char* err, size_t errlen);

  /* Destroy the instance: every accepted transfer has been completed (the
   * plugin fails what is still pending with FERRY_ERR_BAD_STATE first). */
  void (*fini)(void* ctx);

  /* Connection info that travels in the engine descriptor to peers. The core
   * provides buf with *len bytes of room (FERRY_MAX_BLOB); set *len. */
  int (*conn_info)(void* ctx, void* buf, size_t* len);

  /* A remote engine was registered. *peer_handle is plugin-owned until
   * peer_remove(). Returning < 0 means this backend cannot reach the peer. */
  int (*peer_add)(void* ctx, const ferry_peer_v1* peer, void** peer_handle);

  /* The peer was deregistered. Transfers to it are failed and completed before
   * this returns. The core releases the peer's imported memory (mem_release)
   * after this call. */
  void (*peer_remove)(void* ctx, void* peer_handle);

  /* Register local memory. *mem_handle plugin-owned until mem_deregister().
   * blob/len as in conn_info: per-memory info for the memory descriptor.
   * FERRY_ERR_UNSUPPORTED when this plugin cannot move that kind of memory. */
  int (*mem_register)(void* ctx, const ferry_mem_v1* mem, void** mem_handle, void* blob,
                      size_t* blob_len);

  /* Revoke access to local memory at once: after this returns, no peer request
   * reads or writes it, also requests that were already queued. The core calls
   * this only when no transfer it posted with this region as local memory is
   * still in flight. */
  void (*mem_deregister)(void* ctx, void* mem_handle);

  /* Import a remote memory descriptor's blob (borrowed) for use in transfers to
   * `peer_handle`. remote_id/size are the core's view of that region.
   * *remote_handle is plugin-owned until mem_release(). */
  int (*mem_import)(void* ctx, void* peer_handle, uint64_t remote_id, uint64_t remote_size,
                    const void* blob, size_t blob_len, void** remote_handle);
  void (*mem_release)(void* ctx, void* remote_handle);

  /* Start a transfer. All or nothing: FERRY_OK means accepted, and
   * host->complete() will be called exactly once for it (possibly before post
   * returns); < 0 means nothing was started and complete() is never called. */
  int (*post)(void* ctx, const ferry_xfer_v1* xfer);

  /* A message a peer's instance of this plugin sent with ctrl_send. msg borrowed. */
  void (*on_ctrl)(void* ctx, const char* peer_key, const void* msg, size_t len);

  /* Optional (may be NULL): a human-readable line for `ferry info` (devices,
   * providers, settings in force). Write into buf (len bytes, NUL-terminated).
   * Since 1.5 the core also calls it on the live instances of an engine
   * (Engine::stats(), the stats socket): any thread, must not block. */
  int (*describe)(void* ctx, char* buf, size_t len);

  /* ---- ABI 1.2 ---- */

  /* Target side, plugins with FERRY_CAP_FENCE (NULL otherwise). The initiator
   * `peer_key` (borrowed) gave up on the n attempts in attempt_ids (borrowed):
   * from now on no byte of them may be applied to local memory, by any lane,
   * QP or worker, also bytes already received and queued. Return once every
   * path that could still apply them has passed its fence check, writing into
   * results[i] (core-owned, n entries) what had landed. A attempt this plugin
   * never saw is FERRY_FENCE_NONE (and stays fenced if its bytes come later).
   * FERRY_OK, or FERRY_ERR_TIMEOUT when that could not be established by
   * deadline_ns (the core answers "unknown"). Never called from a host callback. */
  int (*fence)(void* ctx, const char* peer_key, const uint64_t* attempt_ids, size_t n,
               uint64_t deadline_ns, ferry_fence_result_v1* results);

  /* ---- ABI 1.5 ---- */

  /* Optional (may be NULL): this live instance's counters, shown per backend by
   * Engine::stats(), the stats socket and `ferry stats`. Write a JSON object
   * whose keys are 1..32 characters of [a-z0-9_] and whose values are
   * non-negative integers, e.g. {"lanes_open":4,"rejected_lanes":0}, into buf
   * (len bytes, NUL-terminated; the core offers 4096), return FERRY_OK. The core
   * keeps at most 32 keys and ignores entries that do not follow these rules.
   * Any thread, often (each stats sample): cheap, never blocking. */
  int (*counters)(void* ctx, char* buf, size_t len);

  /* ---- ABI 1.6 ---- */

  /* Optional (may be NULL): report, on the calling thread, transfers whose work
   * has finished (host->complete for each, in the order the plugin would have
   * reported them anyway) and return how many (>= 0). The core calls it from a
   * thread that polls for one of this instance's transfers to end (Wait()), so a
   * short transfer ends without the hand-off to the plugin's own progress
   * thread and the wake-up back (issue 19: ~3-5 us of a 64 KiB GPU copy's
   * ~18). A plugin that reports completions from its own thread keeps doing so:
   * whichever thread sees a transfer finish first reports it, exactly once.
   * Any thread, concurrently with everything but init/fini; never from a host
   * callback; must not block (try a lock, do not wait for one held long) and
   * must be cheap when nothing has finished: it is called in a polling loop. */
  int (*progress)(void* ctx);
} ferry_plugin_ops_v1;

/* A plugin defines this (with visibility default) in exactly one file:
 *   FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = { ... }; */
#if defined(__GNUC__)
#define FERRY_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define FERRY_PLUGIN_EXPORT
#endif

#ifdef __cplusplus
}
#endif

#endif /* FERRY_PLUGIN_H */
