// SPDX-License-Identifier: Apache-2.0
#include "host_link.h"

#include <chrono>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "log.h"

namespace ferry {

namespace {

// This thread's host calls in progress, innermost first (a callback may call
// into the engine, which calls a plugin, which calls the host again).
thread_local HostLink::Use* tl_innermost = nullptr;

std::atomic<uint64_t> g_late_calls{0};

// A detached link is reused only after this many others were detached since:
// a late call through it then almost surely finds it still detached, not
// another engine's backend. Bounds the pool at about this many links beyond
// the most ever attached at once.
constexpr size_t kQuarantine = 1024;

}  // namespace

class HostPool {
 public:
  // Never destroyed: a plugin's thread may call through a link during exit.
  static HostPool& get() {
    static HostPool* pool = new HostPool;
    return *pool;
  }

  HostLink* take(const ferry_host_v1& functions) {
    std::lock_guard<std::mutex> lk(mu_);
    if (retired_.size() > kQuarantine) {
      HostLink* l = retired_.front();
      retired_.pop_front();
      return l;  // its table is the same functions (filled once, never rewritten)
    }
    HostLink& l = links_.emplace_back();
    l.table_ = functions;
    l.table_.host_ctx = &l;
    return &l;
  }

  void give_back(HostLink* l) {
    std::lock_guard<std::mutex> lk(mu_);
    retired_.push_back(l);
  }

 private:
  std::mutex mu_;
  std::deque<HostLink> links_;  // a deque: the links never move
  std::deque<HostLink*> retired_;
};

HostLink* HostLink::acquire(Backend* b, const ferry_host_v1& functions) {
  HostLink* l = HostPool::get().take(functions);
  l->told_late_.store(false);
  l->detached_.store(false);
  l->backend_.store(b, std::memory_order_seq_cst);
  return l;
}

void HostLink::detach() {
  if (detached_.exchange(true)) return;
  backend_.store(nullptr, std::memory_order_seq_cst);
  // A call that read the backend before the store counted itself before it
  // read (both sequentially consistent), so it is seen here.
  uint32_t own = 0;
  for (const Use* u = tl_innermost; u != nullptr; u = u->outer_)
    if (u->link_ == this) ++own;
  const auto began = std::chrono::steady_clock::now();
  bool told = false;
  for (unsigned spins = 0; calls_.load(std::memory_order_seq_cst) > own; ++spins) {
    if (spins < 1000) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!told && std::chrono::steady_clock::now() - began > std::chrono::seconds(1)) {
      told = true;
      log_line(LogLevel::WARN, "core",
               "a plugin thread is still inside a host call after the plugin's fini() "
               "returned; waiting for it before the backend is freed");
    }
  }
  HostPool::get().give_back(this);
}

uint64_t HostLink::late_calls() { return g_late_calls.load(std::memory_order_relaxed); }

HostLink::Use::Use(void* host_ctx, const char* what) noexcept
    : link_(static_cast<HostLink*>(host_ctx)), outer_(tl_innermost) {
  if (link_ == nullptr) return;
  link_->calls_.fetch_add(1, std::memory_order_seq_cst);
  backend_ = link_->backend_.load(std::memory_order_seq_cst);
  tl_innermost = this;
  if (backend_ != nullptr) return;
  g_late_calls.fetch_add(1, std::memory_order_relaxed);
  if (link_->told_late_.exchange(true)) return;
  try {
    log_line(LogLevel::ERROR, "core",
             std::string("a plugin called the host's ") + what +
                 "() after its fini() returned (plugin.h forbids it): ignored");
  } catch (...) {
  }
}

HostLink::Use::~Use() {
  if (link_ == nullptr) return;
  tl_innermost = outer_;
  link_->calls_.fetch_sub(1, std::memory_order_seq_cst);
}

}  // namespace ferry
