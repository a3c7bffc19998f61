// SPDX-License-Identifier: Apache-2.0
// Registered local memory and its revocation.
//
// A region is touched by socket I/O in two roles: as the target of a peer's
// request and as the local side of our own transfers. Every such I/O holds a
// "use" naming its socket, so revocation can wait for it - and, if the socket
// has stalled, shut the socket down instead of waiting out the I/O timeout.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

namespace ferry_tcp {

class Region {
 public:
  // device: the GPU that owns the memory, -1 for host memory (gpu_stage.h).
  // key: random, from the region's memory blob; every request presents it.
  Region(uint64_t id, uint8_t* addr, uint64_t size, int device = -1, uint64_t key = 0)
      : id_(id), addr_(addr), size_(size), device_(device), key_(key) {}

  uint64_t id() const { return id_; }
  uint8_t* addr() const { return addr_; }
  uint64_t size() const { return size_; }
  int device() const { return device_; }
  uint64_t key() const { return key_; }
  // Constant-time, so response timing does not reveal how much of a guess was right.
  bool KeyIs(uint64_t k) const {
    uint64_t d = k ^ key_;
    d |= d >> 32;
    d |= d >> 16;
    d |= d >> 8;
    return (d & 0xff) == 0;
  }
  bool on_gpu() const { return device_ >= 0; }
  // offset+len inside the region, without wrapping.
  bool Contains(uint64_t offset, uint64_t len) const {
    return offset <= size_ && len <= size_ - offset;
  }

  // False once revoked. Pair with Release(fd) before fd is closed.
  bool Acquire(int fd);
  void Release(int fd);
  bool revoked() const;

  // Returns when no I/O touches the region and none will again. I/O still going
  // after `grace` has stalled; its sockets are shut down so it ends now.
  void Revoke(std::chrono::milliseconds grace);

 private:
  const uint64_t id_;
  uint8_t* const addr_;
  const uint64_t size_;
  const int device_;
  const uint64_t key_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  bool revoked_ = false;
  std::vector<int> users_;  // one entry per use in progress
};

// Scoped use of a region by the I/O on one socket.
class RegionUse {
 public:
  RegionUse(Region* r, int fd) : r_(r), fd_(fd), ok_(r != nullptr && r->Acquire(fd)) {}
  ~RegionUse() {
    if (ok_) r_->Release(fd_);
  }
  RegionUse(const RegionUse&) = delete;
  RegionUse& operator=(const RegionUse&) = delete;
  bool ok() const { return ok_; }

 private:
  Region* r_;
  int fd_;
  bool ok_;
};

class RegionTable {
 public:
  bool Add(std::shared_ptr<Region> r);
  std::shared_ptr<Region> Find(uint64_t id) const;
  std::shared_ptr<Region> Remove(uint64_t id);
  std::vector<std::shared_ptr<Region>> TakeAll();

 private:
  mutable std::shared_mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Region>> map_;
};

}  // namespace ferry_tcp
