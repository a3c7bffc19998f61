// SPDX-License-Identifier: Apache-2.0
// A condition that another thread or process makes true, looked at until a
// deadline: a bounded poll of the state itself, never a sleep standing in for
// the event.
#pragma once
#include <chrono>
#include <functional>
#include <thread>

namespace ferry::test {

inline bool eventually(const std::function<bool()>& cond,
                       std::chrono::milliseconds limit = std::chrono::seconds(10),
                       std::chrono::milliseconds step = std::chrono::milliseconds(1)) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(step);
  }
  return true;
}

}  // namespace ferry::test
