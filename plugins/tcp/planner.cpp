// SPDX-License-Identifier: Apache-2.0
#include "planner.h"

#include <algorithm>

namespace ferry_tcp {

std::vector<PlannedFrame> PlanFrames(const ferry_iov_v1* iov, uint32_t n, uint8_t* local_base,
                                     uint64_t chunk_bytes, uint32_t max_items) {
  // Order is kept: overlapping WRITE items must land in the order given.
  std::vector<ferry_iov_v1> merged;
  merged.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    if (iov[i].len == 0) continue;
    if (!merged.empty()) {
      ferry_iov_v1& last = merged.back();
      if (last.local_off + last.len == iov[i].local_off &&
          last.remote_off + last.len == iov[i].remote_off) {
        last.len += iov[i].len;
        continue;
      }
    }
    merged.push_back(iov[i]);
  }

  std::vector<PlannedFrame> frames;
  PlannedFrame cur;
  for (const ferry_iov_v1& it : merged) {
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
  }
  if (cur.bytes > 0) frames.push_back(std::move(cur));
  return frames;
}

}  // namespace ferry_tcp
