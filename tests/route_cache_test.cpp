// SPDX-License-Identifier: Apache-2.0
// The transfer lifecycle's route cache (transfer.cpp route_for, registry.h
// RemoteMem::routes): a region that is deregistered leaves none of its cached
// routes behind in the remote imports, so an engine that registers and
// deregisters memory for as long as it runs does not grow.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine_impl.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

// Two engines with tcp, each registered with the other.
void Connect(EngineImpl& ini, EngineImpl& tgt) {
  for (EngineImpl* e : {&ini, &tgt}) {
    Result r = e->add_backend("tcp", "{}");
    ASSERT_TRUE(r) << r.message;
  }
  ASSERT_TRUE(ini.register_remote_engine(tgt.desc()));
  ASSERT_TRUE(tgt.register_remote_engine(ini.desc()));
}

TEST(RouteCache, ADeregisteredRegionLeavesNoCachedRoutes) {
  setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
  EngineImpl ini("route-cache-ini", EngineConfig{}), tgt("route-cache-tgt", EngineConfig{});
  ASSERT_NO_FATAL_FAILURE(Connect(ini, tgt));
  std::vector<char> dst(1 << 16);
  const MemoryDesc rmem =
      tgt.registry().register_memory(dst.data(), dst.size(), -1, MemoryLocation::CPU);
  std::vector<char> src(1 << 16, 'x');
  for (int round = 0; round < 20; ++round) {
    const MemoryDesc lmem =
        ini.registry().register_memory(src.data(), src.size(), -1, MemoryLocation::CPU);
    MemPair pair;
    std::string why;
    ASSERT_EQ(ini.registry().resolve(lmem, rmem, pair, why), StatusCode::SUCCESS) << why;
    for (Op op : {Op::WRITE, Op::READ}) {
      const size_t off = 0, len = 4096;
      TransferStatus st =
          ini.transfers().submit(pair, op, &off, &off, &len, 1, ini.allocate_uid(), false);
      ASSERT_TRUE(st.WaitFor(20s));
      ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
    }
    EXPECT_GE(ini.registry().cached_routes_of(lmem.id), 2u) << "each op's route is cached";
    pair = MemPair{};  // holds the region: deregistering waits for it
    ASSERT_TRUE(ini.registry().deregister_memory(lmem));
    EXPECT_EQ(ini.registry().cached_routes_of(lmem.id), 0u)
        << "round " << round << ": the region's routes outlived it";
  }
}

// A pair resolved before its local region was deregistered (a session that
// outlived the region, or a post racing the deregistration) does not put a
// route back for the gone region: nothing would ever erase it again.
TEST(RouteCache, APostWithAPairOfADeregisteredRegionCachesNoRoute) {
  setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
  EngineImpl ini("route-stale-ini", EngineConfig{}), tgt("route-stale-tgt", EngineConfig{});
  ASSERT_NO_FATAL_FAILURE(Connect(ini, tgt));
  std::vector<char> dst(1 << 16), src(1 << 16, 'y');
  const MemoryDesc rmem =
      tgt.registry().register_memory(dst.data(), dst.size(), -1, MemoryLocation::CPU);
  const MemoryDesc lmem =
      ini.registry().register_memory(src.data(), src.size(), -1, MemoryLocation::CPU);
  MemPair pair;
  std::string why;
  ASSERT_EQ(ini.registry().resolve(lmem, rmem, pair, why), StatusCode::SUCCESS) << why;
  ASSERT_TRUE(ini.registry().deregister_memory(lmem));
  for (Op op : {Op::WRITE, Op::READ}) {
    const size_t off = 0, len = 4096;
    TransferStatus st =
        ini.transfers().submit(pair, op, &off, &off, &len, 1, ini.allocate_uid(), false);
    ASSERT_TRUE(st.WaitFor(20s));
    EXPECT_NE(st.Code(), StatusCode::SUCCESS) << "a transfer from a deregistered region";
  }
  EXPECT_EQ(ini.registry().cached_routes_of(lmem.id), 0u)
      << "a route was cached for a region already deregistered";
}

}  // namespace
