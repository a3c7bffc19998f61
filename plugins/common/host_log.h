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

// post() refusing: tell the core why (ABI 1.3, ferry_xfer_v1.reason), so the
// reason reaches the application's TransferStatus::Message(), not only the log.
inline void TellRefusal(const ferry_xfer_v1* x, const char* why) {
  if (!FERRY_HAS_FIELD(ferry_xfer_v1, x, reason_len) || x->reason == nullptr ||
      x->reason_len == 0 || why == nullptr)
    return;
  std::snprintf(x->reason, x->reason_len, "%s", why);
}

}  // namespace ferry_plugin_kit
