// SPDX-License-Identifier: Apache-2.0
// ferry.hpp - the C++ API: engines, descriptors, transfers, sessions.
//
// The model is MORI-IO's: an Engine per process, backends loaded as plugins,
// engine and memory descriptors exchanged out of band by the application,
// one-sided READ/WRITE (single or batched, or through a Session), and a
// TransferStatus per transfer. Errors found before anything moves (unknown
// memory, out-of-range offsets, no backend) end the returned status at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace ferry {

// Codes as MORI-IO's, plus ERR_TIMEOUT and ERR_TRANSPORT.
enum class StatusCode : int {
  SUCCESS = 0,
  INIT = 1,
  IN_PROGRESS = 2,
  ERR_INVALID_ARGS = 11,
  ERR_NOT_FOUND = 12,
  ERR_RDMA_OP = 13,
  ERR_BAD_STATE = 14,
  ERR_GPU_OP = 15,
  ERR_TIMEOUT = 16,
  ERR_TRANSPORT = 17,
  // The transfer may or may not have landed, wholly or in part, and ferry could
  // not find out by the deadline (the target did not answer the fence). Its
  // bytes may still land later; the peer is fenced until it answers (see
  // docs/policy.md, "Fencing").
  ERR_OUTCOME_UNKNOWN = 18,
  // Ended by TransferStatus::Cancel(): nothing more of it can land; what had
  // landed before stays (the message says how much, when the target told).
  ERR_CANCELLED = 19,
};
const char* to_string(StatusCode c);

enum class MemoryLocation : uint8_t { UNKNOWN = 0, CPU = 1, GPU = 2 };
const char* to_string(MemoryLocation l);

enum class Op : uint8_t { READ = 1, WRITE = 2 };

// Thrown by constructors and by calls that configure (never by transfers).
class Error : public std::runtime_error {
 public:
  Error(StatusCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  StatusCode code() const { return code_; }

 private:
  StatusCode code_;
};

// The outcome of a call that does not move data.
struct Result {
  StatusCode code = StatusCode::SUCCESS;
  std::string message;
  bool ok() const { return code == StatusCode::SUCCESS; }
  explicit operator bool() const { return ok(); }
};

// ---- descriptors -------------------------------------------------------------

// Everything a peer needs to reach this engine; produced by Engine::desc().
struct EngineDesc {
  std::string key;
  std::string host;
  uint16_t port = 0;
  std::string node_id;
  uint32_t pid = 0;
  // Random per engine object: a restarted engine with the same key has another,
  // so descriptors of its previous life are told apart. 0 = unknown (older peer).
  uint64_t instance = 0;
  // The instance's access secret (32 random bytes): whoever holds this
  // descriptor may connect to the engine, nobody else (docs/security.md). Hand
  // descriptors only to the engines that should reach this one; to_json() does
  // not print it.
  std::vector<uint8_t> secret;
  std::map<std::string, std::vector<uint8_t>> backends;  // plugin name -> conn blob
  // The abstract unix socket the control plane also listens on (engines with
  // this node_id connect there first); empty: none, or an older ferry.
  std::string control_unix;

  std::vector<uint8_t> pack() const;
  // Throws ferry::Error(ERR_INVALID_ARGS) on a truncated, oversized or forged blob.
  static EngineDesc unpack(const std::vector<uint8_t>& bytes);
  std::string to_json() const;
  bool operator==(const EngineDesc&) const = default;
};

// A registered memory region; produced by Engine::register_memory().
struct MemoryDesc {
  std::string engine_key;
  uint64_t engine_instance = 0;  // EngineDesc::instance of the engine that registered it
  uint64_t id = 0;               // random, never 0: ids cannot be guessed from others
  MemoryLocation location = MemoryLocation::UNKNOWN;
  int32_t device = -1;
  std::string bus_id;
  uint64_t addr = 0;
  uint64_t size = 0;
  std::map<std::string, std::vector<uint8_t>> backends;  // plugin name -> mem blob

  std::vector<uint8_t> pack() const;
  static MemoryDesc unpack(const std::vector<uint8_t>& bytes);
  std::string to_json() const;
  bool operator==(const MemoryDesc&) const = default;
};

// ---- transfer status -----------------------------------------------------------

// Shared handle to one transfer's state: copies observe the same transfer.
// Thread-safe. The first final code sticks; later reports are ignored.
class TransferStatus {
 public:
  TransferStatus();  // a fresh status in INIT

  StatusCode Code() const;
  std::string Message() const;
  bool Init() const { return Code() == StatusCode::INIT; }
  bool InProgress() const;
  bool Succeeded() const { return Code() == StatusCode::SUCCESS; }
  bool Failed() const;
  // Block until the transfer ends; returns its code. Both waits first poll the
  // code for up to FERRY_WAIT_SPIN_US microseconds (default 100; 0: block at
  // once), so a short transfer's end is seen without a thread wake-up; while
  // they poll, a backend that can (plugin ABI 1.6 progress(), e.g. xgmi)
  // reports a finished transfer on this thread.
  StatusCode Wait() const;
  // Block at most `timeout`; returns true when the transfer has ended.
  // WaitFor(0) is a poll that also drives the backend's progress once.
  bool WaitFor(std::chrono::milliseconds timeout) const;
  // Ask the transfer to end as ERR_CANCELLED. It ends only once nothing more
  // of it can land: an attempt in flight is fenced at its target (a WRITE on a
  // backend that can fence) or waited for (a READ, or a backend that cannot).
  // It may still end SUCCESS (all had landed by then) or with the error that
  // ended it first. False, with the reason in *why, when the transfer had
  // already ended (a no-op) or this status cannot be cancelled (it is not a
  // transfer's). Never blocks.
  bool Cancel(std::string* why = nullptr) const;
  // From when this status was made (for a transfer: when it was posted) to when
  // it ended, or to now while it has not: what telemetry reports per transfer.
  std::chrono::nanoseconds Elapsed() const;

  // Set by the engine; public for backends written in C++ and for tests.
  void SetInProgress();
  // Returns false when the status had already ended (first code sticks).
  bool Finish(StatusCode code, std::string message = {});
  // What Cancel() calls, once (the transfer lifecycle sets it).
  void SetCanceller(std::function<void()> cancel);
  // What a wait runs while it polls: reports finished work of the backend the
  // transfer is on, on the waiting thread (the transfer lifecycle sets it when
  // a backend offers progress()). Must not block.
  void SetProgress(std::function<void()> progress);
  // Runs that hook once, if the status is still in progress (never blocks).
  void Progress() const;
  // When the transfer should end, from how long its backend's recent transfers
  // of about its size took (the transfer lifecycle sets it). A wait that
  // outlasts its spin sleeps until shortly before then and polls again around
  // it, instead of sleeping until it is woken after the end.
  void SetExpectedEnd(std::chrono::steady_clock::time_point end);

  struct State;
  const std::shared_ptr<State>& state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

// Wait for every status; false if any did not end within timeout.
bool wait_all(const std::vector<TransferStatus>& statuses,
              std::chrono::milliseconds timeout = std::chrono::milliseconds::max());

using TransferUid = uint64_t;

// The largest notification message (send_notification, or attached to a transfer).
constexpr size_t kMaxNotificationBytes = 64 * 1024;

// ---- engine --------------------------------------------------------------------

// Where engines publish and find descriptors (EngineConfig::metadata).
struct MetadataConfig {
  // etcd endpoints ("http://127.0.0.1:2379"). Empty: FERRY_ETCD_ENDPOINTS
  // (comma list), then the policy's `metadata: etcd:`, then no store.
  std::vector<std::string> etcd;
  // Key prefix. Empty: FERRY_ETCD_NAMESPACE, the policy's, then "ferry".
  std::string ns;
  // Lease TTL on what this engine publishes. 0: FERRY_ETCD_LEASE, the policy's, then 10 s.
  std::chrono::milliseconds lease{0};
};

struct EngineConfig {
  std::string host = "127.0.0.1";        // address the control listener binds and advertises
  uint16_t port = 0;                     // 0 = any free port
  std::string node_id;                   // empty: FERRY_NODE_ID, then boot id, then hostname
  std::string policy_file;               // empty: FERRY_POLICY, then the built-in policy
  std::vector<std::string> plugin_dirs;  // searched after FERRY_PLUGIN_PATH
  std::chrono::milliseconds timeout{0};  // per-transfer deadline; 0 = the policy's
  // Shared secret every peer must prove (HMAC-SHA256 challenge/response on each
  // control and data connection; never sent). Empty: FERRY_AUTH_TOKEN, then none.
  std::string auth_token;
  // Serve Engine::stats() as JSON on this Unix socket (mode 0600) for
  // `ferry stats PATH`; "{key}" and "{pid}" are replaced. Empty:
  // FERRY_STATS_SOCKET, then no endpoint.
  std::string stats_socket;
  // Target side: inbound statuses kept for pop_inbound_transfer_status(), per
  // initiator at most this many and none older than inbound_max_age (the oldest
  // go first, counted in EngineStats::inbound_dropped). 0: no limit.
  size_t inbound_max_per_peer = 65536;
  std::chrono::milliseconds inbound_max_age{std::chrono::minutes(10)};
  // Whether a transfer tells its target (for pop_inbound_transfer_status) when
  // its call leaves `notify` unset. Unset: the policy file's `notify:`, else true.
  std::optional<bool> notify;
  // A control-plane connection to a peer (fences, notification messages,
  // plugin handshakes) unused this long is closed at both ends; the next use
  // reconnects. 0: never.
  std::chrono::milliseconds control_idle_close{std::chrono::seconds(60)};
  // After a control frame arrives (a NOTIFY, a message, a fence), the control
  // plane's thread polls for the next one this long before it sleeps again,
  // so the sender of the next frame of a burst does not pay for waking a
  // sleeping thread (3-6 us of a notified transfer on the GPU host); and a
  // thread waiting for a peer's answer (a message's MSG_ACK) polls for it this
  // long before it sleeps. Costs up to one core for this long after the last
  // frame; an idle engine costs nothing. Unset: FERRY_CONTROL_SPIN_US, then 0
  // (sleep at once). At most 10 ms.
  std::optional<std::chrono::microseconds> control_spin;
  // Serve Prometheus metrics at http://ADDRESS/metrics ("host:port"; port 0 =
  // any free one, see Engine::metrics_address()). Empty: FERRY_METRICS_ADDR,
  // then no endpoint. Bind 127.0.0.1 unless a scraper on another host needs it.
  std::string metrics_address;
  // Publish this engine's descriptors in etcd and follow peers' (docs/operations.md).
  MetadataConfig metadata;
};

struct BackendStats {
  uint64_t bytes = 0;
  uint64_t transfers = 0;
  uint64_t failures = 0;
  uint64_t failovers = 0;    // transfers re-run elsewhere after failing here
  uint64_t quarantines = 0;  // times a peer was quarantined on this backend
  // complete() calls for no transfer the plugin held (a second completion,
  // or a context it was never given): an ABI breach, ignored and counted.
  uint64_t stray_completions = 0;
  // What the live plugin instance says (plugin ABI 1.5; empty for older plugins
  // or a backend no longer loaded): its describe() line and counters().
  std::string detail;
  std::map<std::string, uint64_t> plugin;
};
struct EngineStats {
  std::map<std::string, BackendStats> backends;
  uint64_t inbound_notifications = 0;
  uint64_t inbound_dropped = 0;         // inbound statuses dropped unpopped (cap or age)
  uint64_t notifications_received = 0;  // notification messages taken into the inbox
  uint64_t notifications_refused = 0;   // refused: too much unread from their sender
  uint64_t notifications_unread = 0;    // in the inbox now
  uint64_t ctrl_rejected = 0;           // control connections refused
  uint64_t ctrl_unix_connections = 0;   // made to same-host peers over their unix socket
  // The core's NOTIFYs (where a backend cannot notify) sent again on a new
  // control connection because theirs broke before the target answered, and
  // given up unanswered (the peer forgotten, or too many waiting on it).
  uint64_t notifies_resent = 0;
  uint64_t notifies_unanswered = 0;
  uint64_t fences = 0;         // FENCE requests sent after attempts with unknown outcome
  uint64_t fence_unknown = 0;  // attempts whose fence got no answer by their deadline
  uint64_t fenced_peers = 0;   // peers no transfer may start to now (a fence pending or unanswered)
};

// One item of a transfer over many regions (Engine::transfer): `local` and
// `remote` index the call's region lists.
struct TransferItem {
  size_t local = 0;
  uint64_t local_offset = 0;
  size_t remote = 0;
  uint64_t remote_offset = 0;
  uint64_t size = 0;
};

// A slice of a region in a prepared list (Engine::prepare_list): `region`
// indexes the list's regions.
struct ListEntry {
  size_t region = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
};

// Region slices resolved and checked once (Engine::prepare_list): a local list
// (this engine's memory) or a remote one (one peer's MemoryDescs), posted by
// index (Engine::transfer). Immutable; shareable between threads; must not
// outlive the Engine that made it.
class PreparedList {
 public:
  size_t size() const;
  bool local() const;
  const std::string& engine_key() const;
  struct Impl;
  explicit PreparedList(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  const std::shared_ptr<Impl>& impl() const { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

class Session;
class EngineImpl;

class Engine {
 public:
  // Binds the control listener and loads the policy. Throws ferry::Error.
  Engine(std::string key, EngineConfig config = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& key() const;

  // Load plugin `name` (libferry-<name>.so) and start it with settings (JSON;
  // empty = the policy's settings for it). Fails with the loader's reason.
  Result add_backend(const std::string& name, const std::string& settings_json = {});
  Result remove_backend(const std::string& name);
  std::vector<std::string> backends() const;

  // This engine's descriptor: hand it only to engines that should reach this
  // one (its secret is what grants access, docs/security.md).
  EngineDesc desc() const;
  // Registering the target at the initiator is enough (one-way registration):
  // the target learns an initiator from its authenticated hello. Registering
  // a descriptor equal to the one known is a no-op (sessions stay); a new
  // instance of the same key replaces the old one. A changed descriptor of
  // the same instance (it added or removed a backend) replaces it too -
  // sessions and transfers in flight to it end, as at a deregistration - but
  // what it landed here and was not popped yet stays poppable.
  Result register_remote_engine(const EngineDesc& desc);
  Result deregister_remote_engine(const std::string& key);

  // Register local memory. With a GPU runtime present the pointer decides:
  // device memory is GPU memory on its own device; UNKNOWN means "detect".
  // Throws ferry::Error: ERR_INVALID_ARGS for a null pointer or zero size,
  // ERR_GPU_OP for GPU memory without a GPU runtime.
  MemoryDesc register_memory(void* addr, size_t size, int device = -1,
                             MemoryLocation location = MemoryLocation::UNKNOWN);
  Result deregister_memory(const MemoryDesc& mem);

  TransferUid allocate_transfer_uid();

  // One-sided transfers. `notify`: the target can pop the inbound status;
  // unset: the engine's default (EngineConfig::notify). `message`: a
  // notification message (at most kMaxNotificationBytes) delivered to the
  // target's get_new_notifications() once the data has landed, exactly once
  // whatever failover the data took; the status ends SUCCESS only after it was
  // delivered (a message that fails fails the transfer, though its data landed).
  TransferStatus read(const MemoryDesc& local, size_t local_off, const MemoryDesc& remote,
                      size_t remote_off, size_t size, TransferUid uid,
                      std::optional<bool> notify = std::nullopt,
                      std::optional<std::string> message = std::nullopt);
  TransferStatus write(const MemoryDesc& local, size_t local_off, const MemoryDesc& remote,
                       size_t remote_off, size_t size, TransferUid uid,
                       std::optional<bool> notify = std::nullopt,
                       std::optional<std::string> message = std::nullopt);
  TransferStatus batch_read(const MemoryDesc& local, const std::vector<size_t>& local_offs,
                            const MemoryDesc& remote, const std::vector<size_t>& remote_offs,
                            const std::vector<size_t>& sizes, TransferUid uid,
                            std::optional<bool> notify = std::nullopt,
                            std::optional<std::string> message = std::nullopt);
  TransferStatus batch_write(const MemoryDesc& local, const std::vector<size_t>& local_offs,
                             const MemoryDesc& remote, const std::vector<size_t>& remote_offs,
                             const std::vector<size_t>& sizes, TransferUid uid,
                             std::optional<bool> notify = std::nullopt,
                             std::optional<std::string> message = std::nullopt);

  // ---- one transfer over many regions (docs/api.md) ----
  // Items over any (local region, remote region) pairs of one remote engine,
  // as one transfer with one status: per region pair one part, each routed and
  // failed over on its own; the status ends when every part has (SUCCESS only
  // when all landed; else the first failure's code, naming each failed part).
  // `notify` and `message` reach the target once, after all the data.
  TransferStatus transfer(Op op, const std::vector<MemoryDesc>& local_regions,
                          const std::vector<MemoryDesc>& remote_regions,
                          const std::vector<TransferItem>& items, TransferUid uid,
                          std::optional<bool> notify = std::nullopt,
                          std::optional<std::string> message = std::nullopt);

  // ---- prepared descriptor lists (docs/api.md) ----
  // Slices of `regions`, checked once: all regions this engine's (a local list)
  // or all one registered peer's (a remote list). Throws ferry::Error
  // (ERR_INVALID_ARGS: a slice out of its region, mixed engines, no entries;
  // ERR_NOT_FOUND: a local list's memory, or a remote list's peer, not
  // registered; a remote list's memory ids are the peer's to check, and a
  // transfer that uses one it does not know fails).
  PreparedList prepare_list(const std::vector<MemoryDesc>& regions,
                            const std::vector<ListEntry>& entries);
  // Item i moves local entry local_indices[i] to/from remote entry
  // remote_indices[i] (equal sizes); as transfer() above. The work per call is
  // proportional to the number of indices, not to the lists' sizes.
  TransferStatus transfer(Op op, const PreparedList& local, const int64_t* local_indices,
                          const PreparedList& remote, const int64_t* remote_indices, size_t n,
                          TransferUid uid, std::optional<bool> notify = std::nullopt,
                          std::optional<std::string> message = std::nullopt);
  TransferStatus transfer(Op op, const PreparedList& local,
                          const std::vector<int64_t>& local_indices, const PreparedList& remote,
                          const std::vector<int64_t>& remote_indices, TransferUid uid,
                          std::optional<bool> notify = std::nullopt,
                          std::optional<std::string> message = std::nullopt);

  // A pre-resolved (local, remote) pair; nullptr with the reason in *why when
  // no backend can serve it (e.g. none loaded: ERR_BAD_STATE).
  std::unique_ptr<Session> create_session(const MemoryDesc& local, const MemoryDesc& remote,
                                          Result* why = nullptr);

  // Target side: the status of an inbound transfer from engine `remote_key`
  // with `uid`, removed from the table; nullopt when none has arrived.
  std::optional<TransferStatus> pop_inbound_transfer_status(const std::string& remote_key,
                                                            TransferUid uid);

  // As pop_inbound_transfer_status, waiting up to `timeout` for it to land.
  std::optional<TransferStatus> wait_inbound_transfer_status(const std::string& remote_key,
                                                             TransferUid uid,
                                                             std::chrono::milliseconds timeout);

  // ---- notification messages (docs/api.md) ----
  // Send `message` (bytes, at most kMaxNotificationBytes) to engine
  // `remote_key` (registered, or learned from its hello). Messages to one
  // engine arrive in the order they were sent (attached ones when their data
  // has landed). The status ends SUCCESS once the target took it (exactly
  // once), fails when it did not and never will (ERR_BAD_STATE: its inbox is
  // full), or ERR_OUTCOME_UNKNOWN when the target could not be asked by the
  // deadline (the policy's timeout).
  TransferStatus send_notification(const std::string& remote_key, const std::string& message);
  // Target side: every message that arrived since the last call, by sender key,
  // in arrival order; the inbox is empty afterwards.
  std::map<std::string, std::vector<std::string>> get_new_notifications();
  // As get_new_notifications(), waiting up to `timeout` for one to arrive.
  std::map<std::string, std::vector<std::string>> wait_notifications(
      std::chrono::milliseconds timeout);
  // A file descriptor that polls readable (POLLIN) while messages are unread,
  // for event loops (asyncio's add_reader); owned by the engine, never read it.
  int notification_fd() const;

  EngineStats stats() const;
  // The policy in force, and where it came from ("built-in" or a file name).
  std::string policy_source() const;

  // "host:port" the /metrics endpoint listens on; empty when it is off.
  std::string metrics_address() const;

  // ---- metadata store (etcd; docs/operations.md) ----
  // With a store configured the engine publishes its EngineDesc at
  // {ns}/{key}/engine under a lease it keeps alive. Peers fetched here are
  // watched: when their lease expires or their key is deleted they are
  // deregistered (transfers to them fail, naming the lease); a new instance
  // published under the same key is registered in its place.
  // All return ERR_BAD_STATE when no store is configured and ERR_TRANSPORT when
  // the store cannot be reached; nothing here changes peers already known.
  bool has_metadata_store() const;
  // Publish `mem` under {ns}/{key}/mem/{name} (this engine's lease).
  Result publish_memory(const std::string& name, const MemoryDesc& mem);
  Result unpublish_memory(const std::string& name);
  // Fetch engine `key`'s descriptor, register it and watch it; waits up to
  // `wait` for it to appear (0: ask once; ERR_NOT_FOUND when absent).
  Result fetch_remote_engine(const std::string& key,
                             std::chrono::milliseconds wait = std::chrono::milliseconds{0});
  // Fetch the MemoryDesc engine `key` published as `name`, waiting as above.
  std::optional<MemoryDesc> fetch_memory(const std::string& key, const std::string& name,
                                         std::chrono::milliseconds wait = {},
                                         Result* why = nullptr);

 private:
  std::unique_ptr<EngineImpl> impl_;
};

// Transfers between one local and one remote region, resolved once.
// A Session must not outlive the Engine that created it.
class Session {
 public:
  ~Session();
  TransferUid allocate_transfer_uid();
  TransferStatus read(size_t local_off, size_t remote_off, size_t size, TransferUid uid,
                      std::optional<bool> notify = std::nullopt,
                      std::optional<std::string> message = std::nullopt);
  TransferStatus write(size_t local_off, size_t remote_off, size_t size, TransferUid uid,
                       std::optional<bool> notify = std::nullopt,
                       std::optional<std::string> message = std::nullopt);
  TransferStatus batch_read(const std::vector<size_t>& local_offs,
                            const std::vector<size_t>& remote_offs,
                            const std::vector<size_t>& sizes, TransferUid uid,
                            std::optional<bool> notify = std::nullopt,
                            std::optional<std::string> message = std::nullopt);
  TransferStatus batch_write(const std::vector<size_t>& local_offs,
                             const std::vector<size_t>& remote_offs,
                             const std::vector<size_t>& sizes, TransferUid uid,
                             std::optional<bool> notify = std::nullopt,
                             std::optional<std::string> message = std::nullopt);
  bool alive() const;

  struct Impl;
  explicit Session(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

// Log verbosity: "error", "warn" (default; or FERRY_LOG_LEVEL), "info", "debug".
// Returns false for an unknown name.
bool set_log_level(const std::string& level);

// Small helpers over the GPU runtime the core loaded (libcudart or libamdhip64,
// found at run time), for tools, tests and bindings that need GPU buffers
// without a GPU SDK. All throw ferry::Error(ERR_GPU_OP) when the runtime fails.
namespace gpu {
bool available();    // a runtime and at least one device
int device_count();  // 0 without a runtime
void* alloc(size_t bytes, int device);
void free(void* ptr);
// Copy in any direction (unified addressing), returned once the bytes are at
// dst - a DMA into the device included - so a transfer posted next sees them.
void copy(void* dst, const void* src, size_t bytes);
}  // namespace gpu

// Plugin discovery for `ferry info`.
struct PluginInfo {
  std::string name;
  std::string path;
  bool loaded = false;
  std::string error;  // why it did not load
  std::string version;
  uint32_t abi_major = 0, abi_minor = 0;
  uint64_t caps = 0;
  std::string description;  // the plugin's describe() line, when it has one
  std::string warning;      // loaded, but its ops table's size disagrees with its abi_minor
};
// Where discover_plugins starts each plugin (init, describe, fini). In this
// process, a plugin that crashes or hangs there takes the caller with it. In a
// child process (one fork per plugin), that is reported as the plugin's error,
// and a probe that has not ended within 30 s is killed; for callers with no
// other threads and no GPU context yet, such as the `ferry` tool (a child of a
// process that initialised CUDA cannot use CUDA).
enum class ProbeIn { THIS_PROCESS, CHILD_PROCESS };
std::vector<PluginInfo> discover_plugins(const std::vector<std::string>& extra_dirs = {},
                                         ProbeIn where = ProbeIn::THIS_PROCESS);
std::string caps_to_string(uint64_t caps);

}  // namespace ferry
