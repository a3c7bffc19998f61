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
#include "region.h"
#include "xfer.h"

namespace ferry_tcp {

class DeadlineWatcher;

class Peer : public std::enable_shared_from_this<Peer> {
 public:
  // gpu_chunk_bytes: the frame size when the local memory is on a GPU.
  Peer(PeerInfo info, int lanes, uint64_t chunk_bytes, uint64_t gpu_chunk_bytes,
       DeadlineWatcher* watcher);
  ~Peer();

  // All or nothing, as plugin.h's post(): on FERRY_OK complete() follows exactly
  // once; otherwise *why says what was wrong and nothing was started.
  int Post(const ferry_xfer_v1& x, const std::shared_ptr<Region>& local, uint64_t remote_id,
           uint64_t remote_key, std::string* why);
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
  uint64_t next_seq_ = 1;
  std::set<uint64_t> notify_inflight_;  // seqs of unfinished notify transfers
};

}  // namespace ferry_tcp
