// SPDX-License-Identifier: Apache-2.0
// The plugin instances loaded in one engine, in load order, and the ones removed
// (kept by name so a fence asked later can tell "removed" from "never loaded").
// Private state behind its own lock; callers get snapshots and keep a Backend
// alive by its shared_ptr.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "duration_model.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "latency_histogram.h"
#include "plugin_loader.h"

namespace ferry {

class EngineImpl;
class HostLink;

struct BackendCounters {
  std::atomic<uint64_t> bytes{0}, transfers{0}, failures{0}, failovers{0}, quarantines{0};
  // complete() calls for no attempt the plugin holds: a second completion of
  // one transfer, or a context the core never gave it (an ABI breach).
  std::atomic<uint64_t> stray_completions{0};
  TransferMetrics metrics;  // by op and size class, for /metrics
};

struct Attempt;

// The attempts a plugin holds - posted, not completed yet - by the id it was
// handed as xfer_ctx. complete() takes its attempt out of here: a second
// completion of one transfer, one after the attempt ended, or a garbage
// context finds nothing, and no freed memory is read (xfer_ctx used to be
// the attempt's address, read again by a second complete() after the first
// had freed it). Sharded: completions of different transfers rarely meet.
// Each shard is an open-addressed array (linear probing, deletion by
// shifting back), so a post allocates nothing once the shard has room: a
// hash map's node was one allocation per transfer on the post path.
class AttemptTable {
 public:
  // id != 0 (attempt ids start at 1 or later: Transfers::first_attempt_id).
  void put(uint64_t id, std::shared_ptr<Attempt> a);
  // nullptr for an id not held (0, garbage, taken already).
  std::shared_ptr<Attempt> take(uint64_t id);
  // Everything still held (the backend was removed).
  std::vector<std::shared_ptr<Attempt>> take_all();
  size_t size() const;

 private:
  static constexpr size_t kShards = 16;
  struct Slot {
    uint64_t id = 0;  // 0: free
    std::shared_ptr<Attempt> a;
  };
  struct Shard {
    mutable std::mutex mu;
    std::vector<Slot> slots;  // a power of two, or none yet; at most half used
    size_t used = 0;
    size_t home(uint64_t id) const;
    void resize(size_t cap);
  };
  Shard& shard(uint64_t id) { return shards_[(id ^ (id >> 17)) % kShards]; }
  std::array<Shard, kShards> shards_;
};

// One loaded plugin instance in this engine.
struct Backend {
  std::string name;
  std::shared_ptr<PluginLibrary> lib;
  const ferry_plugin_ops_v1* ops = nullptr;
  void* ctx = nullptr;
  uint64_t caps = 0;
  bool has_progress = false;  // ABI 1.6 progress(): waiters drive its completions
  std::vector<uint8_t> conn_blob;
  HostLink* link = nullptr;  // the plugin's host table; outlives this (host_link.h)
  EngineImpl* engine = nullptr;
  std::shared_ptr<BackendCounters> counters;  // survive a remove / add of the name
  AttemptTable attempts;                      // what the plugin holds (xfer_ctx -> attempt)
  DurationModel durations;                    // how long its recent transfers took, for waiters
  // Calls into the plugin hold `life` shared; removal holds it unique and sets
  // `removed`, so nothing reaches a plugin instance after fini().
  std::shared_mutex life;
  bool removed = false;

  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;
  ~Backend();  // detaches the link (a backend whose init or conn_info failed)
};
using BackendPtr = std::shared_ptr<Backend>;

class BackendSet {
 public:
  std::vector<BackendPtr> snapshot() const;  // load order
  BackendPtr find(const std::string& name) const;
  // A backend of that name was loaded and removed (and not loaded again).
  BackendPtr find_retired(const std::string& name) const;
  bool has(const std::string& name) const { return find(name) != nullptr; }
  // Name and capabilities in load order, what the router ranks among.
  std::vector<std::pair<std::string, uint64_t>> loaded() const;
  // Changes whenever a backend is added or removed (cached routes check it).
  uint64_t generation() const { return generation_.load(std::memory_order_acquire); }
  // The counters kept for a name across its loads.
  std::shared_ptr<BackendCounters> counters_for(const std::string& name);
  std::map<std::string, BackendStats> counter_values() const;
  // Every name's counters (for /metrics, which also reads the histograms).
  std::map<std::string, std::shared_ptr<BackendCounters>> all_counters() const;
  void add(const BackendPtr& b);
  // Takes it out of the set and keeps it as retired; nullptr when not loaded.
  BackendPtr remove(const std::string& name);

 private:
  mutable std::shared_mutex mu_;
  std::vector<BackendPtr> loaded_;
  std::map<std::string, BackendPtr> retired_;
  std::map<std::string, std::shared_ptr<BackendCounters>> counters_;
  std::atomic<uint64_t> generation_{0};
};

}  // namespace ferry
