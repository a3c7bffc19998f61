// SPDX-License-Identifier: Apache-2.0
#include "responses.h"

#include <sys/epoll.h>
#include <sys/socket.h>

#include <thread>
#include <utility>

#include "lane.h"

namespace ferry_tcp {

ResponseReader::ResponseReader(Lane* lane, std::unique_ptr<ByteReader> in, int fd)
    : lane_(lane), in_(std::move(in)), fd_(fd) {
  ExpectHeader();
}

void ResponseReader::ExpectHeader() {
  phase_ = Phase::kHeader;
  want_.assign(1, iovec{hb_, sizeof(hb_)});
  want_first_ = 0;
}

void ResponseReader::Complete(int status, const std::string& msg) {
  std::exchange(current_, nullptr)->Resolve(status, msg);
  ++resolved_;
}

bool ResponseReader::Fail(int status, std::string msg) {
  status_ = status;
  msg_ = std::move(msg);
  return false;
}

ResponseReader::Pumped ResponseReader::Pump(bool may_block) {
  if (ended_) return Pumped::kOver;
  for (;;) {
    if (phase_ == Phase::kStaged) {
      if (!may_block) return Pumped::kNeedsBlocking;
      // Blocking reads through the stage: the payload is on its way.
      const int err = lane_->ReceiveStaged(*in_, *current_, &status_, &msg_);
      use_.reset();
      if (err != 0) return Pumped::kOver;
      Complete(FERRY_OK, {});
      ExpectHeader();
      continue;
    }
    size_t moved = 0;
    const int err = phase_ == Phase::kDiscard ? in_->DiscardSome(&discard_left_, &moved)
                                              : in_->ReadSome(want_, &want_first_, &moved);
    if (err == EAGAIN || err == EWOULDBLOCK) return Pumped::kWait;
    if (err != 0) {
      Fail(FERRY_ERR_TRANSPORT, lane_->Lost(err));
      return Pumped::kOver;
    }
    bool go_on = true;
    switch (phase_) {
      case Phase::kHeader:
        go_on = HeaderDone();
        break;
      case Phase::kErrorText:
        go_on = ErrorTextDone();
        break;
      case Phase::kPayload:
        use_.reset();
        Complete(FERRY_OK, {});
        ExpectHeader();
        break;
      case Phase::kDiscard:
        Complete(FERRY_ERR_BAD_STATE,
                 "local memory was deregistered during a READ from " + lane_->info_->label);
        ExpectHeader();
        break;
      case Phase::kStaged:  // handled above, before any read
        break;
    }
    if (!go_on) return Pumped::kOver;
  }
}

bool ResponseReader::HeaderDone() {
  const std::string& label = lane_->info_->label;
  std::string why;
  if (!wire::DecodeHeader(hb_, &h_, &why))
    return Fail(FERRY_ERR_PROTOCOL, "malformed frame from " + label + ": " + why);
  if (h_.type == wire::Type::kError) {
    text_.resize(h_.payload_len);
    want_.assign(1, iovec{text_.data(), text_.size()});
    want_first_ = 0;
    phase_ = Phase::kErrorText;
    return true;
  }
  if (h_.type != wire::Type::kWriteAck && h_.type != wire::Type::kReadData)
    return Fail(FERRY_ERR_PROTOCOL,
                std::string("unexpected ") + wire::TypeName(h_.type) + " frame from " + label);
  current_ = lane_->TakeInflight(h_.req_id);
  if (!current_) return Fail(FERRY_ERR_PROTOCOL, "response to an unknown request from " + label);
  // A direct READ's bytes were put in place by the target: its answer has none.
  const uint64_t payload = current_->direct ? 0 : current_->payload_bytes;
  if ((h_.type == wire::Type::kWriteAck) != current_->is_write ||
      (h_.type == wire::Type::kReadData && h_.payload_len != payload)) {
    return Fail(FERRY_ERR_PROTOCOL,
                std::string("mismatched ") + wire::TypeName(h_.type) + " from " + label);
  }
  if (h_.type == wire::Type::kWriteAck || current_->direct) {
    Complete(FERRY_OK, {});
    ExpectHeader();
    return true;
  }
  use_.emplace(current_->xfer->local.get(), fd_);
  if (!use_->ok()) {
    use_.reset();
    discard_left_ = h_.payload_len;
    phase_ = Phase::kDiscard;
    return true;
  }
  if (current_->xfer->local->on_gpu()) {
    phase_ = Phase::kStaged;  // Pump receives it, when it may block
    return true;
  }
  // Straight into the caller's memory: no staging copy.
  want_ = current_->local;
  want_first_ = 0;
  phase_ = Phase::kPayload;
  return true;
}

bool ResponseReader::ErrorTextDone() {
  const std::string& label = lane_->info_->label;
  if (h_.req_id == 0) return Fail(FERRY_ERR_REMOTE, label + " refused the connection: " + text_);
  current_ = lane_->TakeInflight(h_.req_id);
  if (!current_) return Fail(FERRY_ERR_PROTOCOL, "response to an unknown request from " + label);
  // The target's own code where it says what kind of refusal this is (the
  // core ends the transfer on NOT_FOUND / INVALID_ARGS / REMOTE, and fences
  // on TIMEOUT: an expired attempt may have had other frames applied).
  const int code = h_.status == FERRY_ERR_NOT_FOUND || h_.status == FERRY_ERR_INVALID_ARGS ||
                           h_.status == FERRY_ERR_TIMEOUT || h_.status == FERRY_ERR_GPU
                       ? h_.status
                       : FERRY_ERR_REMOTE;
  Complete(code, label + " refused the request: " + text_);
  ExpectHeader();
  return true;
}

void ResponseReader::Lost(int err) {
  if (status_ == FERRY_ERR_TRANSPORT && msg_.empty()) msg_ = lane_->Lost(err);
}

void ResponseReader::End() {
  if (ended_) return;
  ended_ = true;
  use_.reset();
  lane_->ReceiverEnded(status_, msg_, std::move(current_));
}

bool PolledResponses::PumpInTurn() {
  if (over_) return true;
  if (ring_ != nullptr && ring_->Woken(Channel::Side::kIn)) gone_ = true;
  for (;;) {
    if (reader_.Pump(/*may_block=*/true) == ResponseReader::Pumped::kOver) return over_ = true;
    if (ring_ == nullptr) return false;
    if (gone_) {
      // The socket fired and the ring has nothing more: the lane is over (a
      // ring wait's EPIPE, read as a socket's end of stream).
      reader_.Lost(kEof);
      return over_ = true;
    }
    if (ring_->SleepIn()) return false;  // else it came meanwhile: pump again
  }
}

uint32_t PolledResponses::OnEvents(IoPool::Handler* h) {
  for (;;) {
    if (turn_.TryTake()) {
      handler_ = h;
      const bool over = PumpInTurn();
      turn_.Release();
      // This turn re-arms the handler (or ends it), which covers any park: one
      // could only come from a second pool thread given the same handler.
      parked_.exchange(false);
      return over ? 0u : uint32_t{EPOLLIN};
    }
    // A waiting thread holds the turn: whoever lets go of it next re-arms us,
    // once (TryPump).
    parked_.store(true);
    if (turn_.held()) return IoPool::kParked;
    // It let go before it could see the park. Take the park back and try
    // again - unless it took it first: then it re-arms the handler, which this
    // thread must leave alone from here on.
    if (!parked_.exchange(false)) return IoPool::kParked;
  }
}

uint64_t PolledResponses::TryPump() {
  if (!turn_.TryTake()) return 0;
  bool blocking = false;
  const uint64_t before = reader_.resolved();
  if (handler_ != nullptr && !over_) {
    switch (reader_.Pump(/*may_block=*/false)) {
      case ResponseReader::Pumped::kWait:
        break;
      case ResponseReader::Pumped::kOver:
        // The pool ends it: shut down, the socket raises an event once armed.
        over_ = true;
        ::shutdown(fd_, SHUT_RDWR);
        break;
      case ResponseReader::Pumped::kNeedsBlocking:
        blocking = true;  // a READ's payload for the GPU stage: a pool thread's work
        break;
    }
  }
  IoPool::Handler* const h = handler_;
  const uint64_t done = reader_.resolved() - before;
  turn_.Release();
  if (h == nullptr) return done;  // closed
  // Exactly one re-arm per park, by whoever takes it: a re-arm of a handler
  // that is armed, or in a pool thread's turn, hands it to a second pool
  // thread, which then waits for the first one's turn (IoPool::Turn). A parked one
  // still has its event (the descriptor is level-triggered, and a ring's bell
  // was not quieted by the turn that found the turn held). A READ for the GPU
  // stage read ahead has no event of its own: EPOLLOUT fires on a writable
  // socket, a ring's wait set is nudged.
  if (parked_.exchange(false)) {
    pool_->Rearm(h, EPOLLIN | (blocking ? uint32_t{EPOLLOUT} : 0u), ring_ != nullptr && blocking);
  } else if (blocking && ring_ != nullptr) {
    // Armed, or a pool thread is on its way: the nudge is level-triggered,
    // so it fires once the handler is armed again.
    ring_->Nudge(Channel::Side::kIn);
  } else if (blocking) {
    // A socket has no nudge: re-armed for EPOLLOUT. A pool thread handed it
    // at this moment makes the next one wait for its turn, not run beside it.
    pool_->Rearm(h, EPOLLIN | EPOLLOUT);
  }
  return done;
}

void PolledResponses::Close() {
  turn_.Take();
  handler_ = nullptr;
  reader_.End();
  turn_.Release();
}

bool RingResponses::PumpInTurn() {
  turn_.Take();
  if (!over_) over_ = reader_.Pump(/*may_block=*/true) == ResponseReader::Pumped::kOver;
  const bool over = over_;
  turn_.Release();
  return over;
}

void RingResponses::Run(Channel* chan) {
  int lost = 0;
  while (!PumpInTurn()) {
    const int err = chan->WaitReadable();
    if (err == 0) continue;
    // The socket says the lane is over (the peer gone, or ours shut down), or
    // a stall: one last look at what arrived, then the end.
    lost = err == EPIPE ? kEof : err;
    PumpInTurn();
    break;
  }
  turn_.Take();
  if (lost != 0) reader_.Lost(lost);
  over_ = true;  // a waiting thread's TryPump touches nothing of the lane from here on
  reader_.End();
  turn_.Release();
}

uint64_t RingResponses::TryPump() {
  if (!turn_.TryTake()) return 0;
  const uint64_t before = reader_.resolved();
  if (!over_ && reader_.Pump(/*may_block=*/false) == ResponseReader::Pumped::kOver) {
    over_ = true;
    // The receiver may be asleep on the ring: the socket's end wakes it to end the lane.
    ::shutdown(fd_, SHUT_RDWR);
  }
  const uint64_t done = reader_.resolved() - before;
  turn_.Release();
  return done;
}

void ProgressSet::Add(std::shared_ptr<Pumpable> r) {
  std::lock_guard lk(mu_);
  members_.push_back(std::move(r));
}

void ProgressSet::Remove(const Pumpable* r) {
  std::lock_guard lk(mu_);
  for (size_t i = 0; i < members_.size(); ++i) {
    if (members_[i].get() == r) {
      members_[i] = std::move(members_.back());
      members_.pop_back();
      return;
    }
  }
}

uint64_t ProgressSet::Run() {
  // Pumped outside the lock: a completion may post, which adds to the set.
  thread_local std::vector<std::shared_ptr<Pumpable>> batch;
  {
    std::lock_guard lk(mu_);
    if (members_.empty()) return 0;
    batch.assign(members_.begin(), members_.end());
  }
  uint64_t done = 0;
  for (auto& r : batch) done += r->TryPump();
  batch.clear();
  if (done != 0) frames_.fetch_add(done, std::memory_order_relaxed);
  return done;
}

}  // namespace ferry_tcp
