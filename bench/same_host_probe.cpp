// SPDX-License-Identifier: Apache-2.0
// same_host_probe: what moving bytes between two processes of one host can
// cost at best, beside one thread's memcpy in the same run - the raw
// references for a same-host CPU path (issue 19, item 4).
//
// Each row copies a BYTES buffer of the parent ("initiator") into a buffer of
// a forked child ("target"), both pre-faulted and reused, so each mechanism sees
// the caches memcpy sees:
//   memcpy      one thread of one process, buffer to buffer (the reference)
//   cma xT      the target pulls with process_vm_readv, T threads each a slice
//               (the kernel copies once; the target checks what it accepts)
//   ring xT     T pairs of threads stream through a shared ring of SLOT-byte
//               slots (the initiator copies in, the target copies out, both
//               polling: two copies, overlapped, no system call)
//   lane ring   the tcp plugin's same-host byte ring (plugins/tcp/shm_ring.h,
//               1 MiB, sealed memfd, poll then sleep on a socket-pair bell): one writer, one reader
// Only the copy is timed: a request's round trip is not (ferry-bench has it).
//   usage: same_host_probe [--threads 1,4] [--slot 256KiB] [--slots 4]
//                          [--reps 30] [SIZE...]
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin_kit.hpp"
#include "shm_ring.h"
#include "socket_util.h"

namespace {

using Clock = std::chrono::steady_clock;

// ferry's one size grammar (4096, 64KiB, 1MiB, ...); 0 for anything else.
size_t parse_size(const std::string& s) {
  return static_cast<size_t>(ferry::plugin_kit::ParseSize(s).value_or(0));
}

void* map(size_t n, bool shared) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE,
                 (shared ? MAP_SHARED : MAP_PRIVATE) | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("same_host_probe: mmap");
    std::exit(1);
  }
  std::memset(p, 1, n);
  return p;
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Waiting between rounds: yields, so idle polling threads leave the memcpy
// reference (and each other, on a small host) the CPUs.
inline void idle() { std::this_thread::yield(); }

constexpr int kMaxThreads = 16;

// One ring per thread pair; head and tail on their own cache lines.
struct alignas(64) RingIndex {
  std::atomic<uint64_t> head{0};              // slots filled by the initiator
  alignas(64) std::atomic<uint64_t> tail{0};  // slots emptied by the target
};

// Lives in shared memory, created before the fork.
struct Control {
  std::atomic<uint64_t> generation{0};  // the parent starts a round by raising it
  std::atomic<int> mode{0};             // 1 cma, 2 ring, 3 lane ring, 9 quit
  std::atomic<int> threads{1};
  int target_threads = 1;  // how many the child runs (the most any row asks for)
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> done{0};         // target threads finished this round
  std::atomic<int> failed{0};       // cma: process_vm_readv's errno
  std::atomic<int> lane_failed{0};  // the lane ring: its error
  pid_t parent = 0;
  RingIndex ring[kMaxThreads];
};

// The lane ring's two ends: the parent writes, the child reads.
ferry_tcp::shm::Ring* g_lane = nullptr;

struct Config {
  size_t slot = 256 << 10;
  int slots = 4;
  size_t max_bytes = 0;
};

// The slice of [0, bytes) that thread t of n owns.
void slice(size_t bytes, int t, int n, size_t* off, size_t* len) {
  const size_t per = (bytes / static_cast<size_t>(n) + 4095) & ~size_t{4095};
  *off = std::min(bytes, per * static_cast<size_t>(t));
  *len = std::min(bytes - *off, per);
}

void target_thread(Control* c, const Config& cfg, int t, uint8_t* src_in_parent, uint8_t* dst,
                   uint8_t* ring) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t g;
    while ((g = c->generation.load(std::memory_order_acquire)) == seen) idle();
    seen = g;
    const int mode = c->mode.load();
    if (mode == 9) return;
    const int n = c->threads.load();
    if (t < n) {
      size_t off, len;
      slice(c->bytes.load(), t, n, &off, &len);
      if (mode == 1 && len > 0) {
        iovec local{dst + off, len}, remote{src_in_parent + off, len};
        if (process_vm_readv(c->parent, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(len)) {
          c->failed.store(errno == 0 ? -1 : errno);
        }
      } else if (mode == 3 && t == 0) {
        size_t got = 0;
        const int err = g_lane->Read(dst, c->bytes.load(), &got, std::chrono::seconds(10), -1);
        if (err != 0) c->lane_failed.store(err);
      } else if (mode == 2) {
        RingIndex& ri = c->ring[t];
        uint8_t* slots = ring + static_cast<size_t>(t) * cfg.slot * cfg.slots;
        uint64_t tail = ri.tail.load();
        for (size_t got = 0; got < len;) {
          while (ri.head.load(std::memory_order_acquire) == tail) relax();
          const size_t take = std::min(cfg.slot, len - got);
          std::memcpy(dst + off + got, slots + (tail % cfg.slots) * cfg.slot, take);
          got += take;
          ri.tail.store(++tail, std::memory_order_release);
        }
      }
    }
    c->done.fetch_add(1, std::memory_order_acq_rel);
  }
}

void initiator_thread(Control* c, const Config& cfg, int t, int n, size_t bytes, const uint8_t* src,
                      uint8_t* ring) {
  size_t off, len;
  slice(bytes, t, n, &off, &len);
  RingIndex& ri = c->ring[t];
  uint8_t* slots = ring + static_cast<size_t>(t) * cfg.slot * cfg.slots;
  uint64_t head = ri.head.load();
  for (size_t put = 0; put < len;) {
    while (head - ri.tail.load(std::memory_order_acquire) >= static_cast<uint64_t>(cfg.slots))
      relax();
    const size_t take = std::min(cfg.slot, len - put);
    std::memcpy(slots + (head % cfg.slots) * cfg.slot, src + off + put, take);
    put += take;
    ri.head.store(++head, std::memory_order_release);
  }
}

// One round of `mode` with n threads; seconds from the start to the last target thread's end.
double round_trip(Control* c, const Config& cfg, int mode, int n, size_t bytes, const uint8_t* src,
                  uint8_t* ring) {
  c->mode.store(mode);
  c->threads.store(n);
  c->bytes.store(bytes);
  c->done.store(0);
  const auto t0 = Clock::now();
  c->generation.fetch_add(1, std::memory_order_acq_rel);
  if (mode == 2) {
    std::vector<std::thread> th;
    for (int t = 1; t < n; ++t) th.emplace_back(initiator_thread, c, cfg, t, n, bytes, src, ring);
    initiator_thread(c, cfg, 0, n, bytes, src, ring);
    for (auto& x : th) x.join();
  } else if (mode == 3) {
    iovec v{const_cast<uint8_t*>(src), bytes};
    size_t progress = 0;
    if (const int err = g_lane->Write(&v, 1, &progress, std::chrono::seconds(10), -1); err != 0)
      c->lane_failed.store(err);
  }
  while (c->done.load(std::memory_order_acquire) < c->target_threads) idle();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  std::vector<int> threads = {1, 4};
  std::vector<size_t> sizes;
  int reps = 30;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--threads" && more) {
      threads.clear();
      std::string list = argv[++i];
      for (size_t p = 0; p <= list.size();) {
        const size_t q = std::min(list.find(',', p), list.size());
        threads.push_back(std::atoi(list.substr(p, q - p).c_str()));
        p = q + 1;
      }
    } else if (a == "--slot" && more) {
      cfg.slot = parse_size(argv[++i]);
    } else if (a == "--slots" && more) {
      cfg.slots = std::atoi(argv[++i]);
    } else if (a == "--reps" && more) {
      reps = std::atoi(argv[++i]);
    } else if (parse_size(a) > 0) {
      sizes.push_back(parse_size(a));
    } else {
      std::fprintf(stderr,
                   "usage: same_host_probe [--threads 1,4] [--slot 256KiB] [--slots 4] "
                   "[--reps 30] [SIZE...]\n");
      return 2;
    }
  }
  for (int t : threads) {
    if (t < 1 || t > kMaxThreads) {
      std::fprintf(stderr, "same_host_probe: --threads takes 1..%d\n", kMaxThreads);
      return 2;
    }
  }
  if (cfg.slot == 0 || cfg.slots < 1 || reps < 1) {
    std::fprintf(stderr, "same_host_probe: --slot, --slots and --reps must be positive\n");
    return 2;
  }
  if (sizes.empty()) sizes = {4096, 65536, 1 << 20, 16 << 20, 64 << 20};
  cfg.max_bytes = *std::max_element(sizes.begin(), sizes.end());

  auto* c = new (map(sizeof(Control), true)) Control();
  c->parent = getpid();
  c->target_threads = *std::max_element(threads.begin(), threads.end());
  auto* src = static_cast<uint8_t*>(map(cfg.max_bytes, false));
  auto* ring = static_cast<uint8_t*>(map(
      cfg.slot * static_cast<size_t>(cfg.slots) * static_cast<size_t>(c->target_threads), true));

  std::string why;
  ferry_tcp::shm::Ring lane = ferry_tcp::shm::Ring::Create(1 << 20, &why);
  if (!lane.ok()) {
    std::fprintf(stderr, "same_host_probe: %s\n", why.c_str());
    return 1;
  }
  ferry_tcp::shm::Handover lane_fds = lane.Duplicate();
  const pid_t child = fork();
  if (child < 0) {
    std::perror("same_host_probe: fork");
    return 1;
  }
  if (child == 0) {
    auto* dst = static_cast<uint8_t*>(map(cfg.max_bytes, false));
    ferry_tcp::shm::Ring reader = ferry_tcp::shm::Ring::Attach(lane_fds, &why);
    if (!reader.ok()) _exit(3);
    g_lane = &reader;
    std::vector<std::thread> th;
    for (int t = 0; t < c->target_threads; ++t)
      th.emplace_back(target_thread, c, cfg, t, src, dst, ring);
    for (auto& x : th) x.join();
    _exit(0);
  }

  lane_fds.Close();
  g_lane = &lane;
  auto* local_dst = static_cast<uint8_t*>(map(cfg.max_bytes, false));
  std::printf("# same_host_probe: median GB/s (1e9 B/s) of %d reps; ring slots %d x %zu B\n", reps,
              cfg.slots, cfg.slot);
  std::printf("%12s %10s", "bytes", "memcpy");
  for (int t : threads) std::printf("   cma x%-2d ratio  ring x%-2d ratio", t, t);
  std::printf("  lane ring ratio\n");
  for (size_t bytes : sizes) {
    std::vector<double> mc;
    for (int r = 0; r < reps + 2; ++r) {
      const auto t0 = Clock::now();
      std::memcpy(local_dst, src, bytes);
      asm volatile("" : : "r"(local_dst) : "memory");
      if (r >= 2) mc.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    const double ref = static_cast<double>(bytes) / median(mc) / 1e9;
    std::printf("%12zu %10.2f", bytes, ref);
    for (int t : threads) {
      for (int mode : {1, 2}) {
        std::vector<double> s;
        for (int r = 0; r < reps + 2; ++r) {
          const double sec = round_trip(c, cfg, mode, t, bytes, src, ring);
          if (r >= 2) s.push_back(sec);
        }
        const double gbs = static_cast<double>(bytes) / median(s) / 1e9;
        if (mode == 1 && c->failed.load() != 0) {
          std::printf("   %8s %5s", "denied", "-");
        } else {
          std::printf("   %8.2f %5.2f", gbs, gbs / ref);
        }
      }
    }
    {
      std::vector<double> s;
      for (int r = 0; r < reps + 2; ++r) {
        const double sec = round_trip(c, cfg, 3, 1, bytes, src, ring);
        if (r >= 2) s.push_back(sec);
      }
      const double gbs = static_cast<double>(bytes) / median(s) / 1e9;
      std::printf("   %9.2f %5.2f", gbs, gbs / ref);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  if (c->failed.load() != 0) {
    std::printf("# cma: process_vm_readv failed (%s): no ptrace rights between the processes\n",
                std::strerror(c->failed.load()));
  }
  if (c->lane_failed.load() != 0) {
    std::printf("# lane ring FAILED: %s\n",
                ferry_tcp::IoErrorString(c->lane_failed.load()).c_str());
  }
  c->mode.store(9);
  c->generation.fetch_add(1);
  int st = 0;
  waitpid(child, &st, 0);
  return 0;
}
