#include "inbound_table.h"

namespace ferry {

bool InboundTable::land(const std::string& peer, uint64_t uid, StatusCode code) {
  std::unique_lock<std::mutex> lk(mu_);
  PeerState& p = peers_[peer];
  if (!p.seen.insert(uid).second) return false;
  p.seen_order.push_back(uid);
  if (p.seen_order.size() > kRememberPerPeer) {
    // Forget the oldest uid, unless the application has not popped it yet.
    uint64_t old = p.seen_order.front();
    p.seen_order.pop_front();
    if (!p.landed.count(old)) p.seen.erase(old);
  }
  TransferStatus s;
  s.Finish(code);
  p.landed.emplace(uid, s);
  lk.unlock();
  landed_cv_.notify_all();
  return true;
}

std::optional<TransferStatus> InboundTable::pop(const std::string& peer, uint64_t uid) {
  std::lock_guard<std::mutex> lk(mu_);
  return pop_locked(peer, uid);
}

std::optional<TransferStatus> InboundTable::wait_pop(const std::string& peer, uint64_t uid,
                                                     std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  std::optional<TransferStatus> got;
  auto ready = [&] { return (got = pop_locked(peer, uid)).has_value(); };
  // now + milliseconds::max() would overflow: a day or more means "no limit".
  if (timeout >= std::chrono::hours(24)) landed_cv_.wait(lk, ready);
  else landed_cv_.wait_for(lk, timeout, ready);
  return got;
}

std::optional<TransferStatus> InboundTable::pop_locked(const std::string& peer, uint64_t uid) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return std::nullopt;
  auto f = it->second.landed.find(uid);
  if (f == it->second.landed.end()) return std::nullopt;
  TransferStatus s = f->second;
  it->second.landed.erase(f);
  return s;
}

void InboundTable::forget_peer(const std::string& peer) {
  std::lock_guard<std::mutex> lk(mu_);
  peers_.erase(peer);
}

size_t InboundTable::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& [k, p] : peers_) n += p.landed.size();
  return n;
}

}  // namespace ferry
