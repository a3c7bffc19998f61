// SPDX-License-Identifier: Apache-2.0
// Failed READs of direct lanes whose target may still be copying into our
// memory (direct_copy.h): each is completed only once its lane's gate shows no
// push under way, or the target process has exited - on a thread of its own,
// so a stopped target holds up no lane lock, deadline or I/O thread. One per
// engine, started at the first READ it has to hold; nearly every READ passes
// straight through (no push under way when its lane broke).
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
  // lane's gate shows a push under way, else once it ends. Never throws.
  void Resolve(FramePtr f, int status, std::string msg);
  // Held READs still waiting `grace` from now are resolved anyway (with an
  // error in the log: the engine is going); then the thread ends.
  void Stop(std::chrono::milliseconds grace);
  // READs held so far (tests).
  uint64_t held() const;

 private:
  struct Held {
    FramePtr frame;
    int status;
    std::string msg;
  };
  void Main();

  const ferry_host_v1* const host_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Held> held_;
  uint64_t held_total_ = 0;
  bool stopping_ = false;
  std::chrono::steady_clock::time_point give_up_;
  std::thread thread_;
};

}  // namespace ferry_tcp
