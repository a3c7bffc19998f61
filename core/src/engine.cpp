// The engine: its construction and teardown, backends (plugins), stats, and the
// public Engine facade - argument checks and forwarding, nothing else. The
// parts: registry.cpp (peers and memory), transfer.cpp (a transfer's life),
// host_services.cpp (what plugins may call), fence_serve.cpp (fences asked of
// this engine), session.cpp.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <random>

#include "engine_impl.h"
#include "gpu_runtime.h"
#include "log.h"
#include "node_id.h"

namespace ferry {

namespace {

std::string token_from(const EngineConfig& c) {
  if (!c.auth_token.empty()) return c.auth_token;
  const char* env = std::getenv("FERRY_AUTH_TOKEN");
  return env ? env : "";
}

}  // namespace

EngineImpl::EngineImpl(std::string key, EngineConfig config)
    : key_(std::move(key)), config_(std::move(config)), secret_(token_from(config_)) {
  if (key_.empty() || key_.size() > kMaxKeyBytes)
    throw Error(StatusCode::ERR_INVALID_ARGS, "engine key must be 1..255 bytes");
  node_id_ = config_.node_id.empty() ? default_node_id() : config_.node_id;
  std::random_device rd;
  while (instance_ == 0) instance_ = (uint64_t{rd()} << 32) ^ rd();
  std::string policy_file = config_.policy_file;
  if (policy_file.empty())
    if (const char* env = std::getenv("FERRY_POLICY"); env && *env) policy_file = env;
  policy_ = policy_file.empty() ? builtin_policy() : load_policy_file(policy_file);
  if (config_.timeout.count() > 0) policy_.timeout = config_.timeout;
  health_ = std::make_unique<Health>(policy_.quarantine);
  ControlPlane::Handlers h;
  h.is_known_peer = [this](const std::string& k) {
    std::shared_lock lk(mu_);
    return peers_.count(k) > 0;
  };
  h.on_plugin = [this](const std::string& peer, const std::string& plugin, const uint8_t* msg,
                       size_t len) {
    BackendPtr b;
    {
      std::shared_lock lk(mu_);
      for (const auto& x : backends_)
        if (x->name == plugin) b = x;
    }
    if (!b) {
      FERRY_LOG(WARN, key_, "control message for backend '" + plugin + "' which is not loaded");
      return;
    }
    std::shared_lock life(b->life);
    if (!b->removed) b->ops->on_ctrl(b->ctx, peer.c_str(), msg, len);
  };
  h.on_notify = [this](const std::string& peer, uint64_t uid, int32_t status) {
    inbound(peer.c_str(), uid, status);
  };
  h.on_fence = [this](const std::string& peer, const std::vector<FenceEntry>& entries,
                      uint64_t* instance) {
    *instance = instance_;
    return fence_inbound(peer, entries);
  };
  control_ =
      std::make_unique<ControlPlane>(key_, config_.host, config_.port, std::move(h), &secret_);
  fencer_ = std::make_unique<Fencer>(control_.get());
  async_ = std::make_unique<AsyncRunner>();
  if (secret_.enabled())
    FERRY_LOG(INFO, key_,
              "auth token set: peers must prove it on every control and data connection");
  std::string stats_path = config_.stats_socket;
  if (stats_path.empty())
    if (const char* env = std::getenv("FERRY_STATS_SOCKET"); env && *env) stats_path = env;
  if (!stats_path.empty()) {
    stats_server_ = std::make_unique<StatsServer>(expand_stats_path(stats_path, key_),
                                                  [this] { return stats_to_json(key_, stats()); });
    FERRY_LOG(INFO, key_, "stats on unix socket " + stats_server_->path() + " (ferry stats PATH)");
  }
}

EngineImpl::~EngineImpl() {
  shutting_down_ = true;
  stats_server_.reset();
  // Backends first: a plugin's fini may still send control messages (ctrl_send
  // uses control_), and control traffic arriving meanwhile finds them marked
  // removed and is dropped. Then the control plane.
  std::vector<std::string> names = backend_names();
  for (auto it = names.rbegin(); it != names.rend(); ++it) remove_backend(*it);
  async_.reset();   // waits for notifications on their way (they end their transfers)
  fencer_.reset();  // ends its fences (they use control_)
  control_.reset();
}

// ---- backends -----------------------------------------------------------------

Result EngineImpl::add_backend(const std::string& name, const std::string& settings_json) {
  {
    std::shared_lock lk(mu_);
    for (const auto& b : backends_)
      if (b->name == name)
        return {StatusCode::ERR_BAD_STATE, "backend '" + name + "' is already loaded"};
  }
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
  b->engine = this;
  init_host_services(*b);
  std::string settings = settings_json.empty() ? policy_.settings_for(name) : settings_json;
  char err[512] = {};
  int rc = b->ops->init(&b->host, key_.c_str(), node_id_.c_str(), settings.c_str(), &b->ctx, err,
                        sizeof err);
  if (rc != FERRY_OK)
    return {rc == FERRY_ERR_INVALID_ARGS ? StatusCode::ERR_INVALID_ARGS : StatusCode::ERR_BAD_STATE,
            "backend '" + name + "' failed to start: " + (err[0] ? err : plugin_error_name(rc))};
  std::vector<uint8_t> blob(FERRY_MAX_BLOB);
  size_t len = blob.size();
  rc = b->ops->conn_info(b->ctx, blob.data(), &len);
  if (rc != FERRY_OK || len > FERRY_MAX_BLOB) {
    b->ops->fini(b->ctx);
    return {StatusCode::ERR_BAD_STATE, "backend '" + name + "': conn_info failed"};
  }
  blob.resize(len);
  b->conn_blob = std::move(blob);

  // Tell the new backend about what already exists: peers and local memory.
  std::vector<std::shared_ptr<PeerEntry>> peers;
  std::vector<std::shared_ptr<LocalMem>> mems;
  {
    std::unique_lock lk(mu_);
    auto& c = counters_[name];
    if (!c) c = std::make_shared<BackendCounters>();
    b->counters = c;
    for (auto& [k, p] : peers_) peers.push_back(p);
    for (auto& [k, m] : local_mems_) mems.push_back(m);
  }
  std::map<PeerEntry*, std::pair<void*, std::string>> peer_results;
  for (auto& p : peers) {
    auto it = p->desc.backends.find(name);
    if (it == p->desc.backends.end()) continue;
    ferry_peer_v1 pv = peer_view(p->desc, p->same_host, it->second);
    void* h = nullptr;
    int prc = b->ops->peer_add(b->ctx, &pv, &h);
    peer_results[p.get()] = {prc == FERRY_OK ? h : nullptr,
                             prc == FERRY_OK ? "" : plugin_error_name(prc)};
  }
  std::map<LocalMem*, std::pair<void*, std::vector<uint8_t>>> mem_results;
  for (auto& m : mems) {
    ferry_mem_v1 mv = mem_view(*m);
    std::vector<uint8_t> mb(FERRY_MAX_BLOB);
    size_t ml = mb.size();
    void* h = nullptr;
    if (b->ops->mem_register(b->ctx, &mv, &h, mb.data(), &ml) == FERRY_OK && ml <= FERRY_MAX_BLOB) {
      mb.resize(ml);
      mem_results[m.get()] = {h, std::move(mb)};
    }
  }
  {
    std::unique_lock lk(mu_);
    for (auto& p : peers) {
      auto r = peer_results.find(p.get());
      if (r == peer_results.end()) continue;
      if (r->second.first)
        p->handles[name] = r->second.first;
      else
        p->unreachable[name] = r->second.second;
    }
    for (auto& m : mems) {
      auto r = mem_results.find(m.get());
      if (r == mem_results.end()) continue;
      m->handles[name] = r->second.first;
      m->desc.backends[name] = std::move(r->second.second);
      m->advertised.insert(name);
    }
    backends_.push_back(b);
    loaded_.emplace_back(name, b->caps);
    ++backend_generation_;
  }
  FERRY_LOG(INFO, key_, "backend '" + name + "' loaded from " + load.lib->path);
  return {};
}

void EngineImpl::release_backend_handles(const BackendPtr& b) {
  // Collect under the lock, call the plugin outside it.
  std::vector<void*> remote_handles, local_handles, peer_handles;
  {
    std::unique_lock lk(mu_);
    std::vector<std::shared_ptr<RemoteMem>> all;
    for (auto& [k, r] : remote_mems_) all.push_back(r);
    for (auto& [k, r] : retired_remote_mems_) all.push_back(r);
    for (auto& r : all) {
      auto it = r->handles.find(b->name);
      if (it != r->handles.end()) {
        remote_handles.push_back(it->second);
        r->handles.erase(it);
      }
    }
    for (auto& [k, m] : local_mems_) {
      auto it = m->handles.find(b->name);
      if (it != m->handles.end()) {
        local_handles.push_back(it->second);
        m->handles.erase(it);
      }
    }
    for (auto& [k, p] : peers_) {
      auto it = p->handles.find(b->name);
      if (it != p->handles.end()) {
        peer_handles.push_back(it->second);
        p->handles.erase(it);
      }
    }
  }
  for (void* h : peer_handles) b->ops->peer_remove(b->ctx, h);
  for (void* h : remote_handles) b->ops->mem_release(b->ctx, h);
  for (void* h : local_handles) b->ops->mem_deregister(b->ctx, h);
}

Result EngineImpl::remove_backend(const std::string& name) {
  BackendPtr b;
  {
    std::unique_lock lk(mu_);
    auto it = std::find_if(backends_.begin(), backends_.end(),
                           [&](const BackendPtr& x) { return x->name == name; });
    if (it == backends_.end())
      return {StatusCode::ERR_NOT_FOUND, "backend '" + name + "' is not loaded"};
    b = *it;
    backends_.erase(it);
    retired_backends_[name] = b;  // fence_inbound waits on its fini
    loaded_.erase(std::remove_if(loaded_.begin(), loaded_.end(),
                                 [&](const auto& l) { return l.first == name; }),
                  loaded_.end());
    ++backend_generation_;
  }
  std::unique_lock life(b->life);  // waits for calls in progress
  release_backend_handles(b);
  b->ops->fini(b->ctx);  // completes whatever was still pending
  b->removed = true;
  return {};
}

std::vector<std::string> EngineImpl::backend_names() const {
  std::shared_lock lk(mu_);
  std::vector<std::string> out;
  for (const auto& b : backends_) out.push_back(b->name);
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
  std::shared_lock lk(mu_);
  for (const auto& b : backends_) d.backends[b->name] = b->conn_blob;
  return d;
}

EngineStats EngineImpl::stats() const {
  EngineStats s;
  std::shared_lock lk(mu_);
  for (const auto& [name, c] : counters_) {
    BackendStats& b = s.backends[name];
    b.bytes = c->bytes;
    b.transfers = c->transfers;
    b.failures = c->failures;
    b.failovers = c->failovers;
    b.quarantines = c->quarantines;
  }
  s.inbound_notifications = inbound_count_;
  s.ctrl_rejected = control_ ? control_->rejected() : 0;
  if (fencer_) {
    auto f = fencer_->counts();
    s.fences = f.fences;
    s.fence_unknown = f.unknown;
    s.fenced_peers = f.gated;
  }
  return s;
}

// ---- the public facade ------------------------------------------------------------------

Engine::Engine(std::string key, EngineConfig config)
    : impl_(std::make_unique<EngineImpl>(std::move(key), std::move(config))) {}
Engine::~Engine() = default;
const std::string& Engine::key() const { return impl_->key_; }
Result Engine::add_backend(const std::string& name, const std::string& settings) {
  return impl_->add_backend(name, settings);
}
Result Engine::remove_backend(const std::string& name) { return impl_->remove_backend(name); }
std::vector<std::string> Engine::backends() const { return impl_->backend_names(); }
EngineDesc Engine::desc() const { return impl_->desc(); }
Result Engine::register_remote_engine(const EngineDesc& d) {
  return impl_->register_remote_engine(d);
}
Result Engine::deregister_remote_engine(const std::string& key) {
  return impl_->deregister_remote_engine(key);
}
MemoryDesc Engine::register_memory(void* addr, size_t size, int device, MemoryLocation loc) {
  return impl_->register_memory(addr, size, device, loc);
}
Result Engine::deregister_memory(const MemoryDesc& m) { return impl_->deregister_memory(m); }
TransferUid Engine::allocate_transfer_uid() { return impl_->next_uid_.fetch_add(1); }
std::optional<TransferStatus> Engine::pop_inbound_transfer_status(const std::string& remote_key,
                                                                  TransferUid uid) {
  return impl_->inbound_.pop(remote_key, uid);
}
std::optional<TransferStatus> Engine::wait_inbound_transfer_status(
    const std::string& remote_key, TransferUid uid, std::chrono::milliseconds timeout) {
  return impl_->inbound_.wait_pop(remote_key, uid, timeout);
}
EngineStats Engine::stats() const { return impl_->stats(); }
std::string Engine::policy_source() const { return impl_->policy_.source; }


namespace {
TransferStatus failed_at_once(StatusCode code, std::string msg) {
  TransferStatus s;
  s.Finish(code, std::move(msg));
  return s;
}
}  // namespace

// ---- the public transfer calls (the lifecycle is transfer.cpp) -----------------

TransferStatus Engine::read(const MemoryDesc& local, size_t loff, const MemoryDesc& remote,
                            size_t roff, size_t size, TransferUid uid, bool notify) {
  return impl_->submit(Op::READ, local, remote, &loff, &roff, &size, 1, uid, notify);
}

TransferStatus Engine::write(const MemoryDesc& local, size_t loff, const MemoryDesc& remote,
                             size_t roff, size_t size, TransferUid uid, bool notify) {
  return impl_->submit(Op::WRITE, local, remote, &loff, &roff, &size, 1, uid, notify);
}

namespace {
bool same_lengths(const std::vector<size_t>& a, const std::vector<size_t>& b,
                  const std::vector<size_t>& c) {
  return a.size() == b.size() && b.size() == c.size();
}
}  // namespace

TransferStatus Engine::batch_read(const MemoryDesc& local, const std::vector<size_t>& loffs,
                                  const MemoryDesc& remote, const std::vector<size_t>& roffs,
                                  const std::vector<size_t>& sizes, TransferUid uid, bool notify) {
  if (!same_lengths(loffs, roffs, sizes))
    return failed_at_once(StatusCode::ERR_INVALID_ARGS, "batch: offsets and sizes differ in length");
  return impl_->submit(Op::READ, local, remote, loffs.data(), roffs.data(), sizes.data(),
                       sizes.size(), uid, notify);
}

TransferStatus Engine::batch_write(const MemoryDesc& local, const std::vector<size_t>& loffs,
                                   const MemoryDesc& remote, const std::vector<size_t>& roffs,
                                   const std::vector<size_t>& sizes, TransferUid uid, bool notify) {
  if (!same_lengths(loffs, roffs, sizes))
    return failed_at_once(StatusCode::ERR_INVALID_ARGS, "batch: offsets and sizes differ in length");
  return impl_->submit(Op::WRITE, local, remote, loffs.data(), roffs.data(), sizes.data(),
                       sizes.size(), uid, notify);
}

}  // namespace ferry
