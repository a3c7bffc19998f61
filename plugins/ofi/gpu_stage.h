// SPDX-License-Identifier: Apache-2.0
// GPU memory on the initiator. An RDM endpoint cannot reach device memory
// without FI_HMEM, so a WRITE from a GPU region first copies its bytes
// device->host into a registered pinned bounce buffer and RMAs them from there;
// a READ into a GPU region RMAs into the bounce buffer, then copies host->device.
//
// A Stage is two bounce buffers ("slots") of gpu_stage_bytes each, registered
// (fi_mr_reg, local access only) with every opened domain once, plus a stream
// and an event per slot. A transfer cuts its items into pieces of at most one
// slot and alternates the slots, so the copy of one piece overlaps the RMAs of
// the other (endpoint.h runs the pipeline).
//
// Stages come from a StagePool that holds at most gpu_pinned_bytes of pinned
// memory. TryAcquire never blocks and makes no GPU call: it hands out an idle
// stage or reserves a new one within the cap, else nothing, and the transfer
// waits in the endpoint's queue (no thread waits) until a stage comes back.
// That cannot deadlock: only the initiator stages, and a stage is held by one
// transfer whose RMAs complete without anything of the peer's. Creating the
// buffers, registrations and stream (Bind) happens on the endpoint's GPU
// thread, never on the application's (the runtime's current device is
// per-thread state).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_ofi {

class Endpoint;

struct Stage {
  uint8_t* buf = nullptr;    // 2 * piece bytes, pinned; slot s starts at buf + s * piece
  std::vector<fid_mr*> mrs;  // one per endpoint (Instance order); null where none was needed
  void* stream = nullptr;
  void* event[2] = {nullptr, nullptr};
  int device = -1;  // the device stream and events belong to; -1 = not bound
};

class StagePool {
 public:
  StagePool(const ferry_host_v1* host, uint64_t piece_bytes, uint64_t pinned_cap);
  ~StagePool();  // Close()

  // The domains stages register with, and what to call when a stage comes back
  // (wakes endpoints whose transfers wait for one). Before first use.
  void SetEndpoints(std::vector<Endpoint*> eps, std::function<void()> on_return);
  uint64_t piece() const { return piece_; }
  uint64_t cap() const { return cap_; }
  uint64_t pinned_bytes() const;

  // Never blocks, no GPU call: an idle stage (preferably bound to `device`), a
  // new unbound one within the cap, or nullptr when the cap is reached.
  std::unique_ptr<Stage> TryAcquire(int device);
  // On a plugin thread: pins the buffers and registers them (first time), and
  // binds stream and events to `device`. False with *why.
  bool Bind(Stage* s, int device, std::string* why);
  void Return(std::unique_ptr<Stage> s);
  // Frees the idle stages (registrations before their domains close); stages
  // returned later are freed at once.
  void Close();

 private:
  void Free(Stage* s);
  void Unbind(Stage* s);

  const ferry_host_v1* host_;
  const ferry_gpu_v1* gpu_;
  const uint64_t piece_;
  const uint64_t cap_;
  std::vector<Endpoint*> eps_;
  std::function<void()> on_return_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Stage>> idle_;
  uint64_t pinned_ = 0;  // reserved by idle and leased stages
  bool closed_ = false;
};

// A stage a transfer holds; goes back to the pool when the transfer is destroyed.
class StageLease {
 public:
  StageLease() = default;
  StageLease(std::shared_ptr<StagePool> pool, std::unique_ptr<Stage> s)
      : pool_(std::move(pool)), stage_(std::move(s)) {}
  StageLease(StageLease&&) = default;
  StageLease& operator=(StageLease&& o) noexcept {
    Reset();
    pool_ = std::move(o.pool_);
    stage_ = std::move(o.stage_);
    return *this;
  }
  ~StageLease() { Reset(); }
  Stage* get() const { return stage_.get(); }
  explicit operator bool() const { return stage_ != nullptr; }
  StagePool* pool() const { return pool_.get(); }

 private:
  void Reset() {
    if (stage_) pool_->Return(std::move(stage_));
  }
  std::shared_ptr<StagePool> pool_;
  std::unique_ptr<Stage> stage_;
};

}  // namespace ferry_ofi
