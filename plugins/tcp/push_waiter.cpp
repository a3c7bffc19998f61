// SPDX-License-Identifier: Apache-2.0
#include "push_waiter.h"

#include <system_error>

#include "direct_copy.h"
#include "log.h"

namespace ferry_tcp {
namespace {

// The push under way has ended, or never will (its target is gone).
bool Quiet(const direct::Link& link) {
  return !link.gate().PushUnderWay() || link.target().Exited();
}

}  // namespace

void PushWaiter::Resolve(FramePtr f, int status, std::string msg) {
  if (status == FERRY_OK || Quiet(*f->push_link)) {
    f->Resolve(status, msg);
    return;
  }
  {
    std::lock_guard lk(mu_);
    if (!stopping_) {
      try {
        held_.reserve(held_.size() + 1);  // the push_back below cannot throw
        if (!thread_.joinable()) thread_ = std::thread([this] { Main(); });
        held_.push_back({std::move(f), status, std::move(msg)});
        ++held_total_;
      } catch (const std::exception&) {
        // No thread: fall through and wait here, which is what holding means.
      }
    }
  }
  if (f) {
    while (!Quiet(*f->push_link)) f->push_link->target().WaitExit(1);
    f->Resolve(status, msg);
    return;
  }
  Log(host_, FERRY_LOG_WARN,
      "a failed READ waits for its target to finish copying into this process's memory");
  cv_.notify_all();
}

void PushWaiter::Main() {
  std::unique_lock lk(mu_);
  for (;;) {
    if (held_.empty()) {
      if (stopping_) return;
      cv_.wait(lk);
      continue;
    }
    const bool give_up = stopping_ && std::chrono::steady_clock::now() >= give_up_;
    std::vector<Held> ready;
    for (auto it = held_.begin(); it != held_.end();) {
      if (give_up || Quiet(*it->frame->push_link)) {
        ready.push_back(std::move(*it));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    const std::shared_ptr<direct::Link> next =
        held_.empty() ? nullptr : held_.front().frame->push_link;
    lk.unlock();
    if (give_up && !ready.empty()) {
      Log(host_, FERRY_LOG_ERROR,
          "stopping: %zu failed READs completed while their target may still copy into them",
          ready.size());
    }
    for (Held& h : ready) h.frame->Resolve(h.status, h.msg);
    ready.clear();
    // Until the next look: at most 1 ms, less once that target exits.
    if (next) next->target().WaitExit(1);
    lk.lock();
  }
}

void PushWaiter::Stop(std::chrono::milliseconds grace) {
  {
    std::lock_guard lk(mu_);
    if (!stopping_) {
      stopping_ = true;
      give_up_ = std::chrono::steady_clock::now() + grace;
    }
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t PushWaiter::held() const {
  std::lock_guard lk(mu_);
  return held_total_;
}

}  // namespace ferry_tcp
