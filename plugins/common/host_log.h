// Logging through the host, so a plugin's lines land wherever the core sends
// its own (see format_bytes.h for what plugins/common is). No "<plugin>:"
// prefix: the core already names the backend in every log line.
#pragma once

#include <cstdarg>
#include <cstdio>

#include "ferry/plugin.h"

namespace ferry_plugin_kit {

__attribute__((format(printf, 3, 4))) inline void Log(const ferry_host_v1* host, int level,
                                                      const char* fmt, ...) {
  if (host == nullptr || host->log == nullptr) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  host->log(host->host_ctx, level, buf);
}

}  // namespace ferry_plugin_kit
