// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-ofi.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_ofi::Instance.
#include "ferry/plugin_kit.hpp"
#include "instance.h"

namespace {

struct OfiPlugin {
  using Instance = ferry_ofi::Instance;
  static constexpr const char* kName = "ofi";
  static constexpr const char* kVersion = "0.1.0";
  // No FENCE yet (docs/backends/ofi.md, "Fencing"): a WRITE whose outcome is
  // unknown leaves the peer fenced until it is registered again.
  static constexpr uint64_t kCaps = FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ |
                                    FERRY_CAP_OP_WRITE | FERRY_CAP_TARGET_PROGRESS;
};

}  // namespace

extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    ferry::plugin_kit::MakeOps<OfiPlugin>();
