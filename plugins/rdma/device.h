// SPDX-License-Identifier: Apache-2.0
// The RDMA devices and ports this instance uses: opened once in init, each
// device with one protection domain, one completion channel and one CQ shared by
// every QP on it; each active port with the GID chosen for it.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "settings.h"
#include "wire.h"

namespace ferry_rdma {

struct DeviceCtx {
  std::string name;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_comp_channel* channel = nullptr;
  ibv_cq* cq = nullptr;
  ibv_device_attr attr{};
  int numa_node = -1;  // /sys/class/infiniband/<dev>/device/numa_node; -1 unknown
  int index = 0;       // in Devices::devs

  // CQEs promised to QPs; the CQ is grown (ibv_resize_cq) when a new QP needs more.
  std::mutex cq_mu;
  int cq_capacity = 0;
  int cq_reserved = 0;
  bool ReserveCqes(int n, std::string* err);
  void ReleaseCqes(int n);

  ~DeviceCtx();
};

struct Port {
  int index = 0;  // in Devices::ports and in our ConnInfo
  DeviceCtx* dev = nullptr;
  uint8_t port_num = 1;
  ibv_port_attr attr{};
  int gid_index = 0;
  ibv_gid gid{};
  bool roce = false;  // link layer Ethernet: address by GID (GRH), else by LID
  wire::PortInfo info;
  std::string Name() const { return dev->name + ":" + std::to_string(port_num); }
};

class Devices {
 public:
  // Opens what the settings select. On failure *code is FERRY_ERR_NO_DEVICE (no
  // device / no active port) or FERRY_ERR_INVALID_ARGS (a configured device is
  // missing, a bad gid_index), and *err says which.
  bool Open(const Settings& s, int* code, std::string* err);

  std::vector<std::unique_ptr<DeviceCtx>> devs;
  std::vector<Port> ports;

  // The port for memory at addr: one whose device sits on the memory's NUMA node
  // when known, else any; ties spread round-robin.
  int PortForMemory(const void* addr, uint64_t size);

  std::string Describe() const;

 private:
  std::mutex rr_mu_;
  unsigned rr_ = 0;
};

const char* MtuName(int mtu);  // enum ibv_mtu -> "1024"

}  // namespace ferry_rdma
