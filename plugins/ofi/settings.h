// SPDX-License-Identifier: Apache-2.0
// The backend's settings, as the policy hands them over in JSON.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/plugin_kit.hpp"

namespace ferry_ofi {

struct Settings {
  // Providers to open, in order of preference. Empty = automatic: "shm" (for
  // peers on this host) plus the first other RDM provider fi_getinfo offers.
  std::vector<std::string> providers;
  std::string domain;        // only this fabric domain (e.g. "lo", "eth0"); empty = first
  std::string listen_host;   // bind the endpoint to this address (FI_SOURCE); empty = any
  uint64_t chunk_bytes = 0;  // most bytes in one RMA; 0 = provider-tuned default
  int window = 32;           // RMAs in flight per peer (also capped by the tx queue)
  int spin_us = 0;           // progress threads keep polling this long after activity (0: one pass)
  // GPU memory on the initiator is staged through registered pinned host
  // buffers (gpu_stage.h): the piece size (a stage is two pieces), and the most
  // pinned memory the plugin holds for stages.
  uint64_t gpu_stage_bytes = 1 << 20;
  uint64_t gpu_pinned_bytes = 64ull << 20;
};

// Rejects bad JSON, unknown keys, wrong types and out-of-range values, saying which.
bool ParseSettings(const char* json, Settings* out, std::string* err);

// "1MiB", "64KiB", "4097B": for describe() and messages.
using ferry::plugin_kit::FormatBytes;

}  // namespace ferry_ofi
