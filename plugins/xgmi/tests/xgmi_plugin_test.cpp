// SPDX-License-Identifier: Apache-2.0
// The xgmi plugin on a host without a GPU: the fake runtime of
// testing/fake_gpu.h stands for CUDA/HIP ("device memory" is host memory, a
// queued copy runs only when something waits for it, a copy call can be made
// to fail). What it checks is xgmi's own logic - pieces merged and bounded,
// held parts and multi-pair posts launched together, and above all that a
// failed launch is reported only once every copy it queued has run: xgmi
// claims INITIATOR_COPY (nothing lands after complete(), so the core fences
// nothing and may retry elsewhere at once). The real copies run in
// tests/gpu/gpu_transfer_test on a GPU host.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"
#include "notify_events.h"
#include "process_tag.h"
#include "testing/fake_gpu.h"
#include "testing/plugin_harness.h"
#include "xgmi_blob.h"

extern "C" const ferry_plugin_ops_v1 ferry_plugin_v1;

namespace {

using ferry_plugin_test::Completion;
using ferry_plugin_test::Fill;
using ferry_plugin_test::MakeXfer;
using ferry_plugin_test::Mem;
using ferry_plugin_test::PairOptions;
using ferry_plugin_test::PairTest;
using ferry_plugin_test::XferArgs;

const ferry_plugin_ops_v1& Ops() { return ferry_plugin_v1; }

PairOptions SameHost() {
  PairOptions o;
  o.instance.same_host = 1;
  return o;
}

// What complete() said, and how often.
struct Observed {
  int status;
  int calls;
};

class Xgmi : public PairTest<> {
 protected:
  Xgmi() : PairTest<>(Ops(), SameHost()) {}
  // hold_us at its longest: held parts wait for their last part (were the
  // completion thread to launch them first, the outcomes checked are the
  // same); idle_spin_us 0, so it sleeps between tests.
  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(Connect(settings_, gpu_.table(), gpu_.table()));
    src_ = a_->Register(1, kSize, 0);
    dst_ = b_->Register(2, kSize, 0);
    Fill(src_->data, 7);
    remote_ = a_->Import(a_peer_b_, *dst_);
  }
  // As the core does: imports and peers go before the instances, and the
  // instances before the fake runtime they use (a member of this class, so
  // destroyed before the base's instances would be).
  void TearDown() override {
    EXPECT_EQ(gpu_.wrong_device_calls.load(), 0u)
        << "work queued on a stream of another device than the current one";
    // (A test may have ended a_ already, or removed its peer.)
    if (a_->ok() && remote_) a_->plugin().mem_release(a_->ctx(), remote_);
    if (a_->ok() && a_peer_b_) a_->plugin().peer_remove(a_->ctx(), a_peer_b_);
    b_->plugin().peer_remove(b_->ctx(), b_peer_a_);
    remote_ = a_peer_b_ = nullptr;
    PairTest<>::TearDown();
  }
  // Non-contiguous 4 KiB pieces: piece i from src 8 KiB * i to dst 8 KiB * i + 4 KiB,
  // so none merges with the next and each is a copy call of its own.
  static std::vector<ferry_iov_v1> Pieces(size_t first, size_t n) {
    std::vector<ferry_iov_v1> iov;
    for (size_t i = first; i < first + n; ++i) iov.push_back({8192 * i, 8192 * i + 4096, 4096});
    return iov;
  }
  static bool LandedIn(const Mem& src, const Mem& dst, const ferry_iov_v1& v) {
    return std::memcmp(src.data.data() + v.local_off, dst.data.data() + v.remote_off, v.len) == 0;
  }
  bool Landed(const ferry_iov_v1& v) const { return LandedIn(*src_, *dst_, v); }
  // Eight pieces, the last past the target's region: refused, nothing queued.
  void ExpectAPieceOutsideRefused() {
    auto iov = Pieces(0, 8);
    iov.back().remote_off = kSize - 100;
    Completion c;
    const ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, &c);
    EXPECT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_ERR_INVALID_ARGS);
    EXPECT_EQ(gpu_.queued(), 0u);
    EXPECT_EQ(gpu_.copied.load(), 0u);
  }
  // The fourth copy of eight pieces fails: three are queued on the stream. The
  // transfer fails, once, and not before those three have run - a report first
  // would let them land after the core was told the transfer is over.
  void ExpectFailureAfterThreeCopies(uint32_t op) {
    gpu_.copied = 0;
    gpu_.fail_after_copies = 3;
    const auto iov = Pieces(0, 8);
    Completion c;
    const ferry_xfer_v1 x = MakeXfer(op, a_peer_b_, src_, remote_, iov, &c);
    ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK)
        << "a launch that may have queued copies is failed by complete()";
    const Observed o = Wait(c);
    EXPECT_EQ(o.status, FERRY_ERR_GPU);
    EXPECT_EQ(o.calls, 1);
    EXPECT_EQ(gpu_.queued(), 0u) << "copies still queued when the failure was reported";
    EXPECT_EQ(gpu_.copied.load(), 3u * 4096);
    gpu_.fail_after_copies = -1;
  }
  // One WRITE of these pieces into `remote` (the target's region by default).
  Observed Write(const std::vector<ferry_iov_v1>& iov, void* remote = nullptr) {
    Completion c;
    const ferry_xfer_v1 x =
        MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote ? remote : remote_, iov, &c);
    EXPECT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
    return Wait(c);
  }
  static Observed Wait(Completion& c) {
    EXPECT_TRUE(c.Wait()) << "never completed";
    std::lock_guard lk(c.mu);
    return {c.status, c.calls};
  }

  static constexpr size_t kSize = 1 << 20;
  std::string settings_ = R"({"hold_us":100000,"idle_spin_us":0})";  // both instances'
  ferry_test::FakeGpu gpu_;
  Mem* src_ = nullptr;
  Mem* dst_ = nullptr;
  void* remote_ = nullptr;
};

TEST_F(Xgmi, PiecesLandWhereTheySay) {
  const auto iov = Pieces(0, 16);
  Completion c;
  const ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, &c);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
  const Observed o = Wait(c);
  EXPECT_EQ(o.status, FERRY_OK);
  for (const auto& v : iov) EXPECT_TRUE(Landed(v));
  // The gap between two pieces stays untouched.
  EXPECT_EQ(dst_->data[8192 * 3 + 100], 0);
}

TEST_F(Xgmi, APieceOutsideARegionQueuesNothing) { ExpectAPieceOutsideRefused(); }

// A region must lie within one GPU allocation: the importer maps exactly that
// one, so a region running past it is refused at registration, not copied
// past the mapping later.
TEST_F(Xgmi, ARegionRunningPastItsAllocationIsRefused) {
  std::vector<uint8_t> bytes(8192);
  ferry_mem_v1 desc{};
  desc.struct_size = sizeof desc;
  desc.location = FERRY_MEM_GPU;
  desc.id = 9;
  desc.addr = bytes.data();
  desc.size = bytes.size();
  desc.device = 0;
  std::vector<uint8_t> blob(FERRY_MAX_BLOB);
  void* h = nullptr;
  size_t len = blob.size();
  gpu_.allocation_bytes = 4096;  // the runtime says the allocation is half of it
  EXPECT_EQ(a_->plugin().mem_register(a_->ctx(), &desc, &h, blob.data(), &len),
            FERRY_ERR_INVALID_ARGS);
  EXPECT_EQ(h, nullptr);
  gpu_.allocation_bytes = bytes.size();  // exactly one allocation: accepted
  len = blob.size();
  ASSERT_EQ(a_->plugin().mem_register(a_->ctx(), &desc, &h, blob.data(), &len), FERRY_OK);
  a_->plugin().mem_deregister(a_->ctx(), h);
  gpu_.allocation_bytes = 0;
}

// A copy call fails part-way (ExpectFailureAfterThreeCopies).
// Two containers on one host are one node (they share the boot id) and may
// both run their engine as pid 1. A region of the other one carries that
// process's tag: its handle is opened, its address is not used as ours. An
// exporter that wrote its bare pid there (an older xgmi) is another process
// too, whatever that pid is.
TEST_F(Xgmi, ARegionOfAnotherProcessWithOurPidIsOpenedNotUsedAsOurs) {
  ASSERT_EQ(Write(Pieces(0, 1)).status, FERRY_OK);
  EXPECT_EQ(gpu_.ipc_opens.load(), 0) << "a region of this process is used directly";
  Mem other = *dst_;
  const uint64_t pid = static_cast<uint64_t>(getpid());
  std::memcpy(other.blob.data() + offsetof(ferry_xgmi::MemBlob, process), &pid, sizeof pid);
  void* remote = a_->Import(a_peer_b_, other);
  ASSERT_NE(remote, nullptr);
  EXPECT_EQ(Write(Pieces(1, 1), remote).status, FERRY_OK);
  EXPECT_EQ(gpu_.ipc_opens.load(), 1) << "a region of another process with our pid";
  EXPECT_TRUE(Landed(Pieces(1, 1)[0]));
  a_->plugin().mem_release(a_->ctx(), remote);
}

// A peer's mapping is closed when the last import that used it is released
// (after its peer was removed), not kept until fini: a decode engine whose
// prefill peers restart would otherwise keep every dead allocation mapped.
TEST_F(Xgmi, AMappingIsClosedWithTheLastImportThatUsedIt) {
  Mem other = *dst_;
  const uint64_t another = ferry_xgmi::ProcessTag() ^ 1;
  std::memcpy(other.blob.data() + offsetof(ferry_xgmi::MemBlob, process), &another, sizeof another);
  void* first = a_->Import(a_peer_b_, other);
  void* second = a_->Import(a_peer_b_, other);  // the same allocation, imported twice
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(Write(Pieces(0, 1), first).status, FERRY_OK);
  EXPECT_EQ(Write(Pieces(1, 1), second).status, FERRY_OK);
  EXPECT_EQ(gpu_.ipc_opens.load(), 1) << "one mapping per allocation and device";
  a_->plugin().mem_release(a_->ctx(), first);
  EXPECT_EQ(gpu_.ipc_closes.load(), 0) << "closed while another import uses it";
  EXPECT_EQ(Write(Pieces(2, 1), second).status, FERRY_OK);
  EXPECT_TRUE(Landed(Pieces(2, 1)[0]));
  a_->plugin().mem_release(a_->ctx(), second);
  EXPECT_EQ(gpu_.ipc_closes.load(), 1);
  void* third = a_->Import(a_peer_b_, other);  // imported again: mapped again
  EXPECT_EQ(Write(Pieces(3, 1), third).status, FERRY_OK);
  EXPECT_EQ(gpu_.ipc_opens.load(), 2);
  EXPECT_TRUE(Landed(Pieces(3, 1)[0]));
  a_->plugin().mem_release(a_->ctx(), third);
  EXPECT_EQ(gpu_.ipc_closes.load(), 2);
}

TEST_F(Xgmi, AFailedCopyCallFailsOnceWhatItQueuedHasRun) {
  for (const uint32_t op : {FERRY_OP_WRITE, FERRY_OP_READ}) {
    SCOPED_TRACE(op == FERRY_OP_WRITE ? "WRITE" : "READ");
    ExpectFailureAfterThreeCopies(op);
  }
}

// Held parts (FERRY_XFER_MORE) launched as one: the launch fails part-way,
// every part fails once, after what was queued has run.
TEST_F(Xgmi, AFailedHeldLaunchFailsEveryPartAfterItsQueuedCopies) {
  gpu_.fail_after_copies = 5;
  Completion c1, c2, c3;
  const auto iov1 = Pieces(0, 4), iov2 = Pieces(4, 4), iov3 = Pieces(8, 4);
  const ferry_xfer_v1 x1 = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov1, &c1,
                                    XferArgs{.flags = FERRY_XFER_MORE});
  const ferry_xfer_v1 x2 = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov2, &c2,
                                    XferArgs{.flags = FERRY_XFER_MORE});
  const ferry_xfer_v1 x3 = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov3, &c3);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x1), FERRY_OK);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x2), FERRY_OK);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x3), FERRY_OK);
  for (Completion* c : {&c1, &c2, &c3}) {
    const Observed o = Wait(*c);
    EXPECT_EQ(o.status, FERRY_ERR_GPU);
    EXPECT_EQ(o.calls, 1);
  }
  EXPECT_EQ(gpu_.queued(), 0u);
  EXPECT_EQ(gpu_.copied.load(), 5u * 4096);
}

// Parts held on device 1 (FERRY_XFER_MORE) are launched first by a post on
// device 0, which makes device 1 the thread's current one: the post's own
// stream and copies must still be device 0's.
TEST_F(Xgmi, APostAfterAnotherDevicesHeldPartsQueuesOnItsOwnDevice) {
  Mem* src2 = a_->Register(3, kSize, 1);
  Mem* dst2 = b_->Register(4, kSize, 0);
  Fill(src2->data, 5);
  void* remote2 = a_->Import(a_peer_b_, *dst2);
  const auto iov1 = Pieces(0, 4), iov2 = Pieces(4, 4);
  Completion c1, c2;
  const ferry_xfer_v1 x1 = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src2, remote2, iov1, &c1,
                                    XferArgs{.flags = FERRY_XFER_MORE});
  const ferry_xfer_v1 x2 = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov2, &c2);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x1), FERRY_OK);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x2), FERRY_OK);
  EXPECT_EQ(Wait(c1).status, FERRY_OK);
  EXPECT_EQ(Wait(c2).status, FERRY_OK);
  for (const auto& v : iov1) EXPECT_TRUE(LandedIn(*src2, *dst2, v));
  for (const auto& v : iov2) EXPECT_TRUE(Landed(v));
  EXPECT_EQ(gpu_.wrong_device_calls.load(), 0u);
  EXPECT_EQ(gpu_.streams_on(1), 1u) << "the held parts' stream";
  EXPECT_EQ(gpu_.streams_on(0), 1u) << "device 0's copies went on a stream of device 1";
  a_->plugin().mem_release(a_->ctx(), remote2);
}

// A device that cannot be made current refuses the post, saying why, with
// nothing queued.
TEST_F(Xgmi, ADeviceThatCannotBeSetRefusesThePostWithItsReason) {
  const auto iov = Pieces(0, 4);
  Completion c;
  ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, &c);
  char reason[256] = {};
  x.reason = reason;
  x.reason_len = sizeof reason;
  gpu_.fail_set_device = true;
  EXPECT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_ERR_GPU);
  gpu_.fail_set_device = false;
  EXPECT_NE(std::string(reason).find("cannot make device 0 current"), std::string::npos) << reason;
  EXPECT_EQ(gpu_.queued(), 0u);
}

// ABI 1.7: several region pairs in one post - src_ -> dst_ and a second pair
// whose local memory is on `device` - 4 pieces each, one WRITE. Each case
// makes the copy calls fail after `fail_after` (never when < 0) and expects
// that many launches and copies run before the one completion.
struct PairCase {
  int fail_after;
  uint64_t launches, copied;
};

class XgmiPairs : public Xgmi {
 protected:
  void Check(int device, std::initializer_list<PairCase> cases) {
    Mem* src2 = a_->Register(3, kSize, device);
    Mem* dst2 = b_->Register(4, kSize, 0);
    Fill(src2->data, 11);
    void* remote2 = a_->Import(a_peer_b_, *dst2);
    const std::vector<ferry_iov_v1> iov = TwoPairPieces();
    const ferry_pair_v1 pairs[2] = {{src_->handle, remote_, 4}, {src2->handle, remote2, 4}};
    for (const PairCase& k : cases) {
      SCOPED_TRACE(k.fail_after);
      gpu_.copied = 0;
      gpu_.fail_after_copies = k.fail_after;
      const uint64_t launches = Counter("pair_launches");
      Completion c;
      const ferry_xfer_v1 x = PairsXfer(iov, pairs, &c);
      ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
      const Observed o = Wait(c);
      EXPECT_EQ(o.calls, 1);
      EXPECT_EQ(o.status, k.fail_after < 0 ? FERRY_OK : FERRY_ERR_GPU);
      EXPECT_EQ(gpu_.queued(), 0u) << "copies still queued when the transfer was reported";
      EXPECT_EQ(gpu_.copied.load(), k.copied * 4096);
      EXPECT_EQ(Counter("pair_launches") - launches, k.launches);
      EXPECT_EQ(Counter("copies_in_flight"), 0u);
      for (size_t i = 0; k.fail_after < 0 && i < iov.size(); ++i)
        EXPECT_TRUE(i < 4 ? Landed(iov[i]) : LandedIn(*src2, *dst2, iov[i])) << "piece " << i;
    }
    gpu_.fail_after_copies = -1;
    a_->plugin().mem_release(a_->ctx(), remote2);
  }
  uint64_t Counter(const char* name) {
    char buf[4096];
    EXPECT_EQ(a_->plugin().counters(a_->ctx(), buf, sizeof buf), FERRY_OK);
    return nlohmann::json::parse(buf)[name].get<uint64_t>();
  }
  // Pieces 0-3 (the first pair's), then 10-13 (the second's).
  static std::vector<ferry_iov_v1> TwoPairPieces() {
    std::vector<ferry_iov_v1> iov = Pieces(0, 4);
    for (const auto& v : Pieces(10, 4)) iov.push_back(v);
    return iov;
  }
  // A WRITE of iov over the two pairs (borrows both).
  ferry_xfer_v1 PairsXfer(const std::vector<ferry_iov_v1>& iov, const ferry_pair_v1* pairs,
                          Completion* c) {
    ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, c);
    x.local_mem = nullptr;
    x.remote_mem = nullptr;
    x.n_pairs = 2;
    x.pairs = pairs;
    return x;
  }
};

// Both pairs on one device: one launch; failing after 6 copies, once after them.
TEST_F(XgmiPairs, OneDeviceIsOneLaunchAndFailsAfterItsCopies) { Check(0, {{-1, 1, 8}, {6, 1, 6}}); }

// Two devices (the fake runtime has two): one launch each, one completion.
// After 2 copies the first device's launch fails and the second is never
// launched; after 5 the second device's launch fails.
TEST_F(XgmiPairs, TwoDevicesAreTwoLaunchesAndOneCompletion) {
  Check(1, {{-1, 2, 8}, {2, 1, 2}, {5, 2, 5}});
}

// ABI 1.9: with copy_segments_async in the runtime, a transfer of several
// pieces (and a multi-pair post on one device) is one call that writes its
// table from the pieces; the runtime's refusal of a piece refuses the post
// with nothing queued, and where it cannot, xgmi merges and batches as before.
class XgmiSegments : public Xgmi {
 protected:
  XgmiSegments() { gpu_.WithSegments(); }
};

TEST_F(XgmiSegments, PiecesGoInOneCallAndLand) {
  for (const uint32_t op : {FERRY_OP_WRITE, FERRY_OP_READ}) {
    SCOPED_TRACE(op == FERRY_OP_WRITE ? "WRITE" : "READ");
    const int calls = gpu_.segment_calls.load();
    gpu_.copied = 0;
    const auto iov = Pieces(0, 16);
    Completion c;
    const ferry_xfer_v1 x = MakeXfer(op, a_peer_b_, src_, remote_, iov, &c);
    ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
    EXPECT_EQ(Wait(c).status, FERRY_OK);
    EXPECT_EQ(gpu_.segment_calls.load(), calls + 1);
    EXPECT_EQ(gpu_.copied.load(), 16u * 4096);
    if (op == FERRY_OP_WRITE) {
      for (const auto& v : iov) EXPECT_TRUE(Landed(v));
    }
  }
}

TEST_F(XgmiSegments, APieceTheRuntimeRefusesRefusesThePostWithNothingQueued) {
  ExpectAPieceOutsideRefused();
  EXPECT_EQ(gpu_.segment_calls.load(), 1);
}

TEST_F(XgmiSegments, AFailedCallFailsOnceWhatItQueuedHasRun) {
  const int calls = gpu_.segment_calls.load();
  ExpectFailureAfterThreeCopies(FERRY_OP_WRITE);
  EXPECT_EQ(gpu_.segment_calls.load(), calls + 1);
}

TEST_F(XgmiSegments, WhereTheRuntimeCannotThePiecesAreMergedAndCopiedAsBefore) {
  gpu_.segments_unsupported = true;
  const auto iov = Pieces(0, 16);
  Completion c;
  const ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, &c);
  ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
  EXPECT_EQ(Wait(c).status, FERRY_OK);
  EXPECT_EQ(gpu_.segment_calls.load(), 1);
  for (const auto& v : iov) EXPECT_TRUE(Landed(v));
}

// The multi-pair cases above again with the runtime's segments call: on one
// device it is the one launch; over two devices xgmi checks every device's
// pieces before the first launch, so it merges them itself (no segments call).
class XgmiPairsSegments : public XgmiPairs {
 protected:
  XgmiPairsSegments() { gpu_.WithSegments(); }
};

TEST_F(XgmiPairsSegments, OneDeviceIsOneCallAndFailsAfterItsCopies) {
  Check(0, {{-1, 1, 8}, {6, 1, 6}});
  EXPECT_EQ(gpu_.segment_calls.load(), 2);
}

// A piece of the second pair outside its regions: the post is refused with
// nothing queued, and the stream it had taken is free again - the same pairs
// then move in one call.
TEST_F(XgmiPairsSegments, APieceOutsideItsPairRefusesThePostAndGivesTheStreamBack) {
  Mem* src2 = a_->Register(5, kSize, 0);
  Mem* dst2 = b_->Register(6, kSize, 0);
  void* remote2 = a_->Import(a_peer_b_, *dst2);
  std::vector<ferry_iov_v1> iov = TwoPairPieces();
  iov.back().local_off = kSize - 100;  // past src2's end
  const ferry_pair_v1 pairs[2] = {{src_->handle, remote_, 4}, {src2->handle, remote2, 4}};
  Completion c;
  const ferry_xfer_v1 x = PairsXfer(iov, pairs, &c);
  EXPECT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_ERR_INVALID_ARGS);
  EXPECT_EQ(gpu_.segment_calls.load(), 1);
  EXPECT_EQ(gpu_.queued(), 0u);
  EXPECT_EQ(Counter("copies_in_flight"), 0u);
  a_->plugin().mem_release(a_->ctx(), remote2);
  Check(0, {{-1, 1, 8}});
  // A stream still counted busy would have made the next post take a new one.
  EXPECT_EQ(gpu_.streams_on(0), 1u) << "the refused post kept its stream";
}

TEST_F(XgmiPairsSegments, TwoDevicesAreMergedHere) {
  Check(1, {{-1, 2, 8}, {2, 1, 2}, {5, 2, 5}});
  EXPECT_EQ(gpu_.segment_calls.load(), 0);
}

// ---- notification in the GPU's order (ABI 1.8, notify_events.h) -----------

// A notify transfer: the target's xgmi reports it (host->inbound) once the
// event recorded behind its copy has fired, and the initiator completes with
// plain FERRY_OK - the core sends no NOTIFY. Where that cannot be done the
// initiator completes FERRY_OK_NOTIFY_BY_CORE and the target hears nothing
// from xgmi.
class XgmiNotify : public Xgmi {
 protected:
  XgmiNotify() { opt_.ctrl = true; }  // a_'s ctrl_send reaches b_'s on_ctrl
  Observed Notify(uint32_t op, uint64_t uid, const std::vector<ferry_iov_v1>& iov,
                  void* peer = nullptr, void* remote = nullptr) {
    Completion c;
    const ferry_xfer_v1 x = MakeXfer(op, peer ? peer : a_peer_b_, src_, remote ? remote : remote_,
                                     iov, &c, XferArgs{.flags = FERRY_XFER_NOTIFY, .uid = uid});
    EXPECT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
    return Wait(c);
  }
  static uint64_t Counter(ferry_plugin_test::Instance& e, const char* name) {
    char buf[4096];
    EXPECT_EQ(e.plugin().counters(e.ctx(), buf, sizeof buf), FERRY_OK);
    return nlohmann::json::parse(buf)[name].get<uint64_t>();
  }
  void OnCtrl(const void* msg, size_t len) {
    b_->plugin().on_ctrl(b_->ctx(), a_->key().c_str(), msg, len);
  }
  // 200 notify WRITEs and READs, each waited for, while another thread polls
  // progress() throughout.
  void WithAWaiterPolling();
};

TEST_F(XgmiNotify, TheTargetReportsWritesAndReadsOnceTheirEventsFired) {
  const auto iov = Pieces(0, 4);
  const Observed w = Notify(FERRY_OP_WRITE, 101, iov);
  EXPECT_EQ(w.status, FERRY_OK);
  ASSERT_TRUE(b_->host().WaitInbound(a_->key(), 101));
  for (const auto& v : iov) EXPECT_TRUE(Landed(v));
  Fill(dst_->data, 9);  // a READ brings these bytes back into src_
  const Observed r = Notify(FERRY_OP_READ, 102, iov);
  EXPECT_EQ(r.status, FERRY_OK);
  ASSERT_TRUE(b_->host().WaitInbound(a_->key(), 102));
  for (const auto& v : iov) EXPECT_TRUE(Landed(v));
  EXPECT_EQ(b_->host().CountInbound(101), 1);
  EXPECT_EQ(b_->host().CountInbound(102), 1);
  EXPECT_EQ(Counter(*a_, "notified_by_event"), 2u);
  EXPECT_EQ(Counter(*a_, "notified_by_core"), 0u);
  EXPECT_EQ(Counter(*b_, "inbound_reported"), 2u);
}

// A waiter polls progress() throughout, as the core's Wait() does, so it and
// the completion thread race for each transfer's message and report (with
// waiter_drives the waiter does both alone). Every transfer completes only
// once its copy has run - the fake runtime runs a copy only when something
// waits for it, so a READ reported early has not brought its bytes - and its
// target is told of it once.
void XgmiNotify::WithAWaiterPolling() {
  std::atomic<bool> stop{false};
  std::thread waiter([&] {
    while (!stop.load()) a_->plugin().progress(a_->ctx());
  });
  struct Joined {  // also when an assertion below returns early
    std::atomic<bool>& stop;
    std::thread& t;
    ~Joined() {
      stop = true;
      t.join();
    }
  } joined{stop, waiter};
  const auto iov = Pieces(0, 4);
  for (uint64_t i = 0; i < 200; ++i) {
    const bool read = i % 2 == 1;
    Fill(read ? dst_->data : src_->data, static_cast<uint8_t>(i));
    const Observed o = Notify(read ? FERRY_OP_READ : FERRY_OP_WRITE, 1000 + i, iov);
    ASSERT_EQ(o.status, FERRY_OK) << "transfer " << i;
    for (const auto& v : iov) ASSERT_TRUE(Landed(v)) << "transfer " << i << " reported early";
  }
  for (uint64_t i = 0; i < 200; ++i) ASSERT_TRUE(b_->host().WaitInbound(a_->key(), 1000 + i));
  for (uint64_t i = 0; i < 200; ++i) EXPECT_EQ(b_->host().CountInbound(1000 + i), 1);
  EXPECT_EQ(Counter(*a_, "notified_by_event"), 200u);
  EXPECT_EQ(Counter(*b_, "inbound_reported"), 200u);
}

TEST_F(XgmiNotify, WithAWaiterPollingEveryTransferLandsAndItsTargetIsToldOnce) {
  WithAWaiterPolling();
}

// The same where the polling waiter sends the messages and queries the
// events alone (waiter_drives).
class XgmiNotifyWaiterDrives : public XgmiNotify {
 protected:
  XgmiNotifyWaiterDrives() {
    settings_ = R"({"hold_us":100000,"idle_spin_us":0,"waiter_drives":true})";
  }
};

TEST_F(XgmiNotifyWaiterDrives, WithAWaiterPollingEveryTransferLandsAndItsTargetIsToldOnce) {
  WithAWaiterPolling();
}

// The target watches an event of another process (opened from its handle)
// and reports nothing while the event says "not yet": here the fake runtime
// holds every query, and the target has polled 50 times first.
TEST_F(XgmiNotify, NothingIsReportedBeforeTheEventFires) {
  void* stream = nullptr;
  void* event = nullptr;
  const ferry_gpu_v1* g = gpu_.table();
  ASSERT_EQ(g->stream_create(g->gpu_ctx, &stream), FERRY_OK);
  ASSERT_EQ(g->event_create_ipc(g->gpu_ctx, &event), FERRY_OK);
  gpu_.hold_queries = true;
  ASSERT_EQ(g->memcpy_async(g->gpu_ctx, dst_->data.data(), src_->data.data(), 4096, stream),
            FERRY_OK);
  ASSERT_EQ(g->event_record(g->gpu_ctx, event, stream), FERRY_OK);
  ferry_xgmi::AfterEventMsg m;
  m.uid = 7;
  m.process = ferry_xgmi::ProcessTag() ^ 1;  // "another process": its handle is opened
  ASSERT_EQ(g->ipc_event_handle(g->gpu_ctx, event, m.handle), FERRY_OK);
  const uint64_t before = gpu_.queries();
  OnCtrl(&m, sizeof m);
  // Until the target polled 50 times, or reported (wrongly), or 30 s passed.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (gpu_.queries() < before + 50 && b_->host().CountInbound(7) == 0 &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::yield();
  EXPECT_GE(gpu_.queries(), before + 50);
  EXPECT_EQ(b_->host().CountInbound(7), 0) << "reported before its event fired";
  EXPECT_EQ(gpu_.copied.load(), 0u);
  gpu_.hold_queries = false;
  ASSERT_TRUE(b_->host().WaitInbound(a_->key(), 7));
  EXPECT_EQ(gpu_.copied.load(), 4096u);
  EXPECT_EQ(Counter(*b_, "inbound_events_open"), 1u);
}

// The message of an initiator in another container whose engine has our pid
// (or of an older xgmi, which sent its bare pid): its event is opened from the
// handle and watched, not looked up among this process's own and dropped.
TEST_F(XgmiNotify, AnEventOfAnotherProcessWithOurPidIsOpenedAndWatched) {
  void* stream = nullptr;
  void* event = nullptr;
  const ferry_gpu_v1* g = gpu_.table();
  ASSERT_EQ(g->stream_create(g->gpu_ctx, &stream), FERRY_OK);
  ASSERT_EQ(g->event_create_ipc(g->gpu_ctx, &event), FERRY_OK);
  ASSERT_EQ(g->event_record(g->gpu_ctx, event, stream), FERRY_OK);
  ferry_xgmi::AfterEventMsg m;
  m.uid = 8;
  m.process = static_cast<uint64_t>(getpid());
  ASSERT_EQ(g->ipc_event_handle(g->gpu_ctx, event, m.handle), FERRY_OK);
  OnCtrl(&m, sizeof m);
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 8));
  EXPECT_EQ(Counter(*b_, "inbound_events_open"), 1u);
  EXPECT_EQ(Counter(*b_, "inbound_dropped"), 0u);
}

TEST_F(XgmiNotify, ABusyControlConnectionLeavesTheNotificationToTheCore) {
  net_.busy = true;
  const Observed o = Notify(FERRY_OP_WRITE, 201, Pieces(0, 2));
  EXPECT_EQ(o.status, FERRY_OK_NOTIFY_BY_CORE);
  EXPECT_EQ(Counter(*b_, "inbound_watched"), 0u);
  EXPECT_EQ(Counter(*a_, "notified_by_core"), 1u);
  net_.busy = false;
  EXPECT_EQ(Notify(FERRY_OP_WRITE, 202, Pieces(0, 2)).status, FERRY_OK);
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 202));
  EXPECT_EQ(b_->host().CountInbound(201), 0);
}

// A target region whose blob lacks kMemWatchesEvents (exported by an xgmi
// from before notify_events.h, which left the byte 0) is told of by the core.
TEST_F(XgmiNotify, ARegionOfAnOlderXgmiIsToldOfByTheCore) {
  ASSERT_TRUE(dst_->blob[1] & ferry_xgmi::kMemWatchesEvents) << "the flags byte moved";
  Mem older = *dst_;
  older.blob[1] = 0;
  void* remote = a_->Import(a_peer_b_, older);
  EXPECT_EQ(Notify(FERRY_OP_WRITE, 301, Pieces(0, 2), a_peer_b_, remote).status,
            FERRY_OK_NOTIFY_BY_CORE);
  EXPECT_EQ(Counter(*a_, "notified_by_core"), 1u);
  a_->plugin().mem_release(a_->ctx(), remote);
}

// One region pair's device: one event for the whole multi-pair transfer. Two
// devices: two launches, which the target cannot watch as one - the core.
TEST_F(XgmiNotify, AMultiPairTransferOnOneDeviceIsReportedByItsEvent) {
  for (const int device : {0, 1}) {
    SCOPED_TRACE(device);
    Mem* src2 = a_->Register(10 + device, kSize, device);
    Mem* dst2 = b_->Register(20 + device, kSize, 0);
    void* remote2 = a_->Import(a_peer_b_, *dst2);
    std::vector<ferry_iov_v1> iov = Pieces(0, 2);
    for (const auto& v : Pieces(10, 2)) iov.push_back(v);
    const ferry_pair_v1 pairs[2] = {{src_->handle, remote_, 2}, {src2->handle, remote2, 2}};
    Completion c;
    ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, &c,
                               XferArgs{.flags = FERRY_XFER_NOTIFY, .uid = 400u + device});
    x.n_pairs = 2;
    x.pairs = pairs;
    ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK);
    EXPECT_EQ(Wait(c).status, device == 0 ? FERRY_OK : FERRY_OK_NOTIFY_BY_CORE);
    if (device == 0) {
      EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 400));
    }
    a_->plugin().mem_release(a_->ctx(), remote2);
  }
  EXPECT_EQ(b_->host().CountInbound(401), 0);
}

// What a hostile or broken peer may send: the wrong size, the wrong version,
// an event "of this process" that is not one. Each is dropped and counted;
// nothing is reported; a real notification still is.
TEST_F(XgmiNotify, MalformedMessagesAreDropped) {
  ferry_xgmi::AfterEventMsg m;
  m.uid = 500;
  m.process = ferry_xgmi::ProcessTag();
  m.pool_id = 12345;  // no such pool here
  OnCtrl(&m, sizeof m);
  const auto pool = ferry_xgmi::EventPool::Create(gpu_.table());  // a real one of this process
  ASSERT_TRUE(pool);
  m.pool_id = pool->id();
  m.slot = 1u << 30;  // beyond it
  OnCtrl(&m, sizeof m);
  OnCtrl(&m, 5);
  m.magic ^= 1;
  OnCtrl(&m, sizeof m);
  EXPECT_EQ(Counter(*b_, "inbound_dropped"), 4u);
  EXPECT_EQ(Counter(*b_, "inbound_watched"), 0u);
  EXPECT_EQ(Notify(FERRY_OP_WRITE, 501, Pieces(0, 1)).status, FERRY_OK);
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 501));
  EXPECT_EQ(b_->host().CountInbound(500), 0);
}

// More notify transfers in flight than a device has events (all held in
// flight by the fake runtime): each of the first kSlotsPerDevice gets one and
// is reported by its event, the next is left to the core. While they end,
// this thread also reports through progress(), racing the completion thread
// for the sends and reports (each exactly once; TSan runs this in CI).
TEST_F(XgmiNotify, MoreInFlightThanEventsLeavesTheRestToTheCore) {
  constexpr size_t kSlots = ferry_xgmi::EventPool::kSlotsPerDevice;
  constexpr size_t n = kSlots + 1;
  const auto iov = Pieces(0, 1);
  std::vector<std::unique_ptr<Completion>> done;
  gpu_.Hold();
  for (size_t i = 0; i < n; ++i) {
    done.push_back(std::make_unique<Completion>());
    const ferry_xfer_v1 x = MakeXfer(FERRY_OP_WRITE, a_peer_b_, src_, remote_, iov, done[i].get(),
                                     XferArgs{.flags = FERRY_XFER_NOTIFY, .uid = 1000 + i});
    ASSERT_EQ(a_->plugin().post(a_->ctx(), &x), FERRY_OK) << i;
  }
  gpu_.Release();
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  auto all_done = [&] {
    for (auto& c : done) {
      std::lock_guard lk(c->mu);
      if (c->calls == 0) return false;
    }
    return true;
  };
  while (!all_done() && std::chrono::steady_clock::now() < until) a_->plugin().progress(a_->ctx());
  size_t by_event = 0, by_core = 0;
  for (size_t i = 0; i < n; ++i) {
    const Observed o = Wait(*done[i]);
    EXPECT_EQ(o.calls, 1) << i;
    by_event += o.status == FERRY_OK;
    by_core += o.status == FERRY_OK_NOTIFY_BY_CORE;
    if (o.status == FERRY_OK) {
      EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 1000 + i)) << i;
    }
  }
  EXPECT_EQ(by_event, kSlots);
  EXPECT_EQ(by_core, 1u);
  EXPECT_EQ(done.back()->status, FERRY_OK_NOTIFY_BY_CORE) << "the one past the pool";
  EXPECT_EQ(Counter(*a_, "notified_by_event"), kSlots);
  EXPECT_EQ(Counter(*a_, "copies_in_flight"), 0u);
}

// The target bounds what one peer may have watched: past kMaxWatchedPerPeer
// that peer's messages are dropped (its events never fire here), another
// peer's are still watched.
TEST_F(XgmiNotify, OnePeerCannotFillTheTargetsWatch) {
  constexpr size_t kPerPeer = ferry_xgmi::InboundWatch::kMaxWatchedPerPeer;
  const ferry_gpu_v1* g = gpu_.table();
  void* stream = nullptr;
  void* event = nullptr;
  ASSERT_EQ(g->stream_create(g->gpu_ctx, &stream), FERRY_OK);
  ASSERT_EQ(g->event_create_ipc(g->gpu_ctx, &event), FERRY_OK);
  gpu_.Hold();
  ASSERT_EQ(g->event_record(g->gpu_ctx, event, stream), FERRY_OK);
  ferry_xgmi::AfterEventMsg m;
  m.process = ferry_xgmi::ProcessTag() ^ 1;
  ASSERT_EQ(g->ipc_event_handle(g->gpu_ctx, event, m.handle), FERRY_OK);
  for (size_t i = 0; i <= kPerPeer; ++i) {
    m.uid = 5000 + i;
    OnCtrl(&m, sizeof m);
  }
  EXPECT_EQ(Counter(*b_, "inbound_watched"), kPerPeer);
  EXPECT_EQ(Counter(*b_, "inbound_dropped"), 1u);
  m.uid = 1;
  b_->plugin().on_ctrl(b_->ctx(), "another-peer", &m, sizeof m);
  EXPECT_EQ(Counter(*b_, "inbound_watched"), kPerPeer + 1);
  EXPECT_EQ(Counter(*b_, "inbound_events_open"), 2u) << "one per peer and process";
  gpu_.Release();
  EXPECT_TRUE(b_->host().WaitInbound("another-peer", 1));
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 5000 + kPerPeer - 1));
  EXPECT_EQ(b_->host().CountInbound(5000 + kPerPeer), 0) << "the dropped one";
}

// A message the target could not act on - lost here; in life, the event
// gone before the target opened it, its initiator having ended right after
// the copy - is made good by the farewell: peer_remove (which the core calls
// for every peer before fini, also when the engine ends) lists the transfers
// told by event that landed, and the target reports them.
TEST_F(XgmiNotify, AFarewellReportsLandingsTheTargetDidNotHearOf) {
  {
    std::lock_guard lk(net_.mu);
    net_.drop = true;  // the messages "leave" and never arrive
  }
  EXPECT_EQ(Notify(FERRY_OP_WRITE, 700, Pieces(0, 2)).status, FERRY_OK);
  EXPECT_EQ(Notify(FERRY_OP_WRITE, 701, Pieces(2, 2)).status, FERRY_OK);
  {
    std::lock_guard lk(net_.mu);
    net_.drop = false;
  }
  EXPECT_EQ(b_->host().CountInbound(700), 0);
  EXPECT_EQ(Counter(*a_, "notified_by_event"), 2u);
  EXPECT_EQ(Counter(*a_, "farewell_sent"), 0u);
  a_->plugin().mem_release(a_->ctx(), remote_);
  remote_ = nullptr;
  a_->plugin().peer_remove(a_->ctx(), a_peer_b_);
  a_peer_b_ = nullptr;
  EXPECT_EQ(Counter(*a_, "farewell_sent"), 2u);
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 700));
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 701));
  EXPECT_EQ(Counter(*b_, "inbound_farewell"), 2u);
  EXPECT_EQ(b_->host().CountInbound(700), 1);
}

// A farewell is peer input like any other: malformed ones are dropped.
TEST_F(XgmiNotify, MalformedFarewellsAreDropped) {
  const uint64_t uids[2] = {801, 802};
  auto msg = ferry_xgmi::EncodeLanded(uids, 2);
  OnCtrl(msg.data(), msg.size() - 1);                   // short by a byte
  OnCtrl(ferry_xgmi::EncodeLanded(uids, 0).data(), 8);  // no uid
  msg[4] = 0xff;                                        // a count past what it holds
  OnCtrl(msg.data(), msg.size());
  EXPECT_EQ(Counter(*b_, "inbound_dropped"), 3u);
  EXPECT_EQ(Counter(*b_, "inbound_farewell"), 0u);
  EXPECT_EQ(b_->host().CountInbound(801), 0);
  msg = ferry_xgmi::EncodeLanded(uids, 2);
  OnCtrl(msg.data(), msg.size());
  EXPECT_TRUE(b_->host().WaitInbound(a_->key(), 802));
  EXPECT_EQ(Counter(*b_, "inbound_farewell"), 2u);
}

class XgmiNotifyNoIpcEvents : public XgmiNotify {
 protected:
  XgmiNotifyNoIpcEvents() { gpu_.WithoutInterprocessEvents(); }
};

TEST_F(XgmiNotifyNoIpcEvents, TheCoreTellsTheTarget) {
  EXPECT_EQ(Notify(FERRY_OP_WRITE, 601, Pieces(0, 2)).status, FERRY_OK_NOTIFY_BY_CORE);
  EXPECT_EQ(dst_->blob.at(1) & ferry_xgmi::kMemWatchesEvents, 0)
      << "a target that cannot open events says so in its regions' blobs";
}

// FERRY_OK_NOTIFY_BY_CORE reads as a failure to a core older than 1.8.
TEST(XgmiInit, ACoreOlderThanAbi18IsRefused) {
  ferry_test::FakeGpu gpu;
  ferry_plugin_test::FakeHost host(Ops(), "x", {.gpu = gpu.table()});
  host.mutable_host()->ctrl_try_send = nullptr;
  void* ctx = nullptr;
  char err[256] = {};
  EXPECT_EQ(Ops().init(host.host(), "x", "node", "{}", &ctx, err, sizeof err),
            FERRY_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(err).find("ABI 1.8"), std::string::npos) << err;
}

}  // namespace
