// SPDX-License-Identifier: Apache-2.0
// gpu-peer-ref: the raw reference for GPU-to-GPU transfers, measured with the
// runtime's own async copies (cudaMemcpyAsync/hipMemcpyAsync between devices,
// i.e. what cudaMemcpyPeerAsync does) through the same dlopen'd runtime the
// core uses, without ferry in between. Prints GB/s per size, and the 1024 x 16
// KiB scattered-block case done three ways (one copy per block, the batched
// copy call, one contiguous copy of the same bytes).
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
  for (size_t n : {size_t{64} << 10, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20,
                   size_t{256} << 20}) {
    int iters = n >= (64u << 20) ? 20 : 200;
    double gbs = measure(n, iters, stream, [&] {
      check(G->memcpy_async(G->gpu_ctx, dst, src, n, stream), "copy");
    });
    double one = measure(n, iters, stream, [&] {
      check(G->memcpy_async(G->gpu_ctx, dst, src, n, stream), "copy");
      check(G->stream_sync(G->gpu_ctx, stream), "sync");
    });
    std::printf("%12zu %14.1f %16.1f\n", n, gbs, one);
  }
  const size_t blk = 16 << 10, count = 1024;
  std::vector<void*> dsts(count);
  std::vector<const void*> srcs(count);
  std::vector<size_t> sizes(count, blk);
  for (size_t i = 0; i < count; ++i) {
    srcs[i] = src + ((i * 37) % count) * blk;
    dsts[i] = dst + i * blk * 2;
  }
  double per_block = measure(count * blk, 20, stream, [&] {
    for (size_t i = 0; i < count; ++i)
      check(G->memcpy_async(G->gpu_ctx, dsts[i], srcs[i], blk, stream), "copy");
  });
  double batched = -1;
  if (G->memcpy_batch_async(G->gpu_ctx, dsts.data(), srcs.data(), sizes.data(), count, stream) ==
      FERRY_OK)
    batched = measure(count * blk, 20, stream, [&] {
      check(G->memcpy_batch_async(G->gpu_ctx, dsts.data(), srcs.data(), sizes.data(), count, stream),
            "batch copy");
    });
  double contiguous = measure(count * blk, 20, stream, [&] {
    check(G->memcpy_async(G->gpu_ctx, dst, src, count * blk, stream), "copy");
  });
  std::printf("1024 x 16 KiB: per-block copies %.1f GB/s, batch call (gather kernel, else the "
              "runtime's batched copy) %s GB/s, one contiguous copy %.1f GB/s\n",
              per_block, batched < 0 ? "n/a" : std::to_string(batched).c_str(), contiguous);
  G->stream_destroy(G->gpu_ctx, stream);
  gpu::free(src);
  gpu::free(dst);
  return 0;
}
