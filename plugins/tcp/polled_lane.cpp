// SPDX-License-Identifier: Apache-2.0
#include "polled_lane.h"

#include <sys/socket.h>

#include <cerrno>
#include <utility>

#include "log.h"

namespace ferry_tcp {
namespace {

// Frames one lane serves per turn before another ready lane gets the thread.
constexpr int kFramesPerTurn = 16;

}  // namespace

PolledLane::PolledLane(TargetServer* server, TargetServer::Conn* conn, std::unique_ptr<Channel> ch,
                       TargetServer::LaneCtx ctx, std::string from, TargetServer::LaneProof proven,
                       uint64_t registrations_seen)
    : s_(server),
      conn_(conn),
      ch_(std::move(ch)),
      fd_(ch_->fd()),
      ctx_(std::move(ctx)),
      from_(std::move(from)),
      proven_(std::move(proven)),
      registrations_seen_(registrations_seen),
      in_(ch_->Reader()) {
  ExpectHeader();
  // The initiator may have written frames already, with nobody asleep to ring
  // for: the first turn comes at once and looks.
  if (ch_->on_rings()) ch_->Nudge();
}

PolledLane::~PolledLane() {
  if (disowned_) return;
  use_.reset();
  if (applying_) ctx_.tp->EndApply(h_, fd_, /*whole=*/false, 0);
  if (!close_why_.empty()) {
    s_->WarnFrom("closed", from_, "closing lane from " + ctx_.who + ": " + close_why_);
  } else {
    Log(s_->host_, FERRY_LOG_DEBUG, "lane from %s closed", ctx_.who.c_str());
  }
  ctx_.tp->Detach(fd_);
  s_->ReleaseConn(conn_);  // closes the descriptor
}

void PolledLane::Expire() {
  expired_.store(true);
  ::shutdown(fd_, SHUT_RDWR);  // the next event ends the lane
}

void PolledLane::ExpectHeader() {
  phase_ = Phase::kHeader;
  want_.assign(1, iovec{hb_, sizeof(hb_)});
  want_first_ = 0;
  piece_got_ = 0;
  ClearStall();
}

void PolledLane::Respond(std::vector<uint8_t> frame, Then then) {
  out_ = std::move(frame);
  out_iov_.assign(1, iovec{out_.data(), out_.size()});
  out_progress_ = 0;
  then_ = then;
  phase_ = Phase::kSend;
}

PolledLane::Step PolledLane::Close(std::string why) {
  close_why_ = std::move(why);
  return Step::kClose;
}

PolledLane::Step PolledLane::WaitFor(Step wait) {
  if (!ch_->on_rings()) return wait;
  // The socket fired and the rings have nothing more for us: the lane is over
  // (a ring read ends as a socket's at end of stream, a write as EPIPE).
  if (gone_) return wait == Step::kWaitIn ? Step::kGoOn : Step::kClose;
  const bool sleep = wait == Step::kWaitIn ? ch_->SleepIn() : ch_->SleepOut();
  return sleep ? wait : Step::kGoOn;
}

uint32_t PolledLane::OnEvents(uint32_t /*events*/) {
  waits_data_ = false;
  if (ch_->on_rings() && ch_->Woken()) gone_ = true;
  int frames = 0;
  size_t moved_total = 0;
  for (;;) {
    size_t moved = 0;
    Step st;
    if (phase_ == Phase::kSend) {
      const size_t before = out_progress_;
      // MSG_MORE before a held-back byte: it follows at once, in the same segment.
      const int err = ch_->Send(out_iov_.data(), out_iov_.size(), &out_progress_,
                                MSG_DONTWAIT | (then_ == Then::kNotifyTail ? MSG_MORE : 0));
      moved = out_progress_ - before;
      if (err == EAGAIN || err == EWOULDBLOCK) {
        st = WaitFor(Step::kWaitOut);
        if (st == Step::kClose)
          st = Close(expired_.load() ? IoErrorString(EAGAIN)
                                     : "cannot answer: " + IoErrorString(EPIPE));
      } else if (err != 0) {
        st =
            Close(expired_.load() ? IoErrorString(EAGAIN) : "cannot answer: " + IoErrorString(err));
      } else {
        st = Sent();
        if (st == Step::kGoOn && phase_ == Phase::kHeader && ++frames >= kFramesPerTurn) {
          // Another lane's turn. Bytes read ahead raise no event: EPOLLOUT,
          // ready at once on a writable socket, brings this lane back for
          // them; on rings, a sleep announced where bytes wait is refused,
          // and our own nudge (an eventfd in the wait set) brings it back.
          if (ch_->on_rings()) {
            if (!ch_->SleepIn()) ch_->Nudge();
            waits_data_ = !gone_;
            return EPOLLIN;
          }
          return EPOLLIN | (in_->buffered() ? uint32_t{EPOLLOUT} : 0u);
        }
      }
    } else {
      st = ReadPhase(&moved);
    }
    moved_total += moved;
    switch (st) {
      case Step::kGoOn:
        continue;
      case Step::kClose:
        return 0;
      case Step::kWaitIn:
      case Step::kWaitOut:
        if (phase_ == Phase::kHeader && piece_got_ == 0) {
          ClearStall();  // between frames: an idle lane is fine
        } else if (moved_total > 0 || !stall_set()) {
          SetStall(std::chrono::milliseconds(s_->settings_.io_timeout_ms));
        }
        waits_data_ = st == Step::kWaitIn && ch_->on_rings() && !gone_;
        return st == Step::kWaitIn ? uint32_t{EPOLLIN} : ch_->RoomEvents();
    }
  }
}

PolledLane::Step PolledLane::ReadPhase(size_t* moved) {
  int err;
  if (phase_ == Phase::kDiscard) {
    err = in_->DiscardSome(&discard_left_, moved);
  } else {
    err = in_->ReadSome(want_, &want_first_, moved);
    if (phase_ == Phase::kHeader) piece_got_ += *moved;
  }
  if (err == EAGAIN || err == EWOULDBLOCK) {
    const Step st = WaitFor(Step::kWaitIn);
    if (st != Step::kGoOn || !gone_) return st;
    err = kEof;  // the socket fired and the ring is empty
  }
  if (err != 0) {
    if (expired_.load()) return Close(IoErrorString(EAGAIN));
    // End of stream between frames is the initiator closing an idle lane.
    if (err == kEof && phase_ == Phase::kHeader && piece_got_ == 0) return Close({});
    return Close(IoErrorString(err));
  }
  switch (phase_) {
    case Phase::kHeader:
      return HeaderDone();
    case Phase::kItems:
      return ItemsDone();
    case Phase::kPayload:
      return PayloadDone();
    case Phase::kDiscard:
      return Refused();
    case Phase::kSend:
      break;
  }
  return Close("internal error: read in the send phase");
}

PolledLane::Step PolledLane::HeaderDone() {
  std::string why = s_->AcceptHead(hb_, ctx_.key, proven_, &registrations_seen_,
                                   ch_->direct_peer() != nullptr, &h_);
  if (!why.empty()) return Close(why);
  item_buf_.resize(TargetServer::BodyBytes(h_));
  want_.assign(1, iovec{item_buf_.data(), item_buf_.size()});
  want_first_ = 0;
  phase_ = Phase::kItems;
  return Step::kGoOn;
}

PolledLane::Step PolledLane::ItemsDone() {
  std::string why = TargetServer::AcceptItems(h_, item_buf_, &items_, &addrs_);
  if (!why.empty()) return Close(why);
  return Begin();
}

PolledLane::Step PolledLane::Begin() {
  TargetPeer& tp = *ctx_.tp;
  // The peer was removed or the engine is stopping (both also shut the socket down).
  if (tp.removed() || s_->stopped_.load(std::memory_order_relaxed)) return Close({});
  const bool is_write = h_.type == wire::Type::kWrite;
  reason_.clear();
  status_ = s_->CheckRequest(h_, items_, &region_, &reason_);
  // Removed meanwhile: a backend being removed deregisters its regions right
  // after removing its peers, so "not registered" may be that, not a refusal.
  if (status_ == FERRY_ERR_NOT_FOUND &&
      (tp.removed() || s_->stopped_.load(std::memory_order_relaxed)))
    return Close({});
  if (status_ == FERRY_OK && region_->on_gpu()) return ServeBlocking();
  if (status_ == FERRY_OK && is_write) {
    applying_ = tp.BeginApply(h_, fd_, ctx_.clock_offset);
    if (!applying_) {
      status_ = FERRY_ERR_TIMEOUT;
      reason_ = TargetServer::FencedReason(h_);
    }
  }
  if (status_ == FERRY_OK) {
    use_.emplace(region_.get(), fd_);
    if (!use_->ok()) {
      use_.reset();
      status_ = FERRY_ERR_NOT_FOUND;
      reason_ = TargetServer::RevokedReason(h_);
    }
  }
  const bool direct = (h_.flags & wire::kFlagDirect) != 0;
  if (status_ != FERRY_OK) {
    region_.reset();
    // A direct request's payload, its addresses, came with its items.
    if (!is_write || direct) return Refused();
    discard_left_ = h_.payload_len;  // still on its way: skip it to stay in step
    phase_ = Phase::kDiscard;
    return Step::kGoOn;
  }
  if (direct) return ServeDirect();
  // Straight between the socket and registered memory: no staging copy.
  std::vector<iovec> mem;
  mem.reserve(items_.size() + 1);
  for (const auto& it : items_) mem.push_back({region_->addr() + it.offset, it.len});
  if (is_write) {
    want_ = std::move(mem);
    want_first_ = 0;
    phase_ = Phase::kPayload;
    return Step::kGoOn;
  }
  std::vector<uint8_t> head(wire::kHeaderSize);
  TargetServer::EncodeReadDataHead(h_, items_, head.data());
  // A notify READ holds back its last byte (copied out) until it is counted:
  // the initiator cannot complete before the target has been told.
  const bool notify = (h_.flags & wire::kFlagNotify) != 0;
  if (notify) {
    iovec& tail = mem.back();
    tail.iov_len -= 1;
    last_ = PayloadByte(static_cast<uint8_t*>(tail.iov_base) + tail.iov_len);
  }
  Respond(std::move(head), notify ? Then::kNotifyTail : Then::kReadDone);
  out_iov_.insert(out_iov_.end(), mem.begin(), mem.end());
  return Step::kGoOn;
}

PolledLane::Step PolledLane::PayloadDone() {
  use_.reset();
  // Counted (the notification recorded) before EndApply: a fence that sees the
  // attempt whole also sees the target told.
  const bool whole = s_->Count(ctx_, h_, FERRY_OK, &close_why_);
  ctx_.tp->EndApply(h_, fd_, whole, TargetServer::ItemBytes(items_));
  applying_ = false;
  region_.reset();
  if (!whole) return Step::kClose;
  wire::Header ack;
  ack.type = wire::Type::kWriteAck;
  ack.req_id = h_.req_id;
  std::vector<uint8_t> frame(wire::kHeaderSize);
  wire::EncodeHeader(ack, frame.data());
  Respond(std::move(frame), Then::kNextFrame);
  return Step::kGoOn;
}

PolledLane::Step PolledLane::ServeDirect() {
  // On the pool thread: one copy of at most a frame's payload (it may wait on
  // the initiator's page faults; direct_copy.h).
  bool close_lane = false;
  status_ = TargetServer::CopyDirect(*ch_, h_, items_, addrs_, *region_, &reason_, &close_lane);
  if (status_ != FERRY_OK) {
    use_.reset();
    region_.reset();
    // Closing ends a WRITE's apply not whole (the destructor): part may have landed.
    if (close_lane) return Close(reason_);
    return Refused();
  }
  if (h_.type == wire::Type::kWrite) return PayloadDone();
  use_.reset();
  region_.reset();
  // Counted before the answer that lets the initiator complete.
  if (!s_->Count(ctx_, h_, FERRY_OK, &close_why_)) return Step::kClose;
  std::vector<uint8_t> frame(wire::kHeaderSize);
  TargetServer::EncodeDirectReadDone(h_, frame.data());
  Respond(std::move(frame), Then::kNextFrame);
  return Step::kGoOn;
}

PolledLane::Step PolledLane::Refused() {
  const bool counted = s_->Count(ctx_, h_, status_, &close_why_);
  if (applying_) {  // began, then its memory went: nothing of it was stored
    ctx_.tp->EndApply(h_, fd_, /*whole=*/false, 0);
    applying_ = false;
  }
  if (!counted) return Step::kClose;
  Log(s_->host_, FERRY_LOG_INFO, "refused %s from %s: %s", wire::TypeName(h_.type),
      ctx_.who.c_str(), reason_.c_str());
  Respond(TargetServer::ErrorFrame(h_.req_id, status_, reason_), Then::kNextFrame);
  return Step::kGoOn;
}

PolledLane::Step PolledLane::Sent() {
  switch (then_) {
    case Then::kNextFrame:
      break;
    case Then::kReadDone:
      use_.reset();
      region_.reset();
      if (!s_->Count(ctx_, h_, FERRY_OK, &close_why_)) return Step::kClose;
      break;
    case Then::kNotifyTail:
      use_.reset();
      region_.reset();
      if (!s_->Count(ctx_, h_, FERRY_OK, &close_why_)) return Step::kClose;
      Respond({last_}, Then::kNextFrame);
      return Step::kGoOn;
  }
  ExpectHeader();
  return Step::kGoOn;
}

PolledLane::Step PolledLane::ServeBlocking() {
  region_.reset();
  // The socket's own timeouts (SO_RCVTIMEO, SO_SNDTIMEO), or the rings' io
  // timeout, bound it now.
  ClearStall();
  const bool socket = !ch_->on_rings();
  if (socket && !SetNonBlocking(fd_, false))
    return Close(std::string("fcntl: ") + IoErrorString(errno));
  // The reader keeps what it read ahead: the blocking reads continue from it.
  const bool go_on = s_->ServeFrame(*ch_, *in_, ctx_, h_, items_, addrs_, &close_why_);
  if (socket && !SetNonBlocking(fd_, true))
    return Close(std::string("fcntl: ") + IoErrorString(errno));
  if (!go_on) return Step::kClose;
  ExpectHeader();
  return Step::kGoOn;
}

}  // namespace ferry_tcp
