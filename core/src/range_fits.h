// SPDX-License-Identifier: Apache-2.0
// The one bounds rule every piece of a transfer obeys, shared by the transfer
// lifecycle (transfer.cpp, multi_region.cpp) and the GPU shim's segment table
// (gpu_runtime.cpp).
#pragma once
#include <cstdint>

namespace ferry {
// Whether [lo, lo + len) lies in a local region of lsize bytes and [ro, ro +
// len) in a remote one of rsize, len > 0. Without branches, so a loop over
// many items stays one straight pass.
inline bool range_fits(uint64_t lo, uint64_t ro, uint64_t len, uint64_t lsize, uint64_t rsize) {
  return !((len == 0) | (lo > lsize) | (len > lsize - lo) | (ro > rsize) | (len > rsize - ro));
}
}  // namespace ferry
