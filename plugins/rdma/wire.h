// SPDX-License-Identifier: Apache-2.0
// The rdma plugin's wire formats: the two opaque blobs that travel inside ferry
// descriptors (connection info, memory info), the QP handshake messages sent
// through the core's control channel, and the notification carried by a SEND.
//
// Pure encode/decode with no I/O: a decoder never trusts a length or count from
// the wire and says in words what it rejected. All integers are little-endian.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry_rdma::wire {

inline constexpr uint16_t kVersion = 1;
inline constexpr size_t kMaxPorts = 32;
inline constexpr size_t kMaxQps = 64;
inline constexpr size_t kMaxNameLen = 64;
inline constexpr size_t kMaxReasonLen = 512;
// One notification SEND: magic "FRDN", 4 reserved bytes (written 0, ignored
// when read, so a later version may use them), the uid (8 bytes).
inline constexpr size_t kNotifySize = 16;

// One usable port, as the owner describes it to peers.
struct PortInfo {
  std::string name;  // ibv device name, e.g. "rxe0"
  uint8_t port = 1;
  uint8_t link_layer = 0;  // IBV_LINK_LAYER_*
  uint8_t active_mtu = 0;  // enum ibv_mtu
  uint8_t gid_index = 0;
  uint16_t lid = 0;
  uint8_t gid[16] = {};
  int16_t numa_node = -1;
};

struct ConnInfo {
  uint64_t nonce = 0;  // random per plugin instance: tells a restarted peer apart
  std::vector<PortInfo> ports;
};
std::vector<uint8_t> EncodeConnInfo(const ConnInfo& c);
bool DecodeConnInfo(const void* p, size_t n, ConnInfo* out, std::string* err);

// Per registered region: where it is and one rkey per port of the owner.
struct MemInfo {
  uint64_t addr = 0;
  uint64_t size = 0;
  uint16_t preferred_port = 0;  // the owner's port closest to the memory
  std::vector<uint32_t> rkeys;  // index = port index in the owner's ConnInfo
};
std::vector<uint8_t> EncodeMemInfo(const MemInfo& m);
bool DecodeMemInfo(const void* p, size_t n, MemInfo* out, std::string* err);

// ---- handshake through host->ctrl_send ---------------------------------------
enum class MsgType : uint8_t {
  kConnectReq = 1,  // initiator -> target: my QPs; create yours and connect them
  kConnectRep = 2,  // target -> initiator: mine, connected to yours
  kConnectNak = 3,  // target -> initiator: refused, with a reason
  // initiator -> target: this connection went idle and its QPs are gone;
  // destroy yours (conn_id, ini_port, tgt_port name it)
  kDisconnect = 4,
};

struct QpAddr {
  uint32_t qpn = 0;
  uint32_t psn = 0;
};

struct ConnectMsg {
  MsgType type = MsgType::kConnectReq;
  uint64_t conn_id = 0;       // the initiator's id for this connection attempt
  uint64_t target_nonce = 0;  // REQ: the target instance the initiator means
  uint16_t ini_port = 0;      // REQ: initiator's port index
  uint16_t tgt_port = 0;      // REQ: target's port index
  uint8_t mtu = 0;            // enum ibv_mtu of the sender's port
  uint8_t rd_atomic = 0;      // REQ: initiator depth; REP: responder resources
  uint16_t lid = 0;
  uint8_t gid[16] = {};
  std::vector<QpAddr> qps;
  std::string reason;  // NAK
};
std::vector<uint8_t> EncodeConnectMsg(const ConnectMsg& m);
bool DecodeConnectMsg(const void* p, size_t n, ConnectMsg* out, std::string* err);

// ---- notification SEND payload ------------------------------------------------
void EncodeNotify(uint64_t uid, uint8_t out[kNotifySize]);
bool DecodeNotify(const void* p, size_t n, uint64_t* uid);

}  // namespace ferry_rdma::wire
