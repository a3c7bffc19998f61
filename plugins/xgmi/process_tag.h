// SPDX-License-Identifier: Apache-2.0
// Which process exported a region or sent a notification, as xgmi tells it to
// its peers. A bare pid does not say it: containers on one host share the boot
// id that makes the node id (so their engines are "same host"), and each may
// run its engine as pid 1. Taken for our own, a peer's region address would be
// used directly - a copy into whatever this process has at that address.
#pragma once
#include <cstdint>

namespace ferry_xgmi {

// Random per process image, and different in a forked child (the pid is
// mixed in on each call). The top bit is set, so it never equals the bare
// pid that an older xgmi wrote in the same field.
uint64_t ProcessTag();

}  // namespace ferry_xgmi
