#include "log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace ferry {
namespace {
LogLevel level_from_env() {
  const char* v = std::getenv("FERRY_LOG_LEVEL");
  if (!v) return LogLevel::WARN;
  if (!strcasecmp(v, "error")) return LogLevel::ERROR;
  if (!strcasecmp(v, "info")) return LogLevel::INFO;
  if (!strcasecmp(v, "debug")) return LogLevel::DEBUG;
  return LogLevel::WARN;
}
const LogLevel g_level = level_from_env();
const char* names[] = {"error", "warn", "info", "debug"};
}  // namespace

bool log_enabled(LogLevel level) { return level <= g_level; }

void log_line(LogLevel level, const std::string& who, const std::string& msg) {
  static std::mutex mu;  // keeps lines from interleaving
  std::lock_guard<std::mutex> lk(mu);
  std::fprintf(stderr, "ferry[%s] %s: %s\n", names[static_cast<int>(level)], who.c_str(),
               msg.c_str());
}
}  // namespace ferry
