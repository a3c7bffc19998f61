#include "watchdog.h"

namespace ferry {

Watchdog::Watchdog() : thread_([this] { loop(); }) {}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::arm(const std::shared_ptr<WatchItem>& item, WatchItem::TimePoint when) {
  bool was_empty;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (item->linked_) return;
    item->when_ = when;
    item->self_ = item;
    item->prev_ = tail_;
    item->next_ = nullptr;
    if (tail_) tail_->next_ = item.get();
    else head_ = item.get();
    tail_ = item.get();
    item->linked_ = true;
    was_empty = head_ == item.get();
  }
  if (was_empty) cv_.notify_all();
}

void Watchdog::disarm(WatchItem* item) {
  std::lock_guard<std::mutex> lk(mu_);
  unlink_locked(item);
}

void Watchdog::unlink_locked(WatchItem* item) {
  if (!item->linked_) return;
  if (item->prev_) item->prev_->next_ = item->next_;
  else head_ = item->next_;
  if (item->next_) item->next_->prev_ = item->prev_;
  else tail_ = item->prev_;
  item->linked_ = false;
  item->prev_ = item->next_ = nullptr;
}

void Watchdog::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (!head_) {
      cv_.wait(lk);
      continue;
    }
    auto when = head_->when_;
    if (std::chrono::steady_clock::now() < when) {
      cv_.wait_until(lk, when);
      continue;
    }
    WatchItem* it = head_;
    auto keep = it->self_.lock();  // fails while the item is being destroyed
    unlink_locked(it);              // after this, `it` is not touched unless kept alive
    lk.unlock();
    if (keep) keep->on_deadline();
    keep.reset();
    lk.lock();
  }
}

}  // namespace ferry
