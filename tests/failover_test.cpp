// SPDX-License-Identifier: Apache-2.0
// Failover: a transfer that fails on one backend, at submit or at completion,
// or that never completes, is re-run whole on the next backend of the policy;
// the data arrives intact, the target hears of it once, the stats show it.
// The broken backend is tests/plugins/fault_plugin.cpp; the good one is tcp.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "child_process.h"
#include "eventually.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "host_link.h"
#include "pattern.h"
#include "stats_server.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kBytes = 1 << 20;

std::string write_policy(const std::string& body) {
  static int n = 0;
  auto path = std::filesystem::temp_directory_path() /
              ("ferry-failover-" + std::to_string(getpid()) + "-" + std::to_string(n++) + ".yaml");
  std::ofstream(path) << body;
  return path.string();
}

std::string policy(int after_failures = 100, int max_attempts = 3) {
  return "backends:\n  fault: {}\n"
         "rules:\n  - prefer: [fault, tcp]\n"
         "failover:\n  max_attempts: " +
         std::to_string(max_attempts) +
         "\n  quarantine: { after_failures: " + std::to_string(after_failures) +
         ", within: 60s, for: 60s }\n"
         "timeout: 1s\n";
}

// Two engines in this process: `ini` writes/reads `tgt`'s memory.
struct Rig {
  // extra: more settings for the fault backend (JSON members, each after a comma).
  explicit Rig(const std::string& fault_mode, const std::string& policy_text = policy(),
               const std::string& extra = "") {
    setenv("FERRY_PLUGIN_PATH",
           (std::string(FERRY_TEST_PLUGIN_DIR) + ":" + FERRY_PLUGIN_BUILD_DIR).c_str(), 1);
    policy_path = write_policy(policy_text);
    EngineConfig cfg;
    cfg.policy_file = policy_path;
    ini = std::make_unique<Engine>("ini", cfg);
    tgt = std::make_unique<Engine>("tgt", cfg);
    std::string settings = "{\"mode\":\"" + fault_mode + "\",\"n\":2" + extra + "}";
    for (Engine* e : {ini.get(), tgt.get()}) {
      Result r1 = e->add_backend("fault", settings);
      Result r2 = e->add_backend("tcp");
      if (!r1 || !r2) throw std::runtime_error(r1.message + " / " + r2.message);
    }
    ini->register_remote_engine(tgt->desc());
    tgt->register_remote_engine(ini->desc());
    src.resize(kBytes);
    dst.resize(kBytes);
    lmem = ini->register_memory(src.data(), src.size());
    rmem = tgt->register_memory(dst.data(), dst.size());
  }
  ~Rig() { std::filesystem::remove(policy_path); }

  // One transfer with fresh data, verified, and the target's inbound status checked once.
  TransferStatus run(Op op, uint64_t seed) {
    std::vector<uint8_t>& from = op == Op::WRITE ? src : dst;
    std::vector<uint8_t>& to = op == Op::WRITE ? dst : src;
    test::fill_pattern(from.data(), 0, kBytes, seed);
    std::fill(to.begin(), to.end(), 0);
    TransferUid uid = ini->allocate_transfer_uid();
    TransferStatus st = op == Op::WRITE ? ini->write(lmem, 0, rmem, 0, kBytes, uid)
                                        : ini->read(lmem, 0, rmem, 0, kBytes, uid);
    EXPECT_TRUE(st.WaitFor(20s));
    if (st.Succeeded()) {
      EXPECT_EQ(test::find_mismatch(to.data(), 0, kBytes, seed, 0), -1) << "data corrupted";
      auto landed = tgt->wait_inbound_transfer_status("ini", uid, 5s);
      EXPECT_TRUE(landed.has_value()) << "target never heard of the transfer";
      EXPECT_FALSE(tgt->wait_inbound_transfer_status("ini", uid, 200ms).has_value())
          << "target heard of the transfer twice";
    }
    return st;
  }

  BackendStats stats(const std::string& b) { return ini->stats().backends[b]; }

  std::string policy_path;
  std::vector<uint8_t> src, dst;  // before the engines: it outlives their threads
  std::unique_ptr<Engine> ini, tgt;
  MemoryDesc lmem, rmem;
};

class FailoverByMode : public testing::TestWithParam<std::string> {};

TEST_P(FailoverByMode, WriteAndReadCompleteOnTheNextBackend) {
  Rig rig(GetParam());
  for (Op op : {Op::WRITE, Op::READ}) {
    TransferStatus st = rig.run(op, op == Op::WRITE ? 11 : 12);
    ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
    EXPECT_NE(st.Message().find("fault"), std::string::npos)
        << "a success after failover says what failed first: " << st.Message();
  }
  EXPECT_EQ(rig.stats("fault").failures, 2u);
  EXPECT_EQ(rig.stats("fault").failovers, 2u);
  EXPECT_EQ(rig.stats("fault").transfers, 0u);
  EXPECT_EQ(rig.stats("tcp").transfers, 2u);
  EXPECT_EQ(rig.stats("tcp").bytes, 2u * kBytes);
}

// A message attached to a transfer goes once its data has landed, whatever
// attempts the data took: the target gets it exactly once, after the data.
TEST_P(FailoverByMode, AttachedMessageIsDeliveredOnceAfterFailover) {
  Rig rig(GetParam());
  for (Op op : {Op::WRITE, Op::READ}) {
    std::vector<uint8_t>& from = op == Op::WRITE ? rig.src : rig.dst;
    std::vector<uint8_t>& to = op == Op::WRITE ? rig.dst : rig.src;
    test::fill_pattern(from.data(), 0, kBytes, 90 + static_cast<int>(op));
    std::fill(to.begin(), to.end(), 0);
    const std::string msg = op == Op::WRITE ? "write done" : "read done";
    TransferStatus st = op == Op::WRITE
                            ? rig.ini->write(rig.lmem, 0, rig.rmem, 0, kBytes, 1, false, msg)
                            : rig.ini->read(rig.lmem, 0, rig.rmem, 0, kBytes, 2, false, msg);
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    EXPECT_EQ(test::find_mismatch(to.data(), 0, kBytes, 90 + static_cast<int>(op), 0), -1);
    auto got = rig.tgt->wait_notifications(5s);
    EXPECT_EQ(got["ini"], std::vector<std::string>{msg});
    EXPECT_TRUE(rig.tgt->wait_notifications(200ms).empty()) << "delivered twice";
  }
  EXPECT_EQ(rig.tgt->stats().notifications_received, 2u);
}

INSTANTIATE_TEST_SUITE_P(Faults, FailoverByMode,
                         testing::Values("fail_submit", "fail_complete", "drop",
                                         "notify_then_fail"));

// A backend that never completes may still be copying: the core cannot fail the
// transfer over (the old copy could land over the new one) nor call it failed.
// It ends ERR_OUTCOME_UNKNOWN by its deadline, the peer is fenced (the next
// transfer fails at once, saying why), and the gate opens again only when the
// plugin finally reports the attempt over (here: its fini completes it).
TEST(Failover, HungAttemptEndsUnknownAndFencesThePeerUntilItEnds) {
  Rig rig("hang");
  test::fill_pattern(rig.src.data(), 0, kBytes, 21);
  const auto t0 = std::chrono::steady_clock::now();
  TransferStatus st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, kBytes, 1);
  ASSERT_TRUE(st.WaitFor(5s));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(st.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << st.Message();
  EXPECT_LE(took, 1s + 100ms) << "must end by the 1 s deadline (+100 ms)";
  EXPECT_NE(st.Message().find("fault"), std::string::npos) << st.Message();
  EXPECT_EQ(rig.stats("fault").failovers, 0u)
      << "an attempt that may still land is not failed over";
  EXPECT_EQ(rig.stats("tcp").transfers, 0u);

  const auto t1 = std::chrono::steady_clock::now();
  TransferStatus next = rig.ini->write(rig.lmem, 0, rig.rmem, 0, kBytes, 2);
  ASSERT_TRUE(next.WaitFor(5s));
  EXPECT_LT(std::chrono::steady_clock::now() - t1, 100ms) << "a fenced peer refuses at once";
  EXPECT_EQ(next.Code(), StatusCode::ERR_BAD_STATE) << next.Message();
  EXPECT_NE(next.Message().find("fenced"), std::string::npos) << next.Message();

  // The hung copy ends (fini completes it): the gate opens; tcp carries the next one.
  ASSERT_TRUE(rig.ini->remove_backend("fault").ok());
  TransferStatus after = rig.run(Op::WRITE, 22);
  EXPECT_EQ(after.Code(), StatusCode::SUCCESS) << after.Message();
}

// post() blocked in the plugin past the attempt's watchdog time: the watchdog
// ends the transfer (unknown) and fences the peer. Then post() refuses - it
// started nothing - so the gate opens again, and nothing else is tried for
// the transfer that already ended.
TEST(Failover, APostRefusedAfterTheWatchdogEndedItReopensThePeer) {
  int gate[2];
  ASSERT_EQ(::pipe(gate), 0);
  Rig rig("refuse_late", policy(), ",\"gate_fd\":" + std::to_string(gate[0]));
  test::fill_pattern(rig.src.data(), 0, kBytes, 31);
  std::atomic<bool> returned{false};
  TransferStatus st;
  std::thread poster([&] {
    st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, kBytes, 1);
    returned = true;
  });
  using test::eventually;
  // The watchdog ended the attempt while its post() is still in the plugin.
  const bool fenced = eventually([&] { return rig.ini->stats().fenced_peers != 0; });
  EXPECT_TRUE(fenced) << "the watchdog never ended the attempt";
  EXPECT_FALSE(returned.load());
  ASSERT_EQ(::write(gate[1], "x", 1), 1);  // now post() refuses
  poster.join();
  ::close(gate[0]);
  ::close(gate[1]);
  ASSERT_TRUE(st.WaitFor(5s));
  EXPECT_EQ(st.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << st.Message();
  EXPECT_TRUE(eventually([&] { return rig.ini->stats().fenced_peers == 0; }))
      << "the peer stays fenced after a refused post()";
  EXPECT_EQ(rig.stats("tcp").transfers, 0u) << "a transfer the watchdog ended was tried again";
}

TEST(Failover, HealthyBackendIsUsedFirstAndNotifiesOnce) {
  Rig rig("ok");
  TransferStatus st = rig.run(Op::WRITE, 5);
  ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(rig.stats("fault").transfers, 1u);
  EXPECT_EQ(rig.stats("tcp").transfers, 0u);
}

// A plugin that reports one transfer twice breaks the ABI; while the attempt
// is alive (here: inside post()) the core keeps the first report and ignores
// the second - no second ending, no failover, no crash.
TEST(Failover, ASecondCompletionOfOneTransferIsIgnored) {
  Rig rig("complete_twice");
  for (uint64_t i = 0; i < 3; ++i) {
    TransferStatus st = rig.run(Op::WRITE, 40 + i);
    ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
    EXPECT_EQ(st.Message(), "") << "the second report reached the transfer";
  }
  EXPECT_EQ(rig.stats("fault").transfers, 3u);
  EXPECT_EQ(rig.stats("fault").failures, 0u);
  EXPECT_EQ(rig.stats("fault").stray_completions, 3u);
  EXPECT_EQ(rig.stats("tcp").transfers, 0u);
}

// The second completion comes long after the transfer ended and its attempt
// was freed (at the plugin's fini): ignored and counted, touching nothing of
// the ended transfer (it used to read the freed attempt: ASan saw it).
TEST(Failover, ACompletionLongAfterTheTransferEndedIsIgnored) {
  Rig rig("complete_again_at_fini");
  for (uint64_t i = 0; i < 3; ++i) {
    TransferStatus st = rig.run(Op::WRITE, 50 + i);
    ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
  }
  ASSERT_TRUE(rig.ini->remove_backend("fault").ok());  // fini: the three late reports
  EXPECT_EQ(rig.stats("fault").stray_completions, 3u);
  EXPECT_EQ(rig.stats("fault").failures, 0u);
}

// The plugin thread's two pipes (a gate it waits on, and where it reports)
// and the settings that name them, for the fault modes that leave a thread.
struct LatePipes {
  int gate[2] = {-1, -1}, done[2] = {-1, -1};
  LatePipes() {
    if (::pipe(gate) != 0 || ::pipe(done) != 0) throw std::runtime_error("pipe failed");
  }
  ~LatePipes() {
    for (int fd : {gate[0], gate[1], done[0], done[1]}) ::close(fd);
  }
  std::string settings() const {
    return ",\"gate_fd\":" + std::to_string(gate[0]) + ",\"done_fd\":" + std::to_string(done[1]);
  }
  // Reads the thread's report (blocks until it comes): false on EOF or error.
  bool report(void* into, size_t len) const {
    size_t got = 0;
    while (got < len) {
      const ssize_t n = ::read(done[0], static_cast<char*>(into) + got, len - got);
      if (n <= 0) return false;
      got += static_cast<size_t>(n);
    }
    return true;
  }
};

// plugin.h forbids calls into the host after fini() returned, yet a thread a
// plugin's fini leaves running makes them. Here they come after both engines
// are gone: each finds no backend and is ignored (complete, inbound, log) or
// refused with FERRY_ERR_BAD_STATE (ctrl_send, ctrl_try_send, auth_sign). The
// host table used to live in the backend: such calls read freed memory and
// reached a destroyed engine (a segfault in this test).
// A plugin whose describe() and counters() write past the buffer they are
// given (plugin.h forbids it) overwrote the core's stack in stats() (the
// 4096-byte buffer was on it): this test died with SIGSEGV. The overrun now
// lands in a guard after the buffer and the text is ignored; the backend
// still carries transfers.
TEST(ThirdPartyPlugin, TextWrittenPastItsBufferIsIgnoredNotACrash) {
  Rig rig("overrun");
  TransferStatus st = rig.run(Op::WRITE, 31);
  EXPECT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
  const BackendStats s = rig.stats("fault");
  EXPECT_NE(s.detail.find("describe() wrote past"), std::string::npos) << s.detail;
  EXPECT_NE(s.detail.find("counters() wrote past"), std::string::npos) << s.detail;
  EXPECT_TRUE(s.plugin.empty());
}

// An init that writes past its error buffer and reports success: not used.
TEST(ThirdPartyPlugin, AnInitThatWritesPastItsErrorBufferIsNotUsed) {
  setenv("FERRY_PLUGIN_PATH",
         (std::string(FERRY_TEST_PLUGIN_DIR) + ":" + FERRY_PLUGIN_BUILD_DIR).c_str(), 1);
  Engine e("e");
  Result r = e.add_backend("fault", R"({"mode":"init_overrun"})");
  EXPECT_FALSE(r);
  EXPECT_NE(r.message.find("wrote past the 512-byte error buffer"), std::string::npos) << r.message;
  EXPECT_EQ(e.stats().backends.count("fault"), 0u);
}

TEST(Failover, HostCallsAfterFiniFindNoEngineAndAreRefused) {
  // The plugin's late thread runs its code after the engines closed the
  // library: this handle keeps it mapped, and is never closed.
  ASSERT_NE(dlopen(FERRY_TEST_PLUGIN_DIR "/libferry-fault.so", RTLD_NOW), nullptr) << dlerror();
  LatePipes pipes;
  const uint64_t late_before = HostLink::late_calls();
  {
    Rig rig("call_after_fini", policy(), pipes.settings());
    for (uint64_t i = 0; i < 3; ++i) {
      TransferStatus st = rig.run(Op::WRITE, 60 + i);
      ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
    }
  }  // fini: the initiator's instance leaves its thread waiting on the gate
  ASSERT_EQ(::write(pipes.gate[1], "x", 1), 1);
  int rc[3] = {};
  ASSERT_TRUE(pipes.report(rc, sizeof rc)) << "the plugin's late thread never reported";
  EXPECT_EQ(rc[0], FERRY_ERR_BAD_STATE) << "ctrl_send after fini";
  EXPECT_EQ(rc[1], FERRY_ERR_BAD_STATE) << "ctrl_try_send after fini";
  EXPECT_EQ(rc[2], FERRY_ERR_BAD_STATE) << "auth_sign after fini";
  // Three completions, one inbound, one log line and the three calls above.
  EXPECT_EQ(HostLink::late_calls() - late_before, 8u);
}

// The same from a thread that calls the host all along: before the backend's
// removal, while its fini runs and after. A call in progress when fini returns
// is waited for before the backend is freed; later ones are refused. The
// sanitizer runs (ASan, TSan) check that no call reads freed memory.
TEST(Failover, HostCallsAcrossTheBackendsRemovalAreServedThenRefused) {
  ASSERT_NE(dlopen(FERRY_TEST_PLUGIN_DIR "/libferry-fault.so", RTLD_NOW), nullptr) << dlerror();
  LatePipes pipes;
  const uint64_t late_before = HostLink::late_calls();
  {
    Rig rig("chatter", policy(), pipes.settings());
    TransferStatus st = rig.run(Op::WRITE, 70);  // starts the thread
    ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
    ASSERT_EQ(::write(pipes.gate[1], "x", 1), 1);  // from here its calls are counted to a bound
    ASSERT_TRUE(rig.ini->remove_backend("fault").ok());
    uint64_t out[2] = {0, 0};  // calls, refused
    ASSERT_TRUE(pipes.report(out, sizeof out)) << "the plugin's thread never reported";
    EXPECT_EQ(out[1], 100u) << "calls after the removal were not refused (" << out[0] << " made)";
  }
  EXPECT_GE(HostLink::late_calls() - late_before, 100u);
}

TEST(Failover, FailFirstNThenRecover) {
  Rig rig("fail_first_n");
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(rig.run(Op::WRITE, 20 + i).Succeeded());
  EXPECT_EQ(rig.stats("fault").failures, 2u);
  EXPECT_EQ(rig.stats("fault").transfers, 2u) << "recovered after the first two";
  EXPECT_EQ(rig.stats("tcp").transfers, 2u);
}

TEST(Failover, QuarantinedBackendIsSkippedWithoutATry) {
  Rig rig("fail_complete", policy(/*after_failures=*/2));
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(rig.run(Op::WRITE, 30 + i).Succeeded());
  EXPECT_EQ(rig.stats("fault").failures, 2u) << "after quarantine the route skips it";
  EXPECT_EQ(rig.stats("fault").quarantines, 1u);
  EXPECT_EQ(rig.stats("tcp").transfers, 4u);
}

TEST(Failover, AttemptBudgetEndsWithEveryReason) {
  // Only one attempt allowed: the failure on fault is final and says why.
  Rig rig("fail_complete", policy(100, /*max_attempts=*/1));
  TransferStatus st = rig.run(Op::WRITE, 40);
  EXPECT_EQ(st.Code(), StatusCode::ERR_TRANSPORT);
  EXPECT_NE(st.Message().find("fault: fault: scripted completion failure"), std::string::npos)
      << st.Message();
}

TEST(Failover, APostRefusalSaysWhyInTheMessage) {
  // ABI 1.3: the reason a plugin gives when post() refuses reaches the message.
  Rig rig("fail_submit");
  test::fill_pattern(rig.src.data(), 0, kBytes, 78);
  auto st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, kBytes, rig.ini->allocate_transfer_uid());
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();  // tcp carried it
  EXPECT_NE(st.Message().find("fault: refused the transfer: transport error (fault: scripted "
                              "refusal in post())"),
            std::string::npos)
      << st.Message();
}

// The route cache is keyed by the policy's size bands: sizes on either side
// of a rule's bound, alternating on one region pair, each go where the policy
// says - never where a cached route of the other band went.
TEST(Routing, EachSizeTakesItsRulesBackendWhateverWasCachedBefore) {
  Rig rig("ok",
          "backends:\n  fault: {}\n"
          "rules:\n"
          "  - match: { min_bytes: 4KiB, max_bytes: 64KiB }\n    prefer: [fault]\n"
          "  - prefer: [tcp]\n"
          "timeout: 5s\n");
  struct Case {
    size_t bytes;
    const char* backend;
  };
  const Case cases[] = {{4096, "fault"},  {4095, "tcp"}, {65536, "fault"}, {65537, "tcp"},
                        {4096, "fault"},  {1, "tcp"},    {8192, "fault"},  {kBytes, "tcp"},
                        {65536, "fault"}, {4095, "tcp"}};
  uint64_t seed = 90;
  for (const Case& c : cases) {
    const auto before = rig.stats(c.backend).transfers;
    test::fill_pattern(rig.src.data(), 0, c.bytes, seed);
    auto st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, c.bytes, rig.ini->allocate_transfer_uid());
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    EXPECT_EQ(rig.stats(c.backend).transfers, before + 1)
        << c.bytes << " bytes should have gone over " << c.backend;
    EXPECT_EQ(test::find_mismatch(rig.dst.data(), 0, c.bytes, seed, 0), -1);
    ++seed;
  }
  EXPECT_EQ(rig.stats("fault").transfers + rig.stats("tcp").transfers, std::size(cases));
}

TEST(Failover, SessionsFailOverToo) {
  Rig rig("fail_submit");
  Result why;
  auto sess = rig.ini->create_session(rig.lmem, rig.rmem, &why);
  ASSERT_TRUE(sess) << why.message;
  test::fill_pattern(rig.src.data(), 0, kBytes, 77);
  auto st = sess->write(0, 0, kBytes, sess->allocate_transfer_uid());
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(test::find_mismatch(rig.dst.data(), 0, kBytes, 77, 0), -1);
  EXPECT_EQ(rig.stats("tcp").transfers, 1u);
}

// A session outlives its local region's deregistration: its posts are
// refused (ERR_NOT_FOUND, the application's mistake), never a backend's
// failure - they neither fail over nor count toward quarantine, so the peer
// stays reachable for every other transfer.
TEST(Refusals, PostsOnADeregisteredLocalRegionDoNotQuarantineTheBackend) {
  Rig rig("ok",
          "rules:\n  - prefer: [tcp]\n"
          "failover:\n  quarantine: { after_failures: 2, within: 60s, for: 60s }\n"
          "timeout: 5s\n");
  std::vector<uint8_t> buf(kBytes, 7);
  MemoryDesc m = rig.ini->register_memory(buf.data(), buf.size());
  Result why;
  auto sess = rig.ini->create_session(m, rig.rmem, &why);
  ASSERT_TRUE(sess) << why.message;
  ASSERT_TRUE(rig.ini->deregister_memory(m).ok());
  for (int i = 0; i < 5; ++i) {
    auto st = sess->write(0, 0, 4096, sess->allocate_transfer_uid());
    EXPECT_EQ(st.Wait(), StatusCode::ERR_NOT_FOUND) << st.Message();
  }
  EXPECT_EQ(rig.stats("tcp").failures, 0u);
  EXPECT_EQ(rig.stats("tcp").quarantines, 0u);
  auto st = rig.run(Op::WRITE, 5);
  EXPECT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
}

// deregister_memory() returns once no transfer uses the region, and none
// starts after: a thread posting READs into the region through a session
// while it is deregistered never lands a byte in it after the call returned
// (before the fix a post that took its hold after the deregistration had
// looked landed the peer's bytes in about 4 % of rounds on 2 vCPUs).
TEST(Refusals, NoReadLandsInARegionAfterItsDeregistrationReturned) {
  Rig rig("ok", "rules:\n  - prefer: [tcp]\ntimeout: 5s\n");
  std::fill(rig.dst.begin(), rig.dst.end(), uint8_t{'b'});
  constexpr size_t kRegion = 64 << 10;
  int late_rounds = 0;
  for (int round = 0; round < 150; ++round) {
    std::vector<uint8_t> loc(kRegion, 'a');
    MemoryDesc m = rig.ini->register_memory(loc.data(), loc.size());
    Result why;
    auto sess = rig.ini->create_session(m, rig.rmem, &why);
    ASSERT_TRUE(sess) << why.message;
    std::atomic<bool> stop{false};
    std::atomic<int> posted{0};
    std::vector<TransferStatus> all;
    std::thread poster([&] {
      while (!stop.load()) {
        TransferStatus s = sess->read(0, 0, kRegion, sess->allocate_transfer_uid());
        all.push_back(s);
        ++posted;
        s.WaitFor(0ms);
      }
    });
    while (posted.load() < 3) std::this_thread::yield();
    ASSERT_TRUE(rig.ini->deregister_memory(m).ok());
    std::fill(loc.begin(), loc.end(), uint8_t{'x'});  // the application reuses its buffer
    stop.store(true);
    poster.join();
    for (auto& s : all) s.Wait();
    if (std::count(loc.begin(), loc.end(), uint8_t{'b'}) > 0) ++late_rounds;
  }
  EXPECT_EQ(late_rounds, 0) << "rounds where a READ landed after deregister_memory returned";
}

// A wait of centuries is a wait until the end (start + timeout would wrap the
// steady clock into the past: WaitFor said "not ended" at once).
TEST(Waits, AVeryLongTimeoutWaitsForTheEnd) {
  Rig rig("hang", "backends:\n  fault: {}\nrules:\n  - prefer: [fault]\ntimeout: 1s\n");
  const auto centuries = std::chrono::milliseconds(std::chrono::hours(24 * 365 * 1000));
  for (const auto timeout : {centuries, std::chrono::milliseconds::max() - 1ms}) {
    auto st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, 4096, rig.ini->allocate_transfer_uid());
    EXPECT_TRUE(st.WaitFor(timeout));
    EXPECT_FALSE(st.InProgress()) << "WaitFor returned before the transfer ended";
    auto st2 = rig.ini->write(rig.lmem, 0, rig.rmem, 0, 4096, rig.ini->allocate_transfer_uid());
    EXPECT_TRUE(wait_all({st2}, timeout));
    EXPECT_FALSE(st2.InProgress()) << "wait_all returned before the transfer ended";
  }
}

TEST(Waits, ATimeoutTheClockCannotHoldIsRefusedWhenTheEngineIsMade) {
  EngineConfig cfg;
  cfg.timeout = std::chrono::milliseconds(std::chrono::hours(169));
  try {
    Engine e("too-long", cfg);
    ADD_FAILURE() << "an engine with a 169 h timeout was made";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS) << e.what();
  }
}

// The same life of a peer registered again with a changed descriptor (it
// removed a backend): the target keeps what that peer landed and the
// application has not popped yet - an update, not a deregistration.
TEST(Refusals, ANewDescriptorOfTheSameLifeKeepsItsUnpoppedStatuses) {
  Rig rig("ok", "backends:\n  fault: {}\nrules:\n  - prefer: [tcp]\ntimeout: 5s\n");
  test::fill_pattern(rig.src.data(), 0, kBytes, 9);
  std::vector<TransferUid> uids;
  for (int i = 0; i < 2; ++i) {
    uids.push_back(rig.ini->allocate_transfer_uid());
    auto st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, 4096, uids.back(), true);
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  }
  const EngineDesc before = rig.ini->desc();
  ASSERT_TRUE(rig.ini->remove_backend("fault").ok());
  const EngineDesc after = rig.ini->desc();
  ASSERT_EQ(after.instance, before.instance);
  ASSERT_FALSE(after.pack() == before.pack()) << "the descriptor did not change";
  ASSERT_TRUE(rig.tgt->register_remote_engine(after).ok());
  for (TransferUid uid : uids)
    EXPECT_TRUE(rig.tgt->pop_inbound_transfer_status("ini", uid).has_value())
        << "uid " << uid << " was dropped by the update";
  EXPECT_EQ(rig.tgt->stats().inbound_dropped, 0u);
}

// A plugin that never completes a transfer, not even at fini (an ABI
// breach): when the engine goes away the transfer still ends - a Wait() on
// its status returns - instead of staying in progress for good.
TEST(Waits, ATransferABackendNeverCompletedEndsWhenTheEngineGoes) {
  Rig rig("lose", "backends:\n  fault: {}\nrules:\n  - prefer: [fault]\ntimeout: 60s\n");
  auto st = rig.ini->write(rig.lmem, 0, rig.rmem, 0, 4096, rig.ini->allocate_transfer_uid());
  EXPECT_FALSE(st.WaitFor(100ms)) << "the plugin completed it: this tests nothing";
  const auto t0 = std::chrono::steady_clock::now();
  rig.ini.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "~Engine waited for the transfer";
  ASSERT_TRUE(st.WaitFor(10s)) << "the transfer never ended";
  EXPECT_NE(st.Code(), StatusCode::SUCCESS) << st.Message();
  EXPECT_NE(st.Message().find("without completing"), std::string::npos) << st.Message();
}

// ---- the stats endpoint and `ferry stats` ---------------------------------------

std::pair<int, std::string> run(const std::string& cmd) { return test::run_command(cmd); }

// backends.<name>.<key> of a stats document, -1 when absent.
long long field(const std::string& json, const std::string& name, const std::string& key) {
  auto j = nlohmann::json::parse(json, nullptr, false);
  if (!j.is_object() || !j.contains("backends") || !j["backends"].contains(name)) return -1;
  const auto& b = j["backends"][name];
  return b.contains(key) && b[key].is_number() ? b[key].get<long long>() : -1;
}

std::string temp_socket(const std::string& tag) {
  return (std::filesystem::temp_directory_path() /
          ("ferry-stats-" + tag + "-" + std::to_string(getpid()) + ".sock"))
      .string();
}

TEST(StatsEndpoint, FerryStatsShowsTheFailoversOfARunningEngine) {
  // One setting for both engines of the rig: {key} keeps their sockets apart.
  const std::string pattern = temp_socket("{key}");
  setenv("FERRY_STATS_SOCKET", pattern.c_str(), 1);
  Rig rig("fail_first_n");
  unsetenv("FERRY_STATS_SOCKET");
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(rig.run(Op::WRITE, 50 + i).Succeeded());
  const std::string path = expand_stats_path(pattern, "ini");
  const BackendStats fault = rig.stats("fault"), tcp = rig.stats("tcp");
  ASSERT_EQ(fault.failovers, 2u);

  auto [rc, json] = run(std::string(FERRY_CLI) + " stats " + path + " --json");
  ASSERT_EQ(rc, 0) << json;
  EXPECT_NE(json.find("\"engine\":\"ini\""), std::string::npos) << json;
  EXPECT_EQ(field(json, "fault", "failovers"), static_cast<long long>(fault.failovers)) << json;
  EXPECT_EQ(field(json, "fault", "failures"), static_cast<long long>(fault.failures)) << json;
  EXPECT_EQ(field(json, "fault", "transfers"), static_cast<long long>(fault.transfers)) << json;
  EXPECT_EQ(field(json, "tcp", "transfers"), static_cast<long long>(tcp.transfers)) << json;
  EXPECT_EQ(field(json, "tcp", "bytes"), static_cast<long long>(tcp.bytes)) << json;
  // The live tcp instance's describe() line and counters() (plugin ABI 1.5).
  auto j = nlohmann::json::parse(json, nullptr, false);
  ASSERT_TRUE(j.is_object()) << json;
  EXPECT_NE(j["backends"]["tcp"].value("detail", std::string()).find("lanes="), std::string::npos)
      << json;
  EXPECT_GE(j["backends"]["tcp"]["plugin"].value("peers", 0), 1) << json;
  // fault's counters() (its progress() calls, for progress_test) show too.
  EXPECT_TRUE(j["backends"]["fault"]["plugin"].contains("progress_calls")) << json;

  auto [trc, table] = run(std::string(FERRY_CLI) + " stats " + path + " --watch 0.01 --count 2");
  EXPECT_EQ(trc, 0) << table;
  EXPECT_NE(table.find("engine ini"), std::string::npos) << table;
  EXPECT_NE(table.find("failovers"), std::string::npos) << table;
  EXPECT_NE(table.find(" peers="), std::string::npos) << table;  // tcp's counters line
  // 2 samples: 3 header lines, 2 backends, each backend's counters
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 2 * (3 + 2 + 2)) << table;

  // The target engine serves its own (the inbound notifications it recorded).
  auto [brc, tj] =
      run(std::string(FERRY_CLI) + " stats " + expand_stats_path(pattern, "tgt") + " --json");
  ASSERT_EQ(brc, 0) << tj;
  EXPECT_NE(tj.find("\"inbound_notifications\":4"), std::string::npos) << tj;

  rig.ini.reset();
  EXPECT_FALSE(std::filesystem::exists(path)) << "the socket is removed with the engine";
  auto [grc, gone] = run(std::string(FERRY_CLI) + " stats " + path);
  EXPECT_EQ(grc, 1);
  EXPECT_NE(gone.find("cannot connect"), std::string::npos) << gone;
}

TEST(StatsEndpoint, StaleSocketIsReplacedLiveOneAndOtherFilesAreRefused) {
  const std::string path = temp_socket("stale");
  {
    // A socket file nobody listens on: what a crashed engine leaves behind.
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
    ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    close(fd);
  }
  EngineConfig cfg;
  cfg.stats_socket = path;
  Engine first("first", cfg);
  EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all,
            std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  try {
    Engine second("second", cfg);
    ADD_FAILURE() << "a second engine took a live stats socket";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_BAD_STATE);
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
  const std::string plain = temp_socket("plain");
  std::ofstream(plain) << "not a socket";
  cfg.stats_socket = plain;
  EXPECT_THROW(Engine("third", cfg), Error);
  EXPECT_TRUE(std::filesystem::exists(plain)) << "a file that is not a socket is left alone";
  std::filesystem::remove(plain);
  cfg.stats_socket = std::string(200, 'x');
  EXPECT_THROW(Engine("fourth", cfg), Error);
}

// ---- a restarted engine -------------------------------------------------------------

TEST(EngineRestart, MemoryDescriptorOfThePreviousInstanceIsRefused) {
  // The target restarts under the same key; its new region has the id of the
  // old one. A descriptor kept from before must not reach the new memory.
  Engine ini("ini");
  ASSERT_TRUE(ini.add_backend("tcp"));
  std::vector<uint8_t> src(4096, 0xab), old_dst(4096), new_dst(4096);
  MemoryDesc lmem = ini.register_memory(src.data(), src.size());
  MemoryDesc stale;
  std::unique_ptr<Session> old_session;
  {
    Engine tgt("tgt");
    ASSERT_TRUE(tgt.add_backend("tcp"));
    stale = tgt.register_memory(old_dst.data(), old_dst.size());
    ASSERT_TRUE(ini.register_remote_engine(tgt.desc()));
    old_session = ini.create_session(lmem, stale);
    ASSERT_TRUE(old_session);
  }
  Engine tgt("tgt");
  ASSERT_TRUE(tgt.add_backend("tcp"));
  MemoryDesc fresh = tgt.register_memory(new_dst.data(), new_dst.size());
  // Ids are random now, and each region has its own key, so an old descriptor
  // rarely even names the new memory; force the case this guards against (the
  // same id) to check the instance itself is what refuses it.
  stale.id = fresh.id;
  ASSERT_NE(fresh.engine_instance, stale.engine_instance);
  ASSERT_TRUE(ini.register_remote_engine(tgt.desc()));
  tgt.register_remote_engine(ini.desc());

  TransferStatus st = ini.write(lmem, 0, stale, 0, src.size(), ini.allocate_transfer_uid());
  EXPECT_EQ(st.Code(), StatusCode::ERR_NOT_FOUND) << st.Message();
  EXPECT_NE(st.Message().find("previous instance"), std::string::npos) << st.Message();
  EXPECT_EQ(std::count(new_dst.begin(), new_dst.end(), 0xab), 0)
      << "nothing reached the new memory";

  // A session made for the previous instance says so, rather than "no backend".
  st = old_session->write(0, 0, src.size(), ini.allocate_transfer_uid());
  EXPECT_EQ(st.Code(), StatusCode::ERR_NOT_FOUND) << st.Message();
  EXPECT_NE(st.Message().find("create a new session"), std::string::npos) << st.Message();

  st = ini.write(lmem, 0, fresh, 0, src.size(), ini.allocate_transfer_uid());
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(new_dst, src);
}

}  // namespace
