// SPDX-License-Identifier: Apache-2.0
#include "planner.h"

#include <algorithm>

namespace ferry_rdma {

Plan MakePlan(const ferry_iov_v1* iov, size_t n_iov, uint64_t chunk_bytes, uint32_t max_sge) {
  std::vector<ferry_iov_v1> items(iov, iov + n_iov);
  std::stable_sort(items.begin(), items.end(), [](const ferry_iov_v1& a, const ferry_iov_v1& b) {
    return a.remote_off != b.remote_off ? a.remote_off < b.remote_off : a.local_off < b.local_off;
  });
  Plan plan;
  PlannedWr* cur = nullptr;
  for (const auto& it : items) {
    uint64_t loff = it.local_off, roff = it.remote_off, left = it.len;
    while (left > 0) {
      bool appended = false;
      if (cur != nullptr && roff == cur->remote_off + cur->len && cur->len < chunk_bytes) {
        const uint64_t take = std::min(left, chunk_bytes - cur->len);
        PlannedSge& last = plan.sges.back();
        if (last.local_off + last.len == loff) {
          last.len += static_cast<uint32_t>(take);
          appended = true;
        } else if (cur->sge_count < max_sge) {
          plan.sges.push_back({loff, static_cast<uint32_t>(take)});
          ++cur->sge_count;
          appended = true;
        }
        if (appended) {
          cur->len += take;
          loff += take;
          roff += take;
          left -= take;
          continue;
        }
      }
      const uint64_t take = std::min(left, chunk_bytes);
      plan.wrs.push_back({roff, take, static_cast<uint32_t>(plan.sges.size()), 1});
      plan.sges.push_back({loff, static_cast<uint32_t>(take)});
      cur = &plan.wrs.back();
      loff += take;
      roff += take;
      left -= take;
    }
  }
  return plan;
}

}  // namespace ferry_rdma
