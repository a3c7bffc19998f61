// SPDX-License-Identifier: Apache-2.0
// The target's side of fencing: a FENCE from an initiator names attempts per
// backend; each backend's fence() makes sure none of their bytes lands from now
// on and says what had landed (plugin.h). The initiator's side is fence.cpp.
#include <chrono>
#include <map>

#include "engine_impl.h"

namespace ferry {

std::vector<FenceResult> serve_fence(const BackendSet& backends, const std::string& peer,
                                     const std::vector<FenceEntry>& entries) {
  // How long a plugin may take to make its lanes pass their fence check.
  constexpr auto kServeFor = std::chrono::seconds(5);
  std::vector<FenceResult> out(entries.size());
  std::map<std::string, std::vector<size_t>> by_backend;
  for (size_t i = 0; i < entries.size(); ++i) {
    out[i] = {entries[i].attempt, FenceState::UNSUPPORTED, 0};
    by_backend[entries[i].backend].push_back(i);
  }
  for (const auto& [name, idx] : by_backend) {
    BackendPtr b = backends.find(name);
    BackendPtr retired = b ? nullptr : backends.find_retired(name);
    if (!b) {
      // Not loaded here now. Removed: once its fini has returned (the life lock
      // is free) its lanes are gone and nothing more of it lands, though part may
      // have. Never loaded here: none of it could land.
      FenceState st = FenceState::NONE;
      if (retired) {
        std::shared_lock life(retired->life);
        st = FenceState::PARTIAL;
      }
      for (size_t i : idx) out[i].state = st;
      continue;
    }
    if (!(b->caps & FERRY_CAP_FENCE)) continue;
    std::vector<uint64_t> ids;
    for (size_t i : idx) ids.push_back(entries[i].attempt);
    std::vector<ferry_fence_result_v1> res(ids.size());
    // On host->now_ns()'s clock (steady_clock).
    const uint64_t deadline =
        static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  (std::chrono::steady_clock::now() + kServeFor).time_since_epoch())
                                  .count());
    int rc;
    {
      std::shared_lock life(b->life);
      if (b->removed) continue;
      rc = b->ops->fence(b->ctx, peer.c_str(), ids.data(), ids.size(), deadline, res.data());
    }
    for (size_t k = 0; k < idx.size(); ++k) {
      FenceResult& r = out[idx[k]];
      if (rc != FERRY_OK || res[k].state > FERRY_FENCE_WHOLE) {
        r.state = FenceState::UNKNOWN;
        continue;
      }
      r.state = static_cast<FenceState>(res[k].state);
      r.landed = res[k].landed_bytes;
    }
  }
  return out;
}

}  // namespace ferry
