// SPDX-License-Identifier: Apache-2.0
// One plugin instance (one engine): devices, registered memory, peers and their
// connections, the target-side QPs, a completion thread (CQ events, async
// events, deadlines) and a worker thread (QP handshakes through the control
// channel, which may block on the network and must not stall completions).
// Methods may throw (std::bad_alloc, std::system_error); rdma_plugin.cpp catches.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "conn.h"
#include "device.h"
#include "ferry/plugin_kit.hpp"
#include "log_gate.h"
#include "settings.h"
#include "wire.h"

namespace ferry_rdma {

// Plugin-owned handles handed to the core.
struct PeerHandle {
  std::string key;
  wire::ConnInfo info;
  std::mutex mu;
  std::map<std::pair<int, int>, std::shared_ptr<Conn>> conns;  // (local port, remote port)
};
struct LocalMem {
  uint64_t id = 0;
  uint8_t* addr = nullptr;
  uint64_t size = 0;
  int preferred_port = 0;
  std::vector<ibv_mr*> mrs;  // by device index
};
struct RemoteMem {
  uint64_t id = 0;
  uint64_t size = 0;
  wire::MemInfo info;
};

class Instance {
 public:
  // init(): the settings parsed, the instance started (the plugin kit's contract).
  static std::unique_ptr<Instance> Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                          std::string* why);
  Instance(const ferry_host_v1* host, std::string engine_key, Settings settings);
  ~Instance();  // fini: fails what is pending, joins the threads, frees every handle

  // Opens devices and starts the threads; *code/*err say why not.
  bool Start(int* code, std::string* err);
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
  // ABI 1.5: live QPs of each side (initiator_qps, target_qps) and passive connections.
  int Counters(char* buf, size_t len);
  // plugin.h fence(): this engine's QPs that serve `peer_key` go to ERR (a
  // responder in ERR applies no more RDMA WRITEs) and are retired; the
  // initiator's next transfer makes new ones with a new handshake.
  // Every attempt of the initiator is fenced by retiring its QPs: the ids and
  // the deadline do not change what is done.
  int Fence(const char* peer_key, const uint64_t* ids, size_t n, uint64_t deadline_ns,
            ferry_fence_result_v1* out);

  // ---- for Conn / Passive ----
  const ferry_host_v1* host() const { return host_; }
  const Settings& settings() const { return settings_; }
  uint64_t Now() const { return host_->now_ns(host_->host_ctx); }
  uint64_t NextWrId() { return next_wr_id_.fetch_add(1, std::memory_order_relaxed); }
  // Connection ids: this instance's random 32-bit lineage, then a counter. A
  // target keeps, per port pair, the passive side of the newest handshake of a
  // lineage: a request of the same lineage that arrives late (sent over a
  // control connection that was replaced - a peer deregistered and registered
  // again) does not displace the newer one. Another lineage is a restarted
  // initiator, whose handshake wins.
  uint64_t NewConnId() { return next_conn_id_.fetch_add(1); }
  static uint64_t FirstConnId();
  static bool SameLineage(uint64_t a, uint64_t b) { return (a >> 32) == (b >> 32); }
  void RegisterQp(int dev, uint32_t qpn, std::weak_ptr<Conn> c, std::weak_ptr<Passive> p, int qi);
  void UnregisterQp(int dev, uint32_t qpn);
  void RegisterConnId(uint64_t id, std::weak_ptr<Conn> c);
  void UnregisterConnId(uint64_t id);
  // Tells the target (from the worker thread) that an idle connection's QPs are gone.
  void SendDisconnect(const std::string& peer_key, const wire::ConnectMsg& m);
  // Queues the handshake request for the worker thread.
  void SendConnectReq(std::weak_ptr<Conn> c, uint64_t conn_id, std::vector<uint8_t> msg);
  void AddConnTimer(uint64_t deadline, std::weak_ptr<Conn> c);
  void Report(FinishedList& done);  // host->complete for each, no lock held
  // Retires a target-side connection now and destroys it once the completion
  // thread has drained what its QPs delivered before.
  void RetirePassive(const std::shared_ptr<Passive>& p);

 private:
  struct Timer {
    std::weak_ptr<Xfer> x;
    std::weak_ptr<Conn> c;
  };
  struct QpRef {
    std::weak_ptr<Conn> conn;
    std::weak_ptr<Passive> passive;
    int qi = 0;
  };

  void CqMain();
  int DrainCqs();
  void Dispatch(DeviceCtx* dev, const ibv_wc& wc, FinishedList* done,
                std::vector<std::pair<std::string, uint64_t>>* inbound);
  void HandleAsync(DeviceCtx* dev);
  void RunTimers();
  int NextTimerMs();
  void AddXferTimer(const std::shared_ptr<Xfer>& x);
  void RemoveTimer(uint64_t deadline, uint64_t seq);
  void Wake();

  void WorkerMain();
  // Runs fn on a worker thread after the work queued before it for the same
  // peer (a DISCONNECT before the next handshake, a reply after its request);
  // different peers' work runs on different workers at once, so a peer whose
  // control channel blocks (ctrl_send waits up to its connect timeout for an
  // unreachable host) holds up only its own handshakes.
  void PushWork(const std::string& peer_key, std::function<void()> fn);
  void HandleCtrl(const std::string& peer_key, const std::vector<uint8_t>& msg);
  void Accept(const std::string& peer_key, const wire::ConnectMsg& req);
  // The initiator released connection m.conn_id: retire our side of it.
  void ReleasePassive(const std::string& peer_key, const wire::ConnectMsg& m);
  // Tells the target of each connected one to retire its QPs (Conn::Farewell).
  void SayFarewell(const std::string& peer_key,
                   const std::map<std::pair<int, int>, std::shared_ptr<Conn>>& conns);
  // Why this handshake may not have QPs here, or "" (mu_ held): the peer must
  // be known (registered or learned), name one of its own ports, and stay
  // within max_qps_per_peer with the connections it keeps.
  std::string RefusalLocked(const std::string& peer_key, const wire::ConnectMsg& req) const;
  // Logs (at most 20 lines per peer per 10 s), counts and sends the NAK.
  void RefuseHandshake(const std::string& peer_key, const wire::ConnectMsg& nak);
  void SendCtrl(const std::string& peer_key, const wire::ConnectMsg& m);

  const ferry_host_v1* host_;
  const std::string engine_key_;
  const Settings settings_;
  Devices devices_;
  uint64_t nonce_ = 0;
  std::atomic<uint64_t> next_wr_id_{1};
  std::atomic<uint64_t> next_conn_id_{FirstConnId()};
  std::atomic<bool> stop_{false};

  // completion thread
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  // Set to ~0 while the completion thread computes its sleep and sleeps: a timer
  // added then must wake it; while it runs it looks at the timers itself.
  std::atomic<uint64_t> sleeping_{0};
  std::thread cq_thread_;
  std::mutex timer_mu_;
  std::map<std::pair<uint64_t, uint64_t>, Timer> timers_;  // (deadline, seq)
  uint64_t next_timer_seq_ = 1;

  // worker threads: per peer, a queue run in order by one worker at a time
  static constexpr int kWorkers = 4;
  std::mutex work_mu_;
  std::condition_variable work_cv_;
  std::map<std::string, std::deque<std::function<void()>>> work_;  // by peer key
  std::deque<std::string> ready_;  // peers with work and no worker on it, in order
  std::set<std::string> running_;  // peers a worker runs a job of now
  std::vector<std::thread> workers_;

  std::mutex mu_;  // the maps below
  std::map<std::pair<int, uint32_t>, QpRef> qps_;
  std::map<uint64_t, std::weak_ptr<Conn>> conn_ids_;
  std::map<std::tuple<std::string, uint16_t, uint16_t>, std::shared_ptr<Passive>> passives_;
  std::vector<std::shared_ptr<Passive>> graveyard_;  // retired, to destroy after a drain
  ferry::plugin_kit::LogGate refusal_log_;           // refused handshakes, per peer
  std::atomic<uint64_t> handshakes_refused_{0};
  std::set<PeerHandle*> peers_;
  std::set<LocalMem*> locals_;
  std::set<RemoteMem*> remotes_;
};

}  // namespace ferry_rdma
