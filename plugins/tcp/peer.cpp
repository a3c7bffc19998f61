// SPDX-License-Identifier: Apache-2.0
#include "peer.h"

#include <algorithm>
#include <cstddef>

#include "deadline.h"
#include "hot_path.h"
#include "planner.h"
#include "wire.h"

namespace ferry_tcp {
namespace {

// Small enough to fit an idle socket's send buffer, so a direct send from the
// posting thread does not wait for the network (and post() does not copy much).
constexpr uint64_t kDirectSendMax = 64 * 1024;

}  // namespace

Peer::Peer(PeerInfo info, int lanes, uint64_t chunk_bytes, uint64_t gpu_chunk_bytes,
           DeadlineWatcher* watcher, std::atomic<uint64_t>* seqs)
    : info_(std::move(info)),
      chunk_bytes_(chunk_bytes),
      gpu_chunk_bytes_(gpu_chunk_bytes),
      watcher_(watcher),
      seqs_(seqs),
      next_seq_(seqs->load()) {
  for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>(&info_, i));
}

Peer::~Peer() { Stop(FERRY_ERR_BAD_STATE, "peer " + info_.key + " destroyed"); }

uint64_t Peer::PostedSoFar() {
  std::lock_guard lk(seq_mu_);
  return next_seq_;
}

void Peer::ResetLanes(int status, const std::string& msg, uint64_t keep_from) {
  // Every lane down before any frame is failed here. Frames in flight are
  // failed by their lane's sender as soon as its connection is down, which may
  // complete a transfer (and the application posts again) before the last lane
  // is aborted: what is posted meanwhile waits (reset_mu_) until every lane is
  // down, and what was posted after the reset began is not its to fail.
  Lane::Doomed doomed;
  {
    std::unique_lock resetting(reset_mu_);
    for (auto& l : lanes_) l->Abort(status, msg, &doomed, keep_from);
  }
  Lane::Fail(doomed);
}

void Peer::Stop(int status, const std::string& msg) {
  stopped_ = true;
  for (auto& l : lanes_) l->Stop(status, msg);
}

FERRY_HOT void Peer::Finished(const Xfer& x) {
  if (!x.notify) return;
  std::lock_guard lk(seq_mu_);
  notify_inflight_.erase(x.seq);
}

FERRY_HOT int Peer::Post(const ferry_xfer_v1& x, const std::shared_ptr<Region>& local,
                         uint64_t remote_id, uint64_t remote_key, bool remote_host,
                         std::string* why) {
  if (stopped_) {
    *why = "peer " + info_.key + " was removed";
    return FERRY_ERR_BAD_STATE;
  }
  if (x.op != FERRY_OP_READ && x.op != FERRY_OP_WRITE) {
    *why = "unknown op " + std::to_string(x.op);
    return FERRY_ERR_INVALID_ARGS;
  }
  if (x.n_iov == 0 || x.iov == nullptr) {
    *why = "transfer has no items";
    return FERRY_ERR_INVALID_ARGS;
  }
  if (local->revoked()) {
    *why = "local memory " + std::to_string(local->id()) + " is deregistered";
    return FERRY_ERR_NOT_FOUND;
  }
  // Local ranges are ours to guard: the socket calls touch them directly. Remote
  // ranges are the target's to check, so a bad one still goes on the wire.
  for (uint32_t i = 0; i < x.n_iov; ++i) {
    if (!local->Contains(x.iov[i].local_off, x.iov[i].len)) {
      *why =
          "item " + std::to_string(i) + " is outside local memory " + std::to_string(local->id());
      return FERRY_ERR_INVALID_ARGS;
    }
  }
  const uint64_t chunk = local->on_gpu() ? gpu_chunk_bytes_ : chunk_bytes_;
  // One item of more frames than lanes: each lane builds its frames as it
  // sends them (FrameRun), so post() costs the same at 64 MiB as at 4 MiB.
  // GPU memory keeps the planned frames (its staging is per frame anyway).
  const bool as_run = x.n_iov == 1 && !local->on_gpu() && x.iov[0].len > chunk * lanes_.size();
  std::vector<PlannedFrame> plan;
  uint64_t frames_needed;
  if (as_run) {
    frames_needed = (x.iov[0].len + chunk - 1) / chunk;
  } else {
    plan = PlanFrames(x.iov, x.n_iov, local->addr(), chunk, wire::kMaxItems);
    frames_needed = plan.size();
  }
  if (frames_needed == 0) {
    *why = "transfer has no bytes";
    return FERRY_ERR_INVALID_ARGS;
  }
  if (frames_needed > UINT32_MAX) {
    *why = "transfer too large";
    return FERRY_ERR_INVALID_ARGS;
  }
  const auto n_frames = static_cast<uint32_t>(frames_needed);

  auto xfer = std::make_shared<Xfer>();
  xfer->host = info_.host;
  xfer->ctx = x.xfer_ctx;
  xfer->op = x.op;
  xfer->notify = (x.flags & FERRY_XFER_NOTIFY) != 0;
  xfer->uid = x.uid;
  xfer->deadline_ns = x.deadline_ns;
  xfer->posted_ns = info_.host->now_ns(info_.host->host_ctx);
  xfer->peer = weak_from_this();
  xfer->watcher = watcher_;
  xfer->local = local;
  // Both ends' memory is the host's, and one frame: a lane that agreed to
  // direct copies may use them. A transfer of several frames stays on the
  // rings, whose lanes copy in parallel at both ends, where several target
  // threads copying from one process at once slow each other down (16-core
  // host: 1-64 MiB at 0.5-0.8 x the rings' rate; docs/benchmarks.md).
  xfer->direct_ok = remote_host && !local->on_gpu() && n_frames == 1;
  xfer->SetFrameCount(n_frames);

  // One frame: a lane whose sender polls right now takes it without a wake-up
  // (sender_spin_us); otherwise the lanes take turns.
  uint64_t first_lane = UINT64_MAX;
  if (n_frames == 1 && info_.sender_spin_us > 0) {
    for (size_t i = 0; i < lanes_.size() && first_lane == UINT64_MAX; ++i)
      if (lanes_[i]->SenderPolling()) first_lane = i;
  }
  if (first_lane == UINT64_MAX) first_lane = next_lane_.fetch_add(n_frames);
  const size_t used_lanes = std::min<size_t>(n_frames, lanes_.size());
  for (size_t i = 0; i < used_lanes; ++i) {
    lanes_[(first_lane + i) % lanes_.size()]->EnsureStarted();
  }

  const bool is_write = x.op == FERRY_OP_WRITE;
  // Made before the transfer is accepted: from then on nothing may throw.
  auto job = std::make_unique<Handover>();
  std::vector<FramePtr>& frames = job->frames;
  uint64_t low_seq;
  {
    std::lock_guard lk(seq_mu_);
    xfer->seq = seqs_->fetch_add(1);
    next_seq_ = xfer->seq + 1;
    if (xfer->notify) notify_inflight_.insert(xfer->seq);
    low_seq = notify_inflight_.empty() ? xfer->seq : std::min(*notify_inflight_.begin(), xfer->seq);
  }
  try {
    // What every frame of the transfer says; each adds its req_id, items and payload.
    wire::Header h;
    h.type = is_write ? wire::Type::kWrite : wire::Type::kRead;
    h.flags = xfer->notify ? wire::kFlagNotify : 0;
    h.frame_count = n_frames;
    h.region_id = remote_id;
    h.region_key = remote_key;
    h.xfer_seq = xfer->seq;
    h.uid = x.uid;
    h.low_seq = low_seq;
    h.attempt_id = x.struct_size >= offsetof(ferry_xfer_v1, attempt_id) + sizeof x.attempt_id
                       ? x.attempt_id
                       : 0;  // a core before ABI 1.2: no fences
    h.expires_ns = x.deadline_ns;
    if (as_run) {
      // One queue entry per lane: lane l sends frames l, l + lanes, ...
      auto run = std::make_shared<FrameRun>();
      run->xfer = xfer;
      run->head = h;
      run->local = local->addr() + x.iov[0].local_off;
      run->remote_off = x.iov[0].remote_off;
      run->len = x.iov[0].len;
      run->chunk = chunk;
      run->next_req = &next_req_;
      for (size_t l = 0; l < used_lanes; ++l) {
        auto entry = std::make_shared<Frame>();
        entry->xfer = xfer;
        entry->is_write = is_write;
        entry->run = run;
        entry->count = static_cast<uint32_t>((n_frames - l + used_lanes - 1) / used_lanes);
        entry->run_next = l;
        entry->run_stride = used_lanes;
        frames.push_back(std::move(entry));
      }
    } else {
      frames.reserve(n_frames);
      for (PlannedFrame& p : plan)
        frames.push_back(
            MakeFrame(xfer, h, next_req_.fetch_add(1), p.remote, std::move(p.local), p.bytes));
    }
    watcher_->Add(xfer);
  } catch (...) {
    Finished(*xfer);
    throw;
  }

  // Accepted: from here on every outcome goes through complete().
  // A READ request is a header and its items whatever the size it asks for, so
  // it may go out from here; a WRITE only when it is small. Only a transfer of
  // one frame: a larger one's frames are queued for the senders in one go per
  // lane, so post() does not pay a send per frame (a 64 MiB READ was 64 sends
  // from post(): 0.3-3.8 ms on loopback, where the kernel runs the receiver's
  // side inside each send).
  const bool is_read = x.op == FERRY_OP_READ;
  // A WRITE from GPU memory never goes out from here: staging it waits on copies.
  // With sender_spin_us the senders send everything: post() makes no system
  // call while a sender polls, and each send starts the sender's next poll.
  // One frame only: each direct send runs the target's side of loopback
  // inside it (7-10 us on the 16-core GPU host), so a 4-frame READ's post()
  // cost 28-42 us; its other lanes are kicked together instead (one wake-up).
  const bool direct = !as_run && info_.sender_spin_us == 0 && n_frames == 1 &&
                      (is_read || (plan[0].bytes <= kDirectSendMax && !local->on_gpu()));
  job->peer = shared_from_this();
  job->first_lane = first_lane;
  job->used_lanes = used_lanes;
  job->direct = direct;
  // With a post queue, a waiter's progress() or the flusher hands them over
  // (post_queue.h).
  if (info_.posts != nullptr) {
    info_.posts->Push(std::move(job));
  } else {
    Deliver(*job);
  }
  return FERRY_OK;
}

void Peer::Handover::Deliver() noexcept { peer->Deliver(*this); }

FERRY_HOT void Peer::Deliver(Handover& h) noexcept {
  std::vector<FramePtr>& frames = h.frames;
  const uint64_t first_lane = h.first_lane;
  const size_t used_lanes = h.used_lanes;
  const bool direct = h.direct;
  const size_t n_frames = frames.size();
  if (n_frames > 0 && frames[0]->xfer->failed()) {
    // Its deadline passed while it was queued: nothing of it goes out.
    int status = FERRY_OK;
    std::string msg;
    frames[0]->xfer->Error(&status, &msg);
    for (auto& f : frames) f->Resolve(status, msg);
    return;
  }
  std::shared_lock no_reset(reset_mu_);
  if (n_frames == 1 && frames[0]->run == nullptr) {
    FramePtr& f = frames[0];
    try {
      lanes_[first_lane % lanes_.size()]->Submit(f, direct);
    } catch (...) {
      f->Resolve(FERRY_ERR_NO_MEMORY, "out of memory queueing a frame to " + info_.label);
    }
    return;
  }
  // A run's entries are one per lane already, in lane order.
  std::vector<std::vector<FramePtr>> per_lane;
  try {
    per_lane.resize(used_lanes);
    for (size_t i = 0; i < frames.size(); ++i) per_lane[i % used_lanes].push_back(frames[i]);
  } catch (...) {
    for (auto& f : frames)
      f->Resolve(FERRY_ERR_NO_MEMORY, "out of memory queueing a frame to " + info_.label);
    return;
  }
  frames.clear();
  // The pool-served lanes' senders are kicked together once every lane has
  // its frames: one wake-up from post(), the pool wakes the rest.
  IoPool::Kicks kicks;
  IoPool::Kicks* batch = nullptr;
  if (info_.pool != nullptr) {
    try {
      kicks.reserve(used_lanes);
      batch = &kicks;
    } catch (...) {
      batch = nullptr;  // each lane kicks its own
    }
  }
  for (size_t l = 0; l < used_lanes; ++l) {
    try {
      lanes_[(first_lane + l) % lanes_.size()]->SubmitAll(per_lane[l], batch);
    } catch (...) {
      for (auto& f : per_lane[l]) {
        if (f) f->Resolve(FERRY_ERR_NO_MEMORY, "out of memory queueing a frame to " + info_.label);
      }
    }
  }
  if (batch != nullptr) info_.pool->KickAll(kicks);
}

}  // namespace ferry_tcp
