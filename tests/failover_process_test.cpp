// SPDX-License-Identifier: Apache-2.0
// Two processes, two real backends: the target's tcp backend is torn down
// (its sockets closed from the target side) while WRITEs are in flight; every
// transfer still completes with correct data by failing over to cma, and the
// target hears of each transfer once.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

TEST(FailoverProcess, TcpCutMidStreamCompletesOnCma) {
  const size_t region = 64u << 20;
  std::string plugin_path = std::string(FERRY_PLUGIN_BUILD_DIR);
  setenv("FERRY_PLUGIN_PATH", plugin_path.c_str(), 1);
  auto policy =
      std::filesystem::temp_directory_path() / ("ferry-cut-" + std::to_string(getpid()) + ".yaml");
  std::ofstream(policy) << "backends:\n  cma: {}\nrules:\n  - prefer: [tcp, cma]\n"
                           "    trust_descriptors: true\n"
                           "failover:\n  max_attempts: 2\ntimeout: 10s\n";
  test::ChildProcess child({FERRY_TEST_PEER, "target", "tcp,cma", std::to_string(region), "10000"});
  std::string ready = child.read_line(60000);
  std::istringstream in(ready);
  std::string word, ehex, mhex;
  in >> word >> ehex >> mhex;
  ASSERT_EQ(word, "READY") << ready;

  EngineConfig cfg;
  cfg.policy_file = policy.string();
  Engine ini("initiator", cfg);
  for (const char* b : {"tcp", "cma"}) {
    Result r = ini.add_backend(b);
    if (!r && std::string(b) == "cma") GTEST_SKIP() << "cma backend unavailable: " << r.message;
    ASSERT_TRUE(r) << r.message;
  }
  ASSERT_TRUE(ini.register_remote_engine(EngineDesc::unpack(test::from_hex(ehex))));
  ASSERT_EQ(child.ask("register " + test::to_hex(ini.desc().pack())), "OK");
  MemoryDesc remote = MemoryDesc::unpack(test::from_hex(mhex));
  std::vector<uint8_t> src(region);
  test::fill_pattern(src.data(), 0, region, 4242);
  MemoryDesc local = ini.register_memory(src.data(), src.size());

  std::vector<TransferStatus> st;
  std::vector<TransferUid> uids;
  for (int i = 0; i < 6; ++i) {
    uids.push_back(ini.allocate_transfer_uid());
    st.push_back(ini.write(local, 0, remote, 0, region, uids.back()));
  }
  ASSERT_EQ(child.ask("remove_backend tcp"), "OK");  // cuts every tcp connection
  for (int i = 0; i < 2; ++i) {                      // after the cut: tcp refuses, cma carries them
    uids.push_back(ini.allocate_transfer_uid());
    st.push_back(ini.write(local, 0, remote, 0, region, uids.back()));
  }
  ASSERT_TRUE(wait_all(st, 60s));
  for (auto& s : st) EXPECT_EQ(s.Code(), StatusCode::SUCCESS) << s.Message();

  std::string h = child.ask("hash 1 0 " + std::to_string(region));
  EXPECT_EQ(h, "HASH " + std::to_string(test::fnv1a(src.data(), region)));
  for (auto uid : uids) {
    EXPECT_EQ(child.ask("pop initiator " + std::to_string(uid) + " 5000"), "INBOUND SUCCESS");
    EXPECT_EQ(child.ask("pop initiator " + std::to_string(uid) + " 0"), "NONE");
  }
  auto stats = ini.stats();
  EXPECT_GE(stats.backends["tcp"].failovers, 2u) << "the post-cut transfers must fail over";
  EXPECT_GE(stats.backends["cma"].transfers, 2u);
  std::filesystem::remove(policy);
}
