// SPDX-License-Identifier: Apache-2.0
// The engine's life in a metadata store (etcd): what it publishes and which
// peers it follows. Keys (docs/operations.md):
//   {ns}/{engine key}/engine       the packed EngineDesc
//   {ns}/{engine key}/mem/{name}   a packed MemoryDesc published by name
// ('/' and '%' in an engine key are written %2F and %25), all under one lease
// this engine keeps alive (keeper thread). A peer fetched here is followed
// (watch thread, one stream over {ns}/): its key deleted - its lease expired,
// the engine died or was cut off from the store, or it closed - deregisters
// it through the engine's own path, with a reason naming the lease; a new
// descriptor under the key (a restarted instance) is registered in its place.
//
// The store being unreachable is never a reason to deregister anyone: calls
// return ERR_TRANSPORT naming the endpoint, the threads retry, and transfers
// between engines that know each other go on. Only the store saying a key is
// gone deregisters.
#pragma once
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "etcd_client.h"
#include "ferry/ferry.hpp"
#include "metrics_text.h"

namespace ferry {

class MetadataSync {
 public:
  struct Config {
    std::vector<std::string> endpoints;
    std::string ns = "ferry";
    std::chrono::milliseconds lease{10000};
  };
  // What the engine lends: its descriptor, and its own peer (de)registration.
  struct Hooks {
    std::function<EngineDesc()> self_desc;
    std::function<Result(const EngineDesc&)> register_peer;
    std::function<void(const std::string& key, const std::string& why)> deregister_peer;
  };
  // Starts both threads; a store that cannot be reached now is retried (the
  // error is logged and counted), so an engine starts while etcd is down.
  MetadataSync(Config config, std::string self_key, Hooks hooks);
  ~MetadataSync();  // stops the threads, then revokes the lease (its keys go)
  MetadataSync(const MetadataSync&) = delete;
  MetadataSync& operator=(const MetadataSync&) = delete;

  // The engine's descriptor changed (a backend added or removed): publish it again.
  void republish_self();
  Result publish_memory(const std::string& name, const MemoryDesc& mem);
  Result unpublish_memory(const std::string& name);
  Result fetch_engine(const std::string& key, std::chrono::milliseconds wait);
  std::optional<MemoryDesc> fetch_memory(const std::string& key, const std::string& name,
                                         std::chrono::milliseconds wait, Result* why);
  MetadataCounts counts() const;
  const Config& config() const { return config_; }

  // Key layout, public for tests and tools.
  static std::string escape_key(const std::string& engine_key);
  std::string engine_path(const std::string& engine_key) const;
  std::string mem_path(const std::string& engine_key, const std::string& name) const;

 private:
  struct Peer {
    int64_t revision = 0;  // mod revision of what was last applied
    int64_t lease = 0;
    uint64_t instance = 0;       // 0: gone (deregistered; a new instance is awaited), or not yet
    uint64_t last_instance = 0;  // the instance registered last, kept while gone
    // fetch_engine calls reading the store for it before it is followed:
    // the watch already records what happens to its key meanwhile.
    int fetching = 0;
  };
  void keeper();
  void watcher();
  // Grant a lease and put every publication under it; pub_mu_ held.
  Result ensure_lease_locked();
  // Apply what the store says about a followed peer's engine key (nullopt:
  // absent); returns the action to run outside mu_.
  std::function<void()> apply(const std::string& key, const std::optional<etcd::KeyValue>& kv,
                              int64_t revision);
  bool on_watch(const etcd::WatchMessage& m, bool& resync);
  std::optional<std::string> engine_key_of(const std::string& path) const;
  Result get_waiting(const std::string& path, std::chrono::milliseconds wait,
                     std::optional<etcd::KeyValue>& kv);
  // Counts a request's outcome; true when a failure should be logged.
  bool note(const Result& r);
  bool stopping() const;  // the destructor has begun

  const Config config_;
  const std::string self_key_;
  const Hooks hooks_;
  etcd::Client client_;
  // Keep-alives only: one endpoint's timeout is a share of the keep-alive
  // period, so a frozen member costs the lease one period, not the lease.
  etcd::Client keepalive_client_;
  etcd::Client watch_client_;  // its own: interrupt() ends only the watch

  std::mutex pub_mu_;  // the lease and what is published under it
  int64_t lease_ = 0;
  std::map<std::string, std::string> pubs_;  // etcd key -> value, put under lease_

  mutable std::mutex mu_;  // followed peers, counters, stop
  std::condition_variable cv_;
  std::map<std::string, Peer> peers_;
  uint64_t generation_ = 0;  // bumped by every watch event: fetch waiters re-ask
  MetadataCounts counts_;
  bool stop_ = false;

  std::thread keeper_, watcher_;
};

// EngineConfig::metadata, else FERRY_ETCD_ENDPOINTS / _NAMESPACE / _LEASE, else
// the policy's `metadata:`; nullopt when no endpoint is named anywhere.
std::optional<MetadataSync::Config> metadata_config(const MetadataConfig& engine,
                                                    const MetadataConfig& policy);

}  // namespace ferry
