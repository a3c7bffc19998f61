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
  // A lane with nothing queued or in flight for this long is closed and its
  // threads end, at both ends; the next transfer reopens it. 0 = never.
  int lane_idle_ms = 60000;
  // The I/O threads that serve TCP lanes at both ends (io_pool.h): the
  // target's admitted lanes, the initiator's sends and responses, however
  // many peers and lanes there are. 0: half the cores, 1..8.
  int io_threads = 0;
  // GPU memory is staged through host buffers (gpu_stage.h): the piece size of
  // the copy/network pipeline, and the most pinned host memory held for it.
  uint64_t gpu_stage_bytes = 1 << 20;
  // Frames from or into local GPU memory: several pieces each, so a frame's
  // copies overlap its own network time and not only other lanes'.
  uint64_t gpu_chunk_bytes = 4 << 20;
  uint64_t gpu_pinned_bytes = 64ull << 20;
  // On a same-host ring lane, GPU frames are copied by the device straight
  // into and out of the ring's shared bytes, pinned for the runtime once per
  // ring (gpu_stage.h), instead of through the staging buffers and a memcpy
  // per side. Off: the buffers (the A/B of docs/benchmarks.md). Those pinned
  // rings are the lanes' own memory, not counted in gpu_pinned_bytes; with
  // gpu_pinned_bytes 0 (never pin) no ring is pinned either.
  bool gpu_stage_in_ring = true;
  // Lanes to an engine on this host run over shared memory (channel.h): this
  // engine listens on a unix socket for them and uses the peer's. Off: TCP
  // only (tests that shape loopback TCP; a peer of a ferry before 2026-12-03,
  // which cannot read the connection blob that carries the socket's name).
  bool same_host_rings = true;
  // Same-host ring lanes of host memory: the target copies each request's
  // bytes itself, straight between the initiator's memory and its region
  // (process_vm_readv/writev, direct_copy.h) - one copy where the rings take
  // two - when the kernel lets it (same user; Yama ptrace_scope 0, or 1 with
  // the target a parent of the initiator; checked per lane, else the rings
  // carry the bytes). Off at either end: never.
  bool same_host_direct = true;
  // Only a transfer of one frame (up to ring_chunk_bytes) is copied directly;
  // larger ones are striped over the lanes' rings, which copy in parallel at
  // both ends. One with less than this goes through the rings. (16-core host:
  // direct 4-16 KiB transfers ran 1.0-1.7 x the rings' rate; below 4 KiB the
  // copy's system call is most of the work.)
  uint64_t direct_min_bytes = 4 << 10;
  // Each ring's bytes (a lane has two; the initiator's setting makes them): a
  // power of two in 64KiB..16MiB. Unset, kGpuRingBytes in a process with a GPU
  // runtime (WithRuntimeDefaults).
  uint64_t ring_bytes = 1 << 20;
  bool ring_bytes_given = false;
  // Largest payload of one frame to a peer whose lanes run over rings: smaller
  // than chunk_bytes, so a 1 MiB transfer is four frames copied by four lanes
  // at once (16-core host: READ 1 MiB 3.5-4.0 -> 19-21 GB/s; docs/benchmarks.md).
  uint64_t ring_chunk_bytes = 256 << 10;
  // How long a blocking ring wait polls before it sleeps: a GPU frame staged
  // over rings, and the threads of a ring lane the I/O pool did not take.
  // Lanes on the pool announce their sleep at once (the pool's sender_spin_us
  // polls instead). 0: at once
  // (measured: on two vCPUs the lane's pollers take the CPU from the thread
  // that has work, 4 KiB WRITE 82 us at 50 us vs 30 us at 0; on 16 cores 50 us
  // gained nothing at 4 KiB and lost at 4-16 MiB).
  int ring_spin_us = 0;
  // How long senders poll for the next frame after a send before they sleep:
  // on TCP lanes one I/O pool thread at a time (which also takes the
  // sockets' events without waiting, so the target's pool polls too; ring
  // lanes are on the same pool). While one polls, post() queues a small frame
  // without a system call (no send from the posting thread, no wake-up); 0:
  // they sleep at once and post() sends small frames itself. Costs up to one
  // CPU for this long after the pool's last work.
  int sender_spin_us = 0;
  // How long the I/O pool polls after serving a same-host ring lane as the
  // target, before it sleeps: the polling thread looks at those lanes' rings
  // (io_pool.h "Watching"), so the initiator's next frame is read with no
  // bell and no wake-up. Only the target's turns start the poll (the
  // initiator's waiting thread reads its answers itself). Ignored while
  // sender_spin_us polls after every turn (that poll watches too). Costs up
  // to one CPU for this long after the last frame served; 0: never. 50: on
  // the 16-core host 4-64 KiB ran 1.5-2 x faster than with 0 and larger
  // transfers no slower (docs/benchmarks.md, "The target watches its ring
  // lanes"); on 2 vCPUs 4 KiB gained too.
  int target_spin_us = 50;
  // post() queues an accepted transfer and returns; the next thread that
  // waits for or polls one of this engine's transfers hands it to the lanes
  // (progress()), or the plugin's flusher thread within this many us
  // (post_queue.h): post() makes no system call. 0: post() hands it over
  // itself (a small frame's send, or an I/O thread's wake-up: 7-26 us p99 on
  // the 16-core GPU host). Not used while sender_spin_us polls.
  int post_flush_us = 200;
};

// Rejects bad JSON, unknown keys, wrong types and out-of-range values, saying which.
bool ParseSettings(const char* json, Settings* out, std::string* err);

// A GPU frame staged in a ring's bytes goes in pieces of a quarter ring, at
// most gpu_stage_bytes (gpu_stage.h); 4 MiB rings give 1 MiB pieces. On an
// H100 host, VRAM -> VRAM through 1 MiB rings (256 KiB pieces) ran 10-14 GB/s
// at 16-256 MiB where 4 MiB rings ran 20-33 (docs/benchmarks.md).
inline constexpr uint64_t kGpuRingBytes = 4 << 20;
// The settings with the defaults that depend on the process: ring_bytes, when
// not given, is kGpuRingBytes where GPU frames can be staged in the rings - a
// GPU runtime that pins memory (`gpu_pins`: the host's, with host_register),
// gpu_stage_in_ring on, gpu_pinned_bytes not 0 (StagesInRing).
Settings WithRuntimeDefaults(Settings s, bool gpu_pins);
// Whether GPU frames are staged in the rings' own bytes (gpu_stage.h): the
// setting, pinning allowed (gpu_pinned_bytes 0 is "never pin"), a runtime
// that pins memory it did not allocate.
bool StagesInRing(const Settings& s, bool gpu_pins);

// "1MiB", "64KiB", "4097B": for describe() and messages.
using ferry::plugin_kit::FormatBytes;

}  // namespace ferry_tcp
