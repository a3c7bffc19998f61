// SPDX-License-Identifier: Apache-2.0
#include "push_waiter.h"

#include "direct_copy.h"
#include "log.h"
#include "thread_name.h"

namespace ferry_tcp {
namespace {

// The push under way has ended, or never will (its target is gone).
bool Quiet(const direct::Link& link) {
  return !link.gate().PushUnderWay() || link.target().Exited();
}

// Between looks while READs are held: short enough for a READ to complete
// soon after its push ended, long enough that a target stopped for good costs
// next to nothing (its exit wakes us at once).
constexpr int kLookMs = 10;

}  // namespace

void PushWaiter::Resolve(FramePtr f, int status, std::string msg) {
  if (status == FERRY_OK || Quiet(*f->push_link)) {
    f->Resolve(status, msg);
    return;
  }
  bool stopping;
  {
    std::lock_guard lk(mu_);
    stopping = stopping_;
    if (!stopping) {
      try {
        held_.reserve(held_.size() + 1);  // the push_back below cannot throw
        if (!thread_.joinable()) thread_ = ferry::named_thread("tcp-push", [this] { Main(); });
        const auto peer = f->xfer->peer.lock();
        held_.push_back({std::move(f), status, std::move(msg), peer.get()});
        ++held_total_;
      } catch (const std::exception&) {
        // No memory or no thread: f is still ours (below).
      }
    }
  }
  if (f) {  // never waits here, whatever the target does
    Log(host_, FERRY_LOG_ERROR,
        "a failed READ completed while its target may still copy into it (%s)",
        stopping ? "engine stopping" : "no thread to wait with");
    f->Resolve(status, msg);
    return;
  }
  Log(host_, FERRY_LOG_WARN,
      "a failed READ waits for its target to finish copying into this process's memory");
  cv_.notify_all();
}

void PushWaiter::GiveUpLocked(const void* owner, bool all) {
  for (Held& h : held_)
    if (all || h.owner == owner) h.give_up = true;
}

void PushWaiter::Main() {
  std::unique_lock lk(mu_);
  for (;;) {
    if (held_.empty()) {
      if (stopping_) return;
      cv_.wait(lk);
      continue;
    }
    std::vector<Held> ready;
    for (auto it = held_.begin(); it != held_.end();) {
      if (it->give_up || Quiet(*it->frame->push_link)) {
        ready.push_back(std::move(*it));
        it = held_.erase(it);
      } else {
        ++it;
      }
    }
    const std::shared_ptr<direct::Link> next =
        held_.empty() ? nullptr : held_.front().frame->push_link;
    lk.unlock();
    for (Held& h : ready) {
      if (h.give_up) {
        Log(host_, FERRY_LOG_ERROR,
            "a failed READ completed after the grace period while its target may still copy "
            "into it");
      }
      h.frame->Resolve(h.status, h.msg);
    }
    ready.clear();
    lk.lock();
    done_.notify_all();
    if (next && held_.empty() == false) {
      lk.unlock();
      next->target().WaitExit(kLookMs);
      lk.lock();
    }
  }
}

void PushWaiter::Drain(const void* owner, std::chrono::milliseconds grace) {
  const auto give_up = std::chrono::steady_clock::now() + grace;
  std::unique_lock lk(mu_);
  auto none = [&] {
    for (const Held& h : held_)
      if (h.owner == owner) return false;
    return true;
  };
  // Held READs mean a thread looks at them (Resolve holds none without one).
  if (done_.wait_until(lk, give_up, none)) return;
  GiveUpLocked(owner, false);
  cv_.notify_all();
  done_.wait(lk, none);
}

void PushWaiter::Stop(std::chrono::milliseconds grace) {
  const auto give_up = std::chrono::steady_clock::now() + grace;
  {
    std::unique_lock lk(mu_);
    if (stopping_) return;
    stopping_ = true;
    if (!done_.wait_until(lk, give_up, [&] { return held_.empty(); })) GiveUpLocked(nullptr, true);
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

uint64_t PushWaiter::held() const {
  std::lock_guard lk(mu_);
  return held_total_;
}

}  // namespace ferry_tcp
