#include "log.h"

#include <atomic>
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
std::atomic<int> g_level{static_cast<int>(level_from_env())};
const char* names[] = {"error", "warn", "info", "debug"};
}  // namespace

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= g_level.load(std::memory_order_relaxed);
}

bool set_log_level(const std::string& name) {
  static const char* names_[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; ++i)
    if (!strcasecmp(name.c_str(), names_[i])) {
      g_level.store(i, std::memory_order_relaxed);
      return true;
    }
  return false;
}

void log_line(LogLevel level, const std::string& who, const std::string& msg) {
  static std::mutex mu;  // keeps lines from interleaving
  std::lock_guard<std::mutex> lk(mu);
  std::fprintf(stderr, "ferry[%s] %s: %s\n", names[static_cast<int>(level)], who.c_str(),
               msg.c_str());
}
}  // namespace ferry
