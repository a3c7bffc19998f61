// SPDX-License-Identifier: Apache-2.0
// GPU memory over tcp. A socket cannot read or write device memory, so the
// bytes of a GPU region pass through host staging buffers on both sides.
//
// A Stage is two host buffers of piece_bytes each, a stream and two events.
// Sending device memory, it copies piece k+1 device->host while piece k is on
// the socket; receiving, it copies piece k host->device while piece k+1
// arrives. A frame then costs about max(copy, network) rather than their sum,
// and since every lane leases its own stage, the lanes of a peer overlap too.
//
// On a same-host ring lane (channel.h) a frame needs no staging buffer: the
// runtime pins the ring's own shared bytes (ferry_gpu_v1.host_register, once per
// ring, kept with the channel), the sender's device->host copies write straight
// into space reserved in the outgoing ring and the receiver's host->device
// copies read straight out of the incoming one, up to kSlots pieces in flight,
// each published (or handed back) once its copy is done. A frame then costs one
// device copy per side and no memcpy, where the buffers take a device copy and
// a memcpy per side. Without host_register, or if pinning fails, the buffers.
// A piece of several blocks (a KV layout) is one batched copy between the
// blocks and the ring's bytes, as between the blocks and a buffer.
//
// Stages come from a StagePool that caps the pinned host memory the plugin
// holds (gpu_pinned_bytes). A stage is leased for one frame and returned. When
// the cap is reached, a frame gets an unpinned stage instead - correct, slower
// (the runtime copies pageable memory synchronously) - and the pool says so
// once in the log. Leasing never blocks: a lane holding a stage may be waiting
// on a peer whose own lanes wait on us, so a blocking pool could deadlock.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_tcp {

class ByteReader;
class Channel;

// A Stage's answer when the GPU runtime failed; Stage::error() says why. Distinct
// from kEof and every errno value of socket_util.h.
inline constexpr int kGpuError = -1000;

// Where staged frames spend their time (issue 19 item 3: ~400 us per 1 MiB
// frame, unexplained), summed over every frame of the pool's stages; the
// plugin's counters() shows them. Nanoseconds.
struct StageTimes {
  std::atomic<uint64_t> frames_sent{0}, frames_received{0};
  std::atomic<uint64_t> send_ns{0};       // whole Send(): first copy queued -> last byte out
  std::atomic<uint64_t> send_wait_ns{0};  //   of which waiting for device->host copies
  std::atomic<uint64_t> recv_ns{0};       // whole Recv(): first byte read -> last copy done
  std::atomic<uint64_t> recv_read_ns{0};  //   of which reading the channel into the stage
  std::atomic<uint64_t> recv_wait_ns{0};  //   of which waiting for host->device copies
  std::atomic<uint64_t> acquires{0}, acquire_ns{0};  // leasing (and binding) a stage
  std::atomic<uint64_t> ring_frames{0};     // frames (either way) staged in a ring's own bytes
  std::atomic<uint64_t> ring_pins{0};       // rings pinned for that
  std::atomic<uint64_t> ring_pin_fails{0};  // rings the runtime could not pin (buffers used)
};

class Stage {
 public:
  // Device copies in flight at once in a ring's bytes; the buffers use two.
  static constexpr int kSlots = 4;

  Stage(const ferry_gpu_v1* gpu, uint64_t piece_bytes, bool pinned, bool in_ring,
        StageTimes* times);
  ~Stage();
  Stage(const Stage&) = delete;
  Stage& operator=(const Stage&) = delete;

  // Creates the buffers, stream and events for `device`. False with error().
  bool Bind(int device);
  int device() const { return device_; }
  bool pinned() const { return pinned_; }
  uint64_t host_bytes() const { return 2 * piece_; }

  // Sends the device bytes iov[0..n) on the lane's channel, in order. With held_last, the final
  // byte is not sent but stored there (a notify READ sends it once counted).
  // `last_flags` go with the final piece (e.g. MSG_MORE). Returns 0, a socket
  // error (socket_util.h) or kGpuError. No copy is running when it returns.
  int Send(Channel& out, const iovec* iov, size_t n, int last_flags, uint8_t* held_last);
  // Receives into the device bytes iov[0..n) from `in`, the reader of `ch`;
  // same returns.
  int Recv(Channel& ch, ByteReader& in, const iovec* iov, size_t n);
  const std::string& error() const { return error_; }

 private:
  struct Piece {
    std::vector<void*> dev;
    std::vector<void*> host;
    std::vector<size_t> len;
    size_t bytes = 0;
  };
  // Cuts the next piece, up to `room` bytes at `host`, out of iov, starting at (*idx, *off).
  static void NextPiece(const iovec* iov, size_t n, size_t* idx, size_t* off, uint8_t* host,
                        uint64_t room, Piece* p);
  // host_pinned: the host side may be read by a kernel (a batched copy): memory
  // from host_alloc, or a ring pinned with host_register (a kernel then uses
  // the registered pointer as is: true on x86-64 hosts with unified
  // addressing, cudaDevAttrCanUseHostPointerForRegisteredMem, measured on H100).
  bool Copy(const Piece& p, bool to_device, int slot, bool host_pinned);
  // Whether this channel's ring of that side (Channel::Side kOut / kIn) takes
  // the frame in place: a ring lane, a runtime that pins, the ring pinned.
  bool InRing(Channel& ch, bool out);

  // A piece of ring bytes: reserved in the outgoing ring, or peeked in the incoming one.
  struct RingPiece {
    uint8_t* at = nullptr;
    uint64_t len = 0;
  };
  // Moves iov[0..n) through a ring in pieces of up to `room` bytes, kSlots in
  // flight: take(max, may_wait, &piece) gets ring bytes (Reserve or Peek: 0, or
  // EAGAIN without waiting, or an error), a device copy moves the piece, and
  // give(piece, last) hands it on once its copy is done (Commit or Consume), in
  // order. Returns 0, take's error or kGpuError; no copy runs after it returns.
  template <typename Take, typename Give>
  int ThroughRing(const iovec* iov, size_t n, uint64_t room, bool to_device, Take take, Give give,
                  uint64_t* take_ns, uint64_t* wait_ns);
  int SendInRing(Channel& ch, const iovec* iov, size_t n, uint8_t* held_last);
  int RecvInRing(Channel& ch, const iovec* iov, size_t n);
  // Until the slot's last copy is done: polls briefly, then blocks.
  bool Wait(int slot, const char* what);
  bool Fail(const char* what);
  void Release();

  const ferry_gpu_v1* gpu_;
  const uint64_t piece_;
  const bool pinned_;
  const bool in_ring_;       // settings.h gpu_stage_in_ring
  StageTimes* const times_;  // the pool's
  int device_ = -1;
  uint8_t* buf_ = nullptr;  // 2 * piece_ bytes: slot s starts at buf_ + s * piece_
  void* stream_ = nullptr;
  void* event_[kSlots] = {};
  std::string error_;
};

// Whether the host's GPU runtime pins memory it did not allocate
// (ferry_gpu_v1.host_register, plugin ABI 1.10): what in-ring staging needs.
bool RuntimePins(const ferry_host_v1* host);

class StagePool {
 public:
  // in_ring: StagesInRing (settings.h), so the runtime pins (RuntimePins).
  StagePool(const ferry_host_v1* host, uint64_t piece_bytes, uint64_t pinned_cap, bool in_ring);
  ~StagePool();  // every lease must have been returned (the lanes are joined first)
  StagePool(const StagePool&) = delete;
  StagePool& operator=(const StagePool&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(StagePool* pool, std::unique_ptr<Stage> s) : pool_(pool), stage_(std::move(s)) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = default;
    ~Lease() {
      if (stage_) pool_->Return(std::move(stage_));
    }
    Stage* operator->() const { return stage_.get(); }
    Stage& operator*() const { return *stage_; }
    explicit operator bool() const { return stage_ != nullptr; }

   private:
    StagePool* pool_ = nullptr;
    std::unique_ptr<Stage> stage_;
  };

  // A stage bound to `device`; never blocks. Empty with *why when the runtime
  // could not provide one (no GPU runtime, out of memory).
  Lease Acquire(int device, std::string* why);
  uint64_t pinned_bytes() const;
  const StageTimes& times() const { return times_; }

 private:
  void Return(std::unique_ptr<Stage> s);

  const ferry_host_v1* host_;
  const uint64_t piece_;
  const uint64_t cap_;
  const bool in_ring_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Stage>> idle_;
  uint64_t pinned_ = 0;  // held by idle and leased pinned stages
  bool warned_ = false;
  StageTimes times_;
};

}  // namespace ferry_tcp
