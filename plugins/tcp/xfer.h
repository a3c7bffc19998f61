// SPDX-License-Identifier: Apache-2.0
// One accepted transfer on the initiator side, and the frames it was cut into.
//
// A transfer completes exactly once: when the last of its frames is resolved
// (acknowledged, refused, or abandoned with its lane). Waiting for every frame,
// even after the first failure, means nothing writes into or reads from the
// caller's memory once complete() has told it the transfer is over.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/plugin.h"
#include "region.h"
#include "wire.h"

namespace ferry_tcp {

class Peer;
class DeadlineWatcher;
namespace direct {
class Link;
}

class Xfer {
 public:
  const ferry_host_v1* host = nullptr;
  void* ctx = nullptr;  // xfer_ctx for host->complete
  uint32_t op = 0;
  bool notify = false;
  uint64_t uid = 0;
  uint64_t seq = 0;
  uint64_t deadline_ns = 0;  // 0 = none
  uint64_t deadline_token = 0;
  uint64_t posted_ns = 0;
  std::weak_ptr<Peer> peer;
  DeadlineWatcher* watcher = nullptr;
  std::shared_ptr<Region> local;
  bool direct_ok = false;  // host memory at both ends, one frame (direct_copy.h)

  void SetFrameCount(uint32_t n) { frames_left_ = n; }
  // Resolves one frame; the last one completes the transfer with the first error seen.
  void FrameDone(int status, const std::string& msg);
  // Records an error that the transfer will end with, without resolving a frame.
  void MarkError(int status, const std::string& msg);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // A frame of it is about to be written to a socket: from now on a failure
  // may have left bytes at the target (without this, it ends FERRY_ERR_NOT_SENT).
  void MarkLeft() { left_.store(true, std::memory_order_release); }
  // The status/message frames of a failed transfer are dropped with.
  void Error(int* status, std::string* msg) const;

 private:
  mutable std::mutex mu_;
  uint32_t frames_left_ = 0;
  int status_ = FERRY_OK;
  std::string msg_;
  std::atomic<bool> failed_{false};
  std::atomic<bool> left_{false};
};

struct FrameRun;

// A frame ready for a lane: encoded head (header + items) plus the local memory
// it sends from (WRITE) or receives into (READ). In a lane's queue a frame may
// instead stand for `count` frames of a FrameRun not built yet (run set):
// the lane builds each when it is about to send it, and failing the entry
// fails all it stands for.
struct Frame {
  std::shared_ptr<Xfer> xfer;
  uint64_t req_id = 0;
  bool is_write = false;
  std::vector<uint8_t> head;
  std::vector<iovec> local;
  uint64_t payload_bytes = 0;
  size_t sent = 0;       // bytes of head+payload already on the socket
  bool sending = false;  // guarded by the lane: a thread is copying from `local`
  // Sent as a direct request (wire.h kFlagDirect; set by the lane before it is
  // in flight): the target copies, and a READ's answer carries no payload.
  bool direct = false;
  // A direct READ's lane link: a failure of it completes only once the
  // target's push into its memory is over (push_waiter.h).
  std::shared_ptr<direct::Link> push_link;
  std::atomic<bool> resolved{false};
  // A queued entry standing for `count` frames of a run: frames run_next,
  // run_next + run_stride, ... (guarded by the lane, as the queue is).
  std::shared_ptr<const FrameRun> run;
  uint32_t count = 1;
  uint64_t run_next = 0;
  uint64_t run_stride = 1;

  // Exactly once per entry (for each frame it stands for); later calls are ignored.
  void Resolve(int status, const std::string& msg);
  // Turns it into a direct request (before it is in flight; not sent yet).
  void MakeDirect();
  // head followed by the payload pieces (WRITE) - what goes on the wire:
  // WireIovCount() pieces, written to out by WireIov.
  size_t WireIovCount() const;
  void WireIov(iovec* out);
};
using FramePtr = std::shared_ptr<Frame>;

// A frame of xfer: `head` says everything the transfer's frames share; the
// frame adds its req_id, its items and (WRITE) its payload length.
FramePtr MakeFrame(const std::shared_ptr<Xfer>& xfer, wire::Header head, uint64_t req_id,
                   const std::vector<wire::Item>& remote, std::vector<iovec> local, uint64_t bytes);

// The frames of one contiguous item, cut into chunk-size pieces: post() of a
// large transfer queues one entry per lane (Frame::run) instead of building a
// frame object and header per chunk (64 at 64 MiB: post() was 14-74 us p99,
// issue 20 item 2). The lane builds frame k - bytes [k*chunk,
// min((k+1)*chunk, len)) of the item - as it takes it.
struct FrameRun {
  std::shared_ptr<Xfer> xfer;
  wire::Header head;         // every field but req_id, n_items and payload_len
  uint8_t* local = nullptr;  // the item's first local byte
  uint64_t remote_off = 0;
  uint64_t len = 0;
  uint64_t chunk = 0;
  std::atomic<uint64_t>* next_req = nullptr;  // the peer's request ids
  // Builds frame k (its req_id taken now).
  FramePtr Build(uint64_t k) const;
};

}  // namespace ferry_tcp
