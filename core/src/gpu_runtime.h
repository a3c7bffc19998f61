// SPDX-License-Identifier: Apache-2.0
// The GPU runtime shim (see plugin.h, ferry_gpu_v1): loaded once, on first use.
#pragma once
#include "ferry/plugin.h"

namespace ferry {
// The table, or nullptr when no GPU runtime (or no visible device) is found.
// FERRY_DISABLE_GPU=1 forces nullptr (CPU-only behaviour on a GPU host).
const ferry_gpu_v1* gpu_runtime();

// How memcpy_batch_async moves many small pieces: AUTO (the gather kernel, else
// the runtime's batched call, else one copy each) or one way only, so the
// benches measure each through the same call. Process-wide.
namespace gpu_batch {
enum class Method { AUTO, GATHER, RUNTIME, COPIES };
void set_method(Method m);
Method method();
}  // namespace gpu_batch
}  // namespace ferry
