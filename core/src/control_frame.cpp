// SPDX-License-Identifier: Apache-2.0
#include "control_frame.h"

#include <cstring>

#include "wire_codec.h"

namespace ferry {

std::vector<uint8_t> encode_ctrl_frame(CtrlType type, const std::vector<uint8_t>& body) {
  wire::Writer w;
  w.u32(kCtrlMagic);
  w.u8(kCtrlVersion);
  w.u8(static_cast<uint8_t>(type));
  w.u16(0);
  w.u32(static_cast<uint32_t>(body.size()));
  w.bytes(body.data(), body.size());
  return std::move(w.buf());
}

bool CtrlFrameReader::feed(const uint8_t* data, size_t n, std::vector<CtrlFrame>& out) {
  if (!error_.empty()) return false;
  buf_.insert(buf_.end(), data, data + n);
  size_t pos = 0;
  while (buf_.size() - pos >= kCtrlHeaderSize) {
    wire::Reader r(buf_.data() + pos, kCtrlHeaderSize);
    uint32_t magic, len;
    uint8_t version, type;
    uint16_t reserved;
    r.u32(magic);
    r.u8(version);
    r.u8(type);
    r.u16(reserved);
    r.u32(len);
    if (magic != kCtrlMagic)
      error_ = "bad magic";
    else if (version != kCtrlVersion)
      error_ = "unsupported version " + std::to_string(version);
    else if (type < 1 || type > kMaxCtrlType)
      error_ = "unknown frame type " + std::to_string(type);
    else if (reserved != 0)
      error_ = "reserved bits set";
    else if (len > max_body_)
      error_ = "frame body of " + std::to_string(len) + " bytes exceeds limit";
    if (!error_.empty()) {
      buf_.clear();
      return false;
    }
    if (buf_.size() - pos - kCtrlHeaderSize < len) break;
    const uint8_t* b = buf_.data() + pos + kCtrlHeaderSize;
    out.push_back({static_cast<CtrlType>(type), std::vector<uint8_t>(b, b + len)});
    pos += kCtrlHeaderSize + len;
  }
  buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(pos));
  return true;
}

bool decode_hello(const std::vector<uint8_t>& body, std::string& key, uint8_t nonce[kCtrlNonceSize],
                  uint8_t* flags) {
  wire::Reader r(body.data(), body.size());
  if (!r.str8(key) || key.empty() || r.left() != kCtrlNonceSize + 1) return false;
  std::memcpy(nonce, r.rest(), kCtrlNonceSize);
  *flags = r.rest()[kCtrlNonceSize];
  return (*flags & ~kHelloHasToken) == 0;
}

bool decode_challenge(const std::vector<uint8_t>& body, uint8_t nonce[kCtrlNonceSize],
                      uint8_t proof[kCtrlProofSize]) {
  if (body.size() != kCtrlNonceSize + kCtrlProofSize) return false;
  std::memcpy(nonce, body.data(), kCtrlNonceSize);
  std::memcpy(proof, body.data() + kCtrlNonceSize, kCtrlProofSize);
  return true;
}

bool decode_proof(const std::vector<uint8_t>& body, uint8_t proof[kCtrlProofSize]) {
  if (body.size() != kCtrlProofSize) return false;
  std::memcpy(proof, body.data(), kCtrlProofSize);
  return true;
}

bool decode_hello_ok(const std::vector<uint8_t>& body, uint8_t* flags) {
  if (body.empty()) {
    *flags = 0;
    return true;
  }
  // One encoding per meaning: no flags is the empty body, never {0}.
  if (body.size() != 1 || body[0] != kHelloOkSendDesc) return false;
  *flags = body[0];
  return true;
}

std::vector<uint8_t> hello_ok_body(uint8_t flags) {
  return flags ? std::vector<uint8_t>{flags} : std::vector<uint8_t>{};
}

bool decode_refused(const std::vector<uint8_t>& body, std::string& reason) {
  wire::Reader r(body.data(), body.size());
  return r.str8(reason) && r.left() == 0;
}

bool decode_plugin(const std::vector<uint8_t>& body, std::string& plugin, size_t& payload_off) {
  wire::Reader r(body.data(), body.size());
  if (!r.str8(plugin) || plugin.empty()) return false;
  payload_off = body.size() - r.left();
  return true;
}

bool decode_notify(const std::vector<uint8_t>& body, uint64_t& uid, int32_t& status,
                   uint64_t& instance, NotifySeq& seq) {
  wire::Reader r(body.data(), body.size());
  return r.u64(uid) && r.i32(status) && r.u64(instance) && r.u64(seq.life) && r.u64(seq.seq) &&
         r.u64(seq.floor) && r.left() == 0;
}

bool decode_notify_ack(const std::vector<uint8_t>& body, uint64_t& uid, NotifyAck& ack) {
  wire::Reader r(body.data(), body.size());
  uint8_t a;
  if (!r.u64(uid) || !r.u8(a) || r.left() != 0 || a > kMaxNotifyAck) return false;
  ack = static_cast<NotifyAck>(a);
  return true;
}

bool decode_msg(const std::vector<uint8_t>& body, uint64_t& instance, uint64_t& id,
                size_t& payload_off) {
  wire::Reader r(body.data(), body.size());
  if (!r.u64(instance) || !r.u64(id) || id == 0 || r.left() > kMaxNotifPayload) return false;
  payload_off = body.size() - r.left();
  return true;
}

bool decode_msg_ack(const std::vector<uint8_t>& body, uint64_t& id, MsgAck& ack) {
  wire::Reader r(body.data(), body.size());
  uint8_t a;
  if (!r.u64(id) || !r.u8(a) || r.left() != 0 || a > kMaxMsgAck) return false;
  ack = static_cast<MsgAck>(a);
  return true;
}

std::vector<uint8_t> hello_body(const std::string& key, const uint8_t nonce[kCtrlNonceSize],
                                uint8_t flags) {
  wire::Writer w;
  w.str8(key);
  w.bytes(nonce, kCtrlNonceSize);
  w.u8(flags);
  return std::move(w.buf());
}

std::vector<uint8_t> challenge_body(const uint8_t nonce[kCtrlNonceSize],
                                    const uint8_t proof[kCtrlProofSize]) {
  wire::Writer w;
  w.bytes(nonce, kCtrlNonceSize);
  w.bytes(proof, kCtrlProofSize);
  return std::move(w.buf());
}

std::vector<uint8_t> proof_body(const uint8_t proof[kCtrlProofSize]) {
  wire::Writer w;
  w.bytes(proof, kCtrlProofSize);
  return std::move(w.buf());
}

std::vector<uint8_t> refused_body(const std::string& reason) {
  wire::Writer w;
  w.str8(reason.substr(0, 255));
  return std::move(w.buf());
}

std::vector<uint8_t> plugin_body(const std::string& plugin, const void* payload, size_t n) {
  wire::Writer w;
  w.str8(plugin);
  w.bytes(payload, n);
  return std::move(w.buf());
}

std::vector<uint8_t> notify_body(uint64_t uid, int32_t status, uint64_t instance,
                                 const NotifySeq& seq) {
  wire::Writer w;
  w.u64(uid);
  w.i32(status);
  w.u64(instance);
  w.u64(seq.life);
  w.u64(seq.seq);
  w.u64(seq.floor);
  return std::move(w.buf());
}

std::vector<uint8_t> notify_ack_body(uint64_t uid, NotifyAck ack) {
  wire::Writer w;
  w.u64(uid);
  w.u8(static_cast<uint8_t>(ack));
  return std::move(w.buf());
}

std::vector<uint8_t> msg_body(uint64_t instance, uint64_t id, const void* payload, size_t n) {
  wire::Writer w;
  w.u64(instance);
  w.u64(id);
  w.bytes(payload, n);
  return std::move(w.buf());
}

std::vector<uint8_t> msg_ack_body(uint64_t id, MsgAck ack) {
  wire::Writer w;
  w.u64(id);
  w.u8(static_cast<uint8_t>(ack));
  return std::move(w.buf());
}

std::vector<uint8_t> fence_body(uint64_t req, uint64_t instance,
                                const std::vector<FenceEntry>& entries) {
  wire::Writer w;
  w.u64(req);
  w.u64(instance);
  w.u32(static_cast<uint32_t>(entries.size()));
  for (const auto& e : entries) {
    w.str8(e.backend);
    w.u64(e.attempt);
  }
  return std::move(w.buf());
}

bool decode_fence(const std::vector<uint8_t>& body, uint64_t& req, uint64_t& instance,
                  std::vector<FenceEntry>& entries) {
  wire::Reader r(body.data(), body.size());
  uint32_t n;
  if (!r.u64(req) || !r.u64(instance) || !r.u32(n) || n == 0 || n > kMaxFenceEntries) return false;
  entries.assign(n, {});
  for (auto& e : entries)
    if (!r.str8(e.backend) || e.backend.empty() || !r.u64(e.attempt)) return false;
  return r.left() == 0;
}

std::vector<uint8_t> fence_reply_body(uint64_t req, uint64_t instance,
                                      const std::vector<FenceResult>& results) {
  wire::Writer w;
  w.u64(req);
  w.u64(instance);
  w.u32(static_cast<uint32_t>(results.size()));
  for (const auto& x : results) {
    w.u64(x.attempt);
    w.u8(static_cast<uint8_t>(x.state));
    w.u64(x.landed);
  }
  return std::move(w.buf());
}

bool decode_fence_reply(const std::vector<uint8_t>& body, uint64_t& req, uint64_t& instance,
                        std::vector<FenceResult>& results) {
  wire::Reader r(body.data(), body.size());
  uint32_t n;
  if (!r.u64(req) || !r.u64(instance) || !r.u32(n) || n > kMaxFenceEntries) return false;
  results.assign(n, {});
  for (auto& x : results) {
    uint8_t st;
    if (!r.u64(x.attempt) || !r.u8(st) || st > static_cast<uint8_t>(FenceState::UNKNOWN) ||
        !r.u64(x.landed))
      return false;
    x.state = static_cast<FenceState>(st);
  }
  return r.left() == 0;
}

}  // namespace ferry
