// SPDX-License-Identifier: Apache-2.0
#include "health.h"

#include "log.h"

namespace ferry {

const char* to_string(Health::State s) {
  switch (s) {
    case Health::State::HEALTHY:
      return "healthy";
    case Health::State::QUARANTINED:
      return "quarantined";
    case Health::State::PROBING:
      return "probing";
  }
  return "?";
}

Health::Health(QuarantinePolicy q, Clock clock) : q_(q), clock_(std::move(clock)) {
  if (!clock_) clock_ = [] { return std::chrono::steady_clock::now(); };
}

Health::Entry& Health::entry(const std::string& peer, const std::string& backend) {
  any_entry_.store(true, std::memory_order_release);
  return entries_[{peer, backend}];
}

void Health::refresh(Entry& e, TimePoint now) {
  if (e.state == State::QUARANTINED && now >= e.until) {
    e.state = State::PROBING;
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
}

Health::State Health::state(const std::string& peer, const std::string& backend) {
  // Asked before every attempt: until a first failure, no lock and no lookup.
  if (!any_entry_.load(std::memory_order_acquire)) return State::HEALTHY;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = entries_.find({peer, backend});
  if (it == entries_.end()) return State::HEALTHY;
  refresh(it->second, clock_());
  return it->second.state;
}

bool Health::fail(const std::string& peer, const std::string& backend) {
  std::lock_guard<std::mutex> lk(mu_);
  auto now = clock_();
  Entry& e = entry(peer, backend);
  refresh(e, now);
  bool relapse = e.state == State::PROBING;
  if (!relapse) {
    e.failures.push_back(now);
    while (!e.failures.empty() && now - e.failures.front() > q_.within) e.failures.pop_front();
    if (e.state == State::QUARANTINED || e.failures.size() < q_.after_failures) return false;
  }
  e.period = relapse ? std::min(e.period * 2, q_.max_period) : q_.period;
  e.until = now + e.period;
  e.state = State::QUARANTINED;
  e.failures.clear();
  generation_.fetch_add(1, std::memory_order_acq_rel);
  FERRY_LOG(WARN, "health",
            backend + " quarantined for peer " + peer + " for " + std::to_string(e.period.count()) +
                " ms" + (relapse ? " (probe failed)" : ""));
  return true;
}

bool Health::succeed(const std::string& peer, const std::string& backend) {
  // Only an entry in PROBING changes here, and one exists only after a failure.
  if (!any_entry_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lk(mu_);
  auto it = entries_.find({peer, backend});
  if (it == entries_.end()) return false;
  Entry& e = it->second;
  refresh(e, clock_());
  if (e.state != State::PROBING) {
    return false;
  }
  e.state = State::HEALTHY;
  e.failures.clear();
  e.period = std::chrono::milliseconds(0);
  generation_.fetch_add(1, std::memory_order_acq_rel);
  FERRY_LOG(WARN, "health", backend + " recovered for peer " + peer);
  return true;
}

Health::TimePoint Health::quarantined_until(const std::string& peer, const std::string& backend) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = entries_.find({peer, backend});
  return it == entries_.end() ? TimePoint{} : it->second.until;
}

void Health::forget_peer(const std::string& peer) {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto it = entries_.begin(); it != entries_.end();)
    it = it->first.first == peer ? entries_.erase(it) : std::next(it);
  generation_.fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace ferry
