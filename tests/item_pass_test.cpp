// SPDX-License-Identifier: Apache-2.0
// The four-wide item passes (item_pass.h) against the one-at-a-time loops
// they stand in for, and the gather table (gather_rows.h) written both ways
// against what its rows must mean: the same bytes from the same places, in
// order, no row longer than kRowBytes. Random batches: scattered, contiguous
// runs that merge, pieces that split, empty and out-of-bounds pieces, groups
// of four cut anywhere.
#include "item_pass.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <vector>

#include "gather_rows.h"
#include "range_fits.h"

namespace ferry {
namespace {

using ull = unsigned long long;

bool have_simd() { return item_pass::simd(); }

// A value near an edge of [0, size] or of 64 bits, or anywhere below size.
uint64_t edgy(std::mt19937_64& rng, uint64_t size) {
  switch (rng() % 8) {
    case 0:
      return 0;
    case 1:
      return size;
    case 2:
      return size - rng() % 3;
    case 3:
      return ~0ULL - rng() % 3;
    case 4:
      return size + 1 + rng() % 3;
    default:
      return size ? rng() % size : 0;
  }
}

TEST(ItemPass, CopiesChecksAndSumsItemsAsTheLoopDoes) {
  if (!have_simd())
    GTEST_SKIP() << "this CPU has no AVX2 (or FERRY_ITEM_SIMD=0): no four-wide pass";
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const size_t n = rng() % 23;
    const uint64_t lsize = rng() % 4 == 0 ? ~0ULL - rng() % 5 : rng() % 1000;
    const uint64_t rsize = rng() % 4 == 0 ? rng() % 5 : rng() % 1000;
    std::vector<size_t> lo(n), ro(n), len(n);
    const bool clean = rng() % 2 == 0;  // half the batches hold only good items
    for (size_t i = 0; i < n; ++i) {
      if (clean && lsize > 0 && rsize > 0 && lsize < 1000 && rsize < 1000) {
        len[i] = 1 + rng() % std::min(lsize, rsize);
        lo[i] = rng() % (lsize - len[i] + 1);
        ro[i] = rng() % (rsize - len[i] + 1);
      } else {
        lo[i] = edgy(rng, lsize);
        ro[i] = edgy(rng, rsize);
        len[i] = edgy(rng, std::min(lsize, rsize));
      }
    }
    std::vector<ferry_iov_v1> want(n), got(n + 1, ferry_iov_v1{1, 2, 3});
    uint64_t want_total = 0, got_total = 0;
    bool want_bad = false, got_bad = false;
    for (size_t i = 0; i < n; ++i) {
      want[i] = {lo[i], ro[i], len[i]};
      want_total += len[i];
      want_bad |= !range_fits(lo[i], ro[i], len[i], lsize, rsize);
    }
    size_t i = item_pass::copy_items(lo.data(), ro.data(), len.data(), n, got.data(), lsize, rsize,
                                     &got_total, &got_bad);
    ASSERT_EQ(i, n / 4 * 4);
    for (; i < n; ++i) {
      got[i] = {lo[i], ro[i], len[i]};
      got_total += len[i];
      got_bad |= !range_fits(lo[i], ro[i], len[i], lsize, rsize);
    }
    ASSERT_EQ(want_total, got_total) << "trial " << trial;
    ASSERT_EQ(want_bad, got_bad) << "trial " << trial;
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(want[k].local_off, got[k].local_off) << "trial " << trial << " item " << k;
      ASSERT_EQ(want[k].remote_off, got[k].remote_off);
      ASSERT_EQ(want[k].len, got[k].len);
    }
    ASSERT_EQ(got[n].local_off, 1u) << "written past the last item";
  }
}

// ---- the gather table -------------------------------------------------------------

struct Batch {
  std::vector<std::vector<ferry_iov_v1>> iovs;
  std::vector<ferry_gpu_seg_v1> segs;
  size_t pieces = 0;
};

// Segments at made-up addresses (nothing is dereferenced), each a mix of
// scattered pieces, runs of contiguous ones (some longer than a row, some
// past 1 MiB together), long pieces and, in some batches, a bad one.
Batch random_batch(std::mt19937_64& rng) {
  Batch b;
  const size_t n_segs = 1 + rng() % 3;
  b.iovs.resize(n_segs);
  const bool with_bad = rng() % 4 == 0, with_big = rng() % 4 == 0;
  uint64_t lo = 0, ro = 0;  // where the last piece ended
  ull lbase = 1ULL << 40, rbase = 9ULL << 40;
  for (size_t g = 0; g < n_segs; ++g) {
    const uint64_t lsize = 64ULL << 20, rsize = 64ULL << 20;
    auto& v = b.iovs[g];
    const size_t n = rng() % 300;
    // Half the segments after the first are of the same regions as the one
    // before, so a first piece may continue its last: rows merge across.
    if (g > 0 && rng() % 2) {
      lbase += 1ULL << 36, rbase += 1ULL << 36;
      lo = ro = 0;
    }
    for (size_t i = 0; i < n; ++i) {
      const unsigned kind = rng() % 16;
      uint64_t len = 0;
      if (kind < 9) {  // scattered: 4 KiB-ish pieces anywhere
        len = 1 + rng() % (16 << 10);
        lo = rng() % (lsize - len);
        ro = rng() % (rsize - len);
      } else if (kind < 13) {  // continues the piece before on both sides
        len = 1 + rng() % (24 << 10);
        if (lo + len >= lsize || ro + len >= rsize) lo = ro = 0;
      } else if (kind < 14) {  // contiguous on one side only
        len = 1 + rng() % (8 << 10);
        ro = rng() % (rsize - len);
      } else if (kind < 15) {  // longer than a row: split
        len = (64 << 10) + 1 + rng() % (with_big ? (2 << 20) : (400 << 10));
        lo = rng() % (lsize - len);
        ro = rng() % (rsize - len);
      } else {  // exactly a row
        len = 64 << 10;
        lo = rng() % (lsize - len);
        ro = rng() % (rsize - len);
      }
      v.push_back({lo, ro, len});
      lo += len;  // where a piece that continues this one starts
      ro += len;
    }
    if (with_bad && !v.empty()) {
      ferry_iov_v1& p = v[rng() % v.size()];
      if (rng() % 2)
        p.len = 0;
      else
        p.remote_off = rsize - p.len + 1;
    }
    b.segs.push_back({reinterpret_cast<char*>(lbase), lsize, reinterpret_cast<char*>(rbase), rsize,
                      v.data(), v.size()});
    b.pieces += v.size();
  }
  return b;
}

struct GrownTable {
  std::vector<ull> dsts, srcs, sizes;
  gather::Table view() { return {dsts.data(), srcs.data(), sizes.data(), dsts.size()}; }
};

int grow_vectors(void* ctx, size_t need, size_t keep, gather::Table* t) {
  auto* g = static_cast<GrownTable*>(ctx);
  std::vector<ull> d(need), s(need), z(need);
  std::copy_n(g->dsts.begin(), keep, d.begin());
  std::copy_n(g->srcs.begin(), keep, s.begin());
  std::copy_n(g->sizes.begin(), keep, z.begin());
  g->dsts.swap(d), g->srcs.swap(s), g->sizes.swap(z);
  *t = g->view();
  return FERRY_OK;
}

struct Span {
  ull dst, src, len;
  bool operator==(const Span&) const = default;
};

// Maximal runs contiguous on both sides, in order.
void append_merged(std::vector<Span>& out, ull dst, ull src, ull len) {
  if (!out.empty() && out.back().dst + out.back().len == dst &&
      out.back().src + out.back().len == src) {
    out.back().len += len;
    return;
  }
  out.push_back({dst, src, len});
}

gather::Written write_both_ways(const Batch& b, uint32_t op, bool wide, GrownTable* g) {
  const size_t start = std::max<size_t>(b.pieces, 1);
  g->dsts.assign(start, 0), g->srcs.assign(start, 0), g->sizes.assign(start, 0);
  gather::Table t = g->view();
  return gather::write_rows(op, b.segs.data(), b.segs.size(), b.pieces, &t, grow_vectors, g, wide);
}

TEST(GatherRows, FourWideWritesTheSameTableAndItMeansThePieces) {
  if (!have_simd())
    GTEST_SKIP() << "this CPU has no AVX2 (or FERRY_ITEM_SIMD=0): no four-wide pass";
  std::mt19937_64 rng(11);
  size_t rows_total = 0, refused = 0, plain = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const Batch b = random_batch(rng);
    const uint32_t op = trial % 2 ? FERRY_OP_WRITE : FERRY_OP_READ;
    GrownTable one, four;
    const gather::Written a = write_both_ways(b, op, false, &one);
    const gather::Written w = write_both_ways(b, op, true, &four);
    ASSERT_EQ(static_cast<int>(a.verdict), static_cast<int>(w.verdict)) << "trial " << trial;
    if (a.verdict == gather::Verdict::BAD_PIECE) ++refused;
    if (a.verdict == gather::Verdict::PLAIN_COPY) ++plain;
    if (a.verdict != gather::Verdict::ROWS) continue;
    ASSERT_EQ(a.rows, w.rows) << "trial " << trial;
    ASSERT_EQ(one.dsts.size(), four.dsts.size()) << "trial " << trial << ": grown differently";
    rows_total += a.rows;
    for (size_t r = 0; r < a.rows; ++r) {
      ASSERT_EQ(one.dsts[r], four.dsts[r]) << "trial " << trial << " row " << r;
      ASSERT_EQ(one.srcs[r], four.srcs[r]) << "trial " << trial << " row " << r;
      ASSERT_EQ(one.sizes[r], four.sizes[r]) << "trial " << trial << " row " << r;
    }
    // What the rows mean: the pieces' bytes, from and to the same places, in
    // order; every row 1..kRowBytes; no run of 1 MiB left to the kernel.
    std::vector<Span> want, got;
    ull longest = 0;
    for (const auto& sg : b.segs) {
      const auto l = reinterpret_cast<ull>(sg.local_base),
                 r = reinterpret_cast<ull>(sg.remote_base);
      for (size_t i = 0; i < sg.n_iov; ++i) {
        const ferry_iov_v1& p = sg.iov[i];
        const ull dst = op == FERRY_OP_WRITE ? r + p.remote_off : l + p.local_off;
        const ull src = op == FERRY_OP_WRITE ? l + p.local_off : r + p.remote_off;
        append_merged(want, dst, src, p.len);
        longest = std::max<ull>(longest, want.back().len);
      }
    }
    for (size_t r = 0; r < w.rows; ++r) {
      ASSERT_GE(four.sizes[r], 1u);
      ASSERT_LE(four.sizes[r], gather::kRowBytes);
      append_merged(got, four.dsts[r], four.srcs[r], four.sizes[r]);
    }
    ASSERT_EQ(want, got) << "trial " << trial;
    ASSERT_LT(longest, gather::kPlainCopyBytes) << "trial " << trial;
  }
  // The batches exercised every outcome (else the generator went wrong).
  EXPECT_GT(rows_total, 100000u);
  EXPECT_GT(refused, 100u);
  EXPECT_GT(plain, 100u);
}

// Scattered pieces alone: every row comes from the four-wide pass; a piece
// that continues the row before at each place in a group of four, once per
// batch, sends only that group's pieces one at a time.
TEST(GatherRows, AContinuingPieceAtEachPlaceOfAGroup) {
  if (!have_simd())
    GTEST_SKIP() << "this CPU has no AVX2 (or FERRY_ITEM_SIMD=0): no four-wide pass";
  for (size_t at = 0; at < 12; ++at) {
    std::vector<ferry_iov_v1> v;
    for (uint64_t i = 0; i < 12; ++i) v.push_back({i * 8192, i * 16384, 4096});
    if (at > 0) v[at] = {v[at - 1].local_off + 4096, v[at - 1].remote_off + 4096, 100};
    Batch b;
    b.iovs.push_back(v);
    b.segs.push_back({reinterpret_cast<char*>(1ULL << 40), 1 << 20,
                      reinterpret_cast<char*>(2ULL << 40), 1 << 20, b.iovs[0].data(), v.size()});
    b.pieces = v.size();
    GrownTable one, four;
    const gather::Written a = write_both_ways(b, FERRY_OP_WRITE, false, &one);
    const gather::Written w = write_both_ways(b, FERRY_OP_WRITE, true, &four);
    ASSERT_EQ(a.verdict, gather::Verdict::ROWS);
    ASSERT_EQ(w.verdict, gather::Verdict::ROWS);
    ASSERT_EQ(a.rows, at > 0 ? 11u : 12u) << "at " << at;
    ASSERT_EQ(w.rows, a.rows) << "at " << at;
    for (size_t r = 0; r < a.rows; ++r) {
      EXPECT_EQ(one.dsts[r], four.dsts[r]) << "at " << at << " row " << r;
      EXPECT_EQ(one.srcs[r], four.srcs[r]);
      EXPECT_EQ(one.sizes[r], four.sizes[r]);
    }
  }
}

// A run of contiguous pieces counts from the last scattered piece, not from
// a run before the scattered ones: 900 KiB contiguous in four pieces (the
// first longer than a row: one at a time), four scattered pieces (four-wide),
// then 200 KiB that continue the last of them is a gather's (no run of 1 MiB).
TEST(GatherRows, ARunCountsFromTheLastScatteredPiece) {
  std::vector<ferry_iov_v1> v{{0, 0, 600 << 10}};
  for (uint64_t i = 0; i < 3; ++i)
    v.push_back({(600 + i * 100) << 10, (600 + i * 100) << 10, 100 << 10});
  for (uint64_t i = 0; i < 4; ++i) v.push_back({(2 << 20) + i * 8192, (3 << 20) + i * 8192, 4096});
  const ferry_iov_v1 last = v.back();
  v.push_back({last.local_off + 4096, last.remote_off + 4096, 200 << 10});
  Batch b;
  b.iovs.push_back(v);
  b.segs.push_back({reinterpret_cast<char*>(1ULL << 40), 8 << 20,
                    reinterpret_cast<char*>(2ULL << 40), 8 << 20, b.iovs[0].data(), v.size()});
  b.pieces = v.size();
  for (bool wide : {false, true}) {
    GrownTable g;
    const gather::Written w = write_both_ways(b, FERRY_OP_READ, wide, &g);
    EXPECT_EQ(w.verdict, gather::Verdict::ROWS) << (wide ? "four-wide" : "one at a time");
  }
}

}  // namespace
}  // namespace ferry
