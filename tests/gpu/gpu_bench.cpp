// SPDX-License-Identifier: Apache-2.0
// ferry-gpu-bench: GPU-memory transfers through ferry between two processes
// (the target is ferry-gpu-peer, started with exec), each row beside its raw
// reference measured in this same process and run, so the ratio comes from one
// run on one machine state.
//   usage: ferry-gpu-bench BACKEND[,BACKEND...] [INITIATOR_DEVICE] [TARGET_DEVICE] [--runs N]
//          [--settings JSON (the first backend's, on both sides)] [--method M]
//          [--rows all|blocks|batches]
// A device of -1 is host memory on that side: `ferry-gpu-bench tcp -1 -1` is the
// CPU->CPU reference for tcp's staged GPU->GPU figures. With tcp and GPU memory
// on a side, that reference is also measured in the same run, alternating with
// each of the row's runs (a second target process with host memory), in the
// last two columns, **cpu GB/s** and its **ratio** (issue 19 item 3);
// `--no-cpu-reference` leaves it out.
//
// Rows: WRITE and READ of one block (64 KiB .. 256 MiB), notification off and
// on, then scattered blocks as one batch (1024 x 16 KiB, 4096 x 4 KiB). Each row
// is measured --runs times (default 5); GB/s is the median run, with the
// slowest and fastest beside it. The raw reference (both sides GPU memory) is
// the runtime's copy between two allocations on the same devices, each copy
// waited for before the next ("one at a time", as a transfer API that reports
// each completion must); for batches, the same one gather-kernel launch ferry
// uses, waited for likewise. The second reference, **ipc**, is the same copy
// into an allocation of the target process mapped here through its IPC handle
// (the kind of mapping xgmi copies through; with both engines on one device,
// two contexts), so its ratio is ferry's own cost. Where the backend reports
// stage times (xgmi), the
// mean per transfer of each stage is printed: post (entry -> copies enqueued),
// pickup (-> the completion thread watches the event), gpu (-> the event
// fired), complete (the core's completion and notification), wake (status
// final -> Wait() returned in this thread), and the share of transfers the
// waiting thread reported itself (plugin ABI 1.6 progress(); for those, pickup
// is 0 and gpu runs from the event's record). Two more columns split the
// fixed costs the stages do not cover: **call**, the mean time the session's
// call took to return to this thread (the core's submit plus the backend's
// post), and **raw call**, the mean time the raw reference's copy call took (the
// batch rows: the gather table written and the kernel launched); **faults**, the
// minor page faults per transfer in this process (memory the allocator handed
// back to the system and touched again). `--rows
// blocks|batches` runs only those rows; `--counters` prints under each row how
// the backend's other counters and the engine's NOTIFY counters moved. Data of the last iteration
// of each WRITE row is verified (hash of the target's region vs ours).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "gpu_runtime.h"
#include "pattern.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Spread {
  double min = 0, median = 0, max = 0;
};
Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2], v.back()};
}

struct Pieces {
  std::vector<size_t> lo, ro, sz;
  size_t bytes() const {
    size_t b = 0;
    for (size_t n : sz) b += n;
    return b;
  }
};
Pieces one_block(size_t n) { return {{0}, {0}, {n}}; }
// `count` blocks of `blk` bytes: read in a shuffled order, written to every other slot.
Pieces scattered(size_t count, size_t blk) {
  Pieces p;
  for (size_t i = 0; i < count; ++i) {
    p.lo.push_back(((i * 37) % count) * blk);
    p.ro.push_back(i * blk * 2);
    p.sz.push_back(blk);
  }
  return p;
}

// The raw reference: copies between two allocations of this process.
class Raw {
 public:
  Raw(int src_dev, int dst_dev, size_t region) : g_(gpu_runtime()) {
    a_ = static_cast<char*>(gpu::alloc(region, src_dev));
    b_ = static_cast<char*>(gpu::alloc(region, dst_dev));
    if (src_dev != dst_dev) {
      g_->enable_peer_access(g_->gpu_ctx, src_dev, dst_dev);
      g_->enable_peer_access(g_->gpu_ctx, dst_dev, src_dev);
    }
    g_->set_device(g_->gpu_ctx, src_dev);
    g_->stream_create(g_->gpu_ctx, &stream_);
  }
  ~Raw() {
    g_->stream_destroy(g_->gpu_ctx, stream_);
    gpu::free(a_);
    gpu::free(b_);
  }
  // The peer's allocation mapped here through its IPC handle (the mapping
  // xgmi copies through), for the second reference; false when it cannot be.
  bool map_peer(const std::vector<uint8_t>& handle, int dev) {
    void* p = nullptr;
    if (handle.size() != 64 || g_->ipc_open(g_->gpu_ctx, handle.data(), dev, &p) != FERRY_OK)
      return false;
    peer_ = static_cast<char*>(p);
    return true;
  }
  bool has_peer() const { return peer_ != nullptr; }
  // GB/s of `iters` one-at-a-time rounds of the pieces (a -> b for WRITE, b -> a
  // for READ; with `to_peer`, the peer's IPC mapping instead of b); the copy
  // calls' time is added to *call_ns.
  double measure(Op op, const Pieces& p, int iters, double* call_ns, bool to_peer = false) {
    std::vector<void*> d(p.sz.size());
    std::vector<const void*> s(p.sz.size());
    char* const remote = to_peer ? peer_ : b_;
    for (size_t i = 0; i < p.sz.size(); ++i) {
      char* l = a_ + p.lo[i];
      char* r = remote + p.ro[i];
      d[i] = op == Op::WRITE ? r : l;
      s[i] = op == Op::WRITE ? l : r;
    }
    auto round = [&](double* call) {
      const auto c0 = Clock::now();
      int rc = p.sz.size() == 1 ? g_->memcpy_async(g_->gpu_ctx, d[0], s[0], p.sz[0], stream_)
                                : g_->memcpy_batch_async(g_->gpu_ctx, d.data(), s.data(),
                                                         p.sz.data(), p.sz.size(), stream_);
      if (call) *call += std::chrono::duration<double, std::nano>(Clock::now() - c0).count();
      if (rc == FERRY_OK) rc = g_->stream_sync(g_->gpu_ctx, stream_);
      if (rc != FERRY_OK) {
        std::fprintf(stderr, "raw copy failed: %s\n", g_->last_error(g_->gpu_ctx));
        std::exit(1);
      }
    };
    for (int i = 0; i < 2; ++i) round(nullptr);
    auto t0 = Clock::now();
    for (int i = 0; i < iters; ++i) round(call_ns);
    double s_total = std::chrono::duration<double>(Clock::now() - t0).count();
    return static_cast<double>(p.bytes()) * iters / s_total / 1e9;
  }

 private:
  const ferry_gpu_v1* g_;
  char* a_ = nullptr;
  char* b_ = nullptr;
  char* peer_ = nullptr;  // closed with the process (the peer's allocation outlives us)
  void* stream_ = nullptr;
};

const char* kStages[] = {"stage_post_ns",   "stage_setup_ns", "stage_enqueue_ns", "stage_merge_ns",
                         "stage_pickup_ns", "stage_gpu_ns",   "stage_complete_ns"};
constexpr size_t kNumStages = sizeof kStages / sizeof kStages[0];

// Minor page faults of this process so far (all its threads).
// A target process (ferry-gpu-peer, started with exec) once it said READY:
// its engine and the region it registered.
struct Target {
  std::unique_ptr<test::ChildProcess> child;
  EngineDesc engine;
  MemoryDesc memory;
};

// Starts one; false, with its answer on stderr, when it did not come up.
bool start_target(const char* name, const std::string& backends, int device, size_t region,
                  const std::string& settings, Target* t) {
  t->child = std::make_unique<test::ChildProcess>(std::vector<std::string>{
      FERRY_GPU_PEER, name, backends, std::to_string(device), std::to_string(region), settings});
  const std::string ready = t->child->read_line(120000);
  std::istringstream in(ready);
  std::string word, ehex, mhex;
  in >> word >> ehex >> mhex;
  if (word != "READY") {
    std::fprintf(stderr, "ferry-gpu-bench: target %s: %s\n", name, ready.c_str());
    return false;
  }
  t->engine = EngineDesc::unpack(test::from_hex(ehex));
  t->memory = MemoryDesc::unpack(test::from_hex(mhex));
  return true;
}

// The initiator and the target learn each other.
bool link(Engine& engine, Target& t) {
  engine.register_remote_engine(t.engine);
  return t.child->ask("register " + test::to_hex(engine.desc().pack())) == "OK";
}

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> pos;
  int runs = 5;
  std::string settings, method = "auto", rows = "all";
  bool cpu_reference = true, counters = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-cpu-reference") == 0)
      cpu_reference = false;
    else if (std::strcmp(argv[i], "--counters") == 0)
      counters = true;
    else if (std::strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
      runs = std::max(1, std::stoi(argv[++i]));
    else if (std::strcmp(argv[i], "--settings") == 0 && i + 1 < argc)
      settings = argv[++i];
    else if (std::strcmp(argv[i], "--method") == 0 && i + 1 < argc)
      method = argv[++i];
    else if (std::strcmp(argv[i], "--rows") == 0 && i + 1 < argc)
      rows = argv[++i];
    else
      pos.emplace_back(argv[i]);
  }
  if (pos.empty() || (rows != "all" && rows != "blocks" && rows != "batches")) {
    std::fprintf(stderr,
                 "usage: %s BACKEND[,BACKEND...] [INITIATOR_DEVICE] [TARGET_DEVICE] [--runs N] "
                 "[--settings JSON] [--method auto|gather|runtime|copies] "
                 "[--rows all|blocks|batches] [--no-cpu-reference] [--counters]\n",
                 argv[0]);
    return 2;
  }
  std::string backends = pos[0];
  int idev = pos.size() > 1 ? std::stoi(pos[1]) : 0;
  int tdev = pos.size() > 2 ? std::stoi(pos[2]) : (gpu::device_count() > 1 ? 1 : 0);
  if ((idev >= 0 || tdev >= 0) && !gpu::available()) {
    std::fprintf(stderr, "ferry-gpu-bench: no GPU runtime or device\n");
    return 2;
  }
  if (method != "auto") {
    if (!gpu::available()) return 2;
    gpu_runtime();
    gpu_batch::set_method(method == "gather"    ? gpu_batch::Method::GATHER
                          : method == "runtime" ? gpu_batch::Method::RUNTIME
                                                : gpu_batch::Method::COPIES);
  }
  const size_t region = 256u << 20;
  Target target;
  if (!start_target("gpu-bench-target", backends, tdev, region, settings, &target)) return 1;
  test::ChildProcess& child = *target.child;
  Engine engine("gpu-bench-initiator");
  std::stringstream bs(backends);
  std::string first_backend;
  for (std::string b; std::getline(bs, b, ',');) {
    if (first_backend.empty()) first_backend = b;
    if (auto r = engine.add_backend(b, b == first_backend ? settings : std::string()); !r) {
      std::fprintf(stderr, "ferry-gpu-bench: %s\n", r.message.c_str());
      return 1;
    }
  }
  if (!link(engine, target)) return 1;
  std::vector<uint8_t> plain(idev >= 0 ? 0 : region);
  uint8_t* buf = idev >= 0 ? static_cast<uint8_t*>(gpu::alloc(region, idev)) : plain.data();
  std::vector<uint8_t> host(region);
  test::fill_pattern(host.data(), 0, region, 5);
  if (idev >= 0) {
    gpu::copy(buf, host.data(), region);
  } else {
    std::copy(host.begin(), host.end(), plain.begin());
  }
  MemoryDesc local = engine.register_memory(buf, region);
  auto session = engine.create_session(local, target.memory);
  if (!session) return 1;
  // tcp's reference for staged GPU memory: the same transfers between host
  // memory of this process and of a second target process.
  Target cpu_target;
  std::vector<uint8_t> cpu_plain;
  MemoryDesc cpu_local;
  std::unique_ptr<Session> cpu_session;
  if (cpu_reference && first_backend == "tcp" && (idev >= 0 || tdev >= 0)) {
    if (!start_target("gpu-bench-target-cpu", backends, -1, region, settings, &cpu_target) ||
        !link(engine, cpu_target))
      return 1;
    cpu_plain = host;
    cpu_local = engine.register_memory(cpu_plain.data(), region);
    cpu_session = engine.create_session(cpu_local, cpu_target.memory);
    if (!cpu_session) return 1;
  }
  std::unique_ptr<Raw> raw;
  if (idev >= 0 && tdev >= 0) {
    raw = std::make_unique<Raw>(idev, tdev, region);
    std::string ipc = child.ask("ipc");
    if (ipc.rfind("IPC ", 0) != 0 || !raw->map_peer(test::from_hex(ipc.substr(4)), idev))
      std::printf("(no raw IPC reference: %s)\n", ipc.c_str());
  }

  auto stage_totals = [&] {
    std::vector<uint64_t> v;
    const auto st = engine.stats();
    auto it = st.backends.find(first_backend);
    std::vector<const char*> keys{"stage_transfers"};
    keys.insert(keys.end(), kStages, kStages + kNumStages);
    keys.push_back("stage_by_waiter");
    for (const char* k : keys) {
      uint64_t x = 0;
      if (it != st.backends.end())
        if (auto p = it->second.plugin.find(k); p != it->second.plugin.end()) x = p->second;
      v.push_back(x);
    }
    return v;
  };
  // --counters: the backend's own counters other than its stage times, and the
  // engine's NOTIFY counters, so a row's path shows (how its targets were told).
  auto path_counters = [&] {
    std::map<std::string, uint64_t> out;
    const auto st = engine.stats();
    if (auto it = st.backends.find(first_backend); it != st.backends.end())
      for (const auto& [k, v] : it->second.plugin)
        if (k.rfind("stage_", 0) != 0 && k.rfind("gpu_", 0) != 0) out[k] = v;
    out["engine.notifies_resent"] = st.notifies_resent;
    out["engine.notifies_unanswered"] = st.notifies_unanswered;
    return out;
  };
  // tcp's staging counters (gpu_*): where a staged frame's time goes, per frame.
  auto staging = [&] {
    std::map<std::string, uint64_t> out;
    const auto st = engine.stats();
    if (auto it = st.backends.find(first_backend); it != st.backends.end())
      for (const auto& [k, v] : it->second.plugin)
        if (k.rfind("gpu_", 0) == 0) out[k] = v;
    return out;
  };
  // One run: `iters` transfers, each waited for; GB/s, and the waiter's wake-up
  // and the session call's ns summed.
  auto run_once = [&](Session* on, Op op, const Pieces& p, bool notify, int iters, double* wake_ns,
                      double* call_ns) {
    double total_s = 0;
    for (int i = -2; i < iters; ++i) {
      auto t0 = Clock::now();
      TransferStatus st = p.sz.size() == 1
                              ? (op == Op::WRITE ? on->write(p.lo[0], p.ro[0], p.sz[0], 0, notify)
                                                 : on->read(p.lo[0], p.ro[0], p.sz[0], 0, notify))
                              : (op == Op::WRITE ? on->batch_write(p.lo, p.ro, p.sz, 0, notify)
                                                 : on->batch_read(p.lo, p.ro, p.sz, 0, notify));
      const auto called = Clock::now();
      if (st.Wait() != StatusCode::SUCCESS) {
        std::fprintf(stderr, "transfer failed: %s\n", st.Message().c_str());
        std::exit(1);
      }
      auto t1 = Clock::now();
      if (i >= 0) {
        total_s += std::chrono::duration<double>(t1 - t0).count();
        *call_ns += std::chrono::duration<double, std::nano>(called - t0).count();
        // Elapsed runs from the status' creation (inside the post, after t0) to its end.
        double end_after_t0 = std::chrono::duration<double, std::nano>(st.Elapsed()).count();
        *wake_ns +=
            std::max(0.0, std::chrono::duration<double, std::nano>(t1 - t0).count() - end_after_t0);
      }
    }
    return static_cast<double>(p.bytes()) * iters / total_s / 1e9;
  };
  auto verify_write = [&](const Pieces& p) {
    std::ostringstream cmd;
    cmd << "hash " << p.lo.size();
    uint64_t h = test::kFnvBasis;
    for (size_t i = 0; i < p.lo.size(); ++i) {
      cmd << " " << p.ro[i] << " " << p.sz[i];
      h = test::fnv1a(host.data() + p.lo[i], p.sz[i], h);
    }
    return child.ask(cmd.str()) == "HASH " + std::to_string(h);
  };
  auto row = [&](const char* name, Op op, const Pieces& p, bool notify, int iters) {
    std::vector<double> ferry_gbs, raw_gbs, ipc_gbs, cpu_gbs;
    double wake = 0, call = 0, raw_call = 0, ipc_call = 0, faults = 0;
    const auto before = stage_totals();
    const auto staged_before = staging();
    const auto path_before = counters ? path_counters() : std::map<std::string, uint64_t>{};
    for (int r = 0; r < runs; ++r) {
      // Alternate the reference and ferry, so both see the same machine state.
      if (raw) raw_gbs.push_back(raw->measure(op, p, iters, &raw_call));
      if (raw && raw->has_peer()) ipc_gbs.push_back(raw->measure(op, p, iters, &ipc_call, true));
      const long f0 = minor_faults();
      ferry_gbs.push_back(run_once(session.get(), op, p, notify, iters, &wake, &call));
      faults += static_cast<double>(minor_faults() - f0);
      double cpu_wake = 0, cpu_call = 0;
      if (cpu_session)
        cpu_gbs.push_back(run_once(cpu_session.get(), op, p, notify, iters, &cpu_wake, &cpu_call));
    }
    const auto after = stage_totals();
    const bool ok = op == Op::WRITE ? verify_write(p) : true;
    Spread f = spread(ferry_gbs);
    std::printf("%-6s %-12s %-6s %9.1f %9.1f %9.1f", op == Op::WRITE ? "WRITE" : "READ", name,
                notify ? "on" : "off", f.median, f.min, f.max);
    if (raw) {
      Spread w = spread(raw_gbs);
      std::printf(" %9.1f %6.2f", w.median, f.median / w.median);
    } else {
      std::printf(" %9s %6s", "-", "-");
    }
    if (!ipc_gbs.empty()) {
      Spread w = spread(ipc_gbs);
      std::printf(" %9.1f %6.2f", w.median, f.median / w.median);
    } else {
      std::printf(" %9s %6s", "-", "-");
    }
    const double n = static_cast<double>(runs) * iters;
    const uint64_t counted = after[0] - before[0];
    std::printf(" %5s ", op == Op::WRITE ? (ok ? "yes" : "NO") : "-");
    if (counted > 0) {
      for (size_t k = 1; k <= kNumStages; ++k)
        std::printf(" %6.1f", static_cast<double>(after[k] - before[k]) / counted / 1e3);
    } else {
      for (size_t k = 0; k < kNumStages; ++k) std::printf(" %6s", "-");
    }
    std::printf(" %6.1f", wake / n / 1e3);
    if (counted > 0)
      std::printf(" %5.0f%%", 100.0 * static_cast<double>(after.back() - before.back()) /
                                  static_cast<double>(counted));
    else
      std::printf(" %6s", "-");
    std::printf(" %6.1f", call / n / 1e3);
    if (raw)
      std::printf(" %8.1f", raw_call / n / 1e3);
    else
      std::printf(" %8s", "-");
    if (!ipc_gbs.empty())
      std::printf(" %8.1f", ipc_call / n / 1e3);
    else
      std::printf(" %8s", "-");
    std::printf(" %6.1f", faults / n);
    if (!cpu_gbs.empty()) {
      Spread c = spread(cpu_gbs);
      std::printf(" %8.1f %6.2f", c.median, f.median / c.median);
    }
    std::printf("\n");
    if (counters) {
      std::printf("       counters:");
      for (const auto& [k, v] : path_counters()) {
        const uint64_t was = path_before.count(k) ? path_before.at(k) : 0;
        if (v != was) std::printf(" %s+%lld", k.c_str(), static_cast<long long>(v - was));
      }
      std::printf("\n");
    }
    auto staged = staging();
    for (auto& [k, v] : staged) v -= staged_before.count(k) ? staged_before.at(k) : 0;
    auto per = [&](const char* k, const char* frames) {
      return staged[frames] ? static_cast<double>(staged[k]) / staged[frames] / 1e3 : 0.0;
    };
    if (staged["gpu_frames_sent"] + staged["gpu_frames_received"] > 0)
      std::printf(
          "       staged here: %llu frames sent, %.1f us each (copy wait %.1f); %llu received, "
          "%.1f us each (read %.1f, copy wait %.1f); lease %.1f us; %llu in rings' bytes\n",
          static_cast<unsigned long long>(staged["gpu_frames_sent"]),
          per("gpu_send_ns", "gpu_frames_sent"), per("gpu_send_wait_ns", "gpu_frames_sent"),
          static_cast<unsigned long long>(staged["gpu_frames_received"]),
          per("gpu_recv_ns", "gpu_frames_received"), per("gpu_recv_read_ns", "gpu_frames_received"),
          per("gpu_recv_wait_ns", "gpu_frames_received"), per("gpu_acquire_ns", "gpu_acquires"),
          static_cast<unsigned long long>(staged["gpu_ring_frames"]));
    std::fflush(stdout);
    return ok;
  };

  std::printf(
      "ferry-gpu-bench: backends=%s device %d -> device %d (two processes), %d runs per row, "
      "batch method %s, settings %s\n",
      backends.c_str(), idev, tdev, runs, method.c_str(),
      settings.empty() ? "{}" : settings.c_str());
  std::printf(
      "%-6s %-12s %-6s %9s %9s %9s %9s %6s %9s %6s %5s  %6s %6s %6s %6s %6s %6s %6s %6s %6s %6s "
      "%8s %8s %6s %8s %6s\n",
      "op", "bytes", "notify", "GB/s", "min", "max", "raw GB/s", "ratio", "ipc GB/s", "ratio", "ok",
      "post", "setup", "enq", "merge", "pickup", "gpu", "compl", "wake", "waiter", "call",
      "raw call", "ipc call", "faults", cpu_session ? "cpu GB/s" : "", cpu_session ? "ratio" : "");
  std::printf("%-6s %-12s %-6s %9s %9s %9s %9s %6s %9s %6s %5s  %55s\n", "", "", "", "(median)", "",
              "", "(median)", "", "(median)", "", "", "us per transfer, mean");
  bool all_ok = true;
  for (size_t n :
       {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20, size_t{256} << 20}) {
    if (rows == "batches") break;
    const int iters = n >= (64u << 20) ? 20 : 100;
    const std::string name = std::to_string(n);
    for (bool notify : {false, true})
      for (Op op : {Op::WRITE, Op::READ})
        all_ok &= row(name.c_str(), op, one_block(n), notify, iters);
  }
  for (auto [count, blk] : {std::pair<size_t, size_t>{1024, 16 << 10}, {4096, 4 << 10}}) {
    if (rows == "blocks") break;
    const std::string name = std::to_string(count) + "x" + std::to_string(blk >> 10) + "KiB";
    for (bool notify : {false, true})
      for (Op op : {Op::WRITE, Op::READ})
        all_ok &= row(name.c_str(), op, scattered(count, blk), notify, 20);
  }
  session.reset();
  engine.deregister_memory(local);
  // Each target is let go before it quits: its lanes close cleanly, and this
  // engine, still up for the other one, logs no lost connection.
  engine.deregister_remote_engine(target.engine.key);
  child.ask("quit", 10000);
  if (cpu_session) {
    cpu_session.reset();
    engine.deregister_memory(cpu_local);
    engine.deregister_remote_engine(cpu_target.engine.key);
    cpu_target.child->ask("quit", 10000);
  }
  raw.reset();
  if (idev >= 0) gpu::free(buf);
  return all_ok ? 0 : 1;
}
