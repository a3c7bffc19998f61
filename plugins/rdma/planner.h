// SPDX-License-Identifier: Apache-2.0
// Turns a transfer's pieces into RDMA work requests: sorted by remote offset,
// pieces contiguous on both sides merged, pieces contiguous only remotely
// gathered/scattered through SGE lists (up to max_sge), everything cut at
// chunk_bytes. Pure, so it is tested without a device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_rdma {

struct PlannedSge {
  uint64_t local_off;
  uint32_t len;
};

struct PlannedWr {
  uint64_t remote_off;
  uint64_t len;        // sum of its SGEs
  uint32_t sge_begin;  // index into Plan::sges
  uint32_t sge_count;
};

struct Plan {
  std::vector<PlannedWr> wrs;
  std::vector<PlannedSge> sges;
};

// chunk_bytes >= 1 and < 4GiB, max_sge >= 1.
Plan MakePlan(const ferry_iov_v1* iov, size_t n_iov, uint64_t chunk_bytes, uint32_t max_sge);

}  // namespace ferry_rdma
