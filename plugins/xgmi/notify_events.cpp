// SPDX-License-Identifier: Apache-2.0
#include "notify_events.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "cpu_relax.h"
#include "ferry/plugin_kit.hpp"
#include "process_tag.h"
#include "thread_name.h"

namespace ferry_xgmi {

// ---- EventPool (initiator) ---------------------------------------------------

namespace {
std::mutex g_pools_mu;
std::map<uint64_t, std::weak_ptr<EventPool>>& Pools() {
  static auto* pools = new std::map<uint64_t, std::weak_ptr<EventPool>>;  // never destroyed
  return *pools;
}
}  // namespace

std::shared_ptr<EventPool> EventPool::Create(const ferry_gpu_v1* gpu) {
  if (gpu == nullptr || !FERRY_HAS_FIELD(ferry_gpu_v1, gpu, ipc_event_open) ||
      gpu->event_create_ipc == nullptr || gpu->ipc_event_handle == nullptr ||
      gpu->ipc_event_open == nullptr)
    return nullptr;
  std::random_device rd;
  uint64_t id = 0;
  std::lock_guard<std::mutex> lk(g_pools_mu);
  do id = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  while (id == 0 || Pools().count(id));
  auto pool = std::make_shared<EventPool>(gpu, id);
  Pools()[id] = pool;
  return pool;
}

std::shared_ptr<EventPool> EventPool::Find(uint64_t id) {
  std::lock_guard<std::mutex> lk(g_pools_mu);
  auto it = Pools().find(id);
  return it == Pools().end() ? nullptr : it->second.lock();
}

EventPool::EventPool(const ferry_gpu_v1* gpu, uint64_t id) : gpu_(gpu), id_(id) {
  const auto devices = static_cast<size_t>(std::max(gpu->device_count, 0));
  slots_.resize(devices * kSlotsPerDevice);
  free_.resize(devices);
  made_.resize(devices);
}

EventPool::~EventPool() {
  {
    std::lock_guard<std::mutex> lk(g_pools_mu);
    auto it = Pools().find(id_);
    if (it != Pools().end() && it->second.expired()) Pools().erase(it);
  }
  for (Slot& s : slots_)
    if (s.event) gpu_->event_destroy(gpu_->gpu_ctx, s.event);
}

bool EventPool::Take(int device, uint32_t* slot) {
  if (device < 0 || static_cast<size_t>(device) >= free_.size()) return false;
  const auto d = static_cast<size_t>(device);
  std::lock_guard<std::mutex> lk(mu_);
  if (!free_[d].empty() && std::chrono::steady_clock::now() - free_[d].front().at >= kReuseAfter) {
    *slot = free_[d].front().slot;
    free_[d].pop_front();
    return true;
  }
  if (made_[d] == kSlotsPerDevice) return false;  // all taken or freed too recently
  const uint32_t i = static_cast<uint32_t>(d * kSlotsPerDevice + made_[d]);
  Slot& s = slots_[i];
  if (gpu_->event_create_ipc(gpu_->gpu_ctx, &s.event) != FERRY_OK) {
    s.event = nullptr;
    return false;
  }
  if (gpu_->ipc_event_handle(gpu_->gpu_ctx, s.event, s.handle) != FERRY_OK) {
    gpu_->event_destroy(gpu_->gpu_ctx, s.event);
    s.event = nullptr;
    return false;
  }
  ++made_[d];
  *slot = i;
  return true;
}

void EventPool::Give(uint32_t slot) {
  std::lock_guard<std::mutex> lk(mu_);
  free_[slot / kSlotsPerDevice].push_back({slot, std::chrono::steady_clock::now()});
}

void* EventPool::Event(uint32_t slot) const {
  std::lock_guard<std::mutex> lk(mu_);
  return slot < slots_.size() ? slots_[slot].event : nullptr;
}

bool EventPool::Handle(uint32_t slot, uint8_t out[64]) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (slot >= slots_.size() || slots_[slot].event == nullptr) return false;
  std::memcpy(out, slots_[slot].handle, 64);
  return true;
}

// ---- InboundWatch (target) ---------------------------------------------------

InboundWatch::InboundWatch(const ferry_host_v1* host, std::chrono::microseconds spin)
    : host_(host), gpu_(host->gpu), spin_(spin) {}

InboundWatch::~InboundWatch() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (auto& [k, o] : opened_) gpu_->event_destroy(gpu_->gpu_ctx, o.event);
}

InboundWatch::Counts InboundWatch::counts() const {
  std::lock_guard<std::mutex> lk(mu_);
  Counts c = counts_;
  c.events_open = opened_.size();
  return c;
}

void InboundWatch::Drop(const char* peer_key, const std::string& why) {
  uint64_t n = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    n = ++counts_.dropped;
  }
  // Bounded logging: a peer that sends junk cannot flood the log.
  if ((n & (n - 1)) == 0)
    ferry::plugin_kit::Log(host_, FERRY_LOG_WARN,
                           "notification from '%s' not watched (%llu so far): %s", peer_key,
                           static_cast<unsigned long long>(n), why.c_str());
}

bool InboundWatch::CloseIdleLocked(const std::string& peer) {
  auto lru = opened_.end();
  for (auto i = opened_.begin(); i != opened_.end(); ++i)
    if (i->second.watchers == 0 && (peer.empty() || i->second.peer == peer) &&
        (lru == opened_.end() || i->second.last_use < lru->second.last_use))
      lru = i;
  if (lru == opened_.end()) return false;
  gpu_->event_destroy(gpu_->gpu_ctx, lru->second.event);
  --peers_[lru->second.peer].opened;
  opened_.erase(lru);
  return true;
}

void* InboundWatch::Open(std::unique_lock<std::mutex>& lk, const std::string& peer,
                         const AfterEventMsg& m, std::string* key, std::string* why) {
  // Per peer and process: another peer's message, or a later process of that
  // peer, never hits an event opened for this one.
  *key = peer + '\0' + std::to_string(m.process) + '\0' +
         std::string(reinterpret_cast<const char*>(m.handle), sizeof m.handle);
  auto it = opened_.find(*key);
  if (it == opened_.end()) {
    if (gpu_ == nullptr || !FERRY_HAS_FIELD(ferry_gpu_v1, gpu_, ipc_event_open) ||
        gpu_->ipc_event_open == nullptr) {
      *why = "this GPU runtime cannot open interprocess events";
      return nullptr;
    }
    // The runtime's open takes its time: not under mu_ (the watch thread's
    // rounds and counters() take it).
    void* e = nullptr;
    lk.unlock();
    const int rc = gpu_->ipc_event_open(gpu_->gpu_ctx, m.handle, &e);
    const std::string err = rc == FERRY_OK ? std::string() : gpu_->last_error(gpu_->gpu_ctx);
    lk.lock();
    if (rc != FERRY_OK) {
      *why = "cannot open the initiator's event: " + err;
      return nullptr;
    }
    it = opened_.find(*key);
    if (it != opened_.end()) {
      gpu_->event_destroy(gpu_->gpu_ctx, e);  // another message opened it meanwhile
    } else {
      if ((peers_[peer].opened >= kMaxOpenPerPeer && !CloseIdleLocked(peer)) ||
          (opened_.size() >= kMaxOpen && !CloseIdleLocked({}))) {
        gpu_->event_destroy(gpu_->gpu_ctx, e);
        *why = "too many of its events are being watched";
        return nullptr;
      }
      it = opened_.emplace(*key, Opened{e, peer, 0, 0}).first;
      ++peers_[peer].opened;
    }
  }
  it->second.last_use = ++use_tick_;
  ++it->second.watchers;
  return it->second.event;
}

void InboundWatch::OnMessage(const char* peer_key, const void* msg, size_t len) {
  uint32_t magic = 0;
  if (msg != nullptr && len >= sizeof magic) std::memcpy(&magic, msg, sizeof magic);
  if (magic == LandedHeader::kMagic) {
    OnLanded(peer_key, msg, len);
    return;
  }
  AfterEventMsg m;
  if (!DecodeAfterEvent(msg, len, &m)) {
    Drop(peer_key, "malformed message (" + std::to_string(len) + " bytes)");
    return;
  }
  Entry e{peer_key, m.uid, nullptr, {}, nullptr, Clock::now()};
  std::string why;
  if (m.process == ProcessTag()) {
    // Two engines of one process: the event is ours; the pool id (random,
    // never sent elsewhere but to our peers) names it.
    e.owner = EventPool::Find(m.pool_id);
    e.event = e.owner ? e.owner->Event(m.slot) : nullptr;
    if (!e.event) why = "no such event in this process";
  }
  std::unique_lock<std::mutex> lk(mu_);
  if (peers_[e.peer].watched >= kMaxWatchedPerPeer || incoming_.size() + watching_ >= kMaxWatched) {
    e.event = nullptr;
    why = "too many of its notifications are being watched";
  } else if (!e.owner && why.empty()) {
    e.event = Open(lk, e.peer, m, &e.key, &why);
  }
  if (!e.event || stop_) {
    if (e.event) ReleaseLocked({}, e.key);  // opened while the engine stopped
    lk.unlock();
    Drop(peer_key, why.empty() ? "the engine is stopping" : why);
    return;
  }
  ++counts_.watched;
  ++peers_[e.peer].watched;
  incoming_.push_back(std::move(e));
  if (!thread_.joinable()) thread_ = ferry::named_thread("xgmi-watch", [this] { Loop(); });
  lk.unlock();
  cv_.notify_one();
}

void InboundWatch::OnLanded(const char* peer_key, const void* msg, size_t len) {
  std::vector<uint64_t> uids;
  if (!DecodeLanded(msg, len, &uids)) {
    Drop(peer_key, "malformed farewell (" + std::to_string(len) + " bytes)");
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    counts_.farewell += uids.size();
  }
  // Those reported by their events already, or still watched (reported
  // again when they fire), are dropped by the core: it records a uid once.
  for (const uint64_t uid : uids) host_->inbound(host_->host_ctx, peer_key, uid, FERRY_OK);
}

void InboundWatch::ReleaseLocked(const std::string& peer, const std::string& key) {
  auto p = peers_.find(peer);
  if (p != peers_.end() && p->second.watched > 0) --p->second.watched;
  if (key.empty()) return;
  auto o = opened_.find(key);
  if (o != opened_.end()) --o->second.watchers;
}

// Every entry is queried in turn (entries of several peers and streams end in
// any order). After a report it polls for spin_, then sleeps between rounds,
// 20 us at first, doubling to 1 ms: an entry waits for a copy that is running
// (or, its initiator gone, for its age limit), and an empty list sleeps until
// a message comes.
void InboundWatch::Loop() {
  constexpr auto kMinNap = std::chrono::microseconds(20);
  constexpr auto kMaxNap = std::chrono::milliseconds(1);
  struct Fired {
    std::string peer;
    uint64_t uid;
    int status;
  };
  std::list<Entry> watching;  // this thread's own
  std::vector<Fired> fired;
  std::vector<std::pair<std::string, std::string>> released;  // (peer, key)
  auto last_fire = Clock::now();
  std::chrono::microseconds nap = kMinNap;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    for (Entry& e : incoming_) watching.push_back(std::move(e));
    incoming_.clear();
    watching_ = watching.size();
    if (stop_) break;
    if (watching.empty()) {
      cv_.wait(lk, [&] { return stop_ || !incoming_.empty(); });
      nap = kMinNap;
      continue;
    }
    lk.unlock();
    const auto now = Clock::now();
    for (auto it = watching.begin(); it != watching.end();) {
      int rc = gpu_->event_query(gpu_->gpu_ctx, it->event);
      if (rc == 1 && now - it->since < kMaxAge) {
        ++it;
        continue;
      }
      // Fired (FERRY_OK), failed (the copy's runtime error) or too old: the
      // core records only landings; a failure is logged there.
      released.emplace_back(it->peer, std::move(it->key));
      fired.push_back({std::move(it->peer), it->uid,
                       rc == FERRY_OK ? FERRY_OK
                       : rc == 1      ? FERRY_ERR_TIMEOUT
                                      : FERRY_ERR_GPU});
      it = watching.erase(it);
    }
    lk.lock();
    for (const auto& [peer, key] : released) ReleaseLocked(peer, key);
    // Counted before the core hears, so a count never lags what it was told.
    for (const Fired& f : fired) ++(f.status == FERRY_OK ? counts_.reported : counts_.dropped);
    if (!fired.empty()) {
      lk.unlock();
      for (const Fired& f : fired) host_->inbound(host_->host_ctx, f.peer.c_str(), f.uid, f.status);
      lk.lock();
    }
    if (!fired.empty()) {
      last_fire = Clock::now();
      nap = kMinNap;
    }
    const bool spinning = Clock::now() - last_fire < spin_;
    fired.clear();
    released.clear();
    if (!incoming_.empty() || watching.empty()) continue;
    if (spinning) {
      lk.unlock();
      for (int i = 0; i < 16; ++i) cpu_relax();
      lk.lock();
      continue;
    }
    cv_.wait_for(lk, nap, [&] { return stop_ || !incoming_.empty(); });
    nap = std::min<std::chrono::microseconds>(nap * 2, kMaxNap);
  }
  for (const Entry& e : watching) ReleaseLocked(e.peer, e.key);
}

}  // namespace ferry_xgmi
