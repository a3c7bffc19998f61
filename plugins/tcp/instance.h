// SPDX-License-Identifier: Apache-2.0
// One plugin instance (one engine): ties settings, registered memory, peers,
// the target server and the deadline watcher together behind the C ABI.
// Methods may throw (std::bad_alloc, std::system_error); the plugin kit's
// entry points (tcp_plugin.cpp) catch.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "connector.h"
#include "deadline.h"
#include "ferry/plugin_kit.hpp"
#include "gpu_stage.h"
#include "idle_reaper.h"
#include "io_pool.h"
#include "peer.h"
#include "post_queue.h"
#include "region.h"
#include "settings.h"
#include "target.h"

namespace ferry_tcp {

// Plugin-owned handles handed to the core.
struct PeerHandle {
  std::shared_ptr<Peer> peer;
};
struct LocalMem {
  std::shared_ptr<Region> region;
};
struct RemoteMem {
  PeerHandle* peer;
  uint64_t id;
  uint64_t size;
  uint64_t key;  // presented with every request (wire::Header::region_key)
  bool host;     // host memory at the target: a same-host lane may copy it directly
};

class Instance {
 public:
  // init(): the settings parsed, the instance started (the plugin kit's contract).
  static std::unique_ptr<Instance> Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                          std::string* why);
  Instance(const ferry_host_v1* host, std::string engine_key, Settings settings);
  ~Instance();  // fini: fails what is pending, joins every thread, frees every handle

  bool Start(std::string* err);
  int ConnInfo(void* buf, size_t* len);
  int PeerAdd(const ferry_peer_v1* p, void** handle);
  void PeerRemove(void* handle);
  int MemRegister(const ferry_mem_v1* m, void** handle, void* blob, size_t* blob_len);
  void MemDeregister(void* handle);
  int MemImport(void* peer, uint64_t remote_id, uint64_t remote_size, const void* blob,
                size_t blob_len, void** handle);
  void MemRelease(void* handle);
  int Post(const ferry_xfer_v1* x);
  int Describe(char* buf, size_t len);
  int Counters(char* buf, size_t len);  // ABI 1.5: peers, regions, refused lanes, pinned bytes
  // ABI 1.6: a thread waiting for a transfer hands posted transfers to their
  // lanes (post_queue.h) and reads the responses of TCP lanes with frames in
  // flight (responses.h); returns the frames it completed.
  int Progress() {
    posts_.Flush();
    return static_cast<int>(progress_.Run());
  }
  int Fence(const char* peer_key, const uint64_t* ids, size_t n, uint64_t deadline_ns,
            ferry_fence_result_v1* out);
  const ferry_host_v1* host() const { return host_; }

 private:
  static void OnExpired(const std::shared_ptr<Xfer>& x);
  // post() leaves transfers on posts_ (post_flush_us); not while the senders
  // poll (sender_spin_us), when post() makes no system call anyway.
  bool PostQueueOn() const { return settings_.post_flush_us > 0 && settings_.sender_spin_us == 0; }

  const ferry_host_v1* host_;
  const std::string engine_key_;
  const Settings settings_;
  RegionTable regions_;
  std::atomic<uint64_t> ring_lanes_opened_{0};    // same-host lanes we opened over rings
  std::atomic<uint64_t> direct_lanes_opened_{0};  // ring lanes whose target agreed to direct copies
  std::atomic<uint64_t> direct_frames_{0};        // frames sent as direct requests
  std::atomic<uint64_t> sender_polls_caught_{0};  // polls of a sender that caught a queued frame
  StagePool stages_;  // GPU staging; outlives the lanes and the target server that lease from it
  PushWaiter push_waiter_;  // failed direct READs waiting out a push; outlives the lanes
  DeadlineWatcher watcher_;
  // Every peer's transfer sequence (peer.h). Starts at the monotonic clock in
  // ns: above what an earlier instance of this engine on this host used (it
  // numbered fewer transfers than nanoseconds passed), should the target still
  // hold its count.
  std::atomic<uint64_t> xfer_seqs_{
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                std::chrono::steady_clock::now().time_since_epoch())
                                .count())};
  // The I/O threads of both sides (the target's TCP lanes, our TCP lanes'
  // responses); stopped after both.
  IoPool pool_;
  ProgressSet progress_;  // our TCP lanes with frames in flight
  IdleReaper reaper_;     // closes our idle lanes that the pool serves
  Connector connector_;   // connects them
  TargetServer target_;
  // Accepted transfers on their way to the lanes; stopped (emptied) first.
  PostQueue posts_;

  // Handles still held by the core, freed by fini if it never returned them.
  std::mutex handles_mu_;
  std::set<PeerHandle*> peers_;
  std::set<LocalMem*> locals_;
  std::set<RemoteMem*> remotes_;
};

}  // namespace ferry_tcp
