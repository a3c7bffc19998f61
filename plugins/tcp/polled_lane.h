// SPDX-License-Identifier: Apache-2.0
// An admitted lane on the target side, served by the I/O pool (io_pool.h)
// with non-blocking I/O: the same protocol as the blocking loop in
// target.cpp (TargetServer::ServeRequest) - every request checked before
// memory is touched, a WRITE applied between the fence's BeginApply and
// EndApply and acknowledged only after it is stored and counted, a notify
// READ holding back its last byte until it is counted - as a state machine
// that gives its thread back whenever the socket has nothing for it.
//
// A same-host lane runs the same machine over its shared rings (channel.h):
// the pool watches the channel's wait set - the rings' bells and the socket -
// instead of the socket, the lane reads and writes the rings without waiting,
// and announces its sleep (Channel::SleepIn / SleepOut) before it gives the
// thread back, so the peer rings it awake. The socket firing means the lane
// is over once the rings hold nothing more (a blocked ring wait's rule).
//
// A frame moves through kHeader -> kItems -> kPayload (a WRITE's bytes, straight
// into registered memory) or kDiscard (a refused WRITE's) -> kSend (the
// response; a READ's data goes straight from registered memory). A lane that
// stops moving mid-frame for io_timeout_ms is cut (IoPool::SetStall). A
// request on GPU memory is served with blocking I/O on the pool thread (the
// staging pipeline of gpu_stage.h), bounded by the socket's io_timeout_ms per
// stall.
//
// Everything the lane holds (the region use, an apply in progress, its
// attachment to the peer, the descriptor) is released by its destructor, which
// the pool runs once OnEvents said it is finished, or at Stop.
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "channel.h"
#include "io_pool.h"
#include "region.h"
#include "socket_util.h"
#include "target.h"
#include "wire.h"

namespace ferry_tcp {

class PolledLane final : public IoPool::Handler {
 public:
  static constexpr uint32_t kFirstEvents = EPOLLIN;

  // ch: the admitted lane's byte stream - its socket (non-blocking; owned
  // from here on, as the Conn's) or its rings with a wait set made
  // (Channel::WaitSet).
  PolledLane(TargetServer* server, TargetServer::Conn* conn, std::unique_ptr<Channel> ch,
             TargetServer::LaneCtx ctx, std::string from, TargetServer::LaneProof proven,
             uint64_t registrations_seen);
  ~PolledLane() override;

  int fd() const override { return ch_->on_rings() ? ch_->WaitSet() : fd_; }
  uint32_t OnEvents(uint32_t events) override;
  void Expire() override;
  // Watching (io_pool.h): a ring lane waiting for the initiator's bytes is
  // looked at by a polling pool thread instead of rung. Any thread may call
  // Peek and SleepWatched: they read the rings' published indices only.
  bool WatchesData() const override { return waits_data_; }
  void Unsleep() override { ch_->WatchIn(); }
  bool Peek() const override { return ch_->InPending(); }
  bool SleepWatched() override { return ch_->SleepInAnyThread(); }
  // Bytes came as the pool stopped watching: its wait set becomes readable
  // (our own eventfd in it, made with the set), which gives the lane a turn.
  void Nudge() override { ch_->Nudge(); }
  // The pool refused the lane: the caller serves it and keeps what it holds.
  void Disown() { disowned_ = true; }
  // After Disown: the lane's byte stream, for the caller to serve.
  std::unique_ptr<Channel> TakeChannel() { return std::move(ch_); }

 private:
  enum class Phase { kHeader, kItems, kPayload, kDiscard, kSend };
  // What follows once the response has left.
  enum class Then { kNextFrame, kReadDone, kNotifyTail };
  // One step of the frame in progress: go on, wait for the socket, or close.
  enum class Step { kGoOn, kWaitIn, kWaitOut, kClose };

  Step ReadPhase(size_t* moved);
  // Nothing more to read (kWaitIn) or no room to send (kWaitOut) for now: on
  // rings, announce the sleep (or go on: it came meanwhile), and the end once
  // the socket fired.
  Step WaitFor(Step wait);
  Step HeaderDone();
  Step ItemsDone();
  // The request is whole up to its payload: check it and start serving it.
  Step Begin();
  Step PayloadDone();
  // A checked direct request (wire.h kFlagDirect): the copy, then its answer.
  Step ServeDirect();
  Step Refused();
  Step Sent();
  // A request on GPU memory, with blocking I/O through the staging pipeline.
  Step ServeBlocking();
  void ExpectHeader();
  void Respond(std::vector<uint8_t> frame, Then then);
  Step Close(std::string why);

  TargetServer* const s_;
  TargetServer::Conn* const conn_;
  std::unique_ptr<Channel> ch_;
  const int fd_;  // the socket: the lane's identity at the target (fences, Detach)
  TargetServer::LaneCtx ctx_;
  const std::string from_;
  const TargetServer::LaneProof proven_;
  uint64_t registrations_seen_;
  const std::unique_ptr<ByteReader> in_;
  bool gone_ = false;        // rings: the socket fired
  bool waits_data_ = false;  // rings: the last turn ended waiting for incoming bytes

  Phase phase_ = Phase::kHeader;
  std::vector<iovec> want_;  // what the read phase fills
  size_t want_first_ = 0;
  size_t piece_got_ = 0;  // bytes of the current header: 0 = between frames
  uint8_t hb_[wire::kHeaderSize];
  wire::Header h_;
  std::vector<uint8_t> item_buf_;
  std::vector<wire::Item> items_;
  std::vector<uint64_t> addrs_;  // a direct request's, in the initiator's memory
  std::shared_ptr<Region> region_;
  std::optional<RegionUse> use_;
  bool applying_ = false;  // between BeginApply and EndApply
  int status_ = FERRY_OK;  // a refused request's code and reason
  std::string reason_;
  uint64_t discard_left_ = 0;

  std::vector<uint8_t> out_;  // a response's head (or the whole of a small one)
  std::vector<iovec> out_iov_;
  size_t out_progress_ = 0;
  Then then_ = Then::kNextFrame;
  uint8_t last_ = 0;  // a notify READ's held-back byte

  std::string close_why_;
  std::atomic<bool> expired_{false};  // the pool cut a stall
  bool disowned_ = false;
};

}  // namespace ferry_tcp
