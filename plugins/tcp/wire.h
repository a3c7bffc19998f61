// SPDX-License-Identifier: Apache-2.0
// The tcp plugin's wire format: frames on data lanes and the two opaque blobs
// (connection info, memory info) that travel inside ferry descriptors.
//
// Everything here is pure encode/decode with no I/O, so the hostile-input rules
// live in one place: a decoder never trusts a length or count from the wire and
// says in words what it rejected.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ferry_tcp::wire {

// "FRRY" as bytes on the wire; all integers are little-endian.
inline constexpr uint8_t kMagic[4] = {'F', 'R', 'R', 'Y'};
// Version 2 added attempt_id and expires_ns; version 3 the region key and the
// link proofs of access by descriptor (96-byte header). Lanes of an older
// version are refused with "unsupported frame version".
inline constexpr uint8_t kVersion = 3;
inline constexpr size_t kHeaderSize = 96;
inline constexpr size_t kItemSize = 16;
inline constexpr uint32_t kMaxItems = 8192;
// Also the upper bound of the chunk_bytes setting: one frame's payload.
inline constexpr uint64_t kMaxPayload = 64ull << 20;
inline constexpr size_t kMaxKeyLen = 255;
inline constexpr size_t kMaxErrorLen = 1024;

enum class Type : uint8_t {
  kHello = 1,     // initiator -> target, first frame of a lane; payload = engine key
  kWrite = 2,     // items + payload; answered by kWriteAck or kError
  kRead = 3,      // items only; answered by kReadData or kError
  kWriteAck = 4,  // the payload is in the target's memory
  kReadData = 5,  // payload = the requested bytes, items in request order
  kError = 6,     // status < 0, payload = reason text; req_id 0 = whole lane refused
  kAuth = 7,      // lane handshake (see below); payload 32, 96 or 64 bytes
};

inline constexpr uint16_t kFlagNotify = 1;  // requests: the target must learn of the transfer
// Requests on a ring lane whose ends agreed to direct copies (direct_copy.h):
// the payload is n_items addresses in the initiator's memory (u64 each, in item
// order; payload_len = 8 * n_items), item i's bytes are there, and the target
// copies them itself (a WRITE's from there, a READ's to there). A READ's
// READ_DATA then carries no payload: the bytes are in place when it is sent.
inline constexpr uint16_t kFlagDirect = 4;
inline constexpr size_t kAddrSize = 8;
// HELLO: the initiator proves access by descriptor (host link_prove, ABI 1.4).
// Then, before any request:
//   initiator -> target  AUTH  Ni (32 random bytes)
//   target -> initiator  AUTH  Nt (32 random bytes) | Pt (64)
//   initiator -> target  AUTH  Pi (64)
// Pt = link_prove(initiator, TARGET, AuthTranscript(kAuthTargetLabel, ...)) and
// Pi = link_prove(target, INITIATOR, AuthTranscript(kAuthInitiatorLabel, ...));
// each side checks the other's with link_check. A target whose host offers
// link_check refuses a HELLO without this flag; one whose host does not (a
// core before ABI 1.4, a test host) refuses a HELLO with it. Each refusal is an
// ERROR (req_id 0) that says why.
inline constexpr uint16_t kFlagAuth = 2;
inline constexpr size_t kAuthNonceSize = 32;
inline constexpr size_t kAuthProofSize = 64;  // FERRY_LINK_PROOF_SIZE
inline constexpr const char* kAuthTargetLabel = "ferry-tcp-v3 target";
inline constexpr const char* kAuthInitiatorLabel = "ferry-tcp-v3 initiator";

struct Header {
  Type type = Type::kHello;
  uint16_t flags = 0;
  uint32_t n_items = 0;
  uint32_t frame_count = 0;  // frames in the whole transfer (requests)
  uint64_t req_id = 0;       // matches a response to its request on one lane
  uint64_t region_id = 0;    // the target's region (requests)
  uint64_t region_key = 0;   // requests: the region's random key from its memory blob
  uint64_t payload_len = 0;  // bytes after the item array
  uint64_t xfer_seq = 0;     // per (initiator, target) transfer sequence
  uint64_t uid = 0;          // the application's uid (notification key)
  uint64_t low_seq = 0;      // every notify transfer below this one is finished
  int32_t status = 0;        // responses: FERRY_OK or FERRY_ERR_*
  uint64_t attempt_id = 0;   // requests: the core's attempt (ferry_xfer_v1.attempt_id), for fences
  // Requests: the attempt's deadline on the initiator's clock (0: none); HELLO:
  // the initiator's clock when it sent the HELLO, so the target can map it onto
  // its own. A frame read after its attempt expired is dropped, not applied.
  uint64_t expires_ns = 0;
};

struct Item {
  uint64_t offset = 0;  // in the target's region
  uint64_t len = 0;
};

void EncodeHeader(const Header& h, uint8_t out[kHeaderSize]);
// Checks everything a header can be checked for on its own; *why says what failed.
bool DecodeHeader(const uint8_t in[kHeaderSize], Header* h, std::string* why);

void EncodeItem(const Item& item, uint8_t out[kItemSize]);
// Decodes n items; each must be non-empty and their sum must not exceed kMaxPayload.
bool DecodeItems(const uint8_t* in, uint32_t n, std::vector<Item>* items, uint64_t* total,
                 std::string* why);

// A whole request/hello/error frame minus any payload, ready to send.
std::vector<uint8_t> EncodeFrameHead(const Header& h, const std::vector<Item>& items);
// Turns an encoded request head (EncodeFrameHead) into a direct one: sets
// kFlagDirect and the payload length, and appends local[i]'s address for each
// of its n items (local[i] holds item i's bytes).
void MakeDirect(std::vector<uint8_t>* frame_head, const iovec* local, size_t n);
// A direct request's payload: n addresses.
void DecodeAddrs(const uint8_t* in, uint32_t n, std::vector<uint64_t>* addrs);

// Connection info: version, port, host. An empty host means "use the host the
// core knows the peer by" (set when listening on a wildcard address).
//
// Version 2 appends the name of the target's abstract unix socket for lanes
// from engines on its host (channel.h): one length byte (0: none) and up to
// kMaxUnixName characters of [A-Za-z0-9_-] (1 at least: a blob without a
// socket is written as version 1). Version 1 blobs still decode (no
// socket); a version-1 reader refuses a version-2 blob, so an engine whose
// peers run an older ferry turns same_host_rings off (settings.h).
struct ConnInfo {
  std::string host;
  uint16_t port = 0;
  std::string unix_name;
};
inline constexpr uint8_t kConnBlobVersion = 2;
inline constexpr size_t kMaxUnixName = 64;
std::vector<uint8_t> EncodeConnBlob(const ConnInfo& info);
bool DecodeConnBlob(const void* blob, size_t len, ConnInfo* info, std::string* why);

// Memory info: the region id and size, so an import can be cross-checked, and
// the region's random key, which every request for it presents (like an rkey):
// an engine's descriptor alone does not grant every region.
//
// Version 3 appends a flags byte: bit 0, the region is host memory, which a
// same-host initiator may have the target copy directly (kFlagDirect). A
// version-2 blob (25 bytes) still decodes, as memory of an unknown kind.
struct MemInfo {
  uint64_t id = 0;
  uint64_t size = 0;
  uint64_t key = 0;
  bool host = false;
};
inline constexpr uint8_t kMemBlobVersion = 3;
inline constexpr size_t kMemBlobSize = 26;
inline constexpr uint8_t kMemHost = 1;
std::vector<uint8_t> EncodeMemBlob(const MemInfo& info);
bool DecodeMemBlob(const void* blob, size_t len, MemInfo* info, std::string* why);

const char* TypeName(Type t);

// What a lane handshake MACs: label, both nonces, both engine keys (length-prefixed).
std::vector<uint8_t> AuthTranscript(std::string_view label, const uint8_t* initiator_nonce,
                                    const uint8_t* target_nonce, std::string_view initiator_key,
                                    std::string_view target_key);

}  // namespace ferry_tcp::wire
