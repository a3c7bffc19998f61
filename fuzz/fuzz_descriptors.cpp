// SPDX-License-Identifier: Apache-2.0
// libFuzzer: engine and memory descriptor decoding (msgpack from a peer, out of
// band). A forged blob must end in ferry::Error, never a crash; what decodes
// must survive re-encoding and printing.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ferry/ferry.hpp"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  try {
    EngineDesc d = EngineDesc::unpack(bytes);
    if (EngineDesc::unpack(d.pack()) != d) __builtin_trap();
    (void)d.to_json();
  } catch (const Error&) {
  }
  try {
    MemoryDesc m = MemoryDesc::unpack(bytes);
    if (MemoryDesc::unpack(m.pack()) != m) __builtin_trap();
    (void)m.to_json();
  } catch (const Error&) {
  }
  return 0;
}
