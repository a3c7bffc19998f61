// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-rdma.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_rdma::Instance.
#include "ferry/plugin_kit.hpp"
#include "instance.h"

namespace {

struct RdmaPlugin {
  using Instance = ferry_rdma::Instance;
  static constexpr const char* kName = "rdma";
  static constexpr const char* kVersion = "0.1.0";
  // FENCE: the target retires the QPs serving the fenced initiator (Fence()).
  static constexpr uint64_t kCaps = FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ |
                                    FERRY_CAP_OP_WRITE | FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_FENCE;
};

}  // namespace

extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    ferry::plugin_kit::MakeOps<RdmaPlugin>();
