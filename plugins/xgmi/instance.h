// SPDX-License-Identifier: Apache-2.0
// One xgmi plugin instance (one engine): GPU-to-GPU copies between engines on
// one host, over XGMI (AMD, through HIP) or NVLink/PCIe peer access (NVIDIA,
// through CUDA). It uses only the core's GPU runtime shim (host->gpu, plugin ABI
// 1.1), so it needs no GPU SDK to build and one .so serves both vendors.
//
// Memory is exported as an IPC handle of its allocation plus the region's offset
// inside it; the importer opens each handle once per local device and caches it.
// A transfer's pieces are merged where contiguous and enqueued on one stream of
// the local device (one batched copy call where the runtime has one, so 1024
// small blocks are not 1024 launches), an idle stream where there is one; a
// copy that shares its stream also records an event (a copy alone on its
// stream is waited for by querying the stream: the record cost ~1.4 us of a
// 64 KiB transfer's ~14). A completion thread waits on them in order and
// reports completion. Its hand-offs are where a
// small transfer's time went (issue 19: ~20 us per transfer against ~9 us for
// the raw copy), so it polls a finishing copy and, after a completion, polls
// for the next post for a while (idle_spin_us) before it blocks. A thread that
// waits for a transfer (Wait(), ABI 1.6 progress()) reports finished copies
// itself, in the same order: whichever of the two sees the front copy done
// first reports it, once (its sequence number decides). Each stage's time is
// summed in the counters (stage_*_ns), which ferry-gpu-bench prints.
// The parts of one multi-region call (FERRY_XFER_MORE on all but the last,
// plugin.h) are held, their pieces merged into one table, and launched as one
// batch call with the last part: a KV request of 64 region pairs was 64
// launches of ~10-15 us each where the copy itself takes ~0.1 ms
// (docs/benchmarks.md). Held parts that wait hold_us without another part
// are launched by the completion thread.
// Notification (NATIVE_NOTIFY, also for READ): an interprocess event behind
// the copy, its handle sent to the target's xgmi at post() (notify_events.h);
// where that cannot be done the core tells the target, as without the cap.
// Methods may throw (std::bad_alloc, std::system_error); the plugin kit's entry
// points (xgmi_plugin.cpp) catch.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/plugin_kit.hpp"
#include "notify_events.h"
#include "xgmi_blob.h"

namespace ferry_xgmi {

struct Local {
  char* addr;
  uint64_t size;
  int device;
};

struct Remote {
  MemBlob blob;
  bool same_process;
  std::vector<char*> base;  // per local device: the opened mapping + offset (guarded by mu_)
};

struct Peer {
  std::string key;
  int inflight = 0;  // guarded by Instance::mu_
};

class Instance {
 public:
  static std::unique_ptr<Instance> Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                          std::string* why);
  explicit Instance(const ferry_host_v1* host);
  ~Instance();  // fini: the completion thread drains what is pending; handles closed

  const ferry_host_v1* host() const { return host_; }
  int ConnInfo(void* buf, size_t* len);
  int PeerAdd(const ferry_peer_v1* p, void** handle);
  void PeerRemove(void* handle);
  int MemRegister(const ferry_mem_v1* m, void** handle, void* blob, size_t* blob_len);
  void MemDeregister(void* handle);
  int MemImport(void* peer, uint64_t id, uint64_t size, const void* blob, size_t len,
                void** handle);
  void MemRelease(void* handle);
  int Post(const ferry_xfer_v1* x);
  // ABI 1.7 (FERRY_CAP_MULTI_PAIR): one transfer over several region pairs.
  int PostPairs(const ferry_xfer_v1* x);
  int Describe(char* buf, size_t len);
  int Counters(char* buf, size_t len);  // ABI 1.5: copies in flight, IPC handles open
  int Progress();                       // ABI 1.6: report finished copies on this thread
  void OnCtrl(const char* peer_key, const void* msg, size_t len);  // a peer's AfterEventMsg

 private:
  using Clock = std::chrono::steady_clock;
  struct Pending {
    uint64_t seq;  // reported only while it is the front's (front_seq_)
    void* event;   // nullptr: alone on its stream, which is queried instead
    void* stream;
    size_t stream_index;  // in streams_[device]
    int device;
    void* xfer_ctx;
    Peer* peer;
    uint64_t bytes;
    Clock::time_point posted;  // when its event was recorded
    bool owns_event;           // the last of the parts launched together returns the event
    int fail_rc = FERRY_OK;    // reported instead of success (a launch failed after others ran)
    int64_t slot = -1;         // events_'s slot that `event` is (given back on report)
    uint8_t tell =
        kTellNone;     // a notify transfer's target: how it learns (authoritative in pending_)
    uint64_t uid = 0;  // the transfer's notification key
  };
  // How a notify transfer's target learns of it. The event's message leaves
  // from the completion thread while the copy runs (a send() costs ~5 us on
  // the GPU host: not on the posting thread); whoever reports the transfer
  // sends it first if nobody has yet, and waits while another thread is.
  static constexpr uint8_t kTellNone = 0;     // not a notify transfer, or told already
  static constexpr uint8_t kTellToSend = 1;   // its event's message has to go out
  static constexpr uint8_t kTellSending = 2;  // a thread is sending it (mu_ released)
  static constexpr uint8_t kTellByCore = 3;   // reported FERRY_OK_NOTIFY_BY_CORE
  // Held parts (FERRY_XFER_MORE) and their merged pieces, all on one device.
  // The piece arrays only grow and `pieces` says how many are in use: resizing
  // them part by part zero-filled every new piece before the merge wrote it.
  struct HeldPart {
    void* xfer_ctx;
    Peer* peer;
    bool notify;  // the core tells its target (FERRY_OK_NOTIFY_BY_CORE)
    uint64_t uid;
  };
  struct Held {
    int device = -1;
    std::vector<void*> dsts;
    std::vector<const void*> srcs;
    std::vector<size_t> sizes;
    size_t pieces = 0;
    std::vector<HeldPart> parts;
    uint64_t bytes = 0;
    Clock::time_point last;  // the last part added
  };
  // Nanoseconds summed per stage over every transfer (guarded by mu_).
  struct Stages {
    uint64_t transfers = 0;
    uint64_t post_ns = 0;          // post() entry -> copies enqueued and event recorded
    uint64_t setup_ns = 0;         //   of which: mapping, stream and event chosen (under mu_)
    uint64_t enqueue_ns = 0;       //   of which: the copy calls (the event record is the rest)
    uint64_t merge_ns = 0;         //     of which: merging a batch's pieces (before the batch call)
    uint64_t pickup_ns = 0;        // event recorded -> the completion thread watches it
    uint64_t gpu_ns = 0;           // watched -> the event says the copies are done
    uint64_t complete_ns = 0;      // the core's complete() (status, notification) returned
    uint64_t by_waiter = 0;        // reported by a waiting thread's progress() (its pickup is 0,
                                   // recorded -> seen done counts as gpu)
    uint64_t sleeps = 0;           // times the completion thread blocked waiting for work
    uint64_t event_blocks = 0;     // copies not done within the poll: waited blocking
    uint64_t tell_ns = 0;          // sending notification messages (SendAfterEvent), summed
    uint64_t tells_over_10us = 0;  // of those sends, the ones that took over 10 us
    uint64_t tell_waits = 0;       // a waiter's progress() found its front copy's message
                                   // being sent and polled until it was
  };
  struct Opened {
    char* base = nullptr;
    int refs = 0;
  };

  void CompleteLoop();
  // Tells `only` (every peer when nullptr) which of its told transfers have
  // landed (xgmi_blob.h LandedHeader); those leave told_.
  void SayFarewell(const Peer* only);
  bool NextPending(std::unique_lock<std::mutex>& lk);  // false: stop and nothing left
  // FERRY_OK or a FERRY_ERR_GPU code; kTaken when another thread reported p meanwhile.
  static constexpr int kTaken = 2;
  static constexpr int kSendFirst = 4;  // WaitCopies: an entry's message is waiting to be sent
  int WaitCopies(const Pending& p);
  int QueryCopies(const Pending& p);  // FERRY_OK done, 1 not yet, else FERRY_ERR_GPU
  // mu_ held: report p if it is still the front (else false: reported already).
  bool Report(std::unique_lock<std::mutex>& lk, const Pending& p, int rc, Clock::time_point watched,
              Clock::time_point done, bool by_waiter);
  void PublishFrontLocked();  // front_seq_, pending_count_
  // mu_ held: a stream of `device` for new copies (*si its index), and an event
  // unless the copies will be alone on it. FERRY_OK or FERRY_ERR_GPU.
  int ChooseStreamLocked(int device, size_t* si, void** event);
  // mu_ held: what ChooseStreamLocked gave (and the copy counted on the
  // stream) goes back, for copies that were never enqueued.
  void ReleaseStreamLocked(int device, size_t si, void* event, int64_t slot = -1);
  // mu_ held: the event a launch's pending entry waits on. After a failed
  // launch (rc) none - its record may not have happened - and the event goes
  // back: the entry waits for the stream, which covers whatever was queued.
  void* EventForLocked(int device, void* event, int rc, int64_t* slot = nullptr);
  // mu_ held: for a notify transfer, an interprocess event of events_
  // in place of *event (which goes back); its slot, or -1 (then the core
  // tells the target).
  // (The remote region's blob says whether the target watches events.)
  int64_t TakeNotifySlotLocked(const ferry_xfer_v1* x, const Remote& remote, int device,
                               void** event);
  // Tells the target's xgmi which event to watch, without waiting. False:
  // the core must tell it.
  bool SendAfterEvent(const Peer& peer, uint64_t uid, int64_t slot);
  // mu_ held on entry and exit (released while sending): sends the message
  // of the pending entry at index i (kTellToSend), which stays pending meanwhile.
  void SendTellLocked(std::unique_lock<std::mutex>& lk, size_t i);
  // mu_ held on entry and exit: sends every pending entry's message still to
  // send, in order (SendTellLocked each).
  void SendTellsLocked(std::unique_lock<std::mutex>& lk);
  // mu_ held: queues p for completion; a notify transfer's target is told by
  // its event (by_event: p's message still to send) or by the core.
  void PushPendingLocked(Pending p, bool notify, bool by_event);
  // mu_ held: adds x's pieces (merged where contiguous) and x itself to held_;
  // false (held_ unchanged) when a piece is outside the regions.
  bool HoldLocked(const ferry_xfer_v1* x, const Local& local, char* rbase, uint64_t rsize);
  // mu_ held on entry and exit (released while launching): launches held_ as
  // one batch and queues its parts for completion; when a launch fails they
  // fail (FERRY_ERR_GPU) once what it queued has run, at once when nothing
  // was launched. FERRY_OK or FERRY_ERR_GPU.
  int LaunchHeld(std::unique_lock<std::mutex>& lk);
  // mu_ held on entry, released on return: a post's copies are pending (the
  // front published), its stage times counted, the completion thread woken.
  struct PostTimes {
    Clock::time_point entered, ready, merged, enqueued, recorded;
  };
  void Posted(std::unique_lock<std::mutex>& lk, const PostTimes& t);
  char* RemoteBase(Remote& r, int device, std::string* why);  // mu_ held
  // kPieceOutside (nothing launched) when a piece is outside the regions;
  // *merged: when the pieces were merged.
  static constexpr int kPieceOutside = 3;
  int Enqueue(const ferry_xfer_v1* x, const Local& local, char* rbase, uint64_t rsize, void* stream,
              Clock::time_point* merged);
  // The pieces of segs as one batch through the runtime's copy_segments_async
  // (ABI 1.9: it writes its table from the pieces; no merge pass here):
  // FERRY_OK, kPieceOutside (nothing queued), FERRY_ERR_UNSUPPORTED (nothing
  // queued: merge and CopyPieces instead) or the runtime's error.
  int CopySegments(uint32_t op, const ferry_gpu_seg_v1* segs, size_t n, void* stream);
  // k pieces on `stream`: one batched call (a gather launch) for several where
  // the runtime has one, else a copy each. FERRY_OK or the runtime's error.
  int CopyPieces(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t k,
                 void* stream);
  void LogLine(int level, const std::string& m) const;
  // post() refusing for the GPU runtime (no remote mapping, device or stream):
  // logs `why`, tells the core, returns FERRY_ERR_GPU. Call without mu_ held.
  int RefuseForGpu(const ferry_xfer_v1* x, const std::string& why) const;
  std::string GpuError() const { return gpu_->last_error(gpu_->gpu_ctx); }

  const ferry_host_v1* host_;
  const ferry_gpu_v1* gpu_;
  const bool has_batch_;         // the shim has memcpy_batch_async (a runtime's batch or gather)
  const bool has_stream_query_;  // ... and stream_query (ABI 1.6)
  const bool has_segments_;      // ... and copy_segments_async (ABI 1.9)
  int streams_per_device_ = 4;
  bool batch_copy_ = true;
  std::chrono::microseconds spin_{200};       // poll a finishing copy this long before blocking
  std::chrono::microseconds idle_spin_{200};  // poll for the next post this long before blocking
  std::chrono::microseconds hold_{100};       // held parts wait at most this long for the next part
  bool notify_by_event_ = true;               // notify_events.h; false: the core tells every target
  bool waiter_drives_ = false;  // a polling waiter does the messages and queries alone

  std::mutex mu_;
  std::condition_variable cv_;                   // pending work for the completion thread
  std::condition_variable drained_;              // a transfer finished (peer_remove waits on it)
  std::vector<std::vector<void*>> streams_;      // per device
  std::vector<std::vector<int>> stream_copies_;  // per device and stream: copies pending on it
  std::vector<size_t> next_stream_;
  std::vector<std::vector<void*>> free_events_;           // per device
  std::map<std::pair<std::string, int>, Opened> opened_;  // (handle bytes, device)
  std::deque<Pending> pending_;
  std::atomic<size_t> pending_count_{0};  // pending_.size(), read without mu_ while polling
  std::atomic<uint64_t> front_seq_{0};    // pending_.front().seq, 0 when empty
  uint64_t next_seq_ = 1;                 // guarded by mu_
  // When a waiter last ran progress(): while waiters poll the events, the
  // completion thread does not query them too (both would take the runtime's lock).
  std::atomic<int64_t> driven_at_ns_{0};
  std::atomic<int> waiters_inside_{0};  // threads in progress() now
  // A waiter polls now (in progress(), or within kWaiterActiveNs): with
  // waiter_drives_ the completion thread then neither queries nor sends.
  bool WaiterActive() const;
  bool completer_sleeping_ = false;  // guarded by mu_: post() notifies only then
  Held held_;                        // guarded by mu_
  // A multi-pair transfer's entries before its last (one per device): the
  // first failure among them, reported with the last (guarded by mu_).
  int group_rc_ = FERRY_OK;
  std::string group_why_;
  uint64_t held_launches_ = 0;    // guarded by mu_: batches launched for held parts
  uint64_t held_parts_ = 0;       // ... and the parts they carried
  uint64_t held_by_timeout_ = 0;  // ... launched by the completion thread (no last part came)
  uint64_t pair_posts_ = 0;       // guarded by mu_: multi-pair posts (ABI 1.7)
  uint64_t pair_launches_ = 0;    // ... and their launches (one per device)
  Stages stages_;
  std::shared_ptr<EventPool> events_;  // nullptr: the runtime has no interprocess events
  std::unique_ptr<InboundWatch> inbound_;
  // The latest notify transfers told by event and reported landed, for the
  // farewell their targets get at peer_remove or fini (SayFarewell; guarded
  // by mu_). A target that could not act on a message - the event gone
  // before it opened it, the initiator having ended right after the copy -
  // still hears of the landing. Only the last milliseconds matter; these are
  // the last kToldKept.
  struct Told {
    const Peer* peer;
    uint64_t uid;
  };
  static constexpr size_t kToldKept = 1024;
  std::deque<Told> told_;
  std::atomic<uint64_t> farewell_sent_{0};      // uids listed in farewells that left
  std::atomic<uint64_t> notified_by_event_{0};  // notify transfers whose target got the event
  std::atomic<uint64_t> notified_by_core_{0};   // ... and those the core told
  std::atomic<size_t> to_send_{
      0};  // pending entries in kTellToSend (the completion thread polls it)
  bool stop_ = false;
  std::thread completer_;
};

}  // namespace ferry_xgmi
