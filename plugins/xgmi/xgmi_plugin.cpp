// SPDX-License-Identifier: Apache-2.0
// The C ABI entry point of libferry-xgmi.so: the ops table, built and guarded by
// ferry/plugin_kit.hpp around ferry_xgmi::Instance (instance.h says what it does).
#include "ferry/plugin_kit.hpp"
#include "instance.h"

// INITIATOR_COPY: the initiator's peer copy is the whole transfer; complete()
// comes after its stream finished, so nothing lands later (no fence needed).
// NO_TARGET_CHECK: that copy goes straight into the target's allocation through
// its IPC mapping; the target's plugin never sees it, so neither bounds nor a
// deregistration are checked there (ferry-plugin-check found a WRITE after
// deregister_memory landing). Policies name xgmi with trust_descriptors: true.
// POST_MORE: the parts of a multi-region call are launched as one (instance.h).
// MULTI_PAIR (ABI 1.7): better still, such a call comes as one post
// (Instance::PostPairs); POST_MORE stays for cores older than 1.7.
// NATIVE_NOTIFY and NATIVE_NOTIFY_READ (ABI 1.8): the target's xgmi reports a
// landing once an interprocess event behind the copy fires (notify_events.h);
// a transfer it could not tell of completes FERRY_OK_NOTIFY_BY_CORE.
FERRY_PLUGIN_KIT_ENTRY(ferry_xgmi::Instance, "xgmi", "0.1.0",
                       FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE |
                           FERRY_CAP_SAME_HOST_ONLY | FERRY_CAP_INITIATOR_COPY |
                           FERRY_CAP_NO_TARGET_CHECK | FERRY_CAP_POST_MORE | FERRY_CAP_MULTI_PAIR |
                           FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_NATIVE_NOTIFY_READ);
