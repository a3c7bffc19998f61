// SPDX-License-Identifier: Apache-2.0
// Completions driven by the waiting thread (plugin ABI 1.6 progress()): a
// thread in Wait()/WaitFor() runs the backend's progress() while it polls, so
// a backend reports a finished transfer there instead of handing it to a
// thread of its own. The backend is tests/plugins/fault_plugin.cpp in mode
// "deferred": it copies in post() but reports success only from progress()
// (or fails the transfer at fini) - it has no thread of its own, so a transfer
// ends only if the core calls progress() for it, and each must end once.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "duration_model.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kBytes = 1 << 20;

struct Rig {
  Rig() {
    setenv("FERRY_PLUGIN_PATH",
           (std::string(FERRY_TEST_PLUGIN_DIR) + ":" + FERRY_PLUGIN_BUILD_DIR).c_str(), 1);
    policy_path = (std::filesystem::temp_directory_path() /
                   ("ferry-progress-" + std::to_string(getpid()) + ".yaml"))
                      .string();
    std::ofstream(policy_path) << "backends:\n  fault: {}\nrules:\n  - prefer: [fault]\n"
                                  "failover:\n  max_attempts: 1\ntimeout: 20s\n";
    EngineConfig cfg;
    cfg.policy_file = policy_path;
    ini = std::make_unique<Engine>("ini", cfg);
    tgt = std::make_unique<Engine>("tgt", cfg);
    for (Engine* e : {ini.get(), tgt.get()})
      if (Result r = e->add_backend("fault", R"({"mode":"deferred"})"); !r)
        throw std::runtime_error(r.message);
    ini->register_remote_engine(tgt->desc());
    tgt->register_remote_engine(ini->desc());
    src.resize(kBytes);
    dst.resize(kBytes);
    test::fill_pattern(src.data(), 0, kBytes, 7);
    lmem = ini->register_memory(src.data(), src.size());
    rmem = tgt->register_memory(dst.data(), dst.size());
  }
  ~Rig() { std::filesystem::remove(policy_path); }

  uint64_t counter(const std::string& key) {
    auto st = ini->stats().backends["fault"];
    auto it = st.plugin.find(key);
    return it == st.plugin.end() ? 0 : it->second;
  }

  std::string policy_path;
  std::vector<uint8_t> src, dst;  // before the engines: it outlives their threads
  std::unique_ptr<Engine> ini, tgt;
  MemoryDesc lmem, rmem;
};

// Without a waiter nothing reports the transfer: the backend really leaves it
// to progress(). Wait() then ends it, on this thread, with the data in place.
TEST(WaiterProgress, WaitReportsWhatTheBackendLeftToIt) {
  Rig rig;
  const TransferUid uid = rig.ini->allocate_transfer_uid();
  TransferStatus st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, 64 << 10, uid, true);
  EXPECT_TRUE(st.InProgress()) << "the deferred backend reported it without a waiter";
  EXPECT_EQ(rig.counter("by_progress"), 0u);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(test::find_mismatch(rig.dst.data(), 0, 64 << 10, 7, 0), -1);
  EXPECT_EQ(rig.counter("by_progress"), 1u);
  EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", uid, 5s).has_value())
      << "the target was not told";
}

// WaitFor(0) is a poll: each one runs the backend's progress once.
TEST(WaiterProgress, APollDrivesTheBackendOnce) {
  Rig rig;
  TransferStatus st = rig.ini->read(rig.lmem, 0, rig.rmem, 0, 4096, 1, false);
  const uint64_t calls = rig.counter("progress_calls");
  ASSERT_TRUE(st.WaitFor(0ms)) << st.Message();
  EXPECT_TRUE(st.Succeeded()) << st.Message();
  EXPECT_EQ(rig.counter("progress_calls"), calls + 1);
  EXPECT_FALSE(st.WaitFor(0ms) && rig.counter("progress_calls") != calls + 1)
      << "a poll of an ended transfer still called the backend";
}

// Many threads wait at once, each for its own transfers; each progress()
// call may report other threads' transfers. Every transfer ends exactly once
// (a second report would free its context twice: ASan/TSan runs check that),
// with its data.
TEST(WaiterProgress, ManyWaitersEachTransferReportedOnce) {
  Rig rig;
  constexpr int kThreads = 8, kEach = 100;
  constexpr size_t kSlice = kBytes / kThreads;
  std::atomic<int> failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        const size_t off = t * kSlice + (i % 4) * (kSlice / 4);
        TransferStatus st = rig.ini->write(rig.lmem, off, rig.rmem, off, kSlice / 4, 0, false);
        if (!st.WaitFor(20s) || !st.Succeeded()) ++failed;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(rig.counter("by_progress"), static_cast<uint64_t>(kThreads * kEach));
  EXPECT_EQ(rig.ini->stats().backends["fault"].transfers, static_cast<uint64_t>(kThreads * kEach));
  EXPECT_EQ(test::find_mismatch(rig.dst.data(), 0, kBytes, 7, 0), -1);
}

// A transfer over many region pairs has one status over its parts: waiting
// for it drives the parts' backend.
TEST(WaiterProgress, MultiRegionCallDrivesItsParts) {
  Rig rig;
  std::vector<uint8_t> src2(kBytes), dst2(kBytes);
  test::fill_pattern(src2.data(), 0, kBytes, 8);
  MemoryDesc l2 = rig.ini->register_memory(src2.data(), kBytes);
  MemoryDesc r2 = rig.tgt->register_memory(dst2.data(), kBytes);
  std::vector<TransferItem> items{{0, 0, 0, 0, 4096}, {1, 0, 1, 0, 4096}, {1, 8192, 0, 8192, 4096}};
  TransferStatus st = rig.ini->transfer(Op::WRITE, {rig.lmem, l2}, {rig.rmem, r2}, items, 9, true);
  EXPECT_TRUE(st.InProgress());
  ASSERT_TRUE(st.WaitFor(20s));
  ASSERT_TRUE(st.Succeeded()) << st.Message();
  EXPECT_EQ(rig.counter("by_progress"), 3u);
  EXPECT_EQ(test::find_mismatch(rig.dst.data(), 0, 4096, 7, 0), -1);
  EXPECT_EQ(test::find_mismatch(dst2.data(), 0, 4096, 8, 0), -1);
  EXPECT_EQ(test::find_mismatch(rig.dst.data(), 8192, 4096, 8, 8192), -1);
  EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", 9, 5s).has_value());
  rig.ini->deregister_memory(l2);
  rig.tgt->deregister_memory(r2);
}

// deregister_memory() of a region with a transfer in flight returns only once
// that transfer has ended: the region's in-flight count is kept without a
// lock, and the transfer that takes it to zero wakes the deregistration.
TEST(WaiterProgress, DeregisteringARegionWaitsForItsTransfer) {
  Rig rig;
  TransferStatus st =
      rig.ini->write(rig.lmem, 0, rig.rmem, 0, 4096, rig.ini->allocate_transfer_uid(), false);
  ASSERT_TRUE(st.InProgress());
  auto dereg = std::async(std::launch::async, [&] { return rig.ini->deregister_memory(rig.lmem); });
  // Nothing reports the transfer (the deferred backend, no waiter yet).
  EXPECT_EQ(dereg.wait_for(300ms), std::future_status::timeout)
      << "the region was deregistered under a transfer in flight";
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  ASSERT_EQ(dereg.wait_for(10s), std::future_status::ready)
      << "the transfer ended but the deregistration was not woken";
  EXPECT_TRUE(dereg.get());
}

// A transfer nobody waits for ends when its backend goes: fini fails it, and a
// wait that comes later returns at once (the removed backend is not called).
TEST(WaiterProgress, RemovedBackendEndsWhatNobodyWaitedFor) {
  Rig rig;
  TransferStatus st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, 4096, 2, false);
  EXPECT_TRUE(st.InProgress());
  ASSERT_TRUE(rig.ini->remove_backend("fault"));
  ASSERT_TRUE(st.WaitFor(10s));
  EXPECT_FALSE(st.Succeeded());
  EXPECT_NE(st.Message().find("waiter"), std::string::npos) << st.Message();
}

// A wait that outlasts its spin sleeps until shortly before its transfer is
// due, then polls (running the progress hook) around the due time. Here only
// a poll can end the transfer - nothing notifies - so a wait that slept until
// woken would never return (the guard below ends it after 10 s).
TEST(WaiterProgress, AWaitIsAwakeWhenItsTransferIsDue) {
  for (const auto lead : {5ms, 50ms}) {
    TransferStatus s;
    s.SetInProgress();
    const auto due = std::chrono::steady_clock::now() + lead;
    std::atomic<int> polls{0};
    s.SetProgress([&] {
      ++polls;
      if (std::chrono::steady_clock::now() >= due) s.Finish(StatusCode::SUCCESS);
    });
    s.SetExpectedEnd(due);
    auto waited = std::async(std::launch::async, [&] { return s.Wait(); });
    const bool returned = waited.wait_for(10s) == std::future_status::ready;
    if (!returned) s.Finish(StatusCode::ERR_TIMEOUT, "test guard");
    EXPECT_TRUE(returned) << "the wait slept through its due time (lead " << lead.count() << " ms)";
    EXPECT_EQ(waited.get(), returned ? StatusCode::SUCCESS : StatusCode::ERR_TIMEOUT);
    // It slept most of the lead: not a poll per microsecond of it.
    EXPECT_LT(polls.load(), 200000);
  }
}

// WaitFor() does the same within its timeout; one due after the timeout is
// not waited for past it.
TEST(WaiterProgress, WaitForHonoursItsTimeoutAroundTheDueTime) {
  TransferStatus s;
  s.SetInProgress();
  s.SetProgress([] {});
  s.SetExpectedEnd(std::chrono::steady_clock::now() + 500ms);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(s.WaitFor(20ms));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 400ms) << "WaitFor outlived its timeout";
  s.Finish(StatusCode::SUCCESS);
  EXPECT_TRUE(s.WaitFor(20ms));
}

// The model behind the due time: per size class, a moving average of time per byte.
TEST(DurationModelTest, LearnsPerSizeClass) {
  DurationModel m;
  EXPECT_EQ(m.expected(1 << 20).count(), 0) << "no history yet";
  m.record(1 << 20, 100us);  // 1 MiB in 100 us
  EXPECT_NEAR(static_cast<double>(m.expected(1 << 20).count()), 100000.0, 1000.0);
  EXPECT_EQ(m.expected(64 << 20).count(), 0) << "another size class has its own history";
  for (int i = 0; i < 20; ++i) m.record(1 << 20, 200us);  // it got slower
  EXPECT_NEAR(static_cast<double>(m.expected(1 << 20).count()), 200000.0, 5000.0);
  m.record(4096, 1ms);  // below kMinBytes: not kept
  EXPECT_EQ(m.expected(4096).count(), 0);
  // Faster than a byte a picosecond (an H100 copies 256 MiB in ~180 us): kept.
  m.record(256u << 20, 180us);
  EXPECT_NEAR(static_cast<double>(m.expected(256u << 20).count()), 180000.0, 2000.0);
}

}  // namespace
