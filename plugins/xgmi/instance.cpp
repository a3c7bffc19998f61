// SPDX-License-Identifier: Apache-2.0
#include "instance.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "cpu_relax.h"
#include "hot_path.h"
#include "process_tag.h"
#include "thread_name.h"

namespace ferry_xgmi {

using ferry::plugin_kit::TellRefusal;

std::unique_ptr<Instance> Instance::Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                           std::string* why) {
  if (!FERRY_HAS_FIELD(ferry_host_v1, a.host, gpu) || !a.host->gpu) {
    *code = FERRY_ERR_NO_DEVICE;
    *why = "no GPU runtime (libcudart / libamdhip64) or no GPU device";
    return nullptr;
  }
  nlohmann::json j;
  *code = FERRY_ERR_INVALID_ARGS;
  if (!ferry::plugin_kit::ParseObject(a.settings_json, "xgmi", &j, why)) return nullptr;
  // The core must understand FERRY_OK_NOTIFY_BY_CORE (ABI 1.8), which this
  // plugin reports for a notify transfer it could not tell the target of.
  if (!FERRY_HAS_FIELD(ferry_host_v1, a.host, ctrl_try_send) || !a.host->ctrl_try_send) {
    *code = FERRY_ERR_UNSUPPORTED;
    *why = "this xgmi needs a ferry core of plugin ABI 1.8 or later";
    return nullptr;
  }
  auto in = std::make_unique<Instance>(a.host);
  for (const auto& [key, v] : j.items()) {
    int64_t n = 0;
    if (key == "num_streams") {
      if (!ferry::plugin_kit::GetInt(v, "num_streams", 1, 64, &n, why)) return nullptr;
      in->streams_per_device_ = static_cast<int>(n);
    } else if (key == "batch_copy") {
      if (!ferry::plugin_kit::GetBool(v, "batch_copy", &in->batch_copy_, why)) return nullptr;
    } else if (key == "spin_us") {
      if (!ferry::plugin_kit::GetInt(v, "spin_us", 0, 100000, &n, why)) return nullptr;
      in->spin_ = std::chrono::microseconds(n);
    } else if (key == "idle_spin_us") {
      if (!ferry::plugin_kit::GetInt(v, "idle_spin_us", 0, 100000, &n, why)) return nullptr;
      in->idle_spin_ = std::chrono::microseconds(n);
    } else if (key == "hold_us") {
      if (!ferry::plugin_kit::GetInt(v, "hold_us", 0, 100000, &n, why)) return nullptr;
      in->hold_ = std::chrono::microseconds(n);
    } else if (key == "notify_by_event") {
      if (!ferry::plugin_kit::GetBool(v, "notify_by_event", &in->notify_by_event_, why))
        return nullptr;
    } else if (key == "waiter_drives") {
      if (!ferry::plugin_kit::GetBool(v, "waiter_drives", &in->waiter_drives_, why)) return nullptr;
    } else {
      *why = "unknown setting '" + key +
             "' (known: num_streams, batch_copy, spin_us, idle_spin_us, hold_us, notify_by_event, "
             "waiter_drives)";
      return nullptr;
    }
  }
  if (in->notify_by_event_) in->events_ = EventPool::Create(in->gpu_);
  in->inbound_ = std::make_unique<InboundWatch>(a.host, in->spin_);
  in->completer_ = ferry::named_thread("xgmi-compl", [raw = in.get()] { raw->CompleteLoop(); });
  return in;
}

Instance::Instance(const ferry_host_v1* host)
    : host_(host),
      gpu_(host->gpu),
      has_batch_(FERRY_HAS_FIELD(ferry_gpu_v1, gpu_, memcpy_batch_async) &&
                 gpu_->memcpy_batch_async != nullptr),
      has_stream_query_(FERRY_HAS_FIELD(ferry_gpu_v1, gpu_, stream_query) &&
                        gpu_->stream_query != nullptr),
      has_segments_(FERRY_HAS_FIELD(ferry_gpu_v1, gpu_, copy_segments_async) &&
                    gpu_->copy_segments_async != nullptr) {
  const size_t n = static_cast<size_t>(gpu_->device_count);
  streams_.resize(n);
  stream_copies_.resize(n);
  next_stream_.resize(n);
  free_events_.resize(n);
}

Instance::~Instance() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;  // the completion thread drains what is pending, then exits
  }
  cv_.notify_all();
  if (completer_.joinable()) completer_.join();
  SayFarewell(nullptr);  // every copy has ended: the peers not removed yet
  for (auto& [k, o] : opened_) gpu_->ipc_close(gpu_->gpu_ctx, o.base);
  for (size_t d = 0; d < streams_.size(); ++d) {
    for (void* s : streams_[d]) gpu_->stream_destroy(gpu_->gpu_ctx, s);
    for (void* e : free_events_[d]) gpu_->event_destroy(gpu_->gpu_ctx, e);
  }
}

void Instance::LogLine(int level, const std::string& m) const {
  ferry::plugin_kit::Log(host_, level, "%s", m.c_str());
}

int Instance::RefuseForGpu(const ferry_xfer_v1* x, const std::string& why) const {
  LogLine(FERRY_LOG_WARN, why);
  return ferry::plugin_kit::Refuse(x, FERRY_ERR_GPU, why);
}

namespace {
// Polls `done` until it is true or `until` passes; the first 100 us with the
// CPU's pause only (a sched_yield costs ~1 us, as much as the copy being
// waited for), then yielding between polls so a busy core is shared.
template <typename F>
bool poll_until(std::chrono::steady_clock::time_point until, F done) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    if (done()) return true;
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    if (now - start < std::chrono::microseconds(100))
      for (int i = 0; i < 16; ++i) cpu_relax();
    else
      std::this_thread::yield();
  }
}

uint64_t ns_between(std::chrono::steady_clock::time_point a,
                    std::chrono::steady_clock::time_point b) {
  return b > a ? static_cast<uint64_t>(std::chrono::nanoseconds(b - a).count()) : 0;
}

// One piece inside both regions. Without branches: MergePieces ORs it over a
// whole batch in its one pass.
bool Inside(const ferry_iov_v1& v, uint64_t lsize, uint64_t rsize) {
  return !((v.len == 0) | (v.local_off > lsize) | (v.len > lsize - v.local_off) |
           (v.remote_off > rsize) | (v.len > rsize - v.remote_off));
}

// Appends n pieces (iov, of a transfer with `op`) to dsts/srcs/sizes from
// index k on (there must be room for n more), merging a piece into the one before it - also one
// appended earlier - where both sides are contiguous; returns the new count. Writes by index:
// push_back's checks cost ~16 ns a piece on the H200 host (18 us for 1024 pieces), more than the
// batch call itself. It also checks every piece against the regions (lsize, rsize bytes) and sets
// *outside for one that is not inside both: a separate pass over a 4096-piece batch cost the GPU
// host about as much as the merge. Nothing may be launched then.
size_t MergePieces(uint32_t op, const ferry_iov_v1* iov, uint64_t n, char* lbase, uint64_t lsize,
                   char* rbase, uint64_t rsize, void** dsts, const void** srcs, size_t* sizes,
                   size_t k, bool* outside) {
  const bool write = op == FERRY_OP_WRITE;
  bool bad = false;
  for (uint64_t i = 0; i < n; ++i) {
    const ferry_iov_v1& v = iov[i];
    bad |= !Inside(v, lsize, rsize);
    char* l = lbase + v.local_off;
    char* r = rbase + v.remote_off;
    char* dst = write ? r : l;
    const char* src = write ? l : r;
    if (k > 0 && static_cast<char*>(dsts[k - 1]) + sizes[k - 1] == dst &&
        static_cast<const char*>(srcs[k - 1]) + sizes[k - 1] == src) {
      sizes[k - 1] += v.len;
      continue;
    }
    dsts[k] = dst;
    srcs[k] = src;
    sizes[k] = v.len;
    ++k;
  }
  *outside = bad;
  return k;
}
// Per-thread piece arrays that only grow (MergePieces writes by index), so a
// post allocates nothing once warm; room for at least n pieces.
struct Scratch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
};
Scratch& ScratchFor(size_t n) {
  thread_local Scratch s;
  if (s.sizes.size() < n) {
    s.dsts.resize(n);
    s.srcs.resize(n);
    s.sizes.resize(n);
  }
  return s;
}
}  // namespace

// Waits for the next pending copy. A post that comes soon after a completion
// (the next block of a request, the next layer) is seen by polling a counter,
// not through a condition variable's wake-up (5-20 us); only after idle_spin_
// without work does the thread block, so an idle engine costs no CPU.
bool Instance::NextPending(std::unique_lock<std::mutex>& lk) {
  for (;;) {
    // Held parts whose last part did not come (or fini): launched from here.
    if (!held_.parts.empty() && (stop_ || Clock::now() - held_.last >= hold_)) {
      ++held_by_timeout_;
      LaunchHeld(lk);
    }
    if (!pending_.empty() || (stop_ && held_.parts.empty())) break;
    if (!held_.parts.empty()) {
      // Asleep for post() too: the last part's launch must wake this thread
      // to watch it (else its completion waited for the rest of hold_us
      // wherever no waiter's progress() reports it).
      completer_sleeping_ = true;
      cv_.wait_until(lk, held_.last + hold_);
      completer_sleeping_ = false;
      continue;
    }
    if (!stop_ && idle_spin_.count() > 0) {
      lk.unlock();
      poll_until(Clock::now() + idle_spin_,
                 [&] { return pending_count_.load(std::memory_order_acquire) != 0; });
      lk.lock();
      if (!pending_.empty() || !held_.parts.empty() || stop_) continue;
    }
    ++stages_.sleeps;
    completer_sleeping_ = true;
    cv_.wait(lk, [&] { return stop_ || !pending_.empty() || !held_.parts.empty(); });
    completer_sleeping_ = false;
  }
  return !pending_.empty();  // empty here: stop requested and nothing left
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
// A waiter that ran progress() this recently is polling the events itself.
constexpr int64_t kWaiterActiveNs = 20000;

FERRY_HOT bool Instance::WaiterActive() const {
  return waiters_inside_.load(std::memory_order_acquire) > 0 ||
         now_ns() - driven_at_ns_.load(std::memory_order_relaxed) < kWaiterActiveNs;
}

// Poll briefly (a copy of a few MiB ends within microseconds and a sleeping
// thread's wake-up costs tens of them), then block: events are created with
// blocking sync, so a slow wait does not burn a core. Spin for the copy's
// expected duration (at ~300 GB/s) plus spin_us, so a large copy is not waited
// for through a sleep/wake-up cycle. Ends early (kTaken) when a waiter's
// progress() reported p; leaves the event to a waiter that is polling it.
FERRY_HOT int Instance::WaitCopies(const Pending& p) {
  int rc = 1;
  auto expected = std::chrono::nanoseconds(p.bytes / 300);
  auto seen = [&] {
    if (front_seq_.load(std::memory_order_acquire) != p.seq) {
      rc = kTaken;
      return true;
    }
    if (waiter_drives_ && WaiterActive()) return false;
    if (to_send_.load(std::memory_order_acquire) != 0) {
      rc = kSendFirst;
      return true;
    }
    if (now_ns() - driven_at_ns_.load(std::memory_order_relaxed) < kWaiterActiveNs) return false;
    return (rc = QueryCopies(p)) != 1;
  };
  if (poll_until(Clock::now() + spin_ + expected, seen)) return rc;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stages_.event_blocks;
  }
  // (A stream that another copy joined meanwhile is waited for with it: the
  // same answer, later.)
  return p.event ? gpu_->event_sync(gpu_->gpu_ctx, p.event)
                 : gpu_->stream_sync(gpu_->gpu_ctx, p.stream);
}

FERRY_HOT int Instance::QueryCopies(const Pending& p) {
  if (p.event) return gpu_->event_query(gpu_->gpu_ctx, p.event);
  // No event: a copy alone on its stream (only where stream_query exists) or
  // a failed launch's stream, which a runtime without the query is waited on.
  if (has_stream_query_) return gpu_->stream_query(gpu_->gpu_ctx, p.stream);
  return gpu_->stream_sync(gpu_->gpu_ctx, p.stream);
}

FERRY_HOT void Instance::PublishFrontLocked() {
  pending_count_.store(pending_.size(), std::memory_order_release);
  front_seq_.store(pending_.empty() ? 0 : pending_.front().seq, std::memory_order_release);
}

FERRY_HOT bool Instance::Report(std::unique_lock<std::mutex>& lk, const Pending& p, int rc,
                                Clock::time_point watched, Clock::time_point done, bool by_waiter) {
  if (pending_.empty() || pending_.front().seq != p.seq) return false;
  // Its target is told before the transfer is reported (the core takes a
  // plain FERRY_OK to mean the plugin told it) - unless the copy failed.
  if (pending_.front().tell == kTellToSend) {
    if (rc == FERRY_OK && pending_.front().fail_rc == FERRY_OK) {
      SendTellLocked(lk, 0);
    } else {
      pending_.front().tell = kTellNone;
      to_send_.fetch_sub(1, std::memory_order_relaxed);
    }
  }
  if (pending_.front().tell == kTellSending) return false;  // another thread's send: later
  const uint8_t tell = pending_.front().tell;
  pending_.pop_front();
  PublishFrontLocked();
  const auto d = static_cast<size_t>(p.device);
  if (p.slot >= 0)
    events_->Give(static_cast<uint32_t>(p.slot));
  else if (p.event && p.owns_event)
    free_events_[d].push_back(p.event);
  --stream_copies_[d][p.stream_index];
  --p.peer->inflight;
  std::string why = rc == FERRY_OK ? std::string() : "GPU copy failed: " + GpuError();
  if (rc == FERRY_OK && p.fail_rc != FERRY_OK) {
    rc = p.fail_rc;
    why = "launching the copies failed (what was launched has ended)";
  }
  // A multi-pair transfer over several devices: one entry per device, in a
  // row; only the last reports, with the first failure of any of them.
  if (p.xfer_ctx == nullptr) {
    if (rc != FERRY_OK && group_rc_ == FERRY_OK) {
      group_rc_ = rc;
      group_why_ = why;
    }
    drained_.notify_all();
    return true;
  }
  if (group_rc_ != FERRY_OK) {
    if (rc == FERRY_OK) {
      rc = group_rc_;
      why = group_why_;
    }
    group_rc_ = FERRY_OK;
  }
  // Told by its event and landed: listed in the farewell to its target.
  if (rc == FERRY_OK && p.slot >= 0 && tell == kTellNone) {
    if (told_.size() >= kToldKept) told_.pop_front();
    told_.push_back({p.peer, p.uid});
  }
  lk.unlock();
  const int status = rc != FERRY_OK        ? FERRY_ERR_GPU
                     : tell == kTellByCore ? FERRY_OK_NOTIFY_BY_CORE
                                           : FERRY_OK;
  if (status == FERRY_OK_NOTIFY_BY_CORE) ++notified_by_core_;
  host_->complete(host_->host_ctx, p.xfer_ctx, status, why.empty() ? nullptr : why.c_str());
  const auto reported = Clock::now();
  lk.lock();
  ++stages_.transfers;
  stages_.by_waiter += by_waiter;
  stages_.pickup_ns += ns_between(p.posted, watched);
  stages_.gpu_ns += ns_between(watched, done);
  stages_.complete_ns += ns_between(done, reported);
  drained_.notify_all();
  return true;
}

void Instance::CompleteLoop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (NextPending(lk)) {
    // Messages first: they leave while their copies run. A waiter that is
    // polling sends them itself (Progress).
    if (!waiter_drives_ || !WaiterActive()) SendTellsLocked(lk);
    const Pending p = pending_.front();
    lk.unlock();
    const auto watched = Clock::now();
    const int rc = WaitCopies(p);
    const auto done = Clock::now();
    lk.lock();
    if (rc != kTaken && rc != kSendFirst) Report(lk, p, rc, watched, done, false);
  }
}

void Instance::SendTellsLocked(std::unique_lock<std::mutex>& lk) {
  for (size_t i = 0; to_send_.load(std::memory_order_relaxed) != 0 && i < pending_.size(); ++i)
    if (pending_[i].tell == kTellToSend) SendTellLocked(lk, i);
}

void Instance::SendTellLocked(std::unique_lock<std::mutex>& lk, size_t i) {
  Pending& e = pending_[i];
  e.tell = kTellSending;
  to_send_.fetch_sub(1, std::memory_order_relaxed);
  const uint64_t seq = e.seq, uid = e.uid;
  const int64_t slot = e.slot;
  const Peer* peer = e.peer;  // lives while the entry does (peer_remove waits for it)
  lk.unlock();
  const auto t0 = Clock::now();
  const bool sent = SendAfterEvent(*peer, uid, slot);
  const uint64_t took = ns_between(t0, Clock::now());
  lk.lock();
  // Its own counters, not a stage: a send runs on the completion thread
  // while the copy runs, or inside a report; a slow one shows here.
  stages_.tell_ns += took;
  stages_.tells_over_10us += took > 10'000;
  // Still pending: nobody reports an entry that is being sent.
  for (Pending& q : pending_)
    if (q.seq == seq) {
      q.tell = sent ? kTellNone : kTellByCore;
      break;
    }
}

FERRY_HOT void Instance::PushPendingLocked(Pending p, bool notify, bool by_event) {
  p.tell = !notify ? kTellNone : by_event ? kTellToSend : kTellByCore;
  pending_.push_back(p);
  // Counted once it is there (a push that throws leaves no count behind).
  if (p.tell == kTellToSend) to_send_.fetch_add(1, std::memory_order_relaxed);
}

// A waiting thread's turn: report, in order, the front copies that are done.
// Never waits for mu_ (post() and the completion thread hold it briefly).
FERRY_HOT int Instance::Progress() {
  driven_at_ns_.store(now_ns(), std::memory_order_relaxed);
  if (pending_count_.load(std::memory_order_acquire) == 0) return 0;
  // With waiter_drives, inside: the completion thread keeps off the runtime
  // and the messages until this returns (and kWaiterActiveNs after). Without
  // it nobody reads the mark, so none is made.
  struct Inside {
    Instance* in;
    explicit Inside(Instance* i) : in(i) {
      if (in) in->waiters_inside_.fetch_add(1);
    }
    ~Inside() {
      if (!in) return;
      in->driven_at_ns_.store(now_ns(), std::memory_order_relaxed);
      in->waiters_inside_.fetch_sub(1);
    }
  } inside(waiter_drives_ ? this : nullptr);
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (!lk.owns_lock()) return 0;
  int reported = 0;
  while (!pending_.empty()) {
    // Messages first, while their copies run (the completion thread leaves
    // them to a polling waiter).
    if (waiter_drives_) SendTellsLocked(lk);
    if (pending_.empty()) break;
    const Pending p = pending_.front();
    // Only a blocking stream_sync would tell (no event, no stream_query): the
    // completion thread's to do, not the waiting thread's, which progress()
    // must not hold up.
    if (!p.event && !has_stream_query_) break;
    lk.unlock();
    const int rc = QueryCopies(p);
    const auto done = Clock::now();
    lk.lock();
    if (rc == 1) break;  // not finished (or p was reported and its event reused: next time)
    // Its message is being sent by the completion thread: wait for that
    // (microseconds) rather than return and let the waiter sleep.
    auto being_sent = [&] {
      return !pending_.empty() && pending_.front().seq == p.seq &&
             pending_.front().tell == kTellSending;
    };
    if (being_sent()) {
      ++stages_.tell_waits;
      do {
        lk.unlock();
        for (int i = 0; i < 16; ++i) cpu_relax();
        lk.lock();
      } while (being_sent());
    }
    if (Report(lk, p, rc, p.posted, done, true)) ++reported;
  }
  return reported;
}

int Instance::ConnInfo(void* buf, size_t* len) {
  if (*len < 1) return FERRY_ERR_INVALID_ARGS;
  static_cast<uint8_t*>(buf)[0] = kBlobVersion;
  *len = 1;
  return FERRY_OK;
}

int Instance::PeerAdd(const ferry_peer_v1* p, void** h) {
  if (!FERRY_HAS_FIELD(ferry_peer_v1, p, conn_blob_len) || p->key == nullptr)
    return FERRY_ERR_INVALID_ARGS;
  if (!p->same_host) return FERRY_ERR_UNSUPPORTED;  // IPC handles only open on the same host
  // One byte, the version; longer from a later xgmi that appends to it.
  const auto* blob = static_cast<const uint8_t*>(p->conn_blob);
  if (p->conn_blob_len < 1 || blob == nullptr || blob[0] != kBlobVersion)
    return FERRY_ERR_INVALID_ARGS;
  *h = new Peer{p->key};
  return FERRY_OK;
}

void Instance::PeerRemove(void* h) {
  auto* peer = static_cast<Peer*>(h);
  if (peer == nullptr) return;
  {
    std::unique_lock<std::mutex> lk(mu_);
    drained_.wait(lk, [&] { return peer->inflight == 0; });  // GPU copies always finish
  }
  SayFarewell(peer);
  delete peer;
}

void Instance::SayFarewell(const Peer* only) {
  std::map<const Peer*, std::vector<uint64_t>> landed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    std::deque<Told> kept;
    for (const Told& t : told_) {
      if (only == nullptr || t.peer == only)
        landed[t.peer].push_back(t.uid);
      else
        kept.push_back(t);
    }
    told_.swap(kept);
  }
  // ctrl_try_send never waits: peer_remove and fini are not held up by a
  // peer that does not read (its targets then rely on their events alone).
  for (const auto& [peer, uids] : landed)
    for (size_t at = 0; at < uids.size(); at += LandedHeader::kMaxUids) {
      const auto n =
          static_cast<uint32_t>(std::min<size_t>(LandedHeader::kMaxUids, uids.size() - at));
      const auto msg = EncodeLanded(uids.data() + at, n);
      if (host_->ctrl_try_send(host_->host_ctx, peer->key.c_str(), msg.data(), msg.size()) ==
          FERRY_OK)
        farewell_sent_ += n;
    }
}

int Instance::MemRegister(const ferry_mem_v1* m, void** h, void* blob, size_t* len) {
  if (!FERRY_HAS_FIELD(ferry_mem_v1, m, device)) return FERRY_ERR_INVALID_ARGS;
  if (m->location != FERRY_MEM_GPU) return FERRY_ERR_UNSUPPORTED;
  void* base = nullptr;
  size_t alloc_size = 0;
  MemBlob b;
  if (gpu_->mem_range(gpu_->gpu_ctx, m->addr, &base, &alloc_size) != FERRY_OK ||
      gpu_->ipc_get_handle(gpu_->gpu_ctx, base, b.handle) != FERRY_OK) {
    LogLine(FERRY_LOG_WARN, "cannot export memory: " + GpuError());
    return FERRY_ERR_GPU;
  }
  b.device = m->device;
  b.process = ProcessTag();
  b.region_id = m->id;
  b.addr = reinterpret_cast<uint64_t>(m->addr);
  b.size = m->size;
  b.offset = b.addr - reinterpret_cast<uint64_t>(base);
  // One allocation: the importer maps exactly that one (IPC), so a region
  // running past it would be copied past the mapping - an illegal address
  // that breaks the importer's context, not an error here. (A runtime that
  // does not know the size says 0.)
  if (alloc_size != 0 && (b.offset > alloc_size || m->size > alloc_size - b.offset)) {
    LogLine(FERRY_LOG_WARN, "cannot export memory: " + std::to_string(m->size) + " bytes at " +
                                std::to_string(b.offset) + " into an allocation of " +
                                std::to_string(alloc_size) +
                                " (a region must lie within one GPU allocation)");
    return FERRY_ERR_INVALID_ARGS;
  }
  // Whoever imports this region may name its notify transfers' events to us.
  if (FERRY_HAS_FIELD(ferry_gpu_v1, gpu_, ipc_event_open) && gpu_->ipc_event_open != nullptr)
    b.flags |= kMemWatchesEvents;
  if (*len < sizeof b) return FERRY_ERR_NO_MEMORY;
  std::memcpy(blob, &b, sizeof b);
  *len = sizeof b;
  *h = new Local{static_cast<char*>(m->addr), m->size, m->device};
  return FERRY_OK;
}

void Instance::MemDeregister(void* h) { delete static_cast<Local*>(h); }

int Instance::MemImport(void*, uint64_t id, uint64_t size, const void* blob, size_t len, void** h) {
  MemBlob b;
  if (blob == nullptr || !decode(blob, len, &b) || b.region_id != id || b.size != size)
    return FERRY_ERR_INVALID_ARGS;
  *h = new Remote{b, b.process == ProcessTag(), {}};
  return FERRY_OK;
}

void Instance::MemRelease(void* h) {
  std::unique_ptr<Remote> r(static_cast<Remote*>(h));
  if (!r) return;
  // The core releases an import after its peer was removed, and peer_remove
  // waited for that peer's copies: no copy uses the mapping now. A mapping no
  // import uses is closed, or the exporter's allocation would stay mapped here
  // (and its memory held) after it freed it, or exited, for as long as this
  // engine lives.
  std::vector<char*> unused;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t d = 0; d < r->base.size(); ++d) {
      if (r->base[d] == nullptr) continue;
      auto it = opened_.find(
          {std::string(reinterpret_cast<const char*>(r->blob.handle), 64), static_cast<int>(d)});
      if (it == opened_.end() || --it->second.refs > 0) continue;
      unused.push_back(it->second.base);
      opened_.erase(it);
    }
  }
  for (char* base : unused) gpu_->ipc_close(gpu_->gpu_ctx, base);
}

FERRY_HOT char* Instance::RemoteBase(Remote& r, int device, std::string* why) {
  if (r.same_process) return reinterpret_cast<char*>(r.blob.addr);
  const auto d = static_cast<size_t>(device);
  if (d < r.base.size() && r.base[d] != nullptr) return r.base[d];
  std::pair<std::string, int> key(std::string(reinterpret_cast<const char*>(r.blob.handle), 64),
                                  device);
  auto it = opened_.find(key);
  if (it == opened_.end()) {
    void* p = nullptr;
    if (gpu_->ipc_open(gpu_->gpu_ctx, r.blob.handle, device, &p) != FERRY_OK) {
      *why = "cannot open the peer's IPC handle on device " + std::to_string(device) + ": " +
             GpuError();
      return nullptr;
    }
    it = opened_.emplace(key, Opened{static_cast<char*>(p), 0}).first;
  }
  ++it->second.refs;  // imports that use this mapping (closed when the last is released)
  if (r.base.size() <= d) r.base.resize(d + 1, nullptr);
  r.base[d] = it->second.base + r.blob.offset;
  return r.base[d];
}

// The copies of one transfer on `stream`: pieces contiguous on both sides are
// merged, then one batched call (a gather launch for many small pieces) or
// one copy per piece. The vectors are per thread, so a post allocates nothing
// once warm.
FERRY_HOT int Instance::Enqueue(const ferry_xfer_v1* x, const Local& local, char* rbase,
                                uint64_t rsize, void* stream, Clock::time_point* merged) {
  const bool write = x->op == FERRY_OP_WRITE;
  if (x->n_iov == 1) {
    // Through the batch call too, so the benches' --method gather can send a
    // single block through the kernel; AUTO copies it with the runtime's copy
    // (faster for one piece: docs/benchmarks.md).
    const ferry_iov_v1& v = x->iov[0];
    char* l = local.addr + v.local_off;
    char* r = rbase + v.remote_off;
    void* dst = write ? r : l;
    const void* src = write ? l : r;
    const size_t n = v.len;
    int rc = batch_copy_ && has_batch_
                 ? gpu_->memcpy_batch_async(gpu_->gpu_ctx, &dst, &src, &n, 1, stream)
                 : FERRY_ERR_UNSUPPORTED;
    if (rc != FERRY_ERR_UNSUPPORTED) return rc;
    return gpu_->memcpy_async(gpu_->gpu_ctx, dst, src, n, stream);
  }
  const ferry_gpu_seg_v1 seg{local.addr, local.size, rbase, rsize, x->iov, x->n_iov};
  if (int rc = CopySegments(x->op, &seg, 1, stream); rc != FERRY_ERR_UNSUPPORTED) {
    *merged = Clock::now();
    return rc;
  }
  Scratch& sc = ScratchFor(x->n_iov);
  bool outside = false;
  const size_t k = MergePieces(x->op, x->iov, x->n_iov, local.addr, local.size, rbase, rsize,
                               sc.dsts.data(), sc.srcs.data(), sc.sizes.data(), 0, &outside);
  *merged = Clock::now();
  if (outside) return kPieceOutside;
  return CopyPieces(sc.dsts.data(), sc.srcs.data(), sc.sizes.data(), k, stream);
}

FERRY_HOT int Instance::CopySegments(uint32_t op, const ferry_gpu_seg_v1* segs, size_t n,
                                     void* stream) {
  if (!has_segments_ || !batch_copy_) return FERRY_ERR_UNSUPPORTED;
  const int rc = gpu_->copy_segments_async(gpu_->gpu_ctx, op, segs, n, stream);
  return rc == FERRY_ERR_INVALID_ARGS ? kPieceOutside : rc;
}

int Instance::CopyPieces(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t k,
                         void* stream) {
  int rc = FERRY_ERR_UNSUPPORTED;
  if (k > 1 && batch_copy_ && has_batch_)
    rc = gpu_->memcpy_batch_async(gpu_->gpu_ctx, dsts, srcs, sizes, k, stream);
  if (rc != FERRY_ERR_UNSUPPORTED) return rc;
  rc = FERRY_OK;
  for (size_t i = 0; i < k && rc == FERRY_OK; ++i)
    rc = gpu_->memcpy_async(gpu_->gpu_ctx, dsts[i], srcs[i], sizes[i], stream);
  return rc;
}

FERRY_HOT int Instance::ChooseStreamLocked(int dev, size_t* si_out, void** event_out) {
  const auto d = static_cast<size_t>(dev);
  auto& pool = streams_[d];
  auto& copies = stream_copies_[d];
  // An idle stream, a new one while fewer than num_streams, else round robin.
  size_t si = std::find(copies.begin(), copies.end(), 0) - copies.begin();
  if (si == pool.size() && pool.size() < static_cast<size_t>(streams_per_device_)) {
    void* s = nullptr;
    if (gpu_->stream_create(gpu_->gpu_ctx, &s) != FERRY_OK) return FERRY_ERR_GPU;
    pool.push_back(s);
    copies.push_back(0);
  }
  if (si == pool.size()) si = next_stream_[d]++ % pool.size();
  // Alone on its stream: querying the stream says when it is done, no event
  // needed. (A copy queued behind it later makes that answer come later only:
  // beyond num_streams copies in flight.)
  const bool alone = copies[si] == 0 && has_stream_query_;
  void* event = nullptr;
  auto& evs = free_events_[d];
  if (!alone && !evs.empty()) {
    event = evs.back();
    evs.pop_back();
  } else if (!alone && gpu_->event_create(gpu_->gpu_ctx, &event) != FERRY_OK) {
    return FERRY_ERR_GPU;
  }
  *si_out = si;
  *event_out = event;
  return FERRY_OK;
}

FERRY_HOT void Instance::ReleaseStreamLocked(int dev, size_t si, void* event, int64_t slot) {
  const auto d = static_cast<size_t>(dev);
  if (slot >= 0)
    events_->Give(static_cast<uint32_t>(slot));
  else if (event)
    free_events_[d].push_back(event);
  --stream_copies_[d][si];
}

FERRY_HOT void* Instance::EventForLocked(int dev, void* event, int rc, int64_t* slot) {
  if (rc == FERRY_OK || event == nullptr) return event;
  if (slot != nullptr && *slot >= 0) {
    events_->Give(static_cast<uint32_t>(*slot));
    *slot = -1;
  } else {
    free_events_[static_cast<size_t>(dev)].push_back(event);
  }
  return nullptr;
}

FERRY_HOT int64_t Instance::TakeNotifySlotLocked(const ferry_xfer_v1* x, const Remote& remote,
                                                 int dev, void** event) {
  uint32_t slot = 0;
  if (!(x->flags & FERRY_XFER_NOTIFY) || !events_ || !(remote.blob.flags & kMemWatchesEvents) ||
      !events_->Take(dev, &slot))
    return -1;
  if (*event) free_events_[static_cast<size_t>(dev)].push_back(*event);
  *event = events_->Event(slot);
  return slot;
}

bool Instance::SendAfterEvent(const Peer& peer, uint64_t uid, int64_t slot) {
  AfterEventMsg m;
  m.slot = static_cast<uint32_t>(slot);
  m.uid = uid;
  m.process = ProcessTag();
  m.pool_id = events_->id();
  const bool sent =
      events_->Handle(m.slot, m.handle) &&
      host_->ctrl_try_send(host_->host_ctx, peer.key.c_str(), &m, sizeof m) == FERRY_OK;
  if (sent) ++notified_by_event_;
  return sent;
}

void Instance::OnCtrl(const char* peer_key, const void* msg, size_t len) {
  inbound_->OnMessage(peer_key, msg, len);
}

bool Instance::HoldLocked(const ferry_xfer_v1* x, const Local& local, char* rbase, uint64_t rsize) {
  Held& h = held_;
  if (h.sizes.size() < h.pieces + x->n_iov) {
    const size_t n = std::max(h.pieces + x->n_iov, 2 * h.sizes.size());
    h.dsts.resize(n);
    h.srcs.resize(n);
    h.sizes.resize(n);
  }
  // A refused part leaves what is held as it was (its first piece may have
  // been merged into the last one held).
  const size_t before = h.pieces;
  const size_t last_size = before > 0 ? h.sizes[before - 1] : 0;
  bool outside = false;
  const size_t k = MergePieces(x->op, x->iov, x->n_iov, local.addr, local.size, rbase, rsize,
                               h.dsts.data(), h.srcs.data(), h.sizes.data(), before, &outside);
  if (outside) {
    if (before > 0) h.sizes[before - 1] = last_size;
    return false;
  }
  h.pieces = k;
  h.parts.push_back(
      {x->xfer_ctx, static_cast<Peer*>(x->peer), (x->flags & FERRY_XFER_NOTIFY) != 0, x->uid});
  h.bytes += x->total_bytes;
  h.last = Clock::now();
  return true;
}

int Instance::LaunchHeld(std::unique_lock<std::mutex>& lk) {
  Held h;
  std::swap(h, held_);
  held_.parts.reserve(h.parts.capacity());
  const int dev = h.device;
  const auto d = static_cast<size_t>(dev);
  size_t si = 0;
  void* event = nullptr;
  int rc = gpu_->set_device(gpu_->gpu_ctx, dev);
  if (rc == FERRY_OK) rc = ChooseStreamLocked(dev, &si, &event);
  // Several parts share one stream and one event: each is a copy pending on it.
  if (rc == FERRY_OK) stream_copies_[d][si] += static_cast<int>(h.parts.size());
  void* stream = rc == FERRY_OK ? streams_[d][si] : nullptr;
  lk.unlock();
  if (rc == FERRY_OK) {
    rc = CopyPieces(h.dsts.data(), h.srcs.data(), h.sizes.data(), h.pieces, stream);
    if (rc == FERRY_OK && event) rc = gpu_->event_record(gpu_->gpu_ctx, event, stream);
  }
  const auto recorded = Clock::now();
  if (rc != FERRY_OK) {
    const std::string why =
        (stream ? "GPU copy failed: " : "no GPU stream for the copies: ") + GpuError();
    LogLine(FERRY_LOG_WARN, "launching " + std::to_string(h.parts.size()) + " held parts: " + why);
    if (stream == nullptr) {  // nothing was launched: fail them now
      for (const HeldPart& p : h.parts)
        host_->complete(host_->host_ctx, p.xfer_ctx, FERRY_ERR_GPU, why.c_str());
      lk.lock();
      for (const HeldPart& p : h.parts) --p.peer->inflight;
      drained_.notify_all();
      return FERRY_ERR_GPU;
    }
  }
  lk.lock();
  // Some copies may be queued before the call that failed: the parts fail
  // once the stream has run them (as Post does).
  event = EventForLocked(dev, event, rc);
  // The next call's pieces go into these arrays again, already as large.
  if (held_.parts.empty() && held_.sizes.size() < h.sizes.size()) {
    std::swap(held_.dsts, h.dsts);
    std::swap(held_.srcs, h.srcs);
    std::swap(held_.sizes, h.sizes);
  }
  for (size_t i = 0; i < h.parts.size(); ++i) {
    PushPendingLocked(
        {next_seq_++, event, stream, si, dev, h.parts[i].xfer_ctx, h.parts[i].peer, h.bytes,
         recorded, i + 1 == h.parts.size(), rc, -1, kTellNone, h.parts[i].uid},
        h.parts[i].notify, false);
  }
  PublishFrontLocked();
  ++held_launches_;
  held_parts_ += h.parts.size();
  if (completer_sleeping_) cv_.notify_one();
  return rc == FERRY_OK ? FERRY_OK : FERRY_ERR_GPU;
}

FERRY_HOT void Instance::Posted(std::unique_lock<std::mutex>& lk, const PostTimes& t) {
  PublishFrontLocked();
  stages_.post_ns += ns_between(t.entered, t.recorded);
  stages_.setup_ns += ns_between(t.entered, t.ready);
  stages_.enqueue_ns += ns_between(t.ready, t.enqueued);
  stages_.merge_ns += ns_between(t.ready, t.merged);
  const bool wake = completer_sleeping_;
  lk.unlock();
  if (wake) cv_.notify_one();
}

// ABI 1.7: the items of several region pairs in one post - a KV request's
// every layer. The pieces of all pairs whose local memory is on one device are
// merged into one table and launched as one batch call (one launch for the
// request where an engine has one GPU); pairs on several devices are one
// launch per device, reported as one transfer when the last is done. Every
// piece is checked against its own pair's regions before anything launches.
int Instance::PostPairs(const ferry_xfer_v1* x) {
  auto* peer = static_cast<Peer*>(x->peer);
  if (peer == nullptr || x->pairs == nullptr || x->iov == nullptr || x->n_iov == 0 ||
      (x->op != FERRY_OP_READ && x->op != FERRY_OP_WRITE)) {
    TellRefusal(x, "missing handle, no pieces or unknown op");
    return FERRY_ERR_INVALID_ARGS;
  }
  struct Seg {
    const Local* local;
    char* rbase;
    uint64_t rsize;
    const ferry_iov_v1* iov;
    uint64_t n;
  };
  thread_local std::vector<Seg> segs;
  thread_local std::vector<int> devices;  // in order of first use
  segs.clear();
  devices.clear();
  uint64_t at = 0;
  for (uint32_t i = 0; i < x->n_pairs; ++i) {
    const ferry_pair_v1& pr = x->pairs[i];
    const auto* local = static_cast<const Local*>(pr.local_mem);
    if (local == nullptr || pr.remote_mem == nullptr || pr.n_iov == 0 || pr.n_iov > x->n_iov - at) {
      TellRefusal(x, "a region pair without handles or items, or more items than the transfer");
      return FERRY_ERR_INVALID_ARGS;
    }
    segs.push_back(
        {local, nullptr, static_cast<Remote*>(pr.remote_mem)->blob.size, x->iov + at, pr.n_iov});
    if (std::find(devices.begin(), devices.end(), local->device) == devices.end())
      devices.push_back(local->device);
    at += pr.n_iov;
  }
  if (at != x->n_iov) {
    TellRefusal(x, "the pairs' item counts do not add up to the transfer's");
    return FERRY_ERR_INVALID_ARGS;
  }
  const auto entered = Clock::now();
  struct Launch {
    int device;
    size_t si;
    void* event;
    void* stream;
    size_t first, k;    // its merged pieces
    int64_t slot = -1;  // an interprocess event (notify, one launch): events_'s slot
  };
  thread_local std::vector<Launch> launches;
  launches.clear();
  std::unique_lock<std::mutex> lk(mu_);
  for (size_t i = 0; i < segs.size(); ++i) {
    std::string why;
    segs[i].rbase =
        RemoteBase(*static_cast<Remote*>(x->pairs[i].remote_mem), segs[i].local->device, &why);
    if (!segs[i].rbase) {
      lk.unlock();
      return RefuseForGpu(x, why);
    }
  }
  // Parts held for a launch go first: they were posted before this.
  while (!held_.parts.empty()) LaunchHeld(lk);
  // A stream per device; a launch that never runs gives it back (mu_ held).
  auto give_back = [&](const Launch& l) { ReleaseStreamLocked(l.device, l.si, l.event, l.slot); };
  for (int dev : devices) {
    Launch l{dev, 0, nullptr, nullptr, 0, 0, -1};
    if (gpu_->set_device(gpu_->gpu_ctx, dev) != FERRY_OK ||
        ChooseStreamLocked(dev, &l.si, &l.event) != FERRY_OK) {
      for (const Launch& taken : launches) give_back(taken);
      lk.unlock();
      return RefuseForGpu(x, "no stream for the copies: " + GpuError());
    }
    l.stream = streams_[static_cast<size_t>(dev)][l.si];
    ++stream_copies_[static_cast<size_t>(dev)][l.si];
    launches.push_back(l);
  }
  // The target can watch one event only: a transfer over several devices is
  // told of by the core.
  if (launches.size() == 1)
    launches[0].slot = TakeNotifySlotLocked(x, *static_cast<Remote*>(x->pairs[0].remote_mem),
                                            launches[0].device, &launches[0].event);
  lk.unlock();
  const auto ready = Clock::now();
  // One device (an engine with one GPU): the runtime writes its table from the
  // pairs' pieces itself (ABI 1.9), each checked against its pair before
  // anything is queued. Several devices: every device's pieces must be checked
  // before the first launch, so they are merged here first.
  int direct_rc = FERRY_ERR_UNSUPPORTED;
  // (CopySegments tests has_segments_ and batch_copy_ too; tested here as well
  // so a runtime without the call costs no segment list.)
  if (launches.size() == 1 && has_segments_ && batch_copy_) {
    thread_local std::vector<ferry_gpu_seg_v1> gsegs;
    gsegs.clear();
    for (const Seg& sg : segs)
      gsegs.push_back({sg.local->addr, sg.local->size, sg.rbase, sg.rsize, sg.iov, sg.n});
    // (A device that cannot be set: the pieces are checked below first, as
    // without the call, and the launch then fails.)
    if (gpu_->set_device(gpu_->gpu_ctx, launches[0].device) == FERRY_OK)
      direct_rc = CopySegments(x->op, gsegs.data(), gsegs.size(), launches[0].stream);
  }
  const bool direct = direct_rc != FERRY_ERR_UNSUPPORTED;
  // Otherwise every pair's pieces, merged where contiguous, device by device
  // (never across two devices), each checked against its own pair's regions.
  Scratch& sc = ScratchFor(direct ? 0 : x->n_iov);
  void** dv = sc.dsts.data();
  const void** sv = sc.srcs.data();
  size_t* zv = sc.sizes.data();
  bool outside = direct_rc == kPieceOutside;
  size_t k = 0;
  if (!direct) {
    for (Launch& l : launches) {
      l.first = k;
      for (const Seg& sg : segs) {
        if (sg.local->device != l.device) continue;
        bool bad = false;
        k = l.first + MergePieces(x->op, sg.iov, sg.n, sg.local->addr, sg.local->size, sg.rbase,
                                  sg.rsize, dv + l.first, sv + l.first, zv + l.first, k - l.first,
                                  &bad);
        outside |= bad;
      }
      l.k = k - l.first;
    }
  }
  const auto merged = Clock::now();
  if (outside) {
    lk.lock();
    for (const Launch& l : launches) give_back(l);
    lk.unlock();
    TellRefusal(x, "a piece is outside its region pair's regions");
    return FERRY_ERR_INVALID_ARGS;
  }
  // Launched device by device; a launch that fails stops the rest, and the
  // transfer then fails once what was launched has ended (nothing lands later).
  int rc = FERRY_OK;
  size_t launched = 0;
  for (const Launch& l : launches) {
    if (direct) {
      rc = direct_rc;  // queued above, on this launch's device and stream
    } else {
      rc = gpu_->set_device(gpu_->gpu_ctx, l.device);
      if (rc == FERRY_OK) rc = CopyPieces(dv + l.first, sv + l.first, zv + l.first, l.k, l.stream);
    }
    if (rc == FERRY_OK && l.event) rc = gpu_->event_record(gpu_->gpu_ctx, l.event, l.stream);
    ++launched;  // (on failure too: some of its copies may be queued)
    if (rc != FERRY_OK) break;
  }
  const auto recorded = Clock::now();
  if (rc != FERRY_OK) LogLine(FERRY_LOG_WARN, "launching the copies failed: " + GpuError());
  const bool notify = (x->flags & FERRY_XFER_NOTIFY) != 0;
  lk.lock();
  for (size_t i = launched; i < launches.size(); ++i) give_back(launches[i]);
  for (size_t i = 0; i < launched; ++i) {
    Launch& l = launches[i];
    const bool last = i + 1 == launched;
    // The failed launch is waited for on its stream (its event may not be recorded).
    void* event = last ? EventForLocked(l.device, l.event, rc, &l.slot) : l.event;
    ++peer->inflight;
    PushPendingLocked(
        {next_seq_++, event, l.stream, l.si, l.device, last ? x->xfer_ctx : nullptr, peer,
         x->total_bytes, recorded, true, last ? rc : FERRY_OK, l.slot, kTellNone, x->uid},
        last && notify, rc == FERRY_OK && l.slot >= 0);
  }
  ++pair_posts_;
  pair_launches_ += launched;
  Posted(lk, {entered, ready, merged, recorded, recorded});
  return FERRY_OK;
}

FERRY_HOT int Instance::Post(const ferry_xfer_v1* x) {
  if (!FERRY_HAS_FIELD(ferry_xfer_v1, x, total_bytes)) return FERRY_ERR_INVALID_ARGS;
  if (FERRY_HAS_FIELD(ferry_xfer_v1, x, pairs) && x->n_pairs > 0) return PostPairs(x);
  auto* local = static_cast<Local*>(x->local_mem);
  auto* remote = static_cast<Remote*>(x->remote_mem);
  auto* peer = static_cast<Peer*>(x->peer);
  if (local == nullptr || remote == nullptr || peer == nullptr || x->iov == nullptr ||
      x->n_iov == 0 || (x->op != FERRY_OP_READ && x->op != FERRY_OP_WRITE)) {
    TellRefusal(x, "missing handle, no pieces or unknown op");
    return FERRY_ERR_INVALID_ARGS;
  }
  // Every piece inside both regions: one piece here, several while they are
  // merged (MergePieces), before anything is launched.
  const uint64_t rsize = remote->blob.size;
  constexpr const char* kOutside = "a piece is outside a region";
  if (x->n_iov == 1 && !Inside(x->iov[0], local->size, rsize)) {
    TellRefusal(x, kOutside);
    return FERRY_ERR_INVALID_ARGS;
  }
  const auto entered = Clock::now();
  const int dev = local->device;
  std::unique_lock<std::mutex> lk(mu_);
  std::string why;
  char* rbase = RemoteBase(*remote, dev, &why);
  if (!rbase) {
    lk.unlock();
    return RefuseForGpu(x, why);
  }
  // A part of a multi-region call with more to come: held for one launch.
  const bool more = (x->flags & FERRY_XFER_MORE) != 0 && hold_.count() > 0 && batch_copy_;
  // Held parts of another device go first (LaunchHeld releases mu_ meanwhile:
  // look again until what is held, if anything, is this device's).
  while (!held_.parts.empty() && held_.device != dev) LaunchHeld(lk);
  // After them: LaunchHeld made their device this thread's current one.
  if (gpu_->set_device(gpu_->gpu_ctx, dev) != FERRY_OK) {
    lk.unlock();
    return RefuseForGpu(x, "cannot make device " + std::to_string(dev) + " current: " + GpuError());
  }
  if (more || !held_.parts.empty()) {
    const bool first = held_.parts.empty();
    if (!HoldLocked(x, *local, rbase, rsize)) {
      lk.unlock();
      TellRefusal(x, kOutside);
      return FERRY_ERR_INVALID_ARGS;
    }
    held_.device = dev;
    ++peer->inflight;
    if (!more) {
      // Accepted either way: a failed launch completes every part with GPU_ERROR.
      LaunchHeld(lk);
      return FERRY_OK;
    }
    const bool wake = first && completer_sleeping_;
    lk.unlock();
    if (wake) cv_.notify_one();  // it launches them if the last part never comes
    return FERRY_OK;
  }
  const auto d = static_cast<size_t>(dev);
  size_t si = 0;
  void* event = nullptr;
  if (ChooseStreamLocked(dev, &si, &event) != FERRY_OK) {
    lk.unlock();
    return RefuseForGpu(x, "no stream for the copy: " + GpuError());
  }
  int64_t slot = TakeNotifySlotLocked(x, *remote, dev, &event);
  void* stream = streams_[d][si];
  ++stream_copies_[d][si];
  lk.unlock();

  const auto ready = Clock::now();
  auto merged = ready;
  int rc = Enqueue(x, *local, rbase, rsize, stream, &merged);
  const auto enqueued = Clock::now();
  if (rc == FERRY_OK && event) rc = gpu_->event_record(gpu_->gpu_ctx, event, stream);
  const auto recorded = Clock::now();
  if (rc != FERRY_OK && rc != kPieceOutside)
    LogLine(FERRY_LOG_WARN, "enqueueing the copy failed: " + GpuError());
  const bool notify = (x->flags & FERRY_XFER_NOTIFY) != 0;
  lk.lock();
  if (rc == kPieceOutside) {  // refused before anything was enqueued
    ReleaseStreamLocked(dev, si, event, slot);
    lk.unlock();
    TellRefusal(x, kOutside);
    return FERRY_ERR_INVALID_ARGS;
  }
  // A copy call that failed may follow others already queued (a piece each
  // where the runtime has no batch call): the transfer fails only once its
  // stream has run them, so nothing lands after the failure is reported
  // (INITIATOR_COPY: the core fences nothing behind it and may retry elsewhere).
  event = EventForLocked(dev, event, rc, &slot);
  ++peer->inflight;
  // The completion thread sends the event's message while the copy runs.
  PushPendingLocked({next_seq_++, event, stream, si, dev, x->xfer_ctx, peer, x->total_bytes,
                     recorded, true, rc, slot, kTellNone, x->uid},
                    notify, rc == FERRY_OK && slot >= 0);
  Posted(lk, {entered, ready, merged, enqueued, recorded});
  return FERRY_OK;
}

int Instance::Describe(char* buf, size_t len) {
  std::snprintf(buf, len,
                "%s runtime, %d device(s), %d streams/device, batched copies %s, poll %lld us "
                "(+ the copy's expected time), idle poll %lld us, notification by event %s",
                gpu_->vendor == FERRY_GPU_CUDA ? "CUDA" : "HIP", gpu_->device_count,
                streams_per_device_, batch_copy_ ? "on (when the runtime has them)" : "off",
                static_cast<long long>(spin_.count()), static_cast<long long>(idle_spin_.count()),
                events_ ? "on" : "off");
  return FERRY_OK;
}

int Instance::Counters(char* buf, size_t len) {
  size_t in_flight = 0, opened = 0;
  uint64_t held_launches = 0, held_parts = 0, held_by_timeout = 0, pair_posts = 0,
           pair_launches = 0;
  Stages st;
  const InboundWatch::Counts watch = inbound_->counts();
  {
    std::lock_guard<std::mutex> lk(mu_);
    in_flight = pending_.size();
    opened = opened_.size();
    st = stages_;
    held_launches = held_launches_;
    held_parts = held_parts_;
    held_by_timeout = held_by_timeout_;
    pair_posts = pair_posts_;
    pair_launches = pair_launches_;
  }
  const std::pair<const char*, uint64_t> fields[] = {
      {"copies_in_flight", in_flight},
      {"ipc_handles_open", opened},
      {"stage_transfers", st.transfers},
      {"stage_post_ns", st.post_ns},
      {"stage_setup_ns", st.setup_ns},
      {"stage_enqueue_ns", st.enqueue_ns},
      {"stage_merge_ns", st.merge_ns},
      {"stage_pickup_ns", st.pickup_ns},
      {"stage_gpu_ns", st.gpu_ns},
      {"stage_complete_ns", st.complete_ns},
      {"completer_sleeps", st.sleeps},
      {"event_blocks", st.event_blocks},
      {"tell_ns", st.tell_ns},
      {"tells_over_10us", st.tells_over_10us},
      {"tell_waits", st.tell_waits},
      {"stage_by_waiter", st.by_waiter},
      {"held_launches", held_launches},
      {"held_parts", held_parts},
      {"held_by_timeout", held_by_timeout},
      {"pair_posts", pair_posts},
      {"pair_launches", pair_launches},
      {"notified_by_event", notified_by_event_.load()},
      {"notified_by_core", notified_by_core_.load()},
      {"inbound_watched", watch.watched},
      {"inbound_reported", watch.reported},
      {"inbound_dropped", watch.dropped},
      {"inbound_events_open", watch.events_open},
      {"inbound_farewell", watch.farewell},
      {"farewell_sent", farewell_sent_.load()}};
  std::string out = "{";
  for (const auto& [k, v] : fields)
    out += (out.size() > 1 ? ",\"" : "\"") + std::string(k) + "\":" + std::to_string(v);
  out += "}";
  if (out.size() + 1 > len) return FERRY_ERR_NO_MEMORY;
  std::memcpy(buf, out.c_str(), out.size() + 1);
  return FERRY_OK;
}

}  // namespace ferry_xgmi
