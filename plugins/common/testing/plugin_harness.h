// SPDX-License-Identifier: Apache-2.0
// The test harness the plugin suites (tcp, ofi, rdma) share: a fake host (the
// ferry_host_v1 table the core would give a plugin), a wrapper that drives one
// plugin instance through its C ABI, and a fixture of two instances that know
// each other as peers. The suites link a plugin's entry file directly, so every
// piece takes that plugin's ops table rather than assuming a global.
//
// Every wait here is bounded and on an event (a completion, an inbound
// notification), never a sleep: a plugin that loses a completion fails a test
// instead of hanging it, and a slow machine (the Soft-RoCE VM) only waits longer.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_plugin_test {

// The host clock: steady, like the core's, since deadlines are compared with it.
inline uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// Seeded bytes, so a transfer that moved the wrong range cannot compare equal.
inline void Fill(std::vector<uint8_t>& v, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
}

// Entries in a directory (/proc/self/fd, /proc/self/task, /dev/shm): leak checks.
inline size_t CountEntries(const char* dir) {
  size_t n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// CountEntries once it has come down to `want`, or what it is after `limit`.
// A joined thread can stay listed in /proc/self/task a moment after
// pthread_join returns (the kernel reaps the task after it clears its tid), and
// a busy host stretches that moment: a leak is a count that never comes back.
inline size_t CountEntriesSettled(const char* dir, size_t want,
                                  std::chrono::milliseconds limit = std::chrono::seconds(5)) {
  const auto until = std::chrono::steady_clock::now() + limit;
  size_t n = CountEntries(dir);
  while (n > want && std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
    n = CountEntries(dir);
  }
  return n;
}

// CPU time this process spends during `window`: idle plugin threads must block.
inline double CpuMsOver(std::chrono::milliseconds window) {
  timespec c0{}, c1{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
  std::this_thread::sleep_for(window);  // a measurement window, not synchronisation
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
  return static_cast<double>(c1.tv_sec - c0.tv_sec) * 1e3 +
         static_cast<double>(c1.tv_nsec - c0.tv_nsec) / 1e6;
}

// What host->complete reported for one transfer (the transfer's xfer_ctx).
struct Completion {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  int status = 1;  // not a FERRY_* code: "never completed" is told apart from OK
  std::string msg;
  uint64_t at_ns = 0;  // when complete() ran, for latency checks

  bool Wait(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, timeout, [&] { return calls > 0; });
  }
};

// One host->inbound call: a notified transfer landed (or failed) at the target.
struct Inbound {
  std::string peer;
  uint64_t uid;
  int status;
};

// The control plane between fake hosts: ctrl_send hands a message straight to
// the on_ctrl of the instance routed under the peer's key, on the sending
// thread, as the core's in-order, at-most-once channel allows.
struct Net {
  std::mutex mu;
  std::map<std::string, void*> hosts;         // engine key -> plugin instance ctx
  bool drop = false;                          // lose every control message (a lost handshake)
  int unknown_peer_rc = FERRY_ERR_NOT_FOUND;  // ctrl_send's answer for a key not routed
  bool busy = false;                          // ctrl_try_send finds the connection busy (NOT_SENT)
  // ctrl_send to this key blocks until it is cleared (Unstall): a host that
  // does not answer, whose connect waits out its timeout.
  std::string stalled;
  std::condition_variable stall_cv;
  int stalls = 0;  // ctrl_sends blocked so far
  void Unstall() {
    std::lock_guard lk(mu);
    stalled.clear();
    stall_cv.notify_all();
  }
};

struct HostOptions {
  const ferry_gpu_v1* gpu = nullptr;  // host->gpu (e.g. testing/fake_gpu.h), or none
  Net* net = nullptr;                 // null: no control channel, ctrl_send is UNSUPPORTED
  int print_level = FERRY_LOG_DEBUG;  // log lines at or below this level go to stderr
  bool landings_only = false;         // record only inbound() calls with FERRY_OK, as the core
};

// A ferry_host_v1 for one plugin instance. link_prove / link_check stay NULL:
// none of the suites' fake hosts has an engine secret, so the plugins run their
// connections unauthenticated (tcp's raw-socket peers rely on that: they send
// a plain HELLO). auth_sign / auth_verify stay NULL for the same reason.
class FakeHost {
 public:
  FakeHost(const ferry_plugin_ops_v1& ops, std::string name, HostOptions o = {})
      : ops_(&ops), name_(std::move(name)), opt_(o) {
    host_.struct_size = sizeof(host_);
    host_.host_ctx = this;
    host_.gpu = opt_.gpu;
    host_.log = [](void* ctx, int level, const char* msg) {
      static const char* kLevels[] = {"E", "W", "I", "D"};
      auto* self = static_cast<FakeHost*>(ctx);
      if (level <= FERRY_LOG_WARN) {
        std::lock_guard lk(self->mu_);
        self->warnings_ += std::string(msg) + "\n";
      }
      if (level <= self->opt_.print_level)
        std::fprintf(stderr, "[%s %s] %s\n", self->name_.c_str(),
                     level >= 0 && level <= 3 ? kLevels[level] : "?", msg);
    };
    host_.now_ns = [](void*) { return NowNs(); };
    host_.ctrl_send = [](void* ctx, const char* peer, const void* msg, size_t len) {
      return static_cast<FakeHost*>(ctx)->Send(peer, msg, len, false);
    };
    host_.ctrl_try_send = [](void* ctx, const char* peer, const void* msg, size_t len) {
      return static_cast<FakeHost*>(ctx)->Send(peer, msg, len, true);
    };
    host_.complete = [](void*, void* xfer_ctx, int status, const char* msg) {
      auto* c = static_cast<Completion*>(xfer_ctx);
      std::lock_guard lk(c->mu);
      ++c->calls;
      c->status = status;
      c->msg = msg ? msg : "";
      c->at_ns = NowNs();
      c->cv.notify_all();
    };
    host_.inbound = [](void* ctx, const char* peer, uint64_t uid, int status) {
      auto* self = static_cast<FakeHost*>(ctx);
      std::lock_guard lk(self->mu_);
      if (status == FERRY_OK || !self->opt_.landings_only)
        self->inbound_.push_back({peer, uid, status});
      self->cv_.notify_all();
    };
  }
  FakeHost(const FakeHost&) = delete;
  FakeHost& operator=(const FakeHost&) = delete;

  const ferry_host_v1* host() const { return &host_; }
  ferry_host_v1* mutable_host() { return &host_; }  // before init: a test plays an older core
  const std::string& name() const { return name_; }
  Net* net() const { return opt_.net; }

  std::vector<Inbound> inbound() {
    std::lock_guard lk(mu_);
    return inbound_;
  }
  int CountInbound(uint64_t uid) {
    std::lock_guard lk(mu_);
    int n = 0;
    for (const auto& i : inbound_) n += i.uid == uid;
    return n;
  }
  // READ notifications may trail the initiator's completion: wait for them.
  bool WaitInbound(uint64_t uid, std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return WaitFor(timeout, [&](const Inbound& i) { return i.uid == uid; });
  }
  bool WaitInbound(const std::string& peer, uint64_t uid,
                   std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    return WaitFor(timeout, [&](const Inbound& i) { return i.peer == peer && i.uid == uid; });
  }
  // Every warning and error line logged so far, one a line.
  std::string warnings() {
    std::lock_guard lk(mu_);
    return warnings_;
  }

  std::atomic<int> ctrl_sent{0};

 private:
  // ctrl_send, or ctrl_try_send (try_only), to the instance routed as `peer`.
  int Send(const char* peer, const void* msg, size_t len, bool try_only) {
    Net* net = opt_.net;
    if (net == nullptr) return try_only ? FERRY_ERR_NOT_SENT : FERRY_ERR_UNSUPPORTED;
    void* to = nullptr;
    {
      std::unique_lock lk(net->mu);
      if (try_only && net->busy) return FERRY_ERR_NOT_SENT;
      if (!try_only && !net->stalled.empty() && net->stalled == peer) {
        ++net->stalls;
        net->stall_cv.notify_all();
        net->stall_cv.wait(lk, [&] { return net->stalled != peer; });
      }
      ctrl_sent.fetch_add(1);
      if (net->drop) return FERRY_OK;  // "queued", then lost
      auto it = net->hosts.find(peer);
      if (it == net->hosts.end()) return try_only ? FERRY_ERR_NOT_SENT : net->unknown_peer_rc;
      to = it->second;
    }
    // Outside the lock: on_ctrl may answer with a ctrl_send of its own.
    ops_->on_ctrl(to, name_.c_str(), msg, len);
    return FERRY_OK;
  }

  template <class Match>
  bool WaitFor(std::chrono::milliseconds timeout, Match match) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, timeout, [&] {
      for (const auto& i : inbound_)
        if (match(i)) return true;
      return false;
    });
  }

  const ferry_plugin_ops_v1* ops_;
  std::string name_;
  HostOptions opt_;
  ferry_host_v1 host_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Inbound> inbound_;
  std::string warnings_;
};

// init() with `settings` on a throw-away host: "" when it succeeded, else its error.
inline std::string InitError(const ferry_plugin_ops_v1& ops, const char* settings,
                             HostOptions host_options = {}) {
  FakeHost host(ops, "x", host_options);
  void* ctx = nullptr;
  char err[1024] = {0};
  const int rc = ops.init(host.host(), "x", "node", settings, &ctx, err, sizeof(err));
  if (rc == FERRY_OK) {
    ops.fini(ctx);
    return "";
  }
  return err;
}

// Registered memory with its handle and blob.
struct Mem {
  std::vector<uint8_t> data;
  uint64_t id = 0;
  void* handle = nullptr;
  std::vector<uint8_t> blob;
};

struct InstanceOptions {
  std::string settings = "{}";
  std::string node = "node";   // node_id, of this instance and of the peers it adds
  uint32_t same_host = 0;      // ferry_peer_v1.same_host of AddPeer's peers
  bool expect_init_ok = true;  // off for tests whose init is meant to fail
  HostOptions host{};
};

// One plugin instance on its own fake host. It owns what it registers and
// deregisters it at Fini; imports and peers are the test's to release.
class Instance {
 public:
  Instance(const ferry_plugin_ops_v1& ops, std::string key, InstanceOptions o = {})
      : ops_(&ops), key_(std::move(key)), opt_(std::move(o)), host_(ops, key_, opt_.host) {
    char err[1024] = {0};
    rc = ops.init(host_.host(), key_.c_str(), opt_.node.c_str(), opt_.settings.c_str(), &ctx_, err,
                  sizeof(err));
    error = err;
    if (opt_.expect_init_ok) {
      EXPECT_EQ(rc, FERRY_OK) << err;
    }
    if (rc != FERRY_OK) {
      ctx_ = nullptr;  // init leaves it unspecified on failure
      return;
    }
    if (Net* net = host_.net()) {
      std::lock_guard lk(net->mu);
      net->hosts[key_] = ctx_;
    }
  }
  Instance(const Instance&) = delete;
  Instance& operator=(const Instance&) = delete;
  ~Instance() { Fini(); }

  // Unroutes the instance first, so no control message reaches it during fini.
  void Fini() {
    if (Net* net = host_.net(); net && ctx_) {
      std::lock_guard lk(net->mu);
      auto it = net->hosts.find(key_);
      if (it != net->hosts.end() && it->second == ctx_) net->hosts.erase(it);
    }
    for (auto& m : mems_) {
      if (ctx_ && m->handle) ops_->mem_deregister(ctx_, m->handle);
    }
    if (ctx_) ops_->fini(ctx_);
    ctx_ = nullptr;
  }

  const ferry_plugin_ops_v1& plugin() const { return *ops_; }
  void* ctx() const { return ctx_; }
  bool ok() const { return ctx_ != nullptr; }
  const std::string& key() const { return key_; }
  FakeHost& host() { return host_; }

  std::vector<uint8_t> ConnBlob() {
    std::vector<uint8_t> b(FERRY_MAX_BLOB);
    size_t len = b.size();
    EXPECT_EQ(ops_->conn_info(ctx_, b.data(), &len), FERRY_OK);
    b.resize(len);
    return b;
  }

  // Adds `key` as a peer reachable through `blob`. With rc_out the caller checks
  // peer_add's code (tests of refusals); without, it must succeed.
  void* AddPeer(const std::string& key, const std::vector<uint8_t>& blob, int* rc_out = nullptr) {
    return AddPeer(key, blob, rc_out, opt_.same_host);
  }
  void* AddPeer(const std::string& key, const std::vector<uint8_t>& blob, int* rc_out,
                uint32_t same_host) {
    ferry_peer_v1 p{};
    p.struct_size = sizeof(p);
    p.key = key.c_str();
    p.host = "127.0.0.1";
    p.node_id = opt_.node.c_str();
    p.same_host = same_host;
    p.conn_blob = blob.data();
    p.conn_blob_len = blob.size();
    void* h = nullptr;
    const int rc = ops_->peer_add(ctx_, &p, &h);
    if (rc_out)
      *rc_out = rc;
    else
      EXPECT_EQ(rc, FERRY_OK);
    return h;
  }

  // device >= 0: registered as that GPU's memory (a fake runtime's device memory
  // is host memory, so the test can still read it).
  Mem* Register(uint64_t id, size_t size, int device = -1) {
    auto m = std::make_unique<Mem>();
    m->data.assign(size, 0);
    m->id = id;
    ferry_mem_v1 desc{};
    desc.struct_size = sizeof(desc);
    desc.location = device >= 0 ? FERRY_MEM_GPU : FERRY_MEM_CPU;
    desc.id = id;
    desc.addr = m->data.data();
    desc.size = size;
    desc.device = device;
    m->blob.resize(FERRY_MAX_BLOB);
    size_t len = m->blob.size();
    EXPECT_EQ(ops_->mem_register(ctx_, &desc, &m->handle, m->blob.data(), &len), FERRY_OK);
    m->blob.resize(len);
    mems_.push_back(std::move(m));
    return mems_.back().get();
  }
  // Deregisters now (the memory stays allocated, so a test can check that it
  // no longer changes).
  void Deregister(Mem* m) {
    ops_->mem_deregister(ctx_, m->handle);
    m->handle = nullptr;
  }

  void* Import(void* peer, const Mem& remote) {
    void* h = nullptr;
    EXPECT_EQ(ops_->mem_import(ctx_, peer, remote.id, remote.data.size(), remote.blob.data(),
                               remote.blob.size(), &h),
              FERRY_OK);
    return h;
  }

  int rc = 0;         // what init returned
  std::string error;  // and its error text

 private:
  const ferry_plugin_ops_v1* ops_;
  std::string key_;
  InstanceOptions opt_;
  FakeHost host_;
  void* ctx_ = nullptr;
  std::vector<std::unique_ptr<Mem>> mems_;  // stable addresses: tests hold Mem*
};

// The parts of a ferry_xfer_v1 besides its buffers; zero is "none" for each.
struct XferArgs {
  uint32_t flags = 0;
  uint64_t uid = 0;
  uint64_t deadline_ns = 0;
  uint64_t attempt_id = 0;
};

// A transfer descriptor; it points into `iov`, which must outlive post().
inline ferry_xfer_v1 MakeXfer(uint32_t op, void* peer, const Mem* local, void* remote,
                              const std::vector<ferry_iov_v1>& iov, Completion* c,
                              const XferArgs& args = {}) {
  ferry_xfer_v1 x{};
  x.struct_size = sizeof(x);
  x.op = op;
  x.flags = args.flags;
  x.n_iov = static_cast<uint32_t>(iov.size());
  x.peer = peer;
  x.local_mem = local->handle;
  x.remote_mem = remote;
  x.iov = iov.data();
  x.uid = args.uid;
  x.deadline_ns = args.deadline_ns;
  x.xfer_ctx = c;
  x.attempt_id = args.attempt_id;
  for (const auto& i : iov) x.total_bytes += i.len;
  return x;
}

struct Result {
  int post_rc;
  int status;  // 0 when post() refused the transfer
  std::string msg;
  int calls;  // complete() calls: must be exactly 1
  double ms;  // post() to complete()
};

// Posts a transfer and waits for its completion.
inline Result Transfer(Instance& e, uint32_t op, void* peer, Mem* local, void* remote,
                       const std::vector<ferry_iov_v1>& iov, const XferArgs& args = {}) {
  Completion c;
  const uint64_t t0 = NowNs();
  const ferry_xfer_v1 x = MakeXfer(op, peer, local, remote, iov, &c, args);
  const int rc = e.plugin().post(e.ctx(), &x);
  if (rc != FERRY_OK) return {rc, 0, "", 0, 0};
  EXPECT_TRUE(c.Wait()) << "transfer never completed";
  std::lock_guard lk(c.mu);
  return {rc, c.status, c.msg, c.calls, static_cast<double>(c.at_ns - t0) / 1e6};
}

struct PairOptions {
  std::string key_a = "a", key_b = "b";
  InstanceOptions instance{};  // for both; Connect sets settings, gpu and net
  bool ctrl = false;           // route ctrl_send between the two (a plugin with a control channel)
  bool fini_a_first = true;    // the order a suite always tore its pair down in
};

// Two instances, a and b, each with the other as a peer; the initiator is a.
// Base: ::testing::Test, or TestWithParam<...> for a parameterised suite.
template <class Base = ::testing::Test>
class PairTest : public Base {
 protected:
  PairTest(const ferry_plugin_ops_v1& ops, PairOptions o) : ops_(ops), opt_(std::move(o)) {}

  // (Re)makes both instances with `settings` and adds them to each other.
  void Connect(const std::string& settings, const ferry_gpu_v1* gpu_a = nullptr,
               const ferry_gpu_v1* gpu_b = nullptr) {
    ASSERT_NO_FATAL_FAILURE(MakeInstances(settings, gpu_a, gpu_b));
    AddPeers();
  }
  // Connect in two steps, for a suite that looks at the instances in between.
  void MakeInstances(const std::string& settings, const ferry_gpu_v1* gpu_a = nullptr,
                     const ferry_gpu_v1* gpu_b = nullptr) {
    Disconnect();
    a_ = std::make_unique<Instance>(ops_, opt_.key_a, Options(settings, gpu_a));
    b_ = std::make_unique<Instance>(ops_, opt_.key_b, Options(settings, gpu_b));
    ASSERT_EQ(a_->rc, FERRY_OK) << a_->error;
    ASSERT_EQ(b_->rc, FERRY_OK) << b_->error;
  }
  void AddPeers() {
    a_peer_b_ = a_->AddPeer(b_->key(), b_->ConnBlob());
    b_peer_a_ = b_->AddPeer(a_->key(), a_->ConnBlob());
  }
  void Disconnect() {
    if (opt_.fini_a_first) a_.reset();
    b_.reset();
    a_.reset();
    a_peer_b_ = b_peer_a_ = nullptr;
  }
  void TearDown() override { Disconnect(); }

  const ferry_plugin_ops_v1& ops_;
  PairOptions opt_;
  Net net_;  // the pair's control plane when opt_.ctrl
  std::unique_ptr<Instance> a_, b_;
  void* a_peer_b_ = nullptr;
  void* b_peer_a_ = nullptr;

 private:
  InstanceOptions Options(const std::string& settings, const ferry_gpu_v1* gpu) {
    InstanceOptions o = opt_.instance;
    o.settings = settings;
    o.host.gpu = gpu;
    o.host.net = opt_.ctrl ? &net_ : nullptr;
    return o;
  }
};

}  // namespace ferry_plugin_test
