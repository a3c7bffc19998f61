// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-tcp.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_tcp::Instance.
#include "ferry/plugin_kit.hpp"
#include "instance.h"

// FENCE: every WRITE frame passes the target's fence check before a byte of it
// is applied (target_peer.h), and fence() waits for frames being applied.
// FENCE_SELECTIVE: only the named attempts' frames are dropped; the lanes, and
// the other attempts' frames on them, go on (a stalled lane aside).
FERRY_PLUGIN_KIT_ENTRY(ferry_tcp::Instance, "tcp", "0.1.0",
                       FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ |
                           FERRY_CAP_OP_WRITE | FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_FENCE |
                           FERRY_CAP_FENCE_SELECTIVE);
