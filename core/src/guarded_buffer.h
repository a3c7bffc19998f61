// SPDX-License-Identifier: Apache-2.0
// A buffer the core hands a plugin to write text into (init's error, describe,
// counters), with as many bytes again after it filled with a pattern. A
// plugin that writes past the length it was given (plugin.h forbids it) used
// to smash the core's stack; now its overrun lands in the guard, is seen, and
// its text is ignored. An overrun longer than the guard is not caught.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace ferry {

class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t len) : len_(len), bytes_(2 * len, kGuardByte) {
    std::fill(bytes_.begin(), bytes_.begin() + static_cast<std::ptrdiff_t>(len), '\0');
  }
  char* data() { return bytes_.data(); }
  size_t size() const { return len_; }
  // False when the plugin wrote past size().
  bool intact() const {
    return std::all_of(bytes_.begin() + static_cast<std::ptrdiff_t>(len_), bytes_.end(),
                       [](char c) { return c == kGuardByte; });
  }
  // What it wrote, up to its terminator; at most size() - 1 bytes (the last
  // is the terminator's place, as if the core had written one there).
  std::string text() const {
    const auto last = bytes_.begin() + static_cast<std::ptrdiff_t>(len_ > 0 ? len_ - 1 : 0);
    return std::string(bytes_.begin(), std::find(bytes_.begin(), last, '\0'));
  }

 private:
  static constexpr char kGuardByte = '\x5a';
  size_t len_;
  std::vector<char> bytes_;
};

}  // namespace ferry
