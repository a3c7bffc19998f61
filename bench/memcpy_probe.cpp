// SPDX-License-Identifier: Apache-2.0
// memcpy_probe: the same-host limit for moving bytes - one thread copying a
// buffer (64 MiB by default) into another, both pre-faulted. Prints the best
// and the median copy bandwidth (bytes copied per second) over N repetitions.
//   usage: memcpy_probe [BYTES (64MiB)] [REPS (20)] [--csv]
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

size_t parse_size(const char* s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, 10);
  std::string u = end ? end : "";
  if (u == "K" || u == "KiB") v <<= 10;
  else if (u == "M" || u == "MiB") v <<= 20;
  else if (u == "G" || u == "GiB") v <<= 30;
  else if (!u.empty() && u != "B") return 0;
  return static_cast<size_t>(v);
}

void* map(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("memcpy_probe: mmap");
    std::exit(1);
  }
  std::memset(p, 1, n);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  size_t bytes = 64u << 20;
  int reps = 20;
  bool csv = false;
  int pos = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--csv") csv = true;
    else if (pos++ == 0) bytes = parse_size(argv[i]);
    else reps = std::atoi(argv[i]);
  }
  if (bytes == 0 || reps < 1) {
    std::fprintf(stderr, "usage: memcpy_probe [BYTES (64MiB)] [REPS (20)] [--csv]\n");
    return 2;
  }
  auto* src = static_cast<char*>(map(bytes));
  auto* dst = static_cast<char*>(map(bytes));
  std::vector<double> gbs;
  for (int r = 0; r < reps + 2; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst, src, bytes);
    auto t1 = std::chrono::steady_clock::now();
    // Keep the copy observable so it cannot be dropped.
    asm volatile("" : : "r"(dst) : "memory");
    if (r >= 2) gbs.push_back(static_cast<double>(bytes) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
  }
  std::sort(gbs.begin(), gbs.end());
  const double best = gbs.back(), median = gbs[gbs.size() / 2];
  if (csv) std::printf("bytes,reps,best_gbs,median_gbs\n%zu,%d,%.3f,%.3f\n", bytes, reps, best, median);
  else std::printf("memcpy %zu bytes, one thread, %d reps: best %.3f GB/s, median %.3f GB/s\n", bytes, reps, best, median);
  munmap(src, bytes);
  munmap(dst, bytes);
  return 0;
}
