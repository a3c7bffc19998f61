// SPDX-License-Identifier: Apache-2.0
// The rdma backend's settings, as the policy hands them over in JSON
// (backends: { rdma: { ... } }). Every key is optional; unknown keys are refused.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/plugin_kit.hpp"

namespace ferry_rdma {

struct Settings {
  // Ports to use, "dev" (every active port of it) or "dev:port"; empty = every
  // active port of every device.
  std::vector<std::string> devices;
  int gid_index = -1;                 // -1 = auto (RoCE v2 IPv4-mapped first)
  int qp_per_transfer = 4;            // RC QPs per (peer, local port, remote port)
  int max_send_wr = 256;              // send queue depth of each QP
  int recv_depth = 64;                // receives posted per target-side QP (notifications)
  int cq_size = 4096;                 // CQEs per device (grown when QPs need more)
  int max_inline = 64;                // WRITEs up to this size are sent inline
  int max_sge = 16;                   // SGEs per work request (capped by the device)
  uint64_t chunk_bytes = 256u << 10;  // most bytes in one work request
  int qp_timeout = 14;                // local ACK timeout exponent: 4.096us * 2^n
  int retry_cnt = 6;                  // transport retries before IBV_WC_RETRY_EXC_ERR
                                      // (rxe treats 7 as unlimited)
  int rnr_retry = 7;                  // receiver-not-ready retries (7 = unlimited)
  int min_rnr_timer = 12;             // RNR NAK timer code (12 = 0.64 ms)
  int traffic_class = 0;              // RoCE GRH traffic class
  int service_level = 0;              // IB SL
  int connect_timeout_ms = 5000;      // QP handshake through the control channel
  // A connection with nothing queued or in flight for this long gives its QPs
  // back at both ends (the target is told); the next transfer connects again.
  // 0 = never.
  int qp_idle_ms = 60000;
  // Target side: the most QPs all of one initiator's connections may hold
  // here (each port pair's handshake names its count, up to 64). A handshake
  // past it is refused: one peer cannot take the device's QPs and CQ entries
  // from the others.
  int max_qps_per_peer = 256;
  bool busy_poll = false;  // completion thread never sleeps
  int spin_us = 20;        // event mode: poll this long before sleeping
};

// Rejects bad JSON, unknown keys, wrong types and out-of-range values, saying which.
bool ParseSettings(const char* json, Settings* out, std::string* err);

// "1MiB", "64KiB", "4097B": for describe() and messages.
using ferry::plugin_kit::FormatBytes;

}  // namespace ferry_rdma
