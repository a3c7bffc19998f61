// SPDX-License-Identifier: Apache-2.0
// Fencing (DESIGN.md "Failure means not delivered"; plugin.h ABI 1.2): a target
// process is stopped (SIGSTOP) longer than the deadline while WRITEs to it are in
// flight, so their bytes sit in its socket buffers. The stopped process orders
// the events: nothing here sleeps to wait for one.
//
// What must hold, with tcp alone and with tcp + cma (cma opted in):
//  - the WRITE caught by the stop ends by its deadline (+100 ms) with
//    ERR_OUTCOME_UNKNOWN (the target cannot answer the fence), not failed over;
//  - while the target is fenced, new transfers fail at once, saying so;
//  - after SIGCONT the fence is answered, the gate opens, and the target holds
//    the bytes of the newest transfer that returned SUCCESS: none of the
//    caught WRITE's bytes landed later, and its inbound record is not SUCCESS;
//  - a refusal by the target (deregistered memory) is not failed over to cma and
//    does not quarantine tcp.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"
#include "proc_self.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kRegion = 1 << 20;
constexpr size_t kSlice = 64 << 10;
constexpr auto kDeadline = 1000ms;
constexpr auto kSlack = 100ms;

struct StoppableTarget {
  // one_way: the target never registers the initiator (as vLLM's connectors run).
  StoppableTarget(const std::string& backends, const std::string& policy_body,
                  bool one_way = false) {
    setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
    policy = std::filesystem::temp_directory_path() /
             ("ferry-fence-" + std::to_string(getpid()) + "-" + std::to_string(++serial) + ".yaml");
    std::ofstream(policy) << policy_body;
    setenv("FERRY_POLICY", policy.c_str(), 1);  // the target (a child) reads it too
    child = std::make_unique<test::ChildProcess>(
        std::vector<std::string>{FERRY_TEST_PEER, "target", backends, std::to_string(kRegion),
                                 std::to_string(kDeadline.count())});
    std::istringstream in(child->read_line(60000));
    std::string word, ehex, mhex;
    in >> word >> ehex >> mhex;
    if (word != "READY") throw std::runtime_error("target did not start: " + word);
    EngineConfig cfg;
    cfg.policy_file = policy.string();
    ini = std::make_unique<Engine>("initiator", cfg);
    std::stringstream bs(backends);
    for (std::string b; std::getline(bs, b, ',');) {
      Result r = ini->add_backend(b);
      if (!r) throw std::runtime_error(r.message);
    }
    target = EngineDesc::unpack(test::from_hex(ehex));
    if (!ini->register_remote_engine(target)) throw std::runtime_error("register target");
    if (!one_way && child->ask("register " + test::to_hex(ini->desc().pack())) != "OK")
      throw std::runtime_error("register initiator at the target");
    remote = MemoryDesc::unpack(test::from_hex(mhex));
    src.resize(kRegion);
    local = ini->register_memory(src.data(), src.size());
  }
  ~StoppableTarget() {
    if (stopped) cont();
    unsetenv("FERRY_POLICY");
    std::filesystem::remove(policy);
  }

  // SIGSTOP, and wait until the kernel says it is stopped.
  void stop() {
    ASSERT_EQ(::kill(child->pid(), SIGSTOP), 0);
    int st = 0;
    ASSERT_EQ(::waitpid(child->pid(), &st, WUNTRACED), child->pid());
    ASSERT_TRUE(WIFSTOPPED(st));
    stopped = true;
  }
  void cont() {
    ::kill(child->pid(), SIGCONT);
    int st = 0;
    ::waitpid(child->pid(), &st, WCONTINUED);
    stopped = false;
  }

  TransferStatus write(uint64_t seed, size_t off, size_t len, TransferUid uid) {
    test::fill_pattern(src.data(), off, len, seed);
    return ini->write(local, off, remote, off, len, uid);
  }
  std::string target_hash(size_t off, size_t len) {
    return child->ask("hash 1 " + std::to_string(off) + " " + std::to_string(len));
  }
  static std::string expected_hash(uint64_t seed, size_t off, size_t len) {
    std::vector<uint8_t> buf(off + len);
    test::fill_pattern(buf.data(), off, len, seed);
    return "HASH " + std::to_string(test::fnv1a(buf.data() + off, len));
  }
  std::string inbound(TransferUid uid, int wait_ms) {
    return child->ask("pop initiator " + std::to_string(uid) + " " + std::to_string(wait_ms));
  }
  // The fence answered after SIGCONT: polls the initiator's own status (the
  // target's answer, not a timer, ends the wait), at most `limit`.
  bool wait_unfenced(std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (ini->stats().fenced_peers != 0) {
      if (std::chrono::steady_clock::now() > end) return false;
      std::this_thread::sleep_for(10ms);
    }
    return true;
  }

  static inline int serial = 0;
  std::filesystem::path policy;
  std::unique_ptr<test::ChildProcess> child;
  std::unique_ptr<Engine> ini;
  EngineDesc target;
  MemoryDesc remote, local;
  std::vector<uint8_t> src;
  bool stopped = false;
};

// One tcp lane: the baseline opens it, so the caught WRITE is written into an
// open connection and sits in the stopped target's socket buffers. (A lane
// opened after the stop cannot finish its handshake - the target must prove
// its descriptor - so nothing of a WRITE queued on it leaves: that is a plain
// failure without a fence, NewLaneToAStoppedTargetSendsNothing below.)
std::string policy_tcp() {
  return "backends:\n  tcp: { lanes: 1 }\nrules:\n  - prefer: [tcp]\ntimeout: 1s\n";
}
std::string policy_tcp_ofi() {
  return "backends:\n  tcp: { lanes: 1 }\n  ofi: { provider: shm }\nrules:\n  - prefer: [tcp, "
         "ofi]\n"
         "failover:\n  max_attempts: 2\n  quarantine: { after_failures: 1000, within: 1s, for: 1s "
         "}\n"
         "timeout: 1s\n";
}
std::string policy_tcp_cma() {
  return "backends:\n  tcp: { lanes: 1 }\n  cma: {}\nrules:\n  - prefer: [tcp, cma]\n    "
         "trust_descriptors: true\n"
         "failover:\n  max_attempts: 2\n  quarantine: { after_failures: 1000, within: 1s, for: 1s "
         "}\n"
         "timeout: 1s\n";
}

// The scenario of both backend mixes.
void caught_write_never_lands(StoppableTarget& r, const char* other) {
  // A baseline that lands: the newest SUCCESS the target must hold in the end.
  TransferStatus base = r.write(1, 0, kRegion, 100);
  ASSERT_EQ(base.Wait(), StatusCode::SUCCESS) << base.Message();
  ASSERT_EQ(r.inbound(100, 2000), "INBOUND SUCCESS");

  r.stop();
  const auto t0 = std::chrono::steady_clock::now();
  TransferStatus caught = r.write(2, 0, kSlice, 101);
  ASSERT_TRUE(caught.WaitFor(kDeadline + 2s));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(caught.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << caught.Message();
  EXPECT_LE(took, kDeadline + kSlack) << caught.Message();
  EXPECT_NE(caught.Message().find("fence"), std::string::npos) << caught.Message();
  std::printf(
      "RESULT fence %s: caught WRITE ended %s after %lld ms\n", other ? other : "tcp",
      to_string(caught.Code()),
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));

  // Fenced: the next WRITE fails at once (no cma write into the stopped target).
  const auto t1 = std::chrono::steady_clock::now();
  TransferStatus next = r.write(3, 0, kSlice, 102);
  ASSERT_TRUE(next.WaitFor(2s));
  EXPECT_LT(std::chrono::steady_clock::now() - t1, kSlack);
  EXPECT_EQ(next.Code(), StatusCode::ERR_BAD_STATE) << next.Message();
  EXPECT_NE(next.Message().find("fenced"), std::string::npos) << next.Message();
  if (other) {
    EXPECT_EQ(r.ini->stats().backends[other].transfers, 0u) << "failed over into a stopped target";
  }
  EXPECT_EQ(r.ini->stats().fenced_peers, 1u);

  const auto t2 = std::chrono::steady_clock::now();
  r.cont();
  ASSERT_TRUE(r.wait_unfenced(10s)) << "the resumed target never answered the fence";
  std::printf("RESULT fence %s: fence answered %lld ms after SIGCONT\n", other ? other : "tcp",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - t2)
                                         .count()));
  // Neither the caught WRITE's bytes (they were in its socket buffers) nor the
  // refused one's landed: the baseline is still there.
  EXPECT_EQ(r.target_hash(0, kSlice), StoppableTarget::expected_hash(1, 0, kSlice));
  EXPECT_EQ(r.inbound(101, 200), "NONE") << "the target recorded a WRITE nobody was told landed";
  EXPECT_EQ(r.inbound(102, 0), "NONE");

  // And the peer works again.
  TransferStatus after = r.write(4, 0, kSlice, 103);
  ASSERT_EQ(after.Wait(), StatusCode::SUCCESS) << after.Message();
  EXPECT_EQ(r.target_hash(0, kSlice), StoppableTarget::expected_hash(4, 0, kSlice));
  EXPECT_EQ(r.inbound(103, 2000), "INBOUND SUCCESS");
  EXPECT_GE(r.ini->stats().fences, 1u);
}

}  // namespace

// The application deregisters a stopped target with a WRITE in flight and
// registers the same engine again: the WRITE ends unknown at once (no fence can
// be asked of a peer that is not registered), and its fence is kept: the
// registered-again peer is fenced (a new WRITE waits) until the resumed target
// answers, so the old WRITE's bytes cannot land over the new one's.
TEST(Fence, DeregisteredWithAWriteInFlightIsFencedWhenRegisteredAgain) {
  StoppableTarget r("tcp", policy_tcp());
  TransferStatus base = r.write(1, 0, kRegion, 200);
  ASSERT_EQ(base.Wait(), StatusCode::SUCCESS) << base.Message();
  r.stop();
  const auto t0 = std::chrono::steady_clock::now();
  TransferStatus caught = r.write(2, 0, kSlice, 201);
  ASSERT_TRUE(r.ini->deregister_remote_engine(r.target.key));
  ASSERT_TRUE(caught.WaitFor(kDeadline + 2s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kDeadline) << caught.Message();
  EXPECT_EQ(caught.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << caught.Message();
  EXPECT_NE(caught.Message().find("deregistered"), std::string::npos) << caught.Message();
  EXPECT_EQ(r.ini->stats().fenced_peers, 0u) << "a deregistered peer counts as fenced";

  ASSERT_TRUE(r.ini->register_remote_engine(r.target));
  EXPECT_EQ(r.ini->stats().fenced_peers, 1u) << "registered again without fencing the old WRITE";
  TransferStatus next = r.write(3, 0, kSlice, 202);
  EXPECT_TRUE(next.InProgress()) << next.Message();
  r.cont();
  ASSERT_EQ(next.Wait(), StatusCode::SUCCESS) << next.Message();
  EXPECT_TRUE(r.wait_unfenced(10s));
  EXPECT_EQ(r.target_hash(0, kSlice), StoppableTarget::expected_hash(3, 0, kSlice));
  EXPECT_EQ(r.inbound(201, 0), "NONE");
}

// The same, with a descriptor of another life of the engine registered in
// between (a restarted engine's, or a stale one from a metadata store): the old
// life's fence stays parked, so registering the old life again still fences
// the caught WRITE before a new one starts.
TEST(Fence, AnotherLifeRegisteredInBetweenKeepsTheParkedFence) {
  StoppableTarget r("tcp", policy_tcp());
  TransferStatus base = r.write(1, 0, kRegion, 300);
  ASSERT_EQ(base.Wait(), StatusCode::SUCCESS) << base.Message();
  r.stop();
  TransferStatus caught = r.write(2, 0, kSlice, 301);
  ASSERT_TRUE(r.ini->deregister_remote_engine(r.target.key));
  ASSERT_TRUE(caught.WaitFor(kDeadline + 2s));
  EXPECT_EQ(caught.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << caught.Message();

  EngineDesc other_life = r.target;
  other_life.instance = r.target.instance + 1;
  ASSERT_TRUE(r.ini->register_remote_engine(other_life));
  EXPECT_EQ(r.ini->stats().fenced_peers, 0u) << "the other life waits for the old life's fence";
  ASSERT_TRUE(r.ini->register_remote_engine(r.target));
  EXPECT_EQ(r.ini->stats().fenced_peers, 1u) << "the old life's parked fence was forgotten";
  TransferStatus next = r.write(3, 0, kSlice, 302);
  EXPECT_TRUE(next.InProgress()) << next.Message();
  r.cont();
  ASSERT_EQ(next.Wait(), StatusCode::SUCCESS) << next.Message();
  EXPECT_TRUE(r.wait_unfenced(10s));
  EXPECT_EQ(r.target_hash(0, kSlice), StoppableTarget::expected_hash(3, 0, kSlice));
  EXPECT_EQ(r.inbound(301, 0), "NONE");
}

TEST(Fence, StoppedTargetTcpAlone) {
  StoppableTarget r("tcp", policy_tcp());
  caught_write_never_lands(r, nullptr);
}

// The same with one-way registration: the target serves the lanes of an
// initiator it never registered, learns it when the fence's control connection
// presents its descriptor (cutting its lanes once, which the fence wants
// anyway), and answers the fence exactly.
TEST(Fence, StoppedTargetTcpAloneOneWayRegistration) {
  StoppableTarget r("tcp", policy_tcp(), /*one_way=*/true);
  caught_write_never_lands(r, nullptr);
}

TEST(Fence, StoppedTargetTcpAndCma) {
  StoppableTarget r("tcp,cma", policy_tcp_cma());
  caught_write_never_lands(r, "cma");
}

// ofi (shm) cannot fence yet: it is not failed over to either, the caught WRITE
// ends unknown and the peer is fenced until the tcp fence is answered.
TEST(Fence, StoppedTargetTcpAndOfi) {
  std::unique_ptr<StoppableTarget> r;
  try {
    r = std::make_unique<StoppableTarget>("tcp,ofi", policy_tcp_ofi());
  } catch (const std::exception& e) {
    GTEST_SKIP() << "ofi backend unavailable here: " << e.what();
  }
  caught_write_never_lands(*r, "ofi");
}

// A read from a stopped target: its outcome is the initiator's own (its lanes
// are cut at the deadline), so it fails (ERR_TIMEOUT) by the deadline without a
// fence, and the peer stays usable once it resumes.
TEST(Fence, ReadFromAStoppedTargetFailsByTheDeadlineWithoutFencing) {
  StoppableTarget r("tcp", policy_tcp());
  r.stop();
  const auto t0 = std::chrono::steady_clock::now();
  TransferStatus rd = r.ini->read(r.local, 0, r.remote, 0, kSlice, 200);
  ASSERT_TRUE(rd.WaitFor(kDeadline + 2s));
  EXPECT_LE(std::chrono::steady_clock::now() - t0, kDeadline + kSlack);
  EXPECT_TRUE(rd.Failed());
  EXPECT_NE(rd.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << rd.Message();
  EXPECT_EQ(r.ini->stats().fences, 0u);
  r.cont();
  TransferStatus w = r.write(5, 0, kSlice, 201);
  EXPECT_EQ(w.Wait(), StatusCode::SUCCESS) << w.Message();
}

// A WRITE to a stopped target that no lane is open to yet: the lane connects
// (the kernel accepts for the stopped process) but its handshake waits for the
// target's proof, so no frame leaves. The transfer fails by its deadline as
// not sent - exact, no fence, the peer not fenced - and nothing lands later.
TEST(Fence, NewLaneToAStoppedTargetSendsNothing) {
  StoppableTarget r("tcp", policy_tcp());
  r.stop();
  const auto t0 = std::chrono::steady_clock::now();
  TransferStatus w = r.write(6, 0, kSlice, 210);
  ASSERT_TRUE(w.WaitFor(kDeadline + 2s));
  EXPECT_LE(std::chrono::steady_clock::now() - t0, kDeadline + kSlack) << w.Message();
  EXPECT_TRUE(w.Failed());
  EXPECT_NE(w.Code(), StatusCode::ERR_OUTCOME_UNKNOWN) << w.Message();
  EXPECT_EQ(r.ini->stats().fences, 0u);
  EXPECT_EQ(r.ini->stats().fenced_peers, 0u);
  r.cont();
  EXPECT_EQ(r.inbound(210, 200), "NONE");
  EXPECT_NE(r.target_hash(0, kSlice), StoppableTarget::expected_hash(6, 0, kSlice))
      << "the failed WRITE landed after SIGCONT";
  TransferStatus after = r.write(7, 0, kSlice, 211);
  ASSERT_EQ(after.Wait(), StatusCode::SUCCESS) << after.Message();
  EXPECT_EQ(r.target_hash(0, kSlice), StoppableTarget::expected_hash(7, 0, kSlice));
}

// Five notified cma WRITEs to a stopped target with no control connection yet:
// the core's NOTIFY cannot get past HELLO. Each ends by its own deadline; none
// waits behind another's handshake.
TEST(Fence, NotifiedCmaWritesToAStoppedTargetEndByTheirDeadlines) {
  StoppableTarget r("cma",
                    "backends:\n  cma: {}\nrules:\n  - prefer: [cma]\n    trust_descriptors: true\n"
                    "timeout: 1s\n");
  r.stop();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<TransferStatus> st;
  for (int i = 0; i < 5; ++i) st.push_back(r.write(10 + i, i * kSlice, kSlice, 300 + i));
  for (auto& s : st) {
    ASSERT_TRUE(s.WaitFor(kDeadline + 2s));
    EXPECT_TRUE(s.Failed()) << s.Message();
    EXPECT_NE(s.Message().find("notified"), std::string::npos) << s.Message();
  }
  EXPECT_LE(std::chrono::steady_clock::now() - t0, kDeadline + kSlack);
  r.cont();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(r.inbound(300 + i, 100), "NONE");
}

// The same with the control connection up: landings' NOTIFYs go into the
// stopped target's socket until it is full (until 2026-12-07), or until
// ControlPlane::kMaxUnanswered wait for answers (since). The next NOTIFY
// ends by its transfer's deadline (it used to block in its write, holding
// the connection, until the target read again), and so does every one behind
// it; after SIGCONT the target holds a record of exactly the transfers that
// succeeded.
TEST(Fence, NotifiesIntoAStoppedTargetsFullControlSocketEndByTheirDeadlines) {
  StoppableTarget r("cma",
                    "backends:\n  cma: {}\nrules:\n  - prefer: [cma]\n    trust_descriptors: true\n"
                    "timeout: 1s\n");
  TransferStatus warm = r.write(1, 0, 8, 500);
  ASSERT_EQ(warm.Wait(), StatusCode::SUCCESS) << warm.Message();
  ASSERT_EQ(r.inbound(500, 2000), "INBOUND SUCCESS");
  r.stop();
  // More NOTIFY frames than a unix socket's default buffer (212,992 bytes of
  // at least ~600 bytes' accounting each) holds.
  constexpr int kWrites = 1000;
  const size_t threads_before = test::thread_count();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<TransferStatus> st;
  for (int i = 0; i < kWrites; ++i) st.push_back(r.write(2, 8 * i, 8, 501 + i));
  // The NOTIFYs that could not leave wait in one queue for this peer, on one
  // thread (each took a thread of its own that waited out its deadline).
  const size_t threads_after = test::thread_count();
  EXPECT_LE(threads_after, threads_before + 8) << "NOTIFYs waiting for one peer took a thread each";
  int failed = 0;
  for (auto& s : st) {
    ASSERT_TRUE(s.WaitFor(kDeadline + 2s)) << "a transfer outlived its deadline by 2 s";
    if (s.Code() == StatusCode::SUCCESS) continue;
    ++failed;
    EXPECT_NE(s.Message().find("notified"), std::string::npos) << s.Message();
  }
  // (Generous: a thousand transfers and their NOTIFY threads, under ASan too.)
  EXPECT_LE(std::chrono::steady_clock::now() - t0, kDeadline + 2s);
  ASSERT_GT(failed, 0) << "the target's socket never filled: this test did not reach its case";
  r.cont();
  for (int i = 0; i < kWrites; ++i) {
    const bool ok = st[i].Code() == StatusCode::SUCCESS;
    // A NOTIFY that went whole arrives once the target reads again.
    EXPECT_EQ(r.inbound(501 + i, ok ? 5000 : 0), ok ? "INBOUND SUCCESS" : "NONE") << i;
  }
}

// A burst of notified cma WRITEs while the target is stopped, then it runs
// again well before their deadlines: every one succeeds and is recorded
// once, and the target cuts no connection for unread answers (the initiator
// reads answers between its writes and keeps at most
// ControlPlane::kMaxUnanswered NOTIFYs unanswered on a connection, so that a
// resend after a broken connection cannot overflow the answers' socket
// either). It passed with that bound lifted too: it guards the burst, not the
// bound.
TEST(Fence, ABurstOfNotifiesToAStalledTargetAllLandOnceItRuns) {
  StoppableTarget r("cma",
                    "backends:\n  cma: {}\nrules:\n  - prefer: [cma]\n    trust_descriptors: true\n"
                    "timeout: 20s\n");
  TransferStatus warm = r.write(1, 0, 8, 700);
  ASSERT_EQ(warm.Wait(), StatusCode::SUCCESS) << warm.Message();
  ASSERT_EQ(r.inbound(700, 2000), "INBOUND SUCCESS");
  r.stop();
  constexpr int kWrites = 600;  // more frames than the unix socket holds (~330)
  std::vector<TransferStatus> st;
  for (int i = 0; i < kWrites; ++i) st.push_back(r.write(2, 8 * i, 8, 701 + i));
  r.cont();
  for (int i = 0; i < kWrites; ++i) {
    ASSERT_TRUE(st[i].WaitFor(30s)) << i;
    EXPECT_EQ(st[i].Code(), StatusCode::SUCCESS) << i << ": " << st[i].Message();
  }
  for (int i = 0; i < kWrites; ++i) {
    EXPECT_EQ(r.inbound(701 + i, 5000), "INBOUND SUCCESS") << i;
    EXPECT_EQ(r.inbound(701 + i, 0), "NONE") << i;
  }
  std::istringstream stats(r.child->ask("stats"));
  std::string word;
  uint64_t inbound = 0, rejected = 0;
  stats >> word >> inbound >> rejected;
  EXPECT_EQ(rejected, 0u) << "the target cut the initiator's control connection";
}

// The target refuses (its memory was deregistered): the transfer ends with that
// error, is not failed over to cma (which would write into the old region), and
// tcp is not quarantined: valid transfers to the peer keep working.
TEST(Fence, RefusalIsNotFailedOverNorQuarantined) {
  StoppableTarget r("tcp,cma",
                    "backends:\n  cma: {}\nrules:\n  - prefer: [tcp, cma]\n"
                    "    trust_descriptors: true\nfailover:\n"
                    "  quarantine: { after_failures: 3, within: 60s, for: 60s }\ntimeout: 1s\n");
  TransferStatus base = r.write(1, 0, kSlice, 400);
  ASSERT_EQ(base.Wait(), StatusCode::SUCCESS) << base.Message();
  ASSERT_EQ(r.child->ask("deregister"), "OK");
  for (int i = 0; i < 5; ++i) {
    TransferStatus s = r.write(20 + i, 0, kSlice, 401 + i);
    ASSERT_TRUE(s.WaitFor(5s));
    EXPECT_EQ(s.Code(), StatusCode::ERR_NOT_FOUND) << s.Message();
    EXPECT_NE(s.Message().find("not registered"), std::string::npos) << s.Message();
  }
  auto stats = r.ini->stats();
  EXPECT_EQ(stats.backends["cma"].transfers, 0u) << "a refusal was failed over to cma";
  EXPECT_EQ(stats.backends["tcp"].quarantines, 0u) << "refusals quarantined tcp";
  EXPECT_EQ(stats.backends["tcp"].failovers, 0u);
  std::istringstream in(r.child->ask("reregister"));
  std::string word, mhex;
  in >> word >> mhex;
  ASSERT_EQ(word, "MEM");
  r.remote = MemoryDesc::unpack(test::from_hex(mhex));
  TransferStatus ok = r.write(30, 0, kSlice, 410);
  ASSERT_EQ(ok.Wait(), StatusCode::SUCCESS) << ok.Message();
  EXPECT_EQ(r.target_hash(0, kSlice), StoppableTarget::expected_hash(30, 0, kSlice));
  EXPECT_GE(r.ini->stats().backends["tcp"].transfers, 2u);
}

// A descriptor forged larger than the region: tcp cross-checks it against the
// target's own blob and will not use it; cma, which cannot check, is not used
// without an opt-in - so the built-in policy never writes past a region. The
// error names both reasons.
TEST(Fence, ForgedSizeIsRefusedAndCmaIsNotUsedWithoutOptIn) {
  StoppableTarget r("tcp,cma", "backends:\n  cma: {}\ntimeout: 1s\n");  // built-in rule
  MemoryDesc forged = r.remote;
  forged.size = kRegion * 2;
  test::fill_pattern(r.src.data(), 0, kSlice, 40);
  const std::string tail = r.target_hash(kRegion - kSlice, kSlice);
  TransferStatus s = r.ini->write(r.local, 0, forged, kRegion, kSlice, 500);
  ASSERT_TRUE(s.WaitFor(5s));
  EXPECT_TRUE(s.Failed());
  EXPECT_NE(s.Message().find("tcp: remote memory could not be imported"), std::string::npos)
      << s.Message();
  EXPECT_NE(s.Message().find("cma: cannot check requests on the target side"), std::string::npos)
      << s.Message();
  EXPECT_EQ(r.ini->stats().backends["cma"].transfers, 0u);
  EXPECT_EQ(r.target_hash(kRegion - kSlice, kSlice), tail);
  // The genuine descriptor still works on tcp.
  TransferStatus ok = r.write(41, 0, kSlice, 501);
  EXPECT_EQ(ok.Wait(), StatusCode::SUCCESS) << ok.Message();
}
