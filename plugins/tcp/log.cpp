#include "log.h"

#include <cstdarg>
#include <cstdio>

namespace ferry_tcp {

void Log(const ferry_host_v1* host, int level, const char* fmt, ...) {
  if (host == nullptr || host->log == nullptr) return;
  char buf[1024];
  const int prefix = std::snprintf(buf, sizeof(buf), "tcp: ");
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf + prefix, sizeof(buf) - prefix, fmt, ap);
  va_end(ap);
  host->log(host->host_ctx, level, buf);
}

}  // namespace ferry_tcp
