// SPDX-License-Identifier: Apache-2.0
// The watchdog (core/src/watchdog.h) ends every attempt by its own deadline,
// whatever order the deadlines were armed in: a failover attempt's deadline
// comes before those of transfers submitted after the one it belongs to.
#include "watchdog.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <vector>

namespace ferry {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What fired, in order, and when.
struct Fired {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> order;
  std::vector<Clock::time_point> at;

  // True once `n` items fired (false after `limit`).
  bool WaitFor(size_t n, std::chrono::milliseconds limit) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, limit, [&] { return order.size() >= n; });
  }
};

class Item final : public WatchItem {
 public:
  Item(Fired* fired, int id) : fired_(fired), id_(id) {}
  void on_deadline() override {
    {
      std::lock_guard lk(fired_->mu);
      fired_->order.push_back(id_);
      fired_->at.push_back(Clock::now());
    }
    fired_->cv.notify_all();
  }

 private:
  Fired* fired_;
  int id_;
};

TEST(Watchdog, AnEarlierDeadlineArmedLaterFiresByItsOwnTime) {
  Fired fired;
  Watchdog wd;
  auto late = std::make_shared<Item>(&fired, 1);
  auto early = std::make_shared<Item>(&fired, 2);
  const auto t0 = Clock::now();
  wd.arm(late, t0 + 60s);    // a transfer submitted just before
  wd.arm(early, t0 + 50ms);  // a failover attempt of an older transfer
  // Not after the later one's deadline: long before it.
  ASSERT_TRUE(fired.WaitFor(1, 20s)) << "the earlier deadline did not fire";
  std::lock_guard lk(fired.mu);
  EXPECT_EQ(fired.order, std::vector<int>{2});
  EXPECT_GE(fired.at[0], t0 + 50ms);
  wd.disarm(late.get());
}

TEST(Watchdog, ItemsFireInDeadlineOrderWhateverOrderTheyWereArmedIn) {
  constexpr int kItems = 40;
  Fired fired;
  Watchdog wd;
  std::vector<std::shared_ptr<Item>> items;
  for (int i = 0; i < kItems; ++i) items.push_back(std::make_shared<Item>(&fired, i));
  std::vector<int> arming(kItems);
  std::iota(arming.begin(), arming.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(arming.begin(), arming.end(), rng);
  const auto t0 = Clock::now() + 100ms;
  // Item i is due at t0 + i * 10 ms; every third one is disarmed again.
  for (int i : arming) wd.arm(items[i], t0 + i * 10ms);
  std::vector<int> want;
  for (int i = 0; i < kItems; ++i) {
    if (i % 3 == 1)
      wd.disarm(items[i].get());
    else
      want.push_back(i);
  }
  ASSERT_TRUE(fired.WaitFor(want.size(), 30s));
  std::lock_guard lk(fired.mu);
  EXPECT_EQ(fired.order, want);
  for (size_t k = 0; k < want.size(); ++k)
    EXPECT_GE(fired.at[k], t0 + want[k] * 10ms) << "item " << want[k] << " fired early";
}

}  // namespace
}  // namespace ferry
