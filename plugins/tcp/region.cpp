// SPDX-License-Identifier: Apache-2.0
#include "region.h"

#include <sys/socket.h>

#include <algorithm>

namespace ferry_tcp {

bool Region::Acquire(int fd) {
  std::lock_guard lk(mu_);
  if (revoked_) return false;
  users_.push_back(fd);
  return true;
}

void Region::Release(int fd) {
  std::lock_guard lk(mu_);
  auto it = std::find(users_.begin(), users_.end(), fd);
  if (it != users_.end()) users_.erase(it);
  if (users_.empty()) idle_.notify_all();
}

bool Region::revoked() const {
  std::lock_guard lk(mu_);
  return revoked_;
}

void Region::Revoke(std::chrono::milliseconds grace) {
  std::unique_lock lk(mu_);
  revoked_ = true;
  if (idle_.wait_for(lk, grace, [&] { return users_.empty(); })) return;
  // The users cannot close these fds while we hold mu_: Release comes first.
  for (int fd : users_) ::shutdown(fd, SHUT_RDWR);
  idle_.wait(lk, [&] { return users_.empty(); });
}

bool RegionTable::Add(std::shared_ptr<Region> r) {
  std::unique_lock lk(mu_);
  return map_.emplace(r->id(), std::move(r)).second;
}

std::shared_ptr<Region> RegionTable::Find(uint64_t id) const {
  std::shared_lock lk(mu_);
  auto it = map_.find(id);
  return it == map_.end() ? nullptr : it->second;
}

std::shared_ptr<Region> RegionTable::Remove(uint64_t id) {
  std::unique_lock lk(mu_);
  auto it = map_.find(id);
  if (it == map_.end()) return nullptr;
  auto r = std::move(it->second);
  map_.erase(it);
  return r;
}

std::vector<std::shared_ptr<Region>> RegionTable::TakeAll() {
  std::unique_lock lk(mu_);
  std::vector<std::shared_ptr<Region>> out;
  for (auto& [id, r] : map_) out.push_back(std::move(r));
  map_.clear();
  return out;
}

}  // namespace ferry_tcp
