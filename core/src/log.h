// The core's logger: one line per event on stderr, level from FERRY_LOG_LEVEL
// (error|warn|info|debug; default warn). Plugins log through the host table.
#pragma once
#include <string>

namespace ferry {
enum class LogLevel { ERROR = 0, WARN = 1, INFO = 2, DEBUG = 3 };
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& who, const std::string& msg);
}  // namespace ferry

#define FERRY_LOG(level, who, msg)                                             \
  do {                                                                         \
    if (::ferry::log_enabled(::ferry::LogLevel::level))                        \
      ::ferry::log_line(::ferry::LogLevel::level, (who), (msg));               \
  } while (0)
