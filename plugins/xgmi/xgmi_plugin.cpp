// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-xgmi.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_xgmi::Instance (instance.h says what it does).
#include "ferry/plugin_kit.hpp"
#include "instance.h"

namespace {

struct XgmiPlugin {
  using Instance = ferry_xgmi::Instance;
  static constexpr const char* kName = "xgmi";
  static constexpr const char* kVersion = "0.1.0";
  // INITIATOR_COPY: the initiator's peer copy is the whole transfer; complete()
  // comes after its stream finished, so nothing lands later (no fence needed).
  static constexpr uint64_t kCaps = FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE |
                                    FERRY_CAP_SAME_HOST_ONLY | FERRY_CAP_INITIATOR_COPY;
};

}  // namespace

extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    ferry::plugin_kit::MakeOps<XgmiPlugin>();
