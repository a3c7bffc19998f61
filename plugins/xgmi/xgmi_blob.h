// SPDX-License-Identifier: Apache-2.0
// What xgmi carries between engines: its memory descriptor's blob, the
// message that names a notify transfer's event, and the farewell that lists
// transfers landed (all fuzzed: fuzz_xgmi_wire).
// What an xgmi memory descriptor carries: the IPC handle of the allocation that
// holds the region, the region's offset inside that allocation (MORI's issue 415
// came from forgetting it), and the exporting process (process_tag.h), so an
// importer in the same process uses the address directly (a process cannot open
// its own handle).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace ferry_xgmi {

constexpr uint8_t kBlobVersion = 1;
// MemBlob.flags: the exporting engine's xgmi watches its peers' events
// (notify_events.h). An older xgmi leaves the byte 0 and ignores it.
constexpr uint8_t kMemWatchesEvents = 1;

struct MemBlob {
  uint8_t version = kBlobVersion;
  uint8_t flags = 0;  // kMemWatchesEvents
  uint8_t pad[2] = {};
  int32_t device = -1;     // exporter's device ordinal
  uint64_t process = 0;    // exporter's ProcessTag() (an older xgmi: its pid)
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

// What an initiator's xgmi sends its target's (on_ctrl, notify_events.h):
// "report `uid` once the event in `handle` has fired". Fixed size; both ends
// are on one host.
struct AfterEventMsg {
  static constexpr uint32_t kMagic = 0x31304e58;  // "XN01"
  uint32_t magic = kMagic;
  uint32_t slot = 0;     // in the initiator's pool (same-process lookups)
  uint64_t uid = 0;      // the transfer's notification key
  uint64_t process = 0;  // the initiator's ProcessTag() (an older xgmi: its pid)
  uint64_t pool_id = 0;  // the initiator's pool, random
  uint8_t handle[64] = {};
};
// What an initiator's xgmi sends a target's when it removes that peer or
// ends: "these notify transfers, told by event, have landed". Each was
// reported here after its copies ended, so the claim holds; the target
// reports every uid and its core drops those it had already (exactly once).
// It covers a message the target could not act on in time - the event gone
// before it was opened, because the initiator ended right after the copy.
// Header then `count` uids, little-endian as the host (both on one host).
struct LandedHeader {
  static constexpr uint32_t kMagic = 0x31304c58;  // "XL01"
  static constexpr uint32_t kMaxUids = 1024;      // per message (8 KiB of uids)
  uint32_t magic = kMagic;
  uint32_t count = 0;
};
static_assert(sizeof(LandedHeader) == 8, "LandedHeader is a fixed wire layout");

inline std::vector<uint8_t> EncodeLanded(const uint64_t* uids, uint32_t n) {
  LandedHeader h;
  h.count = n;
  std::vector<uint8_t> out(sizeof h + sizeof(uint64_t) * n);
  std::memcpy(out.data(), &h, sizeof h);
  if (n > 0) std::memcpy(out.data() + sizeof h, uids, sizeof(uint64_t) * n);
  return out;
}

// False for anything but a whole message of this version with 1..kMaxUids uids.
inline bool DecodeLanded(const void* msg, size_t len, std::vector<uint64_t>* uids) {
  LandedHeader h;
  if (msg == nullptr || len < sizeof h) return false;
  std::memcpy(&h, msg, sizeof h);
  if (h.magic != LandedHeader::kMagic || h.count == 0 || h.count > LandedHeader::kMaxUids ||
      len != sizeof h + sizeof(uint64_t) * h.count)
    return false;
  uids->resize(h.count);
  std::memcpy(uids->data(), static_cast<const uint8_t*>(msg) + sizeof h,
              sizeof(uint64_t) * h.count);
  return true;
}

static_assert(offsetof(MemBlob, flags) == 1, "MemBlob's flags byte is byte 1 (the tests read it)");
static_assert(sizeof(AfterEventMsg) == 96, "AfterEventMsg is a fixed wire layout");

// False for anything but a whole message of this version (peer input).
inline bool DecodeAfterEvent(const void* msg, size_t len, AfterEventMsg* out) {
  if (msg == nullptr || len != sizeof(AfterEventMsg)) return false;
  std::memcpy(out, msg, sizeof *out);
  return out->magic == AfterEventMsg::kMagic;
}

}  // namespace ferry_xgmi
