// SPDX-License-Identifier: Apache-2.0
// PeerJobQueue: jobs for one peer run one after another, in the order given,
// on an AsyncRunner thread; different peers' jobs run side by side. The core's
// NOTIFYs that cannot leave at once (the control connection is busy with a
// message awaiting its MSG_ACK, or down) wait here: each used to take a
// thread of its own that waited for the connection, so a slow or stopped
// target cost the initiator a thread per landing (1,000 notified WRITEs, ~1,000
// threads). Now it costs one per peer.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "async_runner.h"

namespace ferry {

class PeerJobQueue {
 public:
  // A job runs once: with `true` on the runner after the peer's earlier jobs,
  // or with `false` on run()'s caller when no thread could be had for the
  // peer's queue (then every job queued for it meanwhile gets `false` too).
  using Job = std::function<void(bool on_runner)>;
  // `runner` must outlive this queue's jobs: destroy it first (its destructor
  // joins the threads, which empty every queue before they end).
  explicit PeerJobQueue(AsyncRunner& runner) : runner_(runner) {}
  void run(const std::string& peer, Job job);
  // Jobs waiting, of every peer (tests).
  size_t waiting();

 private:
  void drain(const std::string& peer);

  AsyncRunner& runner_;
  std::mutex mu_;
  // A peer is here while a drain runs for it (or is being started).
  std::map<std::string, std::deque<Job>> queues_;
};

}  // namespace ferry
