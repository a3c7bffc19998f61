// SPDX-License-Identifier: Apache-2.0
// The gather kernel's table written from a transfer's segments (plugin ABI 1.9
// copy_segments_async): each piece checked, merged into the row before where
// contiguous on both sides, split where longer than a row. No GPU here: the
// GPU shim (gpu_runtime.cpp) hands it the pinned table and a way to grow it,
// and a CPU test (tests/item_pass_test.cpp) hands it plain memory.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ferry/plugin.h"

namespace ferry::gather {

// One thread block copies one row; rows are at most kRowBytes (a longer piece
// is split), so one big piece does not leave a single block copying while
// the rest of the GPU idles.
constexpr size_t kRowBytes = 64 << 10;
// A piece - or a run of pieces contiguous on both sides - this long goes as a
// plain copy on the copy engine, which moves it faster than the kernel.
constexpr size_t kPlainCopyBytes = 1 << 20;

// Three columns of cap rows each.
struct Table {
  unsigned long long *dsts, *srcs, *sizes;
  size_t cap;
};

// Makes *t hold at least `need` rows, keeping its first `keep`; FERRY_OK or a
// FERRY_ERR_* code (and *t unchanged).
using GrowFn = int (*)(void* ctx, size_t need, size_t keep, Table* t);

enum class Verdict {
  ROWS,        // rows written, the batch may launch
  BAD_PIECE,   // a piece is empty or outside its segment: nothing may launch
  PLAIN_COPY,  // a piece or a contiguous run of kPlainCopyBytes or more: not a gather's
  GROW_FAILED  // grow() returned `grow_rc`
};
struct Written {
  Verdict verdict = Verdict::ROWS;
  size_t rows = 0;
  int grow_rc = 0;
};

// Writes the rows of `pieces` pieces (the sum of segs[].n_iov) of a transfer
// with `op` into *t, which must hold at least `pieces` rows: one per piece
// until a piece longer than a row grows it. `four_wide` lets groups of four
// scattered pieces go through item_pass::scattered_rows (the same rows; the
// tests compare both ways).
Written write_rows(uint32_t op, const ferry_gpu_seg_v1* segs, size_t n_segs, size_t pieces,
                   Table* t, GrowFn grow, void* grow_ctx, bool four_wide);

}  // namespace ferry::gather
