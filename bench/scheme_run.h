// SPDX-License-Identifier: Apache-2.0
// ferry-bench --scheme with more than one pair: every rank a process of this
// machine, started by exec (the ranks' own binary, as rank 1 always was) and
// driven over pipes by the process the user ran (the driver). The driver
// measures nothing itself: it starts the targets, then the initiators, hands
// each initiator the targets' descriptors, and per sweep point lets every
// initiator warm up, starts their timed iterations together (one "go" each,
// after all of them reported "WARM") and aggregates what they report.
//
// Driver <-> initiator lines (the initiator rank's stdin/stdout):
//   <- HELLO <engine desc hex>          the initiator's engine is up
//   -> TARGETS <m> <engine hex> <mem hex> ... (every target, in order)
//   <- OK | ERR <why>                   the initiator registered its targets
//   -> point <block> <batch> <iters>    warm up at that point, then wait
//   <- WARM | ERR <why>
//   -> go                               run the timed iterations
//   <- DONE <wall ns> <excluded ns> <bytes> <verified 0|1> <n> <latency us> x n
//   <- ask <target> <command>           (any time during a point) a target
//   -> <the target's answer>            command for --check-consistency, relayed
//   -> quit   <- BYE
#pragma once
#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ferry/ferry.hpp"
#include "scheme.h"
#include "segment.h"

namespace ferry::bench {

struct SchemeRun {
  SchemeShape shape;
  std::vector<std::string> backends;
  std::string backend_label;  // as given to --backend, for the output
  std::map<std::string, std::string> backend_settings;
  std::string policy_file, host = "127.0.0.1";
  Op op = Op::WRITE;  // tp: always a WRITE then a READ back
  bool notify = true, check = false, strided = false, progress = false;
  SegType init_seg = SegType::DRAM, target_seg = SegType::DRAM;
  int init_dev = -1;
  size_t slice_bytes = 0;  // one initiator's part of a target region (max block x max batch)
  std::vector<std::pair<size_t, size_t>> points;  // (block, batch), in sweep order
  int num_iter = 64, warmup_iter = 8, large_block_iter_factor = 16;
  std::string csv_file, json_file;
};

// The driver. `rank_args`: the user's command line (without argv[0]); each
// rank gets it back with its role and index, so it derives the same layout.
int run_scheme_driver(const SchemeRun& run, const std::vector<std::string>& rank_args);

// Initiator rank `index`, driven over in_fd/out_fd (its stdin/stdout). Never
// writes to stdout otherwise: that is the driver's pipe.
int run_scheme_initiator(const SchemeRun& run, int index, int in_fd, int out_fd);

}  // namespace ferry::bench
