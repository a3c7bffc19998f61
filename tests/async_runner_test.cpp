// SPDX-License-Identifier: Apache-2.0
// AsyncRunner (core/src/async_runner.h): a job never waits behind another,
// threads are reused while jobs keep coming and end after their linger, and
// the destructor runs every queued job. Events are ordered by futures and by
// the runner's own counts, never by sleeping.
#include "async_runner.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "peer_job_queue.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

// Polls `cond` until it holds or 10 s pass (a status, not a guess at timing).
template <typename Cond>
bool eventually(Cond cond) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!cond()) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::yield();
  }
  return true;
}

// With a thread idle already (the case a wrong count of idle threads gets
// wrong: it hands both jobs to that one thread, the second behind the first).
TEST(AsyncRunner, AJobDoesNotWaitBehindABlockedOne) {
  std::promise<void> release, first_done;  // outlive the runner (declared first)
  std::once_flag released_once;
  auto let_go = [&] { std::call_once(released_once, [&] { release.set_value(); }); };
  std::shared_future<void> released = release.get_future().share();
  AsyncRunner r(std::chrono::minutes(1));
  r.run([] {});
  ASSERT_TRUE(eventually([&] { return r.idle() == 1; }));
  r.run([released, &first_done] {
    released.wait();  // blocked until the second job runs
    first_done.set_value();
  });
  r.run(let_go);
  EXPECT_EQ(first_done.get_future().wait_for(10s), std::future_status::ready);
  let_go();  // a failed run: the blocked job goes, so the runner can end
}

TEST(AsyncRunner, AnIdleThreadTakesTheNextJob) {
  std::vector<std::promise<std::thread::id>> ran(50);  // outlive the runner
  AsyncRunner r(std::chrono::minutes(1));
  for (auto& p : ran) {
    r.run([&p] { p.set_value(std::this_thread::get_id()); });
    ASSERT_EQ(p.get_future().wait_for(10s), std::future_status::ready);
    // Back to idle before the next job: then no new thread is started for it.
    ASSERT_TRUE(eventually([&] { return r.idle() == 1; }));
  }
  EXPECT_EQ(r.threads(), 1u);
}

TEST(AsyncRunner, ThreadsEndAfterTheirLinger) {
  AsyncRunner r(1ms);
  std::atomic<int> ran{0};
  for (int i = 0; i < 4; ++i) r.run([&ran] { ++ran; });
  EXPECT_TRUE(eventually([&] { return ran.load() == 4 && r.threads() == 0; }));
  r.run([&ran] { ++ran; });  // and a job after that starts a thread again
  EXPECT_TRUE(eventually([&] { return ran.load() == 5; }));
}

TEST(AsyncRunner, DestructionRunsWhatIsQueuedAndWhatJobsStart) {
  std::atomic<int> ran{0};
  {
    AsyncRunner r(std::chrono::minutes(1));
    std::promise<void> go;
    std::shared_future<void> started = go.get_future().share();
    for (int i = 0; i < 8; ++i)
      r.run([&r, &ran, started, i] {
        started.wait();
        ++ran;
        if (i == 0) r.run([&ran] { ++ran; });  // maybe during the destructor
      });
    go.set_value();
  }
  EXPECT_EQ(ran.load(), 9);
}

TEST(AsyncRunner, ManyPostersAtOnce) {
  std::atomic<int> ran{0};
  {
    AsyncRunner r(5ms);
    std::vector<std::thread> posters;
    for (int p = 0; p < 4; ++p)
      posters.emplace_back([&] {
        for (int i = 0; i < 200; ++i) r.run([&ran] { ++ran; });
      });
    for (auto& t : posters) t.join();
  }
  EXPECT_EQ(ran.load(), 800);
}

// PeerJobQueue: one peer's jobs run one at a time, the earliest deadline
// first; another peer's job does not wait behind a blocked one; the
// destructor order (runner first) leaves nothing queued.
TEST(PeerJobQueue, OnePeerByDeadlineOthersBeside) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::mutex mu;
  std::vector<int> order;
  std::promise<void> b_ran, a_first_running;
  auto record = [&](int n) {
    std::lock_guard<std::mutex> lk(mu);
    order.push_back(n);
  };
  std::atomic<int> on_runner{0};
  {
    // As in Transfers (transfer.h): the runner is declared last, so it is
    // destroyed first and its threads finish every drain while the queue
    // still exists (the other way round, a drain's last look at its peer
    // read a destroyed queue: TSan, CI of 2026-12-05).
    struct Owner {
      PeerJobQueue q{runner};
      AsyncRunner runner;
    } owner;
    PeerJobQueue& q = owner.q;
    AsyncRunner& runner = owner.runner;
    q.run("a", PeerJobQueue::Clock::now(), [&](bool ok) {
      on_runner += ok;
      a_first_running.set_value();
      released.wait();  // peer a's first job blocks its queue
      record(1);
    });
    for (int n = 2; n <= 5; ++n)
      q.run("a", PeerJobQueue::Clock::now() + std::chrono::seconds(10 - n), [&, n](bool ok) {
        on_runner += ok;
        record(n);
      });
    q.run("b", PeerJobQueue::Clock::now(), [&](bool ok) {
      on_runner += ok;
      b_ran.set_value();
    });
    // b's job runs while a's queue is blocked (it would hang here otherwise).
    ASSERT_EQ(b_ran.get_future().wait_for(10s), std::future_status::ready);
    // (Job 1 may not have left the queue yet when b's ran: a busy machine.)
    ASSERT_EQ(a_first_running.get_future().wait_for(10s), std::future_status::ready);
    EXPECT_EQ(q.waiting(), 4u);  // a's jobs 2..5 wait behind job 1
    EXPECT_LE(runner.threads(), 2u) << "a thread per waiting job";
    release.set_value();
    ASSERT_TRUE(eventually([&] { return q.waiting() == 0 && on_runner == 6; }));
  }
  // Job 1 ran first (it was alone); the rest by deadline, 5 being due first.
  EXPECT_EQ(order, (std::vector<int>{1, 5, 4, 3, 2}));
}

}  // namespace
}  // namespace ferry
