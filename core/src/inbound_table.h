// SPDX-License-Identifier: Apache-2.0
// Target side: which transfers from which initiator have landed. Each
// (initiator, uid) is recorded once, however many backends or attempts carried
// it; a remembered window of recent uids per initiator drops repeats, also
// after the application popped the first report. A core NOTIFY carries its
// place in its sender's sequence (NotifySeq): its resend is known as one
// however many landings came in between, which the uid window is not.
//
// Bounded (a peer can land records faster than the application pops them, and
// some applications never pop): per initiator at most `max_per_peer` un-popped
// records, none older than `max_age`, and at most `max_peers` initiators. The
// oldest record (or the initiator with the oldest landing) goes first; every
// record dropped unpopped is counted.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "control_frame.h"
#include "ferry/ferry.hpp"

namespace ferry {

struct InboundLimits {
  size_t max_per_peer = 65536;                                   // 0: no limit
  std::chrono::milliseconds max_age = std::chrono::minutes(10);  // 0: no limit
  size_t max_peers = 4096;
};

class InboundTable {
 public:
  using Clock = std::chrono::steady_clock;
  using Limits = InboundLimits;
  explicit InboundTable(Limits limits = {}, std::function<Clock::time_point()> now = {});

  // Returns true when this was the first report for (peer, uid). `seq`: the
  // report is a core NOTIFY at that place in its sender's sequence; a seq
  // taken before, or below the sender's floor, is a repeat.
  bool land(const std::string& peer, uint64_t uid, StatusCode code, const NotifySeq* seq = nullptr);
  std::optional<TransferStatus> pop(const std::string& peer, uint64_t uid);
  // pop, waiting up to `timeout` for the transfer to land.
  std::optional<TransferStatus> wait_pop(const std::string& peer, uint64_t uid,
                                         std::chrono::milliseconds timeout);
  void forget_peer(const std::string& peer);
  size_t pending() const;
  // Records dropped before the application popped them (cap, age, peer cap).
  uint64_t dropped() const;
  // Entries in every internal container (records, their order, remembered
  // uids): what the table's memory grows with.
  size_t footprint() const;
  const Limits& limits() const { return limits_; }

  static constexpr size_t kRememberPerPeer = 1 << 16;
  // NOTIFY seqs kept per initiator at or above its floor. A sender keeps at
  // most 128 NOTIFYs unanswered (ControlPlane::kMaxUnanswered), so these are
  // the last answered ones its next NOTIFY's floor releases; more is a sender
  // not keeping to that (its oldest are forgotten: the uid window is left).
  static constexpr size_t kMaxNotifySeqs = 4096;

 private:
  struct PeerState {
    std::unordered_map<uint64_t, TransferStatus> landed;
    std::deque<std::pair<Clock::time_point, uint64_t>> landed_order;  // may hold popped uids
    std::unordered_set<uint64_t> seen;
    std::deque<uint64_t> seen_order;
    // In `seen` only because they were unpopped when the window passed them:
    // they leave it when popped or dropped.
    std::unordered_set<uint64_t> kept_past_window;
    Clock::time_point last_landing{};
    // The initiator's NOTIFY sequence: its life, the highest floor it sent,
    // the seqs taken from there up.
    uint64_t notify_life = 0, notify_floor = 0;
    std::set<uint64_t> notify_seqs;
  };
  // Whether a NOTIFY at `s` is a repeat; notes it when it is not (mu_ held).
  static bool repeated_notify_locked(PeerState& p, const NotifySeq& s);
  std::optional<TransferStatus> pop_locked(const std::string& peer, uint64_t uid);
  // Drops what is too old, then the oldest while over the cap; mu_ held.
  void trim_locked(PeerState& p, Clock::time_point now);
  // A record leaves `landed` (popped or dropped); mu_ held.
  static void release_locked(PeerState& p, uint64_t uid);
  PeerState& state_for_locked(const std::string& peer, Clock::time_point now);

  const Limits limits_;
  const std::function<Clock::time_point()> now_;
  mutable std::mutex mu_;
  std::condition_variable landed_cv_;
  std::map<std::string, PeerState> peers_;
  uint64_t dropped_ = 0;
};

}  // namespace ferry
