// SPDX-License-Identifier: Apache-2.0
// One plugin instance (one engine): the opened providers, registered memory,
// peers and imports behind the C ABI. Methods may throw (std::bad_alloc);
// ofi_plugin.cpp catches.
#pragma once

#include <rdma/fabric.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "endpoint.h"
#include "ferry/plugin_kit.hpp"
#include "gpu_stage.h"
#include "settings.h"

namespace ferry_ofi {

// Plugin-owned handles handed to the core.
struct PeerHandle {
  std::shared_ptr<PeerEp> ep;  // the provider chosen for this peer
};
struct LocalMem {
  uint64_t id = 0;
  uint8_t* addr = nullptr;
  uint64_t size = 0;
  std::vector<fid_mr*> mrs;  // one per endpoint (same order as Instance::eps_), null = none
  bool gpu = false;          // device memory: staged through bounce buffers, never a target
  int device = -1;
};
struct RemoteMem {
  PeerHandle* peer = nullptr;
  Endpoint* ep = nullptr;
  uint64_t size = 0;
  uint64_t base = 0;
  uint64_t rkey = 0;
  bool mapped = false;
};

class Instance {
 public:
  // init(): the settings parsed, the instance started (the plugin kit's contract).
  static std::unique_ptr<Instance> Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                          std::string* why);
  Instance(const ferry_host_v1* host, std::string engine_key, Settings settings);
  ~Instance();  // fini: fails what is pending, joins every thread, frees every handle

  bool Start(std::string* err);
  int ConnInfo(void* buf, size_t* len);
  int PeerAdd(const ferry_peer_v1* p, void** handle);
  void PeerRemove(void* handle);
  int MemRegister(const ferry_mem_v1* m, void** handle, void* blob, size_t* blob_len);
  void MemDeregister(void* handle);
  int MemImport(void* peer, uint64_t remote_id, uint64_t remote_size, const void* blob,
                size_t blob_len, void** handle);
  void MemRelease(void* handle);
  int Post(const ferry_xfer_v1* x);
  void OnCtrl(const char* peer_key, const void* msg, size_t len);
  int Describe(char* buf, size_t len);
  const ferry_host_v1* host() const { return host_; }

 private:
  bool OpenProvider(const std::string& name, std::string* why);
  size_t IndexOf(const Endpoint* ep) const;
  void CloseMrs(LocalMem* m);
  int RegisterGpu(const ferry_mem_v1* m, void** handle, void* blob, size_t* blob_len);

  const ferry_host_v1* host_;
  const std::string engine_key_;
  const Settings settings_;
  std::vector<std::unique_ptr<Endpoint>> eps_;  // in order of preference
  std::string offered_;                         // what fi_getinfo offers, for describe()
  std::shared_ptr<StagePool> pool_;             // GPU staging; null without a GPU runtime

  std::mutex handles_mu_;
  std::set<PeerHandle*> peers_;
  std::set<LocalMem*> locals_;
  std::set<RemoteMem*> remotes_;
};

}  // namespace ferry_ofi
