// SPDX-License-Identifier: Apache-2.0
#include "deadline.h"

#include <chrono>
#include <vector>

#include "hot_path.h"
#include "thread_name.h"
#include "xfer.h"

namespace ferry_tcp {
namespace {
// How long the thread keeps a self-set wake-up after the last deadline went.
constexpr uint64_t kIdleLingerNs = 1000000000;
}  // namespace

DeadlineWatcher::DeadlineWatcher(const ferry_host_v1* host, Expire on_expire)
    : host_(host), on_expire_(std::move(on_expire)) {}

DeadlineWatcher::~DeadlineWatcher() { Stop(); }

void DeadlineWatcher::Start() {
  thread_ = ferry::named_thread("tcp-deadline", [this] { Main(); });
}

void DeadlineWatcher::Stop() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

FERRY_HOT void DeadlineWatcher::Add(const std::shared_ptr<Xfer>& x) {
  if (x->deadline_ns == 0) return;
  bool earliest;
  {
    std::lock_guard lk(mu_);
    x->deadline_token = next_token_++;
    auto it = by_deadline_.emplace(std::make_pair(x->deadline_ns, x->deadline_token), x).first;
    earliest = it == by_deadline_.begin() && x->deadline_ns < wake_at_ns_;
  }
  if (earliest) cv_.notify_all();
}

FERRY_HOT void DeadlineWatcher::Remove(const Xfer& x) {
  if (x.deadline_ns == 0) return;
  std::lock_guard lk(mu_);
  by_deadline_.erase({x.deadline_ns, x.deadline_token});
}

void DeadlineWatcher::Main() {
  std::unique_lock lk(mu_);
  bool lingered = false;
  while (!stop_) {
    const uint64_t now = host_->now_ns(host_->host_ctx);
    if (by_deadline_.empty()) {
      if (!lingered) {
        lingered = true;
        wake_at_ns_ = now + kIdleLingerNs;
        cv_.wait_for(lk, std::chrono::nanoseconds(kIdleLingerNs));
      } else {
        wake_at_ns_ = UINT64_MAX;  // idle: no wake-ups at all
        cv_.wait(lk);
      }
      continue;
    }
    lingered = false;
    const uint64_t first = by_deadline_.begin()->first.first;
    if (first > now) {
      wake_at_ns_ = first;
      cv_.wait_for(lk, std::chrono::nanoseconds(first - now));
      continue;
    }
    std::vector<std::shared_ptr<Xfer>> expired;
    while (!by_deadline_.empty() && by_deadline_.begin()->first.first <= now) {
      if (auto x = by_deadline_.begin()->second.lock()) expired.push_back(std::move(x));
      by_deadline_.erase(by_deadline_.begin());
    }
    // on_expire resets lanes, whose threads complete transfers and call Remove.
    lk.unlock();
    for (const auto& x : expired) on_expire_(x);
    expired.clear();
    lk.lock();
  }
}

}  // namespace ferry_tcp
