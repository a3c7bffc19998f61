// SPDX-License-Identifier: Apache-2.0
#include "instance.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

#include "log.h"
#include "thread_name.h"

namespace ferry_rdma {
namespace {

constexpr uint64_t kWakeTag = ~0ull;
constexpr uint64_t kAsyncTag = 1ull << 32;

bool RangeOk(uint64_t off, uint64_t len, uint64_t size) { return off <= size && len <= size - off; }

}  // namespace

Instance::Instance(const ferry_host_v1* host, std::string engine_key, Settings settings)
    : host_(host), engine_key_(std::move(engine_key)), settings_(std::move(settings)) {}

std::unique_ptr<Instance> Instance::Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                           std::string* why) {
  // The control channel carries the QP handshake; inbound, the notifications.
  if (a.host->ctrl_send == nullptr || a.host->inbound == nullptr) {
    *code = FERRY_ERR_INVALID_ARGS;
    *why = "host services table lacks ctrl_send or inbound";
    return nullptr;
  }
  return ferry::plugin_kit::ParseAndStart<Instance, Settings>(a, ParseSettings, FERRY_ERR_INTERNAL,
                                                              code, why);
}

bool Instance::Start(int* code, std::string* err) {
  if (!devices_.Open(settings_, code, err)) return false;
  std::random_device rd;
  nonce_ = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0) {
    *code = FERRY_ERR_INTERNAL;
    *err = std::string("epoll/eventfd: ") + std::strerror(errno);
    return false;
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  for (const auto& d : devices_.devs) {
    ev.data.u64 = static_cast<uint64_t>(d->index);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, d->channel->fd, &ev);
    ev.data.u64 = kAsyncTag | static_cast<uint64_t>(d->index);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, d->ctx->async_fd, &ev);
  }
  cq_thread_ = ferry::named_thread("rdma-cq", [this] { CqMain(); });
  for (int i = 0; i < kWorkers; ++i)
    workers_.push_back(ferry::named_thread("rdma-work", [this] { WorkerMain(); }));
  Log(host_, FERRY_LOG_INFO, "using %s", devices_.Describe().c_str());
  return true;
}

Instance::~Instance() {
  stop_ = true;
  {
    std::lock_guard lk(work_mu_);
    work_.clear();
    ready_.clear();
  }
  work_cv_.notify_all();
  Wake();
  for (auto& w : workers_)
    if (w.joinable()) w.join();
  if (cq_thread_.joinable()) cq_thread_.join();

  // The threads are gone: deliver what the CQs hold (notifications that their
  // initiators were already acknowledged for, send completions), then close.
  DrainCqs();
  FinishedList done;
  std::vector<std::shared_ptr<Passive>> passives;
  std::set<PeerHandle*> peers;
  {
    std::lock_guard lk(mu_);
    peers.swap(peers_);
    for (auto& [k, p] : passives_) passives.push_back(p);
    passives_.clear();
    for (auto& p : graveyard_) passives.push_back(p);
    graveyard_.clear();
  }
  for (auto& p : passives) p->Retire();
  DrainCqs();
  for (auto& p : passives) p->Destroy();
  passives.clear();
  for (PeerHandle* p : peers) {
    SayFarewell(p->key, p->conns);
    for (auto& [k, c] : p->conns)
      c->Close(FERRY_ERR_BAD_STATE, "the rdma backend is shutting down", &done);
    delete p;
  }
  Report(done);
  for (LocalMem* m : locals_) {
    for (ibv_mr* mr : m->mrs)
      if (mr) ibv_dereg_mr(mr);
    delete m;
  }
  for (RemoteMem* r : remotes_) delete r;
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

// ---- descriptors -------------------------------------------------------------------

int Instance::ConnInfo(void* buf, size_t* len) {
  wire::ConnInfo c;
  c.nonce = nonce_;
  for (const auto& p : devices_.ports) c.ports.push_back(p.info);
  const auto blob = wire::EncodeConnInfo(c);
  if (buf == nullptr || len == nullptr || *len < blob.size()) return FERRY_ERR_NO_MEMORY;
  std::memcpy(buf, blob.data(), blob.size());
  *len = blob.size();
  return FERRY_OK;
}

int Instance::PeerAdd(const ferry_peer_v1* p, void** handle) {
  if (!FERRY_HAS_FIELD(ferry_peer_v1, p, conn_blob_len) || p->key == nullptr || handle == nullptr)
    return FERRY_ERR_INVALID_ARGS;
  auto ph = std::make_unique<PeerHandle>();
  ph->key = p->key;
  std::string err;
  if (!wire::DecodeConnInfo(p->conn_blob, p->conn_blob_len, &ph->info, &err)) {
    Log(host_, FERRY_LOG_WARN, "peer '%s': %s", p->key, err.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  bool reachable = false;
  for (const auto& lp : devices_.ports)
    for (const auto& rp : ph->info.ports) reachable |= lp.info.link_layer == rp.link_layer;
  if (!reachable) {
    Log(host_, FERRY_LOG_WARN, "peer '%s': none of its RDMA ports shares a link layer with ours",
        p->key);
    return FERRY_ERR_UNSUPPORTED;
  }
  std::lock_guard lk(mu_);
  peers_.insert(ph.get());
  *handle = ph.release();
  return FERRY_OK;
}

void Instance::PeerRemove(void* handle) {
  auto* ph = static_cast<PeerHandle*>(handle);
  std::vector<std::shared_ptr<Passive>> passives;
  {
    std::lock_guard lk(mu_);
    if (!peers_.erase(ph)) return;
    for (auto it = passives_.begin(); it != passives_.end();) {
      if (std::get<0>(it->first) == ph->key) {
        passives.push_back(it->second);
        it = passives_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::map<std::pair<int, int>, std::shared_ptr<Conn>> conns;
  {
    std::lock_guard lk(ph->mu);
    conns.swap(ph->conns);
  }
  FinishedList done;
  SayFarewell(ph->key, conns);
  for (auto& [k, c] : conns)
    c->Close(FERRY_ERR_TRANSPORT, "peer '" + ph->key + "' was deregistered", &done);
  Report(done);
  for (auto& p : passives) RetirePassive(p);
  delete ph;
}

int Instance::MemRegister(const ferry_mem_v1* m, void** handle, void* blob, size_t* blob_len) {
  if (!FERRY_HAS_FIELD(ferry_mem_v1, m, device) || m->addr == nullptr || m->size == 0 ||
      handle == nullptr || blob == nullptr || blob_len == nullptr)
    return FERRY_ERR_INVALID_ARGS;
  if (m->location == FERRY_MEM_GPU) {
    // GPUDirect needs a peer-memory client (nvidia_peermem / amdgpu) so that
    // ibv_reg_mr accepts a device pointer; tried only when the core has a GPU runtime.
    const bool gpu = FERRY_HAS_FIELD(ferry_host_v1, host_, gpu) && host_->gpu != nullptr;
    if (!gpu) return FERRY_ERR_UNSUPPORTED;
  } else if (m->location != FERRY_MEM_CPU) {
    return FERRY_ERR_UNSUPPORTED;
  }
  auto lm = std::make_unique<LocalMem>();
  lm->id = m->id;
  lm->addr = static_cast<uint8_t*>(m->addr);
  lm->size = m->size;
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  for (const auto& d : devices_.devs) {
    ibv_mr* mr = ibv_reg_mr(d->pd, m->addr, m->size, access);
    if (mr == nullptr) {
      const int e = errno;
      for (ibv_mr* r : lm->mrs) ibv_dereg_mr(r);
      if (m->location == FERRY_MEM_GPU) {
        Log(host_, FERRY_LOG_DEBUG,
            "GPU memory not registrable on %s (%s): no peer-memory support; rdma skips it",
            d->name.c_str(), std::strerror(e));
        return FERRY_ERR_UNSUPPORTED;
      }
      Log(host_, FERRY_LOG_WARN, "ibv_reg_mr of %s on %s failed: %s%s",
          FormatBytes(m->size).c_str(), d->name.c_str(), std::strerror(e),
          e == ENOMEM || e == EPERM ? " (locked-memory limit? see ulimit -l)" : "");
      return e == ENOMEM ? FERRY_ERR_NO_MEMORY : FERRY_ERR_TRANSPORT;
    }
    lm->mrs.push_back(mr);
  }
  lm->preferred_port = m->location == FERRY_MEM_GPU ? 0 : devices_.PortForMemory(m->addr, m->size);
  wire::MemInfo info;
  info.addr = reinterpret_cast<uintptr_t>(m->addr);
  info.size = m->size;
  info.preferred_port = static_cast<uint16_t>(lm->preferred_port);
  for (const auto& p : devices_.ports)
    info.rkeys.push_back(lm->mrs[static_cast<size_t>(p.dev->index)]->rkey);
  const auto bytes = wire::EncodeMemInfo(info);
  if (*blob_len < bytes.size()) {
    for (ibv_mr* r : lm->mrs) ibv_dereg_mr(r);
    return FERRY_ERR_NO_MEMORY;
  }
  std::memcpy(blob, bytes.data(), bytes.size());
  *blob_len = bytes.size();
  std::lock_guard lk(mu_);
  locals_.insert(lm.get());
  *handle = lm.release();
  return FERRY_OK;
}

void Instance::MemDeregister(void* handle) {
  auto* lm = static_cast<LocalMem*>(handle);
  {
    std::lock_guard lk(mu_);
    if (!locals_.erase(lm)) return;
  }
  // Deregistering invalidates the rkeys at once: later peer requests fail.
  for (ibv_mr* mr : lm->mrs) ibv_dereg_mr(mr);
  delete lm;
}

int Instance::MemImport(void* peer, uint64_t remote_id, uint64_t remote_size, const void* blob,
                        size_t blob_len, void** handle) {
  auto* ph = static_cast<PeerHandle*>(peer);
  if (ph == nullptr || handle == nullptr) return FERRY_ERR_INVALID_ARGS;
  auto rm = std::make_unique<RemoteMem>();
  std::string err;
  if (!wire::DecodeMemInfo(blob, blob_len, &rm->info, &err)) {
    Log(host_, FERRY_LOG_WARN, "memory %llu of '%s': %s",
        static_cast<unsigned long long>(remote_id), ph->key.c_str(), err.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  if (rm->info.size < remote_size || rm->info.rkeys.size() != ph->info.ports.size()) {
    Log(host_, FERRY_LOG_WARN, "memory %llu of '%s': blob disagrees with the descriptor",
        static_cast<unsigned long long>(remote_id), ph->key.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  rm->id = remote_id;
  rm->size = remote_size;
  std::lock_guard lk(mu_);
  remotes_.insert(rm.get());
  *handle = rm.release();
  return FERRY_OK;
}

void Instance::MemRelease(void* handle) {
  auto* rm = static_cast<RemoteMem*>(handle);
  {
    std::lock_guard lk(mu_);
    if (!remotes_.erase(rm)) return;
  }
  delete rm;
}

// ---- transfers -----------------------------------------------------------------------

int Instance::Post(const ferry_xfer_v1* x) {
  if (!FERRY_HAS_FIELD(ferry_xfer_v1, x, xfer_ctx) || x->peer == nullptr ||
      x->local_mem == nullptr || x->remote_mem == nullptr || x->iov == nullptr || x->n_iov == 0 ||
      (x->op != FERRY_OP_READ && x->op != FERRY_OP_WRITE))
    return FERRY_ERR_INVALID_ARGS;
  if (stop_) return FERRY_ERR_BAD_STATE;
  auto* ph = static_cast<PeerHandle*>(x->peer);
  auto* lm = static_cast<LocalMem*>(x->local_mem);
  auto* rm = static_cast<RemoteMem*>(x->remote_mem);
  for (uint32_t i = 0; i < x->n_iov; ++i) {
    const ferry_iov_v1& v = x->iov[i];
    if (v.len == 0 || !RangeOk(v.local_off, v.len, lm->size) ||
        !RangeOk(v.remote_off, v.len, rm->size)) {
      Log(host_, FERRY_LOG_WARN, "refusing a transfer: piece %u is out of range", i);
      ferry::plugin_kit::TellRefusal(x, "a piece is outside a region");
      return FERRY_ERR_INVALID_ARGS;
    }
  }
  // Ports: the local region's and the remote region's nearest, else a compatible pair.
  int lp = lm->preferred_port;
  int rp = rm->info.preferred_port;
  auto compatible = [&](int l, int r) {
    return devices_.ports[static_cast<size_t>(l)].info.link_layer ==
           ph->info.ports[static_cast<size_t>(r)].link_layer;
  };
  if (!compatible(lp, rp)) {
    bool found = false;
    for (int r = 0; r < static_cast<int>(ph->info.ports.size()) && !found; ++r)
      if (compatible(lp, r)) rp = r, found = true;
    for (int l = 0; l < static_cast<int>(devices_.ports.size()) && !found; ++l)
      for (int r = 0; r < static_cast<int>(ph->info.ports.size()) && !found; ++r)
        if (compatible(l, r)) lp = l, rp = r, found = true;
    if (!found) {
      ferry::plugin_kit::TellRefusal(x, "no port pair with a common link layer (IB vs RoCE)");
      return FERRY_ERR_UNSUPPORTED;
    }
  }
  Port* port = &devices_.ports[static_cast<size_t>(lp)];
  std::shared_ptr<Conn> conn;
  {
    std::lock_guard lk(ph->mu);
    auto& slot = ph->conns[{lp, rp}];
    if (!slot)
      slot = std::make_shared<Conn>(this, ph->key, ph->info.nonce, port, static_cast<uint16_t>(rp),
                                    ph->info.ports[static_cast<size_t>(rp)]);
    conn = slot;
  }
  const DeviceCtx* dev = port->dev;
  int max_sge = std::min({settings_.max_sge, dev->attr.max_sge, 64});
  if (x->op == FERRY_OP_READ && dev->attr.max_sge_rd > 0)
    max_sge = std::min(max_sge, dev->attr.max_sge_rd);
  auto xf = std::make_shared<Xfer>();
  xf->xfer_ctx = x->xfer_ctx;
  xf->uid = x->uid;
  xf->deadline_ns = x->deadline_ns;
  xf->notify = (x->flags & FERRY_XFER_NOTIFY) != 0;
  xf->is_read = x->op == FERRY_OP_READ;
  xf->local_base = reinterpret_cast<uintptr_t>(lm->addr);
  xf->lkey = lm->mrs[static_cast<size_t>(dev->index)]->lkey;
  xf->remote_base = rm->info.addr;
  xf->rkey = rm->info.rkeys[static_cast<size_t>(rp)];
  xf->plan = MakePlan(x->iov, x->n_iov, settings_.chunk_bytes,
                      static_cast<uint32_t>(std::max(1, max_sge)));
  xf->conn = conn;
  if (xf->deadline_ns != 0) AddXferTimer(xf);
  FinishedList done;
  conn->Enqueue(std::move(xf), &done);
  Report(done);
  return FERRY_OK;
}

int Instance::Fence(const char* peer_key, const uint64_t*, size_t n, uint64_t,
                    ferry_fence_result_v1* out) {
  if (peer_key == nullptr || (n > 0 && out == nullptr)) return FERRY_ERR_INVALID_ARGS;
  std::vector<std::shared_ptr<Passive>> passives;
  {
    std::lock_guard lk(mu_);
    for (auto it = passives_.begin(); it != passives_.end();) {
      if (std::get<0>(it->first) == peer_key) {
        passives.push_back(it->second);
        it = passives_.erase(it);
      } else {
        ++it;
      }
    }
  }
  // Retire() moves each QP to ERR before it returns. The target side cannot
  // count what one-sided WRITEs put in memory, so what had landed is "part"
  // (maybe all) where a QP served the peer, "none" where none did.
  for (auto& p : passives) RetirePassive(p);
  const uint32_t state = passives.empty() ? FERRY_FENCE_NONE : FERRY_FENCE_PARTIAL;
  for (size_t i = 0; i < n; ++i) out[i] = {0, state, 0};
  if (!passives.empty())
    Log(host_, FERRY_LOG_INFO, "fenced '%s': %zu connection(s) to it retired (QPs in ERR)",
        peer_key, passives.size());
  return FERRY_OK;
}

void Instance::RetirePassive(const std::shared_ptr<Passive>& p) {
  p->Retire();
  {
    std::lock_guard lk(mu_);
    graveyard_.push_back(p);
  }
  Wake();
}

void Instance::Report(FinishedList& done) {
  for (auto& f : done) {
    RemoveTimer(f.deadline_ns, f.timer_seq);
    host_->complete(host_->host_ctx, f.xfer_ctx, f.status,
                    f.message.empty() ? nullptr : f.message.c_str());
  }
  done.clear();
}

// ---- the QP and connection maps ----------------------------------------------------------

void Instance::RegisterQp(int dev, uint32_t qpn, std::weak_ptr<Conn> c, std::weak_ptr<Passive> p,
                          int qi) {
  std::lock_guard lk(mu_);
  qps_[{dev, qpn}] = QpRef{std::move(c), std::move(p), qi};
}

void Instance::UnregisterQp(int dev, uint32_t qpn) {
  std::lock_guard lk(mu_);
  qps_.erase({dev, qpn});
}

void Instance::RegisterConnId(uint64_t id, std::weak_ptr<Conn> c) {
  std::lock_guard lk(mu_);
  conn_ids_[id] = std::move(c);
}

void Instance::UnregisterConnId(uint64_t id) {
  std::lock_guard lk(mu_);
  conn_ids_.erase(id);
}

// ---- timers --------------------------------------------------------------------------------

void Instance::AddXferTimer(const std::shared_ptr<Xfer>& x) {
  bool first;
  {
    std::lock_guard lk(timer_mu_);
    x->timer_seq = next_timer_seq_++;
    const auto key = std::make_pair(x->deadline_ns, x->timer_seq);
    first = timers_.empty() || key < timers_.begin()->first;
    timers_[key] = Timer{x, {}};
  }
  if (first && sleeping_.load() != 0) Wake();
}

void Instance::AddConnTimer(uint64_t deadline, std::weak_ptr<Conn> c) {
  bool first;
  {
    std::lock_guard lk(timer_mu_);
    const auto key = std::make_pair(deadline, next_timer_seq_++);
    first = timers_.empty() || key < timers_.begin()->first;
    timers_[key] = Timer{{}, std::move(c)};
  }
  if (first && sleeping_.load() != 0) Wake();
}

void Instance::RemoveTimer(uint64_t deadline, uint64_t seq) {
  if (seq == 0) return;
  std::lock_guard lk(timer_mu_);
  timers_.erase({deadline, seq});
}

void Instance::RunTimers() {
  std::vector<Timer> due;
  const uint64_t now = Now();
  {
    std::lock_guard lk(timer_mu_);
    while (!timers_.empty() && timers_.begin()->first.first <= now) {
      due.push_back(std::move(timers_.begin()->second));
      timers_.erase(timers_.begin());
    }
  }
  if (due.empty()) return;
  FinishedList done;
  for (auto& t : due) {
    if (auto x = t.x.lock()) {
      if (auto c = x->conn.lock()) c->Expire(x, &done);
    } else if (auto c = t.c.lock()) {
      c->OnTimer(now, &done);
    }
  }
  Report(done);
}

int Instance::NextTimerMs() {
  std::lock_guard lk(timer_mu_);
  if (timers_.empty()) return -1;
  const uint64_t now = Now();
  const uint64_t first = timers_.begin()->first.first;
  if (first <= now) return 0;
  const uint64_t ms = (first - now + 999999) / 1000000;
  return static_cast<int>(std::min<uint64_t>(ms, 3600 * 1000));
}

void Instance::Wake() {
  if (wake_fd_ < 0) return;
  uint64_t one = 1;
  [[maybe_unused]] auto k = write(wake_fd_, &one, sizeof one);
}

// ---- the completion thread ------------------------------------------------------------------

int Instance::DrainCqs() {
  int total = 0;
  FinishedList done;
  std::vector<std::pair<std::string, uint64_t>> inbound;
  ibv_wc wcs[32];
  for (const auto& d : devices_.devs) {
    for (;;) {
      const int n = ibv_poll_cq(d->cq, 32, wcs);
      if (n <= 0) {
        if (n < 0) Log(host_, FERRY_LOG_ERROR, "ibv_poll_cq on %s failed", d->name.c_str());
        break;
      }
      total += n;
      for (int i = 0; i < n; ++i) Dispatch(d.get(), wcs[i], &done, &inbound);
      Report(done);
      for (const auto& [key, uid] : inbound)
        host_->inbound(host_->host_ctx, key.c_str(), uid, FERRY_OK);
      inbound.clear();
      if (n < 32) break;
    }
  }
  return total;
}

void Instance::Dispatch(DeviceCtx* dev, const ibv_wc& wc, FinishedList* done,
                        std::vector<std::pair<std::string, uint64_t>>* inbound) {
  QpRef ref;
  {
    std::lock_guard lk(mu_);
    auto it = qps_.find({dev->index, wc.qp_num});
    if (it == qps_.end()) return;  // a QP destroyed since
    ref = it->second;
  }
  if (auto c = ref.conn.lock()) {
    c->OnWc(ref.qi, wc, done);
  } else if (auto p = ref.passive.lock()) {
    uint64_t uid = 0;
    if (p->OnWc(ref.qi, wc, &uid)) inbound->emplace_back(p->peer_key(), uid);
  }
}

void Instance::HandleAsync(DeviceCtx* dev) {
  ibv_async_event ev;
  while (ibv_get_async_event(dev->ctx, &ev) == 0) {
    const ibv_event_type type = ev.event_type;
    uint32_t qpn = 0;
    bool qp_event = false;
    switch (type) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_PATH_MIG_ERR:
        qp_event = true;
        qpn = ev.element.qp->qp_num;
        break;
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_DEVICE_FATAL:
        Log(host_, FERRY_LOG_ERROR, "%s: %s", dev->name.c_str(), ibv_event_type_str(type));
        break;
      case IBV_EVENT_PORT_ERR:
      case IBV_EVENT_PORT_ACTIVE:
      case IBV_EVENT_LID_CHANGE:
      case IBV_EVENT_GID_CHANGE:
        Log(host_, FERRY_LOG_WARN, "%s port %d: %s", dev->name.c_str(), ev.element.port_num,
            ibv_event_type_str(type));
        break;
      default:
        break;
    }
    ibv_ack_async_event(&ev);
    if (!qp_event) continue;
    QpRef ref;
    {
      std::lock_guard lk(mu_);
      auto it = qps_.find({dev->index, qpn});
      if (it == qps_.end()) continue;
      ref = it->second;
    }
    if (auto c = ref.conn.lock()) {
      FinishedList done;
      c->OnAsyncError(ref.qi, ibv_event_type_str(type), &done);
      Report(done);
    } else {
      Log(host_, FERRY_LOG_DEBUG, "target-side QP %u: %s", qpn, ibv_event_type_str(type));
    }
  }
}

void Instance::CqMain() {
  const uint64_t spin_ns = static_cast<uint64_t>(settings_.spin_us) * 1000;
  uint64_t idle_since = 0;
  unsigned busy_iter = 0;
  epoll_event evs[16];
  while (!stop_) {
    std::vector<std::shared_ptr<Passive>> dead;
    {
      std::lock_guard lk(mu_);
      dead.swap(graveyard_);
    }
    const int n = DrainCqs();
    for (auto& p : dead) p->Destroy();  // what they delivered before retiring is handled
    dead.clear();
    RunTimers();
    if (n > 0) {
      idle_since = 0;
      continue;
    }
    int timeout = -1;
    if (settings_.busy_poll) {
      if (++busy_iter % 256 != 0) continue;
      timeout = 0;  // now and then: async events, wake-ups
    } else {
      const uint64_t now = Now();
      if (idle_since == 0) idle_since = now;
      if (now - idle_since < spin_ns) continue;
      for (const auto& d : devices_.devs) ibv_req_notify_cq(d->cq, 0);
      if (DrainCqs() > 0) {  // completions that came before the CQ was armed
        idle_since = 0;
        continue;
      }
      sleeping_.store(~0ull);
      timeout = NextTimerMs();
    }
    const int k = epoll_wait(epoll_fd_, evs, 16, timeout);
    sleeping_.store(0);
    for (int i = 0; i < k; ++i) {
      const uint64_t tag = evs[i].data.u64;
      if (tag == kWakeTag) {
        uint64_t v;
        [[maybe_unused]] auto r = read(wake_fd_, &v, sizeof v);
      } else if (tag & kAsyncTag) {
        HandleAsync(devices_.devs[static_cast<size_t>(tag & 0xffffffff)].get());
      } else {
        DeviceCtx* d = devices_.devs[static_cast<size_t>(tag)].get();
        ibv_cq* cq = nullptr;
        void* ctx = nullptr;
        while (ibv_get_cq_event(d->channel, &cq, &ctx) == 0) ibv_ack_cq_events(cq, 1);
      }
    }
    idle_since = 0;
  }
}

// ---- the worker thread: handshakes ------------------------------------------------------------

void Instance::PushWork(const std::string& peer_key, std::function<void()> fn) {
  {
    std::lock_guard lk(work_mu_);
    if (stop_) return;
    auto& q = work_[peer_key];
    // A peer with work queued is in ready_ already, or a worker has it.
    if (q.empty() && running_.count(peer_key) == 0) ready_.push_back(peer_key);
    q.push_back(std::move(fn));
  }
  work_cv_.notify_one();
}

void Instance::WorkerMain() {
  std::unique_lock lk(work_mu_);
  for (;;) {
    work_cv_.wait(lk, [&] { return stop_ || !ready_.empty(); });
    if (stop_) return;
    std::string peer = std::move(ready_.front());
    ready_.pop_front();
    auto it = work_.find(peer);
    if (it == work_.end() || it->second.empty()) continue;
    std::function<void()> fn = std::move(it->second.front());
    it->second.pop_front();
    running_.insert(peer);
    lk.unlock();
    try {
      fn();
    } catch (const std::exception& e) {
      Log(host_, FERRY_LOG_ERROR, "worker: %s", e.what());
    }
    fn = nullptr;  // what it holds goes before the lock is taken again
    lk.lock();
    running_.erase(peer);
    it = work_.find(peer);
    if (it == work_.end()) continue;  // cleared (stopping)
    if (it->second.empty()) {
      work_.erase(it);
    } else {
      ready_.push_back(std::move(peer));  // its next job, behind other peers' waiting ones
      work_cv_.notify_one();
    }
  }
}

void Instance::SendConnectReq(std::weak_ptr<Conn> wc, uint64_t conn_id, std::vector<uint8_t> msg) {
  auto owner = wc.lock();  // the caller's Conn (it holds its lock): alive
  if (!owner) return;
  PushWork(owner->peer_key(), [this, wc = std::move(wc), conn_id, msg = std::move(msg)] {
    auto c = wc.lock();
    if (!c) return;
    const int rc = host_->ctrl_send(host_->host_ctx, c->peer_key().c_str(), msg.data(), msg.size());
    if (rc == FERRY_OK) return;
    FinishedList done;
    c->OnSendFailed(conn_id,
                    rc == FERRY_ERR_NOT_FOUND
                        ? "the core does not know that engine"
                        : "its control channel cannot be reached (is our engine registered there?)",
                    &done);
    Report(done);
  });
}

void Instance::OnCtrl(const char* peer_key, const void* msg, size_t len) {
  if (peer_key == nullptr || (msg == nullptr && len > 0) || stop_) return;
  std::string key = peer_key;
  std::vector<uint8_t> bytes(static_cast<const uint8_t*>(msg),
                             static_cast<const uint8_t*>(msg) + len);
  PushWork(key, [this, key, bytes = std::move(bytes)] { HandleCtrl(key, bytes); });
}

uint64_t Instance::FirstConnId() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) | 1;
}

void Instance::HandleCtrl(const std::string& peer_key, const std::vector<uint8_t>& bytes) {
  wire::ConnectMsg m;
  std::string err;
  if (!wire::DecodeConnectMsg(bytes.data(), bytes.size(), &m, &err)) {
    Log(host_, FERRY_LOG_WARN, "dropping a control message from '%s': %s", peer_key.c_str(),
        err.c_str());
    return;
  }
  if (m.type == wire::MsgType::kConnectReq) {
    Accept(peer_key, m);
    return;
  }
  if (m.type == wire::MsgType::kDisconnect) {
    ReleasePassive(peer_key, m);
    return;
  }
  std::shared_ptr<Conn> c;
  {
    std::lock_guard lk(mu_);
    auto it = conn_ids_.find(m.conn_id);
    if (it != conn_ids_.end()) c = it->second.lock();
  }
  if (!c || c->peer_key() != peer_key) {
    Log(host_, FERRY_LOG_DEBUG, "ignoring a stale handshake answer from '%s'", peer_key.c_str());
    return;
  }
  FinishedList done;
  c->OnReply(m, &done);
  Report(done);
}

void Instance::SendDisconnect(const std::string& peer_key, const wire::ConnectMsg& m) {
  // From the worker: ctrl_send may block on the network, and the caller holds a Conn's lock.
  PushWork(peer_key, [this, peer_key, bytes = wire::EncodeConnectMsg(m)] {
    const int rc = host_->ctrl_send(host_->host_ctx, peer_key.c_str(), bytes.data(), bytes.size());
    if (rc != FERRY_OK)
      Log(host_, FERRY_LOG_DEBUG, "cannot tell '%s' that idle QPs were released (error %d)",
          peer_key.c_str(), rc);
  });
}

void Instance::SayFarewell(const std::string& peer_key,
                           const std::map<std::pair<int, int>, std::shared_ptr<Conn>>& conns) {
  // Never waits (ctrl_try_send): a peer that does not read must not hold up
  // peer_remove or fini. What is not sent stays at the target until it
  // removes or fences this engine. (At peer_remove the core has dropped the
  // peer's address, so ctrl_send could not reach it; its open control
  // connection still can.)
  if (!FERRY_HAS_FIELD(ferry_host_v1, host_, ctrl_try_send) || host_->ctrl_try_send == nullptr)
    return;
  for (const auto& [k, c] : conns) {
    wire::ConnectMsg m;
    if (!c->Farewell(&m)) continue;
    const auto bytes = wire::EncodeConnectMsg(m);
    const int rc =
        host_->ctrl_try_send(host_->host_ctx, peer_key.c_str(), bytes.data(), bytes.size());
    if (rc != FERRY_OK)
      Log(host_, FERRY_LOG_DEBUG, "cannot tell '%s' to retire its QPs of ours (error %d)",
          peer_key.c_str(), rc);
  }
}

void Instance::ReleasePassive(const std::string& peer_key, const wire::ConnectMsg& m) {
  std::shared_ptr<Passive> p;
  {
    std::lock_guard lk(mu_);
    auto it = passives_.find({peer_key, m.ini_port, m.tgt_port});
    // Only the connection it names: a newer handshake of the same port pair stays.
    if (it == passives_.end() || !it->second || it->second->conn_id() != m.conn_id) return;
    p = std::move(it->second);
    passives_.erase(it);
  }
  Log(host_, FERRY_LOG_DEBUG, "'%s' released its idle QPs: retiring ours", peer_key.c_str());
  RetirePassive(p);
}

void Instance::SendCtrl(const std::string& peer_key, const wire::ConnectMsg& m) {
  const auto bytes = wire::EncodeConnectMsg(m);
  const int rc = host_->ctrl_send(host_->host_ctx, peer_key.c_str(), bytes.data(), bytes.size());
  if (rc != FERRY_OK)
    Log(host_, FERRY_LOG_WARN, "cannot answer the QP handshake of '%s' (error %d)",
        peer_key.c_str(), rc);
}

void Instance::Accept(const std::string& peer_key, const wire::ConnectMsg& req) {
  wire::ConnectMsg nak;
  nak.type = wire::MsgType::kConnectNak;
  nak.conn_id = req.conn_id;
  if (req.target_nonce != nonce_) {
    nak.reason = "its descriptor of engine '" + engine_key_ +
                 "' is stale (the rdma backend there was restarted): register the engine again";
    SendCtrl(peer_key, nak);
    return;
  }
  if (req.tgt_port >= devices_.ports.size()) {
    nak.reason = "no port " + std::to_string(req.tgt_port) + " on engine '" + engine_key_ + "'";
    SendCtrl(peer_key, nak);
    return;
  }
  {
    // A late handshake of this initiator (same lineage, older id): the newer
    // one's queue pairs stay; its own initiator gave up on it already.
    std::lock_guard lk(mu_);
    auto it = passives_.find({peer_key, req.ini_port, req.tgt_port});
    if (it != passives_.end() && it->second && SameLineage(it->second->conn_id(), req.conn_id) &&
        req.conn_id < it->second->conn_id()) {
      nak.reason = "superseded by a newer handshake of the same initiator";
      Log(host_, FERRY_LOG_DEBUG, "'%s': a stale QP handshake arrived after a newer one",
          peer_key.c_str());
      SendCtrl(peer_key, nak);
      return;
    }
  }
  {
    std::lock_guard lk(mu_);
    nak.reason = RefusalLocked(peer_key, req);
  }
  if (!nak.reason.empty()) {
    RefuseHandshake(peer_key, nak);
    return;
  }
  Port* port = &devices_.ports[req.tgt_port];
  auto p = std::make_shared<Passive>(this, peer_key, port, req.qps.size());
  wire::ConnectMsg rep;
  std::string err;
  if (!p->Setup(req, &rep, &err)) {
    p->Destroy();
    nak.reason = err;
    RefuseHandshake(peer_key, nak);
    return;
  }
  std::shared_ptr<Passive> old;
  {
    // Again, now that it is made: the peer may have been removed meanwhile.
    std::lock_guard lk(mu_);
    nak.reason = RefusalLocked(peer_key, req);
    if (nak.reason.empty()) {
      auto& slot = passives_[{peer_key, req.ini_port, req.tgt_port}];
      old = std::move(slot);
      slot = p;
    }
  }
  if (!nak.reason.empty()) {
    p->Destroy();
    RefuseHandshake(peer_key, nak);
    return;
  }
  if (old) RetirePassive(old);
  SendCtrl(peer_key, rep);
}

std::string Instance::RefusalLocked(const std::string& peer_key,
                                    const wire::ConnectMsg& req) const {
  const PeerHandle* peer = nullptr;
  for (const PeerHandle* ph : peers_)
    if (ph->key == peer_key) peer = ph;
  // The core adds every engine it registered or learned from an authenticated
  // hello; any other sender never gets an answer (ctrl_send cannot reach it),
  // and its QPs would stay here until fini.
  if (peer == nullptr) return "engine '" + peer_key + "' is not known here";
  if (req.ini_port >= peer->info.ports.size())
    return "port " + std::to_string(req.ini_port) + " is not one of the " +
           std::to_string(peer->info.ports.size()) + " its descriptor names";
  size_t held = 0;  // its other connections' QPs (the one this handshake replaces goes)
  for (const auto& [k, p] : passives_)
    if (std::get<0>(k) == peer_key &&
        (std::get<1>(k) != req.ini_port || std::get<2>(k) != req.tgt_port))
      held += p ? p->qp_count() : 0;
  const size_t cap = static_cast<size_t>(settings_.max_qps_per_peer);
  if (held + req.qps.size() > cap)
    return "it would hold " + std::to_string(held + req.qps.size()) + " QPs here (" +
           std::to_string(held) + " in its other connections), past max_qps_per_peer " +
           std::to_string(cap) + " of engine '" + engine_key_ + "'";
  return {};
}

void Instance::RefuseHandshake(const std::string& peer_key, const wire::ConnectMsg& nak) {
  uint64_t held = 0;
  if (refusal_log_.Allow(peer_key, &held))
    Log(host_, FERRY_LOG_WARN, "refusing the QP handshake of '%s': %s%s", peer_key.c_str(),
        nak.reason.c_str(),
        held ? (" (" + std::to_string(held) + " more since the last report)").c_str() : "");
  ++handshakes_refused_;
  SendCtrl(peer_key, nak);
}

// ---- describe --------------------------------------------------------------------------------

int Instance::Counters(char* buf, size_t len) {
  if (buf == nullptr || len == 0) return FERRY_ERR_INVALID_ARGS;
  size_t initiator = 0, target = 0, passive = 0;
  {
    std::lock_guard lk(mu_);
    for (const auto& [k, ref] : qps_) {
      if (!ref.passive.expired()) ++target;
      if (!ref.conn.expired()) ++initiator;
    }
    passive = passives_.size();
  }
  std::snprintf(buf, len,
                "{\"initiator_qps\":%zu,\"target_qps\":%zu,\"target_connections\":%zu,"
                "\"handshakes_refused\":%llu}",
                initiator, target, passive,
                static_cast<unsigned long long>(handshakes_refused_.load()));
  return FERRY_OK;
}

int Instance::Describe(char* buf, size_t len) {
  if (buf == nullptr || len == 0) return FERRY_ERR_INVALID_ARGS;
  const Settings& s = settings_;
  std::string mode =
      s.busy_poll ? "busy-poll" : "event mode, spin " + std::to_string(s.spin_us) + "us";
  std::snprintf(buf, len,
                "%s; qp_per_transfer %d, chunk %s, max_send_wr %d, max_sge %d, inline %d, "
                "timeout %d retry %d; %s; notify by SEND",
                devices_.Describe().c_str(), s.qp_per_transfer, FormatBytes(s.chunk_bytes).c_str(),
                s.max_send_wr, s.max_sge, s.max_inline, s.qp_timeout, s.retry_cnt, mode.c_str());
  return FERRY_OK;
}

}  // namespace ferry_rdma
