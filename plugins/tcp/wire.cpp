// SPDX-License-Identifier: Apache-2.0
#include "wire.h"

#include <cstring>

#include "hot_path.h"

namespace ferry_tcp::wire {
namespace {

// Byte-wise so the format does not depend on the host's endianness or alignment.
void Put16(uint8_t* p, uint16_t v) {
  for (int i = 0; i < 2; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void Put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint16_t Get16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t Get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

bool Fail(std::string* why, std::string msg) {
  if (why) *why = std::move(msg);
  return false;
}

}  // namespace

const char* TypeName(Type t) {
  switch (t) {
    case Type::kHello:
      return "HELLO";
    case Type::kWrite:
      return "WRITE";
    case Type::kRead:
      return "READ";
    case Type::kWriteAck:
      return "WRITE_ACK";
    case Type::kReadData:
      return "READ_DATA";
    case Type::kError:
      return "ERROR";
    case Type::kAuth:
      return "AUTH";
  }
  return "?";
}

void EncodeHeader(const Header& h, uint8_t out[kHeaderSize]) {
  std::memcpy(out, kMagic, 4);
  out[4] = kVersion;
  out[5] = static_cast<uint8_t>(h.type);
  Put16(out + 6, h.flags);
  Put32(out + 8, h.n_items);
  Put32(out + 12, h.frame_count);
  Put64(out + 16, h.req_id);
  Put64(out + 24, h.region_id);
  Put64(out + 32, h.payload_len);
  Put64(out + 40, h.xfer_seq);
  Put64(out + 48, h.uid);
  Put64(out + 56, h.low_seq);
  Put32(out + 64, static_cast<uint32_t>(h.status));
  Put32(out + 68, 0);
  Put64(out + 72, h.attempt_id);
  Put64(out + 80, h.expires_ns);
  Put64(out + 88, h.region_key);
}

bool DecodeHeader(const uint8_t in[kHeaderSize], Header* h, std::string* why) {
  if (std::memcmp(in, kMagic, 4) != 0) return Fail(why, "bad magic");
  if (in[4] != kVersion) {
    return Fail(why, "unsupported frame version " + std::to_string(in[4]) + " (want " +
                         std::to_string(kVersion) + ")");
  }
  const uint8_t type = in[5];
  if (type < static_cast<uint8_t>(Type::kHello) || type > static_cast<uint8_t>(Type::kAuth)) {
    return Fail(why, "unknown frame type " + std::to_string(type));
  }
  h->type = static_cast<Type>(type);
  h->flags = Get16(in + 6);
  h->n_items = Get32(in + 8);
  h->frame_count = Get32(in + 12);
  h->req_id = Get64(in + 16);
  h->region_id = Get64(in + 24);
  h->payload_len = Get64(in + 32);
  h->xfer_seq = Get64(in + 40);
  h->uid = Get64(in + 48);
  h->low_seq = Get64(in + 56);
  h->status = static_cast<int32_t>(Get32(in + 64));
  if (Get32(in + 68) != 0) return Fail(why, "reserved header field is not zero");
  h->attempt_id = Get64(in + 72);
  h->expires_ns = Get64(in + 80);
  h->region_key = Get64(in + 88);

  const std::string name = TypeName(h->type);
  const bool request = h->type == Type::kWrite || h->type == Type::kRead;
  if (h->type == Type::kHello) {
    if (h->flags & ~kFlagAuth) return Fail(why, name + ": unknown flags");
  } else {
    if (h->flags & ~(kFlagNotify | kFlagDirect)) return Fail(why, name + ": unknown flags");
    if (h->flags && !request) return Fail(why, name + ": flags on a non-request frame");
  }
  if (!request && h->n_items != 0) return Fail(why, name + ": unexpected items");
  if (request) {
    if (h->n_items == 0 || h->n_items > kMaxItems) {
      return Fail(why, name + ": item count " + std::to_string(h->n_items) + " not in 1.." +
                           std::to_string(kMaxItems));
    }
    if (h->frame_count == 0) return Fail(why, name + ": frame count 0");
    if (h->low_seq > h->xfer_seq) return Fail(why, name + ": low sequence above sequence");
    if (h->status != 0) return Fail(why, name + ": status set on a request");
  } else if (h->attempt_id != 0 || h->region_key != 0 ||
             (h->expires_ns != 0 && h->type != Type::kHello)) {
    return Fail(why, name + ": attempt id or expiry on a non-request frame");
  }
  if (h->flags & kFlagDirect) {
    if (h->payload_len != uint64_t{h->n_items} * kAddrSize)
      return Fail(why, name + ": a direct request's payload is not one address per item");
    return true;
  }
  switch (h->type) {
    case Type::kHello:
      if (h->payload_len == 0 || h->payload_len > kMaxKeyLen) {
        return Fail(why, "HELLO: key length " + std::to_string(h->payload_len) + " not in 1.." +
                             std::to_string(kMaxKeyLen));
      }
      break;
    case Type::kReadData:  // 0: the answer to a direct READ
    case Type::kWrite:
      if ((h->payload_len == 0 && h->type == Type::kWrite) || h->payload_len > kMaxPayload) {
        return Fail(why, name + ": payload length " + std::to_string(h->payload_len) +
                             " not in 1.." + std::to_string(kMaxPayload));
      }
      break;
    case Type::kRead:
    case Type::kWriteAck:
      if (h->payload_len != 0) return Fail(why, name + ": unexpected payload");
      break;
    case Type::kError:
      if (h->payload_len > kMaxErrorLen) return Fail(why, "ERROR: message too long");
      if (h->status >= 0) return Fail(why, "ERROR: status is not an error");
      break;
    case Type::kAuth:
      if (h->payload_len != kAuthNonceSize && h->payload_len != kAuthProofSize &&
          h->payload_len != kAuthNonceSize + kAuthProofSize) {
        return Fail(
            why, "AUTH: payload length " + std::to_string(h->payload_len) + " is not 32, 64 or 96");
      }
      break;
  }
  if (h->type != Type::kError && h->status != 0) return Fail(why, name + ": unexpected status");
  return true;
}

void EncodeItem(const Item& item, uint8_t out[kItemSize]) {
  Put64(out, item.offset);
  Put64(out + 8, item.len);
}

bool DecodeItems(const uint8_t* in, uint32_t n, std::vector<Item>* items, uint64_t* total,
                 std::string* why) {
  if (n > kMaxItems) return Fail(why, "too many items");
  items->resize(n);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; ++i) {
    Item& it = (*items)[i];
    it.offset = Get64(in + i * kItemSize);
    it.len = Get64(in + i * kItemSize + 8);
    if (it.len == 0) return Fail(why, "item " + std::to_string(i) + " is empty");
    // Each len is checked before adding, so sum never wraps.
    if (it.len > kMaxPayload || sum + it.len > kMaxPayload) {
      return Fail(why, "items add up to more than " + std::to_string(kMaxPayload) + " bytes");
    }
    sum += it.len;
  }
  *total = sum;
  return true;
}

FERRY_HOT std::vector<uint8_t> EncodeFrameHead(const Header& h, const std::vector<Item>& items) {
  std::vector<uint8_t> out(kHeaderSize + items.size() * kItemSize);
  EncodeHeader(h, out.data());
  for (size_t i = 0; i < items.size(); ++i) {
    EncodeItem(items[i], out.data() + kHeaderSize + i * kItemSize);
  }
  return out;
}

FERRY_HOT void MakeDirect(std::vector<uint8_t>* frame_head, const iovec* local, size_t n) {
  uint8_t* h = frame_head->data();
  Put16(h + 6, static_cast<uint16_t>(Get16(h + 6) | kFlagDirect));
  Put64(h + 32, n * kAddrSize);
  const size_t at = frame_head->size();
  frame_head->resize(at + n * kAddrSize);
  for (size_t i = 0; i < n; ++i)
    Put64(frame_head->data() + at + i * kAddrSize, reinterpret_cast<uintptr_t>(local[i].iov_base));
}

void DecodeAddrs(const uint8_t* in, uint32_t n, std::vector<uint64_t>* addrs) {
  addrs->resize(n);
  for (uint32_t i = 0; i < n; ++i) (*addrs)[i] = Get64(in + i * kAddrSize);
}

std::vector<uint8_t> AuthTranscript(std::string_view label, const uint8_t* initiator_nonce,
                                    const uint8_t* target_nonce, std::string_view initiator_key,
                                    std::string_view target_key) {
  std::vector<uint8_t> t;
  auto str = [&](std::string_view s) {
    const size_t n = s.size() > 255 ? 255 : s.size();
    t.push_back(static_cast<uint8_t>(n));
    t.insert(t.end(), s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n));
  };
  str(label);
  t.insert(t.end(), initiator_nonce, initiator_nonce + kAuthNonceSize);
  t.insert(t.end(), target_nonce, target_nonce + kAuthNonceSize);
  str(initiator_key);
  str(target_key);
  return t;
}

std::vector<uint8_t> EncodeConnBlob(const ConnInfo& info) {
  // Without a socket name, version 1: what every ferry reads.
  const bool v2 = !info.unix_name.empty();
  std::vector<uint8_t> out(4 + info.host.size() + (v2 ? 1 + info.unix_name.size() : 0));
  out[0] = v2 ? kConnBlobVersion : 1;
  Put16(out.data() + 1, info.port);
  out[3] = static_cast<uint8_t>(info.host.size());
  std::memcpy(out.data() + 4, info.host.data(), info.host.size());
  if (v2) {
    uint8_t* p = out.data() + 4 + info.host.size();
    p[0] = static_cast<uint8_t>(info.unix_name.size());
    std::memcpy(p + 1, info.unix_name.data(), info.unix_name.size());
  }
  return out;
}

bool DecodeConnBlob(const void* blob, size_t len, ConnInfo* info, std::string* why) {
  const auto* p = static_cast<const uint8_t*>(blob);
  if (p == nullptr || len < 4) return Fail(why, "tcp connection blob too short");
  if (p[0] != 1 && p[0] != kConnBlobVersion) {
    return Fail(why, "tcp connection blob version " + std::to_string(p[0]) + " unsupported");
  }
  const size_t host_len = p[3];
  size_t want = 4 + host_len;
  size_t name_len = 0;
  if (p[0] == 2) {
    if (len < want + 1) return Fail(why, "tcp connection blob length mismatch");
    name_len = p[want];
    want += 1 + name_len;
  }
  if (len != want) return Fail(why, "tcp connection blob length mismatch");
  info->port = Get16(p + 1);
  if (info->port == 0) return Fail(why, "tcp connection blob has port 0");
  info->host.assign(reinterpret_cast<const char*>(p + 4), host_len);
  for (char c : info->host) {
    // Hostnames and IPv4/IPv6 literals only: no spaces, controls or non-ASCII.
    if (c <= 0x20 || c >= 0x7f) return Fail(why, "tcp connection blob has a bad host name");
  }
  info->unix_name.assign(reinterpret_cast<const char*>(p + 5 + host_len), name_len);
  // Version 2 exists to name a socket: one without is written as version 1.
  if (p[0] == 2 && (name_len == 0 || name_len > kMaxUnixName))
    return Fail(why, "tcp connection blob has a bad unix socket name");
  for (char c : info->unix_name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_';
    if (!ok) return Fail(why, "tcp connection blob has a bad unix socket name");
  }
  return true;
}

std::vector<uint8_t> EncodeMemBlob(const MemInfo& info) {
  std::vector<uint8_t> out(kMemBlobSize);
  out[0] = kMemBlobVersion;
  Put64(out.data() + 1, info.id);
  Put64(out.data() + 9, info.size);
  Put64(out.data() + 17, info.key);
  out[25] = info.host ? kMemHost : 0;
  return out;
}

bool DecodeMemBlob(const void* blob, size_t len, MemInfo* info, std::string* why) {
  const auto* p = static_cast<const uint8_t*>(blob);
  if (p == nullptr || len == 0) return Fail(why, "tcp memory blob has a bad length");
  // Version 2: the same less the flags byte.
  const size_t want = p[0] == 2 ? kMemBlobSize - 1 : kMemBlobSize;
  if (p[0] != kMemBlobVersion && p[0] != 2) {
    return Fail(why, "tcp memory blob version " + std::to_string(p[0]) + " unsupported");
  }
  if (len != want) return Fail(why, "tcp memory blob has a bad length");
  info->id = Get64(p + 1);
  info->size = Get64(p + 9);
  info->key = Get64(p + 17);
  info->host = false;
  if (p[0] == kMemBlobVersion) {
    if ((p[25] & ~kMemHost) != 0) return Fail(why, "tcp memory blob has unknown flags");
    info->host = (p[25] & kMemHost) != 0;
  }
  return true;
}

}  // namespace ferry_tcp::wire
