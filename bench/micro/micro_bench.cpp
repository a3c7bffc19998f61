// SPDX-License-Identifier: Apache-2.0
// Google Benchmark micro benches for ferry's hot paths:
//  - submit overhead per transfer through the engine API and a session, with a
//    bench-only "null" backend that completes inside post(): what is measured is
//    the core's own cost (validate, route lookup, attempt, completion, status);
//  - descriptor encode/decode (what a peer does with every descriptor it gets);
//  - route decision (policy match + candidate filtering, the route-cache miss path);
//  - the tcp plugin's frame planner and header codec (per-frame CPU cost).
//   run: build/bin/ferry-micro-bench [--benchmark_filter=Session]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <vector>

#include "ferry/ferry.hpp"
#include "gather_rows.h"
#include "planner.h"
#include "policy.h"
#include "router.h"
#include "wire.h"

using namespace ferry;

namespace {

// Two engines in this process, both with the null backend; "a" writes to "b".
struct Rig {
  std::unique_ptr<Engine> a, b;
  // 32 MiB: a batch of 4096 strided 4 KiB items (the KV case of issue 19).
  std::vector<uint8_t> la_mem = std::vector<uint8_t>(32 << 20),
                       rb_mem = std::vector<uint8_t>(32 << 20);
  MemoryDesc la, rb;
  std::mutex mu;
  std::vector<std::unique_ptr<Session>> sessions;  // one per benchmark thread

  Rig() {
    EngineConfig cfg;
    cfg.plugin_dirs = {FERRY_NULL_PLUGIN_DIR};
    a = std::make_unique<Engine>("micro-a", cfg);
    b = std::make_unique<Engine>("micro-b", cfg);
    for (Engine* e : {a.get(), b.get()}) {
      if (Result r = e->add_backend("null"); !r) {
        std::fprintf(stderr, "ferry-micro-bench: %s\n", r.message.c_str());
        std::exit(1);
      }
    }
    la = a->register_memory(la_mem.data(), la_mem.size(), -1, MemoryLocation::CPU);
    rb = b->register_memory(rb_mem.data(), rb_mem.size(), -1, MemoryLocation::CPU);
    if (Result r = a->register_remote_engine(b->desc()); !r) {
      std::fprintf(stderr, "ferry-micro-bench: %s\n", r.message.c_str());
      std::exit(1);
    }
  }
  Session& session(int thread) {
    std::lock_guard lk(mu);
    while (sessions.size() <= static_cast<size_t>(thread)) {
      Result why;
      auto s = a->create_session(la, rb, &why);
      if (!s) {
        std::fprintf(stderr, "ferry-micro-bench: no session: %s\n", why.message.c_str());
        std::exit(1);
      }
      sessions.push_back(std::move(s));
    }
    return *sessions[static_cast<size_t>(thread)];
  }
};

Rig& rig() {
  static Rig r;
  return r;
}

void check(benchmark::State& state, const TransferStatus& st) {
  if (!st.Succeeded()) state.SkipWithError(("transfer did not succeed: " + st.Message()).c_str());
}

// ---- submit overhead -------------------------------------------------------------

void BM_SessionWrite(benchmark::State& state) {
  Session& s = rig().session(state.thread_index());
  const bool notify = state.range(0) != 0;
  const size_t off = static_cast<size_t>(state.thread_index()) * 4096;
  TransferUid uid = s.allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = s.write(off, off, 8, uid++, notify);
    benchmark::DoNotOptimize(st);
  }
  check(state, st);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SessionWrite)->ArgName("notify")->Arg(0)->Arg(1)->ThreadRange(1, 2)->UseRealTime();

// The same write with the caches cooled between calls: a GPU backend's copy
// call runs microseconds of driver code between two transfers, which evicts
// what the core touches (issue 19: the core's share of an xgmi call on the GPU
// host was ~2.5 us, against well under 1 us here hot). The argument is how
// many KiB are written between calls (untimed); the time is the call alone.
void BM_SessionWriteColdCache(benchmark::State& state) {
  Session& s = rig().session(0);
  std::vector<uint8_t> evict(static_cast<size_t>(state.range(0)) << 10);
  TransferUid uid = s.allocate_transfer_uid();
  TransferStatus st;
  uint8_t round = 0;
  for (auto _ : state) {
    std::fill(evict.begin(), evict.end(), ++round);
    benchmark::ClobberMemory();
    const auto t0 = std::chrono::steady_clock::now();
    st = s.write(0, 0, 8, uid++, false);
    benchmark::DoNotOptimize(st);
    const auto t1 = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
  }
  check(state, st);
  state.SetItemsProcessed(state.iterations());
}
// (A fixed count: the untimed eviction would otherwise run for a minute.)
BENCHMARK(BM_SessionWriteColdCache)
    ->ArgName("evict_kib")
    ->Arg(0)
    ->Arg(1024)
    ->Arg(8192)
    ->UseManualTime()
    ->Iterations(20000);

void BM_SessionRead(benchmark::State& state) {
  Session& s = rig().session(0);
  TransferUid uid = s.allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = s.read(0, 0, 8, uid++, false);
    benchmark::DoNotOptimize(st);
  }
  check(state, st);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SessionRead);

void BM_EngineWrite(benchmark::State& state) {
  Rig& r = rig();
  TransferUid uid = r.a->allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = r.a->write(r.la, 0, r.rb, 0, 8, uid++, false);
    benchmark::DoNotOptimize(st);
  }
  check(state, st);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_EngineWrite);

// A batch of N 4 KiB items, strided (nothing merges); items/s counts items.
void BM_SessionBatchWrite(benchmark::State& state) {
  Session& s = rig().session(0);
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<size_t> offs(n), sizes(n, 4096);
  for (size_t i = 0; i < n; ++i) offs[i] = i * 8192;
  TransferUid uid = s.allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = s.batch_write(offs, offs, sizes, uid++, false);
    benchmark::DoNotOptimize(st);
  }
  check(state, st);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
}
BENCHMARK(BM_SessionBatchWrite)->Arg(1)->Arg(16)->Arg(128)->Arg(1024)->Arg(4096);

// ---- a KV-cache request: 10,000 blocks over 32 layers x {K, V} regions ------------
// The same items posted three ways: by index into prepared lists, as one
// multi-region transfer() of items, and as one batch per region pair (what a
// client without multi-region calls does). items/s counts blocks; the null
// backend completes inside post(), so this is the core's cost per block.
struct KvRig {
  static constexpr size_t kRegions = 64, kRegionBytes = 1 << 20, kBlock = 4096, kItems = 10000;
  std::vector<std::vector<uint8_t>> lmem, rmem;
  std::vector<MemoryDesc> local, remote;
  std::vector<TransferItem> items;     // interleaved: each item another pair's
  std::vector<TransferItem> by_layer;  // the same, pair by pair (a connector's order)
  std::vector<int64_t> li, ri;
  std::vector<int64_t> li_by_layer, ri_by_layer;  // the indices in by_layer's order
  std::unique_ptr<PreparedList> lp, rp;
  KvRig() {
    Rig& r = rig();
    for (size_t i = 0; i < kRegions; ++i) {
      lmem.emplace_back(kRegionBytes);
      rmem.emplace_back(kRegionBytes);
      local.push_back(
          r.a->register_memory(lmem.back().data(), kRegionBytes, -1, MemoryLocation::CPU));
      remote.push_back(
          r.b->register_memory(rmem.back().data(), kRegionBytes, -1, MemoryLocation::CPU));
    }
    const size_t per = kRegionBytes / kBlock;
    std::vector<ListEntry> entries;
    for (size_t g = 0; g < kRegions; ++g)
      for (size_t b = 0; b < per; ++b) entries.push_back({g, b * kBlock, kBlock});
    lp = std::make_unique<PreparedList>(r.a->prepare_list(local, entries));
    rp = std::make_unique<PreparedList>(r.a->prepare_list(remote, entries));
    uint64_t x = 88172645463325252ull;  // xorshift: block ids per request, as a scheduler's
    for (size_t i = 0; i < kItems; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      const size_t g = i % kRegions, lb = (x >> 8) % per, rb = (x >> 24) % per;
      items.push_back({g, lb * kBlock, g, rb * kBlock, kBlock});
      li.push_back(static_cast<int64_t>(g * per + lb));
      ri.push_back(static_cast<int64_t>(g * per + rb));
    }
    by_layer = items;
    std::stable_sort(
        by_layer.begin(), by_layer.end(),
        [](const TransferItem& a, const TransferItem& b) { return a.local < b.local; });
    for (const TransferItem& it : by_layer) {
      li_by_layer.push_back(static_cast<int64_t>(it.local * per + it.local_offset / kBlock));
      ri_by_layer.push_back(static_cast<int64_t>(it.remote * per + it.remote_offset / kBlock));
    }
  }
};
KvRig& kv() {
  static KvRig k;
  return k;
}

void kv_prepared(benchmark::State& state, const std::vector<int64_t>& li,
                 const std::vector<int64_t>& ri) {
  KvRig& k = kv();
  Engine& a = *rig().a;
  TransferUid uid = a.allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = a.transfer(Op::WRITE, *k.lp, li, *k.rp, ri, uid++, false);
    benchmark::DoNotOptimize(st);
  }
  st.Wait();
  check(state, st);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(KvRig::kItems));
}

void BM_KvPrepared(benchmark::State& state) { kv_prepared(state, kv().li, kv().ri); }
BENCHMARK(BM_KvPrepared)->UseRealTime();

// Layer after layer, as vLLM's connector lays out its descriptor ids.
void BM_KvPreparedByLayer(benchmark::State& state) {
  kv_prepared(state, kv().li_by_layer, kv().ri_by_layer);
}
BENCHMARK(BM_KvPreparedByLayer)->UseRealTime();

// One multi-region transfer() of `items` per iteration.
void kv_items(benchmark::State& state, const std::vector<TransferItem>& items) {
  KvRig& k = kv();
  Engine& a = *rig().a;
  TransferUid uid = a.allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = a.transfer(Op::WRITE, k.local, k.remote, items, uid++, false);
    benchmark::DoNotOptimize(st);
  }
  st.Wait();
  check(state, st);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(KvRig::kItems));
}

void BM_KvItems(benchmark::State& state) { kv_items(state, kv().items); }
BENCHMARK(BM_KvItems)->UseRealTime();

// The same items pair by pair: they need no regrouping (multi_region.cpp).
void BM_KvItemsByLayer(benchmark::State& state) { kv_items(state, kv().by_layer); }
BENCHMARK(BM_KvItemsByLayer)->UseRealTime();

void BM_KvPerRegionBatches(benchmark::State& state) {
  KvRig& k = kv();
  Engine& a = *rig().a;
  std::vector<std::vector<size_t>> lo(KvRig::kRegions), ro(KvRig::kRegions), sz(KvRig::kRegions);
  for (const auto& it : k.items) {
    lo[it.local].push_back(it.local_offset);
    ro[it.local].push_back(it.remote_offset);
    sz[it.local].push_back(it.size);
  }
  TransferUid uid = a.allocate_transfer_uid();
  std::vector<TransferStatus> st(KvRig::kRegions);
  for (auto _ : state) {
    for (size_t g = 0; g < KvRig::kRegions; ++g)
      st[g] = a.batch_write(k.local[g], lo[g], k.remote[g], ro[g], sz[g], uid++, false);
    benchmark::DoNotOptimize(st);
  }
  wait_all(st);
  for (auto& s : st) check(state, s);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(KvRig::kItems));
}
BENCHMARK(BM_KvPerRegionBatches)->UseRealTime();

void BM_EngineBatchWrite(benchmark::State& state) {
  Rig& r = rig();
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<size_t> offs(n), sizes(n, 4096);
  for (size_t i = 0; i < n; ++i) offs[i] = i * 8192;
  TransferUid uid = r.a->allocate_transfer_uid();
  TransferStatus st;
  for (auto _ : state) {
    st = r.a->batch_write(r.la, offs, r.rb, offs, sizes, uid++, false);
    benchmark::DoNotOptimize(st);
  }
  check(state, st);
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
}
BENCHMARK(BM_EngineBatchWrite)->Arg(128);

// The floor under every transfer: one status object, finished and read.
void BM_TransferStatusLifecycle(benchmark::State& state) {
  for (auto _ : state) {
    TransferStatus st;
    st.SetInProgress();
    st.Finish(StatusCode::SUCCESS);
    benchmark::DoNotOptimize(st.Wait());
  }
}
BENCHMARK(BM_TransferStatusLifecycle);

// ---- the GPU shim's gather table, without a GPU -----------------------------------
// gather::write_rows into plain memory: N pieces of 4 KiB, scattered (arg 1 = 0:
// one row each) or in contiguous runs of 4 (arg 1 = 1: a KV block's pages,
// merged into rows of 16 KiB). FERRY_ITEM_SIMD=0 in the environment runs the
// one-at-a-time loop (item_pass.h) for an A/B in the same build.
void BM_GatherRows(benchmark::State& state) {
  const auto n = static_cast<size_t>(state.range(0));
  const bool runs = state.range(1) != 0;
  std::vector<ferry_iov_v1> iov(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t at = runs ? (i / 4) * 32768 + (i % 4) * 4096 : i * 8192;
    iov[i] = {at, at, 4096};
  }
  const ferry_gpu_seg_v1 seg{reinterpret_cast<char*>(1ULL << 40),
                             1ULL << 30,
                             reinterpret_cast<char*>(2ULL << 40),
                             1ULL << 30,
                             iov.data(),
                             n};
  std::vector<unsigned long long> cols(3 * n);
  gather::Table t{cols.data(), cols.data() + n, cols.data() + 2 * n, n};
  const auto no_growth = [](void*, size_t, size_t, gather::Table*) { return FERRY_ERR_NO_MEMORY; };
  for (auto _ : state) {
    gather::Written w =
        gather::write_rows(FERRY_OP_WRITE, &seg, 1, n, &t, no_growth, nullptr, true);
    benchmark::DoNotOptimize(w);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
}
BENCHMARK(BM_GatherRows)->Args({4096, 0})->Args({1024, 0})->Args({4096, 1});

// ---- descriptors -------------------------------------------------------------------

void BM_MemoryDescUnpack(benchmark::State& state) {
  const std::vector<uint8_t> bytes = rig().rb.pack();
  for (auto _ : state) benchmark::DoNotOptimize(MemoryDesc::unpack(bytes));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(BM_MemoryDescUnpack);

void BM_MemoryDescPack(benchmark::State& state) {
  const MemoryDesc d = rig().rb;
  for (auto _ : state) benchmark::DoNotOptimize(d.pack());
}
BENCHMARK(BM_MemoryDescPack);

void BM_EngineDescUnpack(benchmark::State& state) {
  const std::vector<uint8_t> bytes = rig().b->desc().pack();
  for (auto _ : state) benchmark::DoNotOptimize(EngineDesc::unpack(bytes));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes.size()));
}
BENCHMARK(BM_EngineDescUnpack);

// ---- routing -------------------------------------------------------------------------

void BM_PolicyMatch(benchmark::State& state) {
  const Policy p = builtin_policy();
  RouteQuery q;
  q.peer_key = "decode-7";
  q.bytes = 4096;
  for (auto _ : state) benchmark::DoNotOptimize(p.match(q));
}
BENCHMARK(BM_PolicyMatch);

// What a route-cache miss costs: rule match plus checking every candidate.
void BM_RouteDecision(benchmark::State& state) {
  const Policy p = builtin_policy();
  const uint64_t cpu = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE;
  const std::set<std::string> adv{"tcp", "ofi", "rdma", "null"};
  RouteInputs in;
  in.query.peer_key = "decode-7";
  in.query.bytes = 1 << 20;
  in.loaded = {{"tcp", cpu}, {"ofi", cpu}, {"rdma", cpu | FERRY_CAP_MEM_GPU}, {"null", cpu}};
  in.peer_backends = &adv;
  in.local_mem_backends = &adv;
  in.remote_mem_backends = &adv;
  in.unusable = [](const std::string&) { return std::string(); };
  for (auto _ : state) benchmark::DoNotOptimize(route(p, in));
}
BENCHMARK(BM_RouteDecision);

// ---- tcp plugin per-frame CPU --------------------------------------------------------

void BM_TcpPlanFrames(benchmark::State& state) {
  const auto n = static_cast<uint32_t>(state.range(0));
  std::vector<ferry_iov_v1> iov(n);
  for (uint32_t i = 0; i < n; ++i) iov[i] = {i * 8192ull, i * 8192ull, 4096};
  static std::vector<uint8_t> base(2u << 20);
  for (auto _ : state)
    benchmark::DoNotOptimize(ferry_tcp::PlanFrames(iov.data(), n, base.data(), 1 << 20, 8192));
  state.SetItemsProcessed(state.iterations() * n);
}
BENCHMARK(BM_TcpPlanFrames)->Arg(1)->Arg(128);

void BM_TcpHeaderDecode(benchmark::State& state) {
  ferry_tcp::wire::Header h;
  h.type = ferry_tcp::wire::Type::kWrite;
  h.n_items = 1;
  h.frame_count = 1;
  h.req_id = 7;
  h.payload_len = 4096;
  uint8_t buf[ferry_tcp::wire::kHeaderSize];
  ferry_tcp::wire::EncodeHeader(h, buf);
  std::string why;
  for (auto _ : state) {
    ferry_tcp::wire::Header out;
    benchmark::DoNotOptimize(ferry_tcp::wire::DecodeHeader(buf, &out, &why));
    benchmark::DoNotOptimize(out);
  }
}
BENCHMARK(BM_TcpHeaderDecode);

}  // namespace

BENCHMARK_MAIN();
