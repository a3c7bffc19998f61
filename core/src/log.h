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

namespace ferry {
enum class LogLevel { ERROR = 0, WARN = 1, INFO = 2, DEBUG = 3 };
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& who, const std::string& msg);

// Bytes outside printable ASCII become \n, \r, \t or \xHH; more than max_bytes
// of input are cut, saying how many were left out.
std::string printable(std::string_view s, size_t max_bytes = 2048);

// At most `burst` lines per key per interval; the next allowed one says how
// many were held back. Keys are bounded (the oldest goes), so a flood of
// distinct keys costs memory only up to max_keys: callers key by something the
// peer cannot vary at will (its address, a fixed reason), not by its text.
class LogLimiter {
 public:
  explicit LogLimiter(std::chrono::milliseconds interval = std::chrono::seconds(10),
                      size_t max_keys = 1024, uint32_t burst = 1)
      : interval_(interval), max_keys_(max_keys), burst_(burst) {}
  // True: log now; *held_back is how many were suppressed since the last one.
  bool allow(const std::string& key, uint64_t* held_back);

 private:
  struct Entry {
    std::chrono::steady_clock::time_point window{};  // start of the current interval
    uint32_t in_window = 0;
    uint64_t held_back = 0;
  };
  const std::chrono::milliseconds interval_;
  const size_t max_keys_;
  const uint32_t burst_;
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};
}  // namespace ferry

#define FERRY_LOG(level, who, msg)                               \
  do {                                                           \
    if (::ferry::log_enabled(::ferry::LogLevel::level))          \
      ::ferry::log_line(::ferry::LogLevel::level, (who), (msg)); \
  } while (0)
