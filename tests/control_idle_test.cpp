// SPDX-License-Identifier: Apache-2.0
// The control plane closes a connection to a peer that has gone unused for
// EngineConfig::control_idle_close, at both ends, and reconnects on the next
// use: a peer that once needed a message or a fence does not hold descriptors
// for good (docs/scale.md). With EngineConfig::control_spin the plane's thread
// polls a while after each frame: every frame still arrives, and an idle
// engine stops polling.
#include <dirent.h>
#include <gtest/gtest.h>
#include <time.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "ferry/ferry.hpp"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

size_t OpenFds() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// The count once it has come down to `want`, or what it is after `limit`: a
// bounded poll of a condition.
size_t FdsSettled(size_t want, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  size_t n = OpenFds();
  while (n > want && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(5ms);
    n = OpenFds();
  }
  return n;
}

std::string Received(Engine& e) {
  auto got = e.wait_notifications(5s);
  return got.count("a") && !got["a"].empty() ? got["a"].front() : "";
}

TEST(ControlIdle, AnUnusedConnectionClosesAtBothEndsAndTheNextMessageReconnects) {
  EngineConfig cfg;
  cfg.control_idle_close = 200ms;
  Engine a("a", cfg), b("b", cfg);
  ASSERT_TRUE(a.register_remote_engine(b.desc()));  // one way, as vLLM does
  const size_t idle = OpenFds();
  for (int round = 1; round <= 2; ++round) {
    TransferStatus st = a.send_notification("b", "hello " + std::to_string(round));
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    EXPECT_EQ(Received(b), "hello " + std::to_string(round));
    EXPECT_GE(OpenFds(), idle + 2) << "a connection at each end while in use";
    EXPECT_EQ(FdsSettled(idle, 5s), idle) << "round " << round;
  }
}

TEST(ControlIdle, ZeroKeepsTheConnection) {
  EngineConfig cfg;
  cfg.control_idle_close = 0ms;
  Engine a("a", cfg), b("b", cfg);
  ASSERT_TRUE(a.register_remote_engine(b.desc()));
  const size_t idle = OpenFds();
  ASSERT_EQ(a.send_notification("b", "x").Wait(), StatusCode::SUCCESS);
  EXPECT_EQ(Received(b), "x");
  // Four idle periods of the other test: the connection is still there.
  EXPECT_GE(FdsSettled(idle, 800ms), idle + 2);
}

double ProcessCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

TEST(ControlSpin, EveryMessageArrivesInOrderWhileThePlanePolls) {
  EngineConfig cfg;
  cfg.control_spin = std::chrono::microseconds(2000);
  Engine a("a", cfg), b("b", cfg);
  ASSERT_TRUE(a.register_remote_engine(b.desc()));
  constexpr int kMessages = 200;
  for (int i = 0; i < kMessages; ++i)
    ASSERT_EQ(a.send_notification("b", std::to_string(i)).Wait(), StatusCode::SUCCESS) << i;
  std::vector<std::string> got;
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (got.size() < kMessages && std::chrono::steady_clock::now() < until) {
    auto m = b.wait_notifications(1s);
    if (m.count("a")) got.insert(got.end(), m["a"].begin(), m["a"].end());
  }
  ASSERT_EQ(got.size(), static_cast<size_t>(kMessages));
  for (int i = 0; i < kMessages; ++i) EXPECT_EQ(got[i], std::to_string(i));
}

// After the longest poll (10 ms) the threads sleep: across 400 ms of idling
// the process uses a small part of one core, not all of it.
TEST(ControlSpin, AnIdleEngineStopsPolling) {
  EngineConfig cfg;
  cfg.control_spin = std::chrono::microseconds(10000);
  cfg.control_idle_close = 0ms;
  Engine a("a", cfg), b("b", cfg);
  ASSERT_TRUE(a.register_remote_engine(b.desc()));
  ASSERT_EQ(a.send_notification("b", "x").Wait(), StatusCode::SUCCESS);
  EXPECT_EQ(Received(b), "x");
  // The last poll ends within control_spin of the last frame: waited for as
  // the process's CPU time standing nearly still across 20 ms (bounded; a
  // poll that never ends runs into the bound and fails the check below).
  const auto bound = std::chrono::steady_clock::now() + 5s;
  for (double last = ProcessCpuSeconds(); std::chrono::steady_clock::now() < bound;) {
    std::this_thread::sleep_for(20ms);  // the window sampled, not an ordering
    const double now = ProcessCpuSeconds();
    if (now - last < 0.002) break;
    last = now;
  }
  const double before = ProcessCpuSeconds();
  std::this_thread::sleep_for(400ms);  // the interval measured, not an ordering
  EXPECT_LT(ProcessCpuSeconds() - before, 0.1) << "a control thread kept polling while idle";
}

TEST(ControlSpin, OutOfRangeIsRefused) {
  EngineConfig cfg;
  cfg.control_spin = std::chrono::microseconds(10001);
  try {
    Engine e("e", cfg);
    ADD_FAILURE() << "an engine started with control_spin 10001 us";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_NE(std::string(e.what()).find("control_spin"), std::string::npos) << e.what();
  }
  for (const char* bad : {"abc", "-1", "20000", "5us"}) {
    setenv("FERRY_CONTROL_SPIN_US", bad, 1);
    EXPECT_THROW(Engine("e", EngineConfig{}), Error) << bad;
  }
  setenv("FERRY_CONTROL_SPIN_US", "300", 1);
  EXPECT_NO_THROW(Engine("e", EngineConfig{}));
  unsetenv("FERRY_CONTROL_SPIN_US");
}

}  // namespace
