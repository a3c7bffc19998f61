// SPDX-License-Identifier: Apache-2.0
// The target's notification inbox: exactly once per (sender life, id), fences
// that decide an id for good, bounds that refuse rather than drop, and the fd
// an event loop polls.
#include "notif_inbox.h"

#include <gtest/gtest.h>
#include <poll.h>

#include <thread>

using namespace ferry;
using namespace std::chrono_literals;

namespace {

MsgAck put(NotifInbox& box, const std::string& from, uint64_t inst, uint64_t id,
           const std::string& m) {
  return box.deliver(from, inst, id, reinterpret_cast<const uint8_t*>(m.data()), m.size());
}

bool readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

}  // namespace

TEST(NotifInbox, ResendOfTheLastIdIsTakenOnce) {
  NotifInbox box;
  EXPECT_EQ(put(box, "a", 7, 1, "one"), MsgAck::TAKEN);
  EXPECT_EQ(put(box, "a", 7, 1, "one"), MsgAck::TAKEN) << "a resend gets the same answer";
  EXPECT_EQ(put(box, "a", 7, 2, "two"), MsgAck::TAKEN);
  EXPECT_EQ(put(box, "a", 7, 1, "one"), MsgAck::STALE) << "below a later decision";
  auto got = box.drain();
  ASSERT_EQ(got["a"], (std::vector<std::string>{"one", "two"}));
  EXPECT_EQ(box.counts().received, 2u);
  EXPECT_TRUE(box.drain().empty());
}

TEST(NotifInbox, FenceDecidesAnIdForGood) {
  NotifInbox box;
  EXPECT_EQ(box.fence("a", 7, 1), FenceState::NONE);
  EXPECT_EQ(put(box, "a", 7, 1, "late"), MsgAck::FENCED) << "fenced first: never taken";
  EXPECT_EQ(put(box, "a", 7, 2, "next"), MsgAck::TAKEN);
  EXPECT_EQ(box.fence("a", 7, 2), FenceState::WHOLE) << "taken before the fence";
  EXPECT_EQ(box.fence("a", 7, 1), FenceState::NONE);
  EXPECT_EQ(box.drain()["a"], std::vector<std::string>{"next"});
}

TEST(NotifInbox, ANewLifeOfTheSenderNumbersAfresh) {
  NotifInbox box;
  EXPECT_EQ(put(box, "a", 7, 5, "old life"), MsgAck::TAKEN);
  EXPECT_EQ(put(box, "a", 8, 1, "new life"), MsgAck::TAKEN);
  EXPECT_EQ(box.drain()["a"], (std::vector<std::string>{"old life", "new life"}));
}

TEST(NotifInbox, OverABoundIsRefusedNotDropped) {
  constexpr size_t c = NotifInbox::kPerMessageCost;  // what a message costs beyond its payload
  NotifLimits lim;
  lim.max_messages = 3;
  lim.max_bytes = 3 * (1 + c);                      // three 1-byte messages
  lim.max_total_bytes = 2 * lim.max_bytes + 1 + c;  // two senders' worth, and one byte more
  NotifInbox box(lim);
  for (uint64_t id = 1; id <= 3; ++id) EXPECT_EQ(put(box, "a", 1, id, "x"), MsgAck::TAKEN);
  EXPECT_EQ(put(box, "a", 1, 4, "x"), MsgAck::FULL) << "4th message from one sender";
  EXPECT_EQ(put(box, "a", 1, 4, "x"), MsgAck::FULL) << "its resend: the same answer";
  EXPECT_EQ(put(box, "b", 1, 1, std::string(lim.max_bytes - c + 1, 'y')), MsgAck::FULL)
      << "over the per-sender bytes";
  EXPECT_EQ(put(box, "b", 1, 2, std::string(lim.max_bytes - c, 'y')), MsgAck::TAKEN);
  EXPECT_EQ(put(box, "c", 1, 1, std::string(2, 'z')), MsgAck::FULL) << "over the total bytes";
  EXPECT_EQ(box.counts().refused, 3u);
  auto got = box.drain();
  EXPECT_EQ(got["a"].size(), 3u);
  EXPECT_EQ(got["b"].size(), 1u);
  EXPECT_EQ(put(box, "a", 1, 5, "x"), MsgAck::TAKEN) << "room again once drained";
}

TEST(NotifInbox, EmptyMessagesAreNotFree) {
  NotifLimits lim;
  lim.max_bytes = 100 * NotifInbox::kPerMessageCost;
  NotifInbox box(lim);
  uint64_t taken = 0;
  for (uint64_t id = 1; id <= 1000; ++id) taken += put(box, "a", 1, id, "") == MsgAck::TAKEN;
  EXPECT_EQ(taken, 100u) << "the per-sender bound counts every message, empty ones too";
}

TEST(NotifInbox, FdIsReadableExactlyWhileSomethingIsUnread) {
  NotifInbox box;
  EXPECT_FALSE(readable(box.fd()));
  put(box, "a", 1, 1, "m");
  put(box, "a", 1, 2, "m");
  EXPECT_TRUE(readable(box.fd()));
  box.drain();
  EXPECT_FALSE(readable(box.fd()));
  put(box, "b", 1, 1, "m");
  EXPECT_TRUE(readable(box.fd()));
}

TEST(NotifInbox, WaitDrainWakesOnArrivalAndTimesOut) {
  NotifInbox box;
  EXPECT_TRUE(box.wait_drain(20ms).empty());
  std::thread t([&] { put(box, "a", 1, 1, "hello"); });
  auto got = box.wait_drain(std::chrono::milliseconds::max());
  t.join();
  EXPECT_EQ(got["a"], std::vector<std::string>{"hello"});
}

TEST(NotifInbox, DecisionsAreKeptForABoundedNumberOfSenders) {
  NotifLimits lim;
  lim.max_senders = 4;
  NotifInbox box(lim);
  for (int i = 0; i < 100; ++i) put(box, "s" + std::to_string(i), 1, 1, "m");
  auto got = box.drain();
  EXPECT_EQ(got.size(), 100u) << "unread messages are never evicted";
  for (int i = 100; i < 200; ++i) {
    put(box, "s" + std::to_string(i), 1, 1, "");
    box.drain();
  }
  EXPECT_EQ(box.footprint(), 4u) << "decisions of drained senders are evicted, oldest first";
}
