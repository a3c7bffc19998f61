// SPDX-License-Identifier: Apache-2.0
// GPU memory end to end: a target process with GPU memory (ferry-gpu-peer,
// started with fork+exec) and an initiator engine here, over xgmi (CUDA IPC +
// peer copies) and over tcp (staged through pinned host buffers) — every
// combination of engine/session x single/batch x read/write x sizes incl. odd
// ones, regions that are sub-allocations at an offset, data verified through
// host copies, the target notified once. Then GPU<->CPU over tcp, the policy's
// choices (xgmi for same-host GPU pairs, tcp otherwise) and the failover from
// xgmi to tcp when the IPC open fails.
// Without a GPU runtime and device every test skips, saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "gpu_runtime.h"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kRegion = (64u << 20) + (1u << 20);

#define REQUIRE_GPU()                                                                  \
  if (!gpu::available())                                                               \
  GTEST_SKIP() << "no GPU runtime (libcudart/libamdhip64) or no GPU device here; the " \
                  "GPU tests run on a GPU host with tests/gpu/run-all.sh"

int target_device() { return gpu::device_count() > 1 ? 1 : 0; }

// A device buffer (device -1: host memory) with a host mirror for filling and checking.
struct DeviceBuffer {
  DeviceBuffer(size_t n, int device, size_t lead = 512) : size(n), lead(lead) {
    if (device >= 0) {
      alloc = static_cast<uint8_t*>(gpu::alloc(n + lead, device));
    } else {
      plain.resize(n + lead);
      alloc = plain.data();
    }
    host.resize(n);
  }
  ~DeviceBuffer() {
    if (plain.empty()) gpu::free(alloc);
  }
  uint8_t* data() { return alloc + lead; }
  void fill(uint64_t seed) {
    test::fill_pattern(host.data(), 0, size, seed);
    gpu::copy(data(), host.data(), size);
  }
  void zero() {
    std::fill(host.begin(), host.end(), 0);
    gpu::copy(data(), host.data(), size);
  }
  const std::vector<uint8_t>& pull() {
    gpu::copy(host.data(), data(), size);
    return host;
  }
  size_t size, lead;
  uint8_t* alloc;
  std::vector<uint8_t> plain;
  std::vector<uint8_t> host;
};

// Devices: -1 = host memory on that side.
struct Rig {
  explicit Rig(const std::string& backends, const std::string& policy_file = {},
               int local_device = 0, int remote_device = target_device())
      : child({FERRY_GPU_PEER, "gpu-target", backends, std::to_string(remote_device),
               std::to_string(kRegion)}) {
    std::string ready = child.read_line(120000);
    std::istringstream in(ready);
    std::string word, ehex, mhex;
    in >> word >> ehex >> mhex;
    if (word != "READY") throw std::runtime_error("gpu peer: " + ready);
    EngineConfig cfg;
    cfg.policy_file = policy_file;
    engine = std::make_unique<Engine>("initiator", cfg);
    std::stringstream bs(backends);
    for (std::string b; std::getline(bs, b, ',');)
      if (auto r = engine->add_backend(b); !r) throw std::runtime_error(r.message);
    target = EngineDesc::unpack(test::from_hex(ehex));
    remote = MemoryDesc::unpack(test::from_hex(mhex));
    engine->register_remote_engine(target);
    std::string ok = child.ask("register " + test::to_hex(engine->desc().pack()));
    if (ok != "OK") throw std::runtime_error("target register: " + ok);
    buf = std::make_unique<DeviceBuffer>(kRegion, local_device);
    local = engine->register_memory(buf->data(), kRegion);
  }
  uint64_t remote_hash(const std::vector<size_t>& offs, const std::vector<size_t>& sizes) {
    std::ostringstream cmd;
    cmd << "hash " << offs.size();
    for (size_t i = 0; i < offs.size(); ++i) cmd << " " << offs[i] << " " << sizes[i];
    std::string a = child.ask(cmd.str());
    return a.rfind("HASH ", 0) == 0 ? std::stoull(a.substr(5)) : 0;
  }
  test::ChildProcess child;
  std::unique_ptr<Engine> engine;
  EngineDesc target;
  MemoryDesc remote, local;
  std::unique_ptr<DeviceBuffer> buf;
};

// Spoils the 64-byte IPC handle at the end of the memory's xgmi blob, so the
// importer cannot open it; false when there is no such blob.
bool garble_ipc_handle(MemoryDesc& m) {
  auto it = m.backends.find("xgmi");
  if (it == m.backends.end() || it->second.size() < 64) return false;
  for (size_t i = it->second.size() - 64; i < it->second.size(); ++i) it->second[i] ^= 0x5a;
  return true;
}

struct Case {
  bool session, batch;
  Op op;
  size_t size;
};

// One case of the matrix over `backend`, GPU memory on both sides.
void RunCase(Rig& r, const Case& c, const std::string& backend) {
  static uint64_t seed = 100;
  ++seed;
  // Batch: up to 16 pieces with gaps on both sides (so they cannot merge).
  std::vector<size_t> lo, ro, sz;
  size_t pieces = c.batch ? std::min<size_t>(16, c.size) : 1,
         piece = (c.size + pieces - 1) / pieces;
  size_t left = c.size, l = 64, o = 128;
  while (left) {
    size_t n = std::min(piece, left);
    lo.push_back(l);
    ro.push_back(o);
    sz.push_back(n);
    l += n + (c.batch ? 32 : 0);
    o += n + (c.batch ? 96 : 0);
    left -= n;
  }
  if (c.op == Op::WRITE) {
    r.buf->fill(seed);
  } else {
    ASSERT_EQ(r.child.ask("fill " + std::to_string(seed)), "OK");
    r.buf->zero();
  }
  std::unique_ptr<Session> s;
  if (c.session) {
    s = r.engine->create_session(r.local, r.remote);
    ASSERT_TRUE(s);
  }
  TransferUid uid = r.engine->allocate_transfer_uid();
  TransferStatus st;
  bool w = c.op == Op::WRITE;
  if (c.batch)
    st = s ? (w ? s->batch_write(lo, ro, sz, uid) : s->batch_read(lo, ro, sz, uid))
           : (w ? r.engine->batch_write(r.local, lo, r.remote, ro, sz, uid)
                : r.engine->batch_read(r.local, lo, r.remote, ro, sz, uid));
  else
    st = s ? (w ? s->write(lo[0], ro[0], sz[0], uid) : s->read(lo[0], ro[0], sz[0], uid))
           : (w ? r.engine->write(r.local, lo[0], r.remote, ro[0], sz[0], uid)
                : r.engine->read(r.local, lo[0], r.remote, ro[0], sz[0], uid));
  ASSERT_TRUE(st.WaitFor(60s));
  ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
  if (w) {
    const auto& h = r.buf->pull();
    uint64_t expect = test::kFnvBasis;
    for (size_t i = 0; i < lo.size(); ++i) expect = test::fnv1a(h.data() + lo[i], sz[i], expect);
    EXPECT_EQ(r.remote_hash(ro, sz), expect);
  } else {
    const auto& h = r.buf->pull();
    for (size_t i = 0; i < lo.size(); ++i)
      ASSERT_EQ(test::find_mismatch(h.data(), lo[i], sz[i], seed, ro[i]), -1) << "piece " << i;
  }
  EXPECT_EQ(r.child.ask("pop initiator " + std::to_string(uid) + " 5000"), "INBOUND SUCCESS");
  EXPECT_EQ(r.child.ask("pop initiator " + std::to_string(uid) + " 0"), "NONE");
  EXPECT_GT(r.engine->stats().backends[backend].transfers, 0u);
}

// xgmi tells the target itself where it can (plugin ABI 1.8): an interprocess
// event recorded behind the copy, which the target process's xgmi watches.
// The pop in RunCase proves the target heard; these counters say who told it.
uint64_t backend_counter(Rig& r, const char* backend, const char* name) {
  const auto st = r.engine->stats();
  auto b = st.backends.find(backend);
  if (b == st.backends.end()) return 0;
  auto c = b->second.plugin.find(name);
  return c == b->second.plugin.end() ? 0 : c->second;
}
uint64_t xgmi_counter(Rig& r, const char* name) { return backend_counter(r, "xgmi", name); }

// One rig per suite: the target process and the registrations are set up once.
template <const char* kBackend>
class GpuMatrix : public testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    if (gpu::available()) rig_ = new Rig(kBackend);
  }
  static void TearDownTestSuite() {
    // Over the whole matrix, the event path was taken between the two
    // processes, not left to the core every time.
    if (rig_ && std::string(kBackend) == "xgmi") {
      EXPECT_GT(xgmi_counter(*rig_, "notified_by_event"), 0u);
    }
    // Both processes on one host: tcp's lanes run over shared rings, and the
    // runtime pinned them, so frames were staged in the rings' own bytes.
    if (rig_ && std::string(kBackend) == "tcp") {
      EXPECT_GT(backend_counter(*rig_, "tcp", "gpu_ring_frames"), 0u);
      EXPECT_EQ(backend_counter(*rig_, "tcp", "gpu_ring_pin_fails"), 0u);
    }
    delete rig_;
    rig_ = nullptr;
  }
  static Rig* rig_;
};
template <const char* kBackend>
Rig* GpuMatrix<kBackend>::rig_ = nullptr;

constexpr char kXgmi[] = "xgmi";
constexpr char kTcp[] = "tcp";
using XgmiMatrix = GpuMatrix<kXgmi>;
using TcpStagedMatrix = GpuMatrix<kTcp>;

TEST_P(XgmiMatrix, MovesVerifiedDataAndNotifies) {
  REQUIRE_GPU();
  const uint64_t by_event = xgmi_counter(*rig_, "notified_by_event");
  const uint64_t by_core = xgmi_counter(*rig_, "notified_by_core");
  RunCase(*rig_, GetParam(), kXgmi);
  const uint64_t event_now = xgmi_counter(*rig_, "notified_by_event");
  EXPECT_EQ(event_now - by_event + xgmi_counter(*rig_, "notified_by_core") - by_core, 1u)
      << "one notify transfer, told of once (by its event or by the core)";
}

// The same matrix over tcp: GPU memory staged through pinned host buffers on both ends.
TEST_P(TcpStagedMatrix, MovesVerifiedDataAndNotifies) {
  REQUIRE_GPU();
  RunCase(*rig_, GetParam(), kTcp);
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (bool s : {false, true})
    for (bool b : {false, true})
      for (Op op : {Op::WRITE, Op::READ})
        for (size_t n : {size_t{1}, size_t{4099}, size_t{1} << 20, (size_t{64} << 20) + 1})
          v.push_back({s, b, op, n});
  return v;
}

std::string name(const testing::TestParamInfo<Case>& p) {
  return std::string(p.param.session ? "Session" : "Engine") +
         (p.param.batch ? "Batch" : "Single") + (p.param.op == Op::READ ? "Read" : "Write") +
         std::to_string(p.param.size);
}

INSTANTIATE_TEST_SUITE_P(Gpu, XgmiMatrix, testing::ValuesIn(cases()), name);
INSTANTIATE_TEST_SUITE_P(Gpu, TcpStagedMatrix, testing::ValuesIn(cases()), name);

TEST(GpuPolicy, DetectsGpuMemoryAndRoutesGpuPairsToXgmi) {
  REQUIRE_GPU();
  DeviceBuffer b(4096, 0);
  Engine e("detect");
  MemoryDesc m = e.register_memory(b.data(), 4096);  // no location given
  EXPECT_EQ(m.location, MemoryLocation::GPU);
  EXPECT_EQ(m.device, 0);
  EXPECT_FALSE(m.bus_id.empty());
  std::vector<uint8_t> host(4096);
  MemoryDesc h = e.register_memory(host.data(), host.size());
  EXPECT_EQ(h.location, MemoryLocation::CPU);
}

// The shim's copy_segments_async (plugin ABI 1.9), called directly: pieces of
// two segments - contiguous ones (merged), ones contiguous on one side only
// (not merged), one longer than a gather row (split), an odd byte - land where
// they say in both directions and nothing else is written; a piece that is
// empty or outside its segment on either side queues nothing; a piece or a
// contiguous run of 1 MiB, and a batch that is one copy, are left to the
// caller's memcpy_batch_async.
TEST(GpuShim, CopySegmentsChecksEveryPieceThenMergesAndSplits) {
  REQUIRE_GPU();
  const ferry_gpu_v1* g = gpu_runtime();
  ASSERT_NE(g, nullptr);
  ASSERT_TRUE(FERRY_HAS_FIELD(ferry_gpu_v1, g, copy_segments_async) && g->copy_segments_async);
  constexpr size_t kHalf = 1 << 20;
  DeviceBuffer a(2 * kHalf, 0), b(2 * kHalf, 0);
  ASSERT_EQ(g->set_device(g->gpu_ctx, 0), FERRY_OK);
  struct Stream {
    const ferry_gpu_v1* g;
    void* s = nullptr;
    ~Stream() {
      if (s) g->stream_destroy(g->gpu_ctx, s);
    }
  } st{g};
  ASSERT_EQ(g->stream_create(g->gpu_ctx, &st.s), FERRY_OK);
  // {local_off, remote_off, len}; no two pieces overlap on either side.
  const std::vector<ferry_iov_v1> first = {{0, 0, 4096},
                                           {4096, 4096, 4096},  // contiguous on both sides: one row
                                           {8192, 9000, 300},
                                           {12000, 9300, 300},  // contiguous on one side only
                                           {65536, 200000, 100000},
                                           {300001, 400000, 1}};  // split in two rows; an odd byte
  const std::vector<ferry_iov_v1> second = {{8, 40000, 5000}, {70000, 100000, 65536}};
  // Segment 0 over the first halves of a (local) and b (remote), segment 1
  // over the second halves, each limited to its half.
  const auto segs = [&](const std::vector<ferry_iov_v1>& s0, const std::vector<ferry_iov_v1>& s1) {
    auto* la = reinterpret_cast<char*>(a.data());
    auto* rb = reinterpret_cast<char*>(b.data());
    return std::vector<ferry_gpu_seg_v1>{
        {la, kHalf, rb, kHalf, s0.data(), s0.size()},
        {la + kHalf, kHalf, rb + kHalf, kHalf, s1.data(), s1.size()}};
  };
  const auto call = [&](uint32_t op, const std::vector<ferry_gpu_seg_v1>& sg) {
    return g->copy_segments_async(g->gpu_ctx, op, sg.data(), sg.size(), st.s);
  };
  for (const uint32_t op : {FERRY_OP_WRITE, FERRY_OP_READ}) {
    SCOPED_TRACE(op == FERRY_OP_WRITE ? "WRITE" : "READ");
    DeviceBuffer& from = op == FERRY_OP_WRITE ? a : b;
    DeviceBuffer& to = op == FERRY_OP_WRITE ? b : a;
    from.fill(op);
    to.zero();
    const int rc = call(op, segs(first, second));
    if (rc == FERRY_ERR_UNSUPPORTED)
      GTEST_SKIP() << "no gather kernel here (HIP, or no NVRTC): " << g->last_error(g->gpu_ctx);
    ASSERT_EQ(rc, FERRY_OK) << g->last_error(g->gpu_ctx);
    ASSERT_EQ(g->stream_sync(g->gpu_ctx, st.s), FERRY_OK);
    std::vector<uint8_t> want(2 * kHalf, 0);
    const auto& src = from.pull();
    for (size_t h = 0; h < 2; ++h)
      for (const ferry_iov_v1& v : h == 0 ? first : second) {
        const size_t s = h * kHalf + (op == FERRY_OP_WRITE ? v.local_off : v.remote_off);
        const size_t d = h * kHalf + (op == FERRY_OP_WRITE ? v.remote_off : v.local_off);
        std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(s), v.len,
                    want.begin() + static_cast<std::ptrdiff_t>(d));
      }
    EXPECT_TRUE(to.pull() == want) << "a piece missing, misplaced, or bytes written outside them";
  }
  // Refused, nothing queued: past the remote half, past the local half, empty.
  b.zero();
  for (const ferry_iov_v1 wrong : std::vector<ferry_iov_v1>{
           {70000, kHalf - 100, 65536}, {kHalf - 100, 100000, 65536}, {70000, 100000, 0}}) {
    std::vector<ferry_iov_v1> bad = second;
    bad.back() = wrong;
    EXPECT_EQ(call(FERRY_OP_WRITE, segs(first, bad)), FERRY_ERR_INVALID_ARGS)
        << wrong.local_off << " " << wrong.remote_off << " " << wrong.len;
  }
  ASSERT_EQ(g->stream_sync(g->gpu_ctx, st.s), FERRY_OK);
  EXPECT_TRUE(b.pull() == std::vector<uint8_t>(2 * kHalf, 0)) << "a refused batch wrote bytes";
  // For plain copies: a 1 MiB piece, and 16 contiguous pieces of 64 KiB.
  const std::vector<ferry_iov_v1> big = {{0, 0, kHalf}};
  EXPECT_EQ(call(FERRY_OP_WRITE, segs(big, second)), FERRY_ERR_UNSUPPORTED);
  std::vector<ferry_iov_v1> run;
  for (uint64_t k = 0; k < 16; ++k) run.push_back({k << 16, k << 16, 1 << 16});
  EXPECT_EQ(call(FERRY_OP_WRITE, segs(run, {})), FERRY_ERR_UNSUPPORTED);
  // One piece in all: the runtime's own copy.
  const std::vector<ferry_iov_v1> one = {{0, 0, 4096}};
  EXPECT_EQ(call(FERRY_OP_WRITE, segs(one, {})), FERRY_ERR_UNSUPPORTED);
  ASSERT_EQ(g->stream_sync(g->gpu_ctx, st.s), FERRY_OK);
  EXPECT_TRUE(b.pull() == std::vector<uint8_t>(2 * kHalf, 0)) << "a batch left to the caller wrote";
}

// The shim sizes a table at one row per piece (at least 4,096) and grows it
// when pieces longer than a row need more: 4,200 pieces of 64 KiB + 1 byte
// are 8,400 rows (more than a table of an earlier test on a stream handle
// the runtime gave out again holds). Each lands at its place, the rows
// written before the table grew included.
TEST(GpuShim, CopySegmentsGrowsItsTableForPiecesLongerThanARow) {
  REQUIRE_GPU();
  const ferry_gpu_v1* g = gpu_runtime();
  ASSERT_NE(g, nullptr);
  ASSERT_TRUE(FERRY_HAS_FIELD(ferry_gpu_v1, g, copy_segments_async) && g->copy_segments_async);
  constexpr size_t kPiece = (64 << 10) + 1, kPieces = 4200, kFrom = 4 << 20;
  DeviceBuffer from(kFrom, 0), to(kPieces * kPiece, 0);
  ASSERT_EQ(g->set_device(g->gpu_ctx, 0), FERRY_OK);
  void* s = nullptr;
  ASSERT_EQ(g->stream_create(g->gpu_ctx, &s), FERRY_OK);
  from.fill(11);
  to.zero();
  // Contiguous on the remote side, scattered (never contiguous) on the local.
  std::vector<ferry_iov_v1> pieces;
  for (uint64_t i = 0; i < kPieces; ++i)
    pieces.push_back({(i * 4099 * 16) % (kFrom - kPiece), i * kPiece, kPiece});
  const ferry_gpu_seg_v1 seg{reinterpret_cast<char*>(from.data()),
                             kFrom,
                             reinterpret_cast<char*>(to.data()),
                             to.size,
                             pieces.data(),
                             pieces.size()};
  const int rc = g->copy_segments_async(g->gpu_ctx, FERRY_OP_WRITE, &seg, 1, s);
  if (rc == FERRY_ERR_UNSUPPORTED) {
    g->stream_destroy(g->gpu_ctx, s);
    GTEST_SKIP() << "no gather kernel here (HIP, or no NVRTC): " << g->last_error(g->gpu_ctx);
  }
  EXPECT_EQ(rc, FERRY_OK) << g->last_error(g->gpu_ctx);
  EXPECT_EQ(g->stream_sync(g->gpu_ctx, s), FERRY_OK);
  g->stream_destroy(g->gpu_ctx, s);
  const std::vector<uint8_t>& src = from.host;  // fill() kept what it wrote
  std::vector<uint8_t> want(kPieces * kPiece);
  for (size_t i = 0; i < kPieces; ++i)
    std::copy_n(src.begin() + static_cast<std::ptrdiff_t>(pieces[i].local_off), kPiece,
                want.begin() + static_cast<std::ptrdiff_t>(i * kPiece));
  EXPECT_TRUE(to.pull() == want) << "a piece missing or misplaced";
}

TEST(GpuPolicy, ManyBlocksMoveInOneBatch) {
  REQUIRE_GPU();
  // 1024 x 16 KiB scattered blocks: the realistic KV layout.
  Rig r("xgmi");
  const size_t blk = 16 << 10, n = 1024;
  std::vector<size_t> lo(n), ro(n), sz(n, blk);
  for (size_t i = 0; i < n; ++i) {
    lo[i] = ((i * 37) % n) * blk;  // scattered on the local side
    ro[i] = i * blk * 2 % (kRegion - blk);
  }
  r.buf->fill(7);
  auto st = r.engine->batch_write(r.local, lo, r.remote, ro, sz, r.engine->allocate_transfer_uid());
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  const auto& h = r.buf->pull();
  uint64_t expect = test::kFnvBasis;
  for (size_t i = 0; i < n; ++i) expect = test::fnv1a(h.data() + lo[i], blk, expect);
  EXPECT_EQ(r.remote_hash(ro, sz), expect);
}

// One call over several region pairs (the KV-cache shape). xgmi takes several
// pairs in one post (plugin ABI 1.7, FERRY_CAP_MULTI_PAIR): the call is one
// post and one launch. Where the parts route differently (here: a rule by
// size sends the larger part to [xgmi, tcp], the others to [xgmi] alone) the
// core posts one part per pair with FERRY_XFER_MORE on all but the last, and
// xgmi holds them and launches them together. Every byte verified, WRITE and
// READ, both ways; the counters say which way each call went.
TEST(GpuPolicy, MultiRegionCallIsOneLaunch) {
  REQUIRE_GPU();
  const auto policy = std::filesystem::temp_directory_path() /
                      ("ferry-gpu-parts-" + std::to_string(getpid()) + ".yaml");
  std::ofstream(policy) << "rules:\n"
                           "  - match: { min_bytes: 1536KiB }\n"
                           "    prefer: [xgmi, tcp]\n"
                           "    trust_descriptors: true\n"
                           "  - prefer: [xgmi]\n"
                           "    trust_descriptors: true\n";
  for (bool apart : {false, true}) {
    SCOPED_TRACE(apart ? "parts routed apart" : "one route");
    Rig r("xgmi,tcp", apart ? policy.string() : std::string());
    constexpr size_t kParts = 4, kPer = 64, blk = 16 << 10;
    const size_t slice = kRegion / kParts;
    std::vector<MemoryDesc> locals;
    for (size_t p = 0; p < kParts; ++p)
      locals.push_back(r.engine->register_memory(r.buf->data() + p * slice, slice));
    std::vector<TransferItem> items;
    std::vector<size_t> ro, sz;
    for (size_t p = 0; p < kParts; ++p)
      for (size_t i = 0; i < (p == 0 ? 2 * kPer : kPer); ++i) {  // part 0: 2 MiB, others 1 MiB
        const size_t lo = ((i * 37) % (2 * kPer)) * blk * 2;     // scattered inside its slice
        const size_t off = (p * 2 * kPer + i) * blk * 3;         // and on the remote side
        items.push_back({p, lo, 0, off, blk});
        ro.push_back(off);
        sz.push_back(blk);
      }
    auto counter = [&](const char* key) {
      auto st = r.engine->stats().backends["xgmi"];
      auto it = st.plugin.find(key);
      return it == st.plugin.end() ? uint64_t{0} : it->second;
    };
    auto local_hash = [&] {
      const auto& h = r.buf->pull();
      uint64_t expect = test::kFnvBasis;
      for (const auto& it : items)
        expect = test::fnv1a(h.data() + it.local * slice + it.local_offset, blk, expect);
      return expect;
    };
    r.buf->fill(11);
    auto w = r.engine->transfer(Op::WRITE, locals, {r.remote}, items,
                                r.engine->allocate_transfer_uid(), false, std::nullopt);
    ASSERT_EQ(w.Wait(), StatusCode::SUCCESS) << w.Message();
    EXPECT_EQ(r.remote_hash(ro, sz), local_hash()) << "WRITE";
    // READ them back over zeroes.
    const uint64_t want = local_hash();
    r.buf->zero();
    auto rd = r.engine->transfer(Op::READ, locals, {r.remote}, items,
                                 r.engine->allocate_transfer_uid(), false, std::nullopt);
    ASSERT_EQ(rd.Wait(), StatusCode::SUCCESS) << rd.Message();
    EXPECT_EQ(local_hash(), want) << "READ";
    EXPECT_EQ(r.engine->stats().backends["tcp"].transfers, 0u);
    if (!apart) {
      EXPECT_EQ(counter("pair_posts"), 2u);
      EXPECT_EQ(counter("pair_launches"), 2u);
      EXPECT_EQ(counter("held_parts"), 0u);
      EXPECT_EQ(r.engine->stats().backends["xgmi"].transfers, 2u);
    } else {
      EXPECT_EQ(counter("pair_posts"), 0u);
      EXPECT_EQ(counter("held_parts"), 2 * kParts);
      EXPECT_EQ(counter("held_launches"), 2u);
      EXPECT_EQ(counter("held_by_timeout"), 0u);
    }
  }
  std::filesystem::remove(policy);
}

// A descriptor claiming more than the target registered (its xgmi blob says
// the real size): xgmi will not import it, so a batch and a multi-region call
// that reach past the real region end with that reason and none of their
// pieces lands - not even those inside the region. (xgmi's post() checks
// every piece against the imported size too, while merging them; with the
// import refused first, no test through the engine reaches that check.)
TEST(GpuPolicy, XgmiRefusesADescriptorClaimingMoreThanRegistered) {
  REQUIRE_GPU();
  Rig r("xgmi");
  MemoryDesc forged = r.remote;
  forged.size = kRegion + (4u << 20);
  const size_t blk = 16 << 10, n = 8;
  std::vector<size_t> lo(n), ro(n), sz(n, blk);
  for (size_t i = 0; i < n; ++i) {
    lo[i] = i * blk;
    ro[i] = i * blk * 2;
  }
  ro[n - 1] = kRegion;  // past the registered region, inside the claim
  const std::vector<size_t> in_ro(ro.begin(), ro.end() - 1), in_sz(n - 1, blk);
  r.buf->fill(3);
  const uint64_t before = r.remote_hash(in_ro, in_sz);
  auto st = r.engine->batch_write(r.local, lo, forged, ro, sz, r.engine->allocate_transfer_uid());
  ASSERT_TRUE(st.WaitFor(30s));
  EXPECT_FALSE(st.Succeeded());
  EXPECT_NE(st.Message().find("could not be imported"), std::string::npos) << st.Message();
  EXPECT_EQ(r.remote_hash(in_ro, in_sz), before) << "a piece of the refused batch landed";

  // Two parts over two local regions, the second reaching past the region.
  const size_t half = kRegion / 2;
  std::vector<MemoryDesc> locals{r.engine->register_memory(r.buf->data(), half),
                                 r.engine->register_memory(r.buf->data() + half, half)};
  std::vector<TransferItem> items;
  std::vector<size_t> mr_ro;
  for (size_t i = 0; i < 8; ++i) {
    items.push_back({i / 4, (i % 4) * blk, 0, (16 + i) * blk, blk});
    mr_ro.push_back((16 + i) * blk);
  }
  items.back().remote_offset = kRegion + blk;
  mr_ro.pop_back();
  const std::vector<size_t> mr_sz(mr_ro.size(), blk);
  r.buf->fill(5);
  const uint64_t mr_before = r.remote_hash(mr_ro, mr_sz);
  auto mr = r.engine->transfer(Op::WRITE, locals, {forged}, items,
                               r.engine->allocate_transfer_uid(), false, std::nullopt);
  ASSERT_TRUE(mr.WaitFor(30s));
  EXPECT_FALSE(mr.Succeeded());
  EXPECT_NE(mr.Message().find("could not be imported"), std::string::npos) << mr.Message();
  EXPECT_EQ(r.remote_hash(mr_ro, mr_sz), mr_before) << "a piece of the refused call landed";
  // The real descriptor still works for the pieces inside the region.
  const std::vector<size_t> in_lo(lo.begin(), lo.end() - 1);
  auto ok = r.engine->batch_write(r.local, in_lo, r.remote, in_ro, in_sz,
                                  r.engine->allocate_transfer_uid());
  ASSERT_EQ(ok.Wait(), StatusCode::SUCCESS) << ok.Message();
  const auto& h = r.buf->pull();
  uint64_t want = test::kFnvBasis;
  for (size_t off : in_lo) want = test::fnv1a(h.data() + off, blk, want);
  EXPECT_EQ(r.remote_hash(in_ro, in_sz), want);
}

TEST(GpuFailover, IpcOpenFailureFailsOverToTheNextBackend) {
  REQUIRE_GPU();
  // A forged descriptor with a garbage IPC handle: xgmi cannot open it, and the
  // policy moves the transfer on; with no other GPU-capable backend it fails
  // with every reason listed.
  Rig r("xgmi");
  MemoryDesc forged = r.remote;
  ASSERT_TRUE(garble_ipc_handle(forged));
  auto st = r.engine->write(r.local, 0, forged, 0, 4096, r.engine->allocate_transfer_uid());
  ASSERT_TRUE(st.WaitFor(30s));
  EXPECT_EQ(st.Code(), StatusCode::ERR_GPU_OP) << st.Message();
  EXPECT_NE(st.Message().find("xgmi"), std::string::npos) << st.Message();
  // The real descriptor still works afterwards.
  r.buf->fill(9);
  auto ok = r.engine->write(r.local, 0, r.remote, 0, 4096, r.engine->allocate_transfer_uid());
  EXPECT_EQ(ok.Wait(), StatusCode::SUCCESS) << ok.Message();
}

}  // namespace

namespace {

TEST(GpuPolicy, CpuMemoryIsNotRoutedToXgmi) {
  REQUIRE_GPU();
  // xgmi moves GPU memory only: with only xgmi loaded and CPU memory on our side
  // the route is empty, and the error says why per backend.
  Rig r("xgmi");
  std::vector<uint8_t> cpu(4096);
  MemoryDesc cm = r.engine->register_memory(cpu.data(), cpu.size());
  ASSERT_EQ(cm.location, MemoryLocation::CPU);
  auto st = r.engine->write(cm, 0, r.remote, 0, cpu.size(), r.engine->allocate_transfer_uid());
  EXPECT_EQ(st.Code(), StatusCode::ERR_BAD_STATE);
  EXPECT_NE(st.Message().find("xgmi: cannot move cpu memory"), std::string::npos) << st.Message();
}

}  // namespace

namespace {

// Moves `n` bytes both ways between the rig's local buffer and the target and
// checks them.
void WriteThenRead(Rig& r, size_t n, uint64_t seed) {
  r.buf->fill(seed);
  auto w = r.engine->write(r.local, 64, r.remote, 128, n, r.engine->allocate_transfer_uid());
  ASSERT_TRUE(w.WaitFor(60s));
  ASSERT_EQ(w.Code(), StatusCode::SUCCESS) << w.Message();
  const auto& h = r.buf->pull();
  EXPECT_EQ(r.remote_hash({128}, {n}), test::fnv1a(h.data() + 64, n, test::kFnvBasis));
  ASSERT_EQ(r.child.ask("fill " + std::to_string(seed + 1)), "OK");
  r.buf->zero();
  auto rd = r.engine->read(r.local, 64, r.remote, 128, n, r.engine->allocate_transfer_uid());
  ASSERT_TRUE(rd.WaitFor(60s));
  ASSERT_EQ(rd.Code(), StatusCode::SUCCESS) << rd.Message();
  EXPECT_EQ(test::find_mismatch(r.buf->pull().data(), 64, n, seed + 1, 128), -1);
}

TEST(GpuTcp, GpuToCpuAndCpuToGpuAreStaged) {
  REQUIRE_GPU();
  {
    Rig r("tcp", {}, /*local_device=*/0, /*remote_device=*/-1);  // GPU here, CPU there
    ASSERT_EQ(r.local.location, MemoryLocation::GPU);
    ASSERT_EQ(r.remote.location, MemoryLocation::CPU);
    WriteThenRead(r, (5u << 20) + 3, 40);
  }
  {
    Rig r("tcp", {}, /*local_device=*/-1, /*remote_device=*/target_device());  // CPU here
    ASSERT_EQ(r.local.location, MemoryLocation::CPU);
    ASSERT_EQ(r.remote.location, MemoryLocation::GPU);
    WriteThenRead(r, (5u << 20) + 3, 50);
  }
}

TEST(GpuPolicy, SameHostGpuPairsTakeXgmiAndCpuMemoryTakesTcp) {
  REQUIRE_GPU();
  // The built-in policy, both backends loaded on both sides.
  Rig r("xgmi,tcp");
  WriteThenRead(r, 1u << 20, 60);
  auto st = r.engine->stats();
  EXPECT_GT(st.backends["xgmi"].transfers, 0u);
  EXPECT_EQ(st.backends["tcp"].transfers, 0u);
  // CPU memory on our side: xgmi cannot move it, so tcp (staging the target's GPU side).
  std::vector<uint8_t> cpu(1 << 20);
  test::fill_pattern(cpu.data(), 0, cpu.size(), 61);
  MemoryDesc cm = r.engine->register_memory(cpu.data(), cpu.size());
  auto w = r.engine->write(cm, 0, r.remote, 0, cpu.size(), r.engine->allocate_transfer_uid());
  ASSERT_EQ(w.Wait(), StatusCode::SUCCESS) << w.Message();
  EXPECT_EQ(r.remote_hash({0}, {cpu.size()}), test::fnv1a(cpu.data(), cpu.size(), test::kFnvBasis));
  st = r.engine->stats();
  EXPECT_GT(st.backends["tcp"].transfers, 0u);
  r.engine->deregister_memory(cm);
}

TEST(GpuFailover, IpcOpenFailureFailsOverToTcpWithCorrectData) {
  REQUIRE_GPU();
  // A forged xgmi blob: the IPC open fails, the policy re-runs the transfer on
  // tcp (staged), and the data and the single notification are right.
  Rig r("xgmi,tcp");
  MemoryDesc forged = r.remote;
  ASSERT_TRUE(garble_ipc_handle(forged));
  r.buf->fill(70);
  const TransferUid uid = r.engine->allocate_transfer_uid();
  auto st = r.engine->write(r.local, 0, forged, 0, 3u << 20, uid);
  ASSERT_TRUE(st.WaitFor(60s));
  ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
  const auto& h = r.buf->pull();
  EXPECT_EQ(r.remote_hash({0}, {3u << 20}), test::fnv1a(h.data(), 3u << 20, test::kFnvBasis));
  EXPECT_EQ(r.child.ask("pop initiator " + std::to_string(uid) + " 5000"), "INBOUND SUCCESS");
  EXPECT_EQ(r.child.ask("pop initiator " + std::to_string(uid) + " 0"), "NONE");
  auto stats = r.engine->stats();
  EXPECT_GT(stats.backends["xgmi"].failures, 0u);
  EXPECT_GT(stats.backends["tcp"].transfers, 0u);
  EXPECT_GT(stats.backends["xgmi"].failovers, 0u) << "the stats must show the failover";
}

TEST(GpuOfi, LocalGpuIsStagedAndRemoteGpuGoesToTcp) {
  REQUIRE_GPU();
  {
    Engine probe("ofi-probe");
    if (auto r = probe.add_backend("ofi"); !r)
      GTEST_SKIP() << "the ofi plugin does not load here: " << r.message;
  }
  {
    // GPU here, host memory there: ofi stages through its bounce buffers.
    Rig r("ofi", {}, /*local_device=*/0, /*remote_device=*/-1);
    WriteThenRead(r, (5u << 20) + 3, 80);
    EXPECT_GT(r.engine->stats().backends["ofi"].transfers, 0u);
  }
  {
    // GPU memory on both sides: ofi cannot reach the remote GPU (refused at
    // import), so the built-in policy's next choice, tcp, carries it.
    Rig r("ofi,tcp");
    WriteThenRead(r, 1u << 20, 90);
    auto st = r.engine->stats();
    EXPECT_EQ(st.backends["ofi"].transfers, 0u);
    EXPECT_GT(st.backends["tcp"].transfers, 0u);
  }
}

}  // namespace
