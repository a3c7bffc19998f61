// SPDX-License-Identifier: Apache-2.0
// How long a backend's transfers of about this size have been taking: per
// size class (a power of two of bytes), a moving average of nanoseconds per
// byte over its recent successful transfers. A wait uses it to be awake when
// its transfer is due (TransferStatus::SetExpectedEnd): a waiter that slept
// through a GPU copy of 256 MiB (~130 us on an H200) was woken 5-8 us after
// it ended, a cost the raw copy's own spin-wait does not pay (issue 19).
// Lock-free: transfers of any thread record and read it.
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdint>

namespace ferry {

class DurationModel {
 public:
  // A transfer of `bytes` took `took` from its post to its end.
  void record(uint64_t bytes, std::chrono::nanoseconds took) {
    if (bytes < kMinBytes || took.count() <= 0) return;
    // Femtoseconds per byte: 1 TB/s is 1,000 fs a byte (picoseconds rounded
    // an H100's 1.4 TB/s copy to 0), and a transfer of 10 s still fits.
    const uint64_t sample = static_cast<uint64_t>(took.count()) * 1000000 / bytes;
    std::atomic<uint64_t>& slot = classes_[size_class(bytes)];
    const uint64_t old = slot.load(std::memory_order_relaxed);
    // 1/4 of the new sample: a few transfers follow a change (another peer,
    // another memory), one outlier does not (a race here only drops a sample).
    slot.store(old == 0 ? sample : old - old / 4 + sample / 4, std::memory_order_relaxed);
  }
  // What a transfer of `bytes` should take, or 0 when this size class has no history.
  std::chrono::nanoseconds expected(uint64_t bytes) const {
    if (bytes < kMinBytes) return std::chrono::nanoseconds(0);
    const uint64_t fs = classes_[size_class(bytes)].load(std::memory_order_relaxed);
    // (bytes / 1000 first: 2^40 bytes at 1e6 fs a byte would overflow.)
    return std::chrono::nanoseconds(fs == 0 ? 0 : static_cast<int64_t>(bytes / 1000 * fs / 1000));
  }

  // Below this a transfer ends within the wait's plain spin anyway.
  static constexpr uint64_t kMinBytes = 64 << 10;

 private:
  static size_t size_class(uint64_t bytes) { return static_cast<size_t>(std::bit_width(bytes)); }
  std::array<std::atomic<uint64_t>, 65> classes_{};
};

}  // namespace ferry
