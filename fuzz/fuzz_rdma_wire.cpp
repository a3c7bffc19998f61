// SPDX-License-Identifier: Apache-2.0
// libFuzzer: what the rdma plugin reads from peers - its connection and memory
// blobs (inside the engine and memory descriptors), the QP handshake messages
// (on_ctrl) and the notification a SEND carries. Whatever a decoder accepts
// must be within its limits and encode back to exactly the bytes it read (one
// encoding per value: nothing ignored but the notification's reserved bytes,
// and a refusal's reason is made printable);
// a refusal always says why.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "rdma/wire.h"
#include "same_bytes.h"

namespace w = ferry_rdma::wire;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string err;
  w::ConnInfo c;
  if (w::DecodeConnInfo(data, size, &c, &err)) {
    if (c.ports.size() > w::kMaxPorts) __builtin_trap();
    for (const auto& p : c.ports)
      if (p.name.size() > w::kMaxNameLen) __builtin_trap();
    same_bytes(w::EncodeConnInfo(c), data, size);
  } else if (err.empty()) {
    __builtin_trap();
  }
  err.clear();
  w::MemInfo m;
  if (w::DecodeMemInfo(data, size, &m, &err)) {
    if (m.rkeys.size() > w::kMaxPorts) __builtin_trap();
    same_bytes(w::EncodeMemInfo(m), data, size);
  } else if (err.empty()) {
    __builtin_trap();
  }
  err.clear();
  w::ConnectMsg msg;
  if (w::DecodeConnectMsg(data, size, &msg, &err)) {
    if (msg.qps.size() > w::kMaxQps || msg.reason.size() > w::kMaxReasonLen) __builtin_trap();
    for (const char ch : msg.reason)  // a NAK's reason is made printable as it is read
      if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f)
        __builtin_trap();
    if (msg.type == w::MsgType::kConnectNak) {
      // Same length, and stable once made printable.
      const std::vector<uint8_t> enc = w::EncodeConnectMsg(msg);
      w::ConnectMsg again;
      if (enc.size() != size || !w::DecodeConnectMsg(enc.data(), enc.size(), &again, &err))
        __builtin_trap();
      same_bytes(w::EncodeConnectMsg(again), enc.data(), enc.size());
    } else {
      same_bytes(w::EncodeConnectMsg(msg), data, size);
    }
  } else if (err.empty()) {
    __builtin_trap();
  }
  // The notification's bytes 4..7 are reserved: written 0, ignored by readers.
  uint64_t uid = 0;
  if (w::DecodeNotify(data, size, &uid)) {
    uint8_t back[w::kNotifySize];
    w::EncodeNotify(uid, back);
    if (size != w::kNotifySize || std::memcmp(back, data, 4) != 0 ||
        std::memcmp(back + 8, data + 8, 8) != 0)
      __builtin_trap();
  }
  return 0;
}
