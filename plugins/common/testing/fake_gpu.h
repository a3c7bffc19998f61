// SPDX-License-Identifier: Apache-2.0
// A GPU runtime for tests on hosts without one: "device memory" is host memory,
// but copies are really asynchronous in the sense that matters - a copy queued
// on a stream happens only when something waits for it (event_sync/query of a
// later event, stream_sync). A stager that reads a staging buffer before waiting
// for the copy into it sees stale bytes, and a test catches that.
// The IPC calls (xgmi) pass the allocation's address as its handle: importer
// and exporter are one process in these tests.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_test {

class FakeGpu {
 public:
  FakeGpu() {
    t_.struct_size = sizeof(t_);
    t_.vendor = FERRY_GPU_CUDA;
    t_.gpu_ctx = this;
    t_.device_count = 2;
    // The current device is the calling thread's, as in CUDA and HIP.
    t_.set_device = [](void* c, int32_t d) {
      if (d < 0 || d >= 2 || Self(c)->fail_set_device.load()) return FERRY_ERR_GPU;
      t_device_ = d;
      return FERRY_OK;
    };
    t_.stream_create = [](void* c, void** s) {
      auto* self = Self(c);
      std::lock_guard lk(self->mu_);
      self->streams_.emplace_back();
      self->streams_.back().device = t_device_;
      *s = &self->streams_.back();
      return FERRY_OK;
    };
    t_.stream_destroy = [](void* c, void* s) { return Self(c)->Run(s, nullptr); };
    t_.stream_sync = [](void* c, void* s) { return Self(c)->Run(s, nullptr); };
    t_.memcpy_async = [](void* c, void* d, const void* src, size_t n, void* s) {
      return Self(c)->Queue(s, {d, src, n, nullptr});
    };
    t_.event_create = [](void* c, void** e) {
      auto* self = Self(c);
      std::lock_guard lk(self->mu_);
      self->events_.push_back(new Event{});
      *e = self->events_.back();
      return FERRY_OK;
    };
    t_.event_destroy = [](void*, void*) { return FERRY_OK; };  // freed with the FakeGpu
    t_.event_record = [](void* c, void* e, void* s) {
      static_cast<Event*>(e)->stream = static_cast<Stream*>(s);
      return Self(c)->Queue(s, {nullptr, nullptr, 0, static_cast<Event*>(e)});
    };
    t_.event_sync = [](void* c, void* e) {
      auto* ev = static_cast<Event*>(e);
      return ev->stream ? Self(c)->Run(ev->stream, ev) : FERRY_OK;
    };
    // Every other query says "not yet" (1), so pollers see both answers.
    t_.event_query = [](void* c, void* e) {
      if (Self(c)->queries_.fetch_add(1) % 2 == 0 || Self(c)->hold_queries.load()) return 1;
      return Self(c)->t_.event_sync(c, e);
    };
    t_.stream_query = [](void* c, void* s) {
      if (Self(c)->queries_.fetch_add(1) % 2 == 0) return 1;
      return Self(c)->Run(s, nullptr);
    };
    t_.mem_range = [](void* c, const void* p, void** base, size_t* size) {
      *base = const_cast<void*>(p);
      *size = Self(c)->allocation_bytes.load();  // 0: unknown
      return FERRY_OK;
    };
    t_.ipc_get_handle = [](void*, const void* base, uint8_t handle[64]) {
      std::memset(handle, 0, 64);
      std::memcpy(handle, &base, sizeof base);
      return FERRY_OK;
    };
    t_.ipc_open = [](void* c, const uint8_t handle[64], int32_t, void** p) {
      ++Self(c)->ipc_opens;
      std::memcpy(p, handle, sizeof *p);
      return FERRY_OK;
    };
    t_.ipc_close = [](void* c, void*) {
      ++Self(c)->ipc_closes;
      return FERRY_OK;
    };
    // Interprocess events (ABI 1.8): an event's address is its handle.
    t_.event_create_ipc = [](void* c, void** e) { return Self(c)->t_.event_create(c, e); };
    t_.ipc_event_handle = [](void*, void* e, uint8_t handle[64]) {
      std::memset(handle, 0, 64);
      std::memcpy(handle, &e, sizeof e);
      return FERRY_OK;
    };
    t_.ipc_event_open = [](void*, const uint8_t handle[64], void** e) {
      std::memcpy(e, handle, sizeof *e);
      return FERRY_OK;
    };
    t_.host_alloc = [](void* c, void** p, size_t n) {
      *p = std::malloc(n);
      Self(c)->pinned_allocs.fetch_add(1);
      return *p ? FERRY_OK : FERRY_ERR_NO_MEMORY;
    };
    t_.host_free = [](void*, void* p) {
      std::free(p);
      return FERRY_OK;
    };
    // Pinning memory the caller mapped (ABI 1.10): counted, so a test sees
    // that every range pinned was unpinned, and refused while fail_register.
    t_.host_register = [](void* c, void* p, size_t n) {
      if (p == nullptr || n == 0 || Self(c)->fail_register.load()) return FERRY_ERR_GPU;
      Self(c)->registrations.fetch_add(1);
      Self(c)->registered.fetch_add(1);
      return FERRY_OK;
    };
    t_.host_unregister = [](void* c, void* p) {
      if (p == nullptr) return FERRY_ERR_GPU;
      Self(c)->registered.fetch_sub(1);
      return FERRY_OK;
    };
    t_.last_error = [](void*) { return "fake GPU: copy refused (test)"; };
    // memcpy_batch_async left NULL: the stager loops over memcpy_async.
  }
  ~FakeGpu() {
    for (Event* e : events_) delete e;
  }
  const ferry_gpu_v1* table() const { return &t_; }
  // A runtime with copy_segments_async (ABI 1.9; before any plugin sees the
  // table): checks every piece first (FERRY_ERR_INVALID_ARGS, nothing queued),
  // then queues each as a copy (fail_after_copies counts them). While
  // segments_unsupported is set it answers FERRY_ERR_UNSUPPORTED.
  void WithSegments() {
    t_.copy_segments_async = [](void* c, uint32_t op, const ferry_gpu_seg_v1* segs, size_t n,
                                void* s) {
      auto* self = Self(c);
      self->segment_calls.fetch_add(1);
      if (self->segments_unsupported.load()) return FERRY_ERR_UNSUPPORTED;
      for (size_t g = 0; g < n; ++g)
        for (uint64_t i = 0; i < segs[g].n_iov; ++i) {
          const ferry_iov_v1& v = segs[g].iov[i];
          if (v.len == 0 || v.local_off > segs[g].local_size ||
              v.len > segs[g].local_size - v.local_off || v.remote_off > segs[g].remote_size ||
              v.len > segs[g].remote_size - v.remote_off)
            return FERRY_ERR_INVALID_ARGS;
        }
      for (size_t g = 0; g < n; ++g)
        for (uint64_t i = 0; i < segs[g].n_iov; ++i) {
          const ferry_iov_v1& v = segs[g].iov[i];
          char* l = segs[g].local_base + v.local_off;
          char* r = segs[g].remote_base + v.remote_off;
          const bool write = op == FERRY_OP_WRITE;
          if (int rc = self->Queue(s, {write ? r : l, write ? l : r, v.len, nullptr});
              rc != FERRY_OK)
            return rc;
        }
      return FERRY_OK;
    };
  }
  std::atomic<int> segment_calls{0};
  std::atomic<bool> segments_unsupported{false};
  // A runtime without interprocess events (before any plugin sees the table).
  void WithoutInterprocessEvents() {
    t_.event_create_ipc = nullptr;
    t_.ipc_event_handle = nullptr;
    t_.ipc_event_open = nullptr;
  }

  // Copies and event records queued on a stream of another device than the
  // calling thread's current one (a kernel launched so fails on a real GPU,
  // and a stream made so belongs to the wrong device for good).
  std::atomic<uint64_t> wrong_device_calls{0};
  std::atomic<bool> fail_set_device{false};  // set_device refuses every device
  std::atomic<uint64_t> copied{0};           // bytes moved by copies that ran
  std::atomic<int> ipc_opens{0};             // ipc_open calls (peers' regions mapped)
  std::atomic<int> ipc_closes{0};            // ipc_close calls
  std::atomic<int> pinned_allocs{0};         // host_alloc calls
  std::atomic<int> fail_after_copies{-1};    // >= 0: copies after this many fail
  std::atomic<bool> hold_queries{false};     // event_query says "not yet" and runs nothing
  std::atomic<int> registrations{0};         // host_register calls that pinned
  std::atomic<int> registered{0};            // of them, not unregistered yet
  std::atomic<bool> fail_register{false};    // host_register refuses
  // What mem_range says an allocation spans from the pointer asked about
  // (0: unknown, as before).
  std::atomic<size_t> allocation_bytes{0};
  // A runtime that cannot pin memory it did not allocate (before ABI 1.10).
  void WithoutHostRegister() {
    t_.host_register = nullptr;
    t_.host_unregister = nullptr;
  }
  uint64_t queries() const { return queries_.load(); }  // event and stream queries so far
  // Until Release(): every query says "not yet" and every synchronize waits,
  // so copies stay in flight for as long as a test needs them to.
  void Hold() {
    std::lock_guard lk(hold_mu_);
    held_ = true;
    hold_queries = true;
  }
  void Release() {
    {
      std::lock_guard lk(hold_mu_);
      held_ = false;
      hold_queries = false;
    }
    hold_cv_.notify_all();
  }
  // Streams made while `device` was the current one.
  size_t streams_on(int device) {
    std::lock_guard lk(mu_);
    size_t n = 0;
    for (const Stream& s : streams_) n += s.device == device;
    return n;
  }
  // Copies queued and not yet run, on every stream.
  size_t queued() {
    std::lock_guard lk(mu_);
    size_t n = 0;
    for (const Stream& s : streams_)
      for (const Op& o : s.ops) n += o.mark == nullptr;
    return n;
  }

 private:
  struct Event;
  struct Op {
    void* dst;
    const void* src;
    size_t n;
    Event* mark;  // non-null: an event record, not a copy
  };
  struct Stream {
    std::deque<Op> ops;
    int device = 0;  // current when it was made
  };
  struct Event {
    Stream* stream = nullptr;
  };
  static FakeGpu* Self(void* c) { return static_cast<FakeGpu*>(c); }

  int Queue(void* s, Op op) {
    std::lock_guard lk(mu_);
    if (static_cast<Stream*>(s)->device != t_device_) wrong_device_calls.fetch_add(1);
    if (op.mark == nullptr) {
      // One atomic step, so a test re-arming the counter is never overwritten.
      int left = fail_after_copies.load();
      do {
        if (left == 0) return FERRY_ERR_GPU;
        if (left < 0) break;
      } while (!fail_after_copies.compare_exchange_weak(left, left - 1));
    }
    static_cast<Stream*>(s)->ops.push_back(op);
    return FERRY_OK;
  }
  // Runs the stream's work up to the latest record of `until`, or all of it.
  int Run(void* s, Event* until) {
    {
      std::unique_lock hl(hold_mu_);
      hold_cv_.wait(hl, [&] { return !held_; });
    }
    std::lock_guard lk(mu_);
    auto& ops = static_cast<Stream*>(s)->ops;
    size_t end = until == nullptr ? ops.size() : 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      if (ops[i].mark == until) end = i + 1;
    }
    for (size_t i = 0; i < end; ++i) {
      const Op o = ops.front();
      ops.pop_front();
      if (o.mark != nullptr) continue;
      std::memcpy(o.dst, o.src, o.n);
      copied += o.n;
    }
    return FERRY_OK;
  }

  static inline thread_local int t_device_ = 0;
  ferry_gpu_v1 t_{};
  std::atomic<uint64_t> queries_{0};
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  bool held_ = false;  // guarded by hold_mu_
  std::mutex mu_;
  std::deque<Stream> streams_;  // deque: stable addresses
  std::vector<Event*> events_;
};

}  // namespace ferry_test
