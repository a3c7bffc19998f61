// SPDX-License-Identifier: Apache-2.0
// The engine's parts, put together (engine_impl.cpp): the backends, the
// registry of peers and memory, the transfer lifecycle, the control plane and
// the inbound table, and what joins them - registering a peer tells the
// registry, the fencer, the health table and the control plane; a FENCE from a
// peer is served by the backends (fence_serve.cpp); plugin callbacks are
// host_services.cpp. The public Engine facade is engine.cpp.
#pragma once
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "auth.h"
#include "backend_set.h"
#include "control_plane.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "health.h"
#include "inbound_table.h"
#include "link_auth.h"
#include "log.h"
#include "metadata_sync.h"
#include "metrics_server.h"
#include "notif_inbox.h"
#include "policy.h"
#include "registry.h"
#include "stats_server.h"
#include "transfer.h"

namespace ferry {

class EngineImpl {
 public:
  EngineImpl(std::string key, EngineConfig config);
  ~EngineImpl();

  Result add_backend(const std::string& name, const std::string& settings_json);
  Result remove_backend(const std::string& name);
  std::vector<std::string> backend_names() const;
  EngineDesc desc() const;
  Result register_remote_engine(const EngineDesc& d);
  Result deregister_remote_engine(const std::string& key);
  EngineStats stats() const;
  TransferStatus send_notification(const std::string& remote_key, std::string payload);
  NotifInbox& notif_inbox() { return notif_inbox_; }
  const NotifInbox& notif_inbox() const { return notif_inbox_; }
  TransferUid allocate_uid() { return next_uid_.fetch_add(1); }

  Registry& registry() { return registry_; }
  Transfers& transfers() { return *transfers_; }
  InboundTable& inbound_table() { return inbound_; }
  const Policy& policy() const { return policy_; }

  // Host services (plugin callbacks, host_services.cpp).
  int ctrl_send(Backend& b, const char* peer_key, const void* msg, size_t len);
  int ctrl_try_send(Backend& b, const char* peer_key, const void* msg, size_t len);
  // `seq`: a core NOTIFY's place in its sender's sequence (none for a
  // plugin's own report).
  void inbound(const char* peer_key, uint64_t uid, int status, const NotifySeq* seq = nullptr);
  int auth_sign(const void* challenge, size_t len, uint8_t mac[32]) const;
  int auth_verify(const void* challenge, size_t len, const uint8_t mac[32]) const;
  const LinkAuth& link_auth() const { return link_auth_; }

  const std::string key_;

  // /metrics and the metadata store (issue 21; engine_cluster.cpp).
  std::string metrics_address() const;
  std::string render_metrics() const;
  MetadataSync* metadata() { return metadata_.get(); }
  // Deregister because the store says the peer is gone; `why` names the lease.
  void deregister_gone_peer(const std::string& key, const std::string& why);

 private:
  void start_cluster_services();  // engine_cluster.cpp, from the constructor
  // What becomes of the peer's fence state (fence.h): KEEP (the same instance
  // registered again), PARK (deregistered, or replaced by a new instance:
  // WRITEs of unknown outcome stay pending for that life's return; a new
  // life has a fence state of its own and does not wait for them).
  enum class PeerFences { KEEP, PARK };
  // keep_inbound: the peer's landed transfers not popped yet stay (the same
  // life registered again with a changed descriptor).
  Result deregister_peer(const std::string& key, PeerFences fences, const std::string& why = {},
                         bool keep_inbound = false);
  // A peer on this host is reached over its control plane's unix socket.
  void route_control(const EngineDesc& d);
  // A peer that proved our descriptor and presented its own (one-way
  // registration): known from now on, so backends can answer it and connect
  // back; at most kMaxLearnedPeers; never replaces a known one (registered or
  // learned: a key is pinned to its secret until the application deregisters it).
  // "" when learned now or known under the same secret; else why not.
  std::string learn_peer(const EngineDesc& d);
  std::mutex peers_mu_;  // register / deregister / learn, one at a time
  static constexpr size_t kMaxLearnedPeers = 1024;

  const EngineConfig config_;
  // The instance secret, and EngineConfig::auth_token, else FERRY_AUTH_TOKEN, else none.
  const auth::Credentials creds_;
  std::string node_id_;
  uint64_t instance_ = 0;  // EngineDesc::instance: random, never 0
  Policy policy_;
  std::unique_ptr<Health> health_;
  InboundTable inbound_;
  NotifInbox notif_inbox_;
  LogLimiter log_limiter_{std::chrono::seconds(10),
                          /*burst=*/1};  // warnings a peer can cause by the thousand
  std::atomic<uint64_t> next_uid_{1};
  std::atomic<uint64_t> inbound_count_{0};

  BackendSet backends_;
  Registry registry_;
  // What connections prove (ABI 1.4), with the secrets of registered peers.
  const LinkAuth link_auth_{creds_,
                            [this](const std::string& k, auth::InstanceSecret* s, bool* learned) {
                              return registry_.peer_secret(k, s, learned);
                            }};
  std::unique_ptr<ControlPlane> control_;  // its thread calls into the parts above
  // control_'s object for route_control(), which its own I/O thread calls
  // (learn_peer): that thread must not read control_ while the destructor
  // resets it. Null before the object exists and from the destructor on; the
  // object outlives a call in progress (its destructor joins that thread).
  std::atomic<ControlPlane*> control_live_{nullptr};
  std::unique_ptr<Transfers> transfers_;           // uses control_; ended before it
  std::unique_ptr<StatsServer> stats_server_;      // its thread reads stats()
  std::unique_ptr<MetricsServer> metrics_server_;  // its thread reads stats() and counters
  std::unique_ptr<MetadataSync> metadata_;         // its threads (de)register peers
};

// host_services.cpp: gives b its host table (b.link), the core's callbacks
// through which its plugin calls the core.
void attach_host_link(Backend& b);
// fence_serve.cpp: a FENCE from `peer`; each entry's backend fences it here.
std::vector<FenceResult> serve_fence(const BackendSet& backends, const std::string& peer,
                                     const std::vector<FenceEntry>& entries);

}  // namespace ferry
