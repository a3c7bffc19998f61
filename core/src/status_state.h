// SPDX-License-Identifier: Apache-2.0
// A TransferStatus's shared state (ferry.hpp declares it opaque): defined here
// for status.cpp and for the transfer lifecycle, which sets a transfer's
// status up before handing it out without a std::function per hook.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "ferry/ferry.hpp"

namespace ferry {

// What a status asks of the transfer behind it: Cancel() and a wait's
// progress rounds. Held weakly (a status may outlive its transfer), so a
// transfer is its own driver and setting it costs no allocation.
struct StatusDriver {
  virtual void cancel() = 0;
  virtual void progress() = 0;

 protected:
  ~StatusDriver() = default;
};

struct TransferStatus::State {
  std::atomic<int> code{static_cast<int>(StatusCode::INIT)};
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::string message;              // guarded by mu; written once, with the final code
  std::function<void()> canceller;  // guarded by mu; taken by the first Cancel()
  // Drives the backend's completions on the waiting thread (plugin ABI 1.6
  // progress()); guarded by mu, set before the status is handed out.
  std::function<void()> progress;
  // The transfer's own hooks, instead of the two above (set_driver()):
  // cancel always, progress when driver_progress. Guarded by mu.
  std::weak_ptr<StatusDriver> driver;
  bool driven = false;  // set_driver() was called (the driver may be gone since)
  bool driver_progress = false;
  bool cancel_asked = false;  // guarded by mu
  // When the status was made (a transfer's: when it was posted) and when it
  // ended; ended is written under mu with the final code.
  const std::chrono::steady_clock::time_point created = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point ended{};
  // SetExpectedEnd's time (steady clock ns), 0 when none.
  std::atomic<int64_t> expected_end_ns{0};
};

// The transfer lifecycle's setup of a status it has not handed out yet: its
// driver (Cancel() calls driver->cancel(); with `progress`, a wait's rounds
// call driver->progress()), and SetInProgress().
void set_driver(TransferStatus& s, std::weak_ptr<StatusDriver> driver, bool progress);

// Finish(), with the end time the caller has just read (one clock read less
// on the completion path). False when the status had already ended.
bool finish_at(TransferStatus& s, StatusCode code, std::string message,
               std::chrono::steady_clock::time_point ended);

}  // namespace ferry
