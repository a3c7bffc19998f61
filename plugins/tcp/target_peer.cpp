// SPDX-License-Identifier: Apache-2.0
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
  // Shut down, not closed: its thread still reads it, and Detaches it itself.
  if (fds_.size() >= kMaxLanesPerPeer) ::shutdown(fds_[fds_.size() - kMaxLanesPerPeer], SHUT_RDWR);
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
    // attempts_ stays: a fence may come after the last lane went, and must still
    // learn what that lane applied before it closed.
  }
}

bool TargetPeer::Adopt(bool same_host) {
  std::lock_guard lk(mu_);
  if (registered_ || removed_) return false;
  registered_ = true;
  same_host_ = same_host;
  return true;
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

TargetPeer::Attempt& TargetPeer::AttemptLocked(uint64_t id) {
  auto it = attempts_.find(id);
  if (it != attempts_.end()) return it->second;
  TrimLocked(kMaxAttempts - 1);
  Attempt& a = attempts_[id];
  if (id <= forgotten_upto_) {
    a.unknown = true;
    a.fenced = true;
  }
  return a;
}

void TargetPeer::TrimLocked(size_t keep) {
  // (A loop: a fence of more ids than the bound grows the table while it runs.)
  while (attempts_.size() > keep) {
    // The oldest record not being applied, an ended one first: a live
    // attempt's later frames are refused once it is forgotten (its transfer
    // fails), an ended one's record only answers a fence that rarely comes.
    auto victim = attempts_.end();
    for (auto o = attempts_.begin(); o != attempts_.end(); ++o) {
      const Attempt& a = o->second;
      if (a.applying != 0 || a.pins != 0) continue;
      if (victim == attempts_.end()) victim = o;
      if (a.fenced || a.broken || (a.frames_total > 0 && a.frames_done == a.frames_total)) {
        victim = o;
        break;
      }
    }
    if (victim == attempts_.end()) break;  // all applied or pinned now: over the bound for a while
    forgotten_upto_ = std::max(forgotten_upto_, victim->first);
    attempts_.erase(victim);
  }
}

bool TargetPeer::BeginApply(const wire::Header& h, int fd, int64_t clock_offset_ns) {
  if (h.attempt_id == 0) return true;  // an initiator that does not fence
  std::lock_guard lk(mu_);
  Attempt& a = AttemptLocked(h.attempt_id);
  if (a.fenced) return false;
  if (h.expires_ns != 0) {
    const auto now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::steady_clock::now().time_since_epoch())
                         .count();
    if (now > static_cast<int64_t>(h.expires_ns) + clock_offset_ns) {
      a.fenced = true;
      return false;
    }
  }
  a.frames_total = h.frame_count;
  ++a.applying;
  a.lanes.push_back(fd);
  return true;
}

void TargetPeer::EndApply(const wire::Header& h, int fd, bool whole, uint64_t bytes) {
  if (h.attempt_id == 0) return;
  {
    std::lock_guard lk(mu_);
    Attempt& a = AttemptLocked(h.attempt_id);
    --a.applying;
    if (auto it = std::find(a.lanes.begin(), a.lanes.end(), fd); it != a.lanes.end())
      a.lanes.erase(it);
    if (whole) {
      ++a.frames_done;
      a.landed += bytes;
    } else {
      a.broken = true;  // part of the payload may be in memory
    }
  }
  applied_.notify_all();
}

int TargetPeer::Fence(const uint64_t* ids, size_t n, std::chrono::steady_clock::time_point deadline,
                      ferry_fence_result_v1* out) {
  std::unique_lock lk(mu_);
  // Pinned for the call: making a record for one id must not forget another
  // it names (a fence of more ids than the table holds outgrows it meanwhile).
  for (size_t i = 0; i < n; ++i) {
    Attempt& a = AttemptLocked(ids[i]);
    a.fenced = true;
    ++a.pins;
  }
  struct Unpin {
    TargetPeer* tp;
    const uint64_t* ids;
    size_t n;
    ~Unpin() {
      for (size_t i = 0; i < n; ++i)
        if (auto it = tp->attempts_.find(ids[i]); it != tp->attempts_.end()) --it->second.pins;
      tp->TrimLocked(kMaxAttempts);  // back within the bound (the answers are written)
    }
  } unpin{this, ids, n};
  auto busy = [&] {
    for (size_t i = 0; i < n; ++i) {
      auto it = attempts_.find(ids[i]);
      if (it != attempts_.end() && it->second.applying > 0) return true;
    }
    return false;
  };
  const auto grace = std::min(deadline, std::chrono::steady_clock::now() + kFenceGrace);
  if (!applied_.wait_until(lk, grace, [&] { return !busy(); })) {
    for (size_t i = 0; i < n; ++i) {
      auto it = attempts_.find(ids[i]);
      if (it == attempts_.end()) continue;
      // The fd stays open until its lane thread has left EndApply (it closes
      // it after ServeLane returns), so this cannot hit a reused number.
      for (int fd : it->second.lanes) ::shutdown(fd, SHUT_RDWR);
    }
    if (!applied_.wait_until(lk, deadline, [&] { return !busy(); })) return FERRY_ERR_TIMEOUT;
  }
  for (size_t i = 0; i < n; ++i) {
    auto it = attempts_.find(ids[i]);
    if (it == attempts_.end()) {  // (pinned: never; kept as the safe answer)
      out[i] = {0, FERRY_FENCE_UNKNOWN, 0};
      continue;
    }
    const Attempt& a = it->second;
    out[i].landed_bytes = a.landed;
    out[i].reserved = 0;
    if (a.unknown)
      out[i].state = FERRY_FENCE_UNKNOWN;
    else if (a.frames_total > 0 && a.frames_done == a.frames_total && !a.broken)
      out[i].state = FERRY_FENCE_WHOLE;
    else if (a.landed > 0 || a.broken)
      out[i].state = FERRY_FENCE_PARTIAL;
    else
      out[i].state = FERRY_FENCE_NONE;
  }
  return FERRY_OK;
}

}  // namespace ferry_tcp
