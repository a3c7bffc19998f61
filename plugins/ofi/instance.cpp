// SPDX-License-Identifier: Apache-2.0
#include "instance.h"

#include <rdma/fi_domain.h>

#include <cstdio>
#include <cstring>

#include "blob.h"
#include "log.h"

namespace ferry_ofi {
namespace {

bool MatchesProvider(const std::string& have, const std::string& want) {
  return have == want || have.rfind(want + ";", 0) == 0;
}

// Providers the automatic choice never takes: slow emulations and test layers.
bool AutoSkips(const std::string& name) {
  return name == "shm" || name == "sockets" || name.find("ofi_rxd") != std::string::npos ||
         name.find("hook") != std::string::npos;
}

bool InRange(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

}  // namespace

Instance::Instance(const ferry_host_v1* host, std::string engine_key, Settings settings)
    : host_(host), engine_key_(std::move(engine_key)), settings_(std::move(settings)) {}

Instance::~Instance() {
  for (auto& ep : eps_) ep->Stop(FERRY_ERR_BAD_STATE, "ofi plugin shutting down");
  for (auto& ep : eps_) ep->CloseEp();
  // Transfers and their stages go back to the pool, whose registrations close
  // before the domains do.
  for (auto& ep : eps_) ep->DropOps();
  if (pool_) pool_->Close();
  {
    std::lock_guard lk(handles_mu_);
    for (RemoteMem* r : remotes_) {
      if (r->mapped) r->ep->UnmapKey(r->rkey);
      delete r;
    }
    for (LocalMem* m : locals_) {
      CloseMrs(m);
      delete m;
    }
    for (PeerHandle* p : peers_) delete p;
    remotes_.clear();
    locals_.clear();
    peers_.clear();
  }
  eps_.clear();
}

std::unique_ptr<Instance> Instance::Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                           std::string* why) {
  return ferry::plugin_kit::ParseAndStart<Instance, Settings>(a, ParseSettings, FERRY_ERR_NO_DEVICE,
                                                              code, why);
}

bool Instance::Start(std::string* err) {
  std::string why;
  std::vector<std::string> names;                 // distinct provider names, in fi_getinfo's order
  std::vector<std::vector<std::string>> domains;  // ... and their domains
  if (fi_info* all = GetInfo(nullptr, nullptr, false, &why)) {
    for (fi_info* i = all; i != nullptr; i = i->next) {
      const std::string name = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
      const std::string dom = i->domain_attr->name ? i->domain_attr->name : "?";
      size_t k = 0;
      while (k < names.size() && names[k] != name) ++k;
      if (k == names.size()) {
        names.push_back(name);
        domains.emplace_back();
      }
      bool seen = false;
      for (const auto& d : domains[k]) seen |= d == dom;
      if (!seen) domains[k].push_back(dom);
    }
    fi_freeinfo(all);
    for (size_t k = 0; k < names.size(); ++k) {
      offered_ += (k ? ", " : "") + names[k] + "[";
      for (size_t d = 0; d < domains[k].size(); ++d) offered_ += (d ? "," : "") + domains[k][d];
      offered_ += "]";
    }
  } else {
    offered_ = "nothing (" + why + ")";
  }
  std::vector<std::string> wanted = settings_.providers;
  if (wanted.empty()) {
    // Automatic: shm for peers on this host, then the first other provider.
    for (const auto& n : names) {
      if (n == "shm") wanted.push_back(n);
    }
    for (const auto& n : names) {
      if (!AutoSkips(n)) {
        wanted.push_back(n);
        break;
      }
    }
  }
  std::string reasons;
  for (const auto& name : wanted) {
    if (!OpenProvider(name, &why)) {
      reasons += (reasons.empty() ? "" : "; ") + why;
      Log(host_, settings_.providers.empty() ? FERRY_LOG_INFO : FERRY_LOG_WARN, "%s", why.c_str());
    }
  }
  if (eps_.empty()) {
    *err = "no libfabric provider could be opened" +
           (reasons.empty() ? std::string() : " (" + reasons + ")") +
           "; the fabric offers RDM+RMA through: " + (offered_.empty() ? "nothing" : offered_);
    return false;
  }
  const ferry_gpu_v1* gpu = FERRY_HAS_FIELD(ferry_host_v1, host_, gpu) ? host_->gpu : nullptr;
  if (gpu != nullptr) {
    pool_ =
        std::make_shared<StagePool>(host_, settings_.gpu_stage_bytes, settings_.gpu_pinned_bytes);
    std::vector<Endpoint*> raw;
    for (size_t i = 0; i < eps_.size(); ++i) {
      raw.push_back(eps_[i].get());
      eps_[i]->SetStaging(pool_, i);
    }
    pool_->SetEndpoints(raw, [this] {
      for (auto& ep : eps_) ep->Wake();
    });
  }
  for (auto& ep : eps_) ep->Start();
  return true;
}

bool Instance::OpenProvider(const std::string& name, std::string* why) {
  const bool is_shm = name == "shm";
  const char* node =
      !is_shm && !settings_.listen_host.empty() ? settings_.listen_host.c_str() : nullptr;
  auto pick = [&](fi_info* list) -> const fi_info* {
    for (fi_info* i = list; i != nullptr; i = i->next) {
      const std::string pn = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "";
      if (!MatchesProvider(pn, name)) continue;
      if (!is_shm && !settings_.domain.empty() &&
          (i->domain_attr->name == nullptr || settings_.domain != i->domain_attr->name))
        continue;
      return i;
    }
    return nullptr;
  };
  fi_info* list = GetInfo(name.c_str(), node, false, why);
  if (list == nullptr) return false;
  const fi_info* info = pick(list);
  if (info == nullptr) {
    *why = "provider " + name + " offers no domain named '" + settings_.domain + "'";
    fi_freeinfo(list);
    return false;
  }
  const std::string actual = info->fabric_attr->prov_name;
  for (const auto& ep : eps_) {
    if (ep->provider() == actual) {
      fi_freeinfo(list);
      *why = "provider " + actual + " is listed twice";
      return false;
    }
  }
  std::unique_ptr<Endpoint> ep = Endpoint::Open(host_, info, settings_, why);
  fi_freeinfo(list);
  if (!ep) return false;
  if (ep->polled()) {
    // No wait fd: count remote RMA events, so the progress thread can tell
    // activity from idleness (optional; the endpoint works without).
    std::string ignored;
    if (fi_info* l2 = GetInfo(name.c_str(), node, true, &ignored)) {
      if (const fi_info* i2 = pick(l2)) {
        ep.reset();
        ep = Endpoint::Open(host_, i2, settings_, why);
      }
      fi_freeinfo(l2);
      if (!ep) return false;
    }
  }
  Log(host_, FERRY_LOG_DEBUG, "opened %s", ep->Describe().c_str());
  eps_.push_back(std::move(ep));
  return true;
}

size_t Instance::IndexOf(const Endpoint* ep) const {
  for (size_t i = 0; i < eps_.size(); ++i) {
    if (eps_[i].get() == ep) return i;
  }
  return eps_.size();
}

void Instance::CloseMrs(LocalMem* m) {
  for (fid_mr*& mr : m->mrs) {
    if (mr != nullptr) fi_close(&mr->fid);
    mr = nullptr;
  }
}

int Instance::ConnInfo(void* buf, size_t* len) {
  if (buf == nullptr || len == nullptr) return FERRY_ERR_INVALID_ARGS;
  blob::ConnInfo ci;
  for (const auto& ep : eps_) {
    blob::EpInfo e;
    e.provider = ep->provider();
    e.doorbell = ep->doorbell_name();
    e.addr_format = ep->addr_format();
    e.addr = ep->addr();
    ci.eps.push_back(std::move(e));
  }
  const std::vector<uint8_t> b = blob::EncodeConn(ci);
  if (*len < b.size()) return FERRY_ERR_INVALID_ARGS;
  std::memcpy(buf, b.data(), b.size());
  *len = b.size();
  return FERRY_OK;
}

int Instance::PeerAdd(const ferry_peer_v1* p, void** handle) {
  if (p == nullptr || handle == nullptr || !FERRY_HAS_FIELD(ferry_peer_v1, p, conn_blob_len) ||
      p->key == nullptr || p->key[0] == '\0') {
    return FERRY_ERR_INVALID_ARGS;
  }
  if (p->conn_blob_len == 0 || p->conn_blob == nullptr) return FERRY_ERR_NOT_FOUND;
  blob::ConnInfo ci;
  std::string why;
  if (!blob::DecodeConn(p->conn_blob, p->conn_blob_len, &ci, &why)) {
    Log(host_, FERRY_LOG_WARN, "peer %s: %s", p->key, why.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  const bool same_host = p->same_host != 0;
  std::string tried;
  for (const auto& ep : eps_) {
    if (ep->provider() == "shm" && !same_host) {
      tried += "; shm: the peer is on another host";
      continue;
    }
    const blob::EpInfo* theirs = nullptr;
    for (const auto& e : ci.eps) {
      if (e.provider == ep->provider()) theirs = &e;
    }
    if (theirs == nullptr) {
      tried += "; " + ep->provider() + ": the peer did not open it";
      continue;
    }
    std::shared_ptr<PeerEp> pe;
    if (ep->InsertPeer(p->key, *theirs, &pe, &why) != FERRY_OK) {
      tried += "; " + why;
      continue;
    }
    auto h = std::make_unique<PeerHandle>();
    h->ep = std::move(pe);
    Log(host_, FERRY_LOG_DEBUG, "peer %s: through %s", p->key, ep->provider().c_str());
    std::lock_guard lk(handles_mu_);
    peers_.insert(h.get());
    *handle = h.release();
    return FERRY_OK;
  }
  std::string theirs;
  for (const auto& e : ci.eps) theirs += (theirs.empty() ? "" : ", ") + e.provider;
  Log(host_, FERRY_LOG_WARN, "peer %s cannot be reached (it opened %s)%s", p->key, theirs.c_str(),
      tried.c_str());
  return FERRY_ERR_UNSUPPORTED;
}

void Instance::PeerRemove(void* handle) {
  auto* h = static_cast<PeerHandle*>(handle);
  if (h == nullptr) return;
  {
    std::lock_guard lk(handles_mu_);
    if (peers_.erase(h) == 0) return;
  }
  h->ep->ep->RemovePeer(h->ep);
  delete h;
}

int Instance::MemRegister(const ferry_mem_v1* m, void** handle, void* blob_out, size_t* blob_len) {
  if (m == nullptr || handle == nullptr || !FERRY_HAS_FIELD(ferry_mem_v1, m, size)) {
    return FERRY_ERR_INVALID_ARGS;
  }
  if ((m->location != FERRY_MEM_CPU && m->location != FERRY_MEM_GPU) || m->addr == nullptr ||
      m->size == 0 || blob_out == nullptr || blob_len == nullptr) {
    return FERRY_ERR_INVALID_ARGS;
  }
  if (m->location == FERRY_MEM_GPU) return RegisterGpu(m, handle, blob_out, blob_len);
  auto h = std::make_unique<LocalMem>();
  h->id = m->id;
  h->addr = static_cast<uint8_t*>(m->addr);
  h->size = m->size;
  h->mrs.assign(eps_.size(), nullptr);
  blob::MemInfo mi;
  mi.id = m->id;
  mi.size = m->size;
  std::string why;
  int rc = FERRY_ERR_TRANSPORT;
  for (size_t i = 0; i < eps_.size(); ++i) {
    blob::MemKey key;
    rc = eps_[i]->RegisterMr(m->addr, m->size, &h->mrs[i], &key, &why);
    if (rc != FERRY_OK) {
      Log(host_, FERRY_LOG_WARN, "memory %llu: %s", static_cast<unsigned long long>(m->id),
          why.c_str());
      continue;
    }
    mi.keys.push_back(std::move(key));
  }
  if (mi.keys.empty()) return rc;
  const std::vector<uint8_t> b = blob::EncodeMem(mi);
  if (b.size() > *blob_len) {
    CloseMrs(h.get());
    return FERRY_ERR_INVALID_ARGS;
  }
  std::memcpy(blob_out, b.data(), b.size());
  *blob_len = b.size();
  std::lock_guard lk(handles_mu_);
  locals_.insert(h.get());
  *handle = h.release();
  return FERRY_OK;
}

int Instance::RegisterGpu(const ferry_mem_v1* m, void** handle, void* blob_out, size_t* blob_len) {
  if (!pool_) {
    Log(host_, FERRY_LOG_INFO, "memory %llu: GPU memory needs the GPU runtime, which is not loaded",
        static_cast<unsigned long long>(m->id));
    return FERRY_ERR_UNSUPPORTED;
  }
  if (m->device < 0) return FERRY_ERR_INVALID_ARGS;
  // Usable as the LOCAL side only (staged here); the blob tells importers it
  // is not remotely accessible, so no peer routes an RMA into it over ofi.
  auto h = std::make_unique<LocalMem>();
  h->id = m->id;
  h->addr = static_cast<uint8_t*>(m->addr);
  h->size = m->size;
  h->mrs.assign(eps_.size(), nullptr);
  h->gpu = true;
  h->device = m->device;
  blob::MemInfo mi;
  mi.id = m->id;
  mi.size = m->size;
  mi.gpu_local_only = true;
  const std::vector<uint8_t> b = blob::EncodeMem(mi);
  if (b.size() > *blob_len) return FERRY_ERR_INVALID_ARGS;
  std::memcpy(blob_out, b.data(), b.size());
  *blob_len = b.size();
  std::lock_guard lk(handles_mu_);
  locals_.insert(h.get());
  *handle = h.release();
  return FERRY_OK;
}

void Instance::MemDeregister(void* handle) {
  auto* h = static_cast<LocalMem*>(handle);
  if (h == nullptr) return;
  {
    std::lock_guard lk(handles_mu_);
    if (locals_.erase(h) == 0) return;
  }
  // Closing the regions revokes their keys: no peer RMA reaches this memory after.
  CloseMrs(h);
  delete h;
}

int Instance::MemImport(void* peer, uint64_t remote_id, uint64_t remote_size, const void* data,
                        size_t len, void** handle) {
  auto* ph = static_cast<PeerHandle*>(peer);
  if (ph == nullptr || handle == nullptr) return FERRY_ERR_INVALID_ARGS;
  {
    std::lock_guard lk(handles_mu_);
    if (peers_.count(ph) == 0) return FERRY_ERR_NOT_FOUND;
  }
  blob::MemInfo mi;
  std::string why;
  if (!blob::DecodeMem(data, len, &mi, &why)) {
    Log(host_, FERRY_LOG_WARN, "import of memory %llu: %s",
        static_cast<unsigned long long>(remote_id), why.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  if (mi.id != remote_id || mi.size != remote_size) {
    Log(host_, FERRY_LOG_WARN,
        "import of memory %llu: blob describes memory %llu of %llu bytes, descriptor says %llu",
        static_cast<unsigned long long>(remote_id), static_cast<unsigned long long>(mi.id),
        static_cast<unsigned long long>(mi.size), static_cast<unsigned long long>(remote_size));
    return FERRY_ERR_INVALID_ARGS;
  }
  if (mi.gpu_local_only) {
    Log(host_, FERRY_LOG_WARN,
        "import of memory %llu: it is GPU memory of %s, which ofi cannot reach remotely "
        "(only the initiator stages GPU memory; use tcp or a GPU-capable backend for it)",
        static_cast<unsigned long long>(remote_id), ph->ep->key.c_str());
    return FERRY_ERR_UNSUPPORTED;
  }
  Endpoint* ep = ph->ep->ep;
  const blob::MemKey* key = nullptr;
  for (const auto& k : mi.keys) {
    if (k.provider == ep->provider()) key = &k;
  }
  if (key == nullptr) {
    Log(host_, FERRY_LOG_WARN, "import of memory %llu: the peer did not register it with %s",
        static_cast<unsigned long long>(remote_id), ep->provider().c_str());
    return FERRY_ERR_UNSUPPORTED;
  }
  auto r = std::make_unique<RemoteMem>();
  r->peer = ph;
  r->ep = ep;
  r->size = mi.size;
  const int rc = ep->ImportKey(*key, mi.size, &r->rkey, &r->base, &r->mapped, &why);
  if (rc != FERRY_OK) {
    Log(host_, FERRY_LOG_WARN, "import of memory %llu: %s",
        static_cast<unsigned long long>(remote_id), why.c_str());
    return rc;
  }
  std::lock_guard lk(handles_mu_);
  remotes_.insert(r.get());
  *handle = r.release();
  return FERRY_OK;
}

void Instance::MemRelease(void* handle) {
  auto* r = static_cast<RemoteMem*>(handle);
  if (r == nullptr) return;
  {
    std::lock_guard lk(handles_mu_);
    if (remotes_.erase(r) == 0) return;
  }
  if (r->mapped) r->ep->UnmapKey(r->rkey);
  delete r;
}

int Instance::Post(const ferry_xfer_v1* x) {
  if (x == nullptr || !FERRY_HAS_FIELD(ferry_xfer_v1, x, xfer_ctx)) return FERRY_ERR_INVALID_ARGS;
  auto* peer = static_cast<PeerHandle*>(x->peer);
  auto* local = static_cast<LocalMem*>(x->local_mem);
  auto* remote = static_cast<RemoteMem*>(x->remote_mem);
  std::string why;
  int rc = FERRY_ERR_INVALID_ARGS;
  size_t idx = eps_.size();
  if (peer == nullptr || local == nullptr || remote == nullptr) {
    why = "missing peer or memory handle";
  } else if (remote->peer != peer) {
    why = "remote memory was imported for another peer";
  } else if (x->op != FERRY_OP_READ && x->op != FERRY_OP_WRITE) {
    why = "unknown op " + std::to_string(x->op);
  } else if (x->n_iov == 0 || x->iov == nullptr) {
    why = "no iov";
  } else if ((idx = IndexOf(peer->ep->ep)) >= eps_.size() ||
             (!local->gpu && local->mrs[idx] == nullptr)) {
    why = "local memory " + std::to_string(local->id) + " is not registered with " +
          peer->ep->ep->provider();
    rc = FERRY_ERR_UNSUPPORTED;
  } else {
    rc = FERRY_OK;
    for (uint32_t i = 0; i < x->n_iov && rc == FERRY_OK; ++i) {
      const ferry_iov_v1& v = x->iov[i];
      if (v.len == 0 || !InRange(v.local_off, v.len, local->size) ||
          !InRange(v.remote_off, v.len, remote->size)) {
        why = "iov " + std::to_string(i) + " is empty or outside a region";
        rc = FERRY_ERR_INVALID_ARGS;
      }
    }
  }
  if (rc != FERRY_OK) {
    Log(host_, FERRY_LOG_WARN, "post refused: %s", why.c_str());
    ferry::plugin_kit::TellRefusal(x, why.c_str());
    return rc;
  }
  auto xf = std::make_shared<Xfer>();
  xf->ctx = x->xfer_ctx;
  xf->op = x->op;
  xf->uid = x->uid;
  xf->deadline_ns = x->deadline_ns;
  xf->posted_ns = host_->now_ns(host_->host_ctx);
  xf->peer = peer->ep;
  xf->local_base = local->addr;
  xf->local_desc = local->gpu ? nullptr : fi_mr_desc(local->mrs[idx]);
  xf->staged = local->gpu;
  xf->device = local->device;
  xf->remote_base = remote->base;
  xf->rkey = remote->rkey;
  // Items that continue each other on both sides become one (then re-cut into
  // chunk_bytes RMAs): a batch of 128 adjacent 4 KiB blocks is one 512 KiB RMA.
  xf->iov.reserve(x->n_iov);
  for (uint32_t i = 0; i < x->n_iov; ++i) {
    const ferry_iov_v1& v = x->iov[i];
    if (!xf->iov.empty()) {
      ferry_iov_v1& last = xf->iov.back();
      if (last.local_off + last.len == v.local_off && last.remote_off + last.len == v.remote_off) {
        last.len += v.len;
        continue;
      }
    }
    xf->iov.push_back(v);
  }

  peer->ep->ep->Post(xf);
  return FERRY_OK;
}

void Instance::OnCtrl(const char* peer_key, const void*, size_t len) {
  // This plugin sends no control messages: everything travels in the blobs.
  Log(host_, FERRY_LOG_DEBUG, "ignoring a %zu-byte control message from %s", len,
      peer_key ? peer_key : "?");
}

int Instance::Describe(char* buf, size_t len) {
  if (buf == nullptr || len == 0) return FERRY_ERR_INVALID_ARGS;
  std::string s = "open:";
  for (const auto& ep : eps_) s += " [" + ep->Describe() + "]";
  s += " spin=" + std::to_string(settings_.spin_us) + "us";
  if (pool_) {
    s += " gpu=staged(" + FormatBytes(pool_->piece()) + " x2, pinned " +
         FormatBytes(pool_->pinned_bytes()) + "/" + FormatBytes(pool_->cap()) + ")";
  } else {
    s += " gpu=none(no GPU runtime)";
  }
  s += "; fabric offers: " + offered_;
  std::snprintf(buf, len, "%s", s.c_str());
  return FERRY_OK;
}

}  // namespace ferry_ofi
