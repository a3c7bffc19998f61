// SPDX-License-Identifier: Apache-2.0
#include "planner.h"

#include <algorithm>

#include "hot_path.h"

namespace ferry_tcp {

FERRY_HOT std::vector<PlannedFrame> PlanFrames(const ferry_iov_v1* iov, uint32_t n,
                                               uint8_t* local_base, uint64_t chunk_bytes,
                                               uint32_t max_items) {
  // Order is kept: overlapping WRITE items must land in the order given.
  // Items contiguous on both sides merge into `run` as they come (no copy of
  // the item list: a one-item post allocates only its frame's two vectors).
  std::vector<PlannedFrame> frames;
  PlannedFrame cur;
  const auto cut = [&](const ferry_iov_v1& it) {
    uint64_t loff = it.local_off, roff = it.remote_off, left = it.len;
    while (left > 0) {
      if (cur.bytes == chunk_bytes || cur.remote.size() == max_items) {
        frames.push_back(std::move(cur));
        cur = PlannedFrame{};
      }
      const uint64_t take = std::min(left, chunk_bytes - cur.bytes);
      cur.remote.push_back({roff, take});
      cur.local.push_back({local_base + loff, static_cast<size_t>(take)});
      cur.bytes += take;
      loff += take;
      roff += take;
      left -= take;
    }
  };
  ferry_iov_v1 run{0, 0, 0};
  for (uint32_t i = 0; i < n; ++i) {
    const ferry_iov_v1& it = iov[i];
    if (it.len == 0) continue;
    if (run.len > 0 && run.local_off + run.len == it.local_off &&
        run.remote_off + run.len == it.remote_off) {
      run.len += it.len;
      continue;
    }
    if (run.len > 0) cut(run);
    run = it;
  }
  if (run.len > 0) cut(run);
  if (cur.bytes > 0) frames.push_back(std::move(cur));
  return frames;
}

}  // namespace ferry_tcp
