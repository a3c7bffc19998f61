// SPDX-License-Identifier: Apache-2.0
// The registry: remote engines (peers), local memory and imports of remote
// memory, and the plugin handles each backend made for them. Private state
// behind its own lock; descriptors are validated and imported here. A transfer
// gets its (local, remote) pair from resolve() and the plugin handles for one
// attempt from handles(); nothing else reaches into the maps.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "backend_set.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"

namespace ferry {

// A peer's or a region's plugin handles by backend name. A handful of
// entries, scanned in one block: each attempt looks up three of them (peer,
// local, remote), where a tree's separately allocated nodes each cost a
// cache miss once a GPU runtime's copy call has run between two transfers.
class HandleTable {
 public:
  using Entry = std::pair<std::string, void*>;
  using iterator = std::vector<Entry>::iterator;
  using const_iterator = std::vector<Entry>::const_iterator;
  iterator begin() { return v_.begin(); }
  iterator end() { return v_.end(); }
  const_iterator begin() const { return v_.begin(); }
  const_iterator end() const { return v_.end(); }
  iterator find(const std::string& name) {
    return std::find_if(v_.begin(), v_.end(), [&](const Entry& e) { return e.first == name; });
  }
  const_iterator find(const std::string& name) const {
    return std::find_if(v_.begin(), v_.end(), [&](const Entry& e) { return e.first == name; });
  }
  size_t count(const std::string& name) const { return find(name) == end() ? 0 : 1; }
  void*& operator[](const std::string& name) {
    auto it = find(name);
    if (it != end()) return it->second;
    return v_.emplace_back(name, nullptr).second;
  }
  void erase(iterator it) { v_.erase(it); }

 private:
  std::vector<Entry> v_;
};

struct PeerEntry {
  EngineDesc desc;
  bool same_host = false;
  std::set<std::string> advertised;  // backends in the peer's descriptor
  // Deregistered (or replaced by a re-registration of its key): sessions made
  // for it refuse new transfers, and its late failures do not count against the
  // health of the engine now registered under the key.
  std::atomic<bool> gone{false};
  // Learned from the peer's authenticated hello (one-way registration), not
  // registered by the application: a later hello of a new life may replace it.
  std::atomic<bool> learned{false};
  // Why it went, when a reason was given (written before `gone` is set): a
  // session's transfers fail with it (metadata store: its lease expired).
  std::string gone_why;

 private:
  friend class Registry;
  HandleTable handles;                             // backend -> plugin peer handle
  std::map<std::string, std::string> unreachable;  // backend -> why peer_add failed
};

struct LocalMem {
  MemoryDesc desc;
  void* addr = nullptr;
  std::set<std::string> advertised;
  // Transfers using this region as local memory; deregistration waits for
  // zero. Counted without a lock (twice per transfer); `draining` (set by the
  // deregistration before it waits) tells the transfer that takes it to zero
  // to wake it, under mu. Both seq_cst: each side writes one and reads the other.
  std::mutex mu;
  std::condition_variable idle;
  std::atomic<uint64_t> inflight{0};
  std::atomic<bool> draining{false};

 private:
  friend class Registry;
  HandleTable handles;
};

// Ranked backends, shared by the route cache and the transfers it routed:
// handing one to a transfer copies a pointer, not the list. Never null.
using Route = std::shared_ptr<const std::vector<BackendPtr>>;

// A routing decision kept for one (local region, remote region, op, size band); valid
// while neither the loaded backends nor any health state changed, and no
// quarantine it relied on has ended.
struct CachedRoute {
  uint64_t backend_generation = 0;
  uint64_t health_generation = 0;
  std::chrono::steady_clock::time_point valid_until;
  Route route;
  std::string why;
};

struct RemoteMem {
  MemoryDesc desc;
  std::set<std::string> advertised;
  std::mutex route_mu;  // the transfer lifecycle's route cache
  std::map<std::tuple<uint64_t, int, int>, CachedRoute> routes;  // (local id, op, size band)

 private:
  friend class Registry;
  HandleTable handles;
};

// A resolved (local, remote) pair: what a transfer and a Session keep.
struct MemPair {
  std::shared_ptr<PeerEntry> peer;
  std::shared_ptr<LocalMem> local;
  std::shared_ptr<RemoteMem> remote;
};

// Engine keys are 1..255 bytes (they travel as str8 on the wire).
constexpr size_t kMaxKeyBytes = 255;

class Registry {
 public:
  // self: this engine's key, instance and node id (same_host is node id equality).
  Registry(std::string self_key, uint64_t self_instance, std::string node_id, BackendSet& backends);

  // ---- peers
  // What add_peer refuses: a bad key, this engine itself, port 0.
  Result check_peer(const EngineDesc& d) const;
  // Checks the descriptor and tells every loaded backend it advertises. A peer
  // already known under the key should be removed first (remove_peer).
  // `learned`: from the peer's hello; then a peer registered meanwhile wins
  // (ERR_BAD_STATE, nothing changed).
  Result add_peer(const EngineDesc& d, bool learned = false);
  // The application registered a descriptor equal to the one known under its
  // key: it is the application's from now on (no longer replaceable by a hello).
  // False when the known descriptor differs or there is none.
  bool confirm_peer(const EngineDesc& d);
  // Whether the peer under `key` was learned, not registered; none: nullopt.
  std::optional<bool> peer_learned(const std::string& key) const;
  size_t learned_peers() const;
  // The instance registered under `key`, or none.
  std::optional<uint64_t> peer_instance(const std::string& key) const;
  // The access secret of the descriptor registered under `key` (false: none);
  // *learned says whether it was learned from a hello rather than registered.
  bool peer_secret(const std::string& key, std::vector<uint8_t>* secret,
                   bool* learned = nullptr) const;
  // Host and port of a registered peer's control plane.
  bool peer_address(const std::string& key, std::string& host, uint16_t& port) const;
  // Takes the peer, its imports and their plugin handles away; false when unknown.
  // `why` (optional): the reason later transfers to the key are told.
  bool remove_peer(const std::string& key, const std::string& why = {});

  // ---- local memory
  MemoryDesc register_memory(void* addr, size_t size, int device, MemoryLocation loc);
  // Waits until no transfer uses the region (each ends by its deadline).
  Result deregister_memory(const MemoryDesc& m);
  // The region is registered here (not deregistered meanwhile).
  bool local_registered(const MemoryDesc& m) const;

  // ---- what transfers use
  // Descriptors -> registered state (re-imports a descriptor that changed).
  StatusCode resolve(const MemoryDesc& local, const MemoryDesc& remote, MemPair& out,
                     std::string& why);
  // The pair's peer and local region are still the registered ones.
  bool alive(const MemPair& pair) const;
  // "" when `backend` holds handles for the pair's peer and remote region, else why not.
  std::string unusable(const MemPair& pair, const std::string& backend) const;
  struct Handles {
    void* peer = nullptr;
    void* local = nullptr;
    void* remote = nullptr;
  };
  // The backends the pair's peer, local and remote region offer, copied under
  // the lock (attach() adds to them): what routing reads.
  struct Advertised {
    std::set<std::string> peer, local, remote;
  };
  Advertised advertised(const MemPair& pair) const;
  // How many routes the transfer lifecycle keeps for local region `local_id`
  // in the remote imports (tests: deregistering a region drops them).
  size_t cached_routes_of(uint64_t local_id) const;
  // The backend's handles for one attempt. Call with the backend's life lock
  // held shared: the calls that free handles hold it unique.
  bool handles(const MemPair& pair, const std::string& backend, Handles& out) const;

  // ---- backends coming and going
  // Tells a newly started backend about the peers and memory registered so far.
  void attach(const BackendPtr& b);
  // Releases every handle `b` made (its life lock held unique by the caller).
  void detach(const BackendPtr& b);

 private:
  std::shared_ptr<RemoteMem> import_remote(const std::shared_ptr<PeerEntry>& peer,
                                           const MemoryDesc& d);
  void release_remote(const std::shared_ptr<RemoteMem>& r);
  // For each loaded backend: take its handle out of `handles` (under mu_) and
  // hand it to release(backend, handle), holding the backend's life lock.
  template <class Release>
  void release_handles(HandleTable& handles, Release release);
  // fn(RemoteMem&) for every import, current and retired, with its route_mu
  // held (call with mu_ held).
  template <class Fn>
  void for_each_import_routes(Fn fn) const;

  const std::string self_key_;
  const uint64_t self_instance_;
  const std::string node_id_;
  BackendSet& backends_;

  mutable std::shared_mutex mu_;  // the maps below and every handles map in them
  std::map<std::string, std::shared_ptr<PeerEntry>> peers_;
  std::unordered_map<uint64_t, std::shared_ptr<LocalMem>> local_mems_;
  // By (engine key, region id); found with the caller's key as a string_view,
  // so a post does not copy the key to look its region up.
  struct RemoteKeyLess {
    using is_transparent = void;
    template <class A, class B>
    bool operator()(const A& a, const B& b) const {
      return std::string_view(a.first) < std::string_view(b.first) ||
             (std::string_view(a.first) == std::string_view(b.first) && a.second < b.second);
    }
  };
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<RemoteMem>, RemoteKeyLess>
      remote_mems_;
  // Imports replaced by a newer descriptor, kept until their peer goes away.
  std::multimap<std::string, std::shared_ptr<RemoteMem>> retired_remote_mems_;
  // Why keys removed with a reason went (until registered again); bounded.
  std::map<std::string, std::string> gone_why_;
  static constexpr size_t kMaxGoneReasons = 1024;
};

// What a plugin is told about a peer and about a local region (pointers borrowed
// from the descriptor, valid while it lives).
ferry_peer_v1 peer_view(const EngineDesc& d, bool same_host, const std::vector<uint8_t>& blob);
ferry_mem_v1 mem_view(const LocalMem& m);

// Plugin error codes -> the user's status codes, and their names (host_services.cpp).
StatusCode status_from_plugin(int rc);
std::string plugin_error_name(int rc);

}  // namespace ferry
