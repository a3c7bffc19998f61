// SPDX-License-Identifier: Apache-2.0
// The rdma backend through the public API, in two processes: a target killed and
// restarted (QP error, then recovery), a QP error with the peer alive (the same
// QPs are reset and rebuilt by the next transfer), failover to tcp when the
// target's rdma backend goes away, an idle engine that costs no CPU, and - on
// hosts without a device - the clear "no RDMA device" refusal. Tests that need a
// device skip with a message where there is none (they run in the Soft-RoCE VM).
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

// The reason the rdma backend cannot start here, or "" when it can.
std::string rdma_unavailable() {
  static const std::string why = [] {
    Engine probe("probe");
    Result r = probe.add_backend("rdma");
    return r ? std::string() : r.message;
  }();
  return why;
}

#define NEED_RDMA()                                                       \
  if (!rdma_unavailable().empty())                                        \
  GTEST_SKIP() << "rdma backend unavailable here (" << rdma_unavailable() \
               << "); these tests run inside the Soft-RoCE VM (docs/backends/rdma.md)"

std::filesystem::path write_policy(const std::string& name, const std::string& text) {
  auto p = std::filesystem::temp_directory_path() /
           ("ferry-rdma-" + name + "-" + std::to_string(getpid()) + ".yaml");
  std::ofstream(p) << text;
  return p;
}

// A ferry-test-peer target registered both ways with `ini` (one way only,
// the target at the initiator, as vLLM's connectors do, when `both` is false).
struct Target {
  Target(Engine& ini, const std::string& backends, size_t region, bool both = true)
      : child({FERRY_TEST_PEER, "target", backends, std::to_string(region), "10000"}) {
    std::string ready = child.read_line(120000);
    std::istringstream in(ready);
    std::string word, ehex, mhex;
    in >> word >> ehex >> mhex;
    if (word != "READY") throw std::runtime_error("peer did not start: " + ready);
    desc = EngineDesc::unpack(test::from_hex(ehex));
    mem = MemoryDesc::unpack(test::from_hex(mhex));
    Result r = ini.register_remote_engine(desc);
    if (!r) throw std::runtime_error("register target: " + r.message);
    if (!both) return;
    std::string ok = child.ask("register " + test::to_hex(ini.desc().pack()));
    if (ok != "OK") throw std::runtime_error("target register: " + ok);
  }
  std::string hash(size_t off, size_t len) {
    return child.ask("hash 1 " + std::to_string(off) + " " + std::to_string(len), 120000);
  }
  std::string pop(TransferUid uid, int ms) {
    return child.ask("pop initiator " + std::to_string(uid) + " " + std::to_string(ms), ms + 60000);
  }
  test::ChildProcess child;
  EngineDesc desc;
  MemoryDesc mem;
};

std::string hash_of(const std::vector<uint8_t>& v, size_t off, size_t len) {
  return "HASH " + std::to_string(test::fnv1a(v.data() + off, len));
}

TEST(RdmaInfo, NoDeviceIsReportedClearly) {
  if (rdma_unavailable().empty()) GTEST_SKIP() << "an RDMA device exists here";
  Engine e("e");
  Result r = e.add_backend("rdma");
  EXPECT_EQ(r.code, StatusCode::ERR_BAD_STATE);
  EXPECT_NE(r.message.find("no RDMA device"), std::string::npos) << r.message;
  // `ferry info` lists the plugin as FAILED with the same reason, and the process lives on.
  std::string cmd =
      std::string(FERRY_CLI) + " info --plugin-dir " + FERRY_PLUGIN_BUILD_DIR + " 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, f)) out.append(buf, n);
  EXPECT_EQ(pclose(f), 0) << out;
  EXPECT_NE(out.find("libferry-rdma.so"), std::string::npos) << out;
  EXPECT_NE(out.find("no RDMA device"), std::string::npos) << out;
}

TEST(RdmaProcess, TargetKilledFailsThenRestartedTargetWorks) {
  NEED_RDMA();
  const size_t region = 4u << 20;
  EngineConfig cfg;
  cfg.timeout = 8000ms;
  Engine ini("initiator", cfg);
  ASSERT_TRUE(ini.add_backend("rdma"));
  std::vector<uint8_t> src(region);
  test::fill_pattern(src.data(), 0, region, 11);
  MemoryDesc local = ini.register_memory(src.data(), src.size());

  auto t1 = std::make_unique<Target>(ini, "rdma", region);
  TransferUid uid = ini.allocate_transfer_uid();
  auto st = ini.write(local, 0, t1->mem, 0, region, uid);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(t1->hash(0, region), hash_of(src, 0, region));
  EXPECT_EQ(t1->pop(uid, 5000), "INBOUND SUCCESS");

  // The target dies: its QPs vanish, ours exhaust their retries (or the deadline).
  MemoryDesc dead_mem = t1->mem;
  t1->child.kill_now();
  auto t0 = std::chrono::steady_clock::now();
  auto lost = ini.write(local, 0, dead_mem, 0, region, ini.allocate_transfer_uid());
  ASSERT_TRUE(lost.WaitFor(30s)) << "a transfer to a dead target never ended";
  EXPECT_TRUE(lost.Failed());
  EXPECT_NE(lost.Message().find("rdma"), std::string::npos) << lost.Message();
  std::printf("transfer to the dead target: %s after %lld ms\n", lost.Message().c_str(),
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - t0)
                                         .count()));
  t1.reset();

  // A new process under the same key: registered again, new QPs, data moves.
  Target t2(ini, "rdma", region);
  test::fill_pattern(src.data(), 0, region, 12);
  uid = ini.allocate_transfer_uid();
  auto again = ini.write(local, 0, t2.mem, 0, region, uid);
  ASSERT_EQ(again.Wait(), StatusCode::SUCCESS) << again.Message();
  EXPECT_EQ(t2.hash(0, region), hash_of(src, 0, region));
  EXPECT_EQ(t2.pop(uid, 5000), "INBOUND SUCCESS");
  auto rd = ini.read(local, 0, t2.mem, 0, region, ini.allocate_transfer_uid());
  ASSERT_EQ(rd.Wait(), StatusCode::SUCCESS) << rd.Message();
}

TEST(RdmaProcess, OneWayRegistrationConnectsQueuePairs) {
  // The target never registers the initiator. Its QP answer goes back over
  // the control plane, to an engine it learned from the initiator's
  // authenticated hello (it presented its descriptor there).
  NEED_RDMA();
  const size_t region = 1u << 20;
  EngineConfig cfg;
  cfg.timeout = 8000ms;
  Engine ini("initiator", cfg);
  ASSERT_TRUE(ini.add_backend("rdma"));
  std::vector<uint8_t> src(region);
  test::fill_pattern(src.data(), 0, region, 21);
  MemoryDesc local = ini.register_memory(src.data(), src.size());
  Target t(ini, "rdma", region, /*both=*/false);
  TransferUid uid = ini.allocate_transfer_uid();
  auto st = ini.write(local, 0, t.mem, 0, region, uid);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(t.hash(0, region), hash_of(src, 0, region));
  EXPECT_EQ(t.pop(uid, 5000), "INBOUND SUCCESS");
  std::fill(src.begin(), src.end(), 0);
  auto rd = ini.read(local, 0, t.mem, 0, region, ini.allocate_transfer_uid());
  ASSERT_EQ(rd.Wait(), StatusCode::SUCCESS) << rd.Message();
  std::vector<uint8_t> want(region);
  test::fill_pattern(want.data(), 0, region, 21);
  EXPECT_EQ(src, want);
}

TEST(RdmaProcess, QpErrorWithLivePeerIsRebuiltByTheNextTransfer) {
  NEED_RDMA();
  EngineConfig cfg;
  cfg.timeout = 8000ms;
  Engine ini("initiator", cfg), tgt("target", cfg);
  ASSERT_TRUE(ini.add_backend("rdma"));
  ASSERT_TRUE(tgt.add_backend("rdma"));
  ASSERT_TRUE(ini.register_remote_engine(tgt.desc()));
  ASSERT_TRUE(tgt.register_remote_engine(ini.desc()));
  std::vector<uint8_t> src(1 << 20), dst1(1 << 20), dst2(1 << 20);
  test::fill_pattern(src.data(), 0, src.size(), 3);
  MemoryDesc local = ini.register_memory(src.data(), src.size());
  MemoryDesc r1 = tgt.register_memory(dst1.data(), dst1.size());
  auto ok = ini.write(local, 0, r1, 0, 4096, 1);
  ASSERT_EQ(ok.Wait(), StatusCode::SUCCESS) << ok.Message();
  // The target revokes r1: our next WRITE meets a remote access error and the QPs reset.
  ASSERT_TRUE(tgt.deregister_memory(r1));
  auto bad = ini.write(local, 0, r1, 0, 4096, 2);
  ASSERT_TRUE(bad.WaitFor(30s));
  EXPECT_TRUE(bad.Failed());
  EXPECT_NE(bad.Message().find("remote access error"), std::string::npos) << bad.Message();
  // Same peer, same port pair: the reset QPs are connected again on the next transfer.
  MemoryDesc r2 = tgt.register_memory(dst2.data(), dst2.size());
  auto good = ini.write(local, 0, r2, 0, src.size(), 3);
  ASSERT_EQ(good.Wait(), StatusCode::SUCCESS) << good.Message();
  EXPECT_EQ(std::memcmp(src.data(), dst2.data(), src.size()), 0);
  auto notified = tgt.wait_inbound_transfer_status("initiator", 3, 5000ms);
  ASSERT_TRUE(notified.has_value());
  EXPECT_EQ(notified->Code(), StatusCode::SUCCESS);
}

TEST(RdmaProcess, FailsOverToTcpWhenTheTargetsRdmaGoesAway) {
  NEED_RDMA();
  const size_t region = 8u << 20;
  std::string plugin_path = std::string(FERRY_PLUGIN_BUILD_DIR);
  setenv("FERRY_PLUGIN_PATH", plugin_path.c_str(), 1);
  auto policy = write_policy("failover",
                             "backends:\n"
                             "  rdma: { qp_timeout: 12, retry_cnt: 3, connect_timeout_ms: 2000 }\n"
                             "rules:\n  - prefer: [rdma, tcp]\n"
                             "failover:\n  max_attempts: 2\ntimeout: 30s\n");
  EngineConfig cfg;
  cfg.policy_file = policy.string();
  Engine ini("initiator", cfg);
  ASSERT_TRUE(ini.add_backend("rdma"));
  ASSERT_TRUE(ini.add_backend("tcp"));
  Target t(ini, "rdma,tcp", region);
  std::vector<uint8_t> src(region);
  test::fill_pattern(src.data(), 0, region, 4242);
  MemoryDesc local = ini.register_memory(src.data(), src.size());

  auto first = ini.write(local, 0, t.mem, 0, region, ini.allocate_transfer_uid());
  ASSERT_EQ(first.Wait(), StatusCode::SUCCESS) << first.Message();
  ASSERT_EQ(ini.stats().backends["rdma"].transfers, 1u) << "the first transfer must go over rdma";

  std::vector<TransferStatus> st;
  std::vector<TransferUid> uids;
  for (int i = 0; i < 6; ++i) {
    uids.push_back(ini.allocate_transfer_uid());
    st.push_back(ini.write(local, 0, t.mem, 0, region, uids.back()));
  }
  ASSERT_EQ(t.child.ask("remove_backend rdma", 60000), "OK");  // destroys its QPs
  for (int i = 0; i < 2; ++i) {  // after the cut: rdma cannot connect, tcp carries them
    uids.push_back(ini.allocate_transfer_uid());
    st.push_back(ini.write(local, 0, t.mem, 0, region, uids.back()));
  }
  ASSERT_TRUE(wait_all(st, 120s));
  for (auto& s : st) EXPECT_EQ(s.Code(), StatusCode::SUCCESS) << s.Message();
  EXPECT_EQ(t.hash(0, region), hash_of(src, 0, region));
  for (auto uid : uids) {
    EXPECT_EQ(t.pop(uid, 5000), "INBOUND SUCCESS");
    EXPECT_EQ(t.pop(uid, 0), "NONE");
  }
  auto stats = ini.stats();
  EXPECT_GE(stats.backends["rdma"].failovers, 2u) << "the post-cut transfers must fail over";
  EXPECT_GE(stats.backends["tcp"].transfers, 2u);
  std::filesystem::remove(policy);
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

TEST(RdmaProcess, IdleEngineCostsNoCpu) {
  NEED_RDMA();
  Engine ini("initiator"), tgt("target");
  ASSERT_TRUE(ini.add_backend("rdma"));
  ASSERT_TRUE(tgt.add_backend("rdma"));
  ASSERT_TRUE(ini.register_remote_engine(tgt.desc()));
  ASSERT_TRUE(tgt.register_remote_engine(ini.desc()));
  std::vector<uint8_t> a(1 << 16), b(1 << 16);
  MemoryDesc la = ini.register_memory(a.data(), a.size());
  MemoryDesc rb = tgt.register_memory(b.data(), b.size());
  auto st = ini.write(la, 0, rb, 0, a.size(), 1);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  // Both engines now hold connected QPs and completion threads; nothing moves for 1 s.
  const double before = cpu_seconds();
  EXPECT_FALSE(tgt.wait_inbound_transfer_status("initiator", 999, 1000ms).has_value());
  const double used = cpu_seconds() - before;
  EXPECT_LT(used, 0.1) << "an idle engine burned " << used << " s of CPU in 1 s";
}

}  // namespace
