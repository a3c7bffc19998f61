// SPDX-License-Identifier: Apache-2.0
// One opened libfabric provider: fabric, domain, address vector, completion
// queue and an RDM endpoint, plus the progress thread that drives them and the
// queue of transfers waiting for room in the window.
//
// Progress: the thread reads the completion queue (which is what moves a
// manual-progress provider such as rxm or shm), posts queued RMAs, and ends
// transfers whose deadline passed. It spins for spin_us after the last sign of
// activity, then blocks:
//  - on the CQ's wait fd (fi_trywait + ppoll, with an eventfd for local posts)
//    where the provider has one (tcp;ofi_rxm): incoming RMAs wake it;
//  - where it has none (shm offers only FI_WAIT_YIELD, a spinner), on its
//    Doorbell (doorbell.h): a local post rings it, and so does a peer that just
//    queued an RMA for it; a target that served RMAs (its remote-event counter
//    moved) rings its sleeping peers, whose completions are then ready.
// Either way an idle engine costs no CPU.
//
// Methods may throw std::bad_alloc; ofi_plugin.cpp catches.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "blob.h"
#include "doorbell.h"
#include "ferry/plugin.h"
#include "gpu_stage.h"
#include "settings.h"

namespace ferry_ofi {

class Endpoint;

// A peer reached through one endpoint. Counters are guarded by the endpoint's mutex.
struct PeerEp {
  std::string key;
  Endpoint* ep = nullptr;
  fi_addr_t addr = FI_ADDR_UNSPEC;
  std::unique_ptr<Doorbell> doorbell;  // the peer's, where its provider has no wait fd
  uint32_t inflight = 0;               // RMAs to this peer inside the provider
  uint32_t stuck = 0;                  // ... of which belong to transfers that already ended
  bool removed = false;
  bool died = false;  // its process died (doorbell.h): said once in the log
};

// One bounce buffer of a staged transfer (gpu_stage.h) and the piece in it.
// Free -> (WRITE) ToHost -> Rma -> Free, or (READ) Rma -> ToDevice -> Free.
struct StageSlot {
  enum State : uint8_t { kFree, kToHost, kRma, kToDevice };
  struct Seg {
    uint64_t local_off, remote_off, len, buf_off;
  };
  State state = kFree;
  std::vector<Seg> segs;
  size_t seg = 0;        // RMA posting cursor: segment ...
  uint64_t seg_off = 0;  // ... and bytes of it already posted
  uint32_t inflight = 0;
};

// One accepted transfer.
struct Xfer {
  void* ctx = nullptr;  // xfer_ctx for host->complete
  uint32_t op = 0;
  uint64_t uid = 0;
  uint64_t deadline_ns = 0;
  uint64_t posted_ns = 0;
  std::shared_ptr<PeerEp> peer;
  uint8_t* local_base = nullptr;
  void* local_desc = nullptr;
  uint64_t remote_base = 0;  // added to remote_off: VA of the region or 0 (offset mode)
  uint64_t rkey = 0;
  std::vector<ferry_iov_v1> iov;
  // Guarded by the endpoint's mutex.
  size_t item = 0;        // posting cursor: iov index ...
  uint64_t item_off = 0;  // ... and bytes of it already posted
  uint32_t inflight = 0;  // RMAs posted and not yet completed
  bool ended = false;     // complete() has been (or is being) called
  bool failed = false;
  int status = FERRY_OK;
  std::string msg;
  std::pair<uint64_t, uint64_t> active_key{0, 0};
  // GPU staging (the local region is device memory). Guarded by the endpoint's mutex.
  bool staged = false;
  int device = -1;
  StageLease stage;
  bool stage_ready = false;  // bound for `device` by the GPU thread
  bool bind_queued = false;
  StageSlot slot[2];
  uint32_t copying = 0;  // jobs queued for the GPU thread (binding, copies)
  bool SlotsIdle() const {
    return slot[0].state == StageSlot::kFree && slot[1].state == StageSlot::kFree;
  }
  bool AllPosted() const { return failed || (item >= iov.size() && (!staged || SlotsIdle())); }
  // Nothing of it is in the provider or on the GPU: it may end.
  bool Settled() const { return inflight == 0 && copying == 0 && AllPosted(); }
};

class Endpoint {
 public:
  // Opens the provider described by `info` (copied). nullptr and *why on failure.
  static std::unique_ptr<Endpoint> Open(const ferry_host_v1* host, const fi_info* info,
                                        const Settings& s, std::string* why);
  ~Endpoint();

  void Start();
  // Ends every transfer with `status`, stops and joins the progress thread.
  void Stop(int status, const std::string& msg);
  // Closes the endpoint itself (after Stop, before the memory regions are closed).
  void CloseEp();

  const std::string& provider() const { return provider_; }
  const std::string& domain_name() const { return domain_name_; }
  bool polled() const { return cq_fd_ < 0; }  // no wait fd: sleeps on the doorbell
  std::string doorbell_name() const { return doorbell_ ? doorbell_->name() : std::string(); }
  const std::vector<uint8_t>& addr() const { return addr_; }
  uint32_t addr_format() const { return addr_format_; }
  uint64_t mr_mode() const { return mr_mode_; }
  uint64_t chunk() const { return chunk_; }
  uint32_t window() const { return window_; }
  std::string Describe() const;

  // Memory registration with this domain. `requested_key` is used unless the
  // provider picks keys itself. Fills `key` for the memory blob.
  int RegisterMr(void* addr, uint64_t len, fid_mr** mr, blob::MemKey* key, std::string* why);
  // A registration for local access only (bounce buffers).
  int RegisterLocal(void* addr, uint64_t len, fid_mr** mr, std::string* why);
  // fi_mr_reg with a random key of the domain's key size, retried on a clash;
  // returns the provider's answer.
  int RegWithFreshKey(void* addr, uint64_t len, uint64_t access, fid_mr** mr);
  // Where staged transfers get their stages, and this endpoint's index in Stage::mrs.
  void SetStaging(std::shared_ptr<StagePool> pool, size_t index);
  // Wakes the progress thread (a stage came back).
  void Wake() { Kick(); }
  // Deletes what RMAs the provider never completed (after CloseEp), releasing
  // their transfers and stages.
  void DropOps();
  // A remote key as it must go into RMAs; *mapped says fi_mr_unmap_key is due.
  int ImportKey(const blob::MemKey& k, uint64_t region_size, uint64_t* rkey, uint64_t* base,
                bool* mapped, std::string* why);
  void UnmapKey(uint64_t rkey);

  int InsertPeer(const std::string& key, const blob::EpInfo& info, std::shared_ptr<PeerEp>* out,
                 std::string* why);
  // Ends the peer's transfers with BAD_STATE (before returning) and forgets its address.
  void RemovePeer(const std::shared_ptr<PeerEp>& p);

  // Queues the transfer and posts what the window allows. Never fails: the
  // transfer is accepted and will be completed exactly once.
  void Post(const std::shared_ptr<Xfer>& x);

 private:
  struct Done {
    void* ctx;
    int status;
    std::string msg;
  };
  // One RMA. The context goes first: the provider uses it until the completion.
  struct Op {
    fi_context2 fctx;
    std::shared_ptr<Xfer> xfer;
    uint64_t len = 0;
    int slot = -1;  // a staged transfer's bounce buffer
  };
  // Work for the GPU thread: bind the stage (slot < 0) or copy a slot's piece.
  struct GpuJob {
    std::shared_ptr<Xfer> xfer;
    int slot = -1;
    bool to_device = false;
  };

  Endpoint(const ferry_host_v1* host, const Settings& s);
  bool OpenAll(const fi_info* info, std::string* why);
  void Main();
  bool Drain(std::vector<Done>* done);
  bool CounterMoved();
  // With mu_ held. Returns true when it posted something; adds the peers it
  // posted to (to ring) and sets *again on -FI_EAGAIN.
  bool PumpLocked(std::vector<Done>* done, bool* again,
                  std::vector<std::shared_ptr<PeerEp>>* posted_to);
  static void RingAll(const std::vector<std::shared_ptr<PeerEp>>& peers);
  // Posts one RMA; on success counts it. Returns the provider's answer.
  ssize_t PostRmaLocked(const std::shared_ptr<Xfer>& x, uint8_t* local, void* desc, uint64_t remote,
                        uint64_t n, int slot);
  // A staged transfer's share of PumpLocked; *blocked_peer on -FI_EAGAIN.
  bool PumpStagedLocked(const std::shared_ptr<Xfer>& x, bool* again, bool* blocked_peer,
                        std::vector<std::shared_ptr<PeerEp>>* posted_to);
  void QueueGpuLocked(GpuJob job);
  void GpuMain();
  bool IssueCopy(const GpuJob& j, std::string* why);
  bool WaitCopy(const GpuJob& j, std::string* why);
  void GpuJobDone(const GpuJob& j, bool ok, const std::string& why);
  void StopGpu();
  void FinishOpLocked(Op* op, int status, const std::string& msg, std::vector<Done>* done);
  void EndLocked(const std::shared_ptr<Xfer>& x, int status, const std::string& msg,
                 std::vector<Done>* done);
  void ExpireLocked(uint64_t now, std::vector<Done>* done);
  void Deliver(std::vector<Done>* done);
  void Kick();  // wakes the thread if it sleeps
  uint64_t Now() const { return host_->now_ns(host_->host_ctx); }

  const ferry_host_v1* host_;
  const Settings settings_;
  std::string provider_, domain_name_;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_cntr* cntr_ = nullptr;  // remote RMA events (activity) where there is no wait fd
  fid_ep* ep_ = nullptr;
  int cq_fd_ = -1;
  int event_fd_ = -1;                   // local posts wake a thread blocked on cq_fd_
  std::unique_ptr<Doorbell> doorbell_;  // ... or ring this one (polled providers)
  uint64_t last_cntr_ = 0;              // progress thread only
  std::vector<uint8_t> addr_;
  uint32_t addr_format_ = 0;
  uint64_t mr_mode_ = 0;
  uint64_t chunk_ = 0;
  uint32_t window_ = 0;     // per peer
  uint32_t ep_window_ = 0;  // per endpoint (tx queue)
  std::mutex key_mu_;
  std::random_device key_rng_;  // requested MR keys (without FI_MR_PROV_KEY)

  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<uint64_t> gen_{0};  // bumped by every post

  std::mutex mu_;
  std::deque<std::shared_ptr<Xfer>> queue_;  // transfers with RMAs not yet posted
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<Xfer>> active_;  // by deadline
  uint64_t seq_ = 0;
  uint32_t inflight_ = 0;
  std::unordered_set<Op*> ops_;  // every Op inside the provider (freed at close otherwise)
  std::vector<std::shared_ptr<PeerEp>> bell_peers_;  // peers with a doorbell (ring after serving)
  std::vector<Op*> free_ops_;
  bool stopped_ = false;

  // GPU staging: the pool, this endpoint's index in Stage::mrs, and the thread
  // that binds stages and issues and waits for copies (started on first use).
  std::shared_ptr<StagePool> pool_;
  size_t stage_index_ = 0;
  std::mutex gpu_mu_;
  std::condition_variable gpu_cv_;
  std::deque<GpuJob> gpu_jobs_;
  bool gpu_stop_ = false;
  std::thread gpu_thread_;  // started with mu_ held, joined by Stop
};

// The fi_info list for the base hints (RDM, RMA, delivery-complete), optionally
// for one provider. Caller frees with fi_freeinfo. nullptr and *why on failure.
fi_info* GetInfo(const char* provider, const char* node, bool rma_event, std::string* why);

}  // namespace ferry_ofi
