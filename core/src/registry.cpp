// SPDX-License-Identifier: Apache-2.0
// The registry (registry.h): peers, local memory, imports of remote memory and
// the plugin handles made for them, behind one lock. Plugins are called with
// the lock released (they may call back into the core) and with the backend's
// life lock held: shared to make a handle, unique to free one.
#include "registry.h"

#include <algorithm>
#include <climits>

#include "auth.h"
#include "gpu_runtime.h"
#include "hot_path.h"
#include "log.h"

namespace ferry {

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

// Takes the handle `name` out of a handles map; nullptr when it had none.
void* take(HandleTable& handles, const std::string& name) {
  auto it = handles.find(name);
  if (it == handles.end()) return nullptr;
  void* h = it->second;
  handles.erase(it);
  return h;
}
}  // namespace

Registry::Registry(std::string self_key, uint64_t self_instance, std::string node_id,
                   BackendSet& backends)
    : self_key_(std::move(self_key)),
      self_instance_(self_instance),
      node_id_(std::move(node_id)),
      backends_(backends) {}

// ---- peers --------------------------------------------------------------------------

Result Registry::check_peer(const EngineDesc& d) const {
  if (d.key.empty() || d.key.size() > kMaxKeyBytes)
    return {StatusCode::ERR_INVALID_ARGS, "bad engine key"};
  if (d.key == self_key_)
    return {StatusCode::ERR_INVALID_ARGS, "cannot register an engine with itself"};
  if (d.port == 0) return {StatusCode::ERR_INVALID_ARGS, "engine descriptor has port 0"};
  return {};
}

Result Registry::add_peer(const EngineDesc& d, bool learned) {
  if (Result r = check_peer(d); !r.ok()) return r;
  auto p = std::make_shared<PeerEntry>();
  p->desc = d;
  p->learned = learned;
  p->same_host = d.node_id == node_id_;
  p->advertised = names_of(d.backends);
  HandleTable handles;
  std::map<std::string, std::string> unreachable;
  for (const auto& b : backends_.snapshot()) {
    auto it = d.backends.find(b->name);
    if (it == d.backends.end()) continue;
    ferry_peer_v1 pv = peer_view(d, p->same_host, it->second);
    void* h = nullptr;
    std::shared_lock life(b->life);
    if (b->removed) continue;
    int rc = b->ops->peer_add(b->ctx, &pv, &h);
    if (rc == FERRY_OK)
      handles[b->name] = h;
    else
      unreachable[b->name] = plugin_error_name(rc);
  }
  std::shared_ptr<PeerEntry> raced;
  {
    std::unique_lock lk(mu_);
    p->handles = std::move(handles);
    p->unreachable = std::move(unreachable);
    auto& slot = peers_[d.key];
    if (learned && slot) {
      raced = p;  // registered (or learned) meanwhile: that one stays
    } else {
      raced = slot;
      slot = p;
      gone_why_.erase(d.key);  // registered again: the old reason no longer applies
    }
  }
  // Two registrations of one key at once: the later one stays. The one it
  // replaced is released like a deregistered peer (its imports stay with the key).
  if (raced) {
    raced->gone = true;
    release_handles(raced->handles, [](Backend& b, void* h) { b.ops->peer_remove(b.ctx, h); });
    if (raced == p) return {StatusCode::ERR_BAD_STATE, "engine '" + d.key + "' is known already"};
  }
  return {};
}

bool Registry::confirm_peer(const EngineDesc& d) {
  std::shared_lock lk(mu_);
  auto it = peers_.find(d.key);
  if (it == peers_.end() || !(it->second->desc == d)) return false;
  it->second->learned = false;
  return true;
}

std::optional<bool> Registry::peer_learned(const std::string& key) const {
  std::shared_lock lk(mu_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return std::nullopt;
  return it->second->learned.load();
}

size_t Registry::learned_peers() const {
  std::shared_lock lk(mu_);
  size_t n = 0;
  for (const auto& [k, p] : peers_) n += p->learned ? 1 : 0;
  return n;
}

template <class Release>
void Registry::release_handles(HandleTable& handles, Release release) {
  for (const auto& b : backends_.snapshot()) {
    std::unique_lock life(b->life);  // no post() may be using the handle freed here
    if (b->removed) continue;        // its fini has freed what it made
    void* h;
    {
      std::unique_lock lk(mu_);
      h = take(handles, b->name);
    }
    if (h) release(*b, h);
  }
}

std::optional<uint64_t> Registry::peer_instance(const std::string& key) const {
  std::shared_lock lk(mu_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return std::nullopt;
  return it->second->desc.instance;
}

bool Registry::peer_secret(const std::string& key, std::vector<uint8_t>* secret,
                           bool* learned) const {
  std::shared_lock lk(mu_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return false;
  *secret = it->second->desc.secret;
  if (learned) *learned = it->second->learned;
  return true;
}

bool Registry::peer_address(const std::string& key, std::string& host, uint16_t& port) const {
  std::shared_lock lk(mu_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return false;
  host = it->second->desc.host;
  port = it->second->desc.port;
  return true;
}

bool Registry::remove_peer(const std::string& key, const std::string& why) {
  std::shared_ptr<PeerEntry> p;
  std::vector<std::shared_ptr<RemoteMem>> mems;
  {
    std::unique_lock lk(mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return false;
    p = it->second;
    p->gone_why = why;
    p->gone = true;
    if (!why.empty()) {
      if (gone_why_.size() >= kMaxGoneReasons) gone_why_.erase(gone_why_.begin());
      gone_why_[key] = why;
    }
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
  }
  for (const auto& b : backends_.snapshot()) {
    std::unique_lock life(b->life);  // no post() may be using the handles freed here
    if (b->removed) continue;
    void* ph;
    std::vector<void*> rhs;
    {
      std::unique_lock lk(mu_);
      ph = take(p->handles, b->name);
      for (auto& m : mems)
        if (void* h = take(m->handles, b->name)) rhs.push_back(h);
    }
    if (ph) b->ops->peer_remove(b->ctx, ph);
    for (void* h : rhs) b->ops->mem_release(b->ctx, h);
  }
  return true;
}

// ---- local memory -------------------------------------------------------------------

MemoryDesc Registry::register_memory(void* addr, size_t size, int device, MemoryLocation loc) {
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
  m->desc.engine_key = self_key_;
  m->desc.engine_instance = self_instance_;
  m->desc.location = loc;
  m->desc.device = loc == MemoryLocation::GPU ? device : -1;
  if (loc == MemoryLocation::GPU) {
    char bus[64] = {};
    if (gpu->device_bus_id(gpu->gpu_ctx, device, bus, sizeof bus) == FERRY_OK) m->desc.bus_id = bus;
  }
  m->desc.addr = reinterpret_cast<uint64_t>(addr);
  m->desc.size = size;
  {
    // Random ids: a region is reachable only through its descriptor, never by
    // counting from another one's id (docs/security.md).
    std::unique_lock lk(mu_);
    do {
      if (!auth::random_bytes(reinterpret_cast<uint8_t*>(&m->desc.id), sizeof m->desc.id))
        throw Error(StatusCode::ERR_BAD_STATE, "no random bytes for a memory id");
    } while (m->desc.id == 0 || local_mems_.count(m->desc.id));
  }
  // Nobody else sees `m` before it is published below: no lock for its maps.
  for (const auto& b : backends_.snapshot()) {
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
      FERRY_LOG(WARN, self_key_, b->name + " could not register memory: " + plugin_error_name(rc));
    }
  }
  std::unique_lock lk(mu_);
  local_mems_[m->desc.id] = m;
  return m->desc;
}

bool Registry::local_registered(const MemoryDesc& d) const {
  std::shared_lock lk(mu_);
  return d.engine_key == self_key_ && local_mems_.count(d.id) != 0;
}

Result Registry::deregister_memory(const MemoryDesc& d) {
  std::shared_ptr<LocalMem> m;
  {
    std::unique_lock lk(mu_);
    auto it = local_mems_.find(d.id);
    if (d.engine_key != self_key_ || it == local_mems_.end())
      return {StatusCode::ERR_NOT_FOUND,
              "memory " + std::to_string(d.id) + " is not registered here"};
    m = it->second;
    local_mems_.erase(it);
  }
  {
    // Every transfer ends by its deadline, so this wait is bounded.
    std::unique_lock lk(m->mu);
    m->draining = true;
    m->idle.wait(lk, [&] { return m->inflight == 0; });
  }
  // Its cached routes go too: an engine that registers and deregisters memory
  // for as long as it runs would otherwise keep entries for every region it
  // ever used in each remote import.
  {
    std::shared_lock lk(mu_);
    for_each_import_routes([&](RemoteMem& r) {
      r.routes.erase(r.routes.lower_bound({d.id, INT_MIN, INT_MIN}),
                     r.routes.upper_bound({d.id, INT_MAX, INT_MAX}));
    });
  }
  release_handles(m->handles, [](Backend& b, void* h) { b.ops->mem_deregister(b.ctx, h); });
  return {};
}

size_t Registry::cached_routes_of(uint64_t local_id) const {
  std::shared_lock lk(mu_);
  size_t n = 0;
  for_each_import_routes([&](RemoteMem& r) {
    for (const auto& [key, route] : r.routes) n += std::get<0>(key) == local_id;
  });
  return n;
}

template <class Fn>
void Registry::for_each_import_routes(Fn fn) const {
  const auto locked = [&](RemoteMem& r) {
    std::lock_guard<std::mutex> rl(r.route_mu);
    fn(r);
  };
  for (const auto& [key, r] : remote_mems_) locked(*r);
  for (const auto& [key, r] : retired_remote_mems_) locked(*r);
}

// ---- imports of remote memory -------------------------------------------------------

std::shared_ptr<RemoteMem> Registry::import_remote(const std::shared_ptr<PeerEntry>& peer,
                                                   const MemoryDesc& d) {
  auto r = std::make_shared<RemoteMem>();
  r->desc = d;
  for (const auto& [name, blob] : d.backends) r->advertised.insert(name);
  for (const auto& b : backends_.snapshot()) {
    auto blob = d.backends.find(b->name);
    if (blob == d.backends.end()) continue;
    std::shared_lock life(b->life);  // keeps the peer handle valid too
    if (b->removed) continue;
    void* ph;
    {
      std::shared_lock lk(mu_);
      auto h = peer->handles.find(b->name);
      if (h == peer->handles.end()) continue;
      ph = h->second;
    }
    void* rh = nullptr;
    int rc =
        b->ops->mem_import(b->ctx, ph, d.id, d.size, blob->second.data(), blob->second.size(), &rh);
    if (rc == FERRY_OK)
      r->handles[b->name] = rh;  // `r` is not published yet
    else
      FERRY_LOG(WARN, self_key_,
                b->name + " could not import memory " + std::to_string(d.id) + " of " +
                    d.engine_key + ": " + plugin_error_name(rc));
  }
  return r;
}

StatusCode Registry::resolve(const MemoryDesc& local, const MemoryDesc& remote, MemPair& out,
                             std::string& why) {
  {
    std::shared_lock lk(mu_);
    auto lm = local.engine_key == self_key_ ? local_mems_.find(local.id) : local_mems_.end();
    if (lm == local_mems_.end()) {
      why = "local memory " + std::to_string(local.id) + " of '" + local.engine_key +
            "' is not registered with engine '" + self_key_ + "'";
      return StatusCode::ERR_NOT_FOUND;
    }
    out.local = lm->second;
    auto p = peers_.find(remote.engine_key);
    if (p == peers_.end()) {
      why = "remote engine '" + remote.engine_key + "' is not registered with engine '" +
            self_key_ + "'";
      if (auto g = gone_why_.find(remote.engine_key); g != gone_why_.end())
        why += " (" + g->second + ")";
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
    auto r = remote_mems_.find(std::pair<std::string_view, uint64_t>(remote.engine_key, remote.id));
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

void Registry::release_remote(const std::shared_ptr<RemoteMem>& r) {
  release_handles(r->handles, [](Backend& b, void* h) { b.ops->mem_release(b.ctx, h); });
}

bool Registry::alive(const MemPair& pair) const {
  std::shared_lock lk(mu_);
  auto p = peers_.find(pair.peer->desc.key);
  auto l = local_mems_.find(pair.local->desc.id);
  return p != peers_.end() && p->second == pair.peer && l != local_mems_.end() &&
         l->second == pair.local;
}

std::string Registry::unusable(const MemPair& pair, const std::string& backend) const {
  std::shared_lock lk(mu_);
  if (!pair.peer->handles.count(backend)) {
    auto u = pair.peer->unreachable.find(backend);
    return "cannot reach the peer" + (u == pair.peer->unreachable.end() ? "" : ": " + u->second);
  }
  if (!pair.remote->handles.count(backend)) return "remote memory could not be imported";
  return {};
}

Registry::Advertised Registry::advertised(const MemPair& pair) const {
  std::shared_lock lk(mu_);
  return {pair.peer->advertised, pair.local->advertised, pair.remote->advertised};
}

FERRY_HOT bool Registry::handles(const MemPair& pair, const std::string& backend,
                                 Handles& out) const {
  std::shared_lock lk(mu_);
  auto p = pair.peer->handles.find(backend);
  auto l = pair.local->handles.find(backend);
  auto r = pair.remote->handles.find(backend);
  if (p == pair.peer->handles.end() || l == pair.local->handles.end() ||
      r == pair.remote->handles.end())
    return false;
  out = {p->second, l->second, r->second};
  return true;
}

// ---- backends coming and going --------------------------------------------------------

void Registry::attach(const BackendPtr& b) {
  std::vector<std::shared_ptr<PeerEntry>> peers;
  std::vector<std::shared_ptr<LocalMem>> mems;
  {
    std::shared_lock lk(mu_);
    for (auto& [k, p] : peers_) peers.push_back(p);
    for (auto& [k, m] : local_mems_) mems.push_back(m);
  }
  const std::string& name = b->name;
  std::map<PeerEntry*, std::pair<void*, std::string>> peer_results;
  for (auto& p : peers) {
    auto it = p->desc.backends.find(name);
    if (it == p->desc.backends.end()) continue;
    ferry_peer_v1 pv = peer_view(p->desc, p->same_host, it->second);
    void* h = nullptr;
    int rc = b->ops->peer_add(b->ctx, &pv, &h);
    peer_results[p.get()] = {rc == FERRY_OK ? h : nullptr,
                             rc == FERRY_OK ? "" : plugin_error_name(rc)};
  }
  std::map<LocalMem*, std::pair<void*, std::vector<uint8_t>>> mem_results;
  for (auto& m : mems) {
    ferry_mem_v1 mv = mem_view(*m);
    std::vector<uint8_t> blob(FERRY_MAX_BLOB);
    size_t len = blob.size();
    void* h = nullptr;
    if (b->ops->mem_register(b->ctx, &mv, &h, blob.data(), &len) == FERRY_OK &&
        len <= FERRY_MAX_BLOB) {
      blob.resize(len);
      mem_results[m.get()] = {h, std::move(blob)};
    }
  }
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
}

void Registry::detach(const BackendPtr& b) {
  // Collect under the lock, call the plugin outside it.
  std::vector<void*> remote_handles, local_handles, peer_handles;
  {
    std::unique_lock lk(mu_);
    for (auto& [k, r] : remote_mems_)
      if (void* h = take(r->handles, b->name)) remote_handles.push_back(h);
    for (auto& [k, r] : retired_remote_mems_)
      if (void* h = take(r->handles, b->name)) remote_handles.push_back(h);
    for (auto& [k, m] : local_mems_)
      if (void* h = take(m->handles, b->name)) local_handles.push_back(h);
    for (auto& [k, p] : peers_)
      if (void* h = take(p->handles, b->name)) peer_handles.push_back(h);
  }
  for (void* h : peer_handles) b->ops->peer_remove(b->ctx, h);
  for (void* h : remote_handles) b->ops->mem_release(b->ctx, h);
  for (void* h : local_handles) b->ops->mem_deregister(b->ctx, h);
}

}  // namespace ferry
