// SPDX-License-Identifier: Apache-2.0
#include "notif_inbox.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include "ferry/ferry.hpp"

namespace ferry {

NotifInbox::NotifInbox(NotifLimits limits) : limits_(limits) {
  event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd_ < 0) throw Error(StatusCode::ERR_BAD_STATE, "eventfd for notifications failed");
}

NotifInbox::~NotifInbox() { ::close(event_fd_); }

NotifInbox::Sender& NotifInbox::sender_locked(const std::string& key) {
  auto it = senders_.find(key);
  if (it == senders_.end()) {
    while (senders_.size() >= limits_.max_senders) {
      // Forget the decision of the sender least recently heard from that has
      // nothing unread (its next message starts afresh: at worst a resend from
      // before is taken again, after max_senders others spoke since).
      auto victim = senders_.end();
      for (auto s = senders_.begin(); s != senders_.end(); ++s)
        if (s->second.unread.empty() &&
            (victim == senders_.end() || s->second.last_use < victim->second.last_use))
          victim = s;
      if (victim == senders_.end()) break;  // all hold unread messages: bounded by bytes
      senders_.erase(victim);
    }
    it = senders_.emplace(key, Sender{}).first;
  }
  it->second.last_use = ++clock_;
  return it->second;
}

MsgAck NotifInbox::deliver(const std::string& sender, uint64_t instance, uint64_t id,
                           const uint8_t* payload, size_t len) {
  std::lock_guard<std::mutex> lk(mu_);
  Sender& s = sender_locked(sender);
  if (s.instance != instance) {  // a new life of the sender numbers afresh
    s.instance = instance;
    s.high = 0;
  }
  if (id < s.high) return MsgAck::STALE;
  if (id == s.high) return s.decided;
  s.high = id;
  // Each message is charged what it holds beyond its payload too: empty ones are not free.
  const size_t cost = len + kPerMessageCost;
  if (s.unread.size() >= limits_.max_messages || s.unread_bytes + cost > limits_.max_bytes ||
      total_bytes_ + cost > limits_.max_total_bytes) {
    ++refused_;
    return s.decided = MsgAck::FULL;
  }
  s.unread.emplace_back(reinterpret_cast<const char*>(payload), len);
  s.unread_bytes += cost;
  total_bytes_ += cost;
  ++unread_;
  ++received_;
  signal_locked();
  arrived_.notify_all();
  return s.decided = MsgAck::TAKEN;
}

FenceState NotifInbox::fence(const std::string& sender, uint64_t instance, uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  Sender& s = sender_locked(sender);
  if (s.instance != instance) {
    s.instance = instance;
    s.high = 0;
  }
  if (id == s.high) return s.decided == MsgAck::TAKEN ? FenceState::WHOLE : FenceState::NONE;
  // Below high: decided before a later one (a taken id is not re-checked: a
  // sender fences only the message it has in flight, which is never below).
  if (id < s.high) return FenceState::NONE;
  s.high = id;
  s.decided = MsgAck::FENCED;
  return FenceState::NONE;
}

void NotifInbox::signal_locked() {
  if (signalled_) return;
  uint64_t one = 1;
  if (::write(event_fd_, &one, sizeof one) == sizeof one) signalled_ = true;
}

NotifInbox::Messages NotifInbox::drain_locked() {
  Messages out;
  for (auto& [key, s] : senders_) {
    if (s.unread.empty()) continue;
    auto& v = out[key];
    v.reserve(s.unread.size());
    for (auto& m : s.unread) v.push_back(std::move(m));
    s.unread.clear();
    total_bytes_ -= s.unread_bytes;
    s.unread_bytes = 0;
  }
  unread_ = 0;
  if (signalled_) {
    uint64_t v;
    if (::read(event_fd_, &v, sizeof v) == sizeof v) signalled_ = false;
  }
  return out;
}

NotifInbox::Messages NotifInbox::drain() {
  std::lock_guard<std::mutex> lk(mu_);
  return drain_locked();
}

NotifInbox::Messages NotifInbox::wait_drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] { return unread_ > 0; };
  if (timeout >= std::chrono::hours(24 * 365))  // "forever": wait_for would overflow
    arrived_.wait(lk, ready);
  else
    arrived_.wait_for(lk, timeout, ready);
  return drain_locked();
}

size_t NotifInbox::footprint() const {
  std::lock_guard<std::mutex> lk(mu_);
  return senders_.size();
}

NotifInbox::Counts NotifInbox::counts() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {received_, refused_, unread_};
}

}  // namespace ferry
