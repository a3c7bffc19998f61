// Logging through the host, so lines land wherever the core sends its own.
#pragma once

#include "ferry/plugin.h"

namespace ferry_rdma {

void Log(const ferry_host_v1* host, int level, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));

}  // namespace ferry_rdma
