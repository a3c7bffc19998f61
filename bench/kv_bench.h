// SPDX-License-Identifier: Apache-2.0
// ferry-bench --kv: one PD-disaggregation KV-cache shipment per request -
// L layers x {K, V} regions of N blocks of S bytes on each side, a request's
// random block ids moved for every layer, then a notification message - posted
// three ways in one run: by index into prepared lists, as one multi-region
// transfer of items, and as one batch per region pair plus a standalone message.
// With DRAM on this side each method is printed beside a raw reference of the
// same run: one thread's memcpy of the same requests' blocks (x raw).
#pragma once
#include <functional>
#include <string>

#include "ferry/ferry.hpp"
#include "segment.h"

namespace ferry::bench {

struct KvOptions {
  int layers = 32;                // Llama-3-8B-like: 32 layers
  size_t blocks = 1024;           // per region
  size_t block_bytes = 16 << 10;  // 16 KiB: 16 tokens x 8 KV heads x 128 x bf16 / 2
  size_t request_blocks = 128;    // a 2,048-token prompt at 16 tokens per block
  int requests = 16, warmup = 2;
  Op op = Op::WRITE;
  SegType init_seg = SegType::DRAM, target_seg = SegType::DRAM;
  int init_dev = -1;
  bool check = false;
  std::string label;  // backends, for the header line
};

// `ask` sends one line to the target rank and returns its answer.
int run_kv(const KvOptions& k, Engine& engine,
           const std::function<std::string(const std::string&)>& ask);

}  // namespace ferry::bench
