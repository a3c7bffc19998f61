// SPDX-License-Identifier: Apache-2.0
// Creating RC queue pairs and walking them through RESET -> INIT -> RTR -> RTS.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>

#include "device.h"

namespace ferry_rdma {

struct QpCaps {
  int send_wr = 1;
  int recv_wr = 1;
  int sge = 1;
  int inline_bytes = 0;
};

// The remote end of a QP as the handshake described it.
struct RemoteQp {
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint8_t gid[16] = {};
  uint16_t lid = 0;
  uint8_t mtu = 0;  // enum ibv_mtu of the remote port
};

struct QpTimers {
  int timeout = 14;
  int retry_cnt = 7;
  int rnr_retry = 7;
  int min_rnr_timer = 12;
  int traffic_class = 0;
  int service_level = 0;
};

// Creates an RC QP on the port's device CQ. *caps is updated to what the device
// granted (inline may come back larger than asked).
ibv_qp* CreateRcQp(const Port& port, QpCaps* caps, std::string* err);

bool QpToInit(ibv_qp* qp, const Port& port, int access, std::string* err);
bool QpToRtr(ibv_qp* qp, const Port& port, const RemoteQp& r, int max_dest_rd_atomic,
             const QpTimers& t, std::string* err);
bool QpToRts(ibv_qp* qp, uint32_t psn, int max_rd_atomic, const QpTimers& t, std::string* err);
bool QpToState(ibv_qp* qp, ibv_qp_state state);  // RESET or ERR

uint32_t RandomPsn();

}  // namespace ferry_rdma
