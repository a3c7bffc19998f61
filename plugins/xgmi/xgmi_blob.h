// SPDX-License-Identifier: Apache-2.0
// What an xgmi memory descriptor carries: the IPC handle of the allocation that
// holds the region, the region's offset inside that allocation (MORI's issue 415
// came from forgetting it), and the exporting process, so an importer in the
// same process uses the address directly (a process cannot open its own handle).
#pragma once
#include <cstdint>
#include <cstring>

namespace ferry_xgmi {

constexpr uint8_t kBlobVersion = 1;

struct MemBlob {
  uint8_t version = kBlobVersion;
  uint8_t pad[3] = {};
  int32_t device = -1;     // exporter's device ordinal
  uint64_t pid = 0;        // exporting process
  uint64_t boot_tag = 0;   // hash of the node id: same host check
  uint64_t region_id = 0;  // the core's id of the region
  uint64_t addr = 0;       // region address in the exporter
  uint64_t size = 0;       // region size
  uint64_t offset = 0;     // region address - allocation base
  uint8_t handle[64] = {};
};

inline bool decode(const void* p, size_t n, MemBlob* out) {
  if (n != sizeof(MemBlob)) return false;
  std::memcpy(out, p, sizeof *out);
  return out->version == kBlobVersion && out->size > 0 && out->device >= 0 &&
         out->addr + out->size > out->addr;
}

}  // namespace ferry_xgmi
