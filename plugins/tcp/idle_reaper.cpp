// SPDX-License-Identifier: Apache-2.0
#include "idle_reaper.h"

#include <algorithm>

#include "thread_name.h"

namespace ferry_tcp {

IdleReaper::IdleReaper(std::chrono::milliseconds idle)
    : idle_(idle),
      // A lane closes at most a quarter of its idle time late.
      period_(std::clamp(idle / 4, std::chrono::milliseconds(1), std::chrono::milliseconds(1000))) {
}

IdleReaper::~IdleReaper() { Stop(); }

bool IdleReaper::Start(std::string* err) {
  if (idle_.count() <= 0) return true;
  try {
    thread_ = ferry::named_thread("tcp-reaper", [this] { Main(); });
  } catch (const std::exception& e) {
    *err = std::string("cannot start the idle-lane thread: ") + e.what();
    return false;
  }
  return true;
}

void IdleReaper::Stop() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void IdleReaper::Watch(Target* t) {
  if (idle_.count() <= 0) return;
  bool first;
  {
    std::lock_guard lk(mu_);
    first = targets_.empty();
    targets_.insert(t);
  }
  if (first) cv_.notify_all();
}

void IdleReaper::Unwatch(Target* t) {
  std::lock_guard lk(mu_);  // waits out a look at t in progress
  targets_.erase(t);
}

void IdleReaper::Main() {
  std::unique_lock lk(mu_);
  while (!stop_) {
    if (targets_.empty()) {
      cv_.wait(lk, [&] { return stop_ || !targets_.empty(); });
      continue;
    }
    if (cv_.wait_for(lk, period_, [&] { return stop_; })) break;
    const auto now = std::chrono::steady_clock::now();
    for (auto it = targets_.begin(); it != targets_.end();) {
      if ((*it)->CloseIfIdle(now))
        ++it;
      else
        it = targets_.erase(it);
    }
  }
}

}  // namespace ferry_tcp
