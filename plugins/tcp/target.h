// SPDX-License-Identifier: Apache-2.0
// The target side: the data-lane listeners (TCP, and a unix socket for lanes
// from engines on this host, which then run over shared rings: channel.h),
// serving READ and WRITE requests against registered memory.
//
// Threads (issue 20): an accepted lane gets a thread for its handshake only;
// once admitted, a TCP lane is served by the engine's small pool of I/O
// threads (io_pool.h, polled_lane.h) and the thread ends, so the thread count
// does not grow with peers. A same-host lane over shared rings keeps its
// thread (ring waits are not epoll events; such lanes come only from engines
// of this host).
//
// A lane is admitted only after HELLO names an added peer and, when the host
// has a secret, the peer proved it (handshake.h); refused lanes are logged and
// counted. At most kMaxPendingLanes lanes may be in the handshake at once (the
// oldest is cut), and a handshake must finish within the connect timeout.
// Every request is checked before memory is touched: the lane's peer is still
// added, the region exists, every item lies inside it. A refused request gets an
// ERROR response and the lane carries on; a malformed frame closes the lane.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "channel.h"
#include "ferry/plugin.h"
#include "gpu_stage.h"
#include "io_pool.h"
#include "log_gate.h"
#include "region.h"
#include "settings.h"
#include "socket_util.h"
#include "target_peer.h"
#include "wire.h"

namespace ferry_tcp {

// One byte of registered memory, read for a reply outside ThreadSanitizer's
// view (target.cpp says why).
uint8_t PayloadByte(const uint8_t* p);

class TargetServer {
 public:
  static constexpr size_t kMaxPendingLanes = 64;
  // Initiators served without being registered (they proved our descriptor);
  // each keeps its fence record while the engine lives, so they are bounded.
  static constexpr size_t kMaxUnregisteredPeers = 1024;

  // pool: the engine's I/O threads (running from before Start until after Stop).
  TargetServer(const ferry_host_v1* host, std::string engine_key, const Settings& settings,
               RegionTable* regions, StagePool* stages, IoPool* pool);
  ~TargetServer();

  bool Start(std::string* err);
  uint16_t port() const { return port_; }
  // The abstract unix socket same-host lanes connect to; empty when off.
  const std::string& unix_name() const { return unix_name_; }
  // Lanes admitted over shared rings since the start, and of them those whose
  // requests may ask for direct copies (direct_copy.h).
  uint64_t ring_lanes() const { return ring_lanes_.load(); }
  uint64_t direct_lanes() const { return direct_lanes_.load(); }
  // False when the key is already added. same_host: it runs on this kernel, so
  // its clock (steady_clock) is ours and request expiries need no mapping.
  bool AddPeer(const std::string& key, bool same_host = false);
  void RemovePeer(const std::string& key);
  void Stop();
  // plugin.h fence(): the initiator `key` gave up on these attempts.
  int Fence(const std::string& key, const uint64_t* ids, size_t n,
            std::chrono::steady_clock::time_point deadline, ferry_fence_result_v1* out);
  // Lanes closed before admission: unknown peer, failed auth, bad handshake, evicted.
  uint64_t rejected() const { return rejected_.load(); }

 private:
  friend class PolledLane;

  struct Conn {
    int fd = -1;               // guarded by mu_, so Stop's shutdown never hits a reused number
    std::thread thread;        // the handshake (and serving, when the pool refuses the lane)
    bool thread_done = false;  // the thread has returned (joined by ReapLocked)
    bool done = false;         // the lane is closed (fd closed); erased once joined
    bool pooled = false;       // served by the I/O pool (a PolledLane owns fd)
    bool admitted = false;     // past the handshake (guarded by mu_)
    bool evicted = false;
    bool local = false;  // came in on the unix socket: a same-host ring lane
    std::string source;  // the peer's address without the port
  };
  // What serving one request frame decided.
  enum class Outcome { kServed, kRefused, kCloseLane };

  void AcceptMain();
  // Blocks until a lane comes in on either listener (or Stop): its fd, or -1
  // with errno; *local says which listener.
  int AcceptOne(bool* local);
  void Serve(Conn* c);
  // True when the lane was handed to the I/O pool (which now owns fd).
  bool ServeLane(Conn* c, int fd, const std::string& from);
  // A pooled lane closed its socket: forget it (PolledLane's destructor).
  void ReleaseConn(Conn* c);
  // What a lane proved in its handshake, kept to check again when the peer is
  // registered later (LaneStillProven): empty when the core checks no proofs.
  struct LaneProof {
    std::vector<uint8_t> transcript;
    std::array<uint8_t, wire::kAuthProofSize> proof{};
  };
  // What serving an admitted lane's frames needs.
  struct LaneCtx {
    std::shared_ptr<TargetPeer> tp;
    std::string key;
    std::string who;  // "'key' (from)", for messages
    int64_t clock_offset = 0;
  };
  // Counts a served request frame for notification and tells the host when its
  // transfer is complete; always before the response that lets the initiator
  // complete. False with *close_why when the frames contradict each other.
  bool Count(const LaneCtx& ctx, const wire::Header& h, int frame_status, std::string* close_why);
  // Serves one decoded request frame with blocking I/O and answers it (ERROR,
  // WRITE_ACK, or the READ data). False when the lane must close (*close_why
  // says why; empty for a quiet close).
  bool ServeFrame(Channel& ch, ByteReader& in, const LaneCtx& ctx, const wire::Header& h,
                  const std::vector<wire::Item>& items, const std::vector<uint64_t>& addrs,
                  std::string* close_why);
  // Authenticates the initiator `key` (HELLO carried kFlagAuth == theirs).
  // False with *why when the lane must be refused.
  // The handshake ends by `deadline` (the lane's connect timeout).
  bool Authenticate(int fd, const std::string& key, bool theirs,
                    std::chrono::steady_clock::time_point deadline, std::string* why,
                    LaneProof* kept);
  // A lane admitted while its key was unregistered proved only that it holds
  // this engine's descriptor. Once a registration happened since `*seen`, its
  // handshake is checked again against what is registered now: a key registered
  // (or learned) here is pinned to its secret. False with *why when the proof no
  // longer holds; the lane must then close. Lanes in flight are not cut: a real
  // initiator's transfer, whose lanes beat its hello to this engine, goes on.
  bool LaneStillProven(const std::string& key, const LaneProof& kept, uint64_t* seen,
                       std::string* why);
  // status: the ERROR's code (FERRY_ERR_UNSUPPORTED: the shared rings were
  // refused, so the initiator may use TCP instead; ring_handover.h).
  void Refuse(int fd, const std::string& from, const std::string& why,
              int status = FERRY_ERR_REMOTE);
  // A WARN about a connection from `from` (address:port), through refusal_log_:
  // 20 per 10 s per (kind `what`, address).
  // The peer state a lane that passed Authenticate() serves: the registered
  // peer, else (when it proved this engine's descriptor) one made for the
  // unregistered initiator; nullptr with *why when neither.
  std::shared_ptr<TargetPeer> PeerForLane(const std::string& key, bool authenticated,
                                          std::string* why);
  void WarnFrom(const char* what, const std::string& from, const std::string& msg);
  Outcome ServeRequest(Channel& ch, ByteReader& in, TargetPeer& tp, const wire::Header& h,
                       const std::vector<wire::Item>& items, const std::vector<uint64_t>& addrs,
                       const std::function<bool(int)>& count, int64_t clock_offset, int* status,
                       std::string* reason, std::string* close_why);
  // A checked direct request's copy (wire.h kFlagDirect) between the
  // initiator's memory and r, on a lane that agreed to direct copies, with
  // the region in use (and a WRITE's apply begun): FERRY_OK once every byte
  // moved. Else *reason, and *close_lane: true when the lane must end (part
  // of it may have moved, or the initiator's process or access is gone: its
  // apply ends not whole), false when it is refused with the code returned
  // (an address not the initiator's, nothing moved).
  static int CopyDirect(const Channel& ch, const wire::Header& h,
                        const std::vector<wire::Item>& items, const std::vector<uint64_t>& addrs,
                        const Region& r, std::string* reason, bool* close_lane);
  // The answer to a direct READ that was served: READ_DATA without payload.
  static void EncodeDirectReadDone(const wire::Header& req, uint8_t* out);
  // ServeRequest for a checked request on a GPU region, through `stage`.
  Outcome ServeStaged(Channel& ch, ByteReader& in, const Region& r, const wire::Header& h,
                      const std::vector<wire::Item>& items, Stage& stage,
                      const std::function<bool(int)>& count, std::string* close_why);
  static int SendError(Channel& ch, uint64_t req_id, int status, const std::string& msg);
  static std::vector<uint8_t> ErrorFrame(uint64_t req_id, int status, const std::string& msg);
  // The checks every request passes before memory is touched: the region is
  // registered and the key is its key, every item lies inside it. FERRY_OK with
  // *r, else the refusal's code with *reason.
  // A lane's next frame, as every lane reads it (its own thread or the pool):
  // the head decoded into *h and checked (a request, from a peer still proven),
  // then its body - items, and a direct request's addresses (BodyBytes in
  // all) - decoded into *items and *addrs and checked against the head. ""
  // when the frame may be served, else why the lane closes. direct_lane: the
  // lane agreed to direct copies (else a direct request closes it).
  std::string AcceptHead(const uint8_t* head, const std::string& key, const LaneProof& proven,
                         uint64_t* registrations_seen, bool direct_lane, wire::Header* h);
  static size_t BodyBytes(const wire::Header& h);
  // The bytes a request's items name (a WRITE's payload, unless direct).
  static uint64_t ItemBytes(const std::vector<wire::Item>& items) {
    uint64_t n = 0;
    for (const auto& it : items) n += it.len;
    return n;
  }
  static std::string AcceptItems(const wire::Header& h, const std::vector<uint8_t>& item_buf,
                                 std::vector<wire::Item>* items, std::vector<uint64_t>* addrs);
  int CheckRequest(const wire::Header& h, const std::vector<wire::Item>& items,
                   std::shared_ptr<Region>* r, std::string* reason) const;
  // A READ's response header: kHeaderSize bytes at out, the items' total as its payload.
  static void EncodeReadDataHead(const wire::Header& req, const std::vector<wire::Item>& items,
                                 uint8_t* out);
  static std::string FencedReason(const wire::Header& h);   // a WRITE dropped by the fence
  static std::string RevokedReason(const wire::Header& h);  // its region went meanwhile
  void ReapLocked();

  const ferry_host_v1* host_;
  const std::string engine_key_;
  const Settings settings_;
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> ring_lanes_{0};
  std::atomic<uint64_t> direct_lanes_{0};
  std::atomic<uint64_t> registrations_{0};  // AddPeer calls so far (LaneStillProven)
  RegionTable* regions_;
  StagePool* stages_;  // for requests on GPU regions
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  int unix_fd_ = -1;
  std::string unix_name_;
  Waker stop_waker_;  // ends AcceptOne's poll at Stop
  std::thread accept_thread_;
  IoPool* const pool_;  // serves admitted lanes (TCP and rings)

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  // Stop() began: lanes stop serving at their next frame (a ring lane with
  // frames waiting in its ring would otherwise go on after its socket was cut).
  std::atomic<bool> stopped_{false};
  // Warnings about refused or closed connections (WarnFrom).
  ferry::plugin_kit::LogGate refusal_log_;
  uint64_t accept_failures_ = 0;   // accept() out of descriptors since the last warning
  uint64_t accept_warned_ns_ = 0;  // host clock of that warning
  std::map<std::string, std::shared_ptr<TargetPeer>> peers_;
  std::list<std::unique_ptr<Conn>> conns_;
};

}  // namespace ferry_tcp
