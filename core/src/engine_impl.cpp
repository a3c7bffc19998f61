// SPDX-License-Identifier: Apache-2.0
// The engine's parts put together (engine_impl.h): construction and teardown,
// backends loaded and removed, peers registered across the parts, stats.
#include "engine_impl.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <random>

#include "host_link.h"
#include "log.h"
#include "node_id.h"
#include "plugin_live_info.h"

namespace ferry {

namespace {

std::string token_from(const EngineConfig& c) {
  if (!c.auth_token.empty()) return c.auth_token;
  const char* env = std::getenv("FERRY_AUTH_TOKEN");
  return env ? env : "";
}

// EngineConfig::control_spin, else FERRY_CONTROL_SPIN_US, else 0; a value
// outside 0..10000 us is refused, not clamped.
std::chrono::microseconds control_spin(const EngineConfig& c) {
  constexpr long long kMax = ControlPlane::kMaxSpin.count();
  if (c.control_spin) {
    if (c.control_spin->count() < 0 || c.control_spin->count() > kMax)
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "control_spin must be 0.." + std::to_string(kMax) + " microseconds");
    return *c.control_spin;
  }
  const char* env = std::getenv("FERRY_CONTROL_SPIN_US");
  if (env == nullptr || *env == '\0') return std::chrono::microseconds(0);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(env, &end, 10);
  if (end == env || *end != '\0' || errno != 0 || v < 0 || v > kMax)
    throw Error(StatusCode::ERR_INVALID_ARGS, "FERRY_CONTROL_SPIN_US='" + std::string(env) +
                                                  "' is not 0.." + std::to_string(kMax) +
                                                  " (microseconds)");
  return std::chrono::microseconds(v);
}

const std::string& checked_key(const std::string& key) {
  if (key.empty() || key.size() > kMaxKeyBytes)
    throw Error(StatusCode::ERR_INVALID_ARGS, "engine key must be 1..255 bytes");
  return key;
}

uint64_t random_instance() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}

Policy policy_for(const EngineConfig& c) {
  std::string file = c.policy_file;
  if (file.empty())
    if (const char* env = std::getenv("FERRY_POLICY"); env && *env) file = env;
  Policy p = file.empty() ? builtin_policy() : load_policy_file(file);
  if (c.timeout > Policy::kMaxDuration)
    throw Error(StatusCode::ERR_INVALID_ARGS, "EngineConfig::timeout must be at most 168h");
  if (c.timeout.count() > 0) p.timeout = c.timeout;
  if (c.notify) p.notify = *c.notify;
  return p;
}

}  // namespace

EngineImpl::EngineImpl(std::string key, EngineConfig config)
    : key_(checked_key(key)),
      config_(std::move(config)),
      creds_(token_from(config_)),
      node_id_(config_.node_id.empty() ? default_node_id() : config_.node_id),
      instance_(random_instance()),
      policy_(policy_for(config_)),
      health_(std::make_unique<Health>(policy_.quarantine)),
      inbound_(InboundTable::Limits{config_.inbound_max_per_peer, config_.inbound_max_age}),
      registry_(key_, instance_, node_id_, backends_) {
  ControlPlane::Handlers h;
  h.on_plugin = [this](const std::string& peer, const std::string& plugin, const uint8_t* msg,
                       size_t len) {
    BackendPtr b = backends_.find(plugin);
    if (!b) {
      uint64_t held = 0;
      if (log_enabled(LogLevel::WARN) && log_limiter_.Allow("unknown-backend " + peer, &held))
        log_line(LogLevel::WARN, key_,
                 "control message from '" + peer + "' for backend '" + plugin +
                     "' which is not loaded" +
                     (held ? " (" + std::to_string(held) + " more since the last report)" : ""));
      return;
    }
    std::shared_lock life(b->life);
    if (!b->removed) b->ops->on_ctrl(b->ctx, peer.c_str(), msg, len);
  };
  h.on_notify = [this](const std::string& peer, uint64_t uid, int32_t status, uint64_t instance,
                       const NotifySeq& seq) {
    // The data went to the life the sender means: another life of ours (an
    // earlier one's transfer, its NOTIFY resent to us) never received it.
    if (instance != instance_) return NotifyAck::OTHER_LIFE;
    inbound(peer.c_str(), uid, status, &seq);
    return NotifyAck::TAKEN;
  };
  h.on_message = [this](const std::string& peer, uint64_t instance, uint64_t id,
                        const uint8_t* payload, size_t len) {
    // The connection proved the life registered (or learned) under the key; a
    // message naming another life is not this peer's to send (exactly once
    // rests on one numbering per life).
    if (registry_.peer_instance(peer) != instance) return MsgAck::STALE;
    MsgAck a = notif_inbox_.deliver(peer, instance, id, payload, len);
    uint64_t held = 0;
    if (a == MsgAck::FULL && log_enabled(LogLevel::WARN) &&
        log_limiter_.Allow("notif-full " + peer, &held))
      log_line(LogLevel::WARN, key_,
               "notification messages from '" + peer +
                   "' are refused: too many unread (get_new_notifications drains them)" +
                   (held ? " (" + std::to_string(held) + " more since the last report)" : ""));
    return a;
  };
  h.on_fence = [this](const std::string& peer, uint64_t wanted,
                      const std::vector<FenceEntry>& entries, uint64_t* instance) {
    *instance = instance_;
    // Meant for another life of this engine (one that ended): that one's
    // bytes can no longer land, and this one's must not be fenced for it.
    // The initiator reads our instance as "gone".
    if (wanted != instance_) return std::vector<FenceResult>{};
    // Messages are the inbox's; the rest each backend's.
    std::vector<FenceEntry> data;
    for (const auto& e : entries)
      if (e.backend != kMsgFenceBackend) data.push_back(e);
    std::vector<FenceResult> served = serve_fence(backends_, peer, data);
    std::vector<FenceResult> out;
    size_t next = 0;
    // The fence's connection proved the peer's key: its life is the one known
    // here. None known (deregistered meanwhile): nothing can be said.
    const auto life = registry_.peer_instance(peer);
    for (const auto& e : entries)
      if (e.backend == kMsgFenceBackend)
        out.push_back({e.attempt,
                       life ? notif_inbox_.fence(peer, *life, e.attempt) : FenceState::UNKNOWN, 0});
      else
        out.push_back(next < served.size() ? served[next++]
                                           : FenceResult{e.attempt, FenceState::UNKNOWN, 0});
    return out;
  };
  h.self_desc = [this] { return desc().pack(); };
  h.on_peer_desc = [this](const EngineDesc& d) { return learn_peer(d); };
  control_ =
      std::make_unique<ControlPlane>(key_, config_.host, config_.port, std::move(h), &link_auth_,
                                     config_.control_idle_close, control_spin(config_));
  control_live_.store(control_.get(), std::memory_order_release);
  transfers_ = std::make_unique<Transfers>(
      Transfers::Parts{key_, policy_, *health_, backends_, registry_, *control_}, instance_);
  if (creds_.has_token())
    FERRY_LOG(INFO, key_,
              "auth token set: peers must prove it, with this engine's descriptor, on every "
              "control and data connection");
  std::string stats_path = config_.stats_socket;
  if (stats_path.empty())
    if (const char* env = std::getenv("FERRY_STATS_SOCKET"); env && *env) stats_path = env;
  if (!stats_path.empty()) {
    stats_server_ = std::make_unique<StatsServer>(expand_stats_path(stats_path, key_),
                                                  [this] { return stats_to_json(key_, stats()); });
    FERRY_LOG(INFO, key_, "stats on unix socket " + stats_server_->path() + " (ferry stats PATH)");
  }
  start_cluster_services();
}

EngineImpl::~EngineImpl() {
  metadata_.reset();  // its threads call into the parts below; leaves the store first
  transfers_->shut_down();
  stats_server_.reset();
  metrics_server_.reset();
  // Backends first: a plugin's fini may still send control messages (ctrl_send
  // uses control_), and control traffic arriving meanwhile finds them marked
  // removed and is dropped. Then the lifecycle (its notifications and fences use
  // control_), then the control plane.
  std::vector<std::string> names = backend_names();
  for (auto it = names.rbegin(); it != names.rend(); ++it) remove_backend(*it);
  // A message or fence still waiting for a peer's answer (a stopped peer) would
  // hold the lifecycle's destruction to its deadline: cut those waits (the
  // message ends unknown). After the backends: their farewells went out.
  control_->abort_waits();
  transfers_.reset();
  control_live_.store(nullptr, std::memory_order_release);
  control_.reset();
}

// ---- backends -----------------------------------------------------------------

Result EngineImpl::add_backend(const std::string& name, const std::string& settings_json) {
  if (backends_.has(name))
    return {StatusCode::ERR_BAD_STATE, "backend '" + name + "' is already loaded"};
  std::vector<std::string> dirs = config_.plugin_dirs;
  dirs.insert(dirs.end(), policy_.plugin_dirs.begin(), policy_.plugin_dirs.end());
  PluginLoad load = load_plugin(name, plugin_search_dirs(dirs));
  if (!load.lib) return {StatusCode::ERR_NOT_FOUND, "backend '" + name + "': " + load.error};

  auto b = std::make_shared<Backend>();
  b->name = name;
  b->lib = load.lib;
  b->ops = load.lib->ops;
  b->caps = b->ops->caps;
  // FENCE is believed only from a plugin whose table has a fence() to call.
  if (!FERRY_HAS_FIELD(ferry_plugin_ops_v1, b->ops, fence) || b->ops->fence == nullptr)
    b->caps &= ~FERRY_CAP_FENCE;
  if (!(b->caps & FERRY_CAP_FENCE)) b->caps &= ~FERRY_CAP_FENCE_SELECTIVE;
  // MULTI_PAIR only from a plugin built against 1.7 or later: an older one
  // cannot know what the bit (or ferry_xfer_v1.pairs) means.
  if (b->ops->abi_minor < 7) b->caps &= ~FERRY_CAP_MULTI_PAIR;
  // Likewise NATIVE_NOTIFY_READ (1.8), and it means nothing without NATIVE_NOTIFY.
  if (b->ops->abi_minor < 8 || !(b->caps & FERRY_CAP_NATIVE_NOTIFY))
    b->caps &= ~FERRY_CAP_NATIVE_NOTIFY_READ;
  b->engine = this;
  attach_host_link(*b);
  std::string settings = settings_json.empty() ? policy_.settings_for(name) : settings_json;
  std::string why;
  int rc = init_plugin(b->ops, b->link->table(), key_.c_str(), node_id_.c_str(), settings.c_str(),
                       &b->ctx, &why);
  if (rc != FERRY_OK)
    return {
        rc == FERRY_ERR_INVALID_ARGS ? StatusCode::ERR_INVALID_ARGS : StatusCode::ERR_BAD_STATE,
        "backend '" + name + "' failed to start: " + (why.empty() ? plugin_error_name(rc) : why)};
  std::vector<uint8_t> blob(FERRY_MAX_BLOB);
  size_t len = blob.size();
  try {
    rc = b->ops->conn_info(b->ctx, blob.data(), &len);
  } catch (...) {
    rc = FERRY_ERR_BAD_STATE;
  }
  if (rc != FERRY_OK || len > FERRY_MAX_BLOB) {
    b->ops->fini(b->ctx);
    return {StatusCode::ERR_BAD_STATE, "backend '" + name + "': conn_info failed"};
  }
  blob.resize(len);
  b->conn_blob = std::move(blob);
  b->counters = backends_.counters_for(name);
  b->has_progress = FERRY_HAS_FIELD(ferry_plugin_ops_v1, b->ops, progress) && b->ops->progress;
  registry_.attach(b);  // what exists already: peers and local memory
  backends_.add(b);
  FERRY_LOG(INFO, key_, "backend '" + name + "' loaded from " + load.lib->path);
  if (metadata_) metadata_->republish_self();  // the descriptor now carries it
  return {};
}

Result EngineImpl::remove_backend(const std::string& name) {
  BackendPtr b = backends_.remove(name);  // kept as retired: fences ask about it
  if (!b) return {StatusCode::ERR_NOT_FOUND, "backend '" + name + "' is not loaded"};
  std::unique_lock life(b->life);  // waits for calls in progress
  registry_.detach(b);
  b->ops->fini(b->ctx);  // completes whatever was still pending
  b->removed = true;
  life.unlock();
  // A call its threads make from now on (a breach) finds nothing. Not under
  // `life`: a call in progress may be waiting for it (a failover's post).
  b->link->detach();
  // What its fini did not complete (a plugin's breach) is completed here, as
  // fini should have: nothing of it can move any more. Left in the table, such
  // an attempt and the backend would keep each other alive, and its transfer
  // would end only by its deadline (or never, were the engine going away).
  auto left = b->attempts.take_all();
  if (!left.empty())
    FERRY_LOG(ERROR, key_,
              "backend '" + name + "': its fini returned without completing " +
                  std::to_string(left.size()) + " transfer(s); they end now");
  for (auto& a : left)
    transfers_->complete(std::move(a), FERRY_ERR_BAD_STATE,
                         "backend removed: its fini returned without completing this transfer");
  if (metadata_) metadata_->republish_self();
  return {};
}

std::vector<std::string> EngineImpl::backend_names() const {
  std::vector<std::string> out;
  for (const auto& b : backends_.snapshot()) out.push_back(b->name);
  return out;
}

EngineDesc EngineImpl::desc() const {
  EngineDesc d;
  d.key = key_;
  d.host = config_.host;
  d.port = control_->port();
  d.node_id = node_id_;
  d.pid = static_cast<uint32_t>(::getpid());
  d.instance = instance_;
  d.secret = creds_.own();
  d.control_unix = control_->unix_name();
  for (const auto& b : backends_.snapshot()) d.backends[b->name] = b->conn_blob;
  return d;
}

void EngineImpl::route_control(const EngineDesc& d) {
  // Same host: its control plane's unix socket (ControlPlane::set_same_host_path).
  if (d.node_id == node_id_ && !d.control_unix.empty())
    if (ControlPlane* c = control_live_.load(std::memory_order_acquire))
      c->set_same_host_path(d.key, d.control_unix);
}

// ---- peers --------------------------------------------------------------------

Result EngineImpl::register_remote_engine(const EngineDesc& d) {
  if (Result r = registry_.check_peer(d); !r.ok()) return r;
  std::lock_guard lk(peers_mu_);
  // The descriptor registered (or learned) already: connectors repeat their
  // handshakes, and that must not tear down the peer's sessions.
  if (registry_.confirm_peer(d)) {
    // Known already (e.g. learned from its hello after a deregistration): fences
    // parked then are asked now (a new registration below does the same).
    transfers_->peer_registered(d.key, d.instance, /*only_parked=*/true);
    return {};
  }
  // A restarted peer: start afresh. The old life's unanswered fences stay
  // parked (a descriptor of that life registered again later - a stale entry
  // in a metadata store, two processes under one key - is fenced first); the
  // new life's transfers do not wait for them.
  // The same life with a changed descriptor (it loaded or removed a backend):
  // what it sent us and we have not popped yet is still its own, and stays.
  if (auto old = registry_.peer_instance(d.key))
    deregister_peer(d.key, *old == d.instance ? PeerFences::KEEP : PeerFences::PARK, {},
                    /*keep_inbound=*/*old == d.instance);
  Result r = registry_.add_peer(d);
  if (r.ok()) {
    route_control(d);
    transfers_->peer_registered(d.key, d.instance);
  }
  return r;
}

std::string EngineImpl::learn_peer(const EngineDesc& d) {
  if (Result r = registry_.check_peer(d); !r.ok()) return "cannot be learned: " + r.message;
  // Serialised with the application's (de)registrations: one key, one entry in
  // every backend at a time.
  std::lock_guard lk(peers_mu_);
  // Known already (registered, or learned by another connection of the same
  // life): this connection speaks for that key only if it proved the secret
  // known under it. A key is pinned to its secret (LinkAuth); a holder of our
  // descriptor who claims a key registered meanwhile gets nothing.
  std::vector<uint8_t> known;
  if (registry_.peer_secret(d.key, &known)) {
    if (known.size() == auth::kMacSize && d.secret.size() == auth::kMacSize &&
        auth::mac_equal(known.data(), d.secret.data()))
      return {};
    return "its key is known here under another secret (registered meanwhile, or another "
           "life of it)";
  }
  if (registry_.learned_peers() >= kMaxLearnedPeers)
    return std::to_string(kMaxLearnedPeers) +
           " engines learned from their hellos already (register it to reach it)";
  if (Result r = registry_.add_peer(d, /*learned=*/true); !r.ok()) return r.message;
  route_control(d);
  FERRY_LOG(INFO, key_,
            "learned engine '" + d.key +
                "' from its authenticated hello (it holds our "
                "descriptor; one-way registration)");
  return {};
}

Result EngineImpl::deregister_remote_engine(const std::string& key) {
  std::lock_guard lk(peers_mu_);
  return deregister_peer(key, PeerFences::PARK);
}

Result EngineImpl::deregister_peer(const std::string& key, PeerFences fences,
                                   const std::string& why, bool keep_inbound) {
  if (!registry_.remove_peer(key, why))
    return {StatusCode::ERR_NOT_FOUND, "engine '" + key + "' is not registered"};
  control_->forget_peer(key);
  if (fences != PeerFences::KEEP) transfers_->forget_fences(key, why, fences == PeerFences::PARK);
  health_->forget_peer(key);
  if (!keep_inbound) inbound_.forget_peer(key);
  return {};
}

TransferStatus EngineImpl::send_notification(const std::string& remote_key, std::string payload) {
  Messenger::Target t;
  t.key = remote_key;
  auto inst = registry_.peer_instance(remote_key);
  if (!inst || !registry_.peer_address(remote_key, t.host, t.port)) {
    TransferStatus s;
    s.Finish(StatusCode::ERR_NOT_FOUND, "engine '" + remote_key + "' is not registered");
    return s;
  }
  t.instance = *inst;
  return transfers_->send_message(t, std::move(payload));
}

// ---- stats ------------------------------------------------------------------------

EngineStats EngineImpl::stats() const {
  EngineStats s;
  s.backends = backends_.counter_values();
  for (const auto& b : backends_.snapshot()) read_live_info(*b, s.backends[b->name]);
  s.inbound_notifications = inbound_count_;
  s.inbound_dropped = inbound_.dropped();
  auto n = notif_inbox_.counts();
  s.notifications_received = n.received;
  s.notifications_refused = n.refused;
  s.notifications_unread = n.unread;
  s.ctrl_rejected = control_->rejected();
  s.ctrl_unix_connections = control_->unix_connections();
  const ControlPlane::NotifyCounts nc = control_->notify_counts();
  s.notifies_resent = nc.resent;
  s.notifies_unanswered = nc.unconfirmed;
  auto f = transfers_->fence_counts();
  s.fences = f.fences;
  s.fence_unknown = f.unknown;
  s.fenced_peers = f.gated;
  return s;
}

}  // namespace ferry
