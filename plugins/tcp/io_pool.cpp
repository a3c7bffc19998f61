// SPDX-License-Identifier: Apache-2.0
#include "io_pool.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "thread_name.h"

namespace ferry_tcp {
namespace {

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

IoPool::Handler::~Handler() = default;

void IoPool::Handler::SetStall(std::chrono::milliseconds timeout) {
  const int64_t at = NowNs() + std::chrono::nanoseconds(timeout).count();
  if (stall_at_ns_.exchange(at) == 0 && pool_ != nullptr) pool_->stalling_.fetch_add(1);
}

void IoPool::Handler::ClearStall() {
  if (stall_at_ns_.exchange(0) != 0 && pool_ != nullptr) pool_->stalling_.fetch_sub(1);
}

IoPool::IoPool(int threads, std::chrono::milliseconds sweep, std::chrono::microseconds spin,
               bool poll_every_turn)
    : want_threads_(std::max(1, threads)),
      sweep_(std::max(sweep, std::chrono::milliseconds(1))),
      spin_(std::max(spin, std::chrono::microseconds(0))),
      poll_every_turn_(poll_every_turn) {}

IoPool::~IoPool() {
  Stop();
  if (epfd_ >= 0) ::close(epfd_);
}

int IoPool::DefaultThreads() {
  const unsigned cores = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(cores / 2, 1u, 8u));
}

bool IoPool::Start(std::string* err) {
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0 || !stop_.ok()) {
    *err = std::string("epoll: ") + std::strerror(errno);
    return false;
  }
  // Level-triggered and never re-armed: once Stop signals it, every thread sees it.
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, stop_.fd(), &ev) != 0) {
    *err = std::string("epoll_ctl: ") + std::strerror(errno);
    return false;
  }
  try {
    for (int i = 0; i < want_threads_; ++i)
      threads_.push_back(ferry::named_thread("tcp-io", [this] { Main(); }));
  } catch (const std::exception& e) {
    *err = std::string("cannot start I/O threads: ") + e.what();
    Stop();
    return false;
  }
  return true;
}

bool IoPool::Add(std::unique_ptr<Handler> h, uint32_t events, std::unique_ptr<Handler>* back,
                 std::string* err) {
  Handler* raw = h.get();
  raw->pool_ = this;
  std::unique_lock lk(mu_);
  if (stopping_.load()) {
    *err = "the I/O pool is stopping";
    *back = std::move(h);
    return false;
  }
  handlers_.emplace(raw, std::move(h));
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.ptr = raw;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, raw->fd(), &ev) != 0) {
    *err = std::string("epoll_ctl: ") + std::strerror(errno);
    auto it = handlers_.find(raw);
    *back = std::move(it->second);
    handlers_.erase(it);
    raw->pool_ = nullptr;
    return false;
  }
  return true;
}

bool IoPool::Rearm(Handler* h, uint32_t events, bool nudge) {
  // Only while it is registered: a handler the pool finished meanwhile is gone.
  std::shared_lock lk(mu_);
  if (handlers_.count(h) == 0) return false;
  if (nudge) h->Nudge();  // still registered, so not deleted under us
  epoll_event ev{};
  ev.events = events | EPOLLONESHOT;
  ev.data.ptr = h;
  h->turns_.fetch_add(1, std::memory_order_release);
  return epoll_ctl(epfd_, EPOLL_CTL_MOD, h->fd(), &ev) == 0;
}

void IoPool::ForPollerLocked(Handler* h, uint32_t events) {
  h->turns_.fetch_add(1, std::memory_order_release);
  kicked_.emplace_back(h, events);
  kicks_waiting_.store(true, std::memory_order_release);
}

bool IoPool::Kick(Handler* h, uint32_t events) {
  {
    std::lock_guard k(kick_mu_);
    if (taking_kicks_) {
      ForPollerLocked(h, events);
      return true;  // the poller checks that it is still registered
    }
  }
  return Rearm(h, events, /*nudge=*/true);
}

void IoPool::KickAll(Kicks& kicks) {
  if (kicks.empty()) return;
  Kicks mine;
  mine.swap(kicks);
  bool deferred = false;
  try {
    std::lock_guard k(kick_mu_);
    if (taking_kicks_) {
      // The poller runs the first and re-arms the rest (Poll).
      kicked_.reserve(kicked_.size() + mine.size());  // throws before any is queued
      for (auto& [h, events] : mine) ForPollerLocked(h, events);
      return;
    }
    deferred_.insert(deferred_.end(), mine.begin() + 1, mine.end());
    if (mine.size() > 1) deferred_waiting_.store(true, std::memory_order_release);
    deferred = true;
  } catch (...) {
    // Out of memory: every kick made here (a kick must not get lost).
  }
  if (!deferred) {
    for (auto& [h, events] : mine) Rearm(h, events, /*nudge=*/true);
    return;
  }
  // No wake-up came of it (no longer registered): nobody is coming for the
  // rest either, so they are re-armed here.
  if (!Rearm(mine[0].first, mine[0].second, /*nudge=*/true)) RearmDeferred();
}

void IoPool::RearmDeferred() {
  if (!deferred_waiting_.load(std::memory_order_acquire)) return;
  Kicks work;
  {
    std::lock_guard k(kick_mu_);
    work.swap(deferred_);
    deferred_waiting_.store(false, std::memory_order_relaxed);
  }
  for (auto& [h, events] : work) Rearm(h, events, /*nudge=*/true);
}

size_t IoPool::handlers() const {
  std::shared_lock lk(mu_);
  return handlers_.size();
}

void IoPool::Stop() {
  if (stopping_.exchange(true)) {
    // A second call (the destructor after an explicit Stop) has nothing left to do.
    return;
  }
  stop_.Signal();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  std::unordered_map<Handler*, std::unique_ptr<Handler>> left;
  {
    std::unique_lock lk(mu_);
    {
      std::lock_guard w(watch_mu_);
      for (Handler* h : watched_) h->watched_ = false;
      watched_.clear();
      watching_.store(false, std::memory_order_relaxed);
    }
    left.swap(handlers_);
    for (auto& [raw, h] : left) {
      if (epfd_ >= 0) epoll_ctl(epfd_, EPOLL_CTL_DEL, raw->fd(), nullptr);
    }
  }
  left.clear();  // their destructors close their sockets, with no lock of ours held
}

void IoPool::Finish(Handler* h) {
  std::unique_ptr<Handler> owned;
  {
    std::unique_lock lk(mu_);
    epoll_ctl(epfd_, EPOLL_CTL_DEL, h->fd(), nullptr);
    auto it = handlers_.find(h);
    if (it == handlers_.end()) return;  // Stop took it
    // Out of the watch list before it is deleted: the poller looks at watched
    // handlers under watch_mu_ only.
    ForgetWatch(h);
    owned = std::move(it->second);
    handlers_.erase(it);
    if (h->stall_at_ns_.exchange(0) != 0) stalling_.fetch_sub(1);
  }
  owned.reset();
}

void IoPool::Sweep() {
  std::unique_lock s(sweep_mu_, std::try_to_lock);
  if (!s.owns_lock()) return;
  const int64_t now = NowNs();
  last_sweep_ns_.store(now);
  std::shared_lock lk(mu_);
  for (auto& [raw, h] : handlers_) {
    const int64_t at = raw->stall_at_ns_.load();
    if (at == 0 || now < at) continue;
    // Once: the shutdown ends the handler at its next event.
    if (raw->stall_at_ns_.exchange(0) != 0) stalling_.fetch_sub(1);
    raw->Expire();
  }
}

void IoPool::SweepIfDue() {
  // A busy pool may never time out: look for stalls by the clock too.
  if (stalling_.load() > 0 &&
      NowNs() - last_sweep_ns_.load() >= std::chrono::nanoseconds(sweep_).count())
    Sweep();
}

bool IoPool::Turn(Handler* h, uint32_t events) {
  // One thread at a time, whatever re-armed it. Looked at under the lock
  // Finish takes to delete it, so h is there to look at; once turning_ is ours
  // only this turn can finish it. Still in another thread's turn: wait for its
  // end (a parked handler re-armed before that turn returned: a few
  // instructions; a handler re-armed by a thread that took it for parked: the
  // whole turn). Dropping the event instead could lose the only wake-up.
  for (bool counted = false;; std::this_thread::yield()) {
    {
      std::shared_lock lk(mu_);
      if (handlers_.count(h) == 0) return false;  // finished by the turn it was in
      if (!h->turning_.exchange(true, std::memory_order_acq_rel)) break;
    }
    if (!counted) turn_waits_.fetch_add(1, std::memory_order_relaxed);
    counted = true;
  }
  return TurnOwned(h, events);
}

bool IoPool::TurnOwned(Handler* h, uint32_t events) {
  uint32_t next = 0;
  h->turns_.load(std::memory_order_acquire);  // after the re-arm or kick that gave us this turn
  // Timed only where a poller may read it (RingWhileBusy): no clock reads on
  // a pool that never polls.
  const bool timed = spin_.count() > 0;
  const auto began =
      timed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  try {
    next = h->OnEvents(events);
  } catch (...) {
    next = 0;  // a handler that cannot go on ends; its destructor cleans up
  }
  if (timed)
    h->last_turn_long_.store(std::chrono::steady_clock::now() - began > kLongTurn,
                             std::memory_order_relaxed);
  // After the turn, not before it: a hand-off's nudge that came as this turn
  // began was taken by it (a ring lane's Woken reads it); cleared before the
  // turn, the flag would keep the poller from looking at the lane again.
  h->handed_.store(false, std::memory_order_relaxed);
  if (next == kParked) {
    UpdateWatch(h);  // out of the list: whoever holds its work now gives its turns
    h->turning_.store(false, std::memory_order_release);  // whoever re-arms it may run it
    return false;
  }
  if (next != 0) {
    const bool watched = UpdateWatch(h);
    epoll_event again{};
    again.events = next | EPOLLONESHOT;
    again.data.ptr = h;
    // Read while the turn is ours: once turning_ is released, the turn the
    // re-arm allows may finish and delete h (TSan saw this read race the delete).
    const int fd = h->fd();
    h->turns_.fetch_add(1, std::memory_order_release);
    // Before the re-arm: the turn it allows must not find this one running.
    h->turning_.store(false, std::memory_order_release);
    if (epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &again) == 0) return watched;
    // Never armed again: ours to finish. Out of the watch list first, then the
    // turn taken back as any thread takes one - a poller may have taken it in
    // between (a watched handler), and its turn must end before Finish.
    ForgetWatch(h);
    while (h->turning_.exchange(true, std::memory_order_acq_rel)) std::this_thread::yield();
  }
  Finish(h);
  return false;
}

bool IoPool::UpdateWatch(Handler* h) {
  if (spin_.count() == 0) return false;  // nobody would look
  const bool want = h->WatchesData();
  {
    std::lock_guard w(watch_mu_);
    if (!want) {
      if (h->watched_) Unwatch(h);
      return false;
    }
    if (!h->watched_) {
      try {
        watched_.push_back(h);
      } catch (...) {
        return false;  // out of memory: it keeps the sleep it announced, and is rung
      }
      h->watched_ = true;
      h->watch_index_ = watched_.size() - 1;
      watching_.store(true, std::memory_order_release);
    }
    // Under watch_mu_, as SleepWatched runs: a poller that stops either
    // re-announces this sleep after this (the handler was in its list), or
    // stopped before (the handler was not; the thread that watched it polls
    // next). Outside the lock the withdrawal could follow the re-announcement
    // and leave a handler nobody watches and nobody rings: a hang.
    h->Unsleep();
  }
  return true;
}

void IoPool::ForgetWatch(Handler* h) {
  std::lock_guard w(watch_mu_);
  if (h->watched_) Unwatch(h);
}

void IoPool::Unwatch(Handler* h) {
  Handler* last = watched_.back();
  watched_[h->watch_index_] = last;
  last->watch_index_ = h->watch_index_;
  watched_.pop_back();
  h->watched_ = false;
  if (watched_.empty()) watching_.store(false, std::memory_order_relaxed);
}

bool IoPool::TurnWatchedReady() {
  if (!watching_.load(std::memory_order_acquire)) return false;
  Handler* mine = nullptr;
  bool handed = false;
  {
    // mu_ (shared) over the look and the taking of mine's turn: a handler is
    // deleted only under mu_ held exclusively, and once its turn is ours only
    // that turn can end it - so mine is the handler looked at, not a new one
    // at its address.
    std::shared_lock lk(mu_);
    std::lock_guard w(watch_mu_);
    for (Handler* h : watched_) {
      if (h->handed_.load(std::memory_order_relaxed) || !h->Peek()) continue;
      if (mine == nullptr) {
        // In another thread's turn: that turn reads what came.
        if (!h->turning_.exchange(true, std::memory_order_acq_rel)) mine = h;
        continue;
      }
      // The first is this thread's; the others go to the pool's threads (their
      // wait sets made readable: one wakes for each), so a transfer striped
      // over several lanes is still served by several threads at once (taken
      // one after another here, 1 MiB over four ring lanes ran 25 % slower).
      h->handed_.store(true, std::memory_order_relaxed);
      h->Nudge();
      handed = true;
    }
  }
  if (mine == nullptr) return handed;
  TakeKicks(false);  // as for an event: kicks during this turn go to other threads
  watch_turns_.fetch_add(1, std::memory_order_relaxed);
  RingWhileBusy(mine);
  TurnOwned(mine, EPOLLIN);
  return true;
}

void IoPool::RingWhileBusy(const Handler* except) {
  // Only before a turn like a long one: ringing the others before every
  // turn made each small frame on another lane ring its bell (4 KiB WRITE
  // 6.4-9.9 us -> 13 us on the 16-core host).
  if (!watching_.load(std::memory_order_acquire) ||
      !except->last_turn_long_.load(std::memory_order_relaxed))
    return;
  std::lock_guard w(watch_mu_);
  for (Handler* h : watched_) {
    if (h == except) continue;
    // Rung from now until its next turn (which withdraws the sleep again):
    // another pool thread serves it while this one is busy.
    if (!h->SleepWatched() && !h->handed_.exchange(true, std::memory_order_relaxed)) h->Nudge();
  }
}

void IoPool::SleepWatched() {
  std::lock_guard w(watch_mu_);
  for (Handler* h : watched_) {
    h->watched_ = false;
    // Still armed in epoll (or in a turn that re-arms it): the nudge's event
    // gives it the turn for the bytes that came meanwhile.
    if (!h->SleepWatched()) h->Nudge();
  }
  watched_.clear();
  watching_.store(false, std::memory_order_relaxed);
}

void IoPool::TakeKicks(bool on) {
  std::lock_guard k(kick_mu_);
  taking_kicks_ = on;
}

void IoPool::Poll() {
  {
    std::lock_guard k(kick_mu_);
    if (poller_) return;  // another thread polls
    poller_ = true;
    taking_kicks_ = true;
  }
  auto until = std::chrono::steady_clock::now() + spin_;
  std::vector<std::pair<Handler*, uint32_t>> work;
  while (!stopping_.load(std::memory_order_relaxed)) {
    work.clear();
    // The lock only when there is something to take or the spin is over: a
    // poller taking it every round would make post()'s kick wait for it (on
    // the futex, when they collide on two cores).
    if (kicks_waiting_.load(std::memory_order_acquire) ||
        std::chrono::steady_clock::now() >= until) {
      bool done = false;
      {
        std::lock_guard k(kick_mu_);
        work.swap(kicked_);
        kicks_waiting_.store(false, std::memory_order_relaxed);
        // Decided under the lock a kick takes: a kick after this re-arms instead.
        if (work.empty() && std::chrono::steady_clock::now() >= until) {
          poller_ = taking_kicks_ = false;
          done = true;
        } else if (!work.empty()) {
          taking_kicks_ = false;
        }
      }
      if (done) {
        // The other lanes of a transfer kicked during this thread's last
        // turns (KickAll leaves them to the thread that catches the first):
        // Main would look for them only at its next event, which may never
        // come - a hang.
        RearmDeferred();
        // After poller_ is cleared: a handler watched from now on is looked
        // at by the thread that watched it (Main polls after such a turn).
        SleepWatched();
        return;
      }
    }
    RearmDeferred();
    // The first kick is this thread's; the others go to the pool's threads
    // (a re-arm wakes one), so several lanes still send at once.
    for (size_t i = 0; i < work.size(); ++i) {
      auto [h, events] = work[i];
      if (i > 0) {
        Rearm(h, events, /*nudge=*/true);  // as Kick does when nobody polls
        continue;
      }
      {
        // Parked handlers end only by their own turn, or by Stop, which
        // joins this thread first: registered now means registered for the turn.
        std::shared_lock lk(mu_);
        if (handlers_.count(h) == 0) continue;
      }
      kicks_caught_.fetch_add(1, std::memory_order_relaxed);
      RingWhileBusy(h);
      Turn(h, events);
    }
    epoll_event ev{};
    const int n = epoll_wait(epfd_, &ev, 1, 0);
    if (n == 1) {
      if (ev.data.ptr == nullptr) break;  // Stop (level-triggered: Main sees it too)
      if (work.empty()) TakeKicks(false);
      RingWhileBusy(static_cast<Handler*>(ev.data.ptr));
      Turn(static_cast<Handler*>(ev.data.ptr), ev.events);
    }
    const bool looked = TurnWatchedReady();
    SweepIfDue();
    if (n == 1 || !work.empty() || looked) {
      TakeKicks(true);
      until = std::chrono::steady_clock::now() + spin_;
    } else {
      // Not a pause: on a core shared with the thread that has the work (the
      // target's pool, the application's waiter) a poller that only pauses
      // holds the core until its spin runs out (2 vCPUs: 8 B WRITE 250 us).
      std::this_thread::yield();
    }
  }
  std::lock_guard k(kick_mu_);
  poller_ = taking_kicks_ = false;  // stopping: what is still kicked is Stop's to delete
  kicked_.clear();
  deferred_.clear();
  deferred_waiting_.store(false, std::memory_order_relaxed);
  kicks_waiting_.store(false, std::memory_order_relaxed);
}

void IoPool::Main() {
  const int sweep_ms = static_cast<int>(sweep_.count());
  for (;;) {
    epoll_event ev{};
    const int n = epoll_wait(epfd_, &ev, 1, stalling_.load() > 0 ? sweep_ms : -1);
    if (stopping_.load()) return;
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // EBADF/EINVAL: nothing to serve with
    }
    SweepIfDue();
    if (n == 0) continue;
    if (ev.data.ptr == nullptr) return;  // Stop
    RearmDeferred();  // first: they may be other lanes of the transfer this turn sends
    const bool watched = Turn(static_cast<Handler*>(ev.data.ptr), ev.events);
    if (spin_.count() > 0 && (poll_every_turn_ || watched)) Poll();
  }
}

}  // namespace ferry_tcp
