// SPDX-License-Identifier: Apache-2.0
// The initiator side of one RC connection: qp_per_transfer QPs from one local
// port to one port of one peer, the transfers queued on it, and the state
// machine IDLE -> CONNECTING (handshake through the core's control channel) ->
// READY -> (error: QPs to RESET) -> IDLE, rebuilt by the next transfer.
//
// Everything under Conn::mu_. Methods never call the host: the transfers they
// finish are appended to a Finished list that the caller reports after
// unlocking (host->complete may re-enter the plugin).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "device.h"
#include "planner.h"
#include "qp.h"
#include "wire.h"

namespace ferry_rdma {

class Instance;
class Conn;

struct Xfer {
  enum class Stage { kQueued, kData, kNotifyQueued, kNotifyPosted, kDone };
  void* xfer_ctx = nullptr;
  uint64_t uid = 0;
  uint64_t deadline_ns = 0;
  uint64_t timer_seq = 0;  // key in Instance's timer map with deadline_ns
  bool notify = false;
  bool is_read = false;
  uint64_t local_base = 0;  // address of the local region
  uint32_t lkey = 0;
  uint64_t remote_base = 0;
  uint32_t rkey = 0;
  Plan plan;
  size_t next = 0;          // next work request to post
  int signals_pending = 0;  // signaled WRs posted and not completed
  uint32_t qp_base = 0;
  Stage stage = Stage::kQueued;
  // The notification SEND follows the data on the same QP without waiting for
  // its completion (all the data on one QP; RC keeps the order, and a FENCE
  // holds it behind READ responses). Else it is posted once the data completed.
  bool notify_pipelined = false;
  bool notify_sent = false;
  uint8_t notify_msg[wire::kNotifySize] = {};
  std::weak_ptr<Conn> conn;
  // No work request of it posted yet: queued, or at the head of the queue
  // waiting for send queue room (already counted in flight then).
  bool NothingPosted() const {
    return stage == Stage::kQueued || (stage == Stage::kData && next == 0);
  }
};

struct Finished {
  void* xfer_ctx;
  int status;
  std::string message;
  uint64_t deadline_ns;
  uint64_t timer_seq;
};
using FinishedList = std::vector<Finished>;

class Conn : public std::enable_shared_from_this<Conn> {
 public:
  Conn(Instance* inst, std::string peer_key, uint64_t peer_nonce, Port* local, uint16_t remote_port,
       wire::PortInfo remote_info);
  ~Conn();

  const std::string& peer_key() const { return peer_key_; }
  Port* local() const { return local_; }

  // Accepts a transfer: queues it, connects or posts as the state allows.
  void Enqueue(std::shared_ptr<Xfer> x, FinishedList* out);

  // The worker thread: the handshake message could not be sent.
  void OnSendFailed(uint64_t conn_id, const std::string& why, FinishedList* out);
  // The worker thread: the target answered.
  void OnReply(const wire::ConnectMsg& m, FinishedList* out);
  // The completion thread: a completion on QP qi.
  void OnWc(int qi, const ibv_wc& wc, FinishedList* out);
  // The completion thread: an async error event on QP qi.
  void OnAsyncError(int qi, const std::string& what, FinishedList* out);
  // The completion thread: the transfer's deadline passed.
  void Expire(const std::shared_ptr<Xfer>& x, FinishedList* out);
  // The completion thread: a connection timer - the handshake's deadline, or
  // the idle release (qp_idle_ms) - may have passed.
  void OnTimer(uint64_t now, FinishedList* out);
  // Fails everything with `status`, destroys the QPs; the Conn is dead after.
  void Close(int status, const std::string& why, FinishedList* out);
  // The DISCONNECT that has the target retire its side of this connection,
  // when there is a side to retire (QPs connected): before Close at
  // peer_remove and fini, so a peer that goes away gracefully leaves no QPs
  // at its targets.
  bool Farewell(wire::ConnectMsg* m);

  std::string StateName();

 private:
  enum class State { kIdle, kConnecting, kReady, kClosed };
  struct SigRec {
    uint64_t wr_id;
    int retires;  // WRs this completion frees on its QP (itself and the unsignaled before it)
    std::shared_ptr<Xfer> x;
    bool notify;
  };
  struct Qp {
    ibv_qp* qp = nullptr;
    uint32_t psn = 0;
    int outstanding = 0;     // posted WRs whose slot is not free yet
    int unsignaled_run = 0;  // unsignaled WRs since the last signaled one
    uint64_t first_id = 0;   // completions with a smaller wr_id belong to an earlier life
    std::deque<SigRec> fifo;
  };

  void StartConnectLocked(FinishedList* out);
  void PumpLocked(FinishedList* out);
  void DataDoneLocked(const std::shared_ptr<Xfer>& x, FinishedList* out);
  void FinishLocked(const std::shared_ptr<Xfer>& x, int status, const std::string& msg,
                    FinishedList* out);
  // A QP error (or a timeout with work in flight): fail what is in flight, QPs
  // to RESET, state IDLE; queued transfers that never started reconnect.
  void ResetLocked(int status, const std::string& why, const std::shared_ptr<Xfer>& culprit,
                   int culprit_status, const std::string& culprit_msg, FinishedList* out);
  void FailQueuedLocked(int status, const std::string& why, FinishedList* out);
  // Nothing queued, in flight or waiting to notify.
  bool QuietLocked() const { return queue_.empty() && inflight_.empty() && notify_queue_.empty(); }
  // Ready and quiet: the idle release is due at last_active_ + qp_idle_ms.
  void ArmIdleLocked();
  // Unregisters and destroys the QPs and gives their CQ entries back.
  void DestroyQpsLocked();
  // Ready, quiet and idle long enough: the QPs go, the target is told; IDLE.
  void ReleaseIdleLocked();
  wire::ConnectMsg DisconnectLocked() const;
  std::string Where() const;

  Instance* const inst_;
  const std::string peer_key_;
  const uint64_t peer_nonce_;
  Port* const local_;
  const uint16_t remote_port_;
  const wire::PortInfo remote_info_;

  std::mutex mu_;
  State state_ = State::kIdle;
  uint64_t conn_id_ = 0;
  uint64_t connect_deadline_ = 0;
  std::vector<Qp> qps_;
  QpCaps caps_;
  int max_rd_atomic_ = 1;
  int cqes_reserved_ = 0;
  int signal_interval_ = 1;
  uint32_t next_qp_base_ = 0;
  std::deque<std::shared_ptr<Xfer>> queue_;         // accepted, WRs left to post
  std::deque<std::shared_ptr<Xfer>> notify_queue_;  // data done, notification SEND to post
  std::unordered_set<std::shared_ptr<Xfer>> inflight_;
  std::string last_error_;
  uint64_t last_active_ = 0;       // host clock: a transfer queued or finished
  bool idle_timer_armed_ = false;  // a timer for the idle release is pending
  uint64_t idle_timer_at_ = 0;     // its deadline (host clock)
};

// The target side of one connection: QPs created on a peer's request, with
// receives posted for notification SENDs. Replaced when the same initiator port
// pair connects again; destroyed with the peer or the instance.
class Passive : public std::enable_shared_from_this<Passive> {
 public:
  // qps: how many QPs the handshake it answers names (Setup makes them).
  Passive(Instance* inst, std::string peer_key, Port* port, size_t qps);
  ~Passive();
  // Creates and connects the QPs to the initiator's; fills the reply.
  bool Setup(const wire::ConnectMsg& req, wire::ConnectMsg* rep, std::string* err);
  // A completion on QP qi; *uid set and true when it carried a notification.
  // A retired Passive still decodes what arrived before it was retired.
  bool OnWc(int qi, const ibv_wc& wc, uint64_t* uid);
  const std::string& peer_key() const { return peer_key_; }
  uint64_t conn_id() const { return conn_id_; }  // the handshake it answered (set by Setup)
  size_t qp_count() const { return qp_count_; }
  // Step 1 of closing: QPs to ERR, no more receives. The notifications already in
  // the CQ are still delivered: the initiator may have been acknowledged for them.
  void Retire();
  // Step 2, once the CQ was drained after Retire: destroy QPs and buffers.
  void Destroy();

 private:
  bool PostRecvLocked(int qi, int slot);

  Instance* const inst_;
  const std::string peer_key_;
  Port* const port_;
  const size_t qp_count_;
  std::mutex mu_;
  uint64_t conn_id_ = 0;
  bool closed_ = false;  // retired
  bool destroyed_ = false;
  std::vector<ibv_qp*> qps_;
  std::vector<uint64_t> first_ids_;
  std::vector<uint8_t> buf_;
  ibv_mr* mr_ = nullptr;
  int depth_ = 0;
  int cqes_reserved_ = 0;
};

}  // namespace ferry_rdma
