// SPDX-License-Identifier: Apache-2.0
// Guarantees that every transfer ends. Items are kept in an intrusive list in
// deadline order (most deadlines are now + the engine's timeout, so an item
// usually goes at the tail; a failover attempt's, earlier, is put in its
// place); one thread sleeps until the head's deadline, so an idle engine
// costs no CPU and the memory held is bounded by what is in flight.
// arm() wakes that thread only when the new deadline is earlier than the time it
// wakes by itself: after the list empties the thread lingers a second before
// sleeping for good, so back-to-back transfers (arm into an empty list, every
// time) cost no thread wake-up each.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>

namespace ferry {

class Watchdog;

class WatchItem {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~WatchItem() = default;
  // Runs on the watchdog thread once the deadline passed, unless disarmed first.
  virtual void on_deadline() = 0;

 private:
  friend class Watchdog;
  TimePoint when_{};
  WatchItem* prev_ = nullptr;
  WatchItem* next_ = nullptr;
  // Written under the watchdog's lock; read without it by disarm(), which
  // returns at once for an item no longer listed (unlink_locked clears it
  // last, so the list touches the item no more once it reads false).
  std::atomic<bool> linked_{false};
  std::weak_ptr<WatchItem> self_;
};

class Watchdog {
 public:
  Watchdog();
  ~Watchdog();
  // Arm an item: on_deadline runs once `when` passed (in deadline order; a
  // deadline earlier than those armed before costs a walk back past them).
  void arm(const std::shared_ptr<WatchItem>& item, WatchItem::TimePoint when);
  // Unlists the item (no lock when it is not listed: the completion unlisted
  // it before its destructor asks again).
  void disarm(WatchItem* item);

 private:
  void loop();
  void unlink_locked(WatchItem* item);
  std::mutex mu_;
  std::condition_variable cv_;
  WatchItem* head_ = nullptr;
  WatchItem* tail_ = nullptr;
  // When the thread wakes by itself (max: never); arm() notifies only before it.
  WatchItem::TimePoint wake_at_ = WatchItem::TimePoint::max();
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ferry
