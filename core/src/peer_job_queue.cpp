// SPDX-License-Identifier: Apache-2.0
#include "peer_job_queue.h"

#include <utility>

namespace ferry {

void PeerJobQueue::run(const std::string& peer, Clock::time_point deadline, Job job) {
  // Its node is made first, so that running out of memory leaves queues_ as it was.
  Queue one;
  try {
    one.emplace(deadline, std::move(job));
  } catch (...) {  // (nothing was moved: the node could not be made)
    if (job) job(false);
    return;
  }
  bool fresh = false;
  try {
    std::lock_guard<std::mutex> lk(mu_);
    // A peer stays in queues_ from its drain's start until that drain found
    // its queue empty: a new entry means no drain runs for it.
    auto [it, created] = queues_.try_emplace(peer);
    it->second.insert(one.extract(one.begin()));  // moves the node: no allocation
    fresh = created;
  } catch (...) {  // no memory for the peer's entry: nothing changed
    for (auto& [d, j] : one) j(false);
    return;
  }
  if (!fresh) return;  // the peer's drain takes it
  try {
    runner_.run([this, peer] { drain(peer); });
  } catch (...) {
    // No thread: nothing drains this peer, so whatever was queued for it (ours
    // and any added meanwhile) is told here. A later run() starts afresh.
    fail_all(peer);
  }
}

void PeerJobQueue::fail_all(const std::string& peer) {
  Queue jobs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = queues_.find(peer);
    if (it == queues_.end()) return;
    jobs.swap(it->second);
    queues_.erase(it);
  }
  for (auto& [deadline, j] : jobs) j(false);
}

void PeerJobQueue::drain(const std::string& peer) {
  for (;;) {
    Job job;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = queues_.find(peer);
      if (it->second.empty()) {
        queues_.erase(it);
        return;
      }
      auto first = it->second.begin();  // the earliest deadline
      job = std::move(first->second);
      it->second.erase(first);
    }
    job(true);
  }
}

size_t PeerJobQueue::waiting() {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& [peer, jobs] : queues_) n += jobs.size();
  return n;
}

}  // namespace ferry
