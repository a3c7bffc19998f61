// SPDX-License-Identifier: Apache-2.0
// FERRY_HOT marks the functions every transfer runs through - submit, post,
// completion, wait - so the compiler puts them together (.text.hot) instead of
// wherever their source files put them, ~90 pages of libferry apart. A post
// that comes after the caller's wait, or after a GPU runtime's copy call, finds
// its code's TLB entries and cache lines gone: fewer pages, fewer walks.
// Measured (docs/benchmarks.md, "Batches four items at a time"): on the
// 2-vCPU VM an 8-byte write after 8 MiB of eviction 11.2 -> 9.2 us (median of
// 7 alternated rounds); on an H100 host xgmi's call and tcp's post() moved
// within their run-to-run spread.
#pragma once

#define FERRY_HOT __attribute__((hot))
