// SPDX-License-Identifier: Apache-2.0
// Tests of the rdma plugin. The first part (settings, planner, wire formats,
// init without a device) runs anywhere. The second part drives two plugin
// instances in one process through the C ABI, each with a fake host
// (plugins/common/testing/plugin_harness.h) whose control channel hands
// messages straight to the other instance; it needs an RDMA device (Soft-RoCE
// in the VM) and skips without one. Every wait is on a completion, never a sleep.
#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"
#include "planner.h"
#include "settings.h"
#include "testing/plugin_harness.h"
#include "wire.h"

extern "C" const ferry_plugin_ops_v1 ferry_plugin_v1;

namespace {

using namespace std::chrono_literals;
using namespace ferry_rdma;
using namespace ferry_plugin_test;
const ferry_plugin_ops_v1& ops = ferry_plugin_v1;

// ---- settings -------------------------------------------------------------------------

TEST(Settings, DefaultsAndValues) {
  Settings s;
  std::string err;
  ASSERT_TRUE(ParseSettings("{}", &s, &err)) << err;
  EXPECT_EQ(s.qp_per_transfer, 4);
  EXPECT_EQ(s.gid_index, -1);
  ASSERT_TRUE(ParseSettings(
      R"({"qp_per_transfer": 2, "chunk_bytes": "64KiB", "devices": ["rxe0", "mlx5_1:2"],
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
  EXPECT_FALSE(ParseSettings(R"({"max_qps_per_peer": 0})", &s, &err));
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
        for (uint64_t b = 0; b < s.len; ++b)
          ASSERT_TRUE(remote_to_local.emplace(r + b, s.local_off + b).second);
        r += s.len;
        total += s.len;
      }
      ASSERT_EQ(total, w.len);
    }
    for (const auto& v : iov)
      for (uint64_t b = 0; b < v.len; ++b)
        ASSERT_EQ(remote_to_local.at(v.remote_off + b), v.local_off + b);
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
  for (size_t n = 0; n < blob.size(); ++n)
    EXPECT_FALSE(wire::DecodeConnInfo(blob.data(), n, &back, &err));
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
  for (size_t n = 0; n < mb.size(); ++n)
    EXPECT_FALSE(wire::DecodeMemInfo(mb.data(), n, &mback, &err));
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
  for (size_t n = 0; n < rb.size(); ++n)
    EXPECT_FALSE(wire::DecodeConnectMsg(rb.data(), n, &rback, &err));
  wire::ConnectMsg nak;
  nak.type = wire::MsgType::kConnectNak;
  nak.conn_id = 9;
  nak.reason = "no\nway";
  auto nb = wire::EncodeConnectMsg(nak);
  ASSERT_TRUE(wire::DecodeConnectMsg(nb.data(), nb.size(), &rback, &err)) << err;
  EXPECT_EQ(rback.reason, "no?way");
  wire::ConnectMsg bye;
  bye.type = wire::MsgType::kDisconnect;
  bye.conn_id = 0x0102030400000007ull;
  bye.ini_port = 1;
  bye.tgt_port = 2;
  auto bb = wire::EncodeConnectMsg(bye);
  ASSERT_TRUE(wire::DecodeConnectMsg(bb.data(), bb.size(), &rback, &err)) << err;
  EXPECT_EQ(rback.type, wire::MsgType::kDisconnect);
  EXPECT_EQ(rback.conn_id, bye.conn_id);
  EXPECT_EQ(rback.ini_port, 1);
  EXPECT_EQ(rback.tgt_port, 2);
  for (size_t n = 0; n < bb.size(); ++n)
    EXPECT_FALSE(wire::DecodeConnectMsg(bb.data(), n, &rback, &err));
  bye.tgt_port = 999;  // no such port
  bb = wire::EncodeConnectMsg(bye);
  EXPECT_FALSE(wire::DecodeConnectMsg(bb.data(), bb.size(), &rback, &err));

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

bool HaveDevice() {
  int n = 0;
  ibv_device** l = ibv_get_device_list(&n);
  if (l) ibv_free_device_list(l);
  return n > 0;
}

// rdma's fake hosts: only warnings and errors printed (the guest is slow and its
// console small), and, as the core does, only landed notifications recorded.
constexpr HostOptions kRdmaHost{.print_level = FERRY_LOG_WARN, .landings_only = true};

// An instance whose init may be meant to fail: the test checks rc and error.
class Inst : public Instance {
 public:
  Inst(std::string key, Net* net, const std::string& settings = "{}")
      : Instance(ops, std::move(key), Options(settings, net)) {}

 private:
  static InstanceOptions Options(const std::string& settings, Net* net) {
    InstanceOptions o{.settings = settings, .expect_init_ok = false, .host = kRdmaHost};
    o.host.net = net;
    return o;
  }
};

// Posts and returns the post code; c receives the completion. Notified with a
// 20 s deadline unless told otherwise.
int Post(Instance& e, uint32_t op, void* peer, Mem& local, void* remote,
         std::vector<ferry_iov_v1> iov, uint64_t uid, Completion* c, bool notify = true,
         uint64_t timeout_ms = 20000) {
  const ferry_xfer_v1 x = MakeXfer(op, peer, &local, remote, iov, c,
                                   {.flags = notify ? FERRY_XFER_NOTIFY : 0u,
                                    .uid = uid,
                                    .deadline_ns = NowNs() + timeout_ms * 1000000ull});
  return ops.post(e.ctx(), &x);
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

class TwoInstances : public PairTest<> {
 protected:
  TwoInstances()
      : PairTest(ops, {.instance = {.expect_init_ok = false, .host = kRdmaHost}, .ctrl = true}) {
    net_.unknown_peer_rc = FERRY_ERR_TRANSPORT;
  }
  void SetUp() override {
    NEED_DEVICE();
    ASSERT_NO_FATAL_FAILURE(MakeInstances(Settings()));
    char buf[512];
    ASSERT_EQ(ops.describe(a_->ctx(), buf, sizeof buf), FERRY_OK);
    std::printf("describe: %s\n", buf);
    AddPeers();
    la_ = a_->Register(1, kSize);
    rb_ = b_->Register(1, kSize);
    rb_import_ = a_->Import(a_peer_b_, *rb_);
  }
  void TearDown() override {
    if (a_ && a_->ctx() && rb_import_) ops.mem_release(a_->ctx(), rb_import_);
    if (a_ && a_->ctx() && la_) a_->Deregister(la_);
    if (b_ && b_->ctx() && rb_) b_->Deregister(rb_);
    if (a_ && a_->ctx() && a_peer_b_) ops.peer_remove(a_->ctx(), a_peer_b_);
    if (b_ && b_->ctx() && b_peer_a_) ops.peer_remove(b_->ctx(), b_peer_a_);
    PairTest::TearDown();
  }
  virtual std::string Settings() {
    return R"({"qp_per_transfer": 3, "chunk_bytes": "16KiB", "max_send_wr": 16})";
  }

  static constexpr size_t kSize = 1 << 20;
  Mem* la_ = nullptr;  // owned by a_, as rb_ by b_
  Mem* rb_ = nullptr;
  void* rb_import_ = nullptr;
};

TEST_F(TwoInstances, WriteAndReadMoveDataAndNotifyOnce) {
  Fill(la_->data, 1);
  // A batch with gaps, out of order, more WRs than one send queue holds (back-pressure).
  std::vector<ferry_iov_v1> iov;
  for (uint64_t i = 0; i < 40; ++i) iov.push_back({(39 - i) * 20000, (39 - i) * 20000 + 7, 19000});
  Completion c;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, iov, 42, &c), FERRY_OK);
  ASSERT_TRUE(c.Wait());
  ASSERT_EQ(c.status, FERRY_OK) << c.msg;
  for (const auto& v : iov)
    ASSERT_EQ(std::memcmp(la_->data.data() + v.local_off, rb_->data.data() + v.remote_off, v.len),
              0);
  ASSERT_TRUE(b_->host().WaitInbound("a", 42));

  Fill(rb_->data, 2);
  Completion r;
  ASSERT_EQ(Post(*a_, FERRY_OP_READ, a_peer_b_, *la_, rb_import_, {{1, 3, kSize - 3}}, 43, &r),
            FERRY_OK);
  ASSERT_TRUE(r.Wait());
  ASSERT_EQ(r.status, FERRY_OK) << r.msg;
  ASSERT_EQ(std::memcmp(la_->data.data() + 1, rb_->data.data() + 3, kSize - 3), 0);
  ASSERT_TRUE(b_->host().WaitInbound("a", 43));
  EXPECT_EQ(b_->host().CountInbound(42), 1);
  EXPECT_EQ(b_->host().CountInbound(43), 1);

  Completion q;  // no notification asked: none sent
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 1}}, 44, &q, false),
            FERRY_OK);
  ASSERT_TRUE(q.Wait());
  ASSERT_EQ(q.status, FERRY_OK) << q.msg;
  Completion z;  // a later notified transfer on the same QPs lands after it
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 1}}, 45, &z), FERRY_OK);
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
    ASSERT_EQ(Post(*a_, i % 3 ? FERRY_OP_WRITE : FERRY_OP_READ, a_peer_b_, *la_, rb_import_,
                   {{off, off, 4096}}, 1000 + static_cast<uint64_t>(i), &cs[static_cast<size_t>(i)],
                   i % 2),
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
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 1, &ok1),
            FERRY_OK);
  ASSERT_TRUE(ok1.Wait());
  ASSERT_EQ(ok1.status, FERRY_OK) << ok1.msg;
  // Revoke the target memory: its rkey dies, the next WRITE gets a remote access error.
  ops.mem_deregister(b_->ctx(), rb_->handle);
  rb_->handle = nullptr;
  Completion bad;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 2, &bad),
            FERRY_OK);
  ASSERT_TRUE(bad.Wait());
  EXPECT_EQ(bad.status, FERRY_ERR_TRANSPORT);
  EXPECT_NE(bad.msg.find("remote access error"), std::string::npos) << bad.msg;
  // A new region: same peer, same port pair, so the same (reset) QPs are rebuilt.
  Mem* fresh = b_->Register(2, kSize);
  void* imp = a_->Import(a_peer_b_, *fresh);
  Completion ok2;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, imp, {{0, 0, kSize}}, 3, &ok2), FERRY_OK);
  ASSERT_TRUE(ok2.Wait());
  ASSERT_EQ(ok2.status, FERRY_OK) << ok2.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), fresh->data.data(), kSize), 0);
  ops.mem_release(a_->ctx(), imp);
  b_->Deregister(fresh);
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
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 1, &ok1),
            FERRY_OK);
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
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 2, &late, false),
            FERRY_OK);
  ASSERT_TRUE(late.Wait());
  EXPECT_NE(late.status, FERRY_OK) << "a WRITE on a fenced connection was applied";
  EXPECT_EQ(std::memcmp(before.data(), rb_->data.data(), 4096), 0);
  Completion ok2;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 3, &ok2),
            FERRY_OK);
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
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 64}}, 9, &c, true, 300),
            FERRY_OK);
  ASSERT_TRUE(c.Wait(10s));
  // Nothing of it was posted: the core fails it over without fencing the target.
  EXPECT_EQ(c.status, FERRY_ERR_NOT_SENT) << c.msg;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  {
    std::lock_guard lk(net_.mu);
    net_.drop = false;
  }
  Completion again;  // the handshake is still pending; it times out, then a new one works
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 64}}, 10, &again),
            FERRY_OK);
  ASSERT_TRUE(again.Wait());
  if (again.status != FERRY_OK) {
    EXPECT_EQ(again.status, FERRY_ERR_NOT_SENT) << again.msg;
    Completion third;
    ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 64}}, 11, &third),
              FERRY_OK);
    ASSERT_TRUE(third.Wait());
    EXPECT_EQ(third.status, FERRY_OK) << third.msg;
  }
}

// A peer whose control channel blocks (its host does not answer: the core's
// ctrl_send waits out a connect timeout) holds up its own handshakes only:
// a handshake with another peer goes on meanwhile.
TEST_F(TwoInstances, AStalledPeersHandshakeDoesNotHoldUpAnotherPeers) {
  Inst c("c", &net_, Settings());
  ASSERT_EQ(c.rc, FERRY_OK) << c.error;
  void* a_peer_c = a_->AddPeer(c.key(), c.ConnBlob());
  void* c_peer_a = c.AddPeer(a_->key(), a_->ConnBlob());
  Mem* rc = c.Register(1, kSize);
  void* rc_import = a_->Import(a_peer_c, *rc);
  {
    std::lock_guard lk(net_.mu);
    net_.stalled = c.key();
  }
  Fill(la_->data, 8);
  Completion to_c;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_c, *la_, rc_import, {{0, 0, 4096}}, 1, &to_c),
            FERRY_OK);
  {
    // The handshake to c is out, blocked in ctrl_send.
    std::unique_lock lk(net_.mu);
    ASSERT_TRUE(net_.stall_cv.wait_for(lk, 10s, [&] { return net_.stalls > 0; }));
  }
  Completion to_b;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 4096}}, 2, &to_b),
            FERRY_OK);
  const bool b_done = to_b.Wait(3s);  // well inside connect_timeout_ms (5 s)
  net_.Unstall();
  ASSERT_TRUE(b_done) << "the handshake with b waited behind c's blocked control message";
  EXPECT_EQ(to_b.status, FERRY_OK) << to_b.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), rb_->data.data(), 4096), 0);
  ASSERT_TRUE(to_c.Wait());
  EXPECT_EQ(to_c.status, FERRY_OK) << to_c.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), rc->data.data(), 4096), 0);
  ops.mem_release(a_->ctx(), rc_import);
  c.Deregister(rc);
  ops.peer_remove(a_->ctx(), a_peer_c);
  ops.peer_remove(c.ctx(), c_peer_a);
}

TEST_F(TwoInstances, FiniCompletesWhatIsPending) {
  {
    std::lock_guard lk(net_.mu);
    net_.drop = true;  // handshake never answered: transfers stay queued
  }
  Completion c1, c2;
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, 64}}, 1, &c1), FERRY_OK);
  ASSERT_EQ(Post(*a_, FERRY_OP_READ, a_peer_b_, *la_, rb_import_, {{0, 0, 64}}, 2, &c2), FERRY_OK);
  ops.peer_remove(a_->ctx(), a_peer_b_);
  a_peer_b_ = nullptr;
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
  ASSERT_EQ(Post(*a_, FERRY_OP_WRITE, a_peer_b_, *la_, rb_import_, {{0, 0, kSize}}, 1, &c),
            FERRY_OK);
  ASSERT_TRUE(c.Wait());
  ASSERT_EQ(c.status, FERRY_OK) << c.msg;
  EXPECT_EQ(std::memcmp(la_->data.data(), rb_->data.data(), kSize), 0);
}

// A counter from the instance's counters() JSON (rdma's: instance.cpp).
uint64_t Counter(Instance& e, const std::string& name) {
  char buf[512] = {};
  EXPECT_EQ(ops.counters(e.ctx(), buf, sizeof buf), FERRY_OK);
  const std::string s = buf;
  const std::string k = "\"" + name + "\":";
  const size_t at = s.find(k);
  EXPECT_NE(at, std::string::npos) << s;
  return at == std::string::npos ? 0 : std::strtoull(s.c_str() + at + k.size(), nullptr, 10);
}

// Polls a state the plugin reaches on its own timer (counters are the only
// window on it); false after `limit`.
bool Eventually(const std::function<bool()>& cond, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// issue 20 item 3: QPs are made on a peer's first transfer and given back at
// both ends once the connection was idle for qp_idle_ms; the next transfer
// makes new ones. Eight initiators to one target, at a small scale for the VM.
TEST(IdleQps, ReleasedAtBothEndsAndMadeAgainOnUse) {
  NEED_DEVICE();
  Net net;
  net.unknown_peer_rc = FERRY_ERR_TRANSPORT;
  const std::string settings = R"({"qp_per_transfer": 2, "qp_idle_ms": 300})";
  Inst t("target", &net, settings);
  ASSERT_EQ(t.rc, FERRY_OK) << t.error;
  constexpr int kPeers = 8;
  constexpr size_t kSize = 64 * 1024;
  Mem* tm = t.Register(1, kSize * kPeers);
  std::vector<std::unique_ptr<Inst>> ini;
  std::vector<void*> to_target, imports;
  std::vector<Mem*> mems;
  for (int i = 0; i < kPeers; ++i) {
    ini.push_back(std::make_unique<Inst>("i" + std::to_string(i), &net, settings));
    Inst& e = *ini.back();
    ASSERT_EQ(e.rc, FERRY_OK) << e.error;
    to_target.push_back(e.AddPeer("target", t.ConnBlob()));
    t.AddPeer(e.key(), e.ConnBlob());
    mems.push_back(e.Register(1, kSize));
    imports.push_back(e.Import(to_target.back(), *tm));
  }
  EXPECT_EQ(Counter(t, "target_qps"), 0u) << "QPs before any transfer";
  auto write_all = [&](uint8_t seed) {
    for (int i = 0; i < kPeers; ++i) {
      std::fill(mems[i]->data.begin(), mems[i]->data.end(), static_cast<uint8_t>(seed + i));
      Completion c;
      const uint64_t off = static_cast<uint64_t>(i) * kSize;
      ASSERT_EQ(Post(*ini[i], FERRY_OP_WRITE, to_target[i], *mems[i], imports[i], {{0, off, kSize}},
                     static_cast<uint64_t>(seed) * 100 + static_cast<uint64_t>(i), &c),
                FERRY_OK);
      ASSERT_TRUE(c.Wait());
      ASSERT_EQ(c.status, FERRY_OK) << c.msg;
      ASSERT_EQ(std::memcmp(mems[i]->data.data(), tm->data.data() + off, kSize), 0);
    }
  };
  ASSERT_NO_FATAL_FAILURE(write_all(10));
  const uint64_t busy = Counter(t, "target_qps");
  std::printf("RESULT idle_qps target %llu QPs, %llu connections after %d peers wrote\n",
              static_cast<unsigned long long>(busy),
              static_cast<unsigned long long>(Counter(t, "target_connections")), kPeers);
  EXPECT_GT(busy, 0u);
  EXPECT_LE(busy, static_cast<uint64_t>(kPeers) * 2);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(Eventually(
      [&] {
        uint64_t left = Counter(t, "target_qps");
        for (auto& e : ini) left += Counter(*e, "initiator_qps");
        return left == 0;
      },
      30s))
      << "idle QPs were not released (target still has " << Counter(t, "target_qps") << ")";
  std::printf("RESULT idle_qps released at both ends %lld ms after the last transfer\n",
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                         std::chrono::steady_clock::now() - t0)
                                         .count()));
  EXPECT_EQ(Counter(t, "target_connections"), 0u);
  // Used again: new QPs, data lands, the target is notified.
  ASSERT_NO_FATAL_FAILURE(write_all(20));
  EXPECT_TRUE(t.host().WaitInbound("i3", 2003));
  for (int i = 0; i < kPeers; ++i) ops.mem_release(ini[i]->ctx(), imports[i]);
}

// What one peer's handshakes may hold at a target: QPs on ports its own
// descriptor names, up to max_qps_per_peer in all; an engine the target does
// not know gets none (it could never be answered, and its QPs would stay).
// Refused handshakes are counted and hold nothing.
TEST(HandshakeBounds, APeerGetsQpsOnlyWithinItsBound) {
  NEED_DEVICE();
  Net net;
  net.unknown_peer_rc = FERRY_ERR_TRANSPORT;
  Inst t("target", &net, R"({"max_qps_per_peer": 4})");
  ASSERT_EQ(t.rc, FERRY_OK) << t.error;
  Inst wide("wide", &net, R"({"qp_per_transfer": 8})");
  Inst fits("fits", &net, R"({"qp_per_transfer": 4})");
  ASSERT_EQ(wide.rc, FERRY_OK) << wide.error;
  ASSERT_EQ(fits.rc, FERRY_OK) << fits.error;
  constexpr size_t kSize = 64 * 1024;
  Mem* tm = t.Register(1, kSize);
  std::vector<void*> imports;
  auto write = [&](Inst& e, uint64_t uid, Completion* c) {
    void* peer = e.AddPeer("target", t.ConnBlob());
    t.AddPeer(e.key(), e.ConnBlob());
    Mem* m = e.Register(1, kSize);
    Fill(m->data, static_cast<uint8_t>(uid));
    imports.push_back(e.Import(peer, *tm));
    ASSERT_EQ(Post(e, FERRY_OP_WRITE, peer, *m, imports.back(), {{0, 0, kSize}}, uid, c), FERRY_OK);
    ASSERT_TRUE(c->Wait());
  };
  Completion too_many;
  ASSERT_NO_FATAL_FAILURE(write(wide, 1, &too_many));
  EXPECT_EQ(too_many.status, FERRY_ERR_REMOTE) << too_many.msg;
  EXPECT_NE(too_many.msg.find("max_qps_per_peer 4"), std::string::npos) << too_many.msg;
  EXPECT_EQ(Counter(t, "target_qps"), 0u);
  Completion ok;
  ASSERT_NO_FATAL_FAILURE(write(fits, 2, &ok));
  EXPECT_EQ(ok.status, FERRY_OK) << ok.msg;
  EXPECT_EQ(Counter(t, "target_qps"), 4u);

  // Handshakes forged in the name of "fits" (a port its descriptor does not
  // name) and of an engine the target does not know.
  wire::ConnInfo info;
  std::string err;
  const std::vector<uint8_t> blob = t.ConnBlob();
  ASSERT_TRUE(wire::DecodeConnInfo(blob.data(), blob.size(), &info, &err)) << err;
  wire::ConnectMsg req;
  req.conn_id = 99;
  req.target_nonce = info.nonce;
  req.mtu = 3;
  req.rd_atomic = 1;
  req.qps.assign(4, wire::QpAddr{0x123, 0x456});
  req.ini_port = 5;
  const auto other_port = wire::EncodeConnectMsg(req);
  ops.on_ctrl(t.ctx(), "fits", other_port.data(), other_port.size());
  req.ini_port = 0;
  const auto unknown = wire::EncodeConnectMsg(req);
  ops.on_ctrl(t.ctx(), "mallory", unknown.data(), unknown.size());
  EXPECT_TRUE(Eventually([&] { return Counter(t, "handshakes_refused") == 3; }, 10s))
      << Counter(t, "handshakes_refused");
  EXPECT_EQ(Counter(t, "target_qps"), 4u) << "a refused handshake holds QPs";
  EXPECT_EQ(Counter(t, "target_connections"), 1u);
  ops.mem_release(wide.ctx(), imports[0]);
  ops.mem_release(fits.ctx(), imports[1]);
}

// An initiator that removes its target peer, or ends, tells the target to
// retire the QPs serving it: one that goes away gracefully leaves none there.
// (They stayed until the target removed or fenced it; qp_idle_ms, 60 s by
// default, is far off here, and an idle release comes from the initiator.)
TEST(Farewell, TheTargetRetiresTheQpsOfAnInitiatorThatRemovedItOrEnded) {
  NEED_DEVICE();
  Net net;
  net.unknown_peer_rc = FERRY_ERR_TRANSPORT;
  Inst t("target", &net);
  ASSERT_EQ(t.rc, FERRY_OK) << t.error;
  constexpr size_t kSize = 64 * 1024;
  Mem* tm = t.Register(1, kSize);
  for (const bool ends : {false, true}) {
    SCOPED_TRACE(ends ? "fini" : "peer_remove");
    auto e = std::make_unique<Inst>(ends ? "ending" : "leaving", &net, R"({"qp_per_transfer": 2})");
    ASSERT_EQ(e->rc, FERRY_OK) << e->error;
    void* peer = e->AddPeer("target", t.ConnBlob());
    void* back = t.AddPeer(e->key(), e->ConnBlob());
    Mem* m = e->Register(1, kSize);
    void* imp = e->Import(peer, *tm);
    Completion c;
    ASSERT_EQ(Post(*e, FERRY_OP_WRITE, peer, *m, imp, {{0, 0, kSize}}, 1, &c), FERRY_OK);
    ASSERT_TRUE(c.Wait());
    ASSERT_EQ(c.status, FERRY_OK) << c.msg;
    EXPECT_EQ(Counter(t, "target_qps"), 2u);
    ops.mem_release(e->ctx(), imp);
    if (ends)
      e.reset();
    else
      ops.peer_remove(e->ctx(), peer);
    EXPECT_TRUE(Eventually([&] { return Counter(t, "target_qps") == 0; }, 10s))
        << "the target still holds " << Counter(t, "target_qps") << " QPs";
    EXPECT_EQ(Counter(t, "target_connections"), 0u);
    ops.peer_remove(t.ctx(), back);
  }
}

}  // namespace
