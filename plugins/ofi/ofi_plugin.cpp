// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-ofi.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_ofi::Instance.
#include "ferry/plugin_kit.hpp"
#include "instance.h"

// No FENCE yet (docs/backends/ofi.md, "Fencing"): a WRITE whose outcome is
// unknown leaves the peer fenced until it is registered again.
FERRY_PLUGIN_KIT_ENTRY(ferry_ofi::Instance, "ofi", "0.1.0",
                       FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ |
                           FERRY_CAP_OP_WRITE | FERRY_CAP_TARGET_PROGRESS);
