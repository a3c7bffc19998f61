// SPDX-License-Identifier: Apache-2.0
// Direct copies on a same-host ring lane (issue 19 item 4): the target copies a
// request's bytes straight between the initiator's memory and its own region
// with process_vm_readv / process_vm_writev - one copy, where the rings take
// two (into the ring and out of it) - after the checks every request gets: the
// region's key and bounds, the fence, the revocation. Only the target's process
// touches the target's memory, so none of the target's rules moves to the
// initiator. The initiator names addresses in its own memory; a wrong one harms
// only itself (the kernel reads or writes it as the initiator's memory, or
// fails the copy: EFAULT refuses the frame).
//
// Set up while the rings are handed over (ring_handover.h):
// - the initiator keeps a random token in its own memory and writes the token
//   and its address into the request ring's spare bytes (Publish), and offers
//   direct copies;
// - the target takes the initiator's pid from the unix socket (SO_PEERCRED: the
//   kernel's word, not the peer's), opens a pidfd for it, reads the token from
//   that process's memory and writes it back (the kernel's ptrace-access check
//   decides: same user, Yama's ptrace_scope, seccomp). It agrees only when both
//   work and the bytes match; otherwise the lane carries bytes through the
//   rings as before.
//
// Per frame:
// - a WRITE's pull runs between the fence's BeginApply and EndApply, so a fence
//   of its attempt waits for it; the core fences a failed WRITE before the
//   application may reuse the buffer, so no pull reads it after that;
// - a READ's push into the initiator has no fence. The Gate - two words in the
//   spare bytes, a Dekker pair - lets the initiator close the lane to pushes
//   when it breaks, and a READ failed with it waits (push_waiter.h, on a thread
//   of its own: a stopped target holds nothing else) until no push is under way
//   or the target exited: no byte lands after the application was told the
//   READ is over.
// - a copy that fails having moved nothing because an address was not the
//   initiator's (EFAULT) refuses the request; any other failure (part of it
//   moved, the access gone, the process gone) closes the lane, as a lane that
//   breaks mid-payload: the initiator fails over, and fences a WRITE.
// A pid names another process once its own was reaped and the pid space went
// round. A pull checks the pidfd before and after copying (not fired after:
// the process read was the lane's, alive throughout); a push checks it before.
// Not covered: a copy blocks on the initiator's page faults, so memory that
// never faults in (a hung FUSE or NFS mapping) holds the target's pool thread;
// memory the kernel cannot reach this way (VM_IO/PFNMAP mappings,
// memfd_secret) is refused with EFAULT where the rings would have carried it.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace ferry_tcp {
class PushWaiter;
}

namespace ferry_tcp::direct {

inline constexpr size_t kTokenBytes = 16;

// Lives in the request ring's spare bytes (shm::Ring::spare); zero in a new
// segment. The initiator writes probe_*; each side writes only its word of the
// gate. Either side may scribble over all of it: each reads what it needs once
// and checks it.
struct Shared {
  uint64_t probe_addr;
  uint8_t probe_token[kTokenBytes];
  alignas(64) std::atomic<uint32_t> pushing;  // the target: a push is under way
  alignas(64) std::atomic<uint32_t> closed;   // the initiator: no more pushes
};

// The gate over one lane's pushes into the initiator.
class Gate {
 public:
  explicit Gate(void* spare) : s_(static_cast<Shared*>(spare)) {}
  // Target: false once the initiator closed the lane to pushes (push nothing).
  // True: push, then EndPush.
  bool BeginPush();
  void EndPush();
  // Initiator: no push begins after this returns; PushUnderWay then says
  // whether one that began before is still copying.
  void Close();
  bool PushUnderWay() const;

 private:
  Shared* s_;
};

// The process at the other end of a lane's unix socket.
class Process {
 public:
  // SO_PEERCRED's pid and a pidfd for it; null with *why when either is missing.
  static std::unique_ptr<Process> OfPeer(int unix_fd, std::string* why);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  // The process has exited (its pidfd fired).
  bool Exited() const;
  // Waits up to timeout_ms for the process to exit: true once it has.
  bool WaitExit(int timeout_ms) const;
  // Copies n pieces between our memory (ours[i]) and the process's
  // (theirs[i]), pairwise of equal length: Pull into ours, Push into theirs.
  // 0, or an errno value with *why (EFAULT: an address of theirs is not
  // mapped so; ESRCH: it exited); *moved: the bytes copied either way.
  int Pull(const iovec* ours, const iovec* theirs, size_t n, uint64_t* moved,
           std::string* why) const;
  int Push(const iovec* ours, const iovec* theirs, size_t n, uint64_t* moved,
           std::string* why) const;

 private:
  Process(pid_t pid, int pidfd) : pid_(pid), pidfd_(pidfd) {}
  int Copy(bool pull, const iovec* ours, const iovec* theirs, size_t n, uint64_t* moved,
           std::string* why) const;
  const pid_t pid_;
  const int pidfd_;
};

// Initiator: publishes the plugin's random token (made once, kept while the
// plugin is loaded: a target may still be probing after a handover was given
// up on) and its address in the request ring's spare bytes. False when no
// random bytes could be had (offer no direct copies).
bool PublishProbe(void* spare);

// The initiator's side of one lane's direct copies: the target's process and
// a mapping of the request ring's spare bytes of its own, so the gate outlives
// the lane's channel. Kept by the lane and by each direct READ in flight: a
// READ failed while a push may be under way waits for it on `waiter`.
class Link {
 public:
  Link(std::unique_ptr<Process> target, std::shared_ptr<void> spare, PushWaiter* waiter)
      : target_(std::move(target)), spare_(std::move(spare)), waiter_(waiter) {}
  Gate gate() const { return Gate(spare_.get()); }
  const Process& target() const { return *target_; }
  PushWaiter* waiter() const { return waiter_; }

 private:
  const std::unique_ptr<Process> target_;
  const std::shared_ptr<void> spare_;
  PushWaiter* const waiter_;
};

// Target: reads the published token from the initiator's memory and writes it
// back; true when both worked and the bytes match, else *why says what did not.
bool CheckProbe(const Process& initiator, const void* spare, std::string* why);

}  // namespace ferry_tcp::direct
