// SPDX-License-Identifier: Apache-2.0
// Failed READs of direct lanes whose target may still be copying into our
// memory (direct_copy.h): each is completed only once its lane's gate shows no
// push under way, or the target process has exited - on a thread of its own,
// so a stopped target holds up no lane lock, deadline or I/O thread. One per
// engine, started at the first READ it has to hold; nearly every READ passes
// straight through (no push under way when its lane broke).
//
// Only peer_remove and fini wait for what it holds (both must complete their
// transfers before they return), each at most a grace period: a target still
// copying after that gets its READs completed anyway, with an error in the log
// (the same bargain the core's watchdog strikes with a backend that never
// completes).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"
#include "xfer.h"

namespace ferry_tcp {

class PushWaiter {
 public:
  explicit PushWaiter(const ferry_host_v1* host) : host_(host) {}
  ~PushWaiter() { Stop(std::chrono::milliseconds(0)); }
  PushWaiter(const PushWaiter&) = delete;
  PushWaiter& operator=(const PushWaiter&) = delete;

  // Resolves f (a direct READ: push_link set) with status/msg, now unless its
  // lane's gate shows a push under way, else once it ends. Never waits, never
  // throws.
  void Resolve(FramePtr f, int status, std::string msg);
  // Returns once no READ of the peer `owner` (its Xfer::peer) is held; those
  // still held after `grace` are completed anyway.
  void Drain(const void* owner, std::chrono::milliseconds grace);
  // Drain for every peer, then the thread ends; later READs complete at once.
  void Stop(std::chrono::milliseconds grace);
  // READs held so far (tests).
  uint64_t held() const;

 private:
  struct Held {
    FramePtr frame;
    int status;
    std::string msg;
    const void* owner;  // its peer
    bool give_up = false;
  };
  void Main();
  // Marks owner's held READs (all with owner_all) to be completed at the next look.
  void GiveUpLocked(const void* owner, bool all);

  const ferry_host_v1* const host_;
  mutable std::mutex mu_;
  std::condition_variable cv_;    // the thread's: something to look at
  std::condition_variable done_;  // Drain's: a READ was completed
  std::vector<Held> held_;
  uint64_t held_total_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ferry_tcp
