// SPDX-License-Identifier: Apache-2.0
// A byte stream between two processes of one host through shared memory: one
// direction of a same-host lane (docs/benchmarks.md, "Same-host CPU -> CPU":
// on the GPU host a loopback frame's round trips cost 47-435 us where copying
// its bytes costs 60-100 us, and a polled ring has no system call per frame).
// Same-host lanes run over two of them (channel.h); same_host_probe measures one.
//
// A Ring is a single-producer, single-consumer byte ring in a memfd that its
// creator sealed against shrinking and growing before sharing it, so the peer
// can never make a mapped page vanish under us (no SIGBUS). Both ends poll
// while busy; an idle end sleeps in poll() on its bell - its end of a unix
// socket pair that comes with the segment, rung (a byte, MSG_DONTWAIT) by the
// other end only when the sleeper announced its sleep; each end is its own open
// file, so a peer cannot make our calls on ours block (an eventfd both held
// could: its non-blocking flag was shared) - and on a liveness descriptor: the lane's socket, which
// carries nothing once the lane is up, so any readable event or hang-up on it means the peer is
// gone, or that a thread of ours shut the socket down to cut the lane (a fence, a revocation, a
// stop): every wait ends at once, as a blocked recv() on a socket lane does. An idle lane costs no
// CPU. The peer is not trusted: every index it publishes is checked (a corrupt one is EPROTO, never
// an access outside the ring), and what it hands over is checked by Attach.
//
// Errors follow socket_util.h: 0 = done, kEof = the peer closed its end and
// every byte it wrote has been read, otherwise an errno value (EAGAIN,
// ETIMEDOUT, EPIPE: the peer is gone, EPROTO: it broke the ring's rules).
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ferry_tcp::shm {

// The ring's bytes: a power of two in [kMinCapacity, kMaxCapacity].
inline constexpr uint64_t kMinCapacity = 64 << 10;
inline constexpr uint64_t kMaxCapacity = 64ull << 20;

struct Waiting {
  // Poll this long before sleeping on the bell.
  std::chrono::microseconds spin{50};
};

// What one end hands the other (SCM_RIGHTS, or inheritance): the segment and
// that end's side of the two bells. Whoever holds a Handover owns its descriptors.
struct Handover {
  int memfd = -1;
  int data_bell = -1;   // rung by the producer for a sleeping consumer
  int space_bell = -1;  // rung by the consumer for a sleeping producer
  void Close();
};

// Reads a rung bell (our end) quiet, without blocking: 0, or EPIPE once the
// peer closed its end (it is gone), or another errno value.
int QuietBell(int bell);

class Ring {
 public:
  // A new sealed segment of `capacity` bytes (plus its control block), mapped,
  // and its two bells. Invalid (ok() false) with *why on failure. Share
  // ForPeer() with the peer (SCM_RIGHTS), or Duplicate() across a fork; the
  // peer calls Attach.
  static Ring Create(uint64_t capacity, std::string* why);
  // Maps a segment a peer created, after checking what a hostile peer could
  // get wrong: a memfd sealed against shrink and grow, a size that is a
  // control block plus a power-of-two capacity, the magic and version, and
  // bells that are unix stream sockets. Takes ownership of every descriptor
  // in h (closed on failure too; the segment's once it is mapped).
  static Ring Attach(Handover h, std::string* why);

  Ring() = default;
  ~Ring();
  Ring(Ring&& o) noexcept;
  Ring& operator=(Ring&& o) noexcept;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  bool ok() const { return ctl_ != nullptr; }
  int fd() const { return h_.memfd; }
  // This end's descriptors: the segment and our ends of the bells.
  const Handover& handover() const { return h_; }
  // What the peer gets (a created ring's; still owned by it): the segment and
  // the peer's ends of the bells, to send with SCM_RIGHTS.
  Handover ForPeer() const;
  // Copies of ForPeer() (CLOEXEC), owned by the caller.
  Handover Duplicate() const;
  // Once the peer has them: closes the segment's descriptor (the mapping keeps
  // the memory) and the peer's bell ends, so a lane holds fewer descriptors.
  void CloseSegmentFd();
  uint64_t capacity() const { return capacity_; }
  // Bytes of the control block that the ring itself never touches, zero in a
  // new segment, shared by both ends: the lane keeps its own per-lane state
  // there (direct_copy.h). The peer may write them at any time.
  void* spare() const;
  static constexpr size_t kSpareBytes = 2048;
  // The same spare bytes through a mapping of their own, unmapped when the
  // last copy of the pointer goes: for state that outlives this ring. A
  // created ring only, before CloseSegmentFd; null with *why on failure.
  std::shared_ptr<void> ShareSpare(std::string* why) const;

  // The producer's end. Writes iov[0..n) from `*progress` bytes in, advancing
  // it. While the ring is full it waits, ETIMEDOUT after `timeout` without room
  // (as SO_SNDTIMEO: per stall, not for the whole write); a timeout of 0 does
  // not wait at all: EAGAIN once full, *progress saying how far it got.
  int Write(const iovec* iov, size_t n, size_t* progress, std::chrono::milliseconds timeout,
            int liveness_fd);
  // The consumer's end: exactly len bytes, *got saying how many arrived (an
  // idle stream and a stalled frame differ by it). ETIMEDOUT after `timeout`
  // without a byte, per stall; 0 = wait as long as the peer lives. kEof once
  // the peer closed and every byte before its close was read.
  int Read(void* buf, size_t len, size_t* got, std::chrono::milliseconds timeout, int liveness_fd);
  // The consumer's end without waiting: up to len bytes that have arrived,
  // 0 once len were read, EAGAIN when fewer were there (*got says how many);
  // otherwise as Read (kEof, ECONNRESET, EPROTO). No system call unless the
  // producer sleeps for room.
  int ReadSome(void* buf, size_t len, size_t* got);
  // Waits until a Read would not wait - bytes arrived, the peer closed or
  // aborted - and returns 0; EPIPE once the liveness descriptor fires; the
  // same timeout rule as Read. For a reader that takes its bytes with ReadSome
  // - on another thread, maybe, while this one waits.
  int WaitReadable(std::chrono::milliseconds timeout, int liveness_fd);
  // Bytes readable now (0 after a corrupt index: the next Read says EPROTO).
  uint64_t Readable() const;

  // In-place ends, for a stager whose device copies write into and read out of
  // the ring's own bytes (gpu_stage.h: one copy per side instead of a copy into
  // a staging buffer and another into the ring). Neither mixes with Write /
  // Read while bytes are reserved or peeked.
  //
  // The producer's: the next contiguous free bytes after those already
  // reserved, up to max (fewer at the ring's end or when less is free): 0 with
  // *at and *len > 0; otherwise as Write (EAGAIN at a timeout of 0).
  int Reserve(uint64_t max, uint8_t** at, uint64_t* len, std::chrono::milliseconds timeout,
              int liveness_fd);
  // Publishes the oldest len reserved bytes (reservations commit in order).
  void Commit(uint64_t len);
  // Forgets every reservation not committed: nothing of it is published.
  void Unreserve() { reserved_ = 0; }
  // The consumer's: the next contiguous readable bytes after those already
  // peeked, up to max, left in the ring (the producer cannot reuse them until
  // Consume): 0 with *at and *len > 0; otherwise as Read, except that a
  // timeout of 0 does not wait (EAGAIN with nothing more there), as Write's.
  int Peek(uint64_t max, const uint8_t** at, uint64_t* len, std::chrono::milliseconds timeout,
           int liveness_fd);
  // Hands the oldest len peeked bytes back to the producer.
  void Consume(uint64_t len);
  // Forgets every peek not consumed: those bytes are read again.
  void Unpeek() { peeked_ = 0; }
  // The ring's bytes, to register with a GPU runtime (null for an invalid ring).
  uint8_t* data() const { return data_; }

  // An end driven by an event loop instead of a waiting thread (the target's
  // I/O pool, polled_lane.h): it watches the bell in its own wait set
  // (data_bell as the consumer, space_bell as the producer) and announces its
  // sleep with these. Each sets this end's sleeping flag and looks once more:
  // false - a read (a write) would not wait after all, do not sleep; true -
  // sleep: the peer rings the bell once it publishes. Awake clears the flag
  // after a wake-up (the bell is the caller's to quiet).
  bool SleepForData();
  // The same from any thread, by the published indices (a watcher of the
  // reader, io_pool.h): true when nothing was there; a read in progress may
  // make it say false (bytes) where the reader is about to find none.
  bool SleepForDataAnyThread();
  // Any thread: bytes published beyond the reader's published tail, or the
  // ring closed (a hint: the reader's next read decides).
  bool PendingAnyThread() const;
  bool SleepForRoom();
  void AwakeForData();
  void AwakeForRoom();

  // Either end: no more bytes from this side; wakes the peer. Idempotent.
  void Close();
  // The producer gives up on what it wrote: the consumer's next Read fails
  // (ECONNRESET) without the bytes still in the ring - a socket's RST.
  void Abort();

  Waiting waiting;

 private:
  struct Control;
  Ring(Handover h, Handover theirs, void* map, size_t map_bytes, uint64_t capacity);
  // Until ready() or the deadline or the peer's end: polls, then sleeps on bell.
  template <typename Ready>
  int Wait(Ready ready, int bell, std::atomic<uint32_t>* sleeping,
           std::chrono::milliseconds timeout, int liveness_fd);
  void Release();
  // What a read finds now past the first `skip` readable bytes: 0 with *avail
  // bytes, kNotYet, kEof, ECONNRESET, EPROTO.
  int Available(uint64_t* avail, uint64_t skip = 0);
  // The producer's side of Available: 0 with *space bytes free past head_ and
  // what is reserved, kNotYet when none, EPROTO, EPIPE once closed.
  int Room(uint64_t* space);
  // Makes head_ (the producer's) or tail_ (the consumer's) visible to the peer.
  void PublishHead();
  void PublishTail();
  // Copies k <= what is available out of the ring and publishes the room.
  void Take(uint8_t* out, uint64_t k);

  uint8_t* sync_ = nullptr;  // ThreadSanitizer builds: the segment's sync object (shm_ring.cpp)
  Handover h_;
  Handover theirs_;  // a created ring's: the peer's bell ends, until handed over
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  Control* ctl_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t capacity_ = 0;
  // This side's own index (the producer's head, the consumer's tail): the
  // peer's copy in the segment is published, never read back.
  uint64_t head_ = 0;
  uint64_t tail_ = 0;
  uint64_t reserved_ = 0;  // the producer's bytes past head_ handed out by Reserve
  uint64_t peeked_ = 0;    // the consumer's bytes past tail_ handed out by Peek
};

}  // namespace ferry_tcp::shm
