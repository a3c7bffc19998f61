// SPDX-License-Identifier: Apache-2.0
// The initiator side of one remote engine: its lanes, and the per-peer transfer
// sequence that the target uses to count a transfer's frames for notification.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include "ferry/plugin.h"
#include "lane.h"
#include "post_queue.h"
#include "region.h"
#include "xfer.h"

namespace ferry_tcp {

class DeadlineWatcher;

class Peer : public std::enable_shared_from_this<Peer> {
 public:
  // gpu_chunk_bytes: the frame size when the local memory is on a GPU.
  // seqs: the instance's transfer sequence, shared by all its peers (see next_seq_).
  Peer(PeerInfo info, int lanes, uint64_t chunk_bytes, uint64_t gpu_chunk_bytes,
       DeadlineWatcher* watcher, std::atomic<uint64_t>* seqs);
  ~Peer();

  // All or nothing, as plugin.h's post(): on FERRY_OK complete() follows exactly
  // once; otherwise *why says what was wrong and nothing was started.
  // remote_host: the target's region is host memory (its blob said so).
  int Post(const ferry_xfer_v1& x, const std::shared_ptr<Region>& local, uint64_t remote_id,
           uint64_t remote_key, bool remote_host, std::string* why);
  // Drops every lane's connection and fails the frames of transfers posted
  // before `keep_from` (a PostedSoFar() taken before the cause of the reset
  // could complete any transfer); later ones wait for the next connection.
  void ResetLanes(int status, const std::string& msg, uint64_t keep_from);
  // The seq the next posted transfer gets.
  uint64_t PostedSoFar();
  void Stop(int status, const std::string& msg);
  // Called once per transfer as it completes.
  void Finished(const Xfer& x);
  const PeerInfo& info() const { return info_; }

 private:
  // An accepted transfer's frames on their way to the lanes (post_queue.h).
  struct Handover final : PostQueue::Job {
    std::shared_ptr<Peer> peer;
    std::vector<FramePtr> frames;
    uint64_t first_lane = 0;
    size_t used_lanes = 0;
    bool direct = false;  // a one-frame transfer may be sent by the delivering thread
    void Deliver() noexcept override;
  };
  // Puts an accepted transfer's frames on their lanes: a small one sent by
  // this thread when its lane is free (direct), the rest queued and the
  // lanes' senders kicked together.
  void Deliver(Handover& h) noexcept;

  const PeerInfo info_;
  const uint64_t chunk_bytes_;
  const uint64_t gpu_chunk_bytes_;
  DeadlineWatcher* const watcher_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::atomic<uint64_t> next_req_{1};
  std::atomic<uint64_t> next_lane_{0};
  std::atomic<bool> stopped_{false};
  // Held shared while a Post puts frames on lanes, unique while ResetLanes
  // aborts them: no frame lands on a lane between two of its aborts.
  std::shared_mutex reset_mu_;
  std::mutex seq_mu_;
  // Transfer sequence numbers come from the instance, not from 1 per Peer: the
  // target keeps its count of an initiator (the "every notify transfer below
  // this one is finished" floor) across the initiator's peer_remove + peer_add
  // (the application deregistering and registering it again) while an old lane
  // is still open there, and a restart at 1 fell below that floor, so the
  // target dropped the new transfers' notifications.
  std::atomic<uint64_t>* const seqs_;
  uint64_t next_seq_;                   // above every seq this peer has used
  std::set<uint64_t> notify_inflight_;  // seqs of unfinished notify transfers
};

}  // namespace ferry_tcp
