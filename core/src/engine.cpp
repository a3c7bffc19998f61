// Engine: backends (plugins), remote engines, memory registration, host services.
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

constexpr size_t kMaxKey = 255;

// ---- host services handed to every plugin instance --------------------------
// Each is noexcept with a catch-all: an exception must never unwind into a
// plugin's C frames (an allocation failure here is logged and the call dropped).
void host_failed(const char* what) noexcept {
  try {
    log_line(LogLevel::ERROR, "core", std::string("host callback ") + what + " failed");
  } catch (...) {
  }
}

void host_log(void* hctx, int level, const char* msg) noexcept {
  try {
    auto* b = static_cast<Backend*>(hctx);
    LogLevel l = level <= FERRY_LOG_ERROR  ? LogLevel::ERROR
                 : level == FERRY_LOG_WARN ? LogLevel::WARN
                 : level == FERRY_LOG_INFO ? LogLevel::INFO
                                           : LogLevel::DEBUG;
    if (log_enabled(l)) log_line(l, b->name, msg ? msg : "");
  } catch (...) {
  }
}

uint64_t host_now_ns(void*) noexcept {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

int host_ctrl_send(void* hctx, const char* peer, const void* msg, size_t len) noexcept {
  try {
    auto* b = static_cast<Backend*>(hctx);
    if (!peer || (!msg && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->ctrl_send(*b, peer, msg, len);
  } catch (...) {
    host_failed("ctrl_send");
    return FERRY_ERR_NO_MEMORY;
  }
}

void host_complete(void* hctx, void* xfer_ctx, int status, const char* message) noexcept {
  auto* b = static_cast<Backend*>(hctx);
  auto* ref = static_cast<std::shared_ptr<Attempt>*>(xfer_ctx);
  std::shared_ptr<Attempt> a = std::move(*ref);
  delete ref;
  try {
    if (a->settled.exchange(true)) {  // the watchdog already ended this attempt
      b->engine->late_completion(a);
      return;
    }
    b->engine->attempt_done(a, status, message ? message : "");
  } catch (...) {
    host_failed("complete");
    // Still end the transfer: its application must not wait forever.
    a->transfer->status.Finish(StatusCode::ERR_BAD_STATE, "internal error completing the transfer");
  }
}

void host_inbound(void* hctx, const char* peer, uint64_t uid, int status) noexcept {
  try {
    auto* b = static_cast<Backend*>(hctx);
    if (peer) b->engine->inbound(peer, uid, status);
  } catch (...) {
    host_failed("inbound");
  }
}

int host_auth_sign(void* hctx, const void* challenge, size_t len, uint8_t mac[32]) noexcept {
  try {
    auto* b = static_cast<Backend*>(hctx);
    if (!b || !mac || (!challenge && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->auth_sign(challenge, len, mac);
  } catch (...) {
    host_failed("auth_sign");
    return FERRY_ERR_INTERNAL;
  }
}

int host_auth_verify(void* hctx, const void* challenge, size_t len, const uint8_t mac[32]) noexcept {
  try {
    auto* b = static_cast<Backend*>(hctx);
    if (!b || !mac || (!challenge && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->auth_verify(challenge, len, mac);
  } catch (...) {
    host_failed("auth_verify");
    return FERRY_ERR_INTERNAL;
  }
}

std::string token_from(const EngineConfig& c) {
  if (!c.auth_token.empty()) return c.auth_token;
  const char* env = std::getenv("FERRY_AUTH_TOKEN");
  return env ? env : "";
}

// What a plugin is told about a peer and about a local region (pointers borrowed
// from the descriptor, valid while it lives).
ferry_peer_v1 peer_view(const EngineDesc& d, bool same_host, const std::vector<uint8_t>& blob) {
  ferry_peer_v1 pv{};
  pv.struct_size = sizeof pv;
  pv.key = d.key.c_str();
  pv.host = d.host.c_str();
  pv.node_id = d.node_id.c_str();
  pv.ctrl_port = d.port;
  pv.same_host = same_host;
  pv.conn_blob = blob.data();
  pv.conn_blob_len = blob.size();
  return pv;
}

ferry_mem_v1 mem_view(const LocalMem& m) {
  ferry_mem_v1 mv{};
  mv.struct_size = sizeof mv;
  mv.location = m.desc.location == MemoryLocation::GPU ? FERRY_MEM_GPU : FERRY_MEM_CPU;
  mv.id = m.desc.id;
  mv.addr = m.addr;
  mv.size = m.desc.size;
  mv.device = m.desc.device;
  return mv;
}

std::set<std::string> names_of(const std::map<std::string, std::vector<uint8_t>>& m) {
  std::set<std::string> s;
  for (const auto& [k, v] : m) s.insert(k);
  return s;
}

}  // namespace

StatusCode status_from_plugin(int rc) {
  switch (rc) {
    case FERRY_OK:
      return StatusCode::SUCCESS;
    case FERRY_ERR_INVALID_ARGS:
      return StatusCode::ERR_INVALID_ARGS;
    case FERRY_ERR_NOT_FOUND:
      return StatusCode::ERR_NOT_FOUND;
    case FERRY_ERR_BAD_STATE:
      return StatusCode::ERR_BAD_STATE;
    case FERRY_ERR_TIMEOUT:
      return StatusCode::ERR_TIMEOUT;
    case FERRY_ERR_GPU:
      return StatusCode::ERR_GPU_OP;
    default:
      return StatusCode::ERR_TRANSPORT;
  }
}

std::string plugin_error_name(int rc) {
  switch (rc) {
    case FERRY_ERR_INVALID_ARGS:
      return "invalid arguments";
    case FERRY_ERR_NOT_FOUND:
      return "not found";
    case FERRY_ERR_BAD_STATE:
      return "bad state";
    case FERRY_ERR_NO_MEMORY:
      return "out of memory";
    case FERRY_ERR_UNSUPPORTED:
      return "unsupported";
    case FERRY_ERR_TRANSPORT:
      return "transport error";
    case FERRY_ERR_TIMEOUT:
      return "timed out";
    case FERRY_ERR_REMOTE:
      return "refused by the target";
    case FERRY_ERR_GPU:
      return "GPU error";
    case FERRY_ERR_NO_DEVICE:
      return "no device";
    case FERRY_ERR_PROTOCOL:
      return "protocol error";
    case FERRY_ERR_NOT_SENT:
      return "not sent (the target was not reached)";
    default:
      return "error " + std::to_string(rc);
  }
}

EngineImpl::EngineImpl(std::string key, EngineConfig config)
    : key_(std::move(key)), config_(std::move(config)), secret_(token_from(config_)) {
  if (key_.empty() || key_.size() > kMaxKey)
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
  b->host.struct_size = sizeof(ferry_host_v1);
  b->host.host_ctx = b.get();
  b->host.log = host_log;
  b->host.now_ns = host_now_ns;
  b->host.ctrl_send = host_ctrl_send;
  b->host.complete = host_complete;
  b->host.inbound = host_inbound;
  b->host.auth_sign = host_auth_sign;
  b->host.auth_verify = host_auth_verify;
  b->host.gpu = gpu_runtime();
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

// ---- remote engines -------------------------------------------------------------

Result EngineImpl::register_remote_engine(const EngineDesc& d) {
  if (d.key.empty() || d.key.size() > kMaxKey)
    return {StatusCode::ERR_INVALID_ARGS, "bad engine key"};
  if (d.key == key_) return {StatusCode::ERR_INVALID_ARGS, "cannot register an engine with itself"};
  if (d.port == 0) return {StatusCode::ERR_INVALID_ARGS, "engine descriptor has port 0"};
  bool known;
  uint64_t old_instance = 0;
  {
    std::shared_lock lk(mu_);
    auto it = peers_.find(d.key);
    known = it != peers_.end();
    if (known) old_instance = it->second->desc.instance;
  }
  // A restarted peer: start afresh (its fence state too, when it is a new life).
  if (known) deregister_peer(d.key, /*keep_fence=*/old_instance == d.instance);

  auto p = std::make_shared<PeerEntry>();
  p->desc = d;
  p->same_host = d.node_id == node_id_;
  p->advertised = names_of(d.backends);
  std::vector<BackendPtr> bs;
  {
    std::shared_lock lk(mu_);
    bs = backends_;
  }
  for (const auto& b : bs) {
    auto it = d.backends.find(b->name);
    if (it == d.backends.end()) continue;
    ferry_peer_v1 pv = peer_view(d, p->same_host, it->second);
    void* h = nullptr;
    std::shared_lock life(b->life);
    if (b->removed) continue;
    int rc = b->ops->peer_add(b->ctx, &pv, &h);
    if (rc == FERRY_OK)
      p->handles[b->name] = h;
    else
      p->unreachable[b->name] = plugin_error_name(rc);
  }
  std::unique_lock lk(mu_);
  peers_[d.key] = p;
  return {};
}

Result EngineImpl::deregister_remote_engine(const std::string& key) {
  return deregister_peer(key, /*keep_fence=*/false);
}

Result EngineImpl::deregister_peer(const std::string& key, bool keep_fence) {
  std::shared_ptr<PeerEntry> p;
  std::vector<std::shared_ptr<RemoteMem>> mems;
  std::vector<BackendPtr> bs;
  {
    std::unique_lock lk(mu_);
    auto it = peers_.find(key);
    if (it == peers_.end())
      return {StatusCode::ERR_NOT_FOUND, "engine '" + key + "' is not registered"};
    p = it->second;
    p->gone = true;
    peers_.erase(it);
    for (auto r = remote_mems_.begin(); r != remote_mems_.end();) {
      if (r->first.first == key) {
        mems.push_back(r->second);
        r = remote_mems_.erase(r);
      } else {
        ++r;
      }
    }
    auto [rb, re] = retired_remote_mems_.equal_range(key);
    for (auto r = rb; r != re; ++r) mems.push_back(r->second);
    retired_remote_mems_.erase(rb, re);
    bs = backends_;
  }
  control_->forget_peer(key);
  if (!keep_fence) fencer_->reset(key);
  for (const auto& b : bs) {
    std::unique_lock life(b->life);  // no post() may be using the handles freed here
    if (b->removed) continue;
    void* ph = nullptr;
    std::vector<void*> rhs;
    {
      std::unique_lock lk(mu_);
      if (auto h = p->handles.find(b->name); h != p->handles.end()) {
        ph = h->second;
        p->handles.erase(h);
      }
      for (auto& m : mems)
        if (auto h = m->handles.find(b->name); h != m->handles.end()) {
          rhs.push_back(h->second);
          m->handles.erase(h);
        }
    }
    if (ph) b->ops->peer_remove(b->ctx, ph);
    for (void* h : rhs) b->ops->mem_release(b->ctx, h);
  }
  health_->forget_peer(key);
  inbound_.forget_peer(key);
  return {};
}

// ---- memory -----------------------------------------------------------------------

MemoryDesc EngineImpl::register_memory(void* addr, size_t size, int device, MemoryLocation loc) {
  if (!addr) throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: null address");
  if (size == 0) throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: size 0");
  if (reinterpret_cast<uintptr_t>(addr) + size < reinterpret_cast<uintptr_t>(addr))
    throw Error(StatusCode::ERR_INVALID_ARGS, "register_memory: range wraps");
  // Where the memory lives: the caller says, or the GPU runtime tells from the pointer.
  const ferry_gpu_v1* gpu = gpu_runtime();
  if (gpu) {
    int32_t found = -1;
    if (gpu->pointer_device(gpu->gpu_ctx, addr, &found) == FERRY_OK && found >= 0) {
      loc = MemoryLocation::GPU;  // device memory is GPU memory whatever the caller said
      device = found;
    }
  }
  if (loc == MemoryLocation::UNKNOWN) loc = MemoryLocation::CPU;
  if (loc == MemoryLocation::GPU && (!gpu || device < 0 || device >= gpu->device_count))
    throw Error(StatusCode::ERR_GPU_OP,
                std::string("register_memory: GPU memory given but ") +
                    (gpu ? "the pointer is not device memory and no valid device was given"
                         : "no GPU runtime (libcudart / libamdhip64) could be loaded"));
  auto m = std::make_shared<LocalMem>();
  m->addr = addr;
  m->desc.engine_key = key_;
  m->desc.engine_instance = instance_;
  m->desc.location = loc;
  m->desc.device = loc == MemoryLocation::GPU ? device : -1;
  if (loc == MemoryLocation::GPU) {
    char bus[64] = {};
    if (gpu->device_bus_id(gpu->gpu_ctx, device, bus, sizeof bus) == FERRY_OK) m->desc.bus_id = bus;
  }
  m->desc.addr = reinterpret_cast<uint64_t>(addr);
  m->desc.size = size;
  std::vector<BackendPtr> bs;
  {
    std::unique_lock lk(mu_);
    m->desc.id = next_mem_id_++;
    bs = backends_;
  }
  for (const auto& b : bs) {
    ferry_mem_v1 mv = mem_view(*m);
    std::vector<uint8_t> blob(FERRY_MAX_BLOB);
    size_t len = blob.size();
    void* h = nullptr;
    std::shared_lock life(b->life);
    if (b->removed) continue;
    int rc = b->ops->mem_register(b->ctx, &mv, &h, blob.data(), &len);
    if (rc == FERRY_OK && len <= FERRY_MAX_BLOB) {
      blob.resize(len);
      m->desc.backends[b->name] = std::move(blob);
      m->handles[b->name] = h;
      m->advertised.insert(b->name);
    } else if (rc != FERRY_ERR_UNSUPPORTED) {
      FERRY_LOG(WARN, key_, b->name + " could not register memory: " + plugin_error_name(rc));
    }
  }
  std::unique_lock lk(mu_);
  local_mems_[m->desc.id] = m;
  return m->desc;
}

Result EngineImpl::deregister_memory(const MemoryDesc& d) {
  std::shared_ptr<LocalMem> m;
  {
    std::unique_lock lk(mu_);
    auto it = local_mems_.find(d.id);
    if (d.engine_key != key_ || it == local_mems_.end())
      return {StatusCode::ERR_NOT_FOUND,
              "memory " + std::to_string(d.id) + " is not registered here"};
    m = it->second;
    local_mems_.erase(it);
  }
  {
    // Every transfer ends by its deadline, so this wait is bounded.
    std::unique_lock lk(m->mu);
    m->idle.wait(lk, [&] { return m->inflight == 0; });
  }
  std::vector<BackendPtr> bs;
  {
    std::shared_lock lk(mu_);
    bs = backends_;
  }
  for (const auto& b : bs) {
    std::unique_lock life(b->life);  // no post() may be using the handle freed here
    if (b->removed) continue;
    void* h = nullptr;
    {
      std::unique_lock lk(mu_);
      auto it = m->handles.find(b->name);
      if (it == m->handles.end()) continue;
      h = it->second;
      m->handles.erase(it);
    }
    b->ops->mem_deregister(b->ctx, h);
  }
  return {};
}

// ---- host services ------------------------------------------------------------------

int EngineImpl::ctrl_send(Backend& b, const char* peer_key, const void* msg, size_t len) {
  std::string host;
  uint16_t port = 0;
  {
    std::shared_lock lk(mu_);
    auto it = peers_.find(peer_key);
    if (it == peers_.end()) return FERRY_ERR_NOT_FOUND;
    host = it->second->desc.host;
    port = it->second->desc.port;
  }
  std::string err;
  int rc =
      control_->send(peer_key, host, port, CtrlType::PLUGIN, plugin_body(b.name, msg, len), &err);
  if (rc != FERRY_OK)
    FERRY_LOG(WARN, b.name, "control message to " + std::string(peer_key) + " failed: " + err);
  return rc;
}

void EngineImpl::inbound(const char* peer_key, uint64_t uid, int status) {
  if (status != FERRY_OK) {
    // Only landings are recorded: a failed attempt may be retried elsewhere.
    FERRY_LOG(DEBUG, key_,
              "inbound transfer " + std::to_string(uid) + " from " + peer_key +
                  " failed on the target: " + plugin_error_name(status));
    return;
  }
  if (inbound_.land(peer_key, uid, StatusCode::SUCCESS)) ++inbound_count_;
}

int EngineImpl::auth_sign(const void* challenge, size_t len, uint8_t mac[32]) const {
  if (!secret_.enabled()) return FERRY_ERR_UNSUPPORTED;
  return secret_.sign(challenge, len, mac) ? FERRY_OK : FERRY_ERR_INTERNAL;
}

int EngineImpl::auth_verify(const void* challenge, size_t len, const uint8_t mac[32]) const {
  if (!secret_.enabled()) return FERRY_ERR_UNSUPPORTED;
  return secret_.verify(challenge, len, mac) ? FERRY_OK : FERRY_ERR_REMOTE;
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

// ---- fences asked of this engine by an initiator ---------------------------------

std::vector<FenceResult> EngineImpl::fence_inbound(const std::string& peer,
                                                   const std::vector<FenceEntry>& entries) {
  // How long a plugin may take to make its lanes pass their fence check.
  constexpr auto kServeFor = std::chrono::seconds(5);
  std::vector<FenceResult> out(entries.size());
  std::map<std::string, std::vector<size_t>> by_backend;
  for (size_t i = 0; i < entries.size(); ++i) {
    out[i] = {entries[i].attempt, FenceState::UNSUPPORTED, 0};
    by_backend[entries[i].backend].push_back(i);
  }
  for (const auto& [name, idx] : by_backend) {
    BackendPtr b, retired;
    {
      std::shared_lock lk(mu_);
      for (const auto& x : backends_)
        if (x->name == name) b = x;
      if (auto r = retired_backends_.find(name); !b && r != retired_backends_.end())
        retired = r->second;
    }
    if (!b) {
      // Not loaded here now. Removed: once its fini has returned (the life lock
      // is free) its lanes are gone and nothing more of it lands, though part may
      // have. Never loaded here: none of it could land.
      FenceState st = FenceState::NONE;
      if (retired) {
        std::shared_lock life(retired->life);
        st = FenceState::PARTIAL;
      }
      for (size_t i : idx) out[i].state = st;
      continue;
    }
    if (!(b->caps & FERRY_CAP_FENCE)) continue;
    std::vector<uint64_t> ids;
    for (size_t i : idx) ids.push_back(entries[i].attempt);
    std::vector<ferry_fence_result_v1> res(ids.size());
    const uint64_t deadline =
        host_now_ns(nullptr) +
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(kServeFor).count());
    int rc;
    {
      std::shared_lock life(b->life);
      if (b->removed) continue;
      rc = b->ops->fence(b->ctx, peer.c_str(), ids.data(), ids.size(), deadline, res.data());
    }
    for (size_t k = 0; k < idx.size(); ++k) {
      FenceResult& r = out[idx[k]];
      if (rc != FERRY_OK || res[k].state > FERRY_FENCE_WHOLE) {
        r.state = FenceState::UNKNOWN;
        continue;
      }
      r.state = static_cast<FenceState>(res[k].state);
      r.landed = res[k].landed_bytes;
    }
  }
  return out;
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

}  // namespace ferry
