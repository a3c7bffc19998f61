// SPDX-License-Identifier: Apache-2.0
// TransferStatus: one transfer's shared, thread-safe state; the first final code sticks.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "ferry/ferry.hpp"
#include "hot_path.h"
#include "status_state.h"

namespace ferry {

namespace {
// A wait's progress round: the transfer's driver, or a hook set with
// SetProgress(), or nothing.
struct Hook {
  std::function<void()> fn;
  std::weak_ptr<StatusDriver> driver;
  bool on = false;
  explicit operator bool() const { return on; }
  void operator()() const {
    if (fn)
      fn();
    else if (auto d = driver.lock())
      d->progress();
  }
};

Hook hook_of(const TransferStatus::State& st) {
  std::lock_guard<std::mutex> lk(st.mu);
  if (st.driver_progress) return {{}, st.driver, true};
  return {st.progress, {}, static_cast<bool>(st.progress)};
}

bool is_final(int c) {
  return c != static_cast<int>(StatusCode::INIT) && c != static_cast<int>(StatusCode::IN_PROGRESS);
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// How long Wait()/WaitFor() poll the code before they block. A blocked waiter
// is woken through a futex, which cost 5-20 us on the GPU host (issue 19) -
// more than a 64 KiB GPU copy takes; polling first sees a short transfer end
// at once. FERRY_WAIT_SPIN_US sets it (0: block at once); read once.
std::chrono::microseconds wait_spin() {
  static const std::chrono::microseconds spin = [] {
    const char* v = std::getenv("FERRY_WAIT_SPIN_US");
    if (v == nullptr || *v == '\0') return std::chrono::microseconds(100);
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || n < 0) return std::chrono::microseconds(100);
    return std::chrono::microseconds(std::min<long long>(n, 1000000));
  }();
  return spin;
}

// True when the code became final within `spin`. Each round also runs
// `progress` (when set), so a backend that can report a finished transfer on
// this thread does so without a hand-off; it runs at least once, also when
// the spin is 0.
FERRY_HOT bool spin_for(const std::atomic<int>& code, std::chrono::microseconds spin,
                        const Hook& progress) {
  if (progress) {
    progress();
    if (is_final(code.load(std::memory_order_acquire))) return true;
  }
  if (spin.count() <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + spin;
  for (unsigned i = 1;; ++i) {
    if (is_final(code.load(std::memory_order_acquire))) return true;
    if (progress)
      progress();
    else
      cpu_relax();
    if (i % 64 == 0) {
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::yield();  // a waiter on a busy core gives the completer its turn
    }
  }
}

// The wait spin, at most `limit`.
bool spin_until_final(const std::atomic<int>& code, std::chrono::microseconds limit,
                      const Hook& progress) {
  return spin_for(code, std::min(wait_spin(), limit), progress);
}

// After the plain spin: a transfer due within kHorizon (and before `until`) is
// slept for until kEarly before it is due, then polled until the wait spin
// after that. True when it ended meanwhile. Waking on time needs no futex
// wake-up from the thread that completes it (5-8 us on the GPU host, 20-40 on
// a VM), and the poll runs the backend's progress() on this thread.
constexpr auto kHorizon = std::chrono::seconds(1);
constexpr auto kEarly = std::chrono::microseconds(100);
bool await_expected_end(TransferStatus::State& st, std::chrono::steady_clock::time_point until,
                        const Hook& progress) {
  const int64_t e = st.expected_end_ns.load(std::memory_order_relaxed);
  if (e == 0 || wait_spin().count() == 0) return false;  // no estimate, or spinning is off
  const std::chrono::steady_clock::time_point end{std::chrono::nanoseconds(e)};
  auto now = std::chrono::steady_clock::now();
  if (end > until || end - now > kHorizon) return false;
  auto done = [&] { return is_final(st.code.load(std::memory_order_acquire)); };
  if (end - kEarly > now) {
    std::unique_lock<std::mutex> lk(st.mu);
    if (st.cv.wait_until(lk, end - kEarly, done)) return true;
    now = std::chrono::steady_clock::now();
  }
  const auto poll_until = std::min(until, std::max(end, now) + wait_spin());
  if (poll_until <= now) return done();
  return spin_for(st.code, std::chrono::duration_cast<std::chrono::microseconds>(poll_until - now),
                  progress);
}
}  // namespace

const char* to_string(StatusCode c) {
  switch (c) {
    case StatusCode::SUCCESS:
      return "SUCCESS";
    case StatusCode::INIT:
      return "INIT";
    case StatusCode::IN_PROGRESS:
      return "IN_PROGRESS";
    case StatusCode::ERR_INVALID_ARGS:
      return "ERR_INVALID_ARGS";
    case StatusCode::ERR_NOT_FOUND:
      return "ERR_NOT_FOUND";
    case StatusCode::ERR_RDMA_OP:
      return "ERR_RDMA_OP";
    case StatusCode::ERR_BAD_STATE:
      return "ERR_BAD_STATE";
    case StatusCode::ERR_GPU_OP:
      return "ERR_GPU_OP";
    case StatusCode::ERR_TIMEOUT:
      return "ERR_TIMEOUT";
    case StatusCode::ERR_TRANSPORT:
      return "ERR_TRANSPORT";
    case StatusCode::ERR_OUTCOME_UNKNOWN:
      return "ERR_OUTCOME_UNKNOWN";
    case StatusCode::ERR_CANCELLED:
      return "ERR_CANCELLED";
  }
  return "UNKNOWN";
}

const char* to_string(MemoryLocation l) {
  switch (l) {
    case MemoryLocation::CPU:
      return "cpu";
    case MemoryLocation::GPU:
      return "gpu";
    case MemoryLocation::UNKNOWN:
      break;
  }
  return "unknown";
}

TransferStatus::TransferStatus() : state_(std::make_shared<State>()) {}

StatusCode TransferStatus::Code() const {
  return static_cast<StatusCode>(state_->code.load(std::memory_order_acquire));
}

std::string TransferStatus::Message() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->message;
}

bool TransferStatus::InProgress() const {
  return !is_final(state_->code.load(std::memory_order_acquire));
}

bool TransferStatus::Failed() const {
  int c = state_->code.load(std::memory_order_acquire);
  return is_final(c) && c != static_cast<int>(StatusCode::SUCCESS);
}

std::chrono::nanoseconds TransferStatus::Elapsed() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  const bool ended = is_final(state_->code.load(std::memory_order_relaxed));
  return (ended ? state_->ended : std::chrono::steady_clock::now()) - state_->created;
}

void TransferStatus::SetInProgress() {
  int expected = static_cast<int>(StatusCode::INIT);
  state_->code.compare_exchange_strong(expected, static_cast<int>(StatusCode::IN_PROGRESS),
                                       std::memory_order_acq_rel);
}

bool TransferStatus::Finish(StatusCode code, std::string message) {
  return finish_at(*this, code, std::move(message), std::chrono::steady_clock::now());
}

FERRY_HOT bool finish_at(TransferStatus& s, StatusCode code, std::string message,
                         std::chrono::steady_clock::time_point ended) {
  TransferStatus::State& st = *s.state();
  {
    std::lock_guard<std::mutex> lk(st.mu);
    if (is_final(st.code.load(std::memory_order_relaxed))) return false;
    st.message = std::move(message);
    st.ended = ended;
    st.code.store(static_cast<int>(code), std::memory_order_release);
  }
  st.cv.notify_all();
  return true;
}

void TransferStatus::SetProgress(std::function<void()> progress) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->progress = std::move(progress);
}

FERRY_HOT void set_driver(TransferStatus& s, std::weak_ptr<StatusDriver> driver, bool progress) {
  TransferStatus::State& st = *s.state();
  {
    std::lock_guard<std::mutex> lk(st.mu);
    st.driver = std::move(driver);
    st.driven = true;
    st.driver_progress = progress;
  }
  s.SetInProgress();
}

void TransferStatus::Progress() const {
  if (!InProgress()) return;
  if (const Hook hook = hook_of(*state_)) hook();
}

void TransferStatus::SetExpectedEnd(std::chrono::steady_clock::time_point end) {
  state_->expected_end_ns.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(end.time_since_epoch()).count(),
      std::memory_order_relaxed);
}

void TransferStatus::SetCanceller(std::function<void()> cancel) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->canceller = std::move(cancel);
}

bool TransferStatus::Cancel(std::string* why) const {
  std::function<void()> fn;
  std::weak_ptr<StatusDriver> driver;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    const int c = state_->code.load(std::memory_order_acquire);
    if (is_final(c)) {
      if (why)
        *why = std::string("the transfer had already ended (") +
               to_string(static_cast<StatusCode>(c)) + "): nothing to cancel";
      return false;
    }
    if (state_->cancel_asked) {
      if (why) *why = "cancel was already asked; the transfer ends once nothing more can land";
      return true;
    }
    if (!state_->canceller && !state_->driven) {
      if (why) *why = "this status cannot be cancelled (it is not an engine's transfer)";
      return false;
    }
    state_->cancel_asked = true;
    fn = std::move(state_->canceller);
    driver = state_->driver;
  }
  if (fn)
    fn();
  else if (auto d = driver.lock())
    d->cancel();
  return true;
}

FERRY_HOT StatusCode TransferStatus::Wait() const {
  if (!InProgress()) return Code();
  const Hook hook = hook_of(*state_);
  if (spin_until_final(state_->code, std::chrono::microseconds::max(), hook) ||
      await_expected_end(*state_, std::chrono::steady_clock::time_point::max(), hook))
    return Code();
  std::unique_lock<std::mutex> lk(state_->mu);
  state_->cv.wait(lk, [&] { return is_final(state_->code.load(std::memory_order_acquire)); });
  return Code();
}

namespace {
// A timeout the steady clock cannot add to now (centuries): a wait without
// end, as milliseconds::max() is. start + timeout would wrap into the past.
bool endless(std::chrono::steady_clock::time_point start, std::chrono::milliseconds timeout) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::time_point::max() - start) <= timeout;
}
}  // namespace

bool TransferStatus::WaitFor(std::chrono::milliseconds timeout) const {
  if (!InProgress()) return true;
  if (timeout.count() <= 0) {  // a poll: one round of the backend's progress
    Progress();
    return !InProgress();
  }
  const auto start = std::chrono::steady_clock::now();
  const bool long_wait = timeout >= std::chrono::hours(1);
  const Hook hook = hook_of(*state_);
  if (spin_until_final(
          state_->code,
          long_wait ? std::chrono::microseconds::max() : std::chrono::microseconds(timeout),
          hook) ||
      await_expected_end(*state_,
                         long_wait ? std::chrono::steady_clock::time_point::max() : start + timeout,
                         hook))
    return true;
  std::unique_lock<std::mutex> lk(state_->mu);
  auto done = [&] { return is_final(state_->code.load(std::memory_order_acquire)); };
  if (endless(start, timeout)) {
    state_->cv.wait(lk, done);
    return true;
  }
  return state_->cv.wait_until(lk, start + timeout, done);
}

bool wait_all(const std::vector<TransferStatus>& statuses, std::chrono::milliseconds timeout) {
  const auto start = std::chrono::steady_clock::now();
  if (endless(start, timeout)) {
    for (const auto& s : statuses) s.Wait();
    return true;
  }
  auto end = start + timeout;
  for (const auto& s : statuses) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        end - std::chrono::steady_clock::now());
    if (!s.WaitFor(std::max(left, std::chrono::milliseconds(0)))) return false;
  }
  return true;
}

}  // namespace ferry
