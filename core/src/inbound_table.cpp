// SPDX-License-Identifier: Apache-2.0
#include "inbound_table.h"

#include <algorithm>

namespace ferry {

InboundTable::InboundTable(Limits limits, std::function<Clock::time_point()> now)
    : limits_(limits), now_(now ? std::move(now) : [] { return Clock::now(); }) {}

InboundTable::PeerState& InboundTable::state_for_locked(const std::string& peer,
                                                        Clock::time_point now) {
  auto it = peers_.find(peer);
  if (it != peers_.end()) return it->second;
  if (limits_.max_peers > 0 && peers_.size() >= limits_.max_peers) {
    // The initiator heard from least recently makes room (its records count as dropped).
    auto oldest = std::min_element(peers_.begin(), peers_.end(), [](const auto& a, const auto& b) {
      return a.second.last_landing < b.second.last_landing;
    });
    dropped_ += oldest->second.landed.size();
    peers_.erase(oldest);
  }
  PeerState& p = peers_[peer];
  p.last_landing = now;
  return p;
}

void InboundTable::release_locked(PeerState& p, uint64_t uid) {
  p.landed.erase(uid);
  if (p.kept_past_window.erase(uid)) p.seen.erase(uid);
}

void InboundTable::trim_locked(PeerState& p, Clock::time_point now) {
  // Popped records leave their place in the order behind; an old unpopped one
  // at the front would keep them all: compact when it holds twice the records.
  if (p.landed_order.size() > 2 * p.landed.size() + 64) {
    std::deque<std::pair<Clock::time_point, uint64_t>> kept;
    for (const auto& e : p.landed_order)
      if (p.landed.count(e.second)) kept.push_back(e);
    p.landed_order.swap(kept);
  }
  const bool aged = limits_.max_age.count() > 0;
  while (!p.landed_order.empty()) {
    const auto& [when, uid] = p.landed_order.front();
    const bool too_old = aged && now - when > limits_.max_age;
    const bool too_many = limits_.max_per_peer > 0 && p.landed.size() > limits_.max_per_peer;
    if (!p.landed.count(uid)) {  // popped already: only its place in the order is left
      p.landed_order.pop_front();
      continue;
    }
    if (!too_old && !too_many) break;
    release_locked(p, uid);
    ++dropped_;
    p.landed_order.pop_front();
  }
}

bool InboundTable::repeated_notify_locked(PeerState& p, const NotifySeq& s) {
  if (s.life != p.notify_life) {  // another sender life: its own sequence
    p.notify_life = s.life;
    p.notify_floor = 0;
    p.notify_seqs.clear();
  }
  // Below the floor: answered to the sender already (or given up by it).
  const uint64_t floor = std::min(s.floor, s.seq);
  if (floor > p.notify_floor) {
    p.notify_floor = floor;
    p.notify_seqs.erase(p.notify_seqs.begin(), p.notify_seqs.lower_bound(floor));
  }
  if (s.seq < p.notify_floor || !p.notify_seqs.insert(s.seq).second) return true;
  if (p.notify_seqs.size() > kMaxNotifySeqs) p.notify_seqs.erase(p.notify_seqs.begin());
  return false;
}

bool InboundTable::land(const std::string& peer, uint64_t uid, StatusCode code,
                        const NotifySeq* seq) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto now = now_();
  PeerState& p = state_for_locked(peer, now);
  if (seq != nullptr && seq->seq != 0 && repeated_notify_locked(p, *seq)) return false;
  if (!p.seen.insert(uid).second) return false;
  p.seen_order.push_back(uid);
  if (p.seen_order.size() > kRememberPerPeer) {
    // Forget the oldest uid, unless the application has not popped it yet.
    uint64_t old = p.seen_order.front();
    p.seen_order.pop_front();
    if (p.landed.count(old))
      p.kept_past_window.insert(old);
    else
      p.seen.erase(old);
  }
  TransferStatus s;
  s.Finish(code);
  p.landed.emplace(uid, s);
  p.landed_order.emplace_back(now, uid);
  p.last_landing = now;
  trim_locked(p, now);
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
  if (timeout >= std::chrono::hours(24))
    landed_cv_.wait(lk, ready);
  else
    landed_cv_.wait_for(lk, timeout, ready);
  return got;
}

std::optional<TransferStatus> InboundTable::pop_locked(const std::string& peer, uint64_t uid) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return std::nullopt;
  PeerState& p = it->second;
  trim_locked(p, now_());  // a record past its age is not handed out
  auto f = p.landed.find(uid);
  if (f == p.landed.end()) return std::nullopt;
  TransferStatus s = f->second;
  release_locked(p, uid);
  return s;
}

void InboundTable::forget_peer(const std::string& peer) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  dropped_ += it->second.landed.size();  // never popped: counted as any drop is
  peers_.erase(it);
}

size_t InboundTable::pending() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& [k, p] : peers_) n += p.landed.size();
  return n;
}

size_t InboundTable::footprint() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& [k, p] : peers_)
    n += p.landed.size() + p.landed_order.size() + p.seen.size() + p.seen_order.size() +
         p.kept_past_window.size() + p.notify_seqs.size();
  return n;
}

uint64_t InboundTable::dropped() const {
  std::lock_guard<std::mutex> lk(mu_);
  return dropped_;
}

}  // namespace ferry
