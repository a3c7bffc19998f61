// SPDX-License-Identifier: Apache-2.0
#include "watchdog.h"

#include "hot_path.h"
#include "thread_name.h"

namespace ferry {

namespace {
// How long the thread keeps a self-set wake-up after the list empties.
constexpr auto kIdleLinger = std::chrono::seconds(1);
}  // namespace

Watchdog::Watchdog() : thread_(ferry::named_thread("ferry-watchdog", [this] { loop(); })) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

FERRY_HOT void Watchdog::arm(const std::shared_ptr<WatchItem>& item, WatchItem::TimePoint when) {
  bool wake;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (item->linked_) return;
    item->when_ = when;
    item->self_ = item;
    // In deadline order, looked for from the tail: most deadlines are now +
    // the engine's timeout, the latest yet (no step back). A failover attempt
    // or a part of an older call comes earlier than items armed after its
    // transfer: behind them, it would fire only once they had.
    WatchItem* before = tail_;
    while (before != nullptr && when < before->when_) before = before->prev_;
    WatchItem* after = before != nullptr ? before->next_ : head_;
    item->prev_ = before;
    item->next_ = after;
    if (before != nullptr)
      before->next_ = item.get();
    else
      head_ = item.get();
    if (after != nullptr)
      after->prev_ = item.get();
    else
      tail_ = item.get();
    item->linked_.store(true, std::memory_order_relaxed);
    // Behind a head, the thread wakes for the (no later) head first; a new head
    // needs it only before the time it wakes by itself.
    wake = head_ == item.get() && when < wake_at_;
  }
  if (wake) cv_.notify_all();
}

FERRY_HOT void Watchdog::disarm(WatchItem* item) {
  if (!item->linked_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lk(mu_);
  unlink_locked(item);
}

void Watchdog::unlink_locked(WatchItem* item) {
  if (!item->linked_) return;
  if (item->prev_)
    item->prev_->next_ = item->next_;
  else
    head_ = item->next_;
  if (item->next_)
    item->next_->prev_ = item->prev_;
  else
    tail_ = item->prev_;
  item->prev_ = item->next_ = nullptr;
  item->linked_.store(false, std::memory_order_release);  // last: see WatchItem::linked_
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  bool lingered = false;
  while (!stop_) {
    if (!head_) {
      if (!lingered) {
        lingered = true;
        wake_at_ = std::chrono::steady_clock::now() + kIdleLinger;
        cv_.wait_until(lk, wake_at_);
      } else {
        wake_at_ = WatchItem::TimePoint::max();  // idle: no wake-ups at all
        cv_.wait(lk);
      }
      continue;
    }
    lingered = false;
    auto when = head_->when_;
    if (std::chrono::steady_clock::now() < when) {
      wake_at_ = when;
      cv_.wait_until(lk, when);
      continue;
    }
    WatchItem* it = head_;
    auto keep = it->self_.lock();  // fails while the item is being destroyed
    unlink_locked(it);             // after this, `it` is not touched unless kept alive
    lk.unlock();
    if (keep) keep->on_deadline();
    keep.reset();
    lk.lock();
  }
}

}  // namespace ferry
