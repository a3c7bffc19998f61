// SPDX-License-Identifier: Apache-2.0
// Target-side view of one added peer: whether its lanes may be served, which
// lanes it has open, and the frame counts that turn into exactly one
// host->inbound() per notify transfer.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/plugin.h"
#include "wire.h"

namespace ferry_tcp {

class TargetPeer {
 public:
  // registered: the core added this peer; false for an initiator served because
  // it proved this engine's descriptor (plugin.h, link_check).
  explicit TargetPeer(std::string key, bool same_host = false, bool registered = true)
      : key_(std::move(key)), same_host_(same_host), registered_(registered) {}
  const std::string& key() const { return key_; }
  bool same_host() const {
    std::lock_guard lk(mu_);
    return same_host_;
  }
  bool registered() const {
    std::lock_guard lk(mu_);
    return registered_;
  }
  // The core registered a peer served so far unregistered: it is registered
  // from now on. Its lanes stay (their transfers go on); each checks its
  // handshake's proof again before its next frame (TargetServer::LaneStillProven)
  // and closes if it does not prove the registered secret. What they applied
  // stays for fences. False when it was registered already.
  bool Adopt(bool same_host);

  bool removed() const;
  // An initiator uses at most 16 lanes (the `lanes` setting); more admitted at
  // once are lanes it lost (a link that went down) or a flood: the oldest is
  // shut down when another would exceed this.
  static constexpr size_t kMaxLanesPerPeer = 64;
  // False once removed: the lane must be refused.
  bool Attach(int fd);
  // The last lane to go drops the counting state, so a vanished initiator leaks nothing.
  void Detach(int fd);
  // Marks the peer gone and shuts its lanes down.
  void Remove();

  // Fencing (plugin.h, fence()). A WRITE frame is applied only between
  // BeginApply (false: its attempt is fenced, drop the frame) and EndApply
  // (after it was counted for notification); Fence marks attempts fenced and
  // waits until no frame of theirs is between the two.
  // `clock_offset_ns` maps the initiator's clock onto ours (from its HELLO): a
  // frame whose attempt expired before we got to it is dropped, and the attempt
  // fenced, so a stopped target that resumes does not apply what its initiator
  // has given up on (the fence stays the exact answer; this makes it "none").
  // `bytes`: what a whole frame landed (its items' total; a direct request's
  // payload is addresses, not its bytes).
  bool BeginApply(const wire::Header& h, int fd, int64_t clock_offset_ns);
  void EndApply(const wire::Header& h, int fd, bool whole, uint64_t bytes);
  // A frame of a fenced attempt already being applied is let finish (at most
  // one chunk per lane; it counts as landed): its lane also carries other
  // attempts' frames - a sibling part of the same call, the next call - which
  // a cut would fail with a lost connection. A lane still applying one after
  // kFenceGrace has stalled and is cut, so the fence never waits for bytes
  // that may not come. FERRY_OK, or FERRY_ERR_TIMEOUT when a frame was still
  // being applied at `deadline`.
  int Fence(const uint64_t* ids, size_t n, std::chrono::steady_clock::time_point deadline,
            ferry_fence_result_v1* out);
  static constexpr std::chrono::milliseconds kFenceGrace{200};

  // Attempts remembered for fences (at most kMaxAttempts).
  size_t remembered_attempts() const {
    std::lock_guard lk(mu_);
    return attempts_.size();
  }
  uint64_t forgotten_upto() const {
    std::lock_guard lk(mu_);
    return forgotten_upto_;
  }
  static constexpr size_t kMaxAttempts = 4096;

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
  // What was applied of one attempt: the last kMaxAttempts attempts of this
  // initiator, for as long as the peer is added. Past that bound the oldest
  // record that is not being applied is forgotten, an ended one (all frames
  // applied, fenced or broken) before a live one, and `forgotten_upto_` rises
  // to its id. Attempt ids grow (plugin.h), so a record asked for at or below
  // that mark may be one forgotten: its frames are refused (a fenced attempt
  // never lands late) and a fence of it is answered FERRY_FENCE_UNKNOWN (the
  // core: outcome unknown) - never NONE or PARTIAL, on which the core would
  // write it again elsewhere though it may have landed whole and been
  // notified. A record named by a fence in progress is never forgotten by it.
  struct Attempt {
    uint32_t frames_total = 0, frames_done = 0;
    uint64_t landed = 0;
    int applying = 0;
    std::vector<int> lanes;  // fds of the lanes applying a frame of it now
    bool fenced = false, broken = false;
    bool unknown = false;  // at or below forgotten_upto_ when first seen: maybe forgotten
    int pins = 0;          // fences in progress that name it: not forgotten meanwhile
  };
  Attempt& AttemptLocked(uint64_t id);
  // Forgets records (the oldest ended first, none applied or pinned) until at
  // most `keep` are left, or none can go.
  void TrimLocked(size_t keep);

  const std::string key_;
  mutable std::mutex mu_;
  bool same_host_;
  bool registered_;
  bool removed_ = false;
  std::vector<int> fds_;
  std::map<uint64_t, Pending> pending_;  // by transfer sequence
  uint64_t floor_ = 0;  // the initiator has finished every notify transfer below this
  std::map<uint64_t, Attempt> attempts_;  // by the core's attempt id
  uint64_t forgotten_upto_ = 0;           // the highest id whose record was forgotten
  std::condition_variable applied_;       // a frame left EndApply
};

}  // namespace ferry_tcp
