// SPDX-License-Identifier: Apache-2.0
// TransferStatus::Cancel() against a target in its own process (ferry-test-peer
// over tcp). The target is stopped (SIGSTOP) so a large WRITE is surely in
// flight; the cancel fences it at the target, which answers once resumed: the
// transfer ends ERR_CANCELLED, and no byte of it lands afterwards (a later
// transfer to the target completes and the cancelled range is unchanged).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <sstream>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kRegion = 96u << 20, kBig = 64u << 20, kAfterOff = 80u << 20;

struct Rig {
  Rig() : child({FERRY_TEST_PEER, "target", "tcp", std::to_string(kRegion), "30000"}) {
    std::istringstream in(child.read_line(60000));
    std::string word, ehex, mhex;
    in >> word >> ehex >> mhex;
    if (word != "READY") throw std::runtime_error("target did not start");
    EngineConfig cfg;
    cfg.timeout = 30s;
    ini = std::make_unique<Engine>("initiator", cfg);
    if (Result r = ini->add_backend("tcp"); !r) throw std::runtime_error(r.message);
    ini->register_remote_engine(EngineDesc::unpack(test::from_hex(ehex)));
    remote = MemoryDesc::unpack(test::from_hex(mhex));
    src.resize(kRegion);
    test::fill_pattern(src.data(), 0, kRegion, 99);
    local = ini->register_memory(src.data(), src.size());
    local2 = ini->register_memory(src2.data(), src2.size());
  }
  void stop() {
    ASSERT_EQ(::kill(child.pid(), SIGSTOP), 0);
    int st = 0;
    ASSERT_EQ(::waitpid(child.pid(), &st, WUNTRACED), child.pid());
  }
  void resume() { ASSERT_EQ(::kill(child.pid(), SIGCONT), 0); }
  std::string hash(size_t off, size_t len) {
    return child.ask("hash 1 " + std::to_string(off) + " " + std::to_string(len), 60000);
  }
  // A later transfer that completes: whatever the cancelled one could still do, it did.
  void transfer_after() {
    auto st = ini->write(local, 0, remote, kAfterOff, 4096, 7, false);
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  }

  test::ChildProcess child;
  std::vector<uint8_t> src, src2 = std::vector<uint8_t>(kBig, 0x5a);
  std::unique_ptr<Engine> ini;
  MemoryDesc local, local2, remote;
};

}  // namespace

TEST(CancelProcess, CancellingAnEndedTransferIsANoOpThatSaysSo) {
  Rig rig;
  auto st = rig.ini->write(rig.local, 0, rig.remote, 0, 4096, 1, false);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  std::string why;
  EXPECT_FALSE(st.Cancel(&why));
  EXPECT_NE(why.find("already ended (SUCCESS)"), std::string::npos) << why;
  EXPECT_EQ(st.Code(), StatusCode::SUCCESS);
  TransferStatus mine;  // not a transfer's
  mine.SetInProgress();
  EXPECT_FALSE(mine.Cancel(&why));
  EXPECT_NE(why.find("cannot be cancelled"), std::string::npos) << why;
}

TEST(CancelProcess, AWriteInFlightIsFencedAndNothingLandsAfter) {
  Rig rig;
  ASSERT_EQ(rig.child.ask("fill 0"), "OK");
  rig.stop();
  auto st = rig.ini->write(rig.local, 0, rig.remote, 0, kBig, 2, false);
  ASSERT_FALSE(st.WaitFor(200ms)) << "a stopped target cannot have taken 64 MiB: " << st.Message();
  std::string why;
  ASSERT_TRUE(st.Cancel(&why)) << why;
  EXPECT_TRUE(st.Cancel(&why)) << "asked twice: still true, says so";
  EXPECT_NE(why.find("already asked"), std::string::npos) << why;
  EXPECT_TRUE(st.InProgress()) << "not ended before the target answered the fence";
  rig.resume();
  ASSERT_TRUE(st.WaitFor(40s));
  EXPECT_EQ(st.Code(), StatusCode::ERR_CANCELLED) << st.Message();
  EXPECT_NE(st.Message().find("bytes had landed"), std::string::npos) << st.Message();
  const std::string at_end = rig.hash(0, kBig);
  rig.transfer_after();
  EXPECT_EQ(rig.hash(0, kBig), at_end) << "bytes of the cancelled WRITE landed after it ended";
  // And the peer is usable at once: the fence was answered, the gate is open.
  auto again = rig.ini->write(rig.local, 0, rig.remote, 0, kBig, 3, false);
  ASSERT_EQ(again.Wait(), StatusCode::SUCCESS) << again.Message();
  EXPECT_EQ(rig.hash(0, kBig), "HASH " + std::to_string(test::fnv1a(rig.src.data(), kBig)));
}

TEST(CancelProcess, CancellingAMultiRegionTransferCancelsEveryPart) {
  Rig rig;
  rig.stop();
  std::vector<TransferItem> items{{0, 0, 0, 0, kBig / 2}, {1, 0, 0, kBig / 2, kBig / 2}};
  auto st =
      rig.ini->transfer(Op::WRITE, {rig.local, rig.local2}, {rig.remote}, items, 4, true, "never");
  ASSERT_FALSE(st.WaitFor(200ms));
  ASSERT_TRUE(st.Cancel());
  rig.resume();
  ASSERT_TRUE(st.WaitFor(40s));
  EXPECT_EQ(st.Code(), StatusCode::ERR_CANCELLED) << st.Message();
  const std::string at_end = rig.hash(0, kBig);
  rig.transfer_after();
  EXPECT_EQ(rig.hash(0, kBig), at_end);
  EXPECT_EQ(rig.child.ask("pop initiator 4 200"), "NONE") << "a cancelled call notifies nobody";
  EXPECT_EQ(rig.child.ask("notifs 200"), "NOTIFS 0");
}

// A transfer held behind a fence (the peer is being fenced: a cancelled WRITE
// to it, the target stopped) is cancelled at once - nothing of it started -
// instead of waiting for the stopped target's answer.
TEST(CancelProcess, ATransferHeldBehindAFenceEndsAtOnceWhenCancelled) {
  Rig rig;
  ASSERT_EQ(rig.child.ask("fill 0"), "OK");
  const std::string before = rig.hash(kAfterOff, 4096);
  rig.stop();
  auto big = rig.ini->write(rig.local, 0, rig.remote, 0, kBig, 4, false);
  ASSERT_FALSE(big.WaitFor(200ms)) << big.Message();
  ASSERT_TRUE(big.Cancel());  // its fence goes to the stopped target and waits there
  auto held = rig.ini->write(rig.local2, 0, rig.remote, kAfterOff, 4096, 5, false);
  ASSERT_FALSE(held.WaitFor(200ms)) << "not held behind the fence: " << held.Message();
  std::string why;
  ASSERT_TRUE(held.Cancel(&why)) << why;
  ASSERT_TRUE(held.WaitFor(5s)) << "a held transfer waited for the fence to end its cancel";
  EXPECT_EQ(held.Code(), StatusCode::ERR_CANCELLED) << held.Message();
  EXPECT_NE(held.Message().find("waiting for peer"), std::string::npos) << held.Message();
  EXPECT_TRUE(big.InProgress()) << "the fence is still unanswered";
  rig.resume();
  ASSERT_TRUE(big.WaitFor(40s));
  EXPECT_EQ(big.Code(), StatusCode::ERR_CANCELLED) << big.Message();
  rig.transfer_after();  // writes kAfterOff too, from local
  // The held one never started: its 0x5a bytes are nowhere at the target.
  EXPECT_NE(rig.hash(kAfterOff, 4096), before) << "transfer_after did not land";
  EXPECT_EQ(rig.hash(kAfterOff, 4096), "HASH " + std::to_string(test::fnv1a(rig.src.data(), 4096)));
}
