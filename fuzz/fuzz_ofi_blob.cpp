// SPDX-License-Identifier: Apache-2.0
// libFuzzer: what the ofi plugin reads from peers - its connection blob (in
// the engine descriptor) and memory blob (in a memory descriptor). Whatever a
// decoder accepts must be within its limits and encode back to exactly the
// bytes it read; a refusal always says why.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ofi/blob.h"
#include "same_bytes.h"

namespace b = ferry_ofi::blob;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string why;
  b::ConnInfo c;
  if (b::DecodeConn(data, size, &c, &why)) {
    if (c.eps.empty() || c.eps.size() > b::kMaxEndpoints) __builtin_trap();
    for (const auto& e : c.eps)
      if (e.addr.size() > b::kMaxAddr || e.provider.size() > b::kMaxName) __builtin_trap();
    same_bytes(b::EncodeConn(c), data, size);
  } else if (why.empty()) {
    __builtin_trap();
  }
  why.clear();
  b::MemInfo m;
  if (b::DecodeMem(data, size, &m, &why)) {
    if (m.keys.empty() != m.gpu_local_only || m.keys.size() > b::kMaxEndpoints) __builtin_trap();
    for (const auto& k : m.keys)
      if (k.key.size() > b::kMaxKey || (!k.raw && k.key.size() != 8)) __builtin_trap();
    same_bytes(b::EncodeMem(m), data, size);
  } else if (why.empty()) {
    __builtin_trap();
  }
  return 0;
}
