// SPDX-License-Identifier: Apache-2.0
// Little-endian field codec for the control plane's frames. The reader never
// reads past its end: every get checks the remaining length first.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::wire {

class Writer {
 public:
  void u8(uint8_t v) { buf_.push_back(v); }
  void u16(uint16_t v) { put(v); }
  void u32(uint32_t v) { put(v); }
  void u64(uint64_t v) { put(v); }
  void i32(int32_t v) { put(static_cast<uint32_t>(v)); }
  void bytes(const void* p, size_t n) {
    auto c = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), c, c + n);
  }
  void str8(std::string_view s) {  // length-prefixed, at most 255 bytes
    u8(static_cast<uint8_t>(s.size()));
    bytes(s.data(), s.size());
  }
  std::vector<uint8_t>& buf() { return buf_; }

 private:
  template <typename T>
  void put(T v) {
    for (size_t i = 0; i < sizeof(T); ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  std::vector<uint8_t> buf_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool u8(uint8_t& v) { return get(v); }
  bool u16(uint16_t& v) { return get(v); }
  bool u32(uint32_t& v) { return get(v); }
  bool u64(uint64_t& v) { return get(v); }
  bool i32(int32_t& v) {
    uint32_t u;
    if (!get(u)) return false;
    v = static_cast<int32_t>(u);
    return true;
  }
  bool str8(std::string& s) {
    uint8_t len;
    if (!u8(len) || len > n_) return false;
    s.assign(reinterpret_cast<const char*>(p_), len);
    skip(len);
    return true;
  }
  const uint8_t* rest() const { return p_; }
  size_t left() const { return n_; }

 private:
  void skip(size_t k) {
    p_ += k;
    n_ -= k;
  }
  template <typename T>
  bool get(T& v) {
    if (n_ < sizeof(T)) return false;
    v = 0;
    for (size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<T>(p_[i]) << (8 * i));
    skip(sizeof(T));
    return true;
  }
  const uint8_t* p_;
  size_t n_;
};

}  // namespace ferry::wire
