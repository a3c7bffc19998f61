// SPDX-License-Identifier: Apache-2.0
// ferry-gpu-bench: GPU-memory transfers through ferry between two processes
// (the target is ferry-gpu-peer, started with exec), at the sizes gpu-peer-ref
// measures raw, so the two tables give a ratio from one run.
//   usage: ferry-gpu-bench BACKEND[,BACKEND...] [INITIATOR_DEVICE] [TARGET_DEVICE]
// A device of -1 is host memory on that side: `ferry-gpu-bench tcp -1 -1` is the
// CPU->CPU reference for tcp's staged GPU->GPU figures in the same run.
// Rows: WRITE and READ of one block (64 KiB .. 256 MiB), then 1024 x 16 KiB
// scattered blocks as one batch. Data of the last iteration of each row is
// verified (hash of the target's region vs ours).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s BACKEND[,BACKEND...] [INITIATOR_DEVICE] [TARGET_DEVICE]\n",
                 argv[0]);
    return 2;
  }
  std::string backends = argv[1];
  int idev = argc > 2 ? std::stoi(argv[2]) : 0;
  int tdev = argc > 3 ? std::stoi(argv[3]) : (gpu::device_count() > 1 ? 1 : 0);
  if ((idev >= 0 || tdev >= 0) && !gpu::available()) {
    std::fprintf(stderr, "ferry-gpu-bench: no GPU runtime or device\n");
    return 2;
  }
  const size_t region = 256u << 20;
  test::ChildProcess child(
      {FERRY_GPU_PEER, "gpu-bench-target", backends, std::to_string(tdev), std::to_string(region)});
  std::string ready = child.read_line(120000);
  std::istringstream in(ready);
  std::string word, ehex, mhex;
  in >> word >> ehex >> mhex;
  if (word != "READY") {
    std::fprintf(stderr, "ferry-gpu-bench: target: %s\n", ready.c_str());
    return 1;
  }
  Engine engine("gpu-bench-initiator");
  std::stringstream bs(backends);
  for (std::string b; std::getline(bs, b, ',');)
    if (auto r = engine.add_backend(b); !r) {
      std::fprintf(stderr, "ferry-gpu-bench: %s\n", r.message.c_str());
      return 1;
    }
  engine.register_remote_engine(EngineDesc::unpack(test::from_hex(ehex)));
  if (child.ask("register " + test::to_hex(engine.desc().pack())) != "OK") return 1;
  MemoryDesc remote = MemoryDesc::unpack(test::from_hex(mhex));
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
  auto session = engine.create_session(local, remote);
  if (!session) return 1;

  auto run = [&](Op op, const std::vector<size_t>& lo, const std::vector<size_t>& ro,
                 const std::vector<size_t>& sz, int iters) {
    double best_us = 1e30, total_s = 0;
    for (int i = -2; i < iters; ++i) {
      auto t0 = Clock::now();
      TransferStatus st = lo.size() == 1
                              ? (op == Op::WRITE ? session->write(lo[0], ro[0], sz[0], 0, false)
                                                 : session->read(lo[0], ro[0], sz[0], 0, false))
                              : (op == Op::WRITE ? session->batch_write(lo, ro, sz, 0, false)
                                                 : session->batch_read(lo, ro, sz, 0, false));
      if (st.Wait() != StatusCode::SUCCESS) {
        std::fprintf(stderr, "transfer failed: %s\n", st.Message().c_str());
        std::exit(1);
      }
      double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (i >= 0) {
        total_s += s;
        best_us = std::min(best_us, s * 1e6);
      }
    }
    size_t bytes = 0;
    for (size_t n : sz) bytes += n;
    return std::make_pair(static_cast<double>(bytes) * iters / total_s / 1e9, best_us);
  };
  auto verify_write = [&](const std::vector<size_t>& lo, const std::vector<size_t>& ro,
                          const std::vector<size_t>& sz) {
    std::ostringstream cmd;
    cmd << "hash " << lo.size();
    uint64_t h = test::kFnvBasis;
    for (size_t i = 0; i < lo.size(); ++i) {
      cmd << " " << ro[i] << " " << sz[i];
      h = test::fnv1a(host.data() + lo[i], sz[i], h);
    }
    return child.ask(cmd.str()) == "HASH " + std::to_string(h);
  };

  std::printf("ferry-gpu-bench: backends=%s device %d -> device %d (two processes)\n",
              backends.c_str(), idev, tdev);
  std::printf("%10s %12s %10s %12s %9s\n", "op", "bytes", "GB/s", "best us", "verified");
  for (size_t n :
       {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20, size_t{256} << 20}) {
    int iters = n >= (64u << 20) ? 20 : 100;
    auto [w, wl] = run(Op::WRITE, {0}, {0}, {n}, iters);
    bool ok = verify_write({0}, {0}, {n});
    std::printf("%10s %12zu %10.1f %12.1f %9s\n", "WRITE", n, w, wl, ok ? "yes" : "NO");
    auto [r, rl] = run(Op::READ, {0}, {0}, {n}, iters);
    std::printf("%10s %12zu %10.1f %12.1f %9s\n", "READ", n, r, rl, "-");
  }
  const size_t blk = 16 << 10, count = 1024;
  std::vector<size_t> lo(count), ro(count), sz(count, blk);
  for (size_t i = 0; i < count; ++i) {
    lo[i] = ((i * 37) % count) * blk;
    ro[i] = i * blk * 2;
  }
  auto [bw, bl] = run(Op::WRITE, lo, ro, sz, 20);
  bool ok = verify_write(lo, ro, sz);
  std::printf("%10s %12s %10.1f %12.1f %9s\n", "WRITE", "1024x16KiB", bw, bl, ok ? "yes" : "NO");
  auto [cw, cl] = run(Op::WRITE, {0}, {0}, {count * blk}, 20);
  std::printf("%10s %12zu %10.1f %12.1f %9s   (same bytes, one block)\n", "WRITE", count * blk, cw,
              cl, "-");
  std::printf("batch / contiguous = %.2f\n", bw / cw);
  session.reset();
  engine.deregister_memory(local);
  child.ask("quit", 10000);
  if (idev >= 0) gpu::free(buf);
  return 0;
}
