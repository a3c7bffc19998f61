// SPDX-License-Identifier: Apache-2.0
#include "peer_job_queue.h"

#include <utility>

namespace ferry {

void PeerJobQueue::run(const std::string& peer, Job job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto [it, fresh] = queues_.try_emplace(peer);
    it->second.push_back(std::move(job));
    if (!fresh) return;  // the peer's drain takes it
  }
  try {
    runner_.run([this, peer] { drain(peer); });
  } catch (...) {
    // No thread: nothing drains this peer, so whatever was queued for it (ours
    // and any added meanwhile) is told here. A later run() starts afresh.
    std::deque<Job> jobs;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = queues_.find(peer);
      jobs.swap(it->second);
      queues_.erase(it);
    }
    for (Job& j : jobs) j(false);
  }
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
      job = std::move(it->second.front());
      it->second.pop_front();
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
