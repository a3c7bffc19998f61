// SPDX-License-Identifier: Apache-2.0
// libFuzzer: what the xgmi plugin reads from peers - its memory descriptor blob
// (inside a MemoryDesc) and the message naming a notify transfer's event
// (on_ctrl), and the farewell listing landed transfers. A blob accepted must
// describe a non-empty region that does not wrap; a message accepted must be
// exactly one of this version; a farewell accepted must hold exactly what it
// says, 1..kMaxUids uids, and encode back to the same bytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xgmi_blob.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ferry_xgmi::MemBlob b;
  if (ferry_xgmi::decode(data, size, &b)) {
    if (size != sizeof b || b.size == 0 || b.device < 0 || b.addr + b.size <= b.addr)
      __builtin_trap();
  }
  ferry_xgmi::AfterEventMsg m;
  if (ferry_xgmi::DecodeAfterEvent(data, size, &m)) {
    if (size != sizeof m || m.magic != ferry_xgmi::AfterEventMsg::kMagic ||
        std::memcmp(&m, data, sizeof m) != 0)
      __builtin_trap();
  }
  std::vector<uint64_t> uids;
  if (ferry_xgmi::DecodeLanded(data, size, &uids)) {
    if (uids.empty() || uids.size() > ferry_xgmi::LandedHeader::kMaxUids ||
        ferry_xgmi::EncodeLanded(uids.data(), static_cast<uint32_t>(uids.size())) !=
            std::vector<uint8_t>(data, data + size))
      __builtin_trap();
  }
  return 0;
}
