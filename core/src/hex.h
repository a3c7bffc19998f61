// SPDX-License-Identifier: Apache-2.0
// Lower-case hex, two digits per byte: names made of random bytes, binary
// blobs in readable JSON, escapes in log lines. Header-only: the fuzz targets
// compile single core sources without the rest of the library.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ferry {

inline constexpr char kHexDigits[] = "0123456789abcdef";

inline std::string to_hex(const uint8_t* p, size_t n) {
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += kHexDigits[p[i] >> 4];
    out += kHexDigits[p[i] & 15];
  }
  return out;
}

}  // namespace ferry
