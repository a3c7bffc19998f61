// SPDX-License-Identifier: Apache-2.0
#include "device.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "ferry/plugin.h"

namespace ferry_rdma {
namespace {

int ReadNumaNode(const std::string& dev) {
  std::ifstream f("/sys/class/infiniband/" + dev + "/device/numa_node");
  int n = -1;
  if (f >> n) return n < 0 ? -1 : n;
  return -1;
}

bool IsZeroGid(const ibv_gid& g) {
  for (uint8_t b : g.raw)
    if (b != 0) return false;
  return true;
}

bool IsIpv4Mapped(const ibv_gid& g) {
  for (int i = 0; i < 10; ++i)
    if (g.raw[i] != 0) return false;
  return g.raw[10] == 0xff && g.raw[11] == 0xff;
}

bool IsLinkLocal(const ibv_gid& g) { return g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80; }

// Auto GID: RoCE v2 IPv4-mapped, then RoCE v2 global IPv6, then any RoCE v2, then RoCE v1.
int PickGid(ibv_context* ctx, uint8_t port, int table_len, ibv_gid* gid) {
  int best = -1, best_score = -1;
  for (int i = 0; i < table_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(ctx, port, static_cast<uint32_t>(i), &e, 0) != 0) continue;
    if (IsZeroGid(e.gid)) continue;
    int score = 0;
    if (e.gid_type == IBV_GID_TYPE_ROCE_V2) {
      score = IsIpv4Mapped(e.gid) ? 4 : IsLinkLocal(e.gid) ? 2 : 3;
    } else if (e.gid_type == IBV_GID_TYPE_ROCE_V1) {
      score = 1;
    }
    if (score > best_score) {
      best_score = score;
      best = i;
      *gid = e.gid;
    }
  }
  return best;
}

// Node of the page at addr (MPOL_F_NODE | MPOL_F_ADDR), -1 when unknown.
int MemoryNode(const void* addr) {
#ifdef SYS_get_mempolicy
  int node = -1;
  constexpr unsigned long kFlags = 1u /*MPOL_F_NODE*/ | 2u /*MPOL_F_ADDR*/;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, addr, kFlags) == 0) return node;
#endif
  (void)addr;
  return -1;
}

bool Selected(const std::vector<std::string>& wanted, const std::string& dev, int port,
              std::vector<bool>* used) {
  if (wanted.empty()) return true;
  bool hit = false;
  for (size_t i = 0; i < wanted.size(); ++i) {
    const std::string& w = wanted[i];
    if (w == dev || w == dev + ":" + std::to_string(port)) {
      (*used)[i] = true;
      hit = true;
    }
  }
  return hit;
}

const char* PortStateName(ibv_port_state s) { return ibv_port_state_str(s); }

}  // namespace

const char* MtuName(int mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return "256";
    case IBV_MTU_512:
      return "512";
    case IBV_MTU_1024:
      return "1024";
    case IBV_MTU_2048:
      return "2048";
    case IBV_MTU_4096:
      return "4096";
    default:
      return "?";
  }
}

bool DeviceCtx::ReserveCqes(int n, std::string* err) {
  std::lock_guard lk(cq_mu);
  if (cq_reserved + n > cq_capacity) {
    int want = std::max(cq_capacity * 2, cq_reserved + n);
    want = std::min(want, attr.max_cqe);
    if (want < cq_reserved + n || ibv_resize_cq(cq, want) != 0) {
      // The caller says what its reservation is made of (and so what to lower).
      *err = "completion queue of " + name + " is full (" + std::to_string(cq_reserved) + " of " +
             std::to_string(cq_capacity) + " CQEs reserved, device max " +
             std::to_string(attr.max_cqe) + (cq_capacity < attr.max_cqe ? "; raise cq_size" : "") +
             ")";
      return false;
    }
    cq_capacity = cq->cqe > want ? cq->cqe : want;
  }
  cq_reserved += n;
  return true;
}

void DeviceCtx::ReleaseCqes(int n) {
  std::lock_guard lk(cq_mu);
  cq_reserved -= n;
}

DeviceCtx::~DeviceCtx() {
  if (cq) ibv_destroy_cq(cq);
  if (channel) ibv_destroy_comp_channel(channel);
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
}

bool Devices::Open(const Settings& s, int* code, std::string* err) {
  int num = 0;
  ibv_device** list = ibv_get_device_list(&num);
  if (list == nullptr || num == 0) {
    if (list) ibv_free_device_list(list);
    *code = FERRY_ERR_NO_DEVICE;
    *err = "no RDMA device (ibv_get_device_list found none";
    *err += errno == ENOSYS ? ": no kernel verbs support)" : ")";
    return false;
  }
  std::vector<bool> used(s.devices.size(), false);
  std::string seen, inactive;
  for (int d = 0; d < num; ++d) {
    const std::string name = ibv_get_device_name(list[d]);
    seen += (seen.empty() ? "" : ", ") + name;
    bool wanted = s.devices.empty();
    for (const auto& w : s.devices)
      if (w == name || w.rfind(name + ":", 0) == 0) wanted = true;
    if (!wanted) continue;
    auto dev = std::make_unique<DeviceCtx>();
    dev->name = name;
    dev->ctx = ibv_open_device(list[d]);
    if (dev->ctx == nullptr || ibv_query_device(dev->ctx, &dev->attr) != 0) {
      inactive += " " + name + " (cannot open: " + std::strerror(errno) + ")";
      continue;
    }
    dev->numa_node = ReadNumaNode(name);
    std::vector<Port> ports;
    for (int p = 1; p <= dev->attr.phys_port_cnt; ++p) {
      Port port;
      port.dev = dev.get();
      port.port_num = static_cast<uint8_t>(p);
      if (ibv_query_port(dev->ctx, static_cast<uint8_t>(p), &port.attr) != 0) continue;
      if (!Selected(s.devices, name, p, &used)) continue;
      if (port.attr.state != IBV_PORT_ACTIVE) {
        inactive +=
            " " + name + ":" + std::to_string(p) + " is " + PortStateName(port.attr.state) + ";";
        continue;
      }
      port.roce = port.attr.link_layer == IBV_LINK_LAYER_ETHERNET;
      if (s.gid_index >= 0) {
        if (s.gid_index >= port.attr.gid_tbl_len ||
            ibv_query_gid(dev->ctx, port.port_num, s.gid_index, &port.gid) != 0 ||
            IsZeroGid(port.gid)) {
          ibv_free_device_list(list);
          *code = FERRY_ERR_INVALID_ARGS;
          *err = "gid_index " + std::to_string(s.gid_index) + " is empty or out of range on " +
                 name + ":" + std::to_string(p) + " (table has " +
                 std::to_string(port.attr.gid_tbl_len) + " entries)";
          return false;
        }
        port.gid_index = s.gid_index;
      } else if (port.roce) {
        port.gid_index = PickGid(dev->ctx, port.port_num, port.attr.gid_tbl_len, &port.gid);
        if (port.gid_index < 0) {
          inactive += " " + name + ":" + std::to_string(p) + " has no usable GID;";
          continue;
        }
      } else {
        port.gid_index = 0;
        ibv_query_gid(dev->ctx, port.port_num, 0, &port.gid);
      }
      ports.push_back(port);
    }
    if (ports.empty()) continue;
    dev->pd = ibv_alloc_pd(dev->ctx);
    dev->channel = ibv_create_comp_channel(dev->ctx);
    dev->cq_capacity = std::min(s.cq_size, dev->attr.max_cqe);
    if (dev->pd && dev->channel)
      dev->cq = ibv_create_cq(dev->ctx, dev->cq_capacity, nullptr, dev->channel, 0);
    if (!dev->pd || !dev->channel || !dev->cq) {
      inactive += " " + name + " (cannot create PD/CQ: " + std::strerror(errno) + ");";
      continue;
    }
    dev->cq_capacity = dev->cq->cqe;
    for (int fd : {dev->channel->fd, dev->ctx->async_fd}) {
      int fl = fcntl(fd, F_GETFL);
      fcntl(fd, F_SETFL, fl | O_NONBLOCK);
    }
    dev->index = static_cast<int>(devs.size());
    for (auto& port : ports) {
      port.index = static_cast<int>(this->ports.size());
      port.info.name = name.substr(0, wire::kMaxNameLen);
      port.info.port = port.port_num;
      port.info.link_layer = port.attr.link_layer;
      port.info.active_mtu = static_cast<uint8_t>(port.attr.active_mtu);
      port.info.gid_index = static_cast<uint8_t>(port.gid_index);
      port.info.lid = port.attr.lid;
      std::memcpy(port.info.gid, port.gid.raw, 16);
      port.info.numa_node = static_cast<int16_t>(dev->numa_node);
      this->ports.push_back(port);
    }
    devs.push_back(std::move(dev));
    if (this->ports.size() >= wire::kMaxPorts) break;
  }
  ibv_free_device_list(list);
  for (size_t i = 0; i < used.size(); ++i) {
    if (!used[i]) {
      *code = FERRY_ERR_INVALID_ARGS;
      *err = "configured device '" + s.devices[i] + "' not found (devices here: " + seen + ")";
      return false;
    }
  }
  if (ports.empty()) {
    *code = FERRY_ERR_NO_DEVICE;
    *err = "no active RDMA port (devices: " + seen + ";" + inactive + ")";
    return false;
  }
  return true;
}

int Devices::PortForMemory(const void* addr, uint64_t size) {
  (void)size;
  const int node = MemoryNode(addr);
  std::vector<int> best;
  int best_score = 3;
  for (const auto& p : ports) {
    const int dn = p.dev->numa_node;
    const int score = (node < 0 || dn < 0) ? 1 : dn == node ? 0 : 2;
    if (score < best_score) {
      best_score = score;
      best.clear();
    }
    if (score == best_score) best.push_back(p.index);
  }
  std::lock_guard lk(rr_mu_);
  return best[rr_++ % best.size()];
}

std::string Devices::Describe() const {
  std::string out;
  for (const auto& p : ports) {
    char gid[64];
    const uint8_t* g = p.gid.raw;
    if (IsIpv4Mapped(p.gid))
      std::snprintf(gid, sizeof gid, "%u.%u.%u.%u", g[12], g[13], g[14], g[15]);
    else
      std::snprintf(gid, sizeof gid, "%02x%02x:...:%02x%02x", g[0], g[1], g[14], g[15]);
    out += (out.empty() ? "" : ", ") + p.Name() + " (" + (p.roce ? "RoCE" : "IB") + " gid " +
           std::to_string(p.gid_index) + " " + gid + ", mtu " + MtuName(p.attr.active_mtu) +
           (p.roce ? "" : ", lid " + std::to_string(p.attr.lid)) + ", numa " +
           std::to_string(p.dev->numa_node) + ")";
  }
  return out;
}

}  // namespace ferry_rdma
