// SPDX-License-Identifier: Apache-2.0
// Closes idle lanes that have no thread of their own to time it (issue 20):
// a TCP lane served by the I/O pool is registered here while its connection
// is up, and one thread looks at the registered lanes a few times per
// `lane_idle_ms`, closing those with nothing queued or in flight for that
// long. With no lane registered the thread sleeps without a timeout, so an
// idle engine costs no CPU.
//
// Locks: the reaper's lock is taken before a lane's, but only with try_lock
// (a busy lane is looked at next time), so a lane may call Watch while
// holding its own lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>

namespace ferry_tcp {

class IdleReaper {
 public:
  // What the reaper asks of a lane.
  class Target {
   public:
    virtual ~Target() = default;
    // Closes the lane if it has been idle long enough. Returns whether the
    // reaper should keep looking at it (false: its connection is gone; it
    // calls Watch again with the next one). Must not block on the lane's lock.
    virtual bool CloseIfIdle(std::chrono::steady_clock::time_point now) = 0;
  };

  // idle: lane_idle_ms (0: the reaper never runs).
  explicit IdleReaper(std::chrono::milliseconds idle);
  ~IdleReaper();
  IdleReaper(const IdleReaper&) = delete;
  IdleReaper& operator=(const IdleReaper&) = delete;

  bool Start(std::string* err);
  void Stop();
  // Looks at t from now on (again); idempotent.
  void Watch(Target* t);
  // After it returns the reaper never touches t. Not under t's own lock.
  void Unwatch(Target* t);

 private:
  void Main();

  const std::chrono::milliseconds idle_;
  const std::chrono::milliseconds period_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::unordered_set<Target*> targets_;
  std::thread thread_;
};

}  // namespace ferry_tcp
