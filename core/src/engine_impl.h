// The engine's private state, shared by engine.cpp (registration, backends),
// transfer.cpp (validation, routing, attempts, failover) and session.cpp.
#pragma once
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "auth.h"
#include "async_runner.h"
#include "control_plane.h"
#include "fence.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "health.h"
#include "inbound_table.h"
#include "plugin_loader.h"
#include "policy.h"
#include "router.h"
#include "stats_server.h"
#include "watchdog.h"

namespace ferry {

class EngineImpl;

struct BackendCounters {
  std::atomic<uint64_t> bytes{0}, transfers{0}, failures{0}, failovers{0}, quarantines{0};
};

// One loaded plugin instance in this engine.
struct Backend {
  std::string name;
  std::shared_ptr<PluginLibrary> lib;
  const ferry_plugin_ops_v1* ops = nullptr;
  void* ctx = nullptr;
  uint64_t caps = 0;
  std::vector<uint8_t> conn_blob;
  ferry_host_v1 host{};
  EngineImpl* engine = nullptr;
  std::shared_ptr<BackendCounters> counters;
  // Calls into the plugin hold `life` shared; removal holds it unique and sets
  // `removed`, so nothing reaches a plugin instance after fini().
  std::shared_mutex life;
  bool removed = false;
};
using BackendPtr = std::shared_ptr<Backend>;

struct PeerEntry {
  EngineDesc desc;
  bool same_host = false;
  std::set<std::string> advertised;                // backends in the peer's descriptor
  std::map<std::string, void*> handles;            // backend -> plugin peer handle (engine mu_)
  std::map<std::string, std::string> unreachable;  // backend -> why peer_add failed
  // Deregistered (or replaced by a re-registration of its key): sessions made
  // for it refuse new transfers, and its late failures do not count against the
  // health of the engine now registered under the key.
  std::atomic<bool> gone{false};
};

struct LocalMem {
  MemoryDesc desc;
  void* addr = nullptr;
  std::set<std::string> advertised;
  std::map<std::string, void*> handles;  // engine mu_
  // Transfers using this region as local memory; deregistration waits for zero.
  std::mutex mu;
  std::condition_variable idle;
  uint64_t inflight = 0;
};

// A routing decision kept for one (local region, remote region, op, rule); valid
// while neither the loaded backends nor any health state changed, and no
// quarantine it relied on has ended.
struct CachedRoute {
  uint64_t backend_generation = 0;
  uint64_t health_generation = 0;
  std::chrono::steady_clock::time_point valid_until;
  std::vector<std::shared_ptr<struct Backend>> route;
  std::string why;
};

struct RemoteMem {
  MemoryDesc desc;
  std::set<std::string> advertised;
  std::map<std::string, void*> handles;  // engine mu_
  std::mutex route_mu;
  std::map<std::tuple<uint64_t, int, int>, CachedRoute> routes;  // (local id, op, rule)
};

// A resolved (local, remote) pair: what a Session keeps.
struct MemPair {
  std::shared_ptr<PeerEntry> peer;
  std::shared_ptr<LocalMem> local;
  std::shared_ptr<RemoteMem> remote;
};

// One logical transfer, across however many backends it takes.
struct Transfer {
  EngineImpl* engine = nullptr;
  TransferStatus status;
  MemPair pair;
  uint32_t op = FERRY_OP_WRITE;
  uint32_t flags = 0;
  uint64_t uid = 0;
  std::vector<ferry_iov_v1> iov;
  uint64_t total = 0;
  std::vector<BackendPtr> route;
  // The whole transfer ends by this (submit + policy timeout): attempts, fences,
  // failovers and the notification all fit inside it.
  std::chrono::steady_clock::time_point deadline;
  size_t next = 0;
  uint32_t attempts = 0;
  StatusCode last_code = StatusCode::ERR_BAD_STATE;
  std::string history;  // "tcp: connection reset; ofi: timeout"
  ~Transfer();
};
using TransferPtr = std::shared_ptr<Transfer>;

// One try of a transfer on one backend. The plugin holds a reference until it
// calls complete(); the watchdog fires if it never does.
struct Attempt : WatchItem, std::enable_shared_from_this<Attempt> {
  TransferPtr transfer;
  BackendPtr backend;
  uint64_t id = 0;  // ferry_xfer_v1.attempt_id
  std::atomic<bool> settled{false};
  bool by_watchdog = false;  // ended by the core's watchdog, not by the plugin
  // The watchdog closed the peer's gate (an INITIATOR_COPY copy may still run);
  // the plugin's late completion reopens it.
  std::atomic<bool> closed_gate{false};
  void on_deadline() override;
  ~Attempt() override;
};

class EngineImpl {
 public:
  EngineImpl(std::string key, EngineConfig config);
  ~EngineImpl();

  // engine.cpp
  Result add_backend(const std::string& name, const std::string& settings_json);
  Result remove_backend(const std::string& name);
  std::vector<std::string> backend_names() const;
  EngineDesc desc() const;
  Result register_remote_engine(const EngineDesc& d);
  Result deregister_remote_engine(const std::string& key);
  // keep_fence: the same instance registered again keeps its fence state.
  Result deregister_peer(const std::string& key, bool keep_fence);
  // A FENCE from `peer`: each entry's backend fences it here.
  std::vector<FenceResult> fence_inbound(const std::string& peer,
                                         const std::vector<FenceEntry>& entries);
  MemoryDesc register_memory(void* addr, size_t size, int device, MemoryLocation loc);
  Result deregister_memory(const MemoryDesc& m);
  EngineStats stats() const;

  // transfer.cpp
  TransferStatus submit(Op op, const MemoryDesc& local, const MemoryDesc& remote,
                        const size_t* local_offs, const size_t* remote_offs, const size_t* sizes,
                        size_t n, TransferUid uid, bool notify);
  TransferStatus submit_pair(const MemPair& pair, Op op, const size_t* local_offs,
                             const size_t* remote_offs, const size_t* sizes, size_t n,
                             TransferUid uid, bool notify);
  // Resolve descriptors into registered state; error code + message on failure.
  StatusCode resolve(const MemoryDesc& local, const MemoryDesc& remote, MemPair& out,
                     std::string& why);
  std::vector<BackendPtr> route_for(const MemPair& pair, Op op, uint64_t bytes, std::string& why);
  void attempt_done(const std::shared_ptr<Attempt>& a, int status, const std::string& msg);

  // host services (plugin callbacks), see host_services in engine.cpp
  int ctrl_send(Backend& b, const char* peer_key, const void* msg, size_t len);
  void inbound(const char* peer_key, uint64_t uid, int status);
  int auth_sign(const void* challenge, size_t len, uint8_t mac[32]) const;
  int auth_verify(const void* challenge, size_t len, const uint8_t mac[32]) const;

  const std::string key_;
  const EngineConfig config_;
  const auth::Secret secret_;  // EngineConfig::auth_token, else FERRY_AUTH_TOKEN, else none
  std::string node_id_;
  uint64_t instance_ = 0;  // EngineDesc::instance: random, never 0
  Policy policy_;
  std::unique_ptr<Health> health_;
  InboundTable inbound_;
  std::atomic<uint64_t> next_uid_{1};
  std::atomic<uint64_t> next_attempt_{1};
  std::atomic<uint64_t> inbound_count_{0};
  std::atomic<bool> shutting_down_{false};
  // Declared before anything whose destruction completes transfers.
  Watchdog watchdog_;

  mutable std::shared_mutex mu_;                          // guards everything below
  std::vector<BackendPtr> backends_;                      // load order
  std::map<std::string, BackendPtr> retired_backends_;    // removed, by name (fences ask)
  std::vector<std::pair<std::string, uint64_t>> loaded_;  // name, caps (for the router)
  std::atomic<uint64_t> backend_generation_{0};
  std::map<std::string, std::shared_ptr<BackendCounters>> counters_;
  std::map<std::string, std::shared_ptr<PeerEntry>> peers_;
  std::unordered_map<uint64_t, std::shared_ptr<LocalMem>> local_mems_;
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<RemoteMem>> remote_mems_;
  // Imports replaced by a newer descriptor, kept until their peer goes away.
  std::multimap<std::string, std::shared_ptr<RemoteMem>> retired_remote_mems_;
  uint64_t next_mem_id_ = 1;

  std::unique_ptr<ControlPlane> control_;      // its thread calls into the above
  std::unique_ptr<Fencer> fencer_;            // uses control_; destroyed before it
  std::unique_ptr<AsyncRunner> async_;        // notifications that must connect first
  std::unique_ptr<StatsServer> stats_server_;  // its thread reads stats()

 private:
  void start_next(const TransferPtr& t);
  int post_attempt(const TransferPtr& t, const BackendPtr& b, std::string& why);
  void finish(const TransferPtr& t, StatusCode code, std::string msg);
  // An attempt failed in a way that leaves nothing to land later: count it
  // against the backend's health and go on with the next backend.
  void attempt_failed(const std::shared_ptr<Attempt>& a, int status, const std::string& msg,
                      bool backend_at_fault = true);
  // The target's answer to the fence of an attempt whose outcome was unknown.
  void attempt_fenced(const std::shared_ptr<Attempt>& a, int status, const std::string& msg,
                      const FenceResult& r, const std::string& why);
  // Tell the target a transfer landed when the backend cannot (or, for a READ,
  // must not: its target cannot know the data arrived). "" or why it failed.
  std::string notify_by_core(const TransferPtr& t);
  // The attempt's data is in place: notify if the core owes it (at once when the
  // control connection is up and free, else on a thread of its own, by the
  // deadline), then end the transfer SUCCESS, or fail the attempt over when the
  // target could not be told.
  void land(const std::shared_ptr<Attempt>& a, bool owes_notify);
  void landed(const std::shared_ptr<Attempt>& a, const std::string& notify_error);
  Fencer::Target fence_target(const TransferPtr& t) const;
 public:
  // host->complete for an attempt the watchdog had already ended.
  void late_completion(const std::shared_ptr<Attempt>& a);
  std::shared_ptr<RemoteMem> import_remote(const std::shared_ptr<PeerEntry>& peer,
                                           const MemoryDesc& d);
  void release_backend_handles(const BackendPtr& b);
  void release_remote(const std::shared_ptr<RemoteMem>& r);
};

// Engine keys are 1..255 bytes (they travel as str8 on the wire).
constexpr size_t kMaxKeyBytes = 255;

// host_services.cpp: fills b.host with the core's callbacks for that backend.
void init_host_services(Backend& b);
// registry.cpp: what a plugin is told about a peer and about a local region
// (pointers borrowed from the descriptor, valid while it lives).
ferry_peer_v1 peer_view(const EngineDesc& d, bool same_host, const std::vector<uint8_t>& blob);
ferry_mem_v1 mem_view(const LocalMem& m);

// Plugin error codes -> the user's status codes.
StatusCode status_from_plugin(int rc);
std::string plugin_error_name(int rc);

}  // namespace ferry
