// Target side: which transfers from which initiator have landed. Each
// (initiator, uid) is recorded once, however many backends or attempts carried
// it; a remembered window of recent uids per initiator drops repeats, also
// after the application popped the first report.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "ferry/ferry.hpp"

namespace ferry {

class InboundTable {
 public:
  // Returns true when this was the first report for (peer, uid).
  bool land(const std::string& peer, uint64_t uid, StatusCode code);
  std::optional<TransferStatus> pop(const std::string& peer, uint64_t uid);
  // pop, waiting up to `timeout` for the transfer to land.
  std::optional<TransferStatus> wait_pop(const std::string& peer, uint64_t uid,
                                         std::chrono::milliseconds timeout);
  void forget_peer(const std::string& peer);
  size_t pending() const;

  static constexpr size_t kRememberPerPeer = 1 << 16;

 private:
  struct PeerState {
    std::unordered_map<uint64_t, TransferStatus> landed;
    std::unordered_set<uint64_t> seen;
    std::deque<uint64_t> seen_order;
  };
  std::optional<TransferStatus> pop_locked(const std::string& peer, uint64_t uid);
  mutable std::mutex mu_;
  std::condition_variable landed_cv_;
  std::map<std::string, PeerState> peers_;
};

}  // namespace ferry
