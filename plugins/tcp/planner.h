// SPDX-License-Identifier: Apache-2.0
// Cuts a transfer's items into frames: coalesces items contiguous on both
// sides, packs small items together so a batch of many small pieces costs a few
// syscalls, and splits items bigger than a chunk so they spread over lanes.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <vector>

#include "ferry/plugin.h"
#include "wire.h"

namespace ferry_tcp {

struct PlannedFrame {
  std::vector<wire::Item> remote;  // offsets in the target's region
  std::vector<iovec> local;        // the matching local bytes, same order
  uint64_t bytes = 0;
};

// Items must already be checked against the local region; empty items are skipped.
// Each frame carries at most chunk_bytes payload and max_items items.
std::vector<PlannedFrame> PlanFrames(const ferry_iov_v1* iov, uint32_t n, uint8_t* local_base,
                                     uint64_t chunk_bytes, uint32_t max_items);

}  // namespace ferry_tcp
