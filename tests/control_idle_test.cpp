// SPDX-License-Identifier: Apache-2.0
// The control plane closes a connection to a peer that has gone unused for
// EngineConfig::control_idle_close, at both ends, and reconnects on the next
// use: a peer that once needed a message or a fence does not hold descriptors
// for good (docs/scale.md).
#include <dirent.h>
#include <gtest/gtest.h>

#include <chrono>
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

}  // namespace
