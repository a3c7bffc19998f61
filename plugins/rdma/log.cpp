#include "log.h"

#include <cstdarg>
#include <cstdio>

namespace ferry_rdma {

void Log(const ferry_host_v1* host, int level, const char* fmt, ...) {
  if (host == nullptr || host->log == nullptr) return;
  // No "rdma:" prefix: the core already names the backend in every log line.
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  host->log(host->host_ctx, level, buf);
}

}  // namespace ferry_rdma
