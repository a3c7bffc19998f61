// SPDX-License-Identifier: Apache-2.0
// The initiator side of a lane's incoming stream: response frames (WRITE_ACK,
// READ_DATA, ERROR), matched to the frames in flight and completed.
//
// One state machine, three drivers. A lane's responses are read by the
// engine's I/O pool (io_pool.h) as they arrive - no thread per lane; on rings
// through the channel's kIn wait set - or by an application thread waiting
// for a transfer (plugin.h progress(): the response is read where it is
// awaited, without waking a pool thread and then the waiter), whichever gets
// there first; without the pool, a ring lane's by its own receiver thread,
// which sleeps on the ring between responses, or by a waiting application
// thread likewise.
// Pump() reads until nothing more has arrived, completing what it can, and
// the frame being received keeps its place between calls. A READ into GPU
// memory is received with blocking reads through the staging pipeline
// (gpu_stage.h) - by the pool, never by a waiting application thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "channel.h"
#include "io_pool.h"
#include "region.h"
#include "socket_util.h"
#include "wire.h"
#include "xfer.h"

namespace ferry_tcp {

class Lane;

class ResponseReader {
 public:
  ResponseReader(Lane* lane, std::unique_ptr<ByteReader> in, int fd);
  enum class Pumped { kWait, kOver, kNeedsBlocking };
  // kWait: nothing more has arrived for now. kOver: the connection is over
  // (End() says why to the lane). kNeedsBlocking (only without may_block): a
  // READ's payload must go through the GPU stage, with blocking reads.
  Pumped Pump(bool may_block = true);
  // The byte stream is over for a reason of its own (err: socket_util.h),
  // unless a failure was already recorded; End() reports it.
  void Lost(int err);
  // Once Pump returned false, or the reader is dropped: fails what it held and
  // tells the lane its receiving side is done.
  void End();
  // It never started: End() does nothing.
  void Abandon() { ended_ = true; }
  bool buffered() const { return in_->buffered(); }
  // Frames completed so far.
  uint64_t resolved() const { return resolved_; }

 private:
  void Complete(int status, const std::string& msg);  // the current frame
  enum class Phase { kHeader, kErrorText, kPayload, kDiscard, kStaged };
  bool HeaderDone();
  bool ErrorTextDone();
  bool Fail(int status, std::string msg);  // false: ends the connection
  void ExpectHeader();

  Lane* const lane_;
  const std::unique_ptr<ByteReader> in_;
  const int fd_;
  Phase phase_ = Phase::kHeader;
  uint8_t hb_[wire::kHeaderSize];
  wire::Header h_;
  std::string text_;
  std::vector<iovec> want_;
  size_t want_first_ = 0;
  uint64_t discard_left_ = 0;
  FramePtr current_;  // the frame whose response is being read
  std::optional<RegionUse> use_;
  uint64_t resolved_ = 0;
  int status_ = FERRY_ERR_TRANSPORT;  // why the connection ended
  std::string msg_;
  bool ended_ = false;
};

// Who pumps a shared ResponseReader now: one thread at a time.
class Turn {
 public:
  bool TryTake() {
    bool expected = false;
    return held_.compare_exchange_strong(expected, true, std::memory_order_acquire);
  }
  // The other holder only pumps what has arrived (it never waits): its turn ends soon.
  void Take() {
    while (!TryTake()) std::this_thread::yield();
  }
  // seq_cst: with the parker's store and look (PolledResponses::OnEvents),
  // either it sees the turn free or the releaser sees it parked.
  void Release() { held_.store(false, std::memory_order_seq_cst); }
  bool held() const { return held_.load(); }

 private:
  std::atomic<bool> held_{false};
};

// What progress() pumps: a lane's responses, shared with another reader.
class Pumpable {
 public:
  virtual ~Pumpable() = default;
  // From a waiting thread: pumps when nobody else is, never blocking; the
  // frames it completed.
  virtual uint64_t TryPump() = 0;
};

// A lane's ResponseReader on the I/O pool, shared with the threads that call
// progress(): one of them at a time holds the turn and pumps. On a TCP lane
// the pool watches the socket; on a ring lane (ring: its channel) the
// channel's kIn wait set, and the pool's turn announces its sleep on the ring
// before it gives the thread back.
class PolledResponses final : public Pumpable {
 public:
  PolledResponses(Lane* lane, std::unique_ptr<ByteReader> in, int fd, IoPool* pool,
                  Channel* ring = nullptr)
      : fd_(fd), pool_(pool), ring_(ring), reader_(lane, std::move(in), fd) {}
  // What the pool watches.
  int fd() const { return ring_ != nullptr ? ring_->WaitSet(Channel::Side::kIn) : fd_; }
  // IoPool::Handler::Nudge for its handler.
  void Nudge() {
    if (ring_ != nullptr) ring_->Nudge(Channel::Side::kIn);
  }
  // The pool's event (from its handler): the events to wait for next, 0 when
  // the connection is over, IoPool::kParked when a waiting thread holds the turn.
  uint32_t OnEvents(IoPool::Handler* h);
  // progress(): pumps when nobody else is, never blocking; the frames it
  // completed. Once the pool's handler is gone (Close) it does nothing.
  uint64_t TryPump() override;
  // The pool's handler is being deleted: waits for the turn, ends the reader.
  void Close();
  // Before the handler is registered (no other thread sees it yet).
  void Bind(IoPool::Handler* h) { handler_ = h; }
  // The pool refused the handler: it never ran, Close ends nothing.
  void Abandon() {
    handler_ = nullptr;
    reader_.Abandon();
  }

 private:
  // The pool's turn: pumps until nothing more has arrived (on rings: and the
  // sleep is announced); true once the connection is over.
  bool PumpInTurn();

  const int fd_;
  IoPool* const pool_;
  Channel* const ring_;  // owned by the lane, which outlives the pool's handler
  bool gone_ = false;    // rings: the socket fired (under the turn)
  ResponseReader reader_;
  Turn turn_;
  // The pool's turn found a waiting thread holding the turn and parked the
  // handler: the next thread to let go of the turn takes this (exchange) and
  // re-arms it. Exactly one re-arm per park: see TryPump.
  std::atomic<bool> parked_{false};
  IoPool::Handler* handler_ = nullptr;  // set under the turn; null once closed
  bool over_ = false;                   // under the turn
};

// A ring lane's ResponseReader, shared by the lane's receiver thread (Run)
// and the threads that call progress(): one of them at a time holds the turn
// and pumps, without waiting; the receiver sleeps on the ring in between, and
// alone receives a READ's payload into GPU memory (its staging blocks). A
// waiting thread thus completes a short transfer without a thread wake-up on
// this side; the receiver, woken too, finds nothing left.
class RingResponses final : public Pumpable {
 public:
  RingResponses(Lane* lane, std::unique_ptr<ByteReader> in, int fd)
      : fd_(fd), reader_(lane, std::move(in), fd) {}
  // The receiver thread, until the connection is over; then ends the reader.
  void Run(Channel* chan);
  uint64_t TryPump() override;

 private:
  // One pump with the turn, blocking where a GPU stage needs it; true once over.
  bool PumpInTurn();
  const int fd_;
  ResponseReader reader_;
  Turn turn_;
  bool over_ = false;  // under the turn
};

// The pool's handle on a PolledResponses (the pool owns handlers; waiting
// threads hold the shared state for as long as they pump).
class PooledResponses final : public IoPool::Handler {
 public:
  explicit PooledResponses(std::shared_ptr<PolledResponses> r) : r_(std::move(r)) {}
  ~PooledResponses() override { r_->Close(); }
  int fd() const override { return r_->fd(); }
  uint32_t OnEvents(uint32_t events) override { return r_->OnEvents(this); }
  void Nudge() override { r_->Nudge(); }
  // The initiator's lanes have no stall limit of their own (deadlines do that).
  void Expire() override {}

 private:
  std::shared_ptr<PolledResponses> r_;
};

// The lanes with frames in flight, for progress().
class ProgressSet {
 public:
  void Add(std::shared_ptr<Pumpable> r);
  void Remove(const Pumpable* r);
  // From a waiting thread: one non-blocking pump of each; the frames completed.
  uint64_t Run();
  // Frames completed by waiting threads since the start (counters()).
  uint64_t frames() const { return frames_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> frames_{0};
  std::mutex mu_;
  std::vector<std::shared_ptr<Pumpable>> members_;
};

}  // namespace ferry_tcp
