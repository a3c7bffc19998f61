// SPDX-License-Identifier: Apache-2.0
// Quarantine, back-off and recovery follow the configured timings (fake clock).
#include "health.h"

#include <gtest/gtest.h>

using namespace ferry;
using namespace std::chrono_literals;

namespace {
struct FakeClock {
  Health::TimePoint now{std::chrono::seconds(1000)};
  Health::Clock fn() {
    return [this] { return now; };
  }
};
QuarantinePolicy q() {
  QuarantinePolicy p;
  p.after_failures = 3;
  p.within = 10s;
  p.period = 30s;
  p.max_period = 100s;
  return p;
}
}  // namespace

TEST(Health, QuarantineAfterNFailuresWithinWindow) {
  FakeClock c;
  Health h(q(), c.fn());
  EXPECT_FALSE(h.fail("p", "tcp"));
  EXPECT_FALSE(h.fail("p", "tcp"));
  EXPECT_TRUE(h.usable("p", "tcp"));
  auto gen = h.generation();
  EXPECT_TRUE(h.fail("p", "tcp"));
  EXPECT_GT(h.generation(), gen) << "a state change invalidates cached routes";
  EXPECT_EQ(h.state("p", "tcp"), Health::State::QUARANTINED);
  EXPECT_TRUE(h.usable("p", "rdma")) << "per (peer, backend)";
  EXPECT_TRUE(h.usable("q", "tcp"));
}

TEST(Health, FailuresOutsideWindowDoNotCount) {
  FakeClock c;
  Health h(q(), c.fn());
  h.fail("p", "tcp");
  h.fail("p", "tcp");
  c.now += 11s;
  EXPECT_FALSE(h.fail("p", "tcp"));
  EXPECT_TRUE(h.usable("p", "tcp"));
}

TEST(Health, ProbeRecoversOrBacksOffUpToCap) {
  FakeClock c;
  Health h(q(), c.fn());
  for (int i = 0; i < 3; ++i) h.fail("p", "tcp");
  c.now += 29s;
  EXPECT_EQ(h.state("p", "tcp"), Health::State::QUARANTINED);
  c.now += 1s;
  EXPECT_EQ(h.state("p", "tcp"), Health::State::PROBING);
  EXPECT_TRUE(h.fail("p", "tcp")) << "a failed probe quarantines again";
  EXPECT_EQ(h.quarantined_until("p", "tcp") - c.now, 60s) << "period doubled";
  c.now += 60s;
  EXPECT_TRUE(h.fail("p", "tcp"));
  EXPECT_EQ(h.quarantined_until("p", "tcp") - c.now, 100s) << "capped at max";
  c.now += 100s;
  EXPECT_TRUE(h.succeed("p", "tcp"));
  EXPECT_EQ(h.state("p", "tcp"), Health::State::HEALTHY);
  for (int i = 0; i < 3; ++i) h.fail("p", "tcp");
  EXPECT_EQ(h.quarantined_until("p", "tcp") - c.now, 30s) << "recovery resets the period";
}
