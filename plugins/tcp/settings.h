// SPDX-License-Identifier: Apache-2.0
// The backend's settings, as the policy hands them over in JSON.
#pragma once

#include <cstdint>
#include <string>

#include "ferry/plugin_kit.hpp"

namespace ferry_tcp {

struct Settings {
  int lanes = 4;                   // data connections per peer
  uint64_t chunk_bytes = 1 << 20;  // most payload bytes in one frame
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;    // 0 = any free port
  std::string advertise_host;  // what peers dial; empty = listen_host
  int connect_timeout_ms = 5000;
  int io_timeout_ms = 30000;  // a frame that stops moving for this long is dropped
  int keepalive_s = 10;       // idle lanes probed after this long (0 = off): SetKeepAlive
  // GPU memory is staged through host buffers (gpu_stage.h): the piece size of
  // the copy/network pipeline, and the most pinned host memory held for it.
  uint64_t gpu_stage_bytes = 1 << 20;
  // Frames from or into local GPU memory: several pieces each, so a frame's
  // copies overlap its own network time and not only other lanes'.
  uint64_t gpu_chunk_bytes = 4 << 20;
  uint64_t gpu_pinned_bytes = 64ull << 20;
};

// Rejects bad JSON, unknown keys, wrong types and out-of-range values, saying which.
bool ParseSettings(const char* json, Settings* out, std::string* err);

// "1MiB", "64KiB", "4097B": for describe() and messages.
using ferry::plugin_kit::FormatBytes;

}  // namespace ferry_tcp
