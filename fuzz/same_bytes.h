// SPDX-License-Identifier: Apache-2.0
// For the round-trip fuzzers: what a decoder accepted must encode back to the
// exact bytes it read; anything else stops the fuzzer (a finding).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

inline void same_bytes(const std::vector<uint8_t>& enc, const uint8_t* data, size_t size) {
  if (enc.size() != size || (size > 0 && std::memcmp(enc.data(), data, size) != 0))
    __builtin_trap();
}
