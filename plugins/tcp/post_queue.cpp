// SPDX-License-Identifier: Apache-2.0
#include "post_queue.h"

#include <sys/prctl.h>

#include <algorithm>
#include <new>
#include <system_error>
#include <utility>

#include "hot_path.h"
#include "thread_name.h"

namespace ferry_tcp {
namespace {
// A queue this long hands over on the posting thread (Push).
constexpr size_t kMaxQueued = 4096;
// The queue this thread is delivering from, if any: a Barrier from inside a
// delivery (a completion callback that removes a peer) cannot wait for itself.
thread_local const PostQueue* tls_delivering = nullptr;
}  // namespace

PostQueue::PostQueue(std::chrono::microseconds flush_after, std::chrono::milliseconds linger)
    : tick_(std::max<std::chrono::microseconds>(flush_after / 2, std::chrono::microseconds(1))),
      linger_ticks_(static_cast<uint64_t>(std::max<int64_t>(
          1, std::chrono::duration_cast<std::chrono::microseconds>(linger).count() /
                 std::max<int64_t>(1, tick_.count())))) {}

PostQueue::~PostQueue() { Stop(); }

bool PostQueue::Start(std::string* err) {
  std::lock_guard lk(mu_);
  try {
    thread_ = ferry::named_thread("tcp-postq", [this] { Main(); });
  } catch (const std::system_error& e) {
    *err = std::string("post flusher thread: ") + e.what();
    return false;
  }
  started_ = true;
  return true;
}

void PostQueue::Stop() {
  {
    std::lock_guard lk(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // A waiter may be delivering still (fini while a thread waits is the
  // core's bug, but nothing queued may be lost).
  Barrier();
}

void PostQueue::Barrier() {
  if (tls_delivering == this) return;  // the rest follows once this delivery returns
  uint64_t target;
  {
    std::lock_guard lk(mu_);
    target = pushes_;
  }
  // Takes turns with a thread delivering now: each of its deliveries is
  // short (it never blocks), and it takes no more than was queued when it began.
  while (done_.load(std::memory_order_acquire) < target) {
    if (Drain(&by_flusher_) == 0) std::this_thread::yield();
  }
}

FERRY_HOT void PostQueue::Push(JobPtr job) noexcept {
  bool wake = false;
  bool full = false;
  {
    std::unique_lock lk(mu_);
    if (started_ && !stop_) {
      try {
        q_.emplace_back();
        q_.back().job = std::move(job);
        q_.back().gen = ++pushes_;
        queued_.store(q_.size(), std::memory_order_release);
        wake = asleep_.load(std::memory_order_relaxed);
        if (wake) asleep_.store(false, std::memory_order_relaxed);
        full = q_.size() >= kMaxQueued;
      } catch (const std::bad_alloc&) {
        // No room to queue it: handed over below, as without the queue.
      }
    }
  }
  if (job) {  // not running, or out of memory: the caller's thread hands it over
    job->Deliver();
    return;
  }
  if (wake) {
    wakeups_.fetch_add(1, std::memory_order_relaxed);
    cv_.notify_one();
  }
  // Posted faster than handed over: the poster hands over what is queued
  // (in order), as it did without the queue, rather than the queue growing.
  if (full) Drain(&by_waiters_);
}

size_t PostQueue::Flush() {
  if (queued_.load(std::memory_order_acquire) == 0) return 0;
  return Drain(&by_waiters_);
}

FERRY_HOT size_t PostQueue::Drain(std::atomic<uint64_t>* count) {
  if (delivering_.exchange(true, std::memory_order_acquire)) return 0;
  size_t n = 0;
  uint64_t limit = 0;
  for (;;) {
    JobPtr job;
    {
      std::lock_guard lk(mu_);
      // No more than was queued when it began: a waiter that hands over
      // other threads' posts is not kept by posts that keep coming.
      if (n == 0) limit = pushes_;
      if (q_.empty() || q_.front().gen > limit) break;
      job = std::move(q_.front().job);
      q_.pop_front();
      queued_.store(q_.size(), std::memory_order_release);
    }
    // Counted first: whoever sees the transfer complete sees the count.
    count->fetch_add(1, std::memory_order_relaxed);
    // Outside mu_: a delivery completes transfers, whose callbacks may post.
    tls_delivering = this;
    job->Deliver();
    job.reset();
    tls_delivering = nullptr;  // what it held (its peer) goes before Barrier() returns
    done_.fetch_add(1, std::memory_order_release);
    ++n;
  }
  delivering_.store(false, std::memory_order_release);
  return n;
}

void PostQueue::Main() {
  // Wake-ups on time: the kernel's default slack (50 us) is as long as a tick.
  ::prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(tick_.count()) * 100UL, 0, 0, 0);
  std::unique_lock lk(mu_);
  // Jobs up to this one were queued a tick ago or more (none yet: one pushed
  // before this thread ran is not old).
  uint64_t mark = 0;
  uint64_t quiet_ticks = 0;
  while (!stop_) {
    if (!q_.empty() && q_.front().gen <= mark) {
      // No waiter took it within a tick: hand it over here.
      lk.unlock();
      const size_t n = Drain(&by_flusher_);
      lk.lock();
      if (n > 0) continue;
      // A waiter is delivering: it takes the rest, or the next tick does.
    }
    if (pushes_ == mark && q_.empty()) {
      if (++quiet_ticks >= linger_ticks_) {
        // Nothing posted for `linger`: sleep until a Push wakes us.
        asleep_.store(true, std::memory_order_relaxed);
        cv_.wait(lk, [&] { return stop_ || !asleep_.load(std::memory_order_relaxed); });
        asleep_.store(false, std::memory_order_relaxed);
        quiet_ticks = 0;
      }
    } else {
      quiet_ticks = 0;
    }
    mark = pushes_;
    cv_.wait_for(lk, tick_);
  }
}

}  // namespace ferry_tcp
