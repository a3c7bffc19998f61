// SPDX-License-Identifier: Apache-2.0
#include "kv_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "gpu_runtime.h"
#include "pattern.h"

namespace ferry::bench {

namespace {

using Clock = std::chrono::steady_clock;

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Request {
  std::vector<size_t> src, dst;  // block ids, the same for every layer
};

struct Result {
  std::vector<double> prep_ms, post_ms, wait_ms, total_ms;
  bool ok = true, verified = false;
  std::string error;
};

class KvRun {
 public:
  KvRun(const KvOptions& k, Engine& e, const std::function<std::string(const std::string&)>& ask)
      : k_(k), e_(e), ask_(ask), regions_(static_cast<size_t>(2 * k.layers)) {}

  bool setup() {
    const size_t bytes = k_.blocks * k_.block_bytes;
    std::istringstream in(
        ask_("kvregions " + std::to_string(regions_) + " " + std::to_string(bytes)));
    std::string word;
    in >> word;
    if (word != "KVREGIONS") {
      std::fprintf(stderr, "ferry-bench --kv: target: %s\n", in.str().c_str());
      return false;
    }
    for (std::string hex; in >> hex;) remote_.push_back(MemoryDesc::unpack(test::from_hex(hex)));
    if (remote_.size() != regions_) return false;
    std::vector<ListEntry> entries;
    for (size_t r = 0; r < regions_; ++r) {
      std::string why;
      auto s = Segment::allocate(k_.init_seg, k_.init_dev, bytes, &why);
      if (!s) {
        std::fprintf(stderr, "ferry-bench --kv: %s\n", why.c_str());
        return false;
      }
      s->fill_pattern(0, bytes, 1000 + r);
      local_.push_back(
          e_.register_memory(s->data(), s->size(), s->registration_device(), s->location()));
      segs_.push_back(std::move(s));
      for (size_t b = 0; b < k_.blocks; ++b)
        entries.push_back({r, b * k_.block_bytes, k_.block_bytes});
    }
    lp_ = std::make_unique<PreparedList>(e_.prepare_list(local_, entries));
    rp_ = std::make_unique<PreparedList>(e_.prepare_list(remote_, entries));
    return true;
  }

  Request request(std::mt19937_64& rng) const {
    std::vector<size_t> ids(k_.blocks);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = i;
    Request r;
    std::shuffle(ids.begin(), ids.end(), rng);
    r.src.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k_.request_blocks));
    std::shuffle(ids.begin(), ids.end(), rng);
    r.dst.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(k_.request_blocks));
    return r;
  }

  // One request by `method`: 0 prepared lists, 1 items, 2 per-region batches.
  void run_one(int method, const Request& rq, uint64_t n, Result& res) {
    const std::string msg = "req-" + std::to_string(n) + ":done";
    const TransferUid uid = e_.allocate_transfer_uid();
    const auto t0 = Clock::now();
    std::vector<TransferStatus> st;
    Clock::time_point t1, t2;
    if (method == 0) {
      std::vector<int64_t> li, ri;
      li.reserve(regions_ * rq.src.size());
      ri.reserve(li.capacity());
      for (size_t r = 0; r < regions_; ++r)
        for (size_t i = 0; i < rq.src.size(); ++i) {
          li.push_back(static_cast<int64_t>(r * k_.blocks + rq.src[i]));
          ri.push_back(static_cast<int64_t>(r * k_.blocks + rq.dst[i]));
        }
      t1 = Clock::now();
      st.push_back(e_.transfer(k_.op, *lp_, li, *rp_, ri, uid, false, msg));
      t2 = Clock::now();
    } else if (method == 1) {
      std::vector<TransferItem> items;
      items.reserve(regions_ * rq.src.size());
      for (size_t r = 0; r < regions_; ++r)
        for (size_t i = 0; i < rq.src.size(); ++i)
          items.push_back(
              {r, rq.src[i] * k_.block_bytes, r, rq.dst[i] * k_.block_bytes, k_.block_bytes});
      t1 = Clock::now();
      st.push_back(e_.transfer(k_.op, local_, remote_, items, uid, false, msg));
      t2 = Clock::now();
    } else {
      std::vector<size_t> lo(rq.src.size()), ro(rq.src.size()), sz(rq.src.size(), k_.block_bytes);
      for (size_t i = 0; i < rq.src.size(); ++i) {
        lo[i] = rq.src[i] * k_.block_bytes;
        ro[i] = rq.dst[i] * k_.block_bytes;
      }
      t1 = Clock::now();
      for (size_t r = 0; r < regions_; ++r)
        st.push_back(k_.op == Op::WRITE
                         ? e_.batch_write(local_[r], lo, remote_[r], ro, sz, uid, false)
                         : e_.batch_read(local_[r], lo, remote_[r], ro, sz, uid, false));
      t2 = Clock::now();
    }
    wait_all(st);
    for (auto& s : st)
      if (!s.Succeeded()) {
        res.ok = false;
        res.error = s.Message();
      }
    if (method == 2 && res.ok) {  // the message the other two carry inside the call
      auto m = e_.send_notification(remote_[0].engine_key, msg);
      if (m.Wait() != StatusCode::SUCCESS) {
        res.ok = false;
        res.error = m.Message();
      }
    }
    const auto t3 = Clock::now();
    res.prep_ms.push_back(ms(t1 - t0));
    res.post_ms.push_back(ms(t2 - t1));
    res.wait_ms.push_back(ms(t3 - t2));
    res.total_ms.push_back(ms(t3 - t0));
  }

  // A sample of the last request's blocks, hashed on both sides.
  bool verify(const Request& rq) {
    for (size_t s = 0; s < 8; ++s) {
      const size_t r = (s * 7) % regions_, i = (s * 13) % rq.src.size();
      const uint64_t loff = rq.src[i] * k_.block_bytes, roff = rq.dst[i] * k_.block_bytes;
      const uint64_t want = segs_[r]->fnv1a(loff, k_.block_bytes, test::kFnvBasis);
      const std::string got = ask_("kvhash " + std::to_string(r) + " " + std::to_string(roff) +
                                   " " + std::to_string(k_.block_bytes));
      if (got != "HASH " + std::to_string(want)) return false;
    }
    return true;
  }

  size_t regions() const { return regions_; }

  // The raw reference, measured in the same run over the same requests: the
  // floor of the path under test, without ferry.
  // - DRAM: one thread's memcpy of the request's blocks (every layer) out of
  //   the local regions into a scratch buffer, in request order;
  // - VRAM: one call of the GPU runtime shim's batch copy (the gather kernel
  //   xgmi uses) moving every block of the request from the local regions
  //   into a scratch buffer on the same device, then a stream sync. The
  //   pointer table is built before the clock starts. With both engines on
  //   one device (the one-GPU host) this is xgmi's copy with nothing around it.
  // False when there is none (no GPU runtime, no scratch memory).
  bool raw_copy(const Request& rq, double* took_ms) {
    return k_.init_seg == SegType::DRAM ? raw_memcpy(rq, took_ms) : raw_gather(rq, took_ms);
  }
  const char* raw_name() const {
    return k_.init_seg == SegType::DRAM ? "raw: memcpy, 1 thread" : "raw: gather kernel, 1 call";
  }

  ~KvRun() {
    if (stream_ != nullptr) gpu_runtime()->stream_destroy(gpu_runtime()->gpu_ctx, stream_);
  }

 private:
  bool raw_memcpy(const Request& rq, double* took_ms) {
    const size_t bb = k_.block_bytes;
    scratch_.resize(regions_ * rq.src.size() * bb);
    const auto t0 = Clock::now();
    uint8_t* out = scratch_.data();
    for (size_t r = 0; r < regions_; ++r) {
      const auto* base = static_cast<const uint8_t*>(segs_[r]->data());
      for (size_t id : rq.src) {
        std::memcpy(out, base + id * bb, bb);
        out += bb;
      }
    }
    *took_ms = ms(Clock::now() - t0);
    return true;
  }

  bool raw_gather(const Request& rq, double* took_ms) {
    const ferry_gpu_v1* g = gpu_runtime();
    if (g == nullptr || segs_.empty()) return false;
    const size_t bb = k_.block_bytes, n = regions_ * rq.src.size();
    if (!gpu_scratch_ || gpu_scratch_->size() < n * bb) {
      std::string why;
      gpu_scratch_ = Segment::allocate(SegType::VRAM, segs_[0]->device(), n * bb, &why);
      if (!gpu_scratch_) return false;
    }
    if (g->set_device(g->gpu_ctx, segs_[0]->device()) != FERRY_OK) return false;
    if (stream_ == nullptr && g->stream_create(g->gpu_ctx, &stream_) != FERRY_OK) return false;
    std::vector<void*> dsts(n);
    std::vector<const void*> srcs(n);
    std::vector<size_t> sizes(n, bb);
    size_t i = 0;
    for (size_t r = 0; r < regions_; ++r)
      for (size_t id : rq.src) {
        srcs[i] = segs_[r]->data() + id * bb;
        dsts[i] = gpu_scratch_->data() + i * bb;
        ++i;
      }
    const auto t0 = Clock::now();
    if (g->memcpy_batch_async(g->gpu_ctx, dsts.data(), srcs.data(), sizes.data(), n, stream_) !=
            FERRY_OK ||
        g->stream_sync(g->gpu_ctx, stream_) != FERRY_OK)
      return false;
    *took_ms = ms(Clock::now() - t0);
    return true;
  }

  const KvOptions& k_;
  Engine& e_;
  const std::function<std::string(const std::string&)>& ask_;
  const size_t regions_;
  std::vector<std::unique_ptr<Segment>> segs_;  // before the descriptors that name them
  std::vector<MemoryDesc> local_, remote_;
  std::unique_ptr<PreparedList> lp_, rp_;
  std::vector<uint8_t> scratch_;          // raw_memcpy's destination
  std::unique_ptr<Segment> gpu_scratch_;  // raw_gather's
  void* stream_ = nullptr;                // raw_gather's, on the regions' device
};

// Where a backend times its stages (xgmi's stage_*_ns, plugin ABI 1.5
// counters): the mean per transfer over the timed requests, in us, so the
// wait column can be split into copy, pickup and completion.
void print_stage_means(const EngineStats& before, const EngineStats& after) {
  for (const auto& [name, b] : after.backends) {
    auto was = [&](const std::string& key) -> uint64_t {
      auto it = before.backends.find(name);
      if (it == before.backends.end()) return 0;
      auto f = it->second.plugin.find(key);
      return f == it->second.plugin.end() ? 0 : f->second;
    };
    auto n = b.plugin.find("stage_transfers");
    if (n == b.plugin.end() || n->second <= was(n->first)) continue;
    const double transfers = static_cast<double>(n->second - was(n->first));
    std::printf("%28s %s stages, us per transfer:", "", name.c_str());
    for (const auto& [key, v] : b.plugin) {
      const size_t len = key.size();
      if (key.rfind("stage_", 0) != 0 || len < 9 || key.compare(len - 3, 3, "_ns") != 0) continue;
      std::printf(" %s %.1f", key.substr(6, len - 9).c_str(),
                  static_cast<double>(v - was(key)) / transfers / 1e3);
    }
    if (auto w = b.plugin.find("stage_by_waiter"); w != b.plugin.end())
      std::printf(" (by the waiter: %.0f%%)",
                  100.0 * static_cast<double>(w->second - was(w->first)) / transfers);
    std::printf("\n");
  }
}

}  // namespace

int run_kv(const KvOptions& k, Engine& engine,
           const std::function<std::string(const std::string&)>& ask) {
  KvRun run(k, engine, ask);
  if (!run.setup()) return 1;
  const double req_mib =
      static_cast<double>(run.regions() * k.request_blocks * k.block_bytes) / (1 << 20);
  std::printf(
      "kv: %d layers x {K,V} x %zu blocks of %zu B (%s -> %s), %zu blocks per request = %zu "
      "items, %.1f MiB; %d requests (+%d warm-up), %s %s, message at the end\n",
      k.layers, k.blocks, k.block_bytes, to_string(k.init_seg), to_string(k.target_seg),
      k.request_blocks, run.regions() * k.request_blocks, req_mib, k.requests, k.warmup,
      k.op == Op::WRITE ? "WRITE" : "READ", k.label.c_str());
  // The raw reference first, over the same requests (raw_copy).
  std::vector<double> raw;
  {
    std::mt19937_64 rng(42);
    for (int i = 0; i < k.warmup + k.requests; ++i) {
      double t = 0;
      if (!run.raw_copy(run.request(rng), &t)) break;
      if (i >= k.warmup) raw.push_back(t);
    }
  }
  const double raw_med = median(raw);
  // prep: the application builds its item list (the raw reference builds
  // its pointer table before its clock starts); post: the call; wait: from
  // the call's return until the transfer (and its message) is done.
  std::printf("%-26s %10s %10s %10s %12s %12s %8s %8s %s\n", "method", "prep ms", "post ms",
              "wait ms", "request ms", "min ms", "GB/s", "x raw", "verified");
  if (raw_med > 0) {
    std::printf("%-26s %10s %10s %10s %12.3f %12.3f %8.2f %8s %s\n", run.raw_name(), "-", "-", "-",
                raw_med, *std::min_element(raw.begin(), raw.end()),
                req_mib * (1 << 20) / (raw_med * 1e6), "1.00", "-");
  }
  const char* names[] = {"prepared lists (1 call)", "multi-region items (1 call)",
                         "per-region batches"};
  int rc = 0;
  uint64_t n = 0;
  for (int method = 0; method < 3; ++method) {
    std::mt19937_64 rng(42);  // the same requests for every method
    Result res;
    Request last;
    EngineStats counted;  // the backends' counters once the warm-up is over
    if (k.warmup == 0) counted = engine.stats();
    for (int i = 0; i < k.warmup + k.requests && res.ok; ++i) {
      last = run.request(rng);
      Result& into = res;
      const size_t before = into.total_ms.size();
      run.run_one(method, last, n++, into);
      if (i < k.warmup && into.total_ms.size() > before) {  // warm-up: not counted
        into.prep_ms.pop_back();
        into.post_ms.pop_back();
        into.wait_ms.pop_back();
        into.total_ms.pop_back();
      }
      if (i + 1 == k.warmup) counted = engine.stats();
    }
    const EngineStats after = engine.stats();
    if (!res.ok) {
      std::printf("%-26s failed: %s\n", names[method], res.error.c_str());
      rc = 1;
      continue;
    }
    // After a WRITE or a READ alike, local block src[i] equals remote block dst[i].
    const bool verified = k.check && run.verify(last);
    if (k.check && !verified) rc = 1;
    const double med = median(res.total_ms);
    const double mn = *std::min_element(res.total_ms.begin(), res.total_ms.end());
    // x raw: the raw copy's time over this method's (1.00 = as fast as memcpy).
    char vs_raw[16] = "-";
    if (raw_med > 0) std::snprintf(vs_raw, sizeof vs_raw, "%.2f", raw_med / med);
    std::printf("%-26s %10.3f %10.3f %10.3f %12.3f %12.3f %8.2f %8s %s\n", names[method],
                median(res.prep_ms), median(res.post_ms), median(res.wait_ms), med, mn,
                req_mib * (1 << 20) / (med * 1e6), vs_raw,
                k.check ? (verified ? "yes" : "NO") : "-");
    print_stage_means(counted, after);
  }
  std::istringstream in(ask("notifs 0"));
  std::string word;
  size_t got = 0;
  in >> word >> got;
  std::printf("target received %zu notification messages (expected %llu)\n", got,
              static_cast<unsigned long long>(n));
  if (got != n) rc = 1;
  return rc;
}

}  // namespace ferry::bench
