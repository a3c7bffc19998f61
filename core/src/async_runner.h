// SPDX-License-Identifier: Apache-2.0
// Runs a job on a thread of its own, for work that may block until a deadline
// (a control-plane connect and HELLO) and must not block the thread that found
// it (a plugin's completion thread, or the application's in post()). Threads
// that have finished are joined on the next run(); the destructor waits for all.
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry {

class AsyncRunner {
 public:
  AsyncRunner() = default;
  AsyncRunner(const AsyncRunner&) = delete;
  AsyncRunner& operator=(const AsyncRunner&) = delete;
  ~AsyncRunner() {
    std::vector<Job> jobs;
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs.swap(jobs_);
    }
    for (auto& j : jobs) j.thread.join();
  }
  void run(std::function<void()> fn) {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = jobs_.begin(); it != jobs_.end();) {
      if (it->done->load()) {
        it->thread.join();  // it has returned: at once
        it = jobs_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    jobs_.push_back({std::thread([fn = std::move(fn), done] {
                       fn();
                       done->store(true);
                     }),
                     done});
  }

 private:
  struct Job {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex mu_;
  std::vector<Job> jobs_;
};

}  // namespace ferry
