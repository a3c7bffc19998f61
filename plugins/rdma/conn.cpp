// SPDX-License-Identifier: Apache-2.0
#include "conn.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "instance.h"
#include "log.h"

namespace ferry_rdma {
namespace {

QpTimers TimersFrom(const Settings& s) {
  QpTimers t;
  t.timeout = s.qp_timeout;
  t.retry_cnt = s.retry_cnt;
  t.rnr_retry = s.rnr_retry;
  t.min_rnr_timer = s.min_rnr_timer;
  t.traffic_class = s.traffic_class;
  t.service_level = s.service_level;
  return t;
}

constexpr int kMaxRdAtomic = 16;

}  // namespace

// ---------------------------------------------------------------------------------
// Conn: the initiator side

Conn::Conn(Instance* inst, std::string peer_key, uint64_t peer_nonce, Port* local,
           uint16_t remote_port, wire::PortInfo remote_info)
    : inst_(inst),
      peer_key_(std::move(peer_key)),
      peer_nonce_(peer_nonce),
      local_(local),
      remote_port_(remote_port),
      remote_info_(std::move(remote_info)) {}

Conn::~Conn() {
  for (auto& q : qps_)
    if (q.qp) ibv_destroy_qp(q.qp);
  if (cqes_reserved_) local_->dev->ReleaseCqes(cqes_reserved_);
}

std::string Conn::Where() const {
  return "peer '" + peer_key_ + "' (" + local_->Name() + " -> " + remote_info_.name + ":" +
         std::to_string(remote_info_.port) + ")";
}

std::string Conn::StateName() {
  std::lock_guard lk(mu_);
  switch (state_) {
    case State::kIdle:
      return "idle";
    case State::kConnecting:
      return "connecting";
    case State::kReady:
      return "ready";
    case State::kClosed:
      return "closed";
  }
  return "?";
}

void Conn::Enqueue(std::shared_ptr<Xfer> x, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ == State::kClosed) {
    out->push_back(
        {x->xfer_ctx, FERRY_ERR_BAD_STATE, "connection closed", x->deadline_ns, x->timer_seq});
    x->stage = Xfer::Stage::kDone;
    return;
  }
  x->qp_base = next_qp_base_++;
  last_active_ = inst_->Now();
  queue_.push_back(std::move(x));
  if (state_ == State::kIdle)
    StartConnectLocked(out);
  else if (state_ == State::kReady)
    PumpLocked(out);
}

void Conn::StartConnectLocked(FinishedList* out) {
  const Settings& s = inst_->settings();
  std::string err;
  DeviceCtx* dev = local_->dev;
  if (qps_.empty()) {
    QpCaps want;
    want.send_wr = std::min(s.max_send_wr, dev->attr.max_qp_wr);
    want.recv_wr = 1;
    want.sge = std::max(1, std::min(s.max_sge, dev->attr.max_sge));
    want.inline_bytes = std::max<int>(s.max_inline, wire::kNotifySize);
    const int n = s.qp_per_transfer;
    const int cqes = n * (want.send_wr + 2);
    if (!dev->ReserveCqes(cqes, &err)) {
      err += ": a connection of ours reserves qp_per_transfer x (max_send_wr + 2) = " +
             std::to_string(cqes) + "; lower either";
      FailQueuedLocked(FERRY_ERR_NOT_SENT, err, out);
      return;
    }
    cqes_reserved_ = cqes;
    caps_ = want;
    for (int i = 0; i < n; ++i) {
      QpCaps got = want;
      ibv_qp* qp = CreateRcQp(*local_, &got, &err);
      if (qp == nullptr) break;
      if (got.inline_bytes < static_cast<int>(wire::kNotifySize)) {
        ibv_destroy_qp(qp);
        err = "device " + dev->name + " grants no inline data on RC QPs; the rdma plugin needs " +
              std::to_string(wire::kNotifySize) + " bytes for its notification SEND";
        break;
      }
      caps_.send_wr = std::min(caps_.send_wr, got.send_wr);
      caps_.sge = std::min(caps_.sge, got.sge);
      caps_.inline_bytes = std::min(caps_.inline_bytes, got.inline_bytes);
      Qp q;
      q.qp = qp;
      qps_.push_back(q);
      inst_->RegisterQp(dev->index, qp->qp_num, weak_from_this(), {}, i);
    }
    if (static_cast<int>(qps_.size()) != n) {
      for (auto& q : qps_) {
        inst_->UnregisterQp(dev->index, q.qp->qp_num);
        ibv_destroy_qp(q.qp);
      }
      qps_.clear();
      dev->ReleaseCqes(cqes_reserved_);
      cqes_reserved_ = 0;
      FailQueuedLocked(FERRY_ERR_NOT_SENT, err, out);
      return;
    }
    caps_.inline_bytes = std::min(caps_.inline_bytes, s.max_inline);
    signal_interval_ = std::max(1, caps_.send_wr / 4);
    max_rd_atomic_ = std::max(1, std::min(kMaxRdAtomic, dev->attr.max_qp_init_rd_atom));
  }
  for (auto& q : qps_) {
    QpToState(q.qp, IBV_QPS_RESET);
    if (!QpToInit(q.qp, *local_, 0, &err)) {
      FailQueuedLocked(FERRY_ERR_NOT_SENT, err + " (" + Where() + ")", out);
      return;
    }
    q.psn = RandomPsn();
    q.first_id = inst_->NextWrId();
    q.outstanding = 0;
    q.unsignaled_run = 0;
    q.fifo.clear();
  }
  conn_id_ = inst_->NewConnId();
  inst_->RegisterConnId(conn_id_, weak_from_this());
  state_ = State::kConnecting;
  connect_deadline_ = inst_->Now() + static_cast<uint64_t>(s.connect_timeout_ms) * 1000000ull;
  inst_->AddConnTimer(connect_deadline_, weak_from_this());

  wire::ConnectMsg m;
  m.type = wire::MsgType::kConnectReq;
  m.conn_id = conn_id_;
  m.target_nonce = peer_nonce_;
  m.ini_port = static_cast<uint16_t>(local_->index);
  m.tgt_port = remote_port_;
  m.mtu = static_cast<uint8_t>(local_->attr.active_mtu);
  m.rd_atomic = static_cast<uint8_t>(max_rd_atomic_);
  m.lid = local_->attr.lid;
  std::memcpy(m.gid, local_->gid.raw, 16);
  for (const auto& q : qps_) m.qps.push_back({q.qp->qp_num, q.psn});
  inst_->SendConnectReq(weak_from_this(), conn_id_, wire::EncodeConnectMsg(m));
}

void Conn::OnSendFailed(uint64_t conn_id, const std::string& why, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ != State::kConnecting || conn_id != conn_id_) return;
  inst_->UnregisterConnId(conn_id_);
  state_ = State::kIdle;
  last_error_ = why;
  FailQueuedLocked(FERRY_ERR_NOT_SENT, "cannot send the QP handshake to " + Where() + ": " + why,
                   out);
}

void Conn::OnReply(const wire::ConnectMsg& m, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ != State::kConnecting || m.conn_id != conn_id_) return;  // a stale answer
  inst_->UnregisterConnId(conn_id_);
  state_ = State::kIdle;
  if (m.type == wire::MsgType::kConnectNak) {
    last_error_ = m.reason;
    FailQueuedLocked(FERRY_ERR_REMOTE, "the target refused the rdma connection: " + m.reason, out);
    return;
  }
  if (m.qps.size() != qps_.size()) {
    FailQueuedLocked(FERRY_ERR_PROTOCOL,
                     "QP handshake answer from " + Where() + " has " +
                         std::to_string(m.qps.size()) + " QPs, asked for " +
                         std::to_string(qps_.size()),
                     out);
    return;
  }
  const QpTimers t = TimersFrom(inst_->settings());
  const int rd = std::max(1, std::min<int>(max_rd_atomic_, m.rd_atomic));
  std::string err;
  for (size_t i = 0; i < qps_.size(); ++i) {
    RemoteQp r;
    r.qpn = m.qps[i].qpn;
    r.psn = m.qps[i].psn;
    std::memcpy(r.gid, m.gid, 16);
    r.lid = m.lid;
    r.mtu = m.mtu;
    if (!QpToRtr(qps_[i].qp, *local_, r, 1, t, &err) ||
        !QpToRts(qps_[i].qp, qps_[i].psn, rd, t, &err)) {
      for (auto& q : qps_) QpToState(q.qp, IBV_QPS_RESET);
      last_error_ = err;
      FailQueuedLocked(FERRY_ERR_NOT_SENT, err + " (" + Where() + ")", out);
      return;
    }
  }
  state_ = State::kReady;
  idle_timer_armed_ = false;  // a timer of the last life finds it armed no more
  Log(inst_->host(), FERRY_LOG_DEBUG, "connected %zu QPs to %s, mtu %s", qps_.size(),
      Where().c_str(), MtuName(std::min<int>(local_->attr.active_mtu, m.mtu)));
  PumpLocked(out);
  ArmIdleLocked();
}

void Conn::FinishLocked(const std::shared_ptr<Xfer>& x, int status, const std::string& msg,
                        FinishedList* out) {
  if (x->stage == Xfer::Stage::kDone) return;
  x->stage = Xfer::Stage::kDone;
  inflight_.erase(x);
  out->push_back({x->xfer_ctx, status, msg, x->deadline_ns, x->timer_seq});
  last_active_ = inst_->Now();
  ArmIdleLocked();
}

void Conn::ArmIdleLocked() {
  const int idle_ms = inst_->settings().qp_idle_ms;
  if (idle_ms <= 0 || idle_timer_armed_ || state_ != State::kReady || !QuietLocked()) return;
  idle_timer_armed_ = true;
  idle_timer_at_ = last_active_ + static_cast<uint64_t>(idle_ms) * 1000000ull;
  inst_->AddConnTimer(idle_timer_at_, weak_from_this());
}

void Conn::DestroyQpsLocked() {
  for (auto& q : qps_) {
    inst_->UnregisterQp(local_->dev->index, q.qp->qp_num);
    ibv_destroy_qp(q.qp);
  }
  qps_.clear();
  if (cqes_reserved_) local_->dev->ReleaseCqes(cqes_reserved_);
  cqes_reserved_ = 0;
}

void Conn::ReleaseIdleLocked() {
  Log(inst_->host(), FERRY_LOG_DEBUG, "releasing %zu idle QPs to %s", qps_.size(), Where().c_str());
  // The target's QPs go with ours; a later handshake makes new ones on both sides.
  inst_->SendDisconnect(peer_key_, DisconnectLocked());
  DestroyQpsLocked();
  state_ = State::kIdle;
}

wire::ConnectMsg Conn::DisconnectLocked() const {
  wire::ConnectMsg m;
  m.type = wire::MsgType::kDisconnect;
  m.conn_id = conn_id_;
  m.ini_port = static_cast<uint16_t>(local_->index);
  m.tgt_port = remote_port_;
  return m;
}

bool Conn::Farewell(wire::ConnectMsg* m) {
  std::lock_guard lk(mu_);
  if (state_ != State::kReady || qps_.empty()) return false;
  *m = DisconnectLocked();
  return true;
}

void Conn::FailQueuedLocked(int status, const std::string& why, FinishedList* out) {
  // Handshake failures pass FERRY_ERR_NOT_SENT: no work request of a queued
  // transfer was posted (a reset fails those that had some first), so the core
  // fails them over without fencing the target - an rdma fence retires every
  // QP serving this initiator there, its other transfers' too.
  for (auto& x : queue_) FinishLocked(x, status, why, out);
  queue_.clear();
}

void Conn::DataDoneLocked(const std::shared_ptr<Xfer>& x, FinishedList* out) {
  if (x->notify_pipelined) return;  // its SEND's completion finishes it
  if (x->notify) {
    x->stage = Xfer::Stage::kNotifyQueued;
    notify_queue_.push_back(x);
  } else {
    FinishLocked(x, FERRY_OK, "", out);
  }
}

void Conn::PumpLocked(FinishedList* out) {
  if (state_ != State::kReady) return;
  const size_t n = qps_.size();
  struct Chain {
    std::vector<ibv_send_wr> wrs;
    std::vector<ibv_sge> sges;
    std::vector<size_t> sge_at;
  };
  std::vector<Chain> chains(n);
  const int max_wr = caps_.send_wr;

  auto add = [&](size_t qi, ibv_send_wr wr, const ibv_sge* sg, int nsg, bool force_signal,
                 const std::shared_ptr<Xfer>& x, bool notify) {
    Qp& q = qps_[qi];
    const bool signaled =
        force_signal || q.unsignaled_run + 1 >= signal_interval_ || q.outstanding + 1 >= max_wr;
    wr.wr_id = inst_->NextWrId();
    if (signaled) wr.send_flags |= IBV_SEND_SIGNALED;
    ++q.outstanding;
    if (signaled) {
      q.fifo.push_back({wr.wr_id, q.unsignaled_run + 1, x, notify});
      q.unsignaled_run = 0;
      if (!notify) ++x->signals_pending;
    } else {
      ++q.unsignaled_run;
    }
    Chain& c = chains[qi];
    c.sge_at.push_back(c.sges.size());
    c.sges.insert(c.sges.end(), sg, sg + nsg);
    wr.num_sge = nsg;
    c.wrs.push_back(wr);
  };

  while (!notify_queue_.empty()) {
    auto x = notify_queue_.front();
    if (x->stage != Xfer::Stage::kNotifyQueued) {
      notify_queue_.pop_front();
      continue;
    }
    const size_t qi = x->qp_base % n;
    if (qps_[qi].outstanding >= max_wr) break;
    wire::EncodeNotify(x->uid, x->notify_msg);
    ibv_sge sge{reinterpret_cast<uintptr_t>(x->notify_msg), wire::kNotifySize, 0};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_INLINE;
    add(qi, wr, &sge, 1, true, x, true);
    x->stage = Xfer::Stage::kNotifyPosted;
    notify_queue_.pop_front();
  }

  ibv_sge sg[64];
  while (!queue_.empty()) {
    auto x = queue_.front();
    if (x->stage == Xfer::Stage::kDone) {
      queue_.pop_front();
      continue;
    }
    if (x->stage == Xfer::Stage::kQueued) {
      x->stage = Xfer::Stage::kData;
      x->notify_pipelined = x->notify && (n == 1 || x->plan.wrs.size() == 1);
      inflight_.insert(x);
    }
    const size_t total = x->plan.wrs.size();
    bool blocked = false;
    while (x->next < total) {
      const size_t k = x->next;
      const size_t qi = (x->qp_base + k) % n;
      if (qps_[qi].outstanding >= max_wr) {
        blocked = true;
        break;
      }
      const PlannedWr& p = x->plan.wrs[k];
      ibv_send_wr wr{};
      wr.opcode = x->is_read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      wr.wr.rdma.remote_addr = x->remote_base + p.remote_off;
      wr.wr.rdma.rkey = x->rkey;
      if (!x->is_read && p.len <= static_cast<uint64_t>(caps_.inline_bytes))
        wr.send_flags |= IBV_SEND_INLINE;
      const uint32_t nsg = std::min<uint32_t>(p.sge_count, 64);
      for (uint32_t j = 0; j < nsg; ++j) {
        const PlannedSge& s = x->plan.sges[p.sge_begin + j];
        sg[j] = {x->local_base + s.local_off, s.len, x->lkey};
      }
      // The last WR on a QP is signaled, unless a pipelined SEND follows it there.
      add(qi, wr, sg, static_cast<int>(nsg), k + n >= total && !x->notify_pipelined, x, false);
      ++x->next;
    }
    if (!blocked && x->notify_pipelined && !x->notify_sent) {
      const size_t qi = x->qp_base % n;  // the QP of all its data
      if (qps_[qi].outstanding >= max_wr) {
        blocked = true;
      } else {
        wire::EncodeNotify(x->uid, x->notify_msg);
        ibv_sge sge{reinterpret_cast<uintptr_t>(x->notify_msg), wire::kNotifySize, 0};
        ibv_send_wr wr{};
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_INLINE | (x->is_read ? IBV_SEND_FENCE : 0);
        add(qi, wr, &sge, 1, true, x, true);
        x->notify_sent = true;
      }
    }
    if (blocked) break;
    queue_.pop_front();
  }

  for (size_t qi = 0; qi < n; ++qi) {
    Chain& c = chains[qi];
    if (c.wrs.empty()) continue;
    for (size_t i = 0; i < c.wrs.size(); ++i) {
      c.wrs[i].sg_list = &c.sges[c.sge_at[i]];
      c.wrs[i].next = i + 1 < c.wrs.size() ? &c.wrs[i + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(qps_[qi].qp, c.wrs.data(), &bad);
    if (rc != 0) {
      ResetLocked(FERRY_ERR_TRANSPORT,
                  std::string("ibv_post_send failed: ") + std::strerror(rc) + " on " + Where(),
                  nullptr, 0, "", out);
      return;
    }
  }
}

void Conn::OnWc(int qi, const ibv_wc& wc, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ != State::kReady || qi < 0 || static_cast<size_t>(qi) >= qps_.size()) return;
  Qp& q = qps_[qi];
  if (wc.wr_id < q.first_id) return;  // from before the last reset
  if (wc.status != IBV_WC_SUCCESS) {
    char buf[320];
    std::snprintf(buf, sizeof buf, "%s (wc status %d, vendor error 0x%x) on QP %u to ",
                  ibv_wc_status_str(wc.status), static_cast<int>(wc.status), wc.vendor_err,
                  wc.qp_num);
    ResetLocked(FERRY_ERR_TRANSPORT, buf + Where(), nullptr, 0, "", out);
    return;
  }
  while (!q.fifo.empty() && q.fifo.front().wr_id <= wc.wr_id) {
    SigRec r = std::move(q.fifo.front());
    q.fifo.pop_front();
    q.outstanding -= r.retires;
    const auto& x = r.x;
    if (x->stage == Xfer::Stage::kDone) continue;
    if (r.notify) {
      FinishLocked(x, FERRY_OK, "", out);
      continue;
    }
    if (--x->signals_pending == 0 && x->next == x->plan.wrs.size()) DataDoneLocked(x, out);
  }
  PumpLocked(out);
}

void Conn::OnAsyncError(int qi, const std::string& what, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ != State::kReady) return;
  ResetLocked(FERRY_ERR_TRANSPORT,
              "async event " + what + " on QP " +
                  std::to_string(qps_[static_cast<size_t>(qi)].qp->qp_num) + " to " + Where(),
              nullptr, 0, "", out);
}

void Conn::ResetLocked(int status, const std::string& why, const std::shared_ptr<Xfer>& culprit,
                       int culprit_status, const std::string& culprit_msg, FinishedList* out) {
  last_error_ = why;
  Log(inst_->host(), FERRY_LOG_WARN, "resetting %zu QPs: %s", qps_.size(), why.c_str());
  std::vector<std::shared_ptr<Xfer>> victims(inflight_.begin(), inflight_.end());
  for (const auto& x : victims) {
    if (x == culprit) {
      FinishLocked(x, culprit_status, culprit_msg, out);
    } else if (x->NothingPosted()) {
      // At the head of the queue, waiting for send queue room: it waits for
      // the rebuilt connection like those behind it.
      x->stage = Xfer::Stage::kQueued;
      inflight_.erase(x);
    } else {
      FinishLocked(x, status, why, out);
    }
  }
  if (culprit) FinishLocked(culprit, culprit_status, culprit_msg, out);
  notify_queue_.clear();
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                              [](const auto& x) { return x->stage == Xfer::Stage::kDone; }),
               queue_.end());
  for (auto& q : qps_) {
    QpToState(q.qp, IBV_QPS_ERR);
    QpToState(q.qp, IBV_QPS_RESET);
    q.fifo.clear();
    q.outstanding = 0;
    q.unsignaled_run = 0;
    q.first_id = inst_->NextWrId();
  }
  if (state_ == State::kConnecting) inst_->UnregisterConnId(conn_id_);
  state_ = State::kIdle;
  if (!queue_.empty()) StartConnectLocked(out);  // transfers that never started: rebuild now
}

void Conn::Expire(const std::shared_ptr<Xfer>& x, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (x->stage == Xfer::Stage::kDone || state_ == State::kClosed) return;
  // Nothing of it posted: it leaves the queue, and the connection and the
  // other transfers on it are left alone; nothing was sent, so no fence is needed.
  if (x->NothingPosted()) {
    queue_.erase(std::remove(queue_.begin(), queue_.end(), x), queue_.end());
    FinishLocked(x, FERRY_ERR_NOT_SENT,
                 state_ == State::kConnecting
                     ? "deadline passed while the QP handshake with " + Where() + " was pending"
                     : "deadline passed while queued for send queue room on " + Where(),
                 out);
    return;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "deadline passed with work requests in flight (%zu of %zu posted, %d signaled "
                "still pending) on ",
                x->next, x->plan.wrs.size(), x->signals_pending);
  ResetLocked(FERRY_ERR_TRANSPORT, "connection reset after another transfer on it timed out", x,
              FERRY_ERR_TIMEOUT, buf + Where() + " (QPs reset)", out);
}

void Conn::OnTimer(uint64_t now, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ == State::kReady && idle_timer_armed_) {
    // Another timer of this connection (its handshake's): the idle one is still pending.
    if (now < idle_timer_at_) return;
    const uint64_t due =
        last_active_ + static_cast<uint64_t>(inst_->settings().qp_idle_ms) * 1000000ull;
    if (!QuietLocked()) {
      idle_timer_armed_ = false;  // armed again when it falls quiet
    } else if (now >= due) {
      idle_timer_armed_ = false;
      ReleaseIdleLocked();
    } else {
      idle_timer_at_ = due;
      inst_->AddConnTimer(due, weak_from_this());  // used since: look again then
    }
    return;
  }
  if (state_ != State::kConnecting || now < connect_deadline_) return;
  inst_->UnregisterConnId(conn_id_);
  state_ = State::kIdle;
  last_error_ = "handshake timed out";
  FailQueuedLocked(FERRY_ERR_NOT_SENT,
                   "no answer to the QP handshake from " + Where() + " within " +
                       std::to_string(inst_->settings().connect_timeout_ms) +
                       " ms (is the rdma backend loaded there?)",
                   out);
}

void Conn::Close(int status, const std::string& why, FinishedList* out) {
  std::lock_guard lk(mu_);
  if (state_ == State::kClosed) return;
  std::vector<std::shared_ptr<Xfer>> victims(inflight_.begin(), inflight_.end());
  for (const auto& x : victims) FinishLocked(x, status, why, out);
  FailQueuedLocked(status, why, out);
  notify_queue_.clear();
  if (state_ == State::kConnecting) inst_->UnregisterConnId(conn_id_);
  DestroyQpsLocked();
  state_ = State::kClosed;
}

// ---------------------------------------------------------------------------------
// Passive: the target side

namespace {
constexpr size_t kRecvSlot = 64;  // bytes per receive buffer (a notification is 16)
constexpr int kSlotBits = 12;     // recv wr_id = (id << 12) | slot; recv_depth <= 4096
}  // namespace

Passive::Passive(Instance* inst, std::string peer_key, Port* port, size_t qps)
    : inst_(inst), peer_key_(std::move(peer_key)), port_(port), qp_count_(qps) {}

Passive::~Passive() { Destroy(); }

bool Passive::Setup(const wire::ConnectMsg& req, wire::ConnectMsg* rep, std::string* err) {
  std::lock_guard lk(mu_);
  conn_id_ = req.conn_id;
  const Settings& s = inst_->settings();
  DeviceCtx* dev = port_->dev;
  const size_t n = req.qps.size();
  depth_ = std::min(s.recv_depth, dev->attr.max_qp_wr);
  const int cqes = static_cast<int>(n) * (depth_ + 2);
  if (!dev->ReserveCqes(cqes, err)) {
    // Each initiator's connection costs its QP count x (recv_depth + 2) here.
    *err += ": serving an initiator's connection reserves " + std::to_string(n) +
            " QPs x (recv_depth + 2) = " + std::to_string(cqes) +
            "; lower recv_depth here or qp_per_transfer at the initiators";
    return false;
  }
  cqes_reserved_ = cqes;
  buf_.assign(n * static_cast<size_t>(depth_) * kRecvSlot, 0);
  mr_ = ibv_reg_mr(dev->pd, buf_.data(), buf_.size(), IBV_ACCESS_LOCAL_WRITE);
  if (mr_ == nullptr) {
    *err = std::string("ibv_reg_mr for receive buffers failed: ") + std::strerror(errno);
    return false;
  }
  const QpTimers t = TimersFrom(s);
  const int max_dest = std::max(1, std::min(kMaxRdAtomic, dev->attr.max_qp_rd_atom));
  rep->type = wire::MsgType::kConnectRep;
  rep->conn_id = req.conn_id;
  rep->mtu = static_cast<uint8_t>(port_->attr.active_mtu);
  rep->rd_atomic = static_cast<uint8_t>(max_dest);
  rep->lid = port_->attr.lid;
  std::memcpy(rep->gid, port_->gid.raw, 16);
  for (size_t i = 0; i < n; ++i) {
    QpCaps caps;
    caps.send_wr = 1;
    caps.recv_wr = depth_;
    caps.sge = 1;
    caps.inline_bytes = 0;
    ibv_qp* qp = CreateRcQp(*port_, &caps, err);
    if (qp == nullptr) return false;
    qps_.push_back(qp);
    first_ids_.push_back(inst_->NextWrId());
    if (!QpToInit(qp, *port_,
                  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, err))
      return false;
    for (int slot = 0; slot < depth_; ++slot)
      if (!PostRecvLocked(static_cast<int>(i), slot)) {
        *err = std::string("ibv_post_recv failed: ") + std::strerror(errno);
        return false;
      }
    RemoteQp r;
    r.qpn = req.qps[i].qpn;
    r.psn = req.qps[i].psn;
    std::memcpy(r.gid, req.gid, 16);
    r.lid = req.lid;
    r.mtu = req.mtu;
    const uint32_t psn = RandomPsn();
    if (!QpToRtr(qp, *port_, r, max_dest, t, err) || !QpToRts(qp, psn, 1, t, err)) return false;
    inst_->RegisterQp(dev->index, qp->qp_num, {}, weak_from_this(), static_cast<int>(i));
    rep->qps.push_back({qp->qp_num, psn});
  }
  return true;
}

bool Passive::PostRecvLocked(int qi, int slot) {
  const size_t at =
      (static_cast<size_t>(qi) * static_cast<size_t>(depth_) + static_cast<size_t>(slot)) *
      kRecvSlot;
  ibv_sge sge{reinterpret_cast<uintptr_t>(buf_.data() + at), kRecvSlot, mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = (inst_->NextWrId() << kSlotBits) | static_cast<uint64_t>(slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(qps_[static_cast<size_t>(qi)], &wr, &bad);
  if (rc != 0) errno = rc;
  return rc == 0;
}

bool Passive::OnWc(int qi, const ibv_wc& wc, uint64_t* uid) {
  std::lock_guard lk(mu_);
  if (destroyed_ || qi < 0 || static_cast<size_t>(qi) >= qps_.size()) return false;
  if ((wc.wr_id >> kSlotBits) < first_ids_[static_cast<size_t>(qi)]) return false;
  if (wc.status != IBV_WC_SUCCESS) {
    if (wc.status != IBV_WC_WR_FLUSH_ERR)
      Log(inst_->host(), FERRY_LOG_DEBUG, "target-side QP %u from '%s': %s", wc.qp_num,
          peer_key_.c_str(), ibv_wc_status_str(wc.status));
    return false;
  }
  if (!(wc.opcode & IBV_WC_RECV)) return false;
  const int slot = static_cast<int>(wc.wr_id & ((1u << kSlotBits) - 1));
  if (slot >= depth_) return false;
  const size_t at =
      (static_cast<size_t>(qi) * static_cast<size_t>(depth_) + static_cast<size_t>(slot)) *
      kRecvSlot;
  const bool ok = wire::DecodeNotify(buf_.data() + at, wc.byte_len, uid);
  if (!ok)
    Log(inst_->host(), FERRY_LOG_WARN, "ignoring a malformed %u-byte SEND from '%s'", wc.byte_len,
        peer_key_.c_str());
  if (!closed_ && !PostRecvLocked(qi, slot))
    Log(inst_->host(), FERRY_LOG_WARN, "cannot repost a receive on QP %u: %s", wc.qp_num,
        std::strerror(errno));
  return ok;
}

void Passive::Retire() {
  std::lock_guard lk(mu_);
  if (closed_) return;
  closed_ = true;
  for (ibv_qp* qp : qps_) QpToState(qp, IBV_QPS_ERR);
}

void Passive::Destroy() {
  std::lock_guard lk(mu_);
  if (destroyed_) return;
  closed_ = destroyed_ = true;
  for (ibv_qp* qp : qps_) {
    inst_->UnregisterQp(port_->dev->index, qp->qp_num);
    ibv_destroy_qp(qp);
  }
  qps_.clear();
  if (mr_) ibv_dereg_mr(mr_);
  mr_ = nullptr;
  if (cqes_reserved_) port_->dev->ReleaseCqes(cqes_reserved_);
  cqes_reserved_ = 0;
}

}  // namespace ferry_rdma
