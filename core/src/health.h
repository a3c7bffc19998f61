// SPDX-License-Identifier: Apache-2.0
// Health of each (peer, backend) pair: failures within a window put the pair in
// quarantine for a period that doubles on each relapse up to a cap. When the
// period ends the pair is probing: the next transfer may use it; success makes
// it healthy again (period reset), failure quarantines it again (doubled).
#pragma once
#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "policy.h"

namespace ferry {

class Health {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Clock = std::function<TimePoint()>;
  enum class State { HEALTHY, QUARANTINED, PROBING };

  explicit Health(QuarantinePolicy q, Clock clock = {});

  State state(const std::string& peer, const std::string& backend);
  bool usable(const std::string& peer, const std::string& backend) {
    return state(peer, backend) != State::QUARANTINED;
  }
  // Record an outcome; return true when it changed the pair's state.
  bool fail(const std::string& peer, const std::string& backend);
  bool succeed(const std::string& peer, const std::string& backend);
  // Bumped on every state change, so cached routes know to recompute.
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // When a quarantined pair becomes usable again (for messages and tests).
  TimePoint quarantined_until(const std::string& peer, const std::string& backend);
  void forget_peer(const std::string& peer);

 private:
  struct Entry {
    State state = State::HEALTHY;
    std::deque<TimePoint> failures;
    TimePoint until{};
    std::chrono::milliseconds period{0};
  };
  Entry& entry(const std::string& peer, const std::string& backend);
  void refresh(Entry& e, TimePoint now);

  QuarantinePolicy q_;
  Clock clock_;
  std::mutex mu_;
  std::map<std::pair<std::string, std::string>, Entry> entries_;
  // Set once any entry exists: until a first failure, succeed() (once per
  // transfer) returns without the lock and the string-pair lookup.
  std::atomic<bool> any_entry_{false};
  std::atomic<uint64_t> generation_{0};
};

const char* to_string(Health::State s);

}  // namespace ferry
