// SPDX-License-Identifier: Apache-2.0
// libFuzzer: what the cma plugin (the plugin template, examples/plugin-cma)
// reads from peers - its connection blob (pid, start time, PID namespace, node
// id) and memory blob. Whatever a decoder accepts must be within its limits
// and encode back to exactly the bytes it read.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cma_blob.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  cma_conn c{};
  if (cma_conn_decode(data, size, &c)) {
    if (c.pid == 0 || c.pid > static_cast<uint32_t>(INT32_MAX) || c.node_len > CMA_MAX_NODE_ID ||
        c.node_id < reinterpret_cast<const char*>(data) ||
        c.node_id + c.node_len > reinterpret_cast<const char*>(data) + size)
      __builtin_trap();
    std::vector<uint8_t> back(cma_conn_blob_len(c.node_len));
    if (cma_conn_encode(back.data(), back.size(), &c) != size ||
        std::memcmp(back.data(), data, size) != 0)
      __builtin_trap();
  }
  uint64_t id = 0, addr = 0, bytes = 0;
  if (cma_mem_decode(data, size, &id, &addr, &bytes)) {
    uint8_t back[CMA_MEM_BLOB_LEN];
    cma_mem_encode(back, id, addr, bytes);
    if (size != CMA_MEM_BLOB_LEN || std::memcmp(back, data, size) != 0) __builtin_trap();
  }
  return 0;
}
