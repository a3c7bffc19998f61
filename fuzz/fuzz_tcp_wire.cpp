// SPDX-License-Identifier: Apache-2.0
// libFuzzer: the tcp plugin's data-lane decoders (frame header, item array) and
// the two blobs that travel in descriptors (connection info, memory info).
// Input: a header, then items, as they would arrive on a lane; the whole input
// is also tried as each blob.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "wire.h"

namespace wire = ferry_tcp::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string why;
  if (size >= wire::kHeaderSize) {
    wire::Header h;
    if (wire::DecodeHeader(data, &h, &why)) {
      uint8_t again[wire::kHeaderSize];
      wire::EncodeHeader(h, again);
      if (std::memcmp(again, data, wire::kHeaderSize) != 0) __builtin_trap();
      if (h.n_items > wire::kMaxItems) __builtin_trap();
      if ((h.flags & wire::kFlagDirect) != 0 &&
          h.payload_len != uint64_t{h.n_items} * wire::kAddrSize)
        __builtin_trap();
      const size_t avail = (size - wire::kHeaderSize) / wire::kItemSize;
      const uint32_t n = static_cast<uint32_t>(std::min<size_t>(h.n_items, avail));
      std::vector<wire::Item> items;
      uint64_t total = 0;
      if (wire::DecodeItems(data + wire::kHeaderSize, n, &items, &total, &why)) {
        uint64_t sum = 0;
        for (const auto& it : items) {
          if (it.len == 0) __builtin_trap();
          sum += it.len;
        }
        if (sum != total || total > wire::kMaxPayload) __builtin_trap();
      }
    } else if (why.empty()) {
      __builtin_trap();  // a refusal always says why
    }
  }
  wire::ConnInfo ci;
  if (wire::DecodeConnBlob(data, size, &ci, &why)) {
    if (wire::EncodeConnBlob(ci) != std::vector<uint8_t>(data, data + size)) __builtin_trap();
  }
  wire::MemInfo mi;
  if (wire::DecodeMemBlob(data, size, &mi, &why)) {
    // A version-2 blob re-encodes as version 3 (its kind unknown: not host).
    std::vector<uint8_t> again = wire::EncodeMemBlob(mi);
    if (data[0] == 2) {
      if (mi.host || again.back() != 0) __builtin_trap();
      again.pop_back();
      again[0] = 2;
    }
    if (again != std::vector<uint8_t>(data, data + size)) __builtin_trap();
  }
  return 0;
}
