// SPDX-License-Identifier: Apache-2.0
// Deterministic test data: the byte at absolute offset i for a given seed, and
// a hash to compare ranges held by two processes without shipping the bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::test {

inline uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (i >> 3) * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint8_t>(x >> (8 * (i & 7)));
}

inline void fill_pattern(uint8_t* base, uint64_t off, uint64_t len, uint64_t seed) {
  for (uint64_t i = 0; i < len; ++i) base[off + i] = pattern_byte(seed, off + i);
}

// Offset of the first byte in [off, off+len) that differs from the pattern, or -1.
inline int64_t find_mismatch(const uint8_t* base, uint64_t off, uint64_t len, uint64_t seed,
                             uint64_t pattern_off) {
  for (uint64_t i = 0; i < len; ++i)
    if (base[off + i] != pattern_byte(seed, pattern_off + i)) return static_cast<int64_t>(i);
  return -1;
}

constexpr uint64_t kFnvBasis = 1469598103934665603ull;

inline uint64_t fnv1a(const uint8_t* p, size_t n, uint64_t h = kFnvBasis) {
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

inline std::string to_hex(const std::vector<uint8_t>& v) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(v.size() * 2);
  for (uint8_t c : v) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

inline std::vector<uint8_t> from_hex(const std::string& s) {
  auto val = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::vector<uint8_t> v(s.size() / 2);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<uint8_t>(val(s[2 * i]) << 4 | val(s[2 * i + 1]));
  return v;
}

}  // namespace ferry::test
