// SPDX-License-Identifier: Apache-2.0
#include "gather_rows.h"

#include <algorithm>

#include "hot_path.h"
#include "item_pass.h"
#include "range_fits.h"

namespace ferry::gather {

FERRY_HOT Written write_rows(uint32_t op, const ferry_gpu_seg_v1* segs, size_t n_segs,
                             size_t pieces, Table* t, GrowFn grow, void* grow_ctx, bool four_wide) {
  static_assert(kRowBytes < kPlainCopyBytes, "a row alone never makes a plain copy");
  const bool write = op == FERRY_OP_WRITE;
  four_wide = four_wide && item_pass::simd();
  // The row before, kept here: reading it back from the table would make
  // each step wait for the store before it (before the first row nothing
  // follows: r != 0). run: the bytes of contiguous pieces that end where
  // this one starts, across rows. left: the pieces not yet written, this one
  // included. The checks only note what is wrong (branches a loop of
  // thousands of pieces would pay for); the end says what.
  unsigned long long pd = 0, ps = 0, pn = 0, run = 0;
  size_t r = 0, left = pieces;
  bool bad = false, big = false;
  for (size_t g = 0; g < n_segs && !bad && !big; ++g) {
    const ferry_gpu_seg_v1& sg = segs[g];
    const uint64_t lsize = sg.local_size, rsize = sg.remote_size;
    const auto lbase = reinterpret_cast<unsigned long long>(sg.local_base);
    const auto rbase = reinterpret_cast<unsigned long long>(sg.remote_base);
    const unsigned long long dbase = write ? rbase : lbase, sbase = write ? lbase : rbase;
    const ferry_iov_v1* iov = sg.iov;
    // Scattered pieces go four at a time; where a group merges or splits,
    // one at a time for a while (4, 8, ... 256 pieces) before the next try, so
    // a batch of contiguous blocks pays little for the tries.
    size_t wide_from = 0, wide_wait = 4;
    for (uint64_t i = 0, n = sg.n_iov; i < n; ++i, --left) {
      if (four_wide && i >= wide_from && n - i >= 4) {
        item_pass::Row prev{pd, ps, pn};
        const size_t k =
            item_pass::scattered_rows(iov + i, n - i, write, dbase, sbase, lsize, rsize, kRowBytes,
                                      r != 0, &prev, t->dsts + r, t->srcs + r, t->sizes + r, &bad);
        if (k > 0) {
          pd = prev.dst, ps = prev.src, pn = run = prev.len;  // none followed the one before
          r += k;
          i += k;
          left -= k;
          wide_wait = 4;
          if (i == n) break;
        } else {
          wide_from = i + wide_wait;
          wide_wait = std::min<size_t>(2 * wide_wait, 256);
        }
      }
      const uint64_t lo = iov[i].local_off, ro = iov[i].remote_off, len = iov[i].len;
      bad |= !range_fits(lo, ro, len, lsize, rsize);
      const unsigned long long dst = dbase + (write ? ro : lo);
      const unsigned long long src = sbase + (write ? lo : ro);
      const bool follows = (pd + pn == dst) & (ps + pn == src) & (r != 0);
      run = follows ? run + len : len;
      big |= run >= kPlainCopyBytes;
      if (follows && pn + len <= kRowBytes) {
        pn += len;
        t->sizes[r - 1] = pn;
        continue;
      }
      if (len <= kRowBytes) {
        pd = t->dsts[r] = dst;
        ps = t->srcs[r] = src;
        pn = t->sizes[r] = len;
        ++r;
        continue;
      }
      if (bad || big) break;  // a length not to split: refused below
      // Rows for this piece, split, and at most one for each piece after it.
      if (const size_t need = r + (len + kRowBytes - 1) / kRowBytes + (left - 1); need > t->cap) {
        if (int rc = grow(grow_ctx, need, r, t); rc != FERRY_OK)
          return {Verdict::GROW_FAILED, r, rc};
      }
      for (uint64_t o = 0; o < len; o += kRowBytes, ++r) {
        pd = t->dsts[r] = dst + o;
        ps = t->srcs[r] = src + o;
        pn = t->sizes[r] = std::min<uint64_t>(kRowBytes, len - o);
      }
    }
  }
  if (big) return {Verdict::PLAIN_COPY, r, 0};
  if (bad) return {Verdict::BAD_PIECE, r, 0};
  return {Verdict::ROWS, r, 0};
}

}  // namespace ferry::gather
