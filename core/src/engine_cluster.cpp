// SPDX-License-Identifier: Apache-2.0
// Running an engine in a cluster (issue 21): the Prometheus endpoint and the
// metadata store, joined to the engine's parts, and their public calls.
#include <cstdlib>

#include "engine_impl.h"
#include "metrics_text.h"

namespace ferry {

void EngineImpl::start_cluster_services() {
  std::string addr = config_.metrics_address;
  if (addr.empty())
    if (const char* env = std::getenv("FERRY_METRICS_ADDR"); env && *env) addr = env;
  if (!addr.empty()) {
    metrics_server_ = std::make_unique<MetricsServer>(addr, [this] { return render_metrics(); });
    FERRY_LOG(INFO, key_,
              "Prometheus metrics on http://" + metrics_server_->address() + "/metrics");
  }
  if (auto mc = metadata_config(config_.metadata, policy_.metadata)) {
    MetadataSync::Hooks h;
    h.self_desc = [this] { return desc(); };
    h.register_peer = [this](const EngineDesc& d) { return register_remote_engine(d); };
    h.deregister_peer = [this](const std::string& k, const std::string& why) {
      deregister_gone_peer(k, why);
    };
    metadata_ = std::make_unique<MetadataSync>(std::move(*mc), key_, std::move(h));
  }
}

std::string EngineImpl::metrics_address() const {
  return metrics_server_ ? metrics_server_->address() : std::string();
}

std::string EngineImpl::render_metrics() const {
  MetricsInput in;
  in.engine_key = key_;
  in.stats = stats();
  in.counters = backends_.all_counters();
  in.inbound_pending = inbound_.pending();
  if (metadata_) in.metadata = metadata_->counts();
  return render_prometheus(in);
}

void EngineImpl::deregister_gone_peer(const std::string& key, const std::string& why) {
  std::lock_guard lk(peers_mu_);
  if (deregister_peer(key, PeerFences::PARK, why).ok())
    FERRY_LOG(WARN, key_, why + ": deregistered");
}

// ---- the public calls ------------------------------------------------------------

namespace {
Result no_store() {
  return {StatusCode::ERR_BAD_STATE,
          "no metadata store configured (EngineConfig::metadata, FERRY_ETCD_ENDPOINTS or the "
          "policy's metadata: etcd:)"};
}
}  // namespace

std::string Engine::metrics_address() const { return impl_->metrics_address(); }
bool Engine::has_metadata_store() const { return impl_->metadata() != nullptr; }

Result Engine::publish_memory(const std::string& name, const MemoryDesc& mem) {
  return impl_->metadata() ? impl_->metadata()->publish_memory(name, mem) : no_store();
}

Result Engine::unpublish_memory(const std::string& name) {
  return impl_->metadata() ? impl_->metadata()->unpublish_memory(name) : no_store();
}

Result Engine::fetch_remote_engine(const std::string& key, std::chrono::milliseconds wait) {
  return impl_->metadata() ? impl_->metadata()->fetch_engine(key, wait) : no_store();
}

std::optional<MemoryDesc> Engine::fetch_memory(const std::string& key, const std::string& name,
                                               std::chrono::milliseconds wait, Result* why) {
  if (!impl_->metadata()) {
    if (why) *why = no_store();
    return std::nullopt;
  }
  return impl_->metadata()->fetch_memory(key, name, wait, why);
}

}  // namespace ferry
