// SPDX-License-Identifier: Apache-2.0
// The core's logger: one line per event on stderr, level from FERRY_LOG_LEVEL
// (error|warn|info|debug; default warn). Plugins log through the host table.
// Every line is passed through printable(): text from the network (claimed
// keys, a peer's error text) cannot forge lines or send terminal escapes.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "log_gate.h"

namespace ferry {
enum class LogLevel { ERROR = 0, WARN = 1, INFO = 2, DEBUG = 3 };
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& who, const std::string& msg);

// Bytes outside printable ASCII become \n, \r, \t or \xHH; more than max_bytes
// of input are cut, saying how many were left out.
std::string printable(std::string_view s, size_t max_bytes = 2048);

// Rate-limited warnings: ferry::plugin_kit::LogGate (plugins/common/log_gate.h),
// the same class plugins use.
using LogLimiter = ferry::plugin_kit::LogGate;
}  // namespace ferry

#define FERRY_LOG(level, who, msg)                               \
  do {                                                           \
    if (::ferry::log_enabled(::ferry::LogLevel::level))          \
      ::ferry::log_line(::ferry::LogLevel::level, (who), (msg)); \
  } while (0)
