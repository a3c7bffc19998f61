// SPDX-License-Identifier: Apache-2.0
#include "wire.h"

#include <cstring>

namespace ferry_rdma::wire {
namespace {

constexpr uint8_t kConnMagic[4] = {'F', 'R', 'D', 'C'};
constexpr uint8_t kMemMagic[4] = {'F', 'R', 'D', 'M'};
constexpr uint8_t kMsgMagic[4] = {'F', 'R', 'D', 'X'};
constexpr uint8_t kNotifyMagic[4] = {'F', 'R', 'D', 'N'};

class Writer {
 public:
  void Bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  void U8(uint8_t v) { out_.push_back(v); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  std::vector<uint8_t> Take() { return std::move(out_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> out_;
};

class Reader {
 public:
  Reader(const void* p, size_t n) : p_(static_cast<const uint8_t*>(p)), n_(p ? n : 0) {}
  bool Bytes(void* out, size_t n) {
    if (n_ - off_ < n) return Fail();
    std::memcpy(out, p_ + off_, n);
    off_ += n;
    return true;
  }
  bool U8(uint8_t* v) { return Bytes(v, 1); }
  bool U16(uint16_t* v) { return Le(v, 2); }
  bool U32(uint32_t* v) { return Le(v, 4); }
  bool U64(uint64_t* v) { return Le(v, 8); }
  bool Magic(const uint8_t m[4]) {
    uint8_t b[4];
    return Bytes(b, 4) && std::memcmp(b, m, 4) == 0;
  }
  bool AtEnd() const { return ok_ && off_ == n_; }
  size_t Left() const { return n_ - off_; }

 private:
  bool Fail() {
    ok_ = false;
    return false;
  }
  template <typename T>
  bool Le(T* v, int n) {
    if (n_ - off_ < static_cast<size_t>(n)) return Fail();
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= static_cast<uint64_t>(p_[off_ + i]) << (8 * i);
    off_ += static_cast<size_t>(n);
    *v = static_cast<T>(x);
    return true;
  }
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
  bool ok_ = true;
};

bool Bad(std::string* err, const char* what) {
  if (err) *err = what;
  return false;
}

}  // namespace

std::vector<uint8_t> EncodeConnInfo(const ConnInfo& c) {
  Writer w;
  w.Bytes(kConnMagic, 4);
  w.U16(kVersion);
  w.U16(static_cast<uint16_t>(c.ports.size()));
  w.U64(c.nonce);
  for (const auto& p : c.ports) {
    w.U8(static_cast<uint8_t>(p.name.size()));
    w.Bytes(p.name.data(), p.name.size());
    w.U8(p.port);
    w.U8(p.link_layer);
    w.U8(p.active_mtu);
    w.U8(p.gid_index);
    w.U16(p.lid);
    w.Bytes(p.gid, 16);
    w.U16(static_cast<uint16_t>(p.numa_node));
  }
  return w.Take();
}

bool DecodeConnInfo(const void* p, size_t n, ConnInfo* out, std::string* err) {
  Reader r(p, n);
  uint16_t version = 0, count = 0;
  ConnInfo c;
  if (!r.Magic(kConnMagic)) return Bad(err, "rdma connection info: bad magic or truncated");
  if (!r.U16(&version) || version != kVersion)
    return Bad(err, "rdma connection info: unsupported version");
  if (!r.U16(&count) || !r.U64(&c.nonce)) return Bad(err, "rdma connection info: truncated");
  if (count == 0 || count > kMaxPorts) return Bad(err, "rdma connection info: bad port count");
  for (uint16_t i = 0; i < count; ++i) {
    PortInfo pi;
    uint8_t len = 0;
    uint16_t numa = 0;
    if (!r.U8(&len) || len == 0 || len > kMaxNameLen)
      return Bad(err, "rdma connection info: bad device name");
    pi.name.resize(len);
    if (!r.Bytes(pi.name.data(), len) || !r.U8(&pi.port) || !r.U8(&pi.link_layer) ||
        !r.U8(&pi.active_mtu) || !r.U8(&pi.gid_index) || !r.U16(&pi.lid) || !r.Bytes(pi.gid, 16) ||
        !r.U16(&numa))
      return Bad(err, "rdma connection info: truncated port entry");
    pi.numa_node = static_cast<int16_t>(numa);
    if (pi.active_mtu < 1 || pi.active_mtu > 5) return Bad(err, "rdma connection info: bad MTU");
    c.ports.push_back(std::move(pi));
  }
  if (!r.AtEnd()) return Bad(err, "rdma connection info: trailing bytes");
  *out = std::move(c);
  return true;
}

std::vector<uint8_t> EncodeMemInfo(const MemInfo& m) {
  Writer w;
  w.Bytes(kMemMagic, 4);
  w.U16(kVersion);
  w.U16(static_cast<uint16_t>(m.rkeys.size()));
  w.U64(m.addr);
  w.U64(m.size);
  w.U16(m.preferred_port);
  for (uint32_t k : m.rkeys) w.U32(k);
  return w.Take();
}

bool DecodeMemInfo(const void* p, size_t n, MemInfo* out, std::string* err) {
  Reader r(p, n);
  uint16_t version = 0, count = 0;
  MemInfo m;
  if (!r.Magic(kMemMagic)) return Bad(err, "rdma memory info: bad magic or truncated");
  if (!r.U16(&version) || version != kVersion)
    return Bad(err, "rdma memory info: unsupported version");
  if (!r.U16(&count) || !r.U64(&m.addr) || !r.U64(&m.size) || !r.U16(&m.preferred_port))
    return Bad(err, "rdma memory info: truncated");
  if (count == 0 || count > kMaxPorts) return Bad(err, "rdma memory info: bad port count");
  if (m.preferred_port >= count) return Bad(err, "rdma memory info: bad preferred port");
  if (m.addr + m.size < m.addr) return Bad(err, "rdma memory info: range wraps");
  m.rkeys.resize(count);
  for (auto& k : m.rkeys)
    if (!r.U32(&k)) return Bad(err, "rdma memory info: truncated rkeys");
  if (!r.AtEnd()) return Bad(err, "rdma memory info: trailing bytes");
  *out = std::move(m);
  return true;
}

std::vector<uint8_t> EncodeConnectMsg(const ConnectMsg& m) {
  Writer w;
  w.Bytes(kMsgMagic, 4);
  w.U16(kVersion);
  w.U8(static_cast<uint8_t>(m.type));
  w.U64(m.conn_id);
  if (m.type == MsgType::kConnectNak) {
    const size_t len = m.reason.size() < kMaxReasonLen ? m.reason.size() : kMaxReasonLen;
    w.U16(static_cast<uint16_t>(len));
    w.Bytes(m.reason.data(), len);
    return w.Take();
  }
  if (m.type == MsgType::kDisconnect) {
    w.U16(m.ini_port);
    w.U16(m.tgt_port);
    return w.Take();
  }
  w.U64(m.target_nonce);
  w.U16(m.ini_port);
  w.U16(m.tgt_port);
  w.U8(m.mtu);
  w.U8(m.rd_atomic);
  w.U16(m.lid);
  w.Bytes(m.gid, 16);
  w.U8(static_cast<uint8_t>(m.qps.size()));
  for (const auto& q : m.qps) {
    w.U32(q.qpn);
    w.U32(q.psn);
  }
  return w.Take();
}

bool DecodeConnectMsg(const void* p, size_t n, ConnectMsg* out, std::string* err) {
  Reader r(p, n);
  uint16_t version = 0;
  uint8_t type = 0;
  ConnectMsg m;
  if (!r.Magic(kMsgMagic)) return Bad(err, "rdma control message: bad magic or truncated");
  if (!r.U16(&version) || version != kVersion)
    return Bad(err, "rdma control message: unsupported version");
  if (!r.U8(&type) || type < 1 || type > 4) return Bad(err, "rdma control message: bad type");
  m.type = static_cast<MsgType>(type);
  if (!r.U64(&m.conn_id)) return Bad(err, "rdma control message: truncated");
  if (m.type == MsgType::kConnectNak) {
    uint16_t len = 0;
    if (!r.U16(&len) || len > kMaxReasonLen) return Bad(err, "rdma control message: bad reason");
    m.reason.resize(len);
    if (!r.Bytes(m.reason.data(), len)) return Bad(err, "rdma control message: truncated reason");
    for (auto& c : m.reason)
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  } else if (m.type == MsgType::kDisconnect) {
    if (!r.U16(&m.ini_port) || !r.U16(&m.tgt_port))
      return Bad(err, "rdma control message: truncated");
    if (m.ini_port >= kMaxPorts || m.tgt_port >= kMaxPorts)
      return Bad(err, "rdma control message: bad port index");
  } else {
    uint8_t nqp = 0;
    if (!r.U64(&m.target_nonce) || !r.U16(&m.ini_port) || !r.U16(&m.tgt_port) || !r.U8(&m.mtu) ||
        !r.U8(&m.rd_atomic) || !r.U16(&m.lid) || !r.Bytes(m.gid, 16) || !r.U8(&nqp))
      return Bad(err, "rdma control message: truncated");
    if (nqp == 0 || nqp > kMaxQps) return Bad(err, "rdma control message: bad QP count");
    if (m.mtu < 1 || m.mtu > 5) return Bad(err, "rdma control message: bad MTU");
    if (m.ini_port >= kMaxPorts || m.tgt_port >= kMaxPorts)
      return Bad(err, "rdma control message: bad port index");
    m.qps.resize(nqp);
    for (auto& q : m.qps)
      if (!r.U32(&q.qpn) || !r.U32(&q.psn)) return Bad(err, "rdma control message: truncated QPs");
    for (const auto& q : m.qps)
      if (q.qpn == 0 || q.qpn > 0xffffff || q.psn > 0xffffff)
        return Bad(err, "rdma control message: bad QP number or PSN");
  }
  if (!r.AtEnd()) return Bad(err, "rdma control message: trailing bytes");
  *out = std::move(m);
  return true;
}

void EncodeNotify(uint64_t uid, uint8_t out[kNotifySize]) {
  std::memcpy(out, kNotifyMagic, 4);
  std::memset(out + 4, 0, 4);
  for (int i = 0; i < 8; ++i) out[8 + i] = static_cast<uint8_t>(uid >> (8 * i));
}

bool DecodeNotify(const void* p, size_t n, uint64_t* uid) {
  if (p == nullptr || n != kNotifySize) return false;
  const auto* b = static_cast<const uint8_t*>(p);
  if (std::memcmp(b, kNotifyMagic, 4) != 0) return false;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(b[8 + i]) << (8 * i);
  *uid = v;
  return true;
}

}  // namespace ferry_rdma::wire
