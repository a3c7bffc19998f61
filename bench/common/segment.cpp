// SPDX-License-Identifier: Apache-2.0
#include "segment.h"

#include <sys/mman.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <vector>

#include "pattern.h"

namespace ferry::bench {

bool parse_seg_type(const std::string& s, SegType* out) {
  std::string u;
  for (char c : s) u += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (u == "DRAM")
    *out = SegType::DRAM;
  else if (u == "VRAM")
    *out = SegType::VRAM;
  else
    return false;
  return true;
}

const char* to_string(SegType t) { return t == SegType::VRAM ? "VRAM" : "DRAM"; }

Segment::~Segment() {
  if (data_ == nullptr) return;
  if (type_ == SegType::DRAM) {
    ::munmap(data_, size_);
    return;
  }
  try {
    gpu::free(data_);
  } catch (const Error&) {
    // Nothing left to do with a runtime that fails to free.
  }
}

namespace {

// GPU memory for a VRAM segment, through the GPU runtime the ferry core loads
// (ferry::gpu, libcudart or libamdhip64 found at run time).
uint8_t* gpu_allocate(int device, size_t bytes, std::string* why) {
  const std::string what = "VRAM segment on device " + std::to_string(device) + ": ";
  if (!gpu::available()) {
    *why = what + "no GPU runtime (libcudart / libamdhip64) or no GPU device here; run with DRAM";
    return nullptr;
  }
  if (device >= gpu::device_count()) {
    *why = what + "this host has " + std::to_string(gpu::device_count()) + " GPU device(s)";
    return nullptr;
  }
  try {
    return static_cast<uint8_t*>(gpu::alloc(bytes, device));
  } catch (const Error& e) {
    *why = what + e.what();
    return nullptr;
  }
}

// Staging chunk for VRAM test data.
constexpr uint64_t kStage = 8u << 20;

}  // namespace

void Segment::fill_pattern(uint64_t off, uint64_t len, uint64_t seed) {
  if (type_ == SegType::DRAM) return test::fill_pattern(data_, off, len, seed);
  std::vector<uint8_t> tmp(std::min(len, kStage));
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min<uint64_t>(len - done, tmp.size());
    for (uint64_t i = 0; i < n; ++i) tmp[i] = test::pattern_byte(seed, off + done + i);
    gpu::copy(data_ + off + done, tmp.data(), n);
    done += n;
  }
}

void Segment::zero(uint64_t off, uint64_t len) {
  if (type_ == SegType::DRAM) {
    std::memset(data_ + off, 0, len);
    return;
  }
  std::vector<uint8_t> tmp(std::min(len, kStage), 0);
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min<uint64_t>(len - done, tmp.size());
    gpu::copy(data_ + off + done, tmp.data(), n);
    done += n;
  }
}

uint64_t Segment::fnv1a(uint64_t off, uint64_t len, uint64_t h) const {
  if (type_ == SegType::DRAM) return test::fnv1a(data_ + off, len, h);
  std::vector<uint8_t> tmp(std::min(len, kStage));
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min<uint64_t>(len - done, tmp.size());
    gpu::copy(tmp.data(), data_ + off + done, n);
    h = test::fnv1a(tmp.data(), n, h);
    done += n;
  }
  return h;
}

int64_t Segment::find_mismatch(uint64_t off, uint64_t len, uint64_t seed) const {
  return find_mismatch(off, len, seed, off);
}

int64_t Segment::find_mismatch(uint64_t off, uint64_t len, uint64_t seed,
                               uint64_t pattern_off) const {
  if (type_ == SegType::DRAM) return test::find_mismatch(data_, off, len, seed, pattern_off);
  std::vector<uint8_t> tmp(std::min(len, kStage));
  for (uint64_t done = 0; done < len;) {
    const uint64_t n = std::min<uint64_t>(len - done, tmp.size());
    gpu::copy(tmp.data(), data_ + off + done, n);
    const int64_t at = test::find_mismatch(tmp.data(), 0, n, seed, pattern_off + done);
    if (at >= 0) return static_cast<int64_t>(done) + at;
    done += n;
  }
  return -1;
}

std::unique_ptr<Segment> Segment::allocate(SegType type, int device, size_t bytes,
                                           std::string* why) {
  auto s = std::make_unique<Segment>();
  s->type_ = type;
  s->size_ = bytes;
  if (bytes == 0) {
    *why = "segment of 0 bytes";
    return nullptr;
  }
  if (type == SegType::VRAM) {
    if (device < 0) {
      *why = "VRAM segment needs a device id >= 0";
      return nullptr;
    }
    s->device_ = device;
    s->data_ = gpu_allocate(device, bytes, why);
    if (s->data_ == nullptr) return nullptr;
    return s;
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    *why = "cannot map " + std::to_string(bytes) + " bytes of host memory: " + std::strerror(errno);
    return nullptr;
  }
  s->data_ = static_cast<uint8_t*>(p);
  std::memset(s->data_, 0, bytes);  // fault every page in now, not inside a timed transfer
  return s;
}

}  // namespace ferry::bench
