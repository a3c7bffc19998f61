// Tests of the rdma plugin. The first part (settings, planner, wire formats,
// init without a device) runs anywhere. The second part drives two plugin
// instances in one process through the C ABI, each with a small fake host whose
// control channel hands messages straight to the other instance; it needs an
// RDMA device (Soft-RoCE in the VM) and skips without one. Every wait is on a
// completion, never a sleep.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "ferry/plugin.h"
#include "planner.h"
#include "settings.h"
#include "wire.h"

extern "C" const ferry_plugin_ops_v1 ferry_plugin_v1;

namespace {

using namespace std::chrono_literals;
using namespace ferry_rdma;
const ferry_plugin_ops_v1& ops = ferry_plugin_v1;

// ---- settings -------------------------------------------------------------------------

TEST(Settings, DefaultsAndValues) {
  Settings s;
  std::string err;
  ASSERT_TRUE(ParseSettings("{}", &s, &err)) << err;
  EXPECT_EQ(s.qp_per_transfer, 4);
  EXPECT_EQ(s.gid_index, -1);
  ASSERT_TRUE(ParseSettings(R"({"qp_per_transfer": 2, "chunk_bytes": "64KiB", "devices": ["rxe0", "mlx5_1:2"],
      "gid_index": 3, "busy_poll": true, "qp_timeout": 10, "retry_cnt": 2, "max_send_wr": 64})",
                            &s, &err))
      << err;
  EXPECT_EQ(s.qp_per_transfer, 2);
  EXPECT_EQ(s.chunk_bytes, 64u << 10);
  EXPECT_EQ(s.devices, (std::vector<std::string>{"rxe0", "mlx5_1:2"}));
  EXPECT_EQ(s.gid_index, 3);
  EXPECT_TRUE(s.busy_poll);
  ASSERT_TRUE(ParseSettings(R"({"gid_index": "auto", "devices": "rxe0"})", &s, &err)) << err;
  EXPECT_EQ(s.gid_index, -1);
}

TEST(Settings, RefusesTyposAndBadValues) {
  Settings s;
  std::string err;
  EXPECT_FALSE(ParseSettings(R"({"qp_per_transfers": 2})", &s, &err));
  EXPECT_NE(err.find("unknown rdma setting 'qp_per_transfers'"), std::string::npos) << err;
  EXPECT_FALSE(ParseSettings(R"({"qp_per_transfer": 0})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"qp_per_transfer": -3})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"retry_cnt": 8})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"chunk_bytes": "1KiB"})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"chunk_bytes": "12XB"})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"devices": [":1"]})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"devices": ["rxe0:x"]})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"gid_index": "first"})", &s, &err));
  EXPECT_FALSE(ParseSettings(R"({"busy_poll": 1})", &s, &err));
  EXPECT_FALSE(ParseSettings("[1]", &s, &err));
  EXPECT_FALSE(ParseSettings("{", &s, &err));
}

// ---- planner --------------------------------------------------------------------------

uint64_t Sum(const Plan& p) {
  uint64_t n = 0;
  for (const auto& w : p.wrs) n += w.len;
  return n;
}

TEST(Planner, ChunksOneLargePiece) {
  ferry_iov_v1 iov{100, 200, 1000};
  Plan p = MakePlan(&iov, 1, 256, 4);
  ASSERT_EQ(p.wrs.size(), 4u);
  EXPECT_EQ(p.wrs[0].remote_off, 200u);
  EXPECT_EQ(p.wrs[3].len, 1000u - 3 * 256);
  EXPECT_EQ(p.sges[p.wrs[3].sge_begin].local_off, 100u + 3 * 256);
  EXPECT_EQ(Sum(p), 1000u);
}

TEST(Planner, MergesContiguousAndSortsByRemote) {
  // Given out of order; contiguous on both sides once sorted.
  std::vector<ferry_iov_v1> iov{{20, 120, 10}, {0, 100, 10}, {10, 110, 10}};
  Plan p = MakePlan(iov.data(), iov.size(), 1 << 20, 4);
  ASSERT_EQ(p.wrs.size(), 1u);
  EXPECT_EQ(p.wrs[0].remote_off, 100u);
  EXPECT_EQ(p.wrs[0].sge_count, 1u);
  EXPECT_EQ(p.sges[0].local_off, 0u);
  EXPECT_EQ(p.sges[0].len, 30u);
}

TEST(Planner, GathersRemoteContiguousIntoSges) {
  // Remote contiguous, local scattered: one WR with one SGE per piece, up to max_sge.
  std::vector<ferry_iov_v1> iov;
  for (uint64_t i = 0; i < 5; ++i) iov.push_back({i * 100, 1000 + i * 8, 8});
  Plan p = MakePlan(iov.data(), iov.size(), 1 << 20, 3);
  ASSERT_EQ(p.wrs.size(), 2u);
  EXPECT_EQ(p.wrs[0].sge_count, 3u);
  EXPECT_EQ(p.wrs[0].len, 24u);
  EXPECT_EQ(p.wrs[1].remote_off, 1024u);
  EXPECT_EQ(p.wrs[1].sge_count, 2u);
  EXPECT_EQ(Sum(p), 40u);
}

TEST(Planner, GapsStaySeparate) {
  std::vector<ferry_iov_v1> iov{{0, 0, 8}, {8, 16, 8}};
  Plan p = MakePlan(iov.data(), iov.size(), 1 << 20, 4);
  EXPECT_EQ(p.wrs.size(), 2u);
}

TEST(Planner, RandomLayoutsCoverEveryByteOnce) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 60; ++round) {
    std::vector<ferry_iov_v1> iov;
    uint64_t loff = 0, roff = 0;
    const int n = 1 + static_cast<int>(rng() % 20);
    for (int i = 0; i < n; ++i) {
      const uint64_t len = 1 + rng() % 5000;
      iov.push_back({loff, roff, len});
      loff += len + (rng() % 2 ? 0 : rng() % 64);
      roff += len + (rng() % 2 ? 0 : rng() % 64);
    }
    std::shuffle(iov.begin(), iov.end(), rng);
    const uint64_t chunk = 64 + rng() % 4096;
    const uint32_t max_sge = 1 + static_cast<uint32_t>(rng() % 5);
    Plan p = MakePlan(iov.data(), iov.size(), chunk, max_sge);
    std::map<uint64_t, uint64_t> remote_to_local;  // every byte's mapping
    for (const auto& w : p.wrs) {
      ASSERT_LE(w.len, chunk);
      ASSERT_LE(w.sge_count, max_sge);
      uint64_t r = w.remote_off, total = 0;
      for (uint32_t j = 0; j < w.sge_count; ++j) {
        const auto& s = p.sges[w.sge_begin + j];
        for (uint64_t b = 0; b < s.len; ++b) ASSERT_TRUE(remote_to_local.emplace(r + b, s.local_off + b).second);
        r += s.len;
        total += s.len;
      }
      ASSERT_EQ(total, w.len);
    }
    for (const auto& v : iov)
      for (uint64_t b = 0; b < v.len; ++b) ASSERT_EQ(remote_to_local.at(v.remote_off + b), v.local_off + b);
  }
}

// ---- wire -------------------------------------------------------------------------------

TEST(Wire, RoundTripsAndRejectsEveryTruncation) {
  wire::ConnInfo c;
  c.nonce = 0x1122334455667788ull;
  wire::PortInfo p;
  p.name = "rxe0";
  p.port = 1;
  p.link_layer = 2;
  p.active_mtu = 3;
  p.gid_index = 1;
  p.gid[15] = 9;
  p.numa_node = -1;
  c.ports = {p, p};
  auto blob = wire::EncodeConnInfo(c);
  wire::ConnInfo back;
  std::string err;
  ASSERT_TRUE(wire::DecodeConnInfo(blob.data(), blob.size(), &back, &err)) << err;
  EXPECT_EQ(back.nonce, c.nonce);
  ASSERT_EQ(back.ports.size(), 2u);
  EXPECT_EQ(back.ports[1].name, "rxe0");
  EXPECT_EQ(back.ports[1].gid[15], 9);
  EXPECT_EQ(back.ports[1].numa_node, -1);
  for (size_t n = 0; n < blob.size(); ++n) EXPECT_FALSE(wire::DecodeConnInfo(blob.data(), n, &back, &err));
  blob.push_back(0);
  EXPECT_FALSE(wire::DecodeConnInfo(blob.data(), blob.size(), &back, &err));

  wire::MemInfo m;
  m.addr = 0x7f0000001000;
  m.size = 4096;
  m.preferred_port = 1;
  m.rkeys = {11, 22};
  auto mb = wire::EncodeMemInfo(m);
  wire::MemInfo mback;
  ASSERT_TRUE(wire::DecodeMemInfo(mb.data(), mb.size(), &mback, &err)) << err;
  EXPECT_EQ(mback.rkeys, m.rkeys);
  EXPECT_EQ(mback.addr, m.addr);
  for (size_t n = 0; n < mb.size(); ++n) EXPECT_FALSE(wire::DecodeMemInfo(mb.data(), n, &mback, &err));
  m.preferred_port = 2;  // out of range
  mb = wire::EncodeMemInfo(m);
  EXPECT_FALSE(wire::DecodeMemInfo(mb.data(), mb.size(), &mback, &err));

  wire::ConnectMsg req;
  req.type = wire::MsgType::kConnectReq;
  req.conn_id = 5;
  req.target_nonce = 6;
  req.mtu = 3;
  req.qps = {{0x11, 0x22}, {0x33, 0x44}};
  auto rb = wire::EncodeConnectMsg(req);
  wire::ConnectMsg rback;
  ASSERT_TRUE(wire::DecodeConnectMsg(rb.data(), rb.size(), &rback, &err)) << err;
  EXPECT_EQ(rback.qps.size(), 2u);
  EXPECT_EQ(rback.qps[1].psn, 0x44u);
  for (size_t n = 0; n < rb.size(); ++n) EXPECT_FALSE(wire::DecodeConnectMsg(rb.data(), n, &rback, &err));
  wire::ConnectMsg nak;
  nak.type = wire::MsgType::kConnectNak;
  nak.conn_id = 9;
  nak.reason = "no\nway";
  auto nb = wire::EncodeConnectMsg(nak);
  ASSERT_TRUE(wire::DecodeConnectMsg(nb.data(), nb.size(), &rback, &err)) << err;
  EXPECT_EQ(rback.reason, "no?way");

  uint8_t n16[wire::kNotifySize];
  wire::EncodeNotify(0xfedcba9876543210ull, n16);
  uint64_t uid = 0;
  ASSERT_TRUE(wire::DecodeNotify(n16, sizeof n16, &uid));
  EXPECT_EQ(uid, 0xfedcba9876543210ull);
  EXPECT_FALSE(wire::DecodeNotify(n16, 15, &uid));
}

TEST(Wire, RandomBytesNeverDecodeOrCrash) {
  std::mt19937 rng(1);
  std::string err;
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b(rng() % 200);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (i % 3 == 0 && b.size() >= 4) std::memcpy(b.data(), i % 2 ? "FRDX" : "FRDC", 4);
    wire::ConnInfo c;
    wire::MemInfo m;
    wire::ConnectMsg msg;
    wire::DecodeConnInfo(b.data(), b.size(), &c, &err);
    wire::DecodeMemInfo(b.data(), b.size(), &m, &err);
    wire::DecodeConnectMsg(b.data(), b.size(), &msg, &err);
  }
}

// ---- through the ABI -----------------------------------------------------------------------

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

bool HaveDevice() {
  int n = 0;
  ibv_device** l = ibv_get_device_list(&n);
  if (l) ibv_free_device_list(l);
  return n > 0;
}

struct Completion {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  int status = 1;
  std::string msg;
  bool Wait(std::chrono::milliseconds t = 60s) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, t, [&] { return calls > 0; });
  }
};

class FakeHost;
struct Net {  // the "control plane": instance name -> host
  std::mutex mu;
  std::map<std::string, FakeHost*> hosts;
  bool drop = false;  // lose every control message
};

class FakeHost {
 public:
  FakeHost(std::string name, Net* net) : name_(std::move(name)), net_(net) {
    host_.struct_size = sizeof(host_);
    host_.host_ctx = this;
    host_.log = [](void* ctx, int level, const char* msg) {
      if (level <= FERRY_LOG_WARN)
        std::fprintf(stderr, "[%s %d] %s\n", static_cast<FakeHost*>(ctx)->name_.c_str(), level, msg);
    };
    host_.now_ns = [](void*) { return NowNs(); };
    host_.ctrl_send = [](void* ctx, const char* peer, const void* msg, size_t len) {
      auto* self = static_cast<FakeHost*>(ctx);
      FakeHost* to = nullptr;
      {
        std::lock_guard lk(self->net_->mu);
        if (self->net_->drop) return FERRY_OK;
        auto it = self->net_->hosts.find(peer);
        if (it == self->net_->hosts.end()) return FERRY_ERR_TRANSPORT;
        to = it->second;
      }
      ops.on_ctrl(to->ctx, self->name_.c_str(), msg, len);
      return FERRY_OK;
    };
    host_.complete = [](void*, void* xfer_ctx, int status, const char* msg) {
      auto* c = static_cast<Completion*>(xfer_ctx);
      std::lock_guard lk(c->mu);
      ++c->calls;
      c->status = status;
      c->msg = msg ? msg : "";
      c->cv.notify_all();
    };
    host_.inbound = [](void* ctx, const char* peer, uint64_t uid, int status) {
      auto* self = static_cast<FakeHost*>(ctx);
      std::lock_guard lk(self->mu_);
      if (status == FERRY_OK) self->inbound_.push_back({peer, uid});
      self->cv_.notify_all();
    };
  }
  bool WaitInbound(const std::string& peer, uint64_t uid, std::chrono::milliseconds t = 30s) {
    std::unique_lock lk(mu_);
    return cv_.wait_for(lk, t, [&] {
      for (const auto& [p, u] : inbound_)
        if (p == peer && u == uid) return true;
      return false;
    });
  }
  int CountInbound(uint64_t uid) {
    std::lock_guard lk(mu_);
    int n = 0;
    for (const auto& i : inbound_) n += i.second == uid;
    return n;
  }
  const ferry_host_v1* host() const { return &host_; }
  void* ctx = nullptr;

 private:
  std::string name_;
  Net* net_;
  ferry_host_v1 host_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::string, uint64_t>> inbound_;
};

struct Mem {
  std::vector<uint8_t> data;
  void* handle = nullptr;
  std::vector<uint8_t> blob;
};

class Inst {
 public:
  Inst(std::string key, Net* net, const std::string& settings = "{}")
      : key_(std::move(key)), net_(net), host_(key_, net) {
    char err[512] = {};
    rc = ops.init(host_.host(), key_.c_str(), "node", settings.c_str(), &host_.ctx, err, sizeof err);
    error = err;
    if (rc == FERRY_OK) {
      std::lock_guard lk(net_->mu);
      net_->hosts[key_] = &host_;
    }
  }
  ~Inst() { Fini(); }
  void Fini() {
    if (!host_.ctx) return;
    {
      std::lock_guard lk(net_->mu);
      net_->hosts.erase(key_);
    }
    ops.fini(host_.ctx);
    host_.ctx = nullptr;
  }
  void* ctx() { return host_.ctx; }
  FakeHost& host() { return host_; }
  std::vector<uint8_t> ConnBlob() {
    std::vector<uint8_t> b(FERRY_MAX_BLOB);
    size_t len = b.size();
    EXPECT_EQ(ops.conn_info(ctx(), b.data(), &len), FERRY_OK);
    b.resize(len);
    return b;
  }
  void* AddPeer(Inst& other) {
    auto blob = other.ConnBlob();
    ferry_peer_v1 p{};
    p.struct_size = sizeof p;
    p.key = other.key_.c_str();
    p.host = "127.0.0.1";
    p.node_id = "node";
    p.conn_blob = blob.data();
    p.conn_blob_len = blob.size();
    void* h = nullptr;
    EXPECT_EQ(ops.peer_add(ctx(), &p, &h), FERRY_OK);
    return h;
  }
  std::unique_ptr<Mem> Register(size_t size, uint64_t id) {
    auto m = std::make_unique<Mem>();
    m->data.assign(size, 0);
    ferry_mem_v1 d{};
    d.struct_size = sizeof d;
    d.location = FERRY_MEM_CPU;
    d.id = id;
    d.addr = m->data.data();
    d.size = size;
    d.device = -1;
    m->blob.resize(FERRY_MAX_BLOB);
    size_t len = m->blob.size();
    EXPECT_EQ(ops.mem_register(ctx(), &d, &m->handle, m->blob.data(), &len), FERRY_OK);
    m->blob.resize(len);
    return m;
  }
  void* Import(void* peer, const Mem& m, uint64_t id) {
    void* h = nullptr;
    EXPECT_EQ(ops.mem_import(ctx(), peer, id, m.data.size(), m.blob.data(), m.blob.size(), &h), FERRY_OK);
    return h;
  }
  // Posts and returns the post code; c receives the completion.
  int Post(uint32_t op, void* peer, Mem& local, void* remote, std::vector<ferry_iov_v1> iov,
           uint64_t uid, Completion* c, bool notify = true, uint64_t timeout_ms = 20000) {
    ferry_xfer_v1 x{};
    x.struct_size = sizeof x;
    x.op = op;
    x.flags = notify ? FERRY_XFER_NOTIFY : 0;
    x.n_iov = static_cast<uint32_t>(iov.size());
    x.peer = peer;
    x.local_mem = local.handle;
    x.remote_mem = remote;
    x.iov = iov.data();
    x.uid = uid;
    x.deadline_ns = NowNs() + timeout_ms * 1000000ull;
    x.xfer_ctx = c;
    for (const auto& v : iov) x.total_bytes += v.len;
    return ops.post(ctx(), &x);
  }
  int rc = 0;
  std::string error;

 private:
  std::string key_;
  Net* net_;
  FakeHost host_;
};

void Fill(std::vector<uint8_t>& v, uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
}

TEST(Abi, InitWithoutDeviceSaysNoRdmaDevice) {
  if (HaveDevice()) GTEST_SKIP() << "an RDMA device exists here";
  Net net;
  Inst a("a", &net);
  EXPECT_EQ(a.rc, FERRY_ERR_NO_DEVICE);
  EXPECT_NE(a.error.find("no RDMA device"), std::string::npos) << a.error;
}

TEST(Abi, InitRefusesBadSettings) {
  Net net;
  Inst a("a", &net, R"({"lanes": 4})");
  EXPECT_EQ(a.rc, FERRY_ERR_INVALID_ARGS);
  EXPECT_NE(a.error.find("unknown rdma setting 'lanes'"), std::string::npos) << a.error;
}

#define NEED_DEVICE() \
  if (!HaveDevice()) GTEST_SKIP() << "no RDMA device here (these run inside the Soft-RoCE VM)"

TEST(Abi, InitRefusesMissingConfiguredDevice) {
  NEED_DEVICE();
  Net net;
  Inst a("a", &net, R"({"devices": ["nosuchdev0"]})");
  EXPECT_EQ(a.rc, FERRY_ERR_INVALID_ARGS);
  EXPECT_NE(a.error.find("'nosuchdev0' not found"), std::string::npos) << a.error;
}

class TwoInstances : public testing::Test {
 protected:
  void SetUp() override {
    NEED_DEVICE();
    a_ = std::make_unique<Inst>("a", &net_, Settings());
    b_ = std::make_unique<Inst>("b", &net_, Settings());
    ASSERT_EQ(a_->rc, FERRY_OK) << a_->error;
    ASSERT_EQ(b_->rc, FERRY_OK) << b_->error;
    char buf[512];
    ASSERT_EQ(ops.describe(a_->ctx(), buf, sizeof buf), FERRY_OK);
    std::printf("describe: %s\n", buf);
    peer_b_ = a_->AddPeer(*b_);
    peer_a_ = b_->AddPeer(*a_);
    la_ = a_->Register(kSize, 1);
    rb_ = b_->Register(kSize, 1);
    rb_import_ = a_->Import(peer_b_, *rb_, 1);
  }
  void TearDown() override {
    if (a_ && a_->ctx() && rb_import_) ops.mem_release(a_->ctx(), rb_import_);
    if (a_ && a_->ctx() && la_) ops.mem_deregister(a_->ctx(), la_->handle);
    if (b_ && b_->ctx() && rb_) ops.mem_deregister(b_->ctx(), rb_->handle);
    if (a_ && a_->ctx() && peer_b_) ops.peer_remove(a_->ctx(), peer_b_);
    if (b_ && b_->ctx() && peer_a_) ops.peer_remove(b_->ctx(), peer_a_);
    a_.reset();
    b_.reset();
  }
  virtual std::string Settings() { return R"({"qp_per_transfer": 3, "chunk_bytes": "16KiB", "max_send_wr": 16})"; }

  static constexpr size_t kSize = 1 << 20;
  Net net_;
  std::unique_ptr<Inst> a_, b_;
  void* peer_b_ = nullptr;
  void* peer_a_ = nullptr;
  std::unique_ptr<Mem> la_, rb_;
  void* rb_import_ = nullptr;
};

TEST_F(TwoInstances, WriteAndReadMoveDataAndNotifyOnce) {
  Fill(la_->data, 1);
  // A batch with gaps, out of order, more WRs than one send queue holds (back-pressure).
  std::vector<ferry_iov_v1> iov;
  for (uint64_t i = 0; i < 40; ++i) iov.push_back({(39 - i) * 20000, (39 - i) * 20000 + 7, 19000});
  Completion c;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, iov, 42, &c), FERRY_OK);
  ASSERT_TRUE(c.Wait());
  ASSERT_EQ(c.status, FERRY_OK) << c.msg;
  for (const auto& v : iov)
    ASSERT_EQ(std::memcmp(la_->data.data() + v.local_off, rb_->data.data() + v.remote_off, v.len), 0);
  ASSERT_TRUE(b_->host().WaitInbound("a", 42));

  Fill(rb_->data, 2);
  Completion r;
  ASSERT_EQ(a_->Post(FERRY_OP_READ, peer_b_, *la_, rb_import_, {{1, 3, kSize - 3}}, 43, &r), FERRY_OK);
  ASSERT_TRUE(r.Wait());
  ASSERT_EQ(r.status, FERRY_OK) << r.msg;
  ASSERT_EQ(std::memcmp(la_->data.data() + 1, rb_->data.data() + 3, kSize - 3), 0);
  ASSERT_TRUE(b_->host().WaitInbound("a", 43));
  EXPECT_EQ(b_->host().CountInbound(42), 1);
  EXPECT_EQ(b_->host().CountInbound(43), 1);

  Completion q;  // no notification asked: none sent
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 1}}, 44, &q, false), FERRY_OK);
  ASSERT_TRUE(q.Wait());
  ASSERT_EQ(q.status, FERRY_OK) << q.msg;
  Completion z;  // a later notified transfer on the same QPs lands after it
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 1}}, 45, &z), FERRY_OK);
  ASSERT_TRUE(z.Wait());
  ASSERT_TRUE(b_->host().WaitInbound("a", 45));
  EXPECT_EQ(b_->host().CountInbound(44), 0);
}

TEST_F(TwoInstances, ManyConcurrentTransfersAllComplete) {
  Fill(la_->data, 3);
  constexpr int kN = 200;
  std::vector<Completion> cs(kN);
  for (int i = 0; i < kN; ++i) {
    const uint64_t off = static_cast<uint64_t>(i) * 4096;
    ASSERT_EQ(a_->Post(i % 3 ? FERRY_OP_WRITE : FERRY_OP_READ, peer_b_, *la_, rb_import_,
                       {{off, off, 4096}}, 1000 + static_cast<uint64_t>(i), &cs[static_cast<size_t>(i)], i % 2),
              FERRY_OK);
  }
  for (auto& c : cs) {
    ASSERT_TRUE(c.Wait());
    EXPECT_EQ(c.status, FERRY_OK) << c.msg;
    EXPECT_EQ(c.calls, 1);
  }
}

TEST_F(TwoInstances, QpErrorFailsTransferAndNextTransferRebuilds) {
  Fill(la_->data, 4);
  Completion ok1;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 1, &ok1), FERRY_OK);
  ASSERT_TRUE(ok1.Wait());
  ASSERT_EQ(ok1.status, FERRY_OK) << ok1.msg;
  // Revoke the target memory: its rkey dies, the next WRITE gets a remote access error.
  ops.mem_deregister(b_->ctx(), rb_->handle);
  rb_->handle = nullptr;
  Completion bad;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 2, &bad), FERRY_OK);
  ASSERT_TRUE(bad.Wait());
  EXPECT_EQ(bad.status, FERRY_ERR_TRANSPORT);
  EXPECT_NE(bad.msg.find("remote access error"), std::string::npos) << bad.msg;
  // A new region: same peer, same port pair, so the same (reset) QPs are rebuilt.
  auto fresh = b_->Register(kSize, 2);
  void* imp = a_->Import(peer_b_, *fresh, 2);
  Completion ok2;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, imp, {{0, 0, kSize}}, 3, &ok2), FERRY_OK);
  ASSERT_TRUE(ok2.Wait());
  ASSERT_EQ(ok2.status, FERRY_OK) << ok2.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), fresh->data.data(), kSize), 0);
  ops.mem_release(a_->ctx(), imp);
  ops.mem_deregister(b_->ctx(), fresh->handle);
}

// fence() on the target: the QPs serving the initiator go to ERR, so nothing the
// initiator still sends on them lands (its next WRITE on the old connection
// fails and the target's memory is unchanged); the transfer after that makes a
// new connection and lands.
TEST_F(TwoInstances, FenceRetiresTheTargetsQpsAndTheNextConnectionWorks) {
  EXPECT_NE(ops.caps & FERRY_CAP_FENCE, 0u);
  ASSERT_NE(ops.fence, nullptr);
  Fill(la_->data, 6);
  Completion ok1;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 1, &ok1), FERRY_OK);
  ASSERT_TRUE(ok1.Wait());
  ASSERT_EQ(ok1.status, FERRY_OK) << ok1.msg;
  const uint64_t ids[2] = {77, 78};
  ferry_fence_result_v1 res[2] = {};
  ASSERT_EQ(ops.fence(b_->ctx(), "a", ids, 2, NowNs() + 5000000000ull, res), FERRY_OK);
  EXPECT_EQ(res[0].state, FERRY_FENCE_PARTIAL);  // a connection served "a": maybe landed
  EXPECT_EQ(res[1].state, FERRY_FENCE_PARTIAL);
  ferry_fence_result_v1 none{};
  ASSERT_EQ(ops.fence(b_->ctx(), "nobody", ids, 1, NowNs() + 5000000000ull, &none), FERRY_OK);
  EXPECT_EQ(none.state, FERRY_FENCE_NONE);

  const std::vector<uint8_t> before(rb_->data.begin(), rb_->data.begin() + 4096);
  Fill(la_->data, 7);
  Completion late;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 2, &late, false),
            FERRY_OK);
  ASSERT_TRUE(late.Wait());
  EXPECT_NE(late.status, FERRY_OK) << "a WRITE on a fenced connection was applied";
  EXPECT_EQ(std::memcmp(before.data(), rb_->data.data(), 4096), 0);
  Completion ok2;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 3, &ok2), FERRY_OK);
  ASSERT_TRUE(ok2.Wait());
  ASSERT_EQ(ok2.status, FERRY_OK) << ok2.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), rb_->data.data(), 4096), 0);
}

TEST_F(TwoInstances, LostHandshakeEndsAtTheDeadline) {
  {
    std::lock_guard lk(net_.mu);
    net_.drop = true;
  }
  Completion c;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 64}}, 9, &c, true, 300), FERRY_OK);
  ASSERT_TRUE(c.Wait(10s));
  EXPECT_EQ(c.status, FERRY_ERR_TIMEOUT) << c.msg;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  {
    std::lock_guard lk(net_.mu);
    net_.drop = false;
  }
  Completion again;  // the handshake is still pending; it times out, then a new one works
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 64}}, 10, &again), FERRY_OK);
  ASSERT_TRUE(again.Wait());
  if (again.status != FERRY_OK) {
    EXPECT_EQ(again.status, FERRY_ERR_TRANSPORT) << again.msg;
    Completion third;
    ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 64}}, 11, &third), FERRY_OK);
    ASSERT_TRUE(third.Wait());
    EXPECT_EQ(third.status, FERRY_OK) << third.msg;
  }
}

TEST_F(TwoInstances, FiniCompletesWhatIsPending) {
  {
    std::lock_guard lk(net_.mu);
    net_.drop = true;  // handshake never answered: transfers stay queued
  }
  Completion c1, c2;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, 64}}, 1, &c1), FERRY_OK);
  ASSERT_EQ(a_->Post(FERRY_OP_READ, peer_b_, *la_, rb_import_, {{0, 0, 64}}, 2, &c2), FERRY_OK);
  ops.peer_remove(a_->ctx(), peer_b_);
  peer_b_ = nullptr;
  ASSERT_TRUE(c1.Wait(1s));
  ASSERT_TRUE(c2.Wait(1s));
  EXPECT_LT(c1.status, 0);
  EXPECT_NE(c1.msg.find("deregistered"), std::string::npos) << c1.msg;
  ops.mem_release(a_->ctx(), rb_import_);
  rb_import_ = nullptr;
}

class TwoInstancesBusyPoll : public TwoInstances {
  std::string Settings() override { return R"({"busy_poll": true, "qp_per_transfer": 1})"; }
};

TEST_F(TwoInstancesBusyPoll, Works) {
  Fill(la_->data, 5);
  Completion c;
  ASSERT_EQ(a_->Post(FERRY_OP_WRITE, peer_b_, *la_, rb_import_, {{0, 0, kSize}}, 1, &c), FERRY_OK);
  ASSERT_TRUE(c.Wait());
  ASSERT_EQ(c.status, FERRY_OK) << c.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), rb_->data.data(), kSize), 0);
}

}  // namespace
