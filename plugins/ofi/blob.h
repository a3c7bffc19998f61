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
struct MemInfo {
  uint64_t id = 0;
  uint64_t size = 0;
  std::vector<MemKey> keys;
};

std::vector<uint8_t> EncodeConn(const ConnInfo& ci);
bool DecodeConn(const void* data, size_t len, ConnInfo* out, std::string* why);

std::vector<uint8_t> EncodeMem(const MemInfo& mi);
bool DecodeMem(const void* data, size_t len, MemInfo* out, std::string* why);

}  // namespace ferry_ofi::blob
