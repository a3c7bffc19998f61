// SPDX-License-Identifier: Apache-2.0
// The I/O pool's kicks (io_pool.h): every kick of a parked handler gives it
// exactly one turn, whether the pool sleeps (KickAll re-arms one handler and
// the thread that wakes for it re-arms the others) or a thread polls (the
// poller takes them), and a pool that stopped takes kicks without harm.
#include "io_pool.h"

#include <gtest/gtest.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ferry_tcp {
namespace {

using namespace std::chrono_literals;

// Counts the turns of each handler; every turn parks the handler again.
struct Turns {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int> count;

  // True once every handler has had at least `n` turns (false after `limit`).
  bool WaitAll(int n, std::chrono::seconds limit) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, limit, [&] {
      for (int c : count)
        if (c < n) return false;
      return true;
    });
  }
};

class CountingHandler final : public IoPool::Handler {
 public:
  CountingHandler(Turns* turns, int index) : turns_(turns), index_(index) {
    // An eventfd is always writable: EPOLLOUT fires as soon as it is armed.
    fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  }
  ~CountingHandler() override {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const override { return fd_; }
  uint32_t OnEvents(uint32_t) override {
    {
      std::lock_guard lk(turns_->mu);
      ++turns_->count[index_];
    }
    turns_->cv.notify_all();
    return IoPool::kParked;
  }
  void Expire() override {}

 private:
  Turns* turns_;
  int index_;
  int fd_ = -1;
};

class IoPoolKicks : public ::testing::TestWithParam<int> {
 protected:
  // Starts `pool` and registers n handlers counted in turns_, each parked
  // (registered for no events) until kicked; their pointers in handlers_.
  void StartWithParkedHandlers(IoPool& pool, int n) {
    std::string err;
    ASSERT_TRUE(pool.Start(&err)) << err;
    turns_.count.assign(static_cast<size_t>(n), 0);
    for (int i = 0; i < n; ++i) {
      auto h = std::make_unique<CountingHandler>(&turns_, i);
      ASSERT_GE(h->fd(), 0);
      handlers_.push_back(h.get());
      std::unique_ptr<IoPool::Handler> back;
      ASSERT_TRUE(pool.Add(std::move(h), 0, &back, &err)) << err;
    }
  }
  std::chrono::microseconds spin() const { return std::chrono::microseconds(GetParam()); }

  Turns turns_;
  std::vector<IoPool::Handler*> handlers_;
};

TEST_P(IoPoolKicks, KickAllGivesEveryParkedHandlerExactlyOneTurn) {
  constexpr int kHandlers = 8;
  constexpr int kRounds = 200;
  IoPool pool(4, 100ms, spin());
  ASSERT_NO_FATAL_FAILURE(StartWithParkedHandlers(pool, kHandlers));
  Turns& turns = turns_;
  const std::vector<IoPool::Handler*>& handlers = handlers_;
  for (int round = 1; round <= kRounds; ++round) {
    IoPool::Kicks kicks;
    for (auto* h : handlers) kicks.emplace_back(h, EPOLLOUT);
    pool.KickAll(kicks);
    EXPECT_TRUE(kicks.empty());
    ASSERT_TRUE(turns.WaitAll(round, 30s)) << "a kick was lost in round " << round;
    std::lock_guard lk(turns.mu);
    for (int i = 0; i < kHandlers; ++i)
      ASSERT_EQ(turns.count[i], round) << "handler " << i << " had an extra turn";
  }
  pool.Stop();  // joins the threads: no turn can still be coming
  for (int i = 0; i < kHandlers; ++i) EXPECT_EQ(turns.count[i], kRounds) << "handler " << i;
}

TEST_P(IoPoolKicks, OneKickAndKickAllMixFromManyThreads) {
  // Four posting threads, each with its own two handlers, kicking one and
  // both in turn: no kick lost, none doubled, while the others kick too.
  constexpr int kThreads = 4;
  constexpr int kRounds = 300;
  IoPool pool(3, 100ms, spin());
  ASSERT_NO_FATAL_FAILURE(StartWithParkedHandlers(pool, kThreads * 2));
  Turns& turns = turns_;
  const std::vector<IoPool::Handler*>& handlers = handlers_;
  std::vector<std::thread> posters;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    posters.emplace_back([&, t] {
      IoPool::Handler* a = handlers[t * 2];
      IoPool::Handler* b = handlers[t * 2 + 1];
      int want_a = 0, want_b = 0;
      for (int r = 0; r < kRounds; ++r) {
        if (r % 2 == 0) {
          IoPool::Kicks kicks{{a, EPOLLOUT}, {b, EPOLLOUT}};
          pool.KickAll(kicks);
          ++want_a;
          ++want_b;
        } else {
          pool.Kick(a, EPOLLOUT);
          ++want_a;
        }
        // Parked again before the next kick: wait for both turns.
        std::unique_lock lk(turns.mu);
        if (!turns.cv.wait_for(lk, 30s, [&] {
              return turns.count[t * 2] >= want_a && turns.count[t * 2 + 1] >= want_b;
            })) {
          ++failures[t];
          return;
        }
        if (turns.count[t * 2] != want_a || turns.count[t * 2 + 1] != want_b) {
          ++failures[t];
          return;
        }
      }
    });
  }
  for (auto& p : posters) p.join();
  pool.Stop();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(failures[t], 0) << "poster " << t;
    EXPECT_EQ(turns.count[t * 2], kRounds) << "poster " << t << "'s first handler";
    EXPECT_EQ(turns.count[t * 2 + 1], kRounds / 2) << "poster " << t << "'s second handler";
  }
}

TEST_P(IoPoolKicks, AStoppedPoolTakesKicksWithoutTurns) {
  IoPool pool(2, 100ms, spin());
  ASSERT_NO_FATAL_FAILURE(StartWithParkedHandlers(pool, 2));
  Turns& turns = turns_;
  const std::vector<IoPool::Handler*>& handlers = handlers_;
  pool.Stop();  // deletes the handlers: the pointers are only compared now
  IoPool::Kicks kicks{{handlers[0], EPOLLOUT}, {handlers[1], EPOLLOUT}};
  pool.KickAll(kicks);
  EXPECT_EQ(pool.handlers(), 0u);
  std::lock_guard lk(turns.mu);
  EXPECT_EQ(turns.count[0], 0);
  EXPECT_EQ(turns.count[1], 0);
}

// A handler that is always ready (an eventfd with a count never read) and
// notes any turn that starts while another is still running; it ends itself
// after `last` turns.
class OverlapHandler final : public IoPool::Handler {
 public:
  explicit OverlapHandler(int last) : last_(last) {
    fd_ = eventfd(1, EFD_CLOEXEC | EFD_NONBLOCK);  // readable from the start
  }
  ~OverlapHandler() override {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const override { return fd_; }
  uint32_t OnEvents(uint32_t) override {
    if (inside_.fetch_add(1) != 0) overlaps.fetch_add(1);
    // Long enough for another thread to be handed the same handler meanwhile.
    const auto until = std::chrono::steady_clock::now() + 20us;
    while (std::chrono::steady_clock::now() < until) {
    }
    const int n = ++turns_;  // plain: only one turn at a time may touch it
    inside_.fetch_sub(1);
    if (n >= last_) {
      done.store(true);
      return 0;  // finished: the pool deletes it
    }
    return EPOLLIN;
  }
  void Expire() override {}

  static inline std::atomic<int> overlaps{0};
  static inline std::atomic<bool> done{false};

 private:
  const int last_;
  int fd_ = -1;
  int turns_ = 0;
  std::atomic<int> inside_{0};
};

TEST_P(IoPoolKicks, AHandlerReArmedDuringItsTurnStillRunsOnOneThreadAtATime) {
  // Another thread re-arms the handler over and over whatever it is doing,
  // as a caller that took it for parked when it was not: the pool hands it
  // to a second thread while the first runs it. That one must wait for the
  // turn's end - never run beside it, never touch it once it is finished.
  OverlapHandler::overlaps = 0;
  OverlapHandler::done = false;
  IoPool pool(4, 100ms, spin());
  std::string err;
  ASSERT_TRUE(pool.Start(&err)) << err;
  auto owned = std::make_unique<OverlapHandler>(3000);
  ASSERT_GE(owned->fd(), 0);
  IoPool::Handler* h = owned.get();
  std::unique_ptr<IoPool::Handler> back;
  ASSERT_TRUE(pool.Add(std::move(owned), EPOLLIN, &back, &err)) << err;
  uint64_t rearms = 0;
  // Rearm checks that h is still registered (under the pool's lock) before
  // it touches it: once the handler finished, it refuses.
  while (pool.Rearm(h, EPOLLIN)) ++rearms;
  EXPECT_TRUE(OverlapHandler::done.load());
  pool.Stop();
  EXPECT_EQ(OverlapHandler::overlaps.load(), 0) << "turns of one handler ran at once";
  EXPECT_GT(rearms, 0u);
  // The re-arms did hand it to a second thread during a turn (else this test
  // proves nothing about that case).
  EXPECT_GT(pool.turn_waits(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Spin, IoPoolKicks, ::testing::Values(0, 200),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "spin" + std::to_string(i.param);
                         });

}  // namespace
}  // namespace ferry_tcp
