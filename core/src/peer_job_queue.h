// SPDX-License-Identifier: Apache-2.0
// PeerJobQueue: jobs for one peer run one after another on an AsyncRunner
// thread, the one with the earliest deadline first; different peers' jobs run
// side by side. The core's NOTIFYs that cannot leave at once (the control
// connection is busy with a message awaiting its MSG_ACK, or down) wait here:
// each used to take a thread of its own that waited for the connection, so a
// slow or stopped target cost the initiator a thread per landing (1,000
// notified WRITEs, ~720 threads). Now it costs one per peer. Earliest deadline
// first: a job waits for the connection at most until its own deadline, so no
// job is held past its deadline by one due later.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "async_runner.h"

namespace ferry {

class PeerJobQueue {
 public:
  using Clock = std::chrono::steady_clock;
  // A job runs once: with `true` on the runner after the peer's jobs due
  // earlier, or with `false` on run()'s caller when no thread (or memory)
  // could be had for the peer's queue (then every job queued for it meanwhile
  // gets `false` too). A job must not throw.
  using Job = std::function<void(bool on_runner)>;
  // `runner` must outlive this queue's jobs: destroy it first (its destructor
  // joins the threads, which empty every queue before they end).
  explicit PeerJobQueue(AsyncRunner& runner) : runner_(runner) {}
  // Never throws.
  void run(const std::string& peer, Clock::time_point deadline, Job job);
  // Jobs waiting, of every peer (tests).
  size_t waiting();

 private:
  using Queue = std::multimap<Clock::time_point, Job>;  // equal deadlines: in order given
  void drain(const std::string& peer);
  // mu_ not held: every job queued for the peer is told `false`, and the peer forgotten.
  void fail_all(const std::string& peer);

  AsyncRunner& runner_;
  std::mutex mu_;
  // A peer is here while a drain runs for it (or is being started).
  std::map<std::string, Queue> queues_;
};

}  // namespace ferry
