// SPDX-License-Identifier: Apache-2.0
// At most `burst` log lines per key per interval, for warnings a remote party
// can trigger at will (refused connections): the next line let through says how
// many were held back. Keys are bounded (the stalest goes); key by something the
// peer cannot vary freely, such as its address. Thread-safe. (The core has the
// same for its own lines, core/src/log.h; a plugin keeps its own.)
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace ferry::plugin_kit {

class LogGate {
 public:
  explicit LogGate(std::chrono::milliseconds interval = std::chrono::seconds(10),
                   uint32_t burst = 20, size_t max_keys = 1024)
      : interval_(interval), burst_(burst), max_keys_(max_keys) {}

  // True: log now; *held_back says how many were suppressed before this one.
  bool Allow(const std::string& key, uint64_t* held_back) {
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lk(mu_);
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      if (entries_.size() >= max_keys_)
        entries_.erase(std::min_element(
            entries_.begin(), entries_.end(),
            [](const auto& a, const auto& b) { return a.second.window < b.second.window; }));
      it = entries_.emplace(key, Entry{now, 0, 0}).first;
    }
    Entry& e = it->second;
    if (now - e.window >= interval_) {
      e.window = now;
      e.in_window = 0;
    }
    if (e.in_window >= burst_) {
      ++e.held_back;
      return false;
    }
    ++e.in_window;
    *held_back = e.held_back;
    e.held_back = 0;
    return true;
  }

 private:
  struct Entry {
    std::chrono::steady_clock::time_point window;
    uint32_t in_window;
    uint64_t held_back;
  };
  const std::chrono::milliseconds interval_;
  const uint32_t burst_;
  const size_t max_keys_;
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

}  // namespace ferry::plugin_kit
