// SPDX-License-Identifier: Apache-2.0
#include "inbound_table.h"

#include <gtest/gtest.h>

#include <thread>

using namespace ferry;
using namespace std::chrono_literals;

TEST(InboundTable, ExactlyOncePerInitiatorAndUid) {
  InboundTable t;
  EXPECT_TRUE(t.land("a", 1, StatusCode::SUCCESS));
  EXPECT_FALSE(t.land("a", 1, StatusCode::SUCCESS)) << "a retried transfer lands twice";
  EXPECT_TRUE(t.land("b", 1, StatusCode::SUCCESS)) << "uids are per initiator";
  ASSERT_TRUE(t.pop("a", 1));
  EXPECT_FALSE(t.pop("a", 1));
  EXPECT_FALSE(t.land("a", 1, StatusCode::SUCCESS)) << "still a repeat after the pop";
  EXPECT_FALSE(t.pop("a", 1));
}

TEST(InboundTable, MemoryIsBounded) {
  InboundTable t;
  for (uint64_t u = 0; u < InboundTable::kRememberPerPeer + 1000; ++u) {
    t.land("a", u, StatusCode::SUCCESS);
    t.pop("a", u);
  }
  EXPECT_EQ(t.pending(), 0u);
  // The oldest uids were forgotten, the recent ones are still remembered.
  EXPECT_TRUE(t.land("a", 0, StatusCode::SUCCESS));
  EXPECT_FALSE(t.land("a", InboundTable::kRememberPerPeer + 999, StatusCode::SUCCESS));
}

TEST(InboundTable, WaitPopWakesWhenTheTransferLands) {
  InboundTable t;
  std::thread lander([&] { t.land("a", 9, StatusCode::SUCCESS); });
  auto s = t.wait_pop("a", 9, 10s);
  lander.join();
  ASSERT_TRUE(s);
  EXPECT_EQ(s->Code(), StatusCode::SUCCESS);
  EXPECT_FALSE(t.wait_pop("a", 10, 1ms));
}

namespace {
// A clock the test moves by hand.
struct FakeClock {
  InboundTable::Clock::time_point now = InboundTable::Clock::time_point(std::chrono::hours(1));
  std::function<InboundTable::Clock::time_point()> fn() {
    return [this] { return now; };
  }
};
}  // namespace

TEST(InboundTable, UnpoppedRecordsStopAtTheCapOldestFirst) {
  InboundTable t({/*max_per_peer=*/100, /*max_age=*/0ms, /*max_peers=*/16});
  for (uint64_t u = 1; u <= 1000; ++u) t.land("a", u, StatusCode::SUCCESS);
  EXPECT_EQ(t.pending(), 100u);
  EXPECT_EQ(t.dropped(), 900u);
  EXPECT_FALSE(t.pop("a", 900)) << "an old record outlived the cap";
  EXPECT_TRUE(t.pop("a", 901));
  EXPECT_TRUE(t.pop("a", 1000));
  // Dropped records still count as seen while the repeat window remembers them.
  EXPECT_FALSE(t.land("a", 5, StatusCode::SUCCESS));
}

TEST(InboundTable, RecordsOlderThanTheAgeLimitAreDropped) {
  FakeClock clock;
  InboundTable t({/*max_per_peer=*/0, /*max_age=*/1000ms, /*max_peers=*/16}, clock.fn());
  t.land("a", 1, StatusCode::SUCCESS);
  clock.now += 600ms;
  t.land("a", 2, StatusCode::SUCCESS);
  clock.now += 600ms;  // 1 is 1.2 s old, 2 is 0.6 s
  EXPECT_FALSE(t.pop("a", 1)) << "a record past its age was handed out";
  EXPECT_TRUE(t.pop("a", 2));
  EXPECT_EQ(t.dropped(), 1u);
}

TEST(InboundTable, InitiatorsAreCappedLeastRecentFirst) {
  FakeClock clock;
  InboundTable t({/*max_per_peer=*/0, /*max_age=*/0ms, /*max_peers=*/3}, clock.fn());
  for (const char* p : {"a", "b", "c"}) {
    t.land(p, 1, StatusCode::SUCCESS);
    clock.now += 1ms;
  }
  t.land("a", 2, StatusCode::SUCCESS);  // a is now the most recent
  clock.now += 1ms;
  t.land("d", 1, StatusCode::SUCCESS);  // b (least recent) makes room
  EXPECT_FALSE(t.pop("b", 1));
  EXPECT_TRUE(t.pop("a", 1));
  EXPECT_TRUE(t.pop("c", 1));
  EXPECT_TRUE(t.pop("d", 1));
  EXPECT_EQ(t.dropped(), 1u);
}

TEST(InboundTable, AFloodOfNeverPoppedUidsStaysBounded) {
  // What a peer forging NOTIFYs with random uids, or an application that never
  // pops, does to the table: it holds at most the cap, and after the flood the
  // uids it remembers are bounded by the repeat window plus the cap.
  InboundTable t({/*max_per_peer=*/1000, /*max_age=*/0ms, /*max_peers=*/16});
  uint64_t x = 88172645463325252ull;
  for (int i = 0; i < 300000; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    t.land("flood", x, StatusCode::SUCCESS);
  }
  EXPECT_EQ(t.pending(), 1000u);
  EXPECT_EQ(t.dropped(), 299000u);
  const size_t window = InboundTable::kRememberPerPeer;
  EXPECT_LE(t.footprint(), 2 * window + 6 * 1000 + 64);
  // One old unpopped record at the front does not keep every later popped one.
  InboundTable u({/*max_per_peer=*/0, /*max_age=*/0ms, /*max_peers=*/16});
  u.land("a", 0, StatusCode::SUCCESS);
  for (uint64_t k = 1; k < 200000; ++k) {
    u.land("a", k, StatusCode::SUCCESS);
    ASSERT_TRUE(u.pop("a", k));
  }
  EXPECT_EQ(u.pending(), 1u);
  EXPECT_LE(u.footprint(), 2 * window + 200) << "popped records' places were kept";
  EXPECT_TRUE(u.pop("a", 0));
}

// A core NOTIFY whose answer was lost is sent again once its connection is
// made again; meanwhile the initiator's other transfers (a backend's own
// notifications) may land past the uid window. Its place in the sender's
// sequence still marks it a repeat: the application, which popped it, does
// not see it land a second time.
TEST(InboundTable, ANotifySentAgainAfterMoreThanTheUidWindowIsARepeat) {
  InboundTable t;
  const NotifySeq first{0xa11fe, 7, 7};
  ASSERT_TRUE(t.land("a", 1, StatusCode::SUCCESS, &first));
  ASSERT_TRUE(t.pop("a", 1));
  ASSERT_TRUE(t.land("a", 2, StatusCode::SUCCESS));  // a probe of the uid window
  for (uint64_t u = 3; u < InboundTable::kRememberPerPeer + 100; ++u) {
    ASSERT_TRUE(t.land("a", u, StatusCode::SUCCESS));
    t.pop("a", u);
  }
  t.pop("a", 2);
  ASSERT_TRUE(t.land("a", 2, StatusCode::SUCCESS)) << "the uid window still holds its first uids";
  EXPECT_FALSE(t.land("a", 1, StatusCode::SUCCESS, &first)) << "the resend landed again";
  EXPECT_FALSE(t.pop("a", 1));
  // Its next NOTIFY is new, though its uid is as old.
  const NotifySeq next{0xa11fe, 8, 7};
  EXPECT_TRUE(t.land("a", 1, StatusCode::SUCCESS, &next));
}

// Below the sender's floor: answered already, or given up by the sender (a
// NOTIFY left behind in a broken connection's buffer, read after newer ones).
// (Its uid is one the table never saw: the seq alone decides.) Another life of
// the sender starts its own sequence.
TEST(InboundTable, ANotifyBelowItsSendersFloorIsARepeatAndANewLifeStartsOver) {
  InboundTable t;
  const NotifySeq five{1, 5, 5}, nine{1, 9, 9}, late_three{1, 3, 3};
  ASSERT_TRUE(t.land("a", 50, StatusCode::SUCCESS, &five));
  ASSERT_TRUE(t.land("a", 90, StatusCode::SUCCESS, &nine));
  EXPECT_FALSE(t.land("a", 30, StatusCode::SUCCESS, &late_three));
  EXPECT_FALSE(t.pop("a", 30));
  // Taken above the floor: a repeat by its seq, whatever uid it names.
  EXPECT_FALSE(t.land("a", 91, StatusCode::SUCCESS, &nine));
  // A restarted initiator numbers from 1 again: none of it is a repeat.
  const NotifySeq reborn{2, 1, 1};
  EXPECT_TRUE(t.land("a", 51, StatusCode::SUCCESS, &reborn));
  // Not sequenced (a plugin's own report): the uid window alone.
  EXPECT_TRUE(t.land("a", 52, StatusCode::SUCCESS));
  EXPECT_FALSE(t.land("a", 52, StatusCode::SUCCESS));
}

// A sender that never raises its floor (hostile, or not a ferry core) cannot
// make the table keep every seq it sent.
TEST(InboundTable, TheSeqsKeptPerSenderAreBounded) {
  InboundTable t;
  for (uint64_t s = 1; s <= 3 * InboundTable::kMaxNotifySeqs; ++s) {
    const NotifySeq q{1, s, 0};
    t.land("a", 1, StatusCode::SUCCESS, &q);  // one uid: only the seqs grow
    t.pop("a", 1);
  }
  EXPECT_LE(t.footprint(), InboundTable::kMaxNotifySeqs + 8);
}
