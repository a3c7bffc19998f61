// SPDX-License-Identifier: Apache-2.0
#include "blob.h"

#include <cstring>

namespace ferry_ofi::blob {
namespace {

constexpr uint32_t kConnMagic = 0x49464f46;  // "FOFI"
constexpr uint32_t kMemMagic = 0x4d464f46;   // "FOFM"

class Writer {
 public:
  void U8(uint8_t v) { b_.push_back(v); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void Bytes(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    b_.insert(b_.end(), c, c + n);
  }
  std::vector<uint8_t> Take() { return std::move(b_); }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> b_;
};

class Reader {
 public:
  Reader(const void* p, size_t n) : p_(static_cast<const uint8_t*>(p)), n_(p ? n : 0) {}
  bool U8(uint8_t* v) { return Le(v, 1); }
  bool U16(uint16_t* v) { return Le(v, 2); }
  bool U32(uint32_t* v) { return Le(v, 4); }
  bool U64(uint64_t* v) { return Le(v, 8); }
  bool Bytes(size_t n, std::vector<uint8_t>* out) {
    if (n > n_ - off_) return false;
    out->assign(p_ + off_, p_ + off_ + n);
    off_ += n;
    return true;
  }
  bool Str(size_t n, std::string* out) {
    if (n > n_ - off_) return false;
    out->assign(reinterpret_cast<const char*>(p_ + off_), n);
    off_ += n;
    return true;
  }
  bool AtEnd() const { return off_ == n_; }

 private:
  template <typename T>
  bool Le(T* v, size_t n) {
    if (n > n_ - off_) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < n; ++i) x |= static_cast<uint64_t>(p_[off_ + i]) << (8 * i);
    off_ += n;
    *v = static_cast<T>(x);
    return true;
  }
  const uint8_t* p_;
  size_t n_;
  size_t off_ = 0;
};

bool Fail(std::string* why, const std::string& msg) {
  if (why) *why = msg;
  return false;
}

bool GoodName(const std::string& s) {
  if (s.empty() || s.size() > kMaxName) return false;
  for (char c : s) {
    if (c <= 0x20 || c >= 0x7f) return false;
  }
  return true;
}

// Magic and version; `what` names the blob in the reason.
bool Head(Reader& r, uint32_t magic, const char* what, std::string* why) {
  uint32_t m = 0;
  uint8_t v = 0;
  if (!r.U32(&m) || !r.U8(&v)) return Fail(why, std::string(what) + " is truncated");
  if (m != magic) return Fail(why, std::string(what) + " is not an ofi plugin blob");
  if (v != kVersion)
    return Fail(why, std::string(what) + " has version " + std::to_string(v) + ", this plugin reads " +
                         std::to_string(kVersion));
  return true;
}

}  // namespace

std::vector<uint8_t> EncodeConn(const ConnInfo& ci) {
  Writer w;
  w.U32(kConnMagic);
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(ci.eps.size()));
  for (const auto& e : ci.eps) {
    w.U8(static_cast<uint8_t>(e.provider.size()));
    w.Bytes(e.provider.data(), e.provider.size());
    w.U8(static_cast<uint8_t>(e.doorbell.size()));
    w.Bytes(e.doorbell.data(), e.doorbell.size());
    w.U32(e.addr_format);
    w.U16(static_cast<uint16_t>(e.addr.size()));
    w.Bytes(e.addr.data(), e.addr.size());
  }
  return w.Take();
}

bool DecodeConn(const void* data, size_t len, ConnInfo* out, std::string* why) {
  Reader r(data, len);
  if (!Head(r, kConnMagic, "connection blob", why)) return false;
  uint8_t n = 0;
  if (!r.U8(&n)) return Fail(why, "connection blob is truncated");
  if (n == 0 || n > kMaxEndpoints)
    return Fail(why, "connection blob lists " + std::to_string(n) + " endpoints (1.." +
                         std::to_string(kMaxEndpoints) + " allowed)");
  ConnInfo ci;
  for (uint8_t i = 0; i < n; ++i) {
    EpInfo e;
    uint8_t name_len = 0, bell_len = 0;
    uint16_t addr_len = 0;
    if (!r.U8(&name_len) || !r.Str(name_len, &e.provider) || !r.U8(&bell_len) ||
        !r.Str(bell_len, &e.doorbell) || !r.U32(&e.addr_format) || !r.U16(&addr_len))
      return Fail(why, "connection blob is truncated");
    if (!GoodName(e.provider)) return Fail(why, "connection blob has a bad provider name");
    if (bell_len != 0 && !GoodName(e.doorbell))
      return Fail(why, "connection blob has a bad doorbell name");
    if (addr_len == 0 || addr_len > kMaxAddr)
      return Fail(why, "connection blob has an address of " + std::to_string(addr_len) + " bytes");
    if (!r.Bytes(addr_len, &e.addr)) return Fail(why, "connection blob is truncated");
    ci.eps.push_back(std::move(e));
  }
  if (!r.AtEnd()) return Fail(why, "connection blob has trailing bytes");
  *out = std::move(ci);
  return true;
}

std::vector<uint8_t> EncodeMem(const MemInfo& mi) {
  Writer w;
  w.U32(kMemMagic);
  w.U8(kVersion);
  w.U8(static_cast<uint8_t>(mi.keys.size()));
  w.U64(mi.id);
  w.U64(mi.size);
  for (const auto& k : mi.keys) {
    w.U8(static_cast<uint8_t>(k.provider.size()));
    w.Bytes(k.provider.data(), k.provider.size());
    w.U64(k.base);
    w.U8(k.raw ? 1 : 0);
    w.U16(static_cast<uint16_t>(k.key.size()));
    w.Bytes(k.key.data(), k.key.size());
  }
  if (mi.keys.empty()) w.U8(kMemGpuLocalOnly);
  return w.Take();
}

bool DecodeMem(const void* data, size_t len, MemInfo* out, std::string* why) {
  Reader r(data, len);
  if (!Head(r, kMemMagic, "memory blob", why)) return false;
  uint8_t n = 0;
  MemInfo mi;
  if (!r.U8(&n) || !r.U64(&mi.id) || !r.U64(&mi.size)) return Fail(why, "memory blob is truncated");
  if (n == 0) {
    uint8_t kind = 0;
    if (!r.U8(&kind)) return Fail(why, "memory blob is truncated");
    if (kind != kMemGpuLocalOnly) return Fail(why, "memory blob lists no keys");
    if (!r.AtEnd()) return Fail(why, "memory blob has trailing bytes");
    mi.gpu_local_only = true;
    *out = std::move(mi);
    return true;
  }
  if (n > kMaxEndpoints)
    return Fail(why, "memory blob lists " + std::to_string(n) + " keys (1.." +
                         std::to_string(kMaxEndpoints) + " allowed)");
  for (uint8_t i = 0; i < n; ++i) {
    MemKey k;
    uint8_t name_len = 0, raw = 0;
    uint16_t key_len = 0;
    if (!r.U8(&name_len) || !r.Str(name_len, &k.provider) || !r.U64(&k.base) || !r.U8(&raw) ||
        !r.U16(&key_len))
      return Fail(why, "memory blob is truncated");
    if (!GoodName(k.provider)) return Fail(why, "memory blob has a bad provider name");
    if (raw > 1) return Fail(why, "memory blob has a bad key kind");
    k.raw = raw == 1;
    if (key_len == 0 || key_len > kMaxKey || (!k.raw && key_len != 8))
      return Fail(why, "memory blob has a key of " + std::to_string(key_len) + " bytes");
    if (!r.Bytes(key_len, &k.key)) return Fail(why, "memory blob is truncated");
    mi.keys.push_back(std::move(k));
  }
  if (!r.AtEnd()) return Fail(why, "memory blob has trailing bytes");
  *out = std::move(mi);
  return true;
}

}  // namespace ferry_ofi::blob
