// SPDX-License-Identifier: Apache-2.0
#include "qp.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

namespace ferry_rdma {

uint32_t RandomPsn() {
  thread_local std::mt19937 rng{std::random_device{}()};
  return rng() & 0xffffff;
}

ibv_qp* CreateRcQp(const Port& port, QpCaps* caps, std::string* err) {
  ibv_qp_init_attr a{};
  a.send_cq = port.dev->cq;
  a.recv_cq = port.dev->cq;
  a.qp_type = IBV_QPT_RC;
  a.sq_sig_all = 0;
  a.cap.max_send_wr = static_cast<uint32_t>(caps->send_wr);
  a.cap.max_recv_wr = static_cast<uint32_t>(caps->recv_wr);
  a.cap.max_send_sge = static_cast<uint32_t>(caps->sge);
  a.cap.max_recv_sge = 1;
  a.cap.max_inline_data = static_cast<uint32_t>(caps->inline_bytes);
  ibv_qp* qp = ibv_create_qp(port.dev->pd, &a);
  if (qp == nullptr && caps->inline_bytes > 0) {
    // Some devices refuse inline data of that size: try without.
    a.cap.max_inline_data = 0;
    qp = ibv_create_qp(port.dev->pd, &a);
  }
  if (qp == nullptr) {
    *err = "ibv_create_qp on " + port.Name() + " failed: " + std::strerror(errno) + " (send_wr " +
           std::to_string(caps->send_wr) + ", sge " + std::to_string(caps->sge) + ")";
    return nullptr;
  }
  caps->send_wr = static_cast<int>(std::min<uint32_t>(a.cap.max_send_wr, 1u << 20));
  caps->recv_wr = static_cast<int>(a.cap.max_recv_wr);
  caps->sge = static_cast<int>(a.cap.max_send_sge);
  caps->inline_bytes = static_cast<int>(a.cap.max_inline_data);
  return qp;
}

bool QpToInit(ibv_qp* qp, const Port& port, int access, std::string* err) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = port.port_num;
  a.qp_access_flags = static_cast<unsigned>(access);
  int rc =
      ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc != 0) {
    *err = std::string("QP to INIT failed: ") + std::strerror(rc);
    return false;
  }
  return true;
}

bool QpToRtr(ibv_qp* qp, const Port& port, const RemoteQp& r, int max_dest_rd_atomic,
             const QpTimers& t, std::string* err) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min<int>(port.attr.active_mtu, r.mtu));
  a.dest_qp_num = r.qpn;
  a.rq_psn = r.psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(max_dest_rd_atomic);
  a.min_rnr_timer = static_cast<uint8_t>(t.min_rnr_timer);
  a.ah_attr.port_num = port.port_num;
  a.ah_attr.sl = static_cast<uint8_t>(t.service_level);
  if (port.roce) {
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, r.gid, 16);
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(port.gid_index);
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.grh.traffic_class = static_cast<uint8_t>(t.traffic_class);
  } else {
    a.ah_attr.dlid = r.lid;
  }
  int rc = ibv_modify_qp(qp, &a,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) {
    *err = std::string("QP to RTR failed: ") + std::strerror(rc);
    return false;
  }
  return true;
}

bool QpToRts(ibv_qp* qp, uint32_t psn, int max_rd_atomic, const QpTimers& t, std::string* err) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psn;
  a.timeout = static_cast<uint8_t>(t.timeout);
  a.retry_cnt = static_cast<uint8_t>(t.retry_cnt);
  a.rnr_retry = static_cast<uint8_t>(t.rnr_retry);
  a.max_rd_atomic = static_cast<uint8_t>(max_rd_atomic);
  int rc = ibv_modify_qp(qp, &a,
                         IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                             IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) {
    *err = std::string("QP to RTS failed: ") + std::strerror(rc);
    return false;
  }
  return true;
}

bool QpToState(ibv_qp* qp, ibv_qp_state state) {
  ibv_qp_attr a{};
  a.qp_state = state;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE) == 0;
}

}  // namespace ferry_rdma
