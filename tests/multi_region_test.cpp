// SPDX-License-Identifier: Apache-2.0
// One transfer over many regions (Engine::transfer) and prepared lists, two
// engines in this process over tcp (and the scripted 'fault' backend for
// failover): data checked byte for byte, the target told once after all the
// data, per-part failover, a failed part failing the call with its name.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <random>
#include <set>
#include <thread>

#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kRegions = 3, kRegionBytes = 1 << 20, kBlock = 16 << 10;

struct Rig {
  // fault_mode: a scripted backend (`fault_name`: 'fault', or 'faultmp',
  // which takes several region pairs per post) ranked before tcp.
  explicit Rig(const std::string& fault_mode = "", const std::string& fault_name = "fault")
      : fault(fault_name) {
    setenv("FERRY_PLUGIN_PATH",
           (std::string(FERRY_TEST_PLUGIN_DIR) + ":" + FERRY_PLUGIN_BUILD_DIR).c_str(), 1);
    EngineConfig cfg;
    cfg.timeout = 10s;
    if (!fault_mode.empty()) {
      policy = std::filesystem::temp_directory_path() /
               ("ferry-multi-" + std::to_string(getpid()) + ".yaml");
      std::ofstream(policy) << "backends:\n  " << fault << ": {}\nrules:\n  - prefer: [" << fault
                            << ", tcp]\n"
                               "failover:\n  max_attempts: 3\n"
                               "  quarantine: { after_failures: 100, within: 60s, for: 60s }\n"
                               "timeout: 10s\n";
      cfg.policy_file = policy.string();
    }
    ini = std::make_unique<Engine>("ini", cfg);
    tgt = std::make_unique<Engine>("tgt", cfg);
    for (Engine* e : {ini.get(), tgt.get()}) {
      if (!fault_mode.empty()) {
        Result r = e->add_backend(fault, "{\"mode\":\"" + fault_mode + "\",\"n\":2}");
        if (!r) throw std::runtime_error(r.message);
      }
      if (Result r = e->add_backend("tcp"); !r) throw std::runtime_error(r.message);
    }
    ini->register_remote_engine(tgt->desc());
    for (size_t i = 0; i < kRegions; ++i) {
      src[i].resize(kRegionBytes);
      dst[i].resize(kRegionBytes);
      local.push_back(ini->register_memory(src[i].data(), kRegionBytes));
      remote.push_back(tgt->register_memory(dst[i].data(), kRegionBytes));
    }
  }
  ~Rig() {
    ini.reset();
    tgt.reset();
    if (!policy.empty()) std::filesystem::remove(policy);
  }

  // Random blocks across every (local, remote) pair: no two items write the same bytes.
  std::vector<TransferItem> items(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<TransferItem> out;
    std::vector<size_t> blocks(kRegions * (kRegionBytes / kBlock));
    for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = i;
    std::shuffle(blocks.begin(), blocks.end(), rng);
    for (size_t i = 0; i < n; ++i) {
      const size_t rb = blocks[i], lb = blocks[(i * 7 + 3) % blocks.size()];
      out.push_back({lb / (kRegionBytes / kBlock), (lb % (kRegionBytes / kBlock)) * kBlock,
                     rb / (kRegionBytes / kBlock), (rb % (kRegionBytes / kBlock)) * kBlock,
                     kBlock});
    }
    return out;
  }
  void fill(uint64_t seed) {
    for (size_t i = 0; i < kRegions; ++i) {
      test::fill_pattern(src[i].data(), 0, kRegionBytes, seed + i);
      std::fill(dst[i].begin(), dst[i].end(), 0);
    }
  }
  // Every item's bytes are where it said (WRITE: src -> dst; READ: dst -> src).
  ::testing::AssertionResult landed(const std::vector<TransferItem>& items, Op op) {
    for (size_t i = 0; i < items.size(); ++i) {
      const auto& it = items[i];
      const uint8_t* from = op == Op::WRITE ? src[it.local].data() + it.local_offset
                                            : dst[it.remote].data() + it.remote_offset;
      const uint8_t* to = op == Op::WRITE ? dst[it.remote].data() + it.remote_offset
                                          : src[it.local].data() + it.local_offset;
      if (std::memcmp(from, to, it.size) != 0)
        return ::testing::AssertionFailure() << "item " << i << " did not land";
    }
    return ::testing::AssertionSuccess();
  }

  // A counter of the scripted backend's (plugin counters, stats()).
  uint64_t counter(const char* key) {
    auto st = ini->stats().backends[fault];
    auto it = st.plugin.find(key);
    return it == st.plugin.end() ? uint64_t{0} : it->second;
  }
  // How many (local, remote) region pairs the items name.
  static size_t pairs_of(const std::vector<TransferItem>& items) {
    std::set<std::pair<size_t, size_t>> seen;
    for (const auto& it : items) seen.insert({it.local, it.remote});
    return seen.size();
  }

  std::string fault;
  std::filesystem::path policy;
  std::vector<uint8_t> src[kRegions], dst[kRegions];
  std::unique_ptr<Engine> ini, tgt;
  std::vector<MemoryDesc> local, remote;
};

}  // namespace

TEST(MultiRegion, WriteAndReadManyRegionPairsAsOneTransfer) {
  Rig rig;
  for (Op op : {Op::WRITE, Op::READ}) {
    rig.fill(op == Op::WRITE ? 10 : 20);
    if (op == Op::READ)  // what a READ brings back: the target's own bytes
      for (size_t i = 0; i < kRegions; ++i)
        test::fill_pattern(rig.dst[i].data(), 0, kRegionBytes, 30 + i);
    auto items = rig.items(64, op == Op::WRITE ? 1 : 2);
    const TransferUid uid = rig.ini->allocate_transfer_uid();
    auto st = rig.ini->transfer(op, rig.local, rig.remote, items, uid, true, "all layers");
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    EXPECT_TRUE(rig.landed(items, op));
    EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", uid, 5s)) << "told once";
    EXPECT_FALSE(rig.tgt->wait_inbound_transfer_status("ini", uid, 100ms)) << "told twice";
    EXPECT_EQ(rig.tgt->wait_notifications(5s)["ini"], std::vector<std::string>{"all layers"});
    EXPECT_TRUE(rig.tgt->wait_notifications(100ms).empty());
  }
  EXPECT_EQ(rig.ini->stats().backends["tcp"].transfers, 2u * kRegions * kRegions)
      << "one part per region pair";
}

// FERRY_XFER_MORE (plugin.h): every part of a multi-region call but the last
// reaches a plugin with FERRY_CAP_POST_MORE flagged, a one-pair call never.
// (The fault plugin claims the capability and ignores the flag, which is
// always correct; tcp does not claim it and is never sent it.)
TEST(MultiRegion, EveryPartButTheLastSaysMoreFollow) {
  Rig rig("ok");
  auto counter = [&](const char* key) {
    auto st = rig.ini->stats().backends["fault"];
    auto it = st.plugin.find(key);
    return it == st.plugin.end() ? uint64_t{0} : it->second;
  };
  rig.fill(3);
  auto items = rig.items(64, 1);
  auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, items,
                              rig.ini->allocate_transfer_uid(), false, std::nullopt);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_TRUE(rig.landed(items, Op::WRITE));
  const uint64_t parts = rig.ini->stats().backends["fault"].transfers;
  ASSERT_GT(parts, 1u);
  EXPECT_EQ(counter("posts_more"), parts - 1);
  EXPECT_EQ(counter("posts_last"), 1u);
  // One pair: a plain post.
  std::vector<TransferItem> one = {items.front()};
  auto lone = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, one,
                                rig.ini->allocate_transfer_uid(), false, std::nullopt);
  ASSERT_EQ(lone.Wait(), StatusCode::SUCCESS) << lone.Message();
  EXPECT_EQ(counter("posts_more"), parts - 1);
  EXPECT_EQ(counter("posts_last"), 2u);
}

TEST(MultiRegion, BadItemsAreRefusedBeforeAnythingMoves) {
  Rig rig;
  auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, {}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, {{0, 0, 7, 0, 8}}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(st.Message().find("item 0 names region 7 of 3 remote regions"), std::string::npos)
      << st.Message();
  st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote,
                         {{0, 0, 0, 0, 8}, {1, 0, 2, kRegionBytes - 4, 8}}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(st.Message().find("item 1: remote range"), std::string::npos) << st.Message();
  std::vector<MemoryDesc> foreign = rig.remote;
  foreign[1].engine_key = "nobody";
  st = rig.ini->transfer(Op::WRITE, rig.local, foreign, {{0, 0, 0, 0, 8}, {0, 8, 1, 8, 8}}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_NOT_FOUND) << st.Message();
  EXPECT_NE(st.Message().find("item 1"), std::string::npos) << st.Message();
  EXPECT_EQ(rig.dst[0], std::vector<uint8_t>(kRegionBytes, 0)) << "nothing moved";
}

// A batch over one region pair (Session::batch_write, Engine::batch_read):
// its items are copied, checked and counted in one pass; a bad item anywhere
// - size 0, past either region's end, an offset or length that wraps - refuses
// the whole batch at once, naming the first bad item, and nothing moves.
TEST(Batches, BadItemsAreRefusedByNumberBeforeAnythingMoves) {
  Rig rig;
  rig.fill(7);
  auto session = rig.ini->create_session(rig.local[0], rig.remote[0]);
  ASSERT_TRUE(session);
  constexpr size_t n = 4096, blk = kRegionBytes / n;
  std::vector<size_t> lo(n), ro(n), sz(n, blk);
  for (size_t i = 0; i < n; ++i) lo[i] = ro[i] = i * blk;
  struct Bad {
    size_t item;
    size_t lo, ro, size;
    const char* says;
  };
  const Bad cases[] = {
      {0, 0, 0, 0, "item 0 has size 0"},
      {4095, 0, 0, 0, "item 4095 has size 0"},
      {17, kRegionBytes - 8, 0, 16, "item 17: local range"},
      {2048, 0, kRegionBytes - 8, 16, "item 2048: remote range"},
      {5, kRegionBytes + 1, 0, 1, "item 5: local range"},
      {6, 0, SIZE_MAX - 4, 8, "item 6: remote range"},  // offset + size wraps
      {7, 8, 0, SIZE_MAX, "item 7: local range"},       // size alone wraps
  };
  for (const Bad& b : cases)
    for (bool second : {false, true}) {
      auto blo = lo, bro = ro, bsz = sz;
      blo[b.item] = b.lo;
      bro[b.item] = b.ro;
      bsz[b.item] = b.size;
      // Alone, and with a second bad item after it: the first is named.
      if (second && b.item + 1 < n) bsz[b.item + 1] = 0;
      for (Op op : {Op::WRITE, Op::READ}) {
        auto st = op == Op::WRITE ? session->batch_write(blo, bro, bsz, 0, false)
                                  : rig.ini->batch_read(rig.local[0], blo, rig.remote[0], bro, bsz,
                                                        rig.ini->allocate_transfer_uid());
        EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS) << b.says;
        EXPECT_NE(st.Message().find(b.says), std::string::npos) << st.Message();
      }
    }
  EXPECT_EQ(rig.dst[0], std::vector<uint8_t>(kRegionBytes, 0)) << "nothing moved";
  EXPECT_EQ(rig.ini->stats().backends["tcp"].transfers, 0u);
  // The same batch, every item good: it moves, every byte.
  auto st = session->batch_write(lo, ro, sz, 0, false);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(rig.dst[0], rig.src[0]);
}

TEST(MultiRegion, APartThatFailsFailsTheCallByNameAndTheTargetHearsNothing) {
  Rig rig;
  rig.fill(40);
  ASSERT_TRUE(rig.tgt->deregister_memory(rig.remote[2]));  // its part is refused there
  auto items = rig.items(64, 3);
  const TransferUid uid = rig.ini->allocate_transfer_uid();
  auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, items, uid, true, "never");
  ASSERT_TRUE(st.WaitFor(20s));
  EXPECT_TRUE(st.Failed()) << st.Message();
  EXPECT_NE(st.Message().find("-> " + std::to_string(rig.remote[2].id)), std::string::npos)
      << st.Message();
  EXPECT_FALSE(rig.tgt->wait_inbound_transfer_status("ini", uid, 300ms));
  EXPECT_TRUE(rig.tgt->wait_notifications(100ms).empty());
}

TEST(MultiRegion, PartsFailOverOnTheirOwnAndTheTargetIsToldOnce) {
  Rig rig("fail_first_n");  // the first two parts fail on 'fault', the rest go
  rig.fill(50);
  auto items = rig.items(48, 4);
  const TransferUid uid = rig.ini->allocate_transfer_uid();
  auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, items, uid, true, "once");
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_TRUE(rig.landed(items, Op::WRITE));
  EXPECT_EQ(rig.ini->stats().backends["fault"].failovers, 2u);
  EXPECT_EQ(rig.ini->stats().backends["tcp"].transfers, 2u);
  EXPECT_NE(st.Message().find("fault"), std::string::npos) << "says what failed over";
  EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", uid, 5s));
  EXPECT_EQ(rig.tgt->wait_notifications(5s)["ini"], std::vector<std::string>{"once"});
  EXPECT_TRUE(rig.tgt->wait_notifications(100ms).empty());
}

// A backend that takes several region pairs per post (plugin ABI 1.7,
// FERRY_CAP_MULTI_PAIR) gets a multi-region call as one post: one attempt,
// every pair's items in it, the target told once and the message once.
TEST(MultiPair, OneCallIsOnePostOverEveryPair) {
  Rig rig("ok", "faultmp");
  for (Op op : {Op::WRITE, Op::READ}) {
    rig.fill(op == Op::WRITE ? 60 : 70);
    if (op == Op::READ)
      for (size_t i = 0; i < kRegions; ++i)
        test::fill_pattern(rig.dst[i].data(), 0, kRegionBytes, 80 + i);
    auto items = rig.items(64, op == Op::WRITE ? 5 : 6);
    ASSERT_GT(Rig::pairs_of(items), 2u);
    const uint64_t posts = rig.counter("multi_posts"), pairs = rig.counter("multi_pairs");
    const TransferUid uid = rig.ini->allocate_transfer_uid();
    auto st = rig.ini->transfer(op, rig.local, rig.remote, items, uid, true, "one post");
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    EXPECT_TRUE(rig.landed(items, op));
    EXPECT_EQ(rig.counter("multi_posts"), posts + 1);
    EXPECT_EQ(rig.counter("multi_pairs"), pairs + Rig::pairs_of(items));
    EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", uid, 5s)) << "told once";
    EXPECT_FALSE(rig.tgt->wait_inbound_transfer_status("ini", uid, 100ms)) << "told twice";
    EXPECT_EQ(rig.tgt->wait_notifications(5s)["ini"], std::vector<std::string>{"one post"});
  }
  EXPECT_EQ(rig.ini->stats().backends["faultmp"].transfers, 2u) << "one transfer per call";
  EXPECT_EQ(rig.counter("posts_more"), 0u) << "nothing held for a next part";
  EXPECT_EQ(rig.ini->stats().backends["tcp"].transfers, 0u);
}

// Items usually come pair by pair (a connector's layer after layer): they go
// to the backend in call order, as they are. When a pair comes back after
// another, every item is regrouped. Both ways, each pair's items reach the
// backend over that pair's regions, and every byte lands where its item said.
TEST(MultiPair, ItemsPairByPairAndMixedBothLandWhereTheySaid) {
  Rig rig("ok", "faultmp");
  auto block = [](size_t l, size_t lb, size_t r, size_t rb) {
    return TransferItem{l, lb * kBlock, r, rb * kBlock, kBlock};
  };
  const std::vector<std::vector<TransferItem>> calls = {
      // pair by pair: (0,0) x3, (1,2) x2, (2,1) x2
      {block(0, 0, 0, 5), block(0, 1, 0, 6), block(0, 2, 0, 7), block(1, 3, 2, 8),
       block(1, 4, 2, 9), block(2, 5, 1, 10), block(2, 6, 1, 11)},
      // (0,0) comes back after (1,2), then a new pair, then (1,2) again
      {block(0, 0, 0, 5), block(0, 1, 0, 6), block(1, 3, 2, 8), block(0, 2, 0, 7),
       block(2, 5, 1, 10), block(1, 4, 2, 9), block(2, 6, 1, 11)},
      // a new pair's second item after another pair
      {block(0, 0, 0, 5), block(1, 3, 2, 8), block(2, 5, 1, 10), block(1, 4, 2, 9)},
  };
  uint64_t seed = 140;
  for (const auto& items : calls) {
    for (Op op : {Op::WRITE, Op::READ}) {
      rig.fill(++seed);
      if (op == Op::READ)
        for (size_t i = 0; i < kRegions; ++i)
          test::fill_pattern(rig.dst[i].data(), 0, kRegionBytes, seed * 10 + i);
      const uint64_t pairs = rig.counter("multi_pairs");
      auto st = rig.ini->transfer(op, rig.local, rig.remote, items,
                                  rig.ini->allocate_transfer_uid(), false);
      ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
      EXPECT_TRUE(rig.landed(items, op));
      EXPECT_EQ(rig.counter("multi_pairs") - pairs, Rig::pairs_of(items));
      // Nothing else was touched: a WRITE leaves every other destination byte 0.
      if (op == Op::WRITE) {
        size_t written = 0;
        for (size_t r = 0; r < kRegions; ++r)
          for (uint8_t b : rig.dst[r]) written += b != 0;
        size_t said = 0;
        for (const auto& it : items)
          for (size_t k = 0; k < it.size; ++k) said += rig.src[it.local][it.local_offset + k] != 0;
        EXPECT_EQ(written, said);
      }
    }
  }
}

// Long region lists (here 300 x 300 descriptors, each naming one of the
// three regions: more index pairs than the grouper's flat table holds) group
// through its hash table; the same region pair under several index pairs is
// simply several groups. Every byte lands where its item said.
TEST(MultiPair, LongRegionListsGroupThroughTheHashTable) {
  Rig rig("ok", "faultmp");
  constexpr size_t kDescs = 300;
  std::vector<MemoryDesc> local, remote;
  for (size_t i = 0; i < kDescs; ++i) {
    local.push_back(rig.local[i % kRegions]);
    remote.push_back(rig.remote[(i / 7) % kRegions]);
  }
  std::mt19937_64 rng(77);
  std::vector<TransferItem> items;
  const size_t per = kRegionBytes / kBlock;
  std::vector<size_t> free_blocks(kRegions * per);
  for (size_t i = 0; i < free_blocks.size(); ++i) free_blocks[i] = i;
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  for (size_t i = 0; i < 150; ++i) {  // each destination block once
    const size_t rb = free_blocks[i];
    size_t r = rng() % kDescs;
    while ((r / 7) % kRegions != rb / per) r = rng() % kDescs;
    const size_t l = rng() % kDescs;
    items.push_back({l, (rng() % per) * kBlock, r, (rb % per) * kBlock, kBlock});
  }
  for (Op op : {Op::WRITE, Op::READ}) {
    rig.fill(op == Op::WRITE ? 150 : 160);
    if (op == Op::READ) {
      for (size_t i = 0; i < kRegions; ++i)
        test::fill_pattern(rig.dst[i].data(), 0, kRegionBytes, 170 + i);
      // A READ writes local blocks: keep one item per local block.
      std::set<std::pair<size_t, size_t>> seen;
      std::vector<TransferItem> once;
      for (const auto& it : items)
        if (seen.insert({it.local % kRegions, it.local_offset}).second) once.push_back(it);
      items = once;
    }
    auto st = rig.ini->transfer(op, local, remote, items, rig.ini->allocate_transfer_uid(), false);
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    for (size_t i = 0; i < items.size(); ++i) {
      const auto& it = items[i];
      const uint8_t* l = rig.src[it.local % kRegions].data() + it.local_offset;
      const uint8_t* r = rig.dst[(it.remote / 7) % kRegions].data() + it.remote_offset;
      ASSERT_EQ(std::memcmp(l, r, it.size), 0) << "item " << i;
    }
  }
  EXPECT_EQ(rig.counter("multi_posts"), 2u);
}

// Random calls - runs of one pair of random length, pairs coming back, long
// and single-item runs, over 6 x 6 descriptors of the three regions - each
// checked byte for byte: every item lands where it said, nothing else is
// written. (The grouping keeps runs as they come and regroups only when a pair
// comes back; this walks both ways and every switch between them.)
TEST(MultiPair, RandomRunsAndReturnsAllLandWhereTheySaid) {
  Rig rig("ok", "faultmp");
  constexpr size_t kDescs = 6;
  std::vector<MemoryDesc> local, remote;
  for (size_t i = 0; i < kDescs; ++i) {
    local.push_back(rig.local[i % kRegions]);
    remote.push_back(rig.remote[(i + 1) % kRegions]);
  }
  const size_t per = kRegionBytes / kBlock;
  std::mt19937_64 rng(2026);
  for (int call = 0; call < 60; ++call) {
    rig.fill(200 + call);
    std::vector<size_t> dst_blocks(kRegions * per);
    for (size_t i = 0; i < dst_blocks.size(); ++i) dst_blocks[i] = i;
    std::shuffle(dst_blocks.begin(), dst_blocks.end(), rng);
    const size_t n = 1 + rng() % 120;
    const unsigned stick = static_cast<unsigned>(rng() % 100);  // % chance to stay on the pair
    std::vector<TransferItem> items;
    size_t l = rng() % kDescs, r = 0, used = 0;
    while (items.size() < n && used < dst_blocks.size()) {
      if (items.empty() || rng() % 100 >= stick) l = rng() % kDescs;
      // A destination block of the region the remote descriptor names.
      const size_t rb = dst_blocks[used++];
      r = (rb / per + kRegions - 1) % kRegions;  // remote[r] is region (r + 1) % 3
      if (rng() % 2) r += kRegions;              // or the other descriptor of it
      items.push_back({l, (rng() % per) * kBlock, r, (rb % per) * kBlock, kBlock});
    }
    auto st =
        rig.ini->transfer(Op::WRITE, local, remote, items, rig.ini->allocate_transfer_uid(), false);
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << "call " << call << ": " << st.Message();
    size_t expect_written = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      const auto& it = items[i];
      const uint8_t* from = rig.src[it.local % kRegions].data() + it.local_offset;
      const uint8_t* to = rig.dst[(it.remote + 1) % kRegions].data() + it.remote_offset;
      ASSERT_EQ(std::memcmp(from, to, it.size), 0) << "call " << call << " item " << i;
      for (size_t k = 0; k < it.size; ++k) expect_written += from[k] != 0;
    }
    size_t written = 0;
    for (size_t q = 0; q < kRegions; ++q)
      for (uint8_t b : rig.dst[q]) written += b != 0;
    ASSERT_EQ(written, expect_written) << "call " << call << ": bytes written elsewhere";
  }
}

// The whole call fails on the multi-pair backend; the next one (tcp) takes
// one pair per post, so the call goes on there as one transfer per pair -
// every byte lands, the target is told once, and the message says both.
TEST(MultiPair, FailoverToAOnePairBackendSplitsTheCallPerPair) {
  Rig rig("fail_complete", "faultmp");
  for (Op op : {Op::WRITE, Op::READ}) {
    rig.fill(op == Op::WRITE ? 90 : 100);
    if (op == Op::READ)
      for (size_t i = 0; i < kRegions; ++i)
        test::fill_pattern(rig.dst[i].data(), 0, kRegionBytes, 110 + i);
    auto items = rig.items(48, op == Op::WRITE ? 7 : 8);
    const uint64_t tcp_before = rig.ini->stats().backends["tcp"].transfers;
    const TransferUid uid = rig.ini->allocate_transfer_uid();
    auto st = rig.ini->transfer(op, rig.local, rig.remote, items, uid, true, "split");
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    EXPECT_TRUE(rig.landed(items, op));
    EXPECT_EQ(rig.ini->stats().backends["tcp"].transfers - tcp_before, Rig::pairs_of(items));
    EXPECT_NE(st.Message().find("faultmp: fault: scripted completion failure"), std::string::npos)
        << st.Message();
    EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", uid, 5s));
    EXPECT_FALSE(rig.tgt->wait_inbound_transfer_status("ini", uid, 100ms)) << "told twice";
    EXPECT_EQ(rig.tgt->wait_notifications(5s)["ini"], std::vector<std::string>{"split"});
    EXPECT_TRUE(rig.tgt->wait_notifications(100ms).empty());
  }
  EXPECT_EQ(rig.counter("multi_posts"), 2u);
}

// A cancel that races the split: the multi-pair attempt fails on another
// thread ('drop') and the call splits onto tcp there, while this thread
// cancels. Whichever wins, the call ends, and the target hears of it exactly
// when it ended SUCCESS (a cancelled call tells the target nothing). After
// each round a call that is not cancelled succeeds: a cancel fences only its
// own parts, it does not cut the lanes that carry the next call's. Its
// notification comes over the same control connection as a cancelled call's
// would have, and after it: once it is here, the cancelled ones never will be.
TEST(MultiPair, ACancelRacingTheSplitEndsTheCallAndTheTargetHearsOnlyOfSuccess) {
  Rig rig("drop", "faultmp");
  auto items = rig.items(48, 11);
  int cancelled = 0, landed = 0;
  for (int round = 0; round < 20; ++round) {
    const TransferUid uid = rig.ini->allocate_transfer_uid();
    const uint64_t tcp_before = rig.ini->stats().backends["tcp"].transfers;
    auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, items, uid, true);
    // Odd rounds cancel once a part has landed on tcp (the split has run and
    // the other parts may be in flight), even rounds at once.
    if (round % 2)
      while (st.InProgress() && rig.ini->stats().backends["tcp"].transfers == tcp_before)
        std::this_thread::yield();
    st.Cancel();
    ASSERT_TRUE(st.WaitFor(20s)) << "round " << round;
    if (st.Code() == StatusCode::SUCCESS) {
      ++landed;
      EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", uid, 5s)) << "round " << round;
    } else {
      ++cancelled;
      EXPECT_EQ(st.Code(), StatusCode::ERR_CANCELLED) << st.Message();
    }
    const TransferUid next = rig.ini->allocate_transfer_uid();
    auto after = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, items, next, true);
    ASSERT_EQ(after.Wait(), StatusCode::SUCCESS) << "round " << round << ": " << after.Message();
    EXPECT_TRUE(rig.tgt->wait_inbound_transfer_status("ini", next, 5s)) << "round " << round;
    if (st.Code() != StatusCode::SUCCESS) {
      EXPECT_FALSE(rig.tgt->pop_inbound_transfer_status("ini", uid)) << "round " << round;
    }
  }
  EXPECT_EQ(cancelled + landed, 20);
  std::printf("cancelled %d, landed %d of 20\n", cancelled, landed);
}

// The split parts keep the call's deadline and what is left of its attempts:
// with one attempt allowed, the failed multi-pair attempt leaves none, and
// the call fails naming it instead of running on.
TEST(MultiPair, SplitPartsShareTheCallsAttemptBudget) {
  Rig rig("fail_complete", "faultmp");
  std::ofstream(rig.policy) << "backends:\n  faultmp: {}\nrules:\n  - prefer: [faultmp, tcp]\n"
                               "failover:\n  max_attempts: 1\n"
                               "  quarantine: { after_failures: 100, within: 60s, for: 60s }\n"
                               "timeout: 10s\n";
  EngineConfig cfg;
  cfg.timeout = 10s;
  cfg.policy_file = rig.policy.string();
  Engine ini("ini1", cfg);
  ASSERT_TRUE(ini.add_backend("faultmp", "{\"mode\":\"fail_complete\"}"));
  ASSERT_TRUE(ini.add_backend("tcp"));
  ini.register_remote_engine(rig.tgt->desc());
  std::vector<MemoryDesc> local;
  for (size_t i = 0; i < kRegions; ++i)
    local.push_back(ini.register_memory(rig.src[i].data(), kRegionBytes));
  rig.fill(120);
  auto items = rig.items(32, 9);
  auto st = ini.transfer(Op::WRITE, local, rig.remote, items, ini.allocate_transfer_uid(), false);
  ASSERT_TRUE(st.WaitFor(20s));
  EXPECT_TRUE(st.Failed()) << st.Message();
  EXPECT_NE(st.Message().find("faultmp"), std::string::npos) << st.Message();
  EXPECT_EQ(ini.stats().backends["tcp"].transfers, 0u);
  EXPECT_EQ(rig.dst[0], std::vector<uint8_t>(kRegionBytes, 0)) << "nothing moved";
}

// A local region of any pair - not only the first - is in use while a
// multi-pair transfer is in flight: deregistering it waits for the transfer
// to end. ('deferred': the copy is made in post() but reported only by a
// waiter's progress(), so the transfer stays in flight until Wait().)
TEST(MultiPair, EveryPairsLocalRegionIsHeldUntilTheTransferEnds) {
  Rig rig("deferred", "faultmp");
  rig.fill(130);
  std::vector<TransferItem> items;
  for (size_t r = 0; r < kRegions; ++r)
    for (size_t b = 0; b < 4; ++b) items.push_back({r, b * kBlock, r, b * kBlock, kBlock});
  auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, items,
                              rig.ini->allocate_transfer_uid(), false);
  ASSERT_TRUE(st.InProgress());
  const MemoryDesc last = rig.local[kRegions - 1];
  auto gone = std::async(std::launch::async, [&] {
    Result r = rig.ini->deregister_memory(last);
    return std::make_pair(bool(r), st.InProgress());
  });
  // Still waiting (bounded look: a deregistration that did not wait would
  // have returned by now, seeing the transfer in flight).
  EXPECT_EQ(gone.wait_for(300ms), std::future_status::timeout);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  auto [ok, in_flight_then] = gone.get();
  EXPECT_TRUE(ok);
  EXPECT_FALSE(in_flight_then) << "deregistered while the transfer was still in flight";
  EXPECT_EQ(rig.counter("multi_posts"), 1u);
}

// Items of one pair in a row are checked as one run: a bad one in the middle
// of a run is still refused by its number in the call, for items and for
// prepared lists (an index outside the lists, unequal entry sizes, a range
// past a region that a stale descriptor claimed), and nothing moves.
TEST(MultiRegion, ABadItemInsideARunIsNamedByItsNumber) {
  Rig rig("ok", "faultmp");
  rig.fill(180);
  std::vector<TransferItem> items;
  for (size_t i = 0; i < 64; ++i) items.push_back({0, i * kBlock, 1, i * kBlock, kBlock});
  for (size_t i = 0; i < 16; ++i) items.push_back({2, i * kBlock, 2, i * kBlock, kBlock});
  auto bad = items;
  bad[37].remote_offset = kRegionBytes - kBlock / 2;
  auto st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, bad, 1, false);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(st.Message().find("item 37: remote range"), std::string::npos) << st.Message();
  bad = items;
  bad[70].size = 0;
  st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, bad, 1, false);
  EXPECT_NE(st.Message().find("item 70 has size 0"), std::string::npos) << st.Message();
  bad = items;
  bad[5].local = 9;
  st = rig.ini->transfer(Op::WRITE, rig.local, rig.remote, bad, 1, false);
  EXPECT_NE(st.Message().find("item 5 names region 9"), std::string::npos) << st.Message();

  std::vector<ListEntry> entries;
  const size_t per = kRegionBytes / kBlock;
  for (size_t r = 0; r < kRegions; ++r)
    for (size_t b = 0; b < per; ++b) entries.push_back({r, b * kBlock, kBlock});
  entries.push_back({0, 0, kBlock / 2});  // the last entry: half a block
  MemoryDesc claims = rig.local[0];
  claims.size = 2 * kRegionBytes;
  std::vector<ListEntry> big_entries = entries;
  big_entries.push_back({0, kRegionBytes, kBlock});  // past the registered region
  PreparedList lp = rig.ini->prepare_list({claims, rig.local[1], rig.local[2]}, big_entries);
  PreparedList rp = rig.ini->prepare_list(rig.remote, entries);
  std::vector<int64_t> li, ri;
  for (int64_t i = 0; i < 48; ++i) {
    li.push_back(i);
    ri.push_back(i + 3);
  }
  auto post = [&](const std::vector<int64_t>& l, const std::vector<int64_t>& r) {
    return rig.ini->transfer(Op::WRITE, lp, l, rp, r, 1, false);
  };
  auto l2 = li, r2 = ri;
  r2[21] = 1 << 30;
  st = post(l2, r2);
  EXPECT_NE(st.Message().find("item 21: index"), std::string::npos) << st.Message();
  l2 = li, r2 = ri;
  r2[30] = static_cast<int64_t>(entries.size() - 1);  // half a block against a whole one
  st = post(l2, r2);
  EXPECT_NE(st.Message().find("item 30: local entry"), std::string::npos) << st.Message();
  l2 = li, r2 = ri;
  l2[44] = static_cast<int64_t>(big_entries.size() - 1);  // past the real local region
  st = post(l2, r2);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(st.Message().find("item 44: local range"), std::string::npos) << st.Message();
  // Two bad items, a range at 10 and an index at 12: the first is named.
  l2 = li, r2 = ri;
  l2[10] = static_cast<int64_t>(big_entries.size() - 1);
  r2[12] = -4;
  st = post(l2, r2);
  EXPECT_NE(st.Message().find("item 10: local range"), std::string::npos) << st.Message();
  for (size_t r = 0; r < kRegions; ++r)
    EXPECT_EQ(rig.dst[r], std::vector<uint8_t>(kRegionBytes, 0)) << "nothing moved";
  // The same runs, every item good: all of it lands.
  st = post(li, ri);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  for (size_t i = 0; i < li.size(); ++i)
    EXPECT_EQ(std::memcmp(rig.src[0].data() + entries[li[i]].offset,
                          rig.dst[0].data() + entries[ri[i]].offset, kBlock),
              0)
        << "item " << i;
}

TEST(PreparedLists, PostByIndexArrays) {
  Rig rig;
  std::vector<ListEntry> entries;
  const size_t per = kRegionBytes / kBlock;
  for (size_t r = 0; r < kRegions; ++r)
    for (size_t b = 0; b < per; ++b) entries.push_back({r, b * kBlock, kBlock});
  PreparedList lp = rig.ini->prepare_list(rig.local, entries);
  PreparedList rp = rig.ini->prepare_list(rig.remote, entries);
  EXPECT_TRUE(lp.local());
  EXPECT_FALSE(rp.local());
  EXPECT_EQ(rp.size(), kRegions * per);
  EXPECT_EQ(rp.engine_key(), "tgt");
  for (int round = 0; round < 3; ++round) {  // the second and third reuse the resolved pairs
    rig.fill(60 + round);
    std::mt19937_64 rng(round);
    std::vector<int64_t> li, ri;
    std::vector<int64_t> all(entries.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    std::shuffle(all.begin(), all.end(), rng);
    for (size_t i = 0; i < 100; ++i) {
      ri.push_back(all[i]);
      li.push_back(all[(i + 50) % all.size()]);
    }
    auto st = rig.ini->transfer(Op::WRITE, lp, li, rp, ri, rig.ini->allocate_transfer_uid(), false,
                                "round " + std::to_string(round));
    ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
    for (size_t i = 0; i < li.size(); ++i) {
      const ListEntry &l = entries[li[i]], &r = entries[ri[i]];
      ASSERT_EQ(std::memcmp(rig.src[l.region].data() + l.offset,
                            rig.dst[r.region].data() + r.offset, kBlock),
                0)
          << "item " << i;
    }
    EXPECT_EQ(rig.tgt->wait_notifications(5s)["ini"],
              std::vector<std::string>{"round " + std::to_string(round)});
  }
  // Refusals: indices out of the lists, unequal sizes, lists swapped, bad slices.
  auto st = rig.ini->transfer(Op::WRITE, lp, std::vector<int64_t>{0, 99999}, rp,
                              std::vector<int64_t>{0, 1}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(st.Message().find("item 1"), std::string::npos) << st.Message();
  st = rig.ini->transfer(Op::WRITE, lp, std::vector<int64_t>{-1}, rp, std::vector<int64_t>{0}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  st = rig.ini->transfer(Op::WRITE, rp, std::vector<int64_t>{0}, lp, std::vector<int64_t>{0}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  PreparedList half = rig.ini->prepare_list(rig.remote, {{0, 0, kBlock / 2}});
  st = rig.ini->transfer(Op::WRITE, lp, std::vector<int64_t>{0}, half, std::vector<int64_t>{0}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_INVALID_ARGS);
  EXPECT_NE(st.Message().find("bytes"), std::string::npos) << st.Message();
  EXPECT_THROW(rig.ini->prepare_list(rig.remote, {{0, kRegionBytes - 1, 2}}), Error);
  EXPECT_THROW(rig.ini->prepare_list(rig.remote, {{5, 0, 1}}), Error);
  EXPECT_THROW(rig.ini->prepare_list({rig.local[0], rig.remote[0]}, {{0, 0, 1}}), Error);
  EXPECT_THROW(rig.ini->prepare_list(rig.remote, {}), Error);
  // A local list over memory no longer registered is refused when made
  // (ferry.hpp: ERR_NOT_FOUND), not at its first transfer.
  std::vector<uint8_t> spare(kBlock);
  MemoryDesc gone = rig.ini->register_memory(spare.data(), spare.size());
  ASSERT_TRUE(rig.ini->deregister_memory(gone).ok());
  try {
    rig.ini->prepare_list({gone}, {{0, 0, kBlock}});
    ADD_FAILURE() << "a local list over deregistered memory was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_NOT_FOUND) << e.what();
  }
  // A list prepared over a descriptor claiming more than was registered: its
  // entries past the real region are refused when posted, by the call's item
  // number, and nothing moves.
  MemoryDesc claims = rig.local[1];
  claims.size = 2 * kRegionBytes;
  PreparedList big = rig.ini->prepare_list({claims}, {{0, 0, kBlock}, {0, kRegionBytes, kBlock}});
  rig.fill(70);
  st = rig.ini->transfer(Op::WRITE, big, std::vector<int64_t>{0, 0, 1}, rp,
                         std::vector<int64_t>{0, 1, 2}, 1);
  EXPECT_EQ(st.Wait(), StatusCode::ERR_INVALID_ARGS) << st.Message();
  EXPECT_NE(st.Message().find("item 2: local range"), std::string::npos) << st.Message();
  EXPECT_EQ(rig.dst[0], std::vector<uint8_t>(kRegionBytes, 0)) << "nothing moved";
  // A peer gone: the cached pairs are not used; the post fails, saying why.
  ASSERT_TRUE(rig.ini->deregister_remote_engine("tgt"));
  st = rig.ini->transfer(Op::WRITE, lp, std::vector<int64_t>{0}, rp, std::vector<int64_t>{0}, 1);
  EXPECT_EQ(st.Code(), StatusCode::ERR_NOT_FOUND) << st.Message();
}
