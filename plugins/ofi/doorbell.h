// SPDX-License-Identifier: Apache-2.0
// A doorbell for a progress thread that has no wait fd to block on (libfabric's
// shm offers only FI_WAIT_YIELD, a spinner): one page of POSIX shared memory
// holding a futex word. The owner's progress thread sleeps on it; a local post,
// or a peer process that just queued an RMA for it, rings it. Ringing costs an
// atomic increment, plus a FUTEX_WAKE only when the owner sleeps; a sleeping
// engine costs no CPU and wakes at once.
//
// The page is named /ferry-ofi-<pid>-<token>; the name travels in the
// connection blob, the token is checked in the page before a peer uses it, and
// the owner unlinks the name when it closes.
//
// The page also says whether its owner died: the owner's progress thread holds
// a robust process-shared mutex in it for its life (HoldLife), and when a
// process dies the kernel marks the robust mutexes its threads held. A peer
// reads that mark with one load (OwnerDied), before each RMA: libfabric's shm
// provider takes a lock in the target's shared region to queue an RMA, and a
// target killed while holding it leaves every later RMA to it spinning for
// ever - with the initiator's endpoint lock held, so post() hung too (seen
// once in engine_process_test_ofi_shm's killed-target case, 2026-12-03).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace ferry_ofi {

class Doorbell {
 public:
  // The owner's doorbell (creates the page). nullptr and *why on failure.
  static std::unique_ptr<Doorbell> Create(std::string* why);
  // A peer's doorbell by name. nullptr and *why when it cannot be opened or is
  // not a ferry doorbell.
  static std::unique_ptr<Doorbell> Open(const std::string& name, std::string* why);
  ~Doorbell();
  Doorbell(const Doorbell&) = delete;
  Doorbell& operator=(const Doorbell&) = delete;

  const std::string& name() const { return name_; }

  // Owner, on the thread that lives exactly as long as the endpoint: holds
  // the life mark until ReleaseLife (or until the process dies).
  void HoldLife();
  void ReleaseLife();
  // Peer: the owner's process died holding its life mark. False for a page of
  // a ferry without the mark, and before its owner holds it.
  bool OwnerDied() const;

  // Waker: counts a ring and wakes the owner if it sleeps.
  void Ring();
  // Waker: ring only when the owner sleeps (cheap check first).
  void RingIfSleeping();

  // Owner: announce the intent to sleep; returns the count to sleep on. The
  // owner then looks for work once more and calls Sleep or Disarm.
  uint32_t Arm();
  // Owner: sleeps until a ring after Arm, or timeout_ns (< 0: no timeout).
  // False when the timeout ended it.
  bool Sleep(uint32_t armed, int64_t timeout_ns);
  void Disarm();

 private:
  struct Page;
  Doorbell() = default;
  Page* page_ = nullptr;
  std::string name_;
  bool owner_ = false;
};

}  // namespace ferry_ofi
