// SPDX-License-Identifier: Apache-2.0
// Benchmark memory segments in nixlbench's vocabulary: DRAM (host memory) or
// VRAM (GPU memory on a device). The one place that allocates them, so GPU
// support changes a single function.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ferry/ferry.hpp"

namespace ferry::bench {

enum class SegType { DRAM, VRAM };

// "DRAM" / "VRAM" (any case); false for anything else.
bool parse_seg_type(const std::string& s, SegType* out);
const char* to_string(SegType t);

class Segment {
 public:
  Segment() = default;
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Host memory: page-aligned, every page touched (no first-touch faults
  // inside a timed transfer). VRAM: ferry::gpu::alloc on `device` (the GPU
  // runtime the core loads at run time); fails with a message saying what is
  // missing (no runtime, no such device) instead.
  static std::unique_ptr<Segment> allocate(SegType type, int device, size_t bytes,
                                           std::string* why);

  SegType type() const { return type_; }
  int device() const { return device_; }
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Test data, in place for DRAM and through a host staging copy for VRAM:
  // pattern(seed) over [off, off+len) (absolute offsets), zeroes, FNV-1a of a
  // range, and the first byte of a range that differs from pattern(seed) (-1: none).
  void fill_pattern(uint64_t off, uint64_t len, uint64_t seed);
  void zero(uint64_t off, uint64_t len);
  uint64_t fnv1a(uint64_t off, uint64_t len, uint64_t h) const;
  int64_t find_mismatch(uint64_t off, uint64_t len, uint64_t seed) const;
  // The same, against the pattern as it was written at pattern_off (bytes
  // READ from another offset of the region they were made in).
  int64_t find_mismatch(uint64_t off, uint64_t len, uint64_t seed, uint64_t pattern_off) const;
  MemoryLocation location() const {
    return type_ == SegType::VRAM ? MemoryLocation::GPU : MemoryLocation::CPU;
  }
  int registration_device() const { return type_ == SegType::VRAM ? device_ : -1; }

 private:
  SegType type_ = SegType::DRAM;
  int device_ = -1;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace ferry::bench
