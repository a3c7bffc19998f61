// The registry: remote engines (peers) and local and remote memory. Descriptors
// are validated and imported here; transfers find their (local, remote) pair
// through resolve() and never touch the maps themselves.
#include <algorithm>

#include "engine_impl.h"
#include "gpu_runtime.h"
#include "log.h"

namespace ferry {

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

namespace {
std::set<std::string> names_of(const std::map<std::string, std::vector<uint8_t>>& m) {
  std::set<std::string> s;
  for (const auto& [k, v] : m) s.insert(k);
  return s;
}
}  // namespace


// ---- remote engines -------------------------------------------------------------

Result EngineImpl::register_remote_engine(const EngineDesc& d) {
  if (d.key.empty() || d.key.size() > kMaxKeyBytes)
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


// ---- imports of remote memory -------------------------------------------------------

std::shared_ptr<RemoteMem> EngineImpl::import_remote(const std::shared_ptr<PeerEntry>& peer,
                                                     const MemoryDesc& d) {
  auto r = std::make_shared<RemoteMem>();
  r->desc = d;
  for (const auto& [name, blob] : d.backends) r->advertised.insert(name);
  std::vector<BackendPtr> bs;
  {
    std::shared_lock lk(mu_);
    bs = backends_;
  }
  for (const auto& b : bs) {
    auto blob = d.backends.find(b->name);
    if (blob == d.backends.end()) continue;
    void* ph;
    {
      std::shared_lock lk(mu_);
      auto h = peer->handles.find(b->name);
      if (h == peer->handles.end()) continue;
      ph = h->second;
    }
    std::shared_lock life(b->life);
    if (b->removed) continue;
    void* rh = nullptr;
    int rc =
        b->ops->mem_import(b->ctx, ph, d.id, d.size, blob->second.data(), blob->second.size(), &rh);
    if (rc == FERRY_OK)
      r->handles[b->name] = rh;
    else
      FERRY_LOG(WARN, key_,
                b->name + " could not import memory " + std::to_string(d.id) + " of " +
                    d.engine_key + ": " + plugin_error_name(rc));
  }
  return r;
}

StatusCode EngineImpl::resolve(const MemoryDesc& local, const MemoryDesc& remote, MemPair& out,
                               std::string& why) {
  {
    std::shared_lock lk(mu_);
    auto lm = local.engine_key == key_ ? local_mems_.find(local.id) : local_mems_.end();
    if (lm == local_mems_.end()) {
      why = "local memory " + std::to_string(local.id) + " of '" + local.engine_key +
            "' is not registered with engine '" + key_ + "'";
      return StatusCode::ERR_NOT_FOUND;
    }
    out.local = lm->second;
    auto p = peers_.find(remote.engine_key);
    if (p == peers_.end()) {
      why =
          "remote engine '" + remote.engine_key + "' is not registered with engine '" + key_ + "'";
      return StatusCode::ERR_NOT_FOUND;
    }
    out.peer = p->second;
    const uint64_t now = out.peer->desc.instance;
    if (remote.engine_instance != 0 && now != 0 && remote.engine_instance != now) {
      // Same key and id, but registered by an earlier life of the engine: its
      // memory ids start over, so this id may name other memory now.
      why = "memory descriptor " + std::to_string(remote.id) + " of '" + remote.engine_key +
            "' is from a previous instance of that engine (it restarted); ask it for a fresh one";
      return StatusCode::ERR_NOT_FOUND;
    }
    auto r = remote_mems_.find({remote.engine_key, remote.id});
    // A descriptor that no longer matches the cached one (re-registered memory) is re-imported.
    if (r != remote_mems_.end() && r->second->desc.addr == remote.addr &&
        r->second->desc.size == remote.size && r->second->desc.location == remote.location &&
        r->second->desc.device == remote.device && r->second->desc.backends == remote.backends) {
      out.remote = r->second;
      return StatusCode::SUCCESS;
    }
  }
  auto fresh = import_remote(out.peer, remote);
  {
    std::unique_lock lk(mu_);
    auto p = peers_.find(remote.engine_key);
    if (p != peers_.end() && p->second == out.peer) {
      auto& slot = remote_mems_[{remote.engine_key, remote.id}];
      // Transfers in flight may still use the old import; it is released with the peer.
      if (slot) retired_remote_mems_.emplace(remote.engine_key, slot);
      slot = fresh;
      out.remote = fresh;
      return StatusCode::SUCCESS;
    }
  }
  why = "remote engine '" + remote.engine_key + "' was deregistered";
  release_remote(fresh);
  return StatusCode::ERR_NOT_FOUND;
}

void EngineImpl::release_remote(const std::shared_ptr<RemoteMem>& r) {
  std::vector<BackendPtr> bs;
  {
    std::shared_lock lk(mu_);
    bs = backends_;
  }
  for (const auto& b : bs) {
    void* h = nullptr;
    {
      std::unique_lock lk(mu_);
      auto it = r->handles.find(b->name);
      if (it == r->handles.end()) continue;
      h = it->second;
      r->handles.erase(it);
    }
    std::unique_lock life(b->life);  // no post() may be using the handle
    if (!b->removed) b->ops->mem_release(b->ctx, h);
  }
}

}  // namespace ferry
