// SPDX-License-Identifier: Apache-2.0
// gpu-peer-ref: the raw reference for GPU-to-GPU transfers, measured with the
// runtime's own async copies (cudaMemcpyAsync/hipMemcpyAsync between devices,
// i.e. what cudaMemcpyPeerAsync does) through the same dlopen'd runtime the
// core uses, without ferry in between. Prints GB/s per size, and the 1024 x 16
// KiB scattered-block case and others done each way the batch call can (the
// gather kernel, the runtime's batched copy, one copy per block) beside one
// contiguous copy of the same bytes, streamed and one at a time.
//   usage: gpu-peer-ref [SRC_DEVICE] [DST_DEVICE]
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "gpu_runtime.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

const ferry_gpu_v1* G;

void check(int rc, const char* what) {
  if (rc != FERRY_OK) {
    std::fprintf(stderr, "gpu-peer-ref: %s: %s\n", what, G->last_error(G->gpu_ctx));
    std::exit(1);
  }
}

// GB/s of `iters` rounds of `round` on one stream, after 2 warm-up rounds.
template <typename F>
double measure(size_t bytes_per_round, int iters, void* stream, F round) {
  for (int i = 0; i < 2; ++i) round();
  check(G->stream_sync(G->gpu_ctx, stream), "sync");
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) round();
  check(G->stream_sync(G->gpu_ctx, stream), "sync");
  double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return static_cast<double>(bytes_per_round) * iters / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  G = gpu_runtime();
  if (!G) {
    std::fprintf(stderr, "gpu-peer-ref: no GPU runtime or device\n");
    return 2;
  }
  int src_dev = argc > 1 ? std::stoi(argv[1]) : 0;
  int dst_dev = argc > 2 ? std::stoi(argv[2]) : (G->device_count > 1 ? 1 : 0);
  const size_t max = 256u << 20;
  char* src = static_cast<char*>(gpu::alloc(max, src_dev));
  char* dst = static_cast<char*>(gpu::alloc(max, dst_dev));
  if (src_dev != dst_dev) {
    check(G->enable_peer_access(G->gpu_ctx, src_dev, dst_dev), "peer access");
    check(G->enable_peer_access(G->gpu_ctx, dst_dev, src_dev), "peer access");
  }
  check(G->set_device(G->gpu_ctx, src_dev), "set device");
  void* stream = nullptr;
  check(G->stream_create(G->gpu_ctx, &stream), "stream");
  std::printf("gpu-peer-ref: device %d -> device %d\n", src_dev, dst_dev);
  // "streamed": copies queued back to back, one sync at the end (the link's
  // limit); "one at a time": each copy waited for before the next, as a
  // transfer API that reports every completion must (ferry's case).
  std::printf("%12s %14s %16s\n", "bytes", "streamed GB/s", "one-at-a-time GB/s");
  for (size_t n :
       {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20, size_t{256} << 20}) {
    int iters = n >= (64u << 20) ? 20 : 200;
    double gbs = measure(n, iters, stream,
                         [&] { check(G->memcpy_async(G->gpu_ctx, dst, src, n, stream), "copy"); });
    double one = measure(n, iters, stream, [&] {
      check(G->memcpy_async(G->gpu_ctx, dst, src, n, stream), "copy");
      check(G->stream_sync(G->gpu_ctx, stream), "sync");
    });
    std::printf("%12zu %14.1f %16.1f\n", n, gbs, one);
  }
  // One piece, one at a time: the runtime's copy against the gather kernel's
  // launch (gpu_batch::Method::GATHER sends even one piece through it).
  std::printf("\none piece, one at a time, GB/s:\n%12s %14s %14s\n", "bytes", "runtime copy",
              "gather kernel");
  for (size_t n :
       {size_t{4} << 10, size_t{64} << 10, size_t{256} << 10, size_t{1} << 20, size_t{4} << 20}) {
    void* d = dst;
    const void* s1 = src;
    double copy = measure(n, 200, stream, [&] {
      check(G->memcpy_async(G->gpu_ctx, dst, src, n, stream), "copy");
      check(G->stream_sync(G->gpu_ctx, stream), "sync");
    });
    gpu_batch::set_method(gpu_batch::Method::GATHER);
    double kernel = measure(n, 200, stream, [&] {
      check(G->memcpy_batch_async(G->gpu_ctx, &d, &s1, &n, 1, stream), "kernel copy");
      check(G->stream_sync(G->gpu_ctx, stream), "sync");
    });
    gpu_batch::set_method(gpu_batch::Method::AUTO);
    std::printf("%12zu %14.1f %14.1f\n", n, copy, kernel);
  }
  // Scattered blocks: each way of moving many pieces through the same batch
  // call (gpu_batch::Method), streamed and one at a time, at several piece
  // sizes: where the gather kernel stops paying off against the runtime's
  // batched copy or plain copies is read from here.
  std::printf("\nscattered blocks, GB/s (streamed / one at a time):\n");
  std::printf("%18s %21s %21s %21s %21s %12s\n", "pieces", "gather kernel", "runtime batch",
              "one copy each", "one contiguous copy", "gather call");
  std::printf("%18s %21s %21s %21s %21s %12s\n", "", "", "", "", "", "(host us)");
  struct Shape {
    size_t count, blk;
  };
  for (Shape sh : {Shape{4096, 4 << 10}, Shape{1024, 16 << 10}, Shape{256, 64 << 10},
                   Shape{64, 256 << 10}, Shape{32, 1 << 20}}) {
    std::vector<void*> dsts(sh.count);
    std::vector<const void*> srcs(sh.count);
    std::vector<size_t> sizes(sh.count, sh.blk);
    for (size_t i = 0; i < sh.count; ++i) {
      srcs[i] = src + ((i * 37) % sh.count) * sh.blk;
      dsts[i] = dst + i * sh.blk * 2;
    }
    const size_t bytes = sh.count * sh.blk;
    auto batch = [&](gpu_batch::Method m, bool sync) -> std::string {
      gpu_batch::set_method(m);
      auto one = [&] {
        return G->memcpy_batch_async(G->gpu_ctx, dsts.data(), srcs.data(), sizes.data(), sh.count,
                                     stream);
      };
      if (one() != FERRY_OK) {
        gpu_batch::set_method(gpu_batch::Method::AUTO);
        return "n/a";
      }
      double gbs = measure(bytes, 20, stream, [&] {
        check(one(), "batch copy");
        if (sync) check(G->stream_sync(G->gpu_ctx, stream), "sync");
      });
      gpu_batch::set_method(gpu_batch::Method::AUTO);
      char b[32];
      std::snprintf(b, sizeof b, "%.1f", gbs);
      return b;
    };
    auto pair = [&](gpu_batch::Method m) { return batch(m, false) + " / " + batch(m, true); };
    auto contiguous = [&](bool sync) {
      return measure(bytes, 20, stream, [&] {
        check(G->memcpy_async(G->gpu_ctx, dst, src, bytes, stream), "copy");
        if (sync) check(G->stream_sync(G->gpu_ctx, stream), "sync");
      });
    };
    char c[48];
    std::snprintf(c, sizeof c, "%.1f / %.1f", contiguous(false), contiguous(true));
    // The host's own cost of one gather call (table written, kernel launched).
    double call_us = 0;
    gpu_batch::set_method(gpu_batch::Method::GATHER);
    for (int i = 0; i < 20; ++i) {
      auto t0 = Clock::now();
      int rc = G->memcpy_batch_async(G->gpu_ctx, dsts.data(), srcs.data(), sizes.data(), sh.count,
                                     stream);
      call_us += std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (rc != FERRY_OK) break;
      check(G->stream_sync(G->gpu_ctx, stream), "sync");
    }
    gpu_batch::set_method(gpu_batch::Method::AUTO);
    std::string name = std::to_string(sh.count) + " x " + std::to_string(sh.blk >> 10) + " KiB";
    std::printf("%18s %21s %21s %21s %21s %12.1f\n", name.c_str(),
                pair(gpu_batch::Method::GATHER).c_str(), pair(gpu_batch::Method::RUNTIME).c_str(),
                pair(gpu_batch::Method::COPIES).c_str(), c, call_us / 20);
  }
  G->stream_destroy(G->gpu_ctx, stream);
  gpu::free(src);
  gpu::free(dst);
  return 0;
}
