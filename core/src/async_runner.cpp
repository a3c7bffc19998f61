// SPDX-License-Identifier: Apache-2.0
#include "async_runner.h"

#include <utility>
#include <vector>

#include "thread_name.h"

namespace ferry {

AsyncRunner::~AsyncRunner() {
  std::unique_lock<std::mutex> lk(mu_);
  stop_ = true;
  work_.notify_all();
  // Every queued job has a worker (run() saw to it); each leaves once the
  // queue is empty. A job may start another meanwhile: joined in a later round.
  while (!workers_.empty()) {
    std::list<Worker> all;
    all.swap(workers_);
    lk.unlock();
    for (Worker& w : all) w.thread.join();
    lk.lock();
  }
}

void AsyncRunner::run(std::function<void()> fn) {
  std::unique_lock<std::mutex> lk(mu_);
  join_ended_locked(lk);
  // An idle worker for every queued job, this one included, or a new worker.
  if (idle_ > queue_.size()) {
    queue_.push_back(std::move(fn));
    work_.notify_one();
    return;
  }
  workers_.emplace_back();
  Worker* w = &workers_.back();
  try {
    w->thread = ferry::named_thread("ferry-runner", [this, w] { loop(w); });
  } catch (...) {
    workers_.pop_back();
    throw;
  }
  queue_.push_back(std::move(fn));
}

size_t AsyncRunner::threads() {
  std::unique_lock<std::mutex> lk(mu_);
  join_ended_locked(lk);
  return workers_.size();
}

size_t AsyncRunner::idle() {
  std::lock_guard<std::mutex> lk(mu_);
  return idle_;
}

void AsyncRunner::join_ended_locked(std::unique_lock<std::mutex>& lk) {
  std::vector<std::thread> ended;
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->ended) {
      ended.push_back(std::move(it->thread));
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  if (ended.empty()) return;
  lk.unlock();  // they have returned from loop(): each join is immediate
  for (std::thread& t : ended) t.join();
  lk.lock();
}

void AsyncRunner::loop(Worker* self) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (queue_.empty()) {
      if (stop_) break;
      ++idle_;
      const bool got = work_.wait_for(lk, linger_, [&] { return stop_ || !queue_.empty(); });
      --idle_;
      if (!got) break;  // lingered long enough: this thread ends
      continue;
    }
    std::function<void()> job = std::move(queue_.front());
    queue_.pop_front();
    lk.unlock();
    job();
    job = nullptr;  // what it captured goes before the next wait
    lk.lock();
  }
  // Under mu_: run() sees either an idle worker (counted above) or an ended one.
  if (!stop_) self->ended = true;
}

}  // namespace ferry
