// SPDX-License-Identifier: Apache-2.0
// xgmi's own notification (FERRY_CAP_NATIVE_NOTIFY and _READ), ordered by the
// GPU. The core's NOTIFY leaves only once the initiator has seen the copy end:
// a send() that wakes the target's control thread sits between the copy's end
// and the transfer's status (3-6 us of a 64 KiB transfer's ~12 on the GPU
// host, docs/benchmarks.md). Here the initiator records an interprocess event
// behind the copy and sends the event's handle to the target's xgmi from
// post(), while the copy runs; the target's watch thread reports the landing
// (host->inbound) once that event has fired - after the data, in the GPU's own
// order - and the initiator's status ends without a message.
//
// Initiator: EventPool, per device up to kSlotsPerDevice events, taken by a
// notify transfer and given back when it has been reported. A slot is reused
// only after its copy was seen done here and kReuseAfter has passed since, so
// a target that looks late at it (its message was slow, it napped) still sees
// the fired record; one later still sees a later copy's record: it reports
// later, never early.
// Target: InboundWatch, the peers' opened events (bounded, least recently used
// closed first) and the entries watched, polled by one thread that starts with
// the first message and sleeps while nothing is watched.
// Where the fast path cannot be taken (no free slot, the control connection
// busy or not made yet, a runtime without interprocess events, a peer that
// does not watch events) the transfer completes with FERRY_OK_NOTIFY_BY_CORE
// and the core sends its NOTIFY as before.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"
#include "xgmi_blob.h"

namespace ferry_xgmi {

class EventPool {
 public:
  static constexpr uint32_t kSlotsPerDevice = 256;
  static constexpr std::chrono::milliseconds kReuseAfter{2};
  // nullptr when the runtime shim has no interprocess events.
  static std::shared_ptr<EventPool> Create(const ferry_gpu_v1* gpu);
  // A live pool of this process by id, or nullptr.
  static std::shared_ptr<EventPool> Find(uint64_t id);
  EventPool(const ferry_gpu_v1* gpu, uint64_t id);
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  uint64_t id() const { return id_; }
  // A free slot of `device` (the current device; made on first use), the one
  // given back longest ago. False when all are taken or making one failed.
  bool Take(int device, uint32_t* slot);
  void Give(uint32_t slot);
  // The slot's event and handle; nullptr for a slot never made.
  void* Event(uint32_t slot) const;
  bool Handle(uint32_t slot, uint8_t out[64]) const;

 private:
  struct Slot {
    void* event = nullptr;
    uint8_t handle[64] = {};
  };
  const ferry_gpu_v1* gpu_;
  const uint64_t id_;
  mutable std::mutex mu_;
  std::vector<Slot> slots_;  // device * kSlotsPerDevice + i, sized at creation
  struct Freed {
    uint32_t slot;
    std::chrono::steady_clock::time_point at;
  };
  std::vector<std::deque<Freed>> free_;  // per device, oldest first
  std::vector<uint32_t> made_;           // per device
};

class InboundWatch {
 public:
  InboundWatch(const ferry_host_v1* host, std::chrono::microseconds spin);
  ~InboundWatch();  // entries not yet fired are dropped unreported; opened events destroyed
  InboundWatch(const InboundWatch&) = delete;
  InboundWatch& operator=(const InboundWatch&) = delete;

  // A message from peer_key's xgmi (the control plane's thread).
  void OnMessage(const char* peer_key, const void* msg, size_t len);

  struct Counts {
    uint64_t watched = 0, reported = 0, dropped = 0;
    uint64_t farewell = 0;  // uids a peer's farewell listed as landed (reported)
    size_t events_open = 0;
  };
  Counts counts() const;

  // Entries watched and events opened at once, per peer (so a peer that
  // floods only loses its own) and in all (an engine with many peers).
  static constexpr size_t kMaxWatchedPerPeer = 1u << 14;
  static constexpr size_t kMaxWatched = 1u << 16;
  static constexpr size_t kMaxOpenPerPeer = 2048;  // 8 devices x kSlotsPerDevice
  static constexpr size_t kMaxOpen = 16384;
  static constexpr std::chrono::seconds kMaxAge{60};

 private:
  using Clock = std::chrono::steady_clock;
  struct Opened {
    void* event = nullptr;
    std::string peer;
    uint64_t last_use = 0;
    int watchers = 0;
  };
  struct PeerUse {
    size_t watched = 0, opened = 0;
  };
  struct Entry {
    std::string peer;
    uint64_t uid;
    void* event;
    std::string key;                   // opened_'s key; empty for an event of this process
    std::shared_ptr<EventPool> owner;  // keeps an event of this process alive
    Clock::time_point since;
  };
  void Loop();
  // The opened event for m's handle from peer (opened now - without mu_ -
  // closing that peer's, or anyone's, least recently used idle one at the
  // bounds); nullptr with *why. *key: its opened_ key.
  void* Open(std::unique_lock<std::mutex>& lk, const std::string& peer, const AfterEventMsg& m,
             std::string* key, std::string* why);
  // mu_ held: closes the least recently used idle event (of `peer`, or of
  // anyone when empty); false when every one is watched.
  bool CloseIdleLocked(const std::string& peer);
  void Drop(const char* peer_key, const std::string& why);
  // A farewell (xgmi_blob.h LandedHeader): each uid reported landed.
  void OnLanded(const char* peer_key, const void* msg, size_t len);
  void ReleaseLocked(const std::string& peer, const std::string& key);  // mu_ held

  const ferry_host_v1* host_;
  const ferry_gpu_v1* gpu_;
  const std::chrono::microseconds spin_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> incoming_;           // guarded by mu_; the thread moves them to its own list
  size_t watching_ = 0;                   // guarded by mu_: entries in the thread's list
  std::map<std::string, Opened> opened_;  // key: peer, pid and handle
  std::map<std::string, PeerUse> peers_;
  uint64_t use_tick_ = 0;
  Counts counts_;
  bool stop_ = false;
  std::thread thread_;  // started by the first entry
};

}  // namespace ferry_xgmi
