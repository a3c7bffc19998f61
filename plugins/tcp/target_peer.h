// Target-side view of one added peer: whether its lanes may be served, which
// lanes it has open, and the frame counts that turn into exactly one
// host->inbound() per notify transfer.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "wire.h"

namespace ferry_tcp {

class TargetPeer {
 public:
  explicit TargetPeer(std::string key) : key_(std::move(key)) {}
  const std::string& key() const { return key_; }

  bool removed() const;
  // False once removed: the lane must be refused.
  bool Attach(int fd);
  // The last lane to go drops the counting state, so a vanished initiator leaks nothing.
  void Detach(int fd);
  // Marks the peer gone and shuts its lanes down.
  void Remove();

  enum class Count { kNothing, kReport, kBad };
  // Records one served request frame (frame_status = how it was served). kReport:
  // call inbound now with *report_status. kBad: the frames contradict each other.
  Count CountFrame(const wire::Header& h, int frame_status, int* report_status, std::string* why);

 private:
  struct Pending {
    uint64_t uid = 0;
    uint32_t total = 0;
    uint32_t served = 0;
    bool reported = false;
  };
  // Bounds memory a buggy or hostile initiator can pin with never-finished transfers.
  static constexpr size_t kMaxPending = 1 << 16;

  const std::string key_;
  mutable std::mutex mu_;
  bool removed_ = false;
  std::vector<int> fds_;
  std::map<uint64_t, Pending> pending_;  // by transfer sequence
  uint64_t floor_ = 0;  // the initiator has finished every notify transfer below this
};

}  // namespace ferry_tcp
