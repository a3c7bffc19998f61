// SPDX-License-Identifier: Apache-2.0
#include "lane.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <system_error>
#include <utility>

#include "handshake.h"
#include "hot_path.h"
#include "log.h"
#include "responses.h"
#include "ring_handover.h"
#include "thread_name.h"
#include "wire.h"

namespace ferry_tcp {
namespace {

// SendOne's answers when the local region was deregistered under the frame, and
// when a GPU frame got no staging buffer (nothing sent in either case).
constexpr int kLocalRevoked = -2;
constexpr int kNoStage = -3;

// Frames one turn of a PooledSender sends before it lets the pool's other
// handlers go first (a writable socket gives it the next turn at once).
constexpr int kFramesPerTurn = 16;

}  // namespace

// The pool's handle on a lane's sending side: registered on a duplicate of the
// lane's socket (epoll keeps the responses' registration on the original),
// EPOLLOUT - or, on rings, of the channel's kOut wait set, readable once the
// target made room (or nudged) - and parked while there is nothing to send.
// Its destructor closes the duplicate only: the lane closes its own
// descriptors when it retires the connection, and the last close ends them.
class PooledSender final : public IoPool::Handler {
 public:
  PooledSender(Lane* lane, int fd, Channel* ring) : lane_(lane), fd_(fd), ring_(ring) {}
  ~PooledSender() override { ::close(fd_); }
  int fd() const override { return fd_; }
  uint32_t OnEvents(uint32_t) override { return lane_->PoolSend(this); }
  // No stall limit of its own, as a sender thread had none (deadlines do that).
  void Expire() override {}
  // The lane arms it (holding its lock: the channel is there until retired).
  void Nudge() override {
    if (ring_ != nullptr) ring_->Nudge(Channel::Side::kOut);
  }

 private:
  Lane* const lane_;
  const int fd_;
  Channel* const ring_;
};

Lane::Lane(const PeerInfo* info, int index) : info_(info), index_(index) {}

Lane::~Lane() { Stop(FERRY_ERR_BAD_STATE, "lane destroyed"); }

void Lane::EnsureStarted() {
  if (UsesConnector()) return;  // Submit queues the connect, with the frame
  std::lock_guard lk(mu_);
  StartLocked();
}

bool Lane::UsesConnector() const {
  // TCP or rings: both are served by the pool once connected.
  return info_->connector != nullptr && info_->pool != nullptr;
}

void Lane::Connect() {
  std::unique_lock lk(mu_);
  while (!stopping_ && state_ == State::kDown && !queue_.empty()) ConnectLocked(lk);
  if (state_ == State::kUp && !Pooled() && !stopping_) {
    // The pool did not take the connection's sends: this thread sends for it,
    // as a lane's own thread does, until the lane closes.
    lk.unlock();
    SenderMain();
    return;
  }
  started_ = false;
}

void Lane::StartLocked() {
  // A connection served by the pool has no thread; the next is connected by one.
  if (started_ || stopping_ || Pooled()) return;
  if (UsesConnector()) {
    started_ = true;  // a connect is queued or running
    try {
      if (!info_->connector->Queue(this)) started_ = false;  // shutting down: Stop fails the queue
    } catch (...) {
      started_ = false;
      throw;
    }
    return;
  }
  // A sender that ended after an idle close set started_ under mu_ and touches
  // nothing after releasing it: joining here cannot wait on us.
  if (sender_.joinable()) sender_.join();
  last_used_ = std::chrono::steady_clock::now();  // a fresh thread waits for its first frame
  sender_ = ferry::named_thread("tcp-send", [this] { SenderMain(); });
  started_ = true;
}

bool Lane::QuietLocked() const { return queue_.empty() && !partial_ && inflight_.empty(); }

std::string Lane::Lost(int err) const {
  return "connection to " + info_->label + " lost: " + IoErrorString(err);
}

void Lane::Fail(Doomed& doomed) {
  for (auto& [f, status, msg] : doomed) {
    // A direct READ's target may still be copying into its memory: it
    // completes once that copy is over (push_waiter.h).
    if (f->push_link != nullptr && f->push_link->waiter() != nullptr)
      f->push_link->waiter()->Resolve(f, status, msg);
    else
      f->Resolve(status, msg);
  }
  doomed.clear();
}

void Lane::MaybeDirectLocked(Frame& f) {
  if (chan_ == nullptr || chan_->direct_link() == nullptr || !f.xfer->direct_ok ||
      f.payload_bytes < info_->direct_min_bytes || f.sent != 0)
    return;
  f.MakeDirect();
  if (!f.is_write) f.push_link = chan_->direct_link();
  if (info_->direct_frames != nullptr)
    info_->direct_frames->fetch_add(1, std::memory_order_relaxed);
}

void Lane::BreakLocked(int status, const std::string& msg, Doomed* doomed, bool reset,
                       uint64_t keep_from) {
  // A second report of a break already made (the sender's send failed and then
  // the receiver saw the close, or the other way round) must not fail frames
  // queued since: they belong to the next connection, not to this one.
  if (state_ == State::kBroken && !reset && !stopping_) {
    cv_.notify_all();
    return;
  }
  if (state_ == State::kUp) {
    state_ = State::kBroken;
    reason_status_ = status;
    reason_msg_ = msg;
    // With frames on the wire, abort the connection now, before any of them is
    // reported failed: otherwise the kernel (or the ring) keeps delivering the
    // queued WRITE payload after the transfers on this lane were failed (and
    // perhaps re-run on another backend), and it lands on top of newer data
    // (tests/faults). The descriptor stays valid for the threads still using
    // it; the sender thread closes it once both are done. An idle lane closes
    // gracefully, so an ordinary shutdown is not a "connection reset" at the target.
    if (!inflight_.empty() || partial_)
      chan_->AbortOutgoing();
    else
      chan_->CloseOutgoing();
    ::shutdown(fd_, SHUT_RDWR);
    // A direct READ's bytes are pushed by the target itself: the lane closes
    // to pushes now, and a READ failed with it waits out one under way (Fail).
    if (chan_->direct_link() != nullptr) chan_->direct_link()->gate().Close();
  } else if (state_ == State::kConnecting) {
    abort_connect_ = true;
    if (waker_ != nullptr) waker_->Signal();
  }
  const bool broken = state_ == State::kBroken;
  std::deque<FramePtr> kept;
  for (auto& f : queue_) {
    if (f->xfer->seq >= keep_from)
      kept.push_back(std::move(f));
    else
      doomed->emplace_back(f, broken ? reason_status_ : status, broken ? reason_msg_ : msg);
  }
  queue_.swap(kept);
  cv_.notify_all();
  ArmSenderLocked();  // a pool-served connection is retired by its sender's next turn
}

void Lane::Abort(int status, const std::string& msg, Doomed* doomed, uint64_t keep_from) {
  std::lock_guard lk(mu_);
  BreakLocked(status, msg, doomed, /*reset=*/true, keep_from);
}

void Lane::Reset(int status, const std::string& msg) {
  Doomed doomed;
  Abort(status, msg, &doomed);
  Fail(doomed);
}

void Lane::Stop(int status, const std::string& msg) {
  Doomed doomed;
  {
    std::lock_guard lk(mu_);
    stopping_ = true;
    BreakLocked(status, msg, &doomed, /*reset=*/true);
  }
  Fail(doomed);
  if (info_->connector != nullptr) info_->connector->Forget(this);
  {
    // The pool's handlers hold the lane until the connection is retired.
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !Pooled(); });
  }
  // The turn that retired it may still be unwinding its locks, send_mu_ last
  // (PoolSend): once we hold that, nothing of the pool's touches the lane.
  { std::lock_guard s(send_mu_); }
  if (sender_.joinable()) sender_.join();
  if (info_->reaper != nullptr) info_->reaper->Unwatch(this);
}

FERRY_HOT int Lane::SendOne(Frame& f, int flags) {
  std::optional<RegionUse> use;
  if (f.is_write) {
    use.emplace(f.xfer->local.get(), fd_);
    if (!use->ok()) return kLocalRevoked;
    if (f.xfer->local->on_gpu()) return SendStaged(f);
  }
  // A frame of a few pieces (the usual one: head and one payload piece)
  // gathers them on the stack; one of many items, in a vector.
  iovec few[8];
  std::vector<iovec> many;
  const size_t n = f.WireIovCount();
  iovec* iov = few;
  if (n > std::size(few)) {
    many.resize(n);
    iov = many.data();
  }
  f.WireIov(iov);
  f.xfer->MarkLeft();
  return chan_->Send(iov, n, &f.sent, flags);
}

int Lane::SendStaged(Frame& f) {
  // The stage first: without one, nothing has gone out and only this frame fails.
  StagePool::Lease stage = info_->stages->Acquire(f.xfer->local->device(), &gpu_error_);
  if (!stage) return kNoStage;
  iovec head{f.head.data(), f.head.size()};
  f.xfer->MarkLeft();
  int err = chan_->Send(&head, 1, &f.sent);
  if (err != 0) return err;
  err = stage->Send(*chan_, f.local.data(), f.local.size(), 0, nullptr);
  if (err == kGpuError) gpu_error_ = stage->error();
  if (err == 0) f.sent += f.payload_bytes;
  return err;
}

void Lane::AfterSendLocked(const FramePtr& f, int err, Doomed* doomed) {
  f->sending = false;
  if ((err == kLocalRevoked || err == kNoStage) && f->sent == 0) {
    // Nothing of it reached the socket, so the connection stays in step.
    inflight_.erase(f->req_id);
    SyncProgressLocked();
    if (err == kNoStage) {
      doomed->emplace_back(
          f, FERRY_ERR_GPU,
          "cannot stage GPU memory for a WRITE to " + info_->label + ": " + gpu_error_);
    } else {
      doomed->emplace_back(f, FERRY_ERR_BAD_STATE,
                           "local memory was deregistered during a transfer to " + info_->label);
    }
    return;
  }
  if (err == kLocalRevoked) {
    BreakLocked(FERRY_ERR_BAD_STATE,
                "local memory was deregistered during a transfer to " + info_->label, doomed);
  } else if (err == kGpuError) {
    BreakLocked(FERRY_ERR_GPU, "WRITE to " + info_->label + ": " + gpu_error_, doomed);
  } else if (err != 0) {
    BreakLocked(FERRY_ERR_TRANSPORT, Lost(err), doomed);
  }
  // The receiver has gone (or will not answer): whoever sent the frame fails it.
  if (state_ != State::kUp && inflight_.erase(f->req_id)) {
    doomed->emplace_back(f, reason_status_, reason_msg_);
    SyncProgressLocked();
  }
}

FERRY_HOT void Lane::Submit(FramePtr f, bool try_direct) {
  if (try_direct && send_mu_.try_lock()) {
    std::unique_lock s(send_mu_, std::adopt_lock);
    std::unique_lock lk(mu_);
    // Nothing queued or half-sent ahead of it: the frame keeps its place. Frames
    // already sent and awaiting their responses do not matter to the socket.
    if (state_ == State::kUp && !stopping_ && queue_.empty() && !partial_) {
      MaybeDirectLocked(*f);
      f->sending = true;
      last_used_ = std::chrono::steady_clock::now();
      inflight_.emplace(f->req_id, f);
      SyncProgressLocked();
      lk.unlock();
      // MSG_DONTWAIT: post() must not block on a slow peer.
      const int err = SendOne(*f, MSG_DONTWAIT);
      Doomed doomed;
      lk.lock();
      if (err == EAGAIN || err == EWOULDBLOCK) {
        partial_ = f;  // still `sending`; nothing else may use the socket first
        if (Pooled())
          ArmSenderLocked();
        else
          cv_.notify_all();
      } else {
        AfterSendLocked(f, err, &doomed);
      }
      lk.unlock();
      s.unlock();
      Fail(doomed);
      return;
    }
  }
  {
    std::lock_guard lk(mu_);
    if (!stopping_) {
      // The sender may have ended after an idle close since Post's EnsureStarted.
      StartLocked();
      last_used_ = std::chrono::steady_clock::now();
      // The sender waits only while the queue is empty: behind other frames it
      // is awake already. One wake-up per burst, not per frame (a 64 MiB post
      // is 64 frames: post() paid 64 futex wakes, issue 20 item 2).
      const bool was_empty = queue_.empty();
      queue_.push_back(std::move(f));
      work_posted_.store(true, std::memory_order_release);
      if (Pooled()) {
        ArmSenderLocked();
      } else if (was_empty) {
        // No waiter while the sender polls: the notify makes no system call then.
        cv_.notify_all();
      }
      return;
    }
  }
  f->Resolve(FERRY_ERR_BAD_STATE, "tcp lane to " + info_->label + " is shut down");
}

void Lane::SubmitAll(std::vector<FramePtr>& frames, IoPool::Kicks* kicks) {
  if (frames.empty()) return;
  {
    std::lock_guard lk(mu_);
    if (!stopping_) {
      StartLocked();
      last_used_ = std::chrono::steady_clock::now();
      const bool was_empty = queue_.empty();
      for (auto& f : frames) queue_.push_back(std::move(f));
      frames.clear();
      work_posted_.store(true, std::memory_order_release);
      if (Pooled())
        ArmSenderLocked(kicks);
      else if (was_empty)
        cv_.notify_all();
      return;
    }
  }
  std::vector<FramePtr> shut;
  shut.swap(frames);
  for (auto& f : shut)
    f->Resolve(FERRY_ERR_BAD_STATE, "tcp lane to " + info_->label + " is shut down");
}

int Lane::Open(int abort_fd, std::unique_ptr<Channel>* chan, std::string* err) {
  InitiatorHello hello;
  hello.host = info_->host;
  hello.my_key = info_->my_key;
  hello.peer_key = info_->key;
  hello.label = info_->label;
  hello.timeout_ms = info_->connect_timeout_ms;
  hello.abort_fd = abort_fd;
  int fd = -1;
  if (!info_->unix_name.empty()) {
    std::string why;
    if (ConnectUnix(info_->unix_name, info_->connect_timeout_ms, &fd, &why) == 0) {
      shm::Ring out, in;
      std::unique_ptr<direct::Process> target;
      std::shared_ptr<void> spare;
      int status = InitiatorHandshake(fd, hello, err);
      if (status == FERRY_OK) {
        status = OfferRings(fd, info_->ring_bytes, abort_fd, info_->connect_timeout_ms,
                            info_->label, info_->offer_direct, &out, &in, &target, &spare, err);
      }
      if (status == FERRY_OK) {
        // No stall limit of our own, as on a TCP lane: a broken lane is shut down.
        *chan = std::make_unique<Channel>(fd, std::move(out), std::move(in),
                                          std::chrono::milliseconds(0));
        (*chan)->SetSpin(std::chrono::microseconds(info_->ring_spin_us));
        if (info_->ring_lanes_opened != nullptr) info_->ring_lanes_opened->fetch_add(1);
        if (target) {
          (*chan)->EnableDirect(std::make_shared<direct::Link>(std::move(target), std::move(spare),
                                                               info_->push_waiter));
          if (info_->direct_lanes_opened != nullptr) info_->direct_lanes_opened->fetch_add(1);
        }
        return FERRY_OK;
      }
      ::close(fd);
      fd = -1;
      // Rings that cannot be made here or taken there make TCP the answer; a
      // refusal of us (not a registered peer, failed auth) stands.
      if (status != FERRY_ERR_NO_MEMORY && status != FERRY_ERR_UNSUPPORTED) return status;
      Log(info_->host, FERRY_LOG_WARN, "lane %d to %s: no shared rings (%s), using TCP", index_,
          info_->label.c_str(), err->c_str());
    } else {
      // Same node id, other network namespace (or the target is gone): TCP says which.
      Log(info_->host, FERRY_LOG_DEBUG, "lane %d to %s: %s, using TCP", index_,
          info_->label.c_str(), why.c_str());
    }
  }
  if (ConnectTcp(info_->addr, info_->port, info_->connect_timeout_ms, abort_fd, &fd, err) != 0) {
    return FERRY_ERR_TRANSPORT;
  }
  SetNoDelay(fd);
  SetKeepAlive(fd, info_->keepalive_s);
  const int status = InitiatorHandshake(fd, hello, err);
  if (status != FERRY_OK) {
    ::close(fd);
    return status;
  }
  *chan = std::make_unique<Channel>(fd);
  return FERRY_OK;
}

bool Lane::ConnectLocked(std::unique_lock<std::mutex>& lk) {
  state_ = State::kConnecting;
  abort_connect_ = false;
  // Only while connecting: an idle lane holds no descriptor (issue 20).
  waker_ = std::make_unique<Waker>();
  const int abort_fd = waker_->fd();
  lk.unlock();

  std::unique_ptr<Channel> chan;
  std::string err;
  int fail_status = FERRY_ERR_TRANSPORT;
  if (abort_fd < 0)
    err = std::string("cannot make an eventfd to connect with: ") + std::strerror(errno);
  else
    fail_status = Open(abort_fd, &chan, &err);
  const int fd = chan ? chan->fd() : -1;
  int rc = fail_status == FERRY_OK ? 0 : ECONNABORTED;
  lk.lock();
  waker_.reset();
  if (rc == 0 && !abort_connect_ && !stopping_) {
    try {
      receiver_done_ = false;
      fd_ = fd;
      chan_ = std::move(chan);
      state_ = State::kUp;
      StartReceiverLocked(chan_.get());
      StartPooledSenderLocked();
      return true;
    } catch (const std::exception& e) {
      rc = EAGAIN;
      err = std::string("cannot start a receiver thread: ") + e.what();
      chan = std::move(chan_);
      fd_ = -1;
    }
  }
  chan.reset();
  if (fd >= 0) ::close(fd);
  state_ = State::kDown;
  // An abort already failed what was queued then; anything newer gets a fresh try.
  if (abort_connect_ || stopping_) return false;
  Doomed doomed;
  const int status = fail_status == FERRY_OK ? FERRY_ERR_TRANSPORT : fail_status;
  for (auto& f : queue_) doomed.emplace_back(f, status, err);
  queue_.clear();
  lk.unlock();
  Log(info_->host, FERRY_LOG_WARN, "lane %d to %s: %s", index_, info_->label.c_str(), err.c_str());
  Fail(doomed);
  lk.lock();
  return false;
}

void Lane::SpinForWorkLocked(std::unique_lock<std::mutex>& lk) {
  // Reset under mu_: a frame queued from now on sets it again (also under mu_).
  work_posted_.store(false, std::memory_order_relaxed);
  spinning_.store(true, std::memory_order_relaxed);
  lk.unlock();
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(info_->sender_spin_us);
  while (!work_posted_.load(std::memory_order_acquire) &&
         std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  lk.lock();
  spinning_.store(false, std::memory_order_relaxed);
  if (work_posted_.load(std::memory_order_relaxed) && info_->sender_polls_caught != nullptr)
    info_->sender_polls_caught->fetch_add(1, std::memory_order_relaxed);
}

void Lane::SenderMain() {
  std::unique_lock lk(mu_);
  const auto idle_for = std::chrono::milliseconds(info_->idle_close_ms);
  // Set by a send: the next wait polls first (sender_spin_us), once.
  bool spin_next = false;
  for (;;) {
    // The connection just made is served by the pool: this thread has done its part.
    if (Pooled()) {
      started_ = false;
      return;
    }
    auto ready = [&] {
      if (partial_) return true;
      if (state_ == State::kBroken) return receiver_done_;
      return stopping_ || !queue_.empty();
    };
    // Only between sends: it is the posting thread's next small frame, a round
    // trip later, that the poll catches without a wake-up. Stopping or breaking
    // the lane does not end a poll early: at most sender_spin_us later.
    if (spin_next && info_->sender_spin_us > 0 && state_ == State::kUp && !ready()) {
      spin_next = false;
      SpinForWorkLocked(lk);
      continue;
    }
    if (idle_for.count() > 0 && (state_ == State::kUp || state_ == State::kDown)) {
      // Close the connection once it has been idle long enough (responses
      // move last_used_ without waking us: we look again when it would have
      // expired), and end this thread once it is closed; a frame queued
      // meanwhile restarts it.
      auto wake_at = last_used_ + idle_for;
      // Busy (frames in flight, a long one maybe): look again an idle period
      // from now, never in a loop.
      if (!QuietLocked()) wake_at = std::max(wake_at, std::chrono::steady_clock::now() + idle_for);
      if (!cv_.wait_until(lk, wake_at, ready)) {
        if (QuietLocked() && state_ == State::kDown) {  // down, nothing to send: end
          started_ = false;
          return;
        }
        if (QuietLocked() && std::chrono::steady_clock::now() >= last_used_ + idle_for) {
          Doomed none;  // up and idle: nothing queued or in flight to fail
          BreakLocked(FERRY_ERR_TRANSPORT,
                      "closed after " + std::to_string(info_->idle_close_ms) + " ms idle", &none);
        }
        continue;
      }
    } else {
      cv_.wait(lk, ready);
    }

    if (partial_) {
      FramePtr f = std::move(partial_);
      lk.unlock();
      Doomed doomed;
      {
        std::lock_guard s(send_mu_);
        const int err = SendOne(*f, 0);
        std::lock_guard l2(mu_);
        AfterSendLocked(f, err, &doomed);
      }
      Fail(doomed);
      lk.lock();
      continue;
    }

    if (state_ == State::kBroken) {
      // Both users of the fd are done: the receiver exited, no send is running
      // once we hold send_mu_, and no direct send starts on a broken lane.
      lk.unlock();
      if (receiver_.joinable()) receiver_.join();
      Doomed doomed;
      {
        std::lock_guard s(send_mu_);
        std::lock_guard l2(mu_);
        CloseConnectionLocked(&doomed);
      }
      Fail(doomed);
      lk.lock();
      continue;
    }

    if (stopping_) break;

    if (state_ == State::kDown) {
      ConnectLocked(lk);
      continue;
    }

    // kUp with frames queued.
    lk.unlock();
    std::unique_lock s(send_mu_);
    lk.lock();
    if (state_ != State::kUp || queue_.empty() || partial_) continue;
    Doomed doomed;
    if (FramePtr f = TakeQueuedLocked(&doomed)) {
      lk.unlock();
      const int err = SendOne(*f, 0);
      lk.lock();
      AfterSendLocked(f, err, &doomed);
      spin_next = true;
    }
    lk.unlock();
    s.unlock();
    Fail(doomed);
    lk.lock();
  }
}

int Lane::ReceiveStaged(ByteReader& in, Frame& f, int* status, std::string* msg) {
  std::string why;
  StagePool::Lease stage = info_->stages->Acquire(f.xfer->local->device(), &why);
  int err = stage ? stage->Recv(*chan_, in, f.local.data(), f.local.size()) : kGpuError;
  if (err == kGpuError) {
    // The payload is still on the socket (or half of it): the lane cannot go on.
    *status = FERRY_ERR_GPU;
    *msg = "READ from " + info_->label + ": " + (stage ? stage->error() : why);
  } else if (err != 0) {
    *msg = Lost(err);
  }
  return err;
}

void Lane::StartReceiverLocked(Channel* chan) {
  const bool rings = chan->on_rings();
  if (info_->pool != nullptr && (!rings || chan->WaitSet(Channel::Side::kIn) >= 0)) {
    auto polled = std::make_shared<PolledResponses>(this, chan->Reader(), chan->fd(), info_->pool,
                                                    rings ? chan : nullptr);
    auto handler = std::make_unique<PooledResponses>(polled);
    polled->Bind(handler.get());
    std::unique_ptr<IoPool::Handler> back;
    std::string why;
    // A ring's first turn comes at once: it announces the sleep the target's
    // first response will ring for.
    if (rings) chan->Nudge(Channel::Side::kIn);
    if (info_->pool->Add(std::move(handler), EPOLLIN, &back, &why)) {
      polled_ = polled;
      pumped_ = std::move(polled);
      SyncProgressLocked();
      return;
    }
    // Dropping `back` must not end (and report) a receiver that never started.
    polled->Abandon();
    Log(info_->host, FERRY_LOG_WARN, "lane %d to %s: responses read by a thread of their own: %s",
        index_, info_->label.c_str(), why.c_str());
  }
  if (chan->on_rings() && info_->progress != nullptr) {
    // The receiver thread shares the ring with waiting threads (progress()).
    auto ring = std::make_shared<RingResponses>(this, chan->Reader(), chan->fd());
    receiver_ = ferry::named_thread("tcp-ring", [ring, chan] { ring->Run(chan); });
    pumped_ = std::move(ring);
    SyncProgressLocked();
    return;
  }
  receiver_ = ferry::named_thread("tcp-recv", [this, chan] { ReceiverMain(chan); });
}

void Lane::ReceiverMain(Channel* chan) {
  ResponseReader reader(this, chan->Reader(), chan->fd());
  // A ring's reads block until the frame is whole; a socket's stop when
  // nothing more has arrived (this thread then waits for more).
  while (reader.Pump() == ResponseReader::Pumped::kWait) {
    pollfd p{chan->fd(), POLLIN, 0};
    if (::poll(&p, 1, -1) < 0 && errno != EINTR) break;
  }
  reader.End();
}

void Lane::SyncProgressLocked() {
  if (info_->progress == nullptr) return;
  const bool want = pumped_ != nullptr && !inflight_.empty();
  if (want == in_progress_set_) return;
  if (want)
    info_->progress->Add(pumped_);
  else
    info_->progress->Remove(pumped_.get());
  in_progress_set_ = want;
}

FramePtr Lane::TakeInflight(uint64_t req_id) {
  std::lock_guard lk(mu_);
  last_used_ = std::chrono::steady_clock::now();
  auto it = inflight_.find(req_id);
  if (it == inflight_.end()) return nullptr;
  FramePtr f = std::move(it->second);
  inflight_.erase(it);
  SyncProgressLocked();
  return f;
}

void Lane::ReceiverEnded(int status, const std::string& msg, FramePtr current) {
  Doomed doomed;
  bool ours;
  {
    std::lock_guard lk(mu_);
    ours = state_ == State::kBroken;  // we broke it on purpose (reset, stop, timeout)
    BreakLocked(status, msg, &doomed);
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      // A frame still being sent is failed by its sender, which owns its memory.
      if (it->second->sending) {
        ++it;
        continue;
      }
      doomed.emplace_back(it->second, reason_status_, reason_msg_);
      it = inflight_.erase(it);
    }
    if (current) doomed.emplace_back(current, reason_status_, reason_msg_);
    // This connection's responses are over: out of progress()'s reach.
    if (in_progress_set_) info_->progress->Remove(pumped_.get());
    in_progress_set_ = false;
    polled_.reset();
    pumped_.reset();
  }
  if (!ours) {
    Log(info_->host, status == FERRY_ERR_TRANSPORT ? FERRY_LOG_WARN : FERRY_LOG_ERROR,
        "lane %d: %s", index_, msg.c_str());
  }
  Fail(doomed);
  // Last: once the sender sees this it may close the socket and the lane may go.
  std::lock_guard lk(mu_);
  receiver_done_ = true;
  cv_.notify_all();
  ArmSenderLocked();
}

bool Lane::StartPooledSenderLocked() {
  if (polled_ == nullptr) return false;
  const bool rings = chan_->on_rings();
  const int watched = rings ? chan_->WaitSet(Channel::Side::kOut) : fd_;
  const int dup_fd = watched < 0 ? -1 : ::fcntl(watched, F_DUPFD_CLOEXEC, 0);
  if (dup_fd < 0) {
    Log(info_->host, FERRY_LOG_WARN, "lane %d to %s: sends by a thread of their own: %s: %s",
        index_, info_->label.c_str(), watched < 0 ? "wait set" : "dup", std::strerror(errno));
    return false;
  }
  auto h = std::make_unique<PooledSender>(this, dup_fd, rings ? chan_.get() : nullptr);
  // Set before it is registered: its first turn may start at once (and waits for mu_).
  send_handler_ = h.get();
  send_armed_ = true;
  std::unique_ptr<IoPool::Handler> back;
  std::string why;
  // A writable socket's EPOLLOUT gives the first turn at once; rings are nudged.
  if (rings) chan_->Nudge(Channel::Side::kOut);
  if (info_->pool->Add(std::move(h), chan_->RoomEvents(), &back, &why)) {
    if (info_->reaper != nullptr && info_->idle_close_ms > 0) info_->reaper->Watch(this);
    return true;
  }
  send_handler_ = nullptr;
  send_armed_ = false;
  Log(info_->host, FERRY_LOG_WARN, "lane %d to %s: sends by a thread of their own: %s", index_,
      info_->label.c_str(), why.c_str());
  return false;  // `back` closes the duplicate
}

void Lane::ArmSenderLocked(IoPool::Kicks* kicks) {
  if (!Pooled() || send_armed_) return;
  send_armed_ = true;
  if (kicks != nullptr) {
    // Parked until this kick: the handler cannot finish (and go) before it.
    kicks->emplace_back(send_handler_, chan_->RoomEvents());
    return;
  }
  // EPOLLOUT fires at once on a socket with room (or one shut down), a ring's
  // wait set once the kick nudged it; a polling pool thread (sender_spin_us)
  // takes the kick without a system call.
  if (!info_->pool->Kick(send_handler_, chan_->RoomEvents())) send_armed_ = false;
}

uint32_t Lane::PoolSend(IoPool::Handler* h) {
  Doomed doomed;
  uint32_t next = 0;
  {
    std::unique_lock s(send_mu_);
    std::unique_lock lk(mu_);
    const bool rings = send_handler_ == h && chan_ != nullptr && chan_->on_rings();
    const uint32_t wait = rings ? chan_->RoomEvents() : uint32_t{EPOLLOUT};
    // The socket fired (rings): room that does not come means the lane is over.
    const bool gone = rings && chan_->Woken(Channel::Side::kOut);
    int budget = kFramesPerTurn;
    for (;;) {
      if (send_handler_ != h) break;  // not ours any more (cannot happen): end
      if (state_ != State::kUp) {
        // Over. The responses' side is done too, or it arms us once it is.
        if (!receiver_done_) {
          send_armed_ = false;
          next = IoPool::kParked;
          break;
        }
        RetireLocked(&doomed);
        break;
      }
      FramePtr f;
      if (partial_) {
        f = std::move(partial_);
      } else if (queue_.empty()) {
        send_armed_ = false;
        next = IoPool::kParked;
        break;
      } else if (budget-- == 0) {
        // Another handler's turn; a writable socket (a nudged wait set) brings us back.
        if (rings) chan_->Nudge(Channel::Side::kOut);
        next = wait;
        break;
      } else if (!(f = TakeQueuedLocked(&doomed))) {
        continue;
      }
      lk.unlock();
      // A GPU frame's staging ignores MSG_DONTWAIT: it holds this pool thread
      // until its copies are through, as a staged READ's receive does.
      const int err = SendOne(*f, MSG_DONTWAIT);
      lk.lock();
      if ((err == EAGAIN || err == EWOULDBLOCK) && rings && gone) {
        AfterSendLocked(f, EPIPE, &doomed);  // breaks the lane
        continue;
      }
      if (err == EAGAIN || err == EWOULDBLOCK) {
        partial_ = std::move(f);
        // Still armed: the socket's room gives the next turn - on rings once
        // the sleep is announced (unless the room came meanwhile: go on).
        if (rings && !chan_->SleepOut()) continue;
        next = wait;
        break;
      }
      AfterSendLocked(f, err, &doomed);
    }
  }
  // No lock held: a completion may post again (and arm us on another thread;
  // nothing of this handler or lane is touched after this).
  Fail(doomed);
  return next;
}

void Lane::CloseConnectionLocked(Doomed* doomed) {
  chan_.reset();
  ::close(fd_);
  fd_ = -1;
  partial_.reset();  // in flight too: failed below
  for (auto& [id, f] : inflight_) doomed->emplace_back(f, reason_status_, reason_msg_);
  inflight_.clear();
  SyncProgressLocked();
  state_ = State::kDown;
  receiver_done_ = false;
}

void Lane::RetireLocked(Doomed* doomed) {
  // Both pool handlers are done with the socket (the responses' is gone, this
  // turn holds send_mu_).
  CloseConnectionLocked(doomed);
  send_handler_ = nullptr;
  send_armed_ = false;
  cv_.notify_all();
  if (queue_.empty() || stopping_) return;
  // Frames queued for the next connection (posted after a reset began).
  try {
    StartLocked();
  } catch (const std::exception& e) {
    for (auto& f : queue_)
      doomed->emplace_back(f, FERRY_ERR_TRANSPORT,
                           "cannot connect to " + info_->label + " again: " + e.what());
    queue_.clear();
  }
}

FramePtr Lane::TakeQueuedLocked(Doomed* doomed) {
  FramePtr f;
  if (queue_.front()->run && !queue_.front()->xfer->failed()) {
    // A run's next frame, built now; the entry stays first while it stands for more.
    Frame& entry = *queue_.front();
    try {
      f = entry.run->Build(entry.run_next);
    } catch (const std::exception& e) {
      // Nothing of the frame went out: fail what the entry stands for.
      FramePtr gone = std::move(queue_.front());
      queue_.pop_front();
      doomed->emplace_back(
          std::move(gone), FERRY_ERR_NO_MEMORY,
          std::string("cannot build a frame to ") + info_->label + ": " + e.what());
      return nullptr;
    }
    entry.run_next += entry.run_stride;
    if (--entry.count == 0) queue_.pop_front();
  } else {
    f = std::move(queue_.front());
    queue_.pop_front();
  }
  if (f->xfer->failed()) {
    // Another frame of it already failed: don't spend the bandwidth (a run's
    // entry: on any of the frames it still stands for).
    int status;
    std::string msg;
    f->xfer->Error(&status, &msg);
    doomed->emplace_back(std::move(f), status, msg);
    return nullptr;
  }
  MaybeDirectLocked(*f);
  f->sending = true;
  inflight_.emplace(f->req_id, f);
  SyncProgressLocked();
  return f;
}

bool Lane::CloseIfIdle(std::chrono::steady_clock::time_point now) {
  std::unique_lock lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return true;  // busy: look again next time
  if (!Pooled()) return false;       // retired (the next connection watches again)
  if (state_ != State::kUp || !QuietLocked()) return true;
  if (now < last_used_ + std::chrono::milliseconds(info_->idle_close_ms)) return true;
  Doomed none;  // quiet: nothing queued or in flight to fail
  BreakLocked(FERRY_ERR_TRANSPORT,
              "closed after " + std::to_string(info_->idle_close_ms) + " ms idle", &none);
  return true;
}

}  // namespace ferry_tcp
