// SPDX-License-Identifier: Apache-2.0
// The two per-item passes of a many-item transfer, four items at a time on a
// CPU with AVX2: the core's copy of a call's items (three columns of offsets
// and lengths) into the plugin's ferry_iov_v1 array, and the GPU shim's
// gather-table rows for scattered pieces (gather_rows.cpp). A 4096-item batch
// spent ~5 us in each one item at a time on the 2-vCPU VM; a KV request of
// thousands of small blocks pays both before its copy starts.
//
// Each function does whole groups of four and returns how many items it did
// (0 where simd() is false); the caller's scalar loop does the rest, and is
// the reference the tests compare these with (item_pass_test.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

#include "ferry/plugin.h"

namespace ferry::item_pass {

// Whether this process runs the four-wide passes: the CPU has AVX2 and
// FERRY_ITEM_SIMD is not "0" (read once; the switch is for A/B measurements).
bool simd();

// Copies items [0, k) of the three columns into out, adds their lengths to
// *total and ORs into *bad whether any is empty or leaves its region (the
// rule of range_fits.h). k, returned, is n rounded down to a multiple of four.
size_t copy_items(const size_t* local_offs, const size_t* remote_offs, const size_t* sizes,
                  size_t n, ferry_iov_v1* out, uint64_t lsize, uint64_t rsize, uint64_t* total,
                  bool* bad);

// A gather-table row: dst, src, bytes.
struct Row {
  unsigned long long dst, src, len;
};

// Writes one row per piece for the first groups of four pieces of iov (one
// segment: pieces are offsets from the bases) in which no piece continues
// the row before it - contiguous with it on both sides - and none is longer
// than row_max bytes; stops at the first group that has such a piece and
// returns how many pieces it wrote (a multiple of four). `prev` is the row
// before the first piece (`has_prev` false: none) and becomes the last row
// written; rows go to dsts/srcs/sizes from index 0. *bad as copy_items.
size_t scattered_rows(const ferry_iov_v1* iov, size_t n, bool write, unsigned long long dbase,
                      unsigned long long sbase, uint64_t lsize, uint64_t rsize, uint64_t row_max,
                      bool has_prev, Row* prev, unsigned long long* dsts, unsigned long long* srcs,
                      unsigned long long* sizes, bool* bad);

}  // namespace ferry::item_pass
