// SPDX-License-Identifier: Apache-2.0
// The post queue on its own (post_queue.h): every job delivered exactly once
// and in push order, by a waiter's Flush or else the flusher; a Flush from
// inside a delivery does not deadlock; pushes wake the flusher only when it
// sleeps for good; Stop delivers what is left.
#include "../post_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry_tcp {
namespace {

using namespace std::chrono_literals;

// Records each delivery: which job, on which thread, how many times.
struct Log {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  std::vector<int> times;

  explicit Log(size_t n) : times(n, 0) {}
  void Add(int id) {
    std::lock_guard lk(mu);
    order.push_back(id);
    threads.push_back(std::this_thread::get_id());
    ++times[static_cast<size_t>(id)];
    cv.notify_all();
  }
  // True once n deliveries happened, within a generous bound (a hung queue fails).
  bool WaitFor(size_t n) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, 30s, [&] { return order.size() >= n; });
  }
};

struct Recorded final : PostQueue::Job {
  Log* log;
  int id;
  std::function<void()> then;  // runs inside the delivery
  Recorded(Log* l, int i, std::function<void()> t = {}) : log(l), id(i), then(std::move(t)) {}
  void Deliver() noexcept override {
    log->Add(id);
    if (then) then();
  }
};

PostQueue::JobPtr Job(Log* log, int id, std::function<void()> then = {}) {
  return std::make_unique<Recorded>(log, id, std::move(then));
}

TEST(PostQueue, AWaiterDeliversInPushOrderOnItsOwnThread) {
  // A long flush time: the flusher does not get there first.
  Log log(8);
  PostQueue q(10s, 10s);
  std::string err;
  ASSERT_TRUE(q.Start(&err)) << err;
  for (int i = 0; i < 8; ++i) q.Push(Job(&log, i));
  EXPECT_EQ(q.Flush(), 8u);
  ASSERT_EQ(log.order.size(), 8u);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(log.order[static_cast<size_t>(i)], i);
    EXPECT_EQ(log.threads[static_cast<size_t>(i)], std::this_thread::get_id());
  }
  EXPECT_EQ(q.Flush(), 0u);  // nothing left
  EXPECT_EQ(q.by_waiters(), 8u);
  EXPECT_EQ(q.by_flusher(), 0u);
}

TEST(PostQueue, WithoutAWaiterTheFlusherDelivers) {
  Log log(1);
  PostQueue q(200us, 50ms);
  std::string err;
  ASSERT_TRUE(q.Start(&err)) << err;
  q.Push(Job(&log, 0));
  ASSERT_TRUE(log.WaitFor(1)) << "the flusher never delivered a job nobody flushed";
  EXPECT_NE(log.threads[0], std::this_thread::get_id());
  EXPECT_EQ(q.by_flusher(), 1u);
}

TEST(PostQueue, AFlushFromInsideADeliveryReturnsAndTheJobItPushedIsDeliveredNext) {
  Log log(2);
  PostQueue q(10s, 10s);
  std::string err;
  ASSERT_TRUE(q.Start(&err)) << err;
  size_t inner = 99;
  // A completion callback that posts again and waits: re-enters the queue.
  q.Push(Job(&log, 0, [&] {
    q.Push(Job(&log, 1));
    inner = q.Flush();
  }));
  // The outer flush takes what was queued when it began; the next one the rest.
  EXPECT_EQ(q.Flush(), 1u);
  EXPECT_EQ(inner, 0u);
  EXPECT_EQ(q.Flush(), 1u);
  ASSERT_EQ(log.order.size(), 2u);
  EXPECT_EQ(log.order[0], 0);
  EXPECT_EQ(log.order[1], 1);
}

TEST(PostQueue, PushesMakeNoWakeUpWhileTheFlusherLingers) {
  // Posted to every 200 us or so for a while: the flusher ticks, nobody wakes it.
  Log log(200);
  PostQueue q(200us, 10s);
  std::string err;
  ASSERT_TRUE(q.Start(&err)) << err;
  for (int i = 0; i < 200; ++i) {
    q.Push(Job(&log, i));
    if (i % 2 == 0) q.Flush();  // this "waiter" takes most; the last is left to the flusher
  }
  ASSERT_TRUE(log.WaitFor(200));
  EXPECT_EQ(q.wakeups(), 0u);
  EXPECT_GT(q.by_flusher(), 0u);
  EXPECT_FALSE(q.asleep());
}

TEST(PostQueue, APushWakesTheFlusherThatSleepsForGood) {
  Log log(2);
  PostQueue q(200us, 5ms);
  std::string err;
  ASSERT_TRUE(q.Start(&err)) << err;
  for (int round = 0; round < 2; ++round) {
    // Nothing posted for the linger: it sleeps until the next push.
    const auto until = std::chrono::steady_clock::now() + 30s;
    while (!q.asleep() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    ASSERT_TRUE(q.asleep());
    q.Push(Job(&log, round));
    EXPECT_EQ(q.wakeups(), static_cast<uint64_t>(round + 1));
    ASSERT_TRUE(log.WaitFor(static_cast<size_t>(round + 1)))
        << "a job pushed to a sleeping flusher was never delivered";
  }
  EXPECT_EQ(q.by_flusher(), 2u);
}

TEST(PostQueue, StopDeliversWhatIsLeftAndLaterPushesAtOnce) {
  Log log(3);
  {
    PostQueue q(10s, 10s);
    std::string err;
    ASSERT_TRUE(q.Start(&err)) << err;
    q.Push(Job(&log, 0));
    q.Push(Job(&log, 1));
    q.Stop();
    EXPECT_EQ(log.order.size(), 2u);
    q.Push(Job(&log, 2));  // after Stop: on this thread, now
    ASSERT_EQ(log.order.size(), 3u);
    EXPECT_EQ(log.threads[2], std::this_thread::get_id());
  }
  for (int t : log.times) EXPECT_EQ(t, 1);
}

TEST(PostQueue, BeforeStartAPushIsDeliveredAtOnce) {
  Log log(1);
  PostQueue q(10s, 10s);
  q.Push(Job(&log, 0));
  ASSERT_EQ(log.order.size(), 1u);
}

TEST(PostQueue, ManyPushersAndFlushersDeliverEachJobOnceInEachPushersOrder) {
  constexpr int kPushers = 4, kPerPusher = 5000;
  Log log(kPushers * kPerPusher);
  PostQueue q(50us, 20ms);
  std::string err;
  ASSERT_TRUE(q.Start(&err)) << err;
  std::atomic<int> pushers_done{0};
  std::vector<std::thread> threads;
  for (int p = 0; p < kPushers; ++p) {
    threads.emplace_back([&, p] {
      for (int i = 0; i < kPerPusher; ++i) {
        q.Push(Job(&log, p * kPerPusher + i));
        if (i % 7 == 0) q.Flush();  // some pushers also wait now and then
      }
      pushers_done.fetch_add(1);
    });
  }
  threads.emplace_back([&] {  // a thread that only polls
    while (pushers_done.load() < kPushers) q.Flush();
  });
  for (auto& t : threads) t.join();
  ASSERT_TRUE(log.WaitFor(static_cast<size_t>(kPushers * kPerPusher)));
  q.Stop();
  for (int t : log.times) ASSERT_EQ(t, 1);
  // Push order holds for each pusher.
  std::vector<int> last(kPushers, -1);
  for (int id : log.order) {
    const int p = id / kPerPusher;
    EXPECT_GT(id, last[static_cast<size_t>(p)]);
    last[static_cast<size_t>(p)] = id;
  }
  EXPECT_EQ(q.by_waiters() + q.by_flusher(), static_cast<uint64_t>(kPushers * kPerPusher));
}

}  // namespace
}  // namespace ferry_tcp
