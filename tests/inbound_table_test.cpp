#include <gtest/gtest.h>

#include <thread>

#include "inbound_table.h"

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
