// SPDX-License-Identifier: Apache-2.0
// The routing policy: which backends, in which order, for which transfer; how
// to fail over; how long a transfer may take. Loaded from YAML (policy_yaml.cpp)
// or built in (builtin_policy()).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"

namespace ferry {

// What a rule matches on: a transfer to a peer.
struct RouteQuery {
  std::string peer_key;
  std::string peer_host;
  bool same_host = false;
  MemoryLocation local = MemoryLocation::CPU;
  MemoryLocation remote = MemoryLocation::CPU;
  uint64_t bytes = 0;
  Op op = Op::WRITE;
};

struct PolicyRule {
  std::optional<std::string> peer;  // glob on the engine key
  std::optional<std::string> host;  // glob on the peer's host
  std::optional<bool> same_host;
  std::optional<MemoryLocation> local, remote;
  std::optional<uint64_t> min_bytes, max_bytes;  // inclusive range
  std::optional<Op> op;
  std::vector<std::string> prefer;
  // Backends that cannot check a request on the target side (FERRY_CAP_NO_TARGET_CHECK,
  // e.g. cma) are used by this rule only when it names them and sets this.
  bool trust_descriptors = false;
  int line = 0;  // where it was written (0 = built in)

  bool matches(const RouteQuery& q) const;
};

struct QuarantinePolicy {
  uint32_t after_failures = 3;                   // this many failures ...
  std::chrono::milliseconds within{10000};       // ... within this window ...
  std::chrono::milliseconds period{30000};       // ... quarantine for this long,
  std::chrono::milliseconds max_period{300000};  // doubling per relapse up to this.
};

struct Policy {
  std::string source = "built-in";
  std::vector<std::string> plugin_dirs;
  std::map<std::string, std::string> backend_settings;  // name -> JSON object text
  std::vector<PolicyRule> rules;
  uint32_t max_attempts = 3;
  QuarantinePolicy quarantine;
  std::chrono::milliseconds timeout{30000};
  // The longest duration a policy or EngineConfig may set: deadlines are
  // now + duration on the steady clock, which a duration of centuries wraps
  // (a transfer would then be past its deadline at once).
  static constexpr std::chrono::milliseconds kMaxDuration = std::chrono::hours(168);
  // Whether a transfer notifies its target when the call does not say
  // (`notify:` in the file; EngineConfig::notify wins). A client that never pops
  // inbound statuses turns it off once.
  bool notify = true;
  // `metadata:` (etcd endpoints, namespace, lease); EngineConfig::metadata and
  // FERRY_ETCD_* win (metadata_sync.h).
  MetadataConfig metadata;

  // Where a rule's byte range starts or ends (min_bytes, max_bytes + 1),
  // sorted: between two of them the bytes change no rule's answer, so a route
  // is the same for every size in one band (the route cache's key).
  std::vector<uint64_t> size_breaks() const;
  // Index of the first rule that matches, or -1.
  int match(const RouteQuery& q) const;
  // Settings JSON for a backend ("{}" when none).
  std::string settings_for(const std::string& backend) const;
};

// One rule preferring xgmi, rdma, ofi, tcp, then any other loaded backend.
Policy builtin_policy();
// The order in which the built-in policy ranks known backends.
const std::vector<std::string>& builtin_backend_order();

// Parse a policy. Throws ferry::Error(ERR_INVALID_ARGS) whose message starts with
// "<source>:<line>:<column>: " and names the bad key or value. Never half-applies.
Policy parse_policy(const std::string& yaml_text, const std::string& source_name);
Policy load_policy_file(const std::string& path);

// Glob with * and ? (no classes).
bool glob_match(const std::string& pattern, const std::string& text);

// "64KiB" / "1MiB" / "4096" -> bytes; "30s" / "250ms" / "5m" -> duration.
std::optional<uint64_t> parse_size(const std::string& s);
std::optional<std::chrono::milliseconds> parse_duration(const std::string& s);

}  // namespace ferry
