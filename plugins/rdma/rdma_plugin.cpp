// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-rdma.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_rdma::Instance.
#include "ferry/plugin_kit.hpp"
#include "instance.h"

// FENCE: the target retires the QPs serving the fenced initiator (Fence()).
// Not FENCE_SELECTIVE: that fails every other transfer in flight on those QPs,
// so the core does not fence for a cancel here (plugin.h).
FERRY_PLUGIN_KIT_ENTRY(ferry_rdma::Instance, "rdma", "0.1.0",
                       FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ |
                           FERRY_CAP_OP_WRITE | FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_FENCE);
