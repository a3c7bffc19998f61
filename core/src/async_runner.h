// SPDX-License-Identifier: Apache-2.0
// Runs a job on a thread of its own, for work that may block until a deadline
// (a control-plane connect and HELLO, a notification message's exchange) and
// must not block the thread that found it (a plugin's completion thread, or
// the application's in post()). A job never waits behind another: when no
// thread is idle, run() starts one. A thread whose job has returned stays for
// `linger` waiting for the next one and then ends, so a steady stream of jobs
// - a message after every KV-cache transfer - reuses a few threads: starting a
// thread per job took 43-51 us of each such transfer's completion on the GPU
// host (docs/benchmarks.md), a wake-up of an idle one a few. An idle engine
// keeps no extra thread past `linger`. The destructor runs what is queued and
// waits for every job.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>

namespace ferry {

class AsyncRunner {
 public:
  explicit AsyncRunner(std::chrono::milliseconds linger = std::chrono::seconds(2))
      : linger_(linger) {}
  AsyncRunner(const AsyncRunner&) = delete;
  AsyncRunner& operator=(const AsyncRunner&) = delete;
  ~AsyncRunner();
  // Throws std::system_error when a thread is needed and cannot be started
  // (the job is then not queued).
  void run(std::function<void()> fn);
  // Threads alive now, busy or idle, and of them idle (tests).
  size_t threads();
  size_t idle();

 private:
  struct Worker {
    std::thread thread;
    bool ended = false;  // its loop returned: join it (guarded by mu_)
  };
  void loop(Worker* self);
  void join_ended_locked(std::unique_lock<std::mutex>& lk);

  const std::chrono::milliseconds linger_;
  std::mutex mu_;
  std::condition_variable work_;  // a job was queued, or stop
  std::deque<std::function<void()>> queue_;
  std::list<Worker> workers_;
  size_t idle_ = 0;  // workers waiting in loop() for a job
  bool stop_ = false;
};

}  // namespace ferry
