// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-tcp.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_tcp::Instance.
#include "ferry/plugin_kit.hpp"
#include "instance.h"

namespace {

struct TcpPlugin {
  using Instance = ferry_tcp::Instance;
  static constexpr const char* kName = "tcp";
  static constexpr const char* kVersion = "0.1.0";
  // FENCE: every WRITE frame passes the target's fence check before a byte of it
  // is applied (target_peer.h), and fence() waits for frames being applied.
  static constexpr uint64_t kCaps = FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ |
                                    FERRY_CAP_OP_WRITE | FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_FENCE;
};

}  // namespace

extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    ferry::plugin_kit::MakeOps<TcpPlugin>();
