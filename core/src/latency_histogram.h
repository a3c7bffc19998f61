// SPDX-License-Identifier: Apache-2.0
// Per-backend transfer metrics for Prometheus (metrics_text.cpp renders them):
// bytes and transfers by op, and a latency histogram per op and size class.
// record() runs on the completion path of every successful transfer, so it is
// a handful of relaxed atomic adds on fixed arrays: no lock, no allocation.
// A scrape reads the atomics one by one; a transfer landing meanwhile may be
// counted in one series and not yet in another, which Prometheus tolerates.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "ferry/ferry.hpp"

namespace ferry {

class TransferMetrics {
 public:
  static constexpr size_t kOps = 2;  // 0: READ, 1: WRITE
  // Size classes by their upper bound (bytes, inclusive); the last has none.
  static constexpr std::array<uint64_t, 4> kSizeBounds = {4096, 65536, 1u << 20, 16u << 20};
  static constexpr std::array<const char*, 5> kSizeNames = {"le4KiB", "le64KiB", "le1MiB",
                                                            "le16MiB", "gt16MiB"};
  static constexpr size_t kSizeClasses = kSizeNames.size();
  // Latency bucket upper bounds in microseconds: 10 us (shared memory, small
  // messages) to 10 s (a large transfer near the default 30 s deadline).
  static constexpr std::array<uint64_t, 15> kBucketUs = {
      10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 100000, 250000, 1000000, 10000000};
  static constexpr size_t kBuckets = kBucketUs.size();

  struct Cell {
    std::array<std::atomic<uint64_t>, kBuckets + 1> buckets{};  // the last: above every bound
    std::atomic<uint64_t> sum_ns{0};
  };

  static size_t op_index(Op op) { return op == Op::READ ? 0 : 1; }
  static const char* op_name(size_t i) { return i == 0 ? "read" : "write"; }
  static size_t size_class(uint64_t bytes) {
    size_t i = 0;
    while (i < kSizeBounds.size() && bytes > kSizeBounds[i]) ++i;
    return i;
  }
  static size_t bucket(std::chrono::nanoseconds latency) {
    const auto us = static_cast<uint64_t>(latency.count() < 0 ? 0 : latency.count()) / 1000;
    size_t i = 0;
    while (i < kBuckets && us > kBucketUs[i]) ++i;  // 16 compares at most
    return i;
  }

  void record(Op op, uint64_t bytes, std::chrono::nanoseconds latency) noexcept {
    const size_t o = op_index(op);
    bytes_[o].fetch_add(bytes, std::memory_order_relaxed);
    transfers_[o].fetch_add(1, std::memory_order_relaxed);
    Cell& c = cells_[o][size_class(bytes)];
    c.buckets[bucket(latency)].fetch_add(1, std::memory_order_relaxed);
    c.sum_ns.fetch_add(static_cast<uint64_t>(latency.count() < 0 ? 0 : latency.count()),
                       std::memory_order_relaxed);
  }

  uint64_t bytes(size_t op) const { return bytes_[op].load(std::memory_order_relaxed); }
  uint64_t transfers(size_t op) const { return transfers_[op].load(std::memory_order_relaxed); }
  const Cell& cell(size_t op, size_t size_class) const { return cells_[op][size_class]; }

 private:
  std::array<std::atomic<uint64_t>, kOps> bytes_{};
  std::array<std::atomic<uint64_t>, kOps> transfers_{};
  std::array<std::array<Cell, kSizeClasses>, kOps> cells_{};
};

}  // namespace ferry
