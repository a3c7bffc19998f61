// SPDX-License-Identifier: Apache-2.0
// The GPU runtime shim (see plugin.h, ferry_gpu_v1): loaded once, on first use.
#pragma once
#include "ferry/plugin.h"

namespace ferry {
// The table, or nullptr when no GPU runtime (or no visible device) is found.
// FERRY_DISABLE_GPU=1 forces nullptr (CPU-only behaviour on a GPU host).
const ferry_gpu_v1* gpu_runtime();
}  // namespace ferry
