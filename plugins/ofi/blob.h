// SPDX-License-Identifier: Apache-2.0
// What travels between instances of this plugin: the connection blob (in the
// EngineDesc) and the memory blob (in the MemoryDesc). Little-endian, versioned, length-checked: a decoder
// treats its input as hostile and fails with a reason, never reads past the end.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry_ofi::blob {

constexpr uint8_t kVersion = 1;
constexpr size_t kMaxEndpoints = 8;
constexpr size_t kMaxAddr = 1024;
constexpr size_t kMaxKey = 256;
constexpr size_t kMaxName = 64;

// One opened provider endpoint of an engine.
struct EpInfo {
  std::string provider;       // "shm", "tcp;ofi_rxm"
  std::string doorbell;       // ring it after posting (providers without wait fds); "" = none
  uint32_t addr_format = 0;   // FI_ADDR_*
  std::vector<uint8_t> addr;  // fi_getname()
};
struct ConnInfo {
  std::vector<EpInfo> eps;
};

// One registration of a region with one provider's domain.
struct MemKey {
  std::string provider;
  uint64_t base = 0;  // remote address of the region's first byte (VA or 0 for offsets)
  bool raw = false;   // key is FI_MR_RAW bytes: map with fi_mr_map_raw before use
  std::vector<uint8_t> key;  // 8 bytes little-endian unless raw
};
// GPU memory is registered for local use only (staged by the initiator); its
// blob has no keys and says so, and an importer refuses it with that reason.
// On the wire: zero keys, then one byte kMemGpuLocalOnly. A decoder from before
// this (zero keys not allowed) refuses it too, so no peer ever RMAs into it.
constexpr uint8_t kMemGpuLocalOnly = 1;
struct MemInfo {
  uint64_t id = 0;
  uint64_t size = 0;
  std::vector<MemKey> keys;  // empty exactly when gpu_local_only
  bool gpu_local_only = false;
};

std::vector<uint8_t> EncodeConn(const ConnInfo& ci);
bool DecodeConn(const void* data, size_t len, ConnInfo* out, std::string* why);

std::vector<uint8_t> EncodeMem(const MemInfo& mi);
bool DecodeMem(const void* data, size_t len, MemInfo* out, std::string* why);

}  // namespace ferry_ofi::blob
