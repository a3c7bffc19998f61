// Byte counts in words, as the policy YAML writes them ("1MiB", "64KiB",
// "4097B"), for the in-tree plugins' describe() lines and messages.
//
// plugins/common holds small header-only helpers that the in-tree plugins
// (tcp, ofi, rdma) share instead of each carrying a copy. It is not part of the
// plugin ABI: a plugin built elsewhere still needs only ferry/plugin.h.
#pragma once

#include <cstdint>
#include <string>

namespace ferry_plugin_kit {

inline std::string FormatBytes(uint64_t n) {
  if (n != 0 && n % (1ull << 30) == 0) return std::to_string(n >> 30) + "GiB";
  if (n != 0 && n % (1ull << 20) == 0) return std::to_string(n >> 20) + "MiB";
  if (n != 0 && n % (1ull << 10) == 0) return std::to_string(n >> 10) + "KiB";
  return std::to_string(n) + "B";
}

}  // namespace ferry_plugin_kit
