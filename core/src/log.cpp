// SPDX-License-Identifier: Apache-2.0
#include "log.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "hex.h"

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

std::string printable(std::string_view s, size_t max_bytes) {
  const size_t n = std::min(s.size(), max_bytes);
  std::string out;
  out.reserve(n + 16);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      out += "\\x";
      out += kHexDigits[c >> 4];
      out += kHexDigits[c & 15];
    }
  }
  if (s.size() > n) out += "...(" + std::to_string(s.size() - n) + " more bytes)";
  return out;
}

void log_line(LogLevel level, const std::string& who, const std::string& msg) {
  const std::string w = printable(who, 256), m = printable(msg);
  static std::mutex mu;  // keeps lines from interleaving
  std::lock_guard<std::mutex> lk(mu);
  std::fprintf(stderr, "ferry[%s] %s: %s\n", names[static_cast<int>(level)], w.c_str(), m.c_str());
}

}  // namespace ferry
