// SPDX-License-Identifier: Apache-2.0
// The host table (ferry_host_v1) one plugin instance is given, and the Backend it
// names. plugin.h forbids calls into the host after fini() returned, yet a
// plugin whose fini did not join one of its threads makes them anyway (a
// stranger's plugin does so easily). A table inside the Backend was freed with
// it, and such a call read freed memory. A HostLink is never freed: after
// detach() a call finds no backend, is logged once and returns an error.
#pragma once
#include <atomic>
#include <cstdint>

#include "ferry/plugin.h"

namespace ferry {

struct Backend;

class HostLink {
 public:
  // A link for b from the process-wide pool. A new link's table is a copy of
  // `functions` with host_ctx the link; a reused one keeps its table, which
  // is never rewritten (a late caller may be reading it): every link is given
  // the same functions (host_services.cpp).
  static HostLink* acquire(Backend* b, const ferry_host_v1& functions);
  // After fini(): later calls find no backend. Waits for calls other threads
  // have in progress (a call of this thread's own, further up its stack, is not
  // waited for). Then the link goes back to the pool, reused only after many
  // others (late callers of this one keep finding nothing). Idempotent.
  void detach();

  ferry_host_v1* table() { return &table_; }
  // Calls that found no backend since the process started, all links together.
  static uint64_t late_calls();

  // One host call: counts itself in flight, so detach() waits for it, and
  // says which backend it is for (nullptr after detach: the call is late).
  class Use {
   public:
    explicit Use(void* host_ctx, const char* what) noexcept;
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    Backend* backend() const { return backend_; }

   private:
    friend class HostLink;
    HostLink* link_;
    Backend* backend_ = nullptr;
    Use* outer_;  // this thread's enclosing call, if any
  };

 private:
  friend class HostPool;
  ferry_host_v1 table_{};
  std::atomic<Backend*> backend_{nullptr};
  std::atomic<uint32_t> calls_{0};
  std::atomic<bool> told_late_{false};
  std::atomic<bool> detached_{true};
};

}  // namespace ferry
