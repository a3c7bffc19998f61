// SPDX-License-Identifier: Apache-2.0
// The byte stream one data lane runs over.
//
// Across hosts that is the lane's TCP socket. When both engines share a host
// (the peer's node id is ours and it advertised a unix socket, wire.h
// ConnInfo) the lane connects over that unix socket, runs the same HELLO and
// auth on it, and then hands over two shared-memory rings (ring_handover.h):
// from there on frames travel through the rings - no system call per frame
// while both ends are busy - and the socket carries nothing. It stays the
// lane's identity and liveness signal: every wait on a ring also watches it,
// so a peer that dies, or a shutdown() of it by a thread of ours (a fence
// cutting the lane, a region's revocation, a stop), ends the wait at once,
// exactly as it ends a blocked recv() on a socket lane. Everything above the
// byte stream - the frame protocol, the target's checks, the fence,
// ack-after-store - is the same on both.
//
// Errors follow socket_util.h: 0, kEof or an errno value.
#pragma once

#include <sys/uio.h>

#include <cassert>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "direct_copy.h"
#include "shm_ring.h"
#include "socket_util.h"

namespace ferry_tcp {

class Channel {
 public:
  // A socket lane. The channel never closes fd: its owner does, after every
  // thread using the channel is done.
  explicit Channel(int fd) : fd_(fd) {}
  // A ring lane: `out` carries our frames, `in` the peer's. io_timeout bounds
  // a stall of one write or read (as SO_SNDTIMEO / SO_RCVTIMEO do on a socket
  // lane); 0 = wait as long as the peer lives and the socket is not shut down.
  Channel(int fd, shm::Ring out, shm::Ring in, std::chrono::milliseconds io_timeout);
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  int fd() const { return fd_; }
  bool on_rings() const { return out_.ok(); }
  // How long a ring wait polls before it sleeps (settings.h, ring_spin_us).
  void SetSpin(std::chrono::microseconds spin);

  // A ring lane whose ends agreed to direct copies (direct_copy.h). At the
  // target: the initiator's process (the gate lives in our incoming ring, the
  // request ring). At the initiator: the lane's link.
  void EnableDirect(std::unique_ptr<direct::Process> initiator);
  void EnableDirect(std::shared_ptr<direct::Link> link) { direct_link_ = std::move(link); }
  // The target's: null unless direct copies were agreed.
  const direct::Process* direct_peer() const { return direct_peer_.get(); }
  // The target's gate over its pushes into the initiator (only with direct_peer).
  direct::Gate gate() const { return direct::Gate(in_.spare()); }
  // The initiator's: null unless direct copies were agreed.
  const std::shared_ptr<direct::Link>& direct_link() const { return direct_link_; }

  // SendIov's contract (socket_util.h): iov[0..n) from *progress on; with
  // MSG_DONTWAIT in flags it may stop part-way with EAGAIN. MSG_MORE is a
  // socket's hint and means nothing on rings.
  int Send(const iovec* iov, size_t n, size_t* progress, int flags = 0);
  int SendAll(const void* buf, size_t len);

  // A reader for the one thread that receives on this channel (one at a time:
  // on a ring lane its ReadSome never waits, and WaitReadable waits for it).
  std::unique_ptr<ByteReader> Reader();
  // A ring lane: until bytes (or the peer's close) are there to read; EPIPE
  // once the socket says the lane is over; ETIMEDOUT per the io timeout.
  int WaitReadable();

  // A ring lane driven by an event loop (the I/O pool: the target's
  // polled_lane.h, the initiator's sender and responses, lane.h) rather than
  // by threads that wait. A wait set is an epoll descriptor, readable while
  // the socket has an event, a bell of its side has rung or it was nudged: kIn, the incoming
  // ring's data bell; kOut, the outgoing ring's space bell; kBoth, both (a
  // target lane, one handler for both directions). Made on the first call,
  // closed with the channel; -1 (errno set) when it cannot be made.
  enum class Side { kBoth = 0, kIn = 1, kOut = 2 };
  int WaitSet(Side side = Side::kBoth);
  // At the start of each turn of that side's handler: clears its sleep
  // flag(s) and quiets its bells that rang. True once the socket fired: the
  // peer is gone, or a thread of ours shut it down; what the rings hold is
  // still read (and room in them still used), then the lane ends.
  bool Woken(Side side = Side::kBoth);
  // Before the loop waits for bytes (for room): announces the sleep, so the
  // peer rings; false when they are there after all (do not wait).
  // The epoll events that give a handler waiting to send its turn: a
  // socket's EPOLLOUT, a wait set's EPOLLIN (it is readable, never writable).
  uint32_t RoomEvents() const;
  bool SleepIn() { return in_.SleepForData(); }
  // A watched lane (io_pool.h "Watching"): withdraws SleepIn's announcement
  // (the reading thread); looks for bytes and announces the sleep again
  // (any thread, by the published indices).
  void WatchIn() { in_.AwakeForData(); }
  bool InPending() const { return in_.PendingAnyThread(); }
  bool SleepInAnyThread() { return in_.SleepForDataAnyThread(); }
  bool SleepOut() { return out_.SleepForRoom(); }
  // Makes that side's wait set readable at once (our own eventfd in it): its
  // handler gets a turn without anything having arrived - its first, or one
  // to go on with what it left to let other lanes have a turn.
  void Nudge(Side side = Side::kBoth);

  // A ring lane's rings themselves (null on a socket lane), for the GPU stager
  // that copies device memory straight into and out of their bytes
  // (gpu_stage.h): out_ring by the one thread that sends, in_ring by the one
  // that reads. ring_wait is the stall limit of their Reserve and Peek: the
  // io timeout, or as long as the peer lives.
  shm::Ring* out_ring() { return on_rings() ? &out_ : nullptr; }
  shm::Ring* in_ring() { return on_rings() ? &in_ : nullptr; }
  std::chrono::milliseconds ring_wait() const;
  // The stager's record of having pinned that ring's bytes for the GPU runtime
  // (kOut or kIn; the same threads' rule): it unpins them when it goes, which
  // is before the rings are unmapped.
  std::shared_ptr<void>& ring_pin(Side side) {
    assert(side != Side::kBoth);
    return ring_pins_[side == Side::kOut ? 1 : 0];
  }

  // The lane breaks while frames are on their way: the peer must not apply
  // what it has not read yet (a socket lane's abortive close does the same
  // with a RST). Then shut the socket down as always.
  void AbortOutgoing();
  // The lane closes cleanly: the peer reads what was sent, then end of stream.
  void CloseOutgoing();

 private:
  const int fd_;
  shm::Ring out_, in_;
  std::chrono::milliseconds io_timeout_{0};
  int wait_sets_[3] = {-1, -1, -1};  // by Side
  int nudges_[3] = {-1, -1, -1};     // by Side: Nudge's eventfd, in that side's wait set
  int NudgeFd(Side side);            // made on first use
  std::unique_ptr<direct::Process> direct_peer_;
  std::shared_ptr<direct::Link> direct_link_;
  // After out_ and in_: destroyed first, so the runtime unpins the bytes before they are unmapped.
  std::shared_ptr<void> ring_pins_[2];  // [0] in, [1] out
};

}  // namespace ferry_tcp
