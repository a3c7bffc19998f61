// SPDX-License-Identifier: Apache-2.0
// Four items at a time with AVX2, chosen at run time (the build targets plain
// x86-64, and other architectures, so nothing here may run unasked).
#include "item_pass.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FERRY_ITEM_PASS_AVX2 1
#endif

namespace ferry::item_pass {

#if FERRY_ITEM_PASS_AVX2
namespace {

// Unsigned 64-bit a > b, lane by lane (AVX2 compares signed).
__attribute__((target("avx2"))) inline __m256i above(__m256i a, __m256i b) {
  const __m256i sign = _mm256_set1_epi64x(static_cast<long long>(1ULL << 63));
  return _mm256_cmpgt_epi64(_mm256_xor_si256(a, sign), _mm256_xor_si256(b, sign));
}

// Lanes where range_fits() is false: an empty item, or one that leaves a region.
__attribute__((target("avx2"))) inline __m256i outside(__m256i lo, __m256i ro, __m256i len,
                                                       __m256i lsize, __m256i rsize) {
  __m256i out = _mm256_cmpeq_epi64(len, _mm256_setzero_si256());
  out = _mm256_or_si256(out, above(lo, lsize));
  out = _mm256_or_si256(out, above(len, _mm256_sub_epi64(lsize, lo)));
  out = _mm256_or_si256(out, above(ro, rsize));
  return _mm256_or_si256(out, above(len, _mm256_sub_epi64(rsize, ro)));
}

__attribute__((target("avx2"))) inline __m256i load4(const void* p) {
  return _mm256_loadu_si256(static_cast<const __m256i*>(p));
}

__attribute__((target("avx2"))) size_t copy_items_avx2(const size_t* lo_col, const size_t* ro_col,
                                                       const size_t* len_col, size_t n,
                                                       ferry_iov_v1* out, uint64_t lsize,
                                                       uint64_t rsize, uint64_t* total, bool* bad) {
  static_assert(sizeof(size_t) == 8 && sizeof(ferry_iov_v1) == 24);
  const __m256i ls = _mm256_set1_epi64x(static_cast<long long>(lsize));
  const __m256i rs = _mm256_set1_epi64x(static_cast<long long>(rsize));
  __m256i sum = _mm256_setzero_si256(), off = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256i lo = load4(lo_col + i), ro = load4(ro_col + i), len = load4(len_col + i);
    sum = _mm256_add_epi64(sum, len);
    off = _mm256_or_si256(off, outside(lo, ro, len, ls, rs));
    // Out as four (local, remote) pairs and their lengths: items 0, 2 in the
    // low pairs, 1, 3 in the high ones.
    const __m256i even = _mm256_unpacklo_epi64(lo, ro), odd = _mm256_unpackhi_epi64(lo, ro);
    ferry_iov_v1* o = out + i;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&o[0].local_off), _mm256_castsi256_si128(even));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&o[1].local_off), _mm256_castsi256_si128(odd));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&o[2].local_off),
                     _mm256_extracti128_si256(even, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&o[3].local_off), _mm256_extracti128_si256(odd, 1));
    o[0].len = len_col[i];
    o[1].len = len_col[i + 1];
    o[2].len = len_col[i + 2];
    o[3].len = len_col[i + 3];
  }
  uint64_t s[4];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s), sum);
  *total += s[0] + s[1] + s[2] + s[3];
  *bad |= !_mm256_testz_si256(off, off);
  return i;
}

__attribute__((target("avx2"))) size_t scattered_rows_avx2(
    const ferry_iov_v1* iov, size_t n, bool write, unsigned long long dbase,
    unsigned long long sbase, uint64_t lsize, uint64_t rsize, uint64_t row_max, bool has_prev,
    Row* prev, unsigned long long* dsts, unsigned long long* srcs, unsigned long long* sizes,
    bool* bad) {
  const __m256i ls = _mm256_set1_epi64x(static_cast<long long>(lsize));
  const __m256i rs = _mm256_set1_epi64x(static_cast<long long>(rsize));
  const __m256i longest = _mm256_set1_epi64x(static_cast<long long>(row_max));
  const __m256i db = _mm256_set1_epi64x(static_cast<long long>(dbase));
  const __m256i sb = _mm256_set1_epi64x(static_cast<long long>(sbase));
  // Lane 0 compares with the row before the group; none before the first row.
  __m256i first = _mm256_set_epi64x(-1, -1, -1, has_prev ? -1 : 0);
  __m256i pd = _mm256_set1_epi64x(static_cast<long long>(prev->dst));
  __m256i ps = _mm256_set1_epi64x(static_cast<long long>(prev->src));
  __m256i pn = _mm256_set1_epi64x(static_cast<long long>(prev->len));
  __m256i off = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    // Four pieces of (local, remote, len) - l0 r0 n0 l1 | r1 n1 l2 r2 | n2 l3 r3 n3 -
    // into one register per field, in piece order.
    const __m256i v0 = load4(iov + i), v1 = load4(&iov[i + 1].remote_off),
                  v2 = load4(&iov[i + 2].len);
    const __m256i lo = _mm256_permute4x64_epi64(
        _mm256_blend_epi32(_mm256_blend_epi32(v0, v1, 0x30), v2, 0x0C), 0x6C);
    const __m256i ro = _mm256_permute4x64_epi64(
        _mm256_blend_epi32(_mm256_blend_epi32(v0, v1, 0xC3), v2, 0x30), 0xB1);
    const __m256i len = _mm256_permute4x64_epi64(
        _mm256_blend_epi32(_mm256_blend_epi32(v0, v1, 0x0C), v2, 0xC3), 0xC6);
    const __m256i dst = _mm256_add_epi64(db, write ? ro : lo);
    const __m256i src = _mm256_add_epi64(sb, write ? lo : ro);
    // Each piece beside the one before it: the row before, then pieces 0-2.
    const __m256i bd = _mm256_blend_epi32(_mm256_permute4x64_epi64(dst, 0x90), pd, 0x03);
    const __m256i bs = _mm256_blend_epi32(_mm256_permute4x64_epi64(src, 0x90), ps, 0x03);
    const __m256i bn = _mm256_blend_epi32(_mm256_permute4x64_epi64(len, 0x90), pn, 0x03);
    const __m256i follows =
        _mm256_and_si256(_mm256_and_si256(_mm256_cmpeq_epi64(_mm256_add_epi64(bd, bn), dst),
                                          _mm256_cmpeq_epi64(_mm256_add_epi64(bs, bn), src)),
                         first);
    const __m256i other = _mm256_or_si256(follows, above(len, longest));
    if (!_mm256_testz_si256(other, other)) break;  // merges or splits: one at a time
    off = _mm256_or_si256(off, outside(lo, ro, len, ls, rs));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dsts + i), dst);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(srcs + i), src);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sizes + i), len);
    pd = _mm256_permute4x64_epi64(dst, 0xFF);  // the last row, in every lane
    ps = _mm256_permute4x64_epi64(src, 0xFF);
    pn = _mm256_permute4x64_epi64(len, 0xFF);
    first = _mm256_set1_epi64x(-1);
  }
  if (i > 0) *prev = {dsts[i - 1], srcs[i - 1], sizes[i - 1]};
  *bad |= !_mm256_testz_si256(off, off);
  return i;
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

}  // namespace
#endif

bool simd() {
#if FERRY_ITEM_PASS_AVX2
  static const bool on = [] {
    const char* env = std::getenv("FERRY_ITEM_SIMD");
    return cpu_has_avx2() && !(env && std::strcmp(env, "0") == 0);
  }();
  return on;
#else
  return false;
#endif
}

size_t copy_items(const size_t* local_offs, const size_t* remote_offs, const size_t* sizes,
                  size_t n, ferry_iov_v1* out, uint64_t lsize, uint64_t rsize, uint64_t* total,
                  bool* bad) {
#if FERRY_ITEM_PASS_AVX2
  if (simd())
    return copy_items_avx2(local_offs, remote_offs, sizes, n, out, lsize, rsize, total, bad);
#endif
  (void)local_offs, (void)remote_offs, (void)sizes, (void)n, (void)out, (void)lsize, (void)rsize,
      (void)total, (void)bad;
  return 0;
}

size_t scattered_rows(const ferry_iov_v1* iov, size_t n, bool write, unsigned long long dbase,
                      unsigned long long sbase, uint64_t lsize, uint64_t rsize, uint64_t row_max,
                      bool has_prev, Row* prev, unsigned long long* dsts, unsigned long long* srcs,
                      unsigned long long* sizes, bool* bad) {
#if FERRY_ITEM_PASS_AVX2
  if (simd())
    return scattered_rows_avx2(iov, n, write, dbase, sbase, lsize, rsize, row_max, has_prev, prev,
                               dsts, srcs, sizes, bad);
#endif
  (void)iov, (void)n, (void)write, (void)dbase, (void)sbase, (void)lsize, (void)rsize,
      (void)row_max, (void)has_prev, (void)prev, (void)dsts, (void)srcs, (void)sizes, (void)bad;
  return 0;
}

}  // namespace ferry::item_pass
