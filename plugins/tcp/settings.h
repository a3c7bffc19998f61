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
  // Lanes to an engine on this host run over shared memory (channel.h): this
  // engine listens on a unix socket for them and uses the peer's. Off: TCP
  // only (tests that shape loopback TCP; a peer of a ferry before 2026-12-03,
  // which cannot read the connection blob that carries the socket's name).
  bool same_host_rings = true;
  // Each ring's bytes (a lane has two): a power of two in 64KiB..16MiB.
  uint64_t ring_bytes = 1 << 20;
  // How long a ring lane's thread polls before it sleeps. -1 = auto: 50 us
  // with 8 or more CPUs, else 0 - on two vCPUs the lane's three pollers (the
  // target's thread, our receiver, the application's wait) take the CPU from
  // the thread that has work (4 KiB WRITE: 82 us polling 50 us, 30 us not;
  // docs/benchmarks.md).
  int ring_spin_us = -1;
};

// ring_spin_us with auto resolved for this machine.
int RingSpinUs(const Settings& s);

// Rejects bad JSON, unknown keys, wrong types and out-of-range values, saying which.
bool ParseSettings(const char* json, Settings* out, std::string* err);

// "1MiB", "64KiB", "4097B": for describe() and messages.
using ferry::plugin_kit::FormatBytes;

}  // namespace ferry_tcp
