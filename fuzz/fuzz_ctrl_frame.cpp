// SPDX-License-Identifier: Apache-2.0
// libFuzzer: the control plane's frame reader and every body decoder.
// Input: byte 0 picks the chunk size the stream is fed in (and whether the
// pre-admission body limit applies); the rest is the byte stream of a connection.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "control_frame.h"

using namespace ferry;

namespace {

void decode_all(const std::vector<uint8_t>& body) {
  std::string s;
  uint8_t nonce[kCtrlNonceSize], mac[kCtrlProofSize];
  uint8_t flags = 0;
  size_t off = 0;
  uint64_t uid = 0;
  int32_t status = 0;
  if (decode_hello(body, s, nonce, &flags)) {
    // What decodes must re-encode to the same bytes.
    if (hello_body(s, nonce, flags) != body) __builtin_trap();
  }
  decode_refused(body, s);
  if (decode_hello_ok(body, &flags) && hello_ok_body(flags) != body) __builtin_trap();
  if (decode_plugin(body, s, off) && (off > body.size() || s.empty())) __builtin_trap();
  uint64_t target = 0;
  NotifySeq seq;
  if (decode_notify(body, uid, status, target, seq) &&
      notify_body(uid, status, target, seq) != body)
    __builtin_trap();
  NotifyAck nack;
  if (decode_notify_ack(body, uid, nack) && notify_ack_body(uid, nack) != body) __builtin_trap();
  uint64_t inst0 = 0, id = 0;
  if (decode_msg(body, inst0, id, off) &&
      (off != 16 || body.size() - off > kMaxNotifPayload || id == 0 ||
       msg_body(inst0, id, body.data() + off, body.size() - off) != body))
    __builtin_trap();
  MsgAck ack;
  if (decode_msg_ack(body, id, ack) && msg_ack_body(id, ack) != body) __builtin_trap();
  if (decode_challenge(body, nonce, mac) && challenge_body(nonce, mac) != body) __builtin_trap();
  if (decode_proof(body, mac) && proof_body(mac) != body) __builtin_trap();
  uint64_t req = 0, inst = 0;
  std::vector<FenceEntry> entries;
  if (decode_fence(body, req, inst, entries) &&
      (entries.empty() || entries.size() > kMaxFenceEntries ||
       fence_body(req, inst, entries) != body))
    __builtin_trap();
  std::vector<FenceResult> results;
  if (decode_fence_reply(body, req, inst, results) &&
      (results.size() > kMaxFenceEntries || fence_reply_body(req, inst, results) != body))
    __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t chunk = (data[0] & 0x3f) + 1;
  const bool handshake = data[0] & 0x40;
  data++;
  size--;
  CtrlFrameReader reader;
  if (handshake) reader.set_max_body(kMaxHandshakeBody);
  std::vector<CtrlFrame> frames;
  bool ok = true;
  for (size_t i = 0; i < size && ok; i += chunk)
    ok = reader.feed(data + i, std::min(chunk, size - i), frames);
  if (!ok && reader.error().empty()) __builtin_trap();
  for (const auto& f : frames) {
    if (f.body.size() > (handshake ? kMaxHandshakeBody : kMaxCtrlBody)) __builtin_trap();
    decode_all(f.body);
  }
  decode_all(std::vector<uint8_t>(data, data + size));
  return 0;
}
