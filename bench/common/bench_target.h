// SPDX-License-Identifier: Apache-2.0
// The target side of ferry-bench: an engine with one registered region, driven
// by line commands over a pair of file descriptors (pipes when both ranks run
// on this machine, a TCP socket between hosts).
#pragma once
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "segment.h"

namespace ferry::bench {

struct TargetOptions {
  std::string key = "target";
  std::vector<std::string> backends{"tcp"};
  std::string host = "127.0.0.1";
  size_t region_bytes = 0;
  std::string policy_file;
  std::chrono::milliseconds timeout{0};
  SegType seg_type = SegType::DRAM;                     // where the region lives
  int device = -1;                                      // GPU ordinal for VRAM
  std::map<std::string, std::string> backend_settings;  // plugin name -> JSON
  // A metadata store (etcd): the engine publishes its descriptor there and
  // the region as "bench" (ferry-bench --etcd-endpoints).
  MetadataConfig metadata;
};

// Serves commands read from in_fd, answering on out_fd, until "quit" or EOF.
// Prints "READY <engine desc hex> <memory desc hex>" first. Each command gets
// one line back:
//   register <engine desc hex>      -> OK | ERR <why>
//   fill <seed>                     -> OK          (whole region = pattern(seed))
//   fill <seed> <n> <off> <len> ... -> OK          (only those n ranges)
//   hash <n> <off> <len> ...        -> HASH <fnv1a of the n ranges in order>
//   pop <key> <uid> <timeout_ms>    -> INBOUND <code> | NONE
//   notifs <timeout_ms>             -> NOTIFS <n> <key>:<hex> ...  (drains the inbox)
//   msghash <ms> <n> <off> <len>... -> MSG <count> <key>:<hex> HASH <h> | NONE: the first
//                                      messages to arrive, and the ranges' hash when they did
//   send <key> <hex>                -> SENT <code> (a notification message to that engine)
//   kvregions <n> <bytes>           -> KVREGIONS <memory desc hex> x n (more regions)
//   kvhash <region> <off> <len>     -> HASH <fnv1a> of a range of one of those
//   stats                           -> STATS <inbound notifications> <ctrl rejected>
//   subregion <off> <len>           -> MEM <memory desc hex>: part of the region as a
//                                      region of its own (ferry-plugin-check's bounds
//                                      and revocation rules; the bytes stay readable
//                                      through hash after it is dropped)
//   dropsub <i>                     -> OK | ERR <why>  (deregisters subregion i)
//   remove_backend <name>           -> OK | ERR <why>  (cuts that backend's connections)
//   publish <name>                  -> OK | ERR <why>  (the region in the metadata
//                                      store: needs FERRY_ETCD_ENDPOINTS or the policy's)
//   quit                            -> BYE, and returns
// Returns an exit code.
int run_target(const TargetOptions& opt, int in_fd, int out_fd);

}  // namespace ferry::bench
