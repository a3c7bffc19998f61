// SPDX-License-Identifier: Apache-2.0
// Transfers that post() accepted and left for another thread to hand to their
// lanes, so post() itself makes no system call (issue 20 item 2).
//
// Handing a transfer to its lanes is a send on the socket for a small frame
// (on loopback the kernel runs the receiver's side inside it: 7-19 us) or a
// wake-up of an I/O thread (an epoll_ctl re-arm); either made post() cost
// 7-26 us at p99 on the 16-core GPU host. Here post() only queues, and the
// hand-over happens on
// - a thread waiting for or polling a transfer of this engine: the core calls
//   the plugin's progress() there first (status.cpp), which Flush()es. A
//   caller that posts and waits pays the same as before, on the same thread,
//   only after post() has returned;
// - otherwise the flusher thread, within flush_after of the post (a caller
//   that posts and looks much later, or never: the notification at the
//   target still comes). It ticks every flush_after / 2 while transfers are
//   being posted and for `linger` after the last, then sleeps until the next
//   Push, which wakes it (the only Push that makes a system call).
// Jobs are delivered in push order, by one thread at a time; a Flush takes
// at most what was queued when it began. A queue of 4,096 makes the posting
// thread hand over what is queued itself (in order), as without the queue.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace ferry_tcp {

class PostQueue {
 public:
  // One accepted transfer's hand-over to its lanes; runs exactly once.
  class Job {
   public:
    virtual ~Job() = default;
    virtual void Deliver() noexcept = 0;
  };
  using JobPtr = std::unique_ptr<Job>;

  PostQueue(std::chrono::microseconds flush_after, std::chrono::milliseconds linger);
  ~PostQueue();  // Stop()
  PostQueue(const PostQueue&) = delete;
  PostQueue& operator=(const PostQueue&) = delete;

  bool Start(std::string* err);
  // Joins the flusher, then delivers what is still queued on this thread.
  // Later pushes are delivered at once by the pushing thread.
  void Stop();
  // Returns once every job pushed before the call has been delivered (and
  // let go of what it held): by this thread, or another one already at it.
  // peer_remove: a removed peer's transfers complete before it returns.
  void Barrier();

  // Queues a job. Before Start, after Stop, or out of memory, it is
  // delivered at once on the calling thread instead.
  void Push(JobPtr job) noexcept;
  // Delivers everything queued, in order; returns how many. 0 at once when
  // nothing is queued or another thread (or this one, re-entered from a
  // Deliver) is delivering: that one takes what is queued.
  size_t Flush();

  uint64_t by_waiters() const { return by_waiters_.load(std::memory_order_relaxed); }
  uint64_t by_flusher() const { return by_flusher_.load(std::memory_order_relaxed); }
  // Pushes that had to wake the flusher (it slept for good).
  uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }
  // The flusher sleeps until the next push (counters: post_flusher_asleep).
  bool asleep() const { return asleep_.load(std::memory_order_acquire); }

 private:
  struct Entry {
    JobPtr job;
    uint64_t gen;  // pushes_ when it was queued
  };
  void Main();
  size_t Drain(std::atomic<uint64_t>* count);

  const std::chrono::microseconds tick_;
  const uint64_t linger_ticks_;
  std::atomic<size_t> queued_{0};  // q_.size(), read without mu_
  std::atomic<bool> delivering_{false};
  std::atomic<bool> asleep_{false};
  std::atomic<uint64_t> by_waiters_{0}, by_flusher_{0}, wakeups_{0};
  std::atomic<uint64_t> done_{0};  // jobs delivered and destroyed
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> q_;
  uint64_t pushes_ = 0;
  bool started_ = false;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ferry_tcp
