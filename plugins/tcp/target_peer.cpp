#include "target_peer.h"

#include <sys/socket.h>

#include <algorithm>

#include "ferry/plugin.h"

namespace ferry_tcp {

bool TargetPeer::removed() const {
  std::lock_guard lk(mu_);
  return removed_;
}

bool TargetPeer::Attach(int fd) {
  std::lock_guard lk(mu_);
  if (removed_) return false;
  fds_.push_back(fd);
  return true;
}

void TargetPeer::Detach(int fd) {
  std::lock_guard lk(mu_);
  auto it = std::find(fds_.begin(), fds_.end(), fd);
  if (it != fds_.end()) fds_.erase(it);
  if (fds_.empty()) {
    // With no lane left, no frame of a half-counted transfer can still arrive.
    pending_.clear();
    floor_ = 0;
  }
}

void TargetPeer::Remove() {
  std::lock_guard lk(mu_);
  removed_ = true;
  // fds stay open until their threads Detach, which needs mu_: shutdown is safe.
  for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
}

TargetPeer::Count TargetPeer::CountFrame(const wire::Header& h, int frame_status,
                                         int* report_status, std::string* why) {
  std::lock_guard lk(mu_);
  if (h.low_seq > floor_) {
    floor_ = h.low_seq;
    // Transfers the initiator gave up on will never see their other frames.
    pending_.erase(pending_.begin(), pending_.lower_bound(floor_));
  }
  if (!(h.flags & wire::kFlagNotify) || h.xfer_seq < floor_) return Count::kNothing;

  auto it = pending_.find(h.xfer_seq);
  if (it == pending_.end()) {
    if (pending_.size() >= kMaxPending) {
      *why = "too many unfinished notify transfers";
      return Count::kBad;
    }
    it = pending_.emplace(h.xfer_seq, Pending{h.uid, h.frame_count, 0, false}).first;
  } else if (it->second.uid != h.uid || it->second.total != h.frame_count) {
    *why = "frames of transfer " + std::to_string(h.xfer_seq) + " disagree on uid or count";
    return Count::kBad;
  }
  Pending& p = it->second;
  if (p.served >= p.total) {
    *why = "more frames than announced for transfer " + std::to_string(h.xfer_seq);
    return Count::kBad;
  }
  ++p.served;
  Count result = Count::kNothing;
  if (frame_status != FERRY_OK && !p.reported) {
    // The initiator fails the transfer on this frame; tell the target now rather
    // than wait for frames the initiator may never send.
    p.reported = true;
    *report_status = frame_status;
    result = Count::kReport;
  } else if (p.served == p.total && !p.reported) {
    *report_status = FERRY_OK;
    result = Count::kReport;
  }
  if (p.served == p.total) pending_.erase(it);
  return result;
}

}  // namespace ferry_tcp
