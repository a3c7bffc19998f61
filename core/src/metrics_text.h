// SPDX-License-Identifier: Apache-2.0
// The Prometheus text exposition (format 0.0.4) of one engine's counters:
// what /metrics serves (metrics_server.h). Names follow Prometheus
// conventions: ferry_ prefix, base units (bytes, seconds), _total on
// counters, labels for backend / op / size class.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "backend_set.h"
#include "ferry/ferry.hpp"

namespace ferry {

// The metadata store's own numbers (metadata_sync.h), when one is configured.
struct MetadataCounts {
  uint64_t watched_peers = 0;   // peers fetched from the store and followed
  uint64_t peers_expired = 0;   // deregistered because their lease expired / key went
  uint64_t peers_replaced = 0;  // a new instance picked up under a known key
  uint64_t store_errors = 0;    // requests to the store that failed
  bool store_up = false;        // the last request (or keep-alive) reached the store
};

struct MetricsInput {
  std::string engine_key;
  EngineStats stats;
  std::map<std::string, std::shared_ptr<BackendCounters>> counters;
  uint64_t inbound_pending = 0;  // inbound statuses waiting to be popped
  std::optional<MetadataCounts> metadata;
};

std::string render_prometheus(const MetricsInput& in);

// A label value escaped as the format wants (\\, \", \n).
std::string prometheus_label_escape(const std::string& v);

}  // namespace ferry
