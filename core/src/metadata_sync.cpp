// SPDX-License-Identifier: Apache-2.0
#include "metadata_sync.h"

#include <cstdio>
#include <cstdlib>

#include "log.h"
#include "policy.h"
#include "thread_name.h"

namespace ferry {

namespace {

std::string hex(int64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t c = s.find(',', start);
    if (c == std::string::npos) c = s.size();
    std::string item = s.substr(start, c - start);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (!item.empty()) out.push_back(item);
    start = c + 1;
  }
  return out;
}

// Keep-alives three times per lease period, so two may be lost in a row.
std::chrono::milliseconds keepalive_period(std::chrono::milliseconds lease) {
  return std::max(std::chrono::milliseconds(100), lease / 3);
}

// Each endpoint's share of a keep-alive period (at least 250 ms, at most the
// usual 3 s): tried in turn, all of them answer or fail within about one period.
std::chrono::milliseconds keepalive_timeout(std::chrono::milliseconds lease, size_t endpoints) {
  const auto share = keepalive_period(lease) / static_cast<long>(std::max<size_t>(1, endpoints));
  return std::clamp(share, std::chrono::milliseconds(250), std::chrono::milliseconds(3000));
}

// How often the watch asks its endpoint a question beside the stream (a
// frozen member keeps the stream's connection up): as often as keep-alives,
// and no more than once a second.
std::chrono::milliseconds watch_probe_period(std::chrono::milliseconds lease) {
  return std::max(std::chrono::milliseconds(1000), keepalive_period(lease));
}

std::string packed(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

}  // namespace

std::optional<MetadataSync::Config> metadata_config(const MetadataConfig& engine,
                                                    const MetadataConfig& policy) {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? v : "";
  };
  MetadataSync::Config c;
  c.endpoints = engine.etcd;
  if (c.endpoints.empty()) c.endpoints = split_commas(env("FERRY_ETCD_ENDPOINTS"));
  if (c.endpoints.empty()) c.endpoints = policy.etcd;
  if (c.endpoints.empty()) return std::nullopt;
  c.ns = !engine.ns.empty()                     ? engine.ns
         : !env("FERRY_ETCD_NAMESPACE").empty() ? env("FERRY_ETCD_NAMESPACE")
         : !policy.ns.empty()                   ? policy.ns
                                                : "ferry";
  c.lease = engine.lease;
  if (c.lease.count() <= 0 && !env("FERRY_ETCD_LEASE").empty()) {
    auto d = parse_duration(env("FERRY_ETCD_LEASE"));
    if (!d || d->count() <= 0)
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "FERRY_ETCD_LEASE: bad duration '" + env("FERRY_ETCD_LEASE") + "' (e.g. 10s)");
    c.lease = *d;
  }
  if (c.lease.count() <= 0) c.lease = policy.lease;
  if (c.lease.count() <= 0) c.lease = std::chrono::seconds(10);
  // etcd refuses TTLs under its minimum (1.5 s with default settings) by
  // raising them; whole seconds only.
  if (c.lease < std::chrono::seconds(2))
    throw Error(StatusCode::ERR_INVALID_ARGS, "metadata lease must be at least 2s, got " +
                                                  std::to_string(c.lease.count()) + "ms");
  for (const auto& e : c.endpoints)
    if (e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0)
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "etcd endpoint must start with http:// or https://, got '" + e + "'");
  return c;
}

std::string MetadataSync::escape_key(const std::string& k) {
  std::string out;
  for (char c : k) {
    if (c == '%')
      out += "%25";
    else if (c == '/')
      out += "%2F";
    else
      out += c;
  }
  return out;
}

std::string MetadataSync::engine_path(const std::string& k) const {
  return config_.ns + "/" + escape_key(k) + "/engine";
}

std::string MetadataSync::mem_path(const std::string& k, const std::string& name) const {
  return config_.ns + "/" + escape_key(k) + "/mem/" + name;
}

MetadataSync::MetadataSync(Config config, std::string self_key, Hooks hooks)
    : config_(std::move(config)),
      self_key_(std::move(self_key)),
      hooks_(std::move(hooks)),
      client_(config_.endpoints),
      keepalive_client_(config_.endpoints,
                        keepalive_timeout(config_.lease, config_.endpoints.size())),
      watch_client_(config_.endpoints) {
  pubs_[engine_path(self_key_)] = packed(hooks_.self_desc().pack());
  {
    std::lock_guard lk(pub_mu_);
    Result r = ensure_lease_locked();
    if (note(r))
      FERRY_LOG(WARN, self_key_,
                "metadata store: " + r.message + "; publishing when it answers (retried)");
  }
  keeper_ = ferry::named_thread("ferry-md-keep", [this] { keeper(); });
  watcher_ = ferry::named_thread("ferry-md-watch", [this] { watcher(); });
}

MetadataSync::~MetadataSync() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  // Requests in progress end too (within about a second), not after the
  // store's timeout on every endpoint and every followed peer.
  watch_client_.interrupt();
  keepalive_client_.interrupt();
  client_.interrupt();
  keeper_.join();
  watcher_.join();
  // Leave at once rather than when the lease runs out: peers following this
  // engine deregister it now. Best effort, with a short bound.
  std::lock_guard lk(pub_mu_);
  if (lease_ != 0) {
    etcd::Client quick(config_.endpoints, std::chrono::milliseconds(500));
    quick.revoke(lease_);
  }
}

bool MetadataSync::stopping() const {
  std::lock_guard lk(mu_);
  return stop_;
}

bool MetadataSync::note(const Result& r) {
  std::lock_guard lk(mu_);
  const bool was_up = counts_.store_up;
  if (r.code == StatusCode::ERR_TRANSPORT) {
    ++counts_.store_errors;
    counts_.store_up = false;
    // The first failure after the store answered is logged; the retries are
    // counted (ferry_metadata_store_errors_total), not logged one by one.
    return was_up || counts_.store_errors == 1;
  }
  if (r.ok() && !was_up) {
    counts_.store_up = true;
    if (counts_.store_errors > 0) FERRY_LOG(WARN, self_key_, "metadata store: reachable again");
  }
  return false;
}

Result MetadataSync::ensure_lease_locked() {
  if (lease_ != 0) return {};
  int64_t id = 0;
  const auto ttl = std::chrono::duration_cast<std::chrono::seconds>(config_.lease +
                                                                    std::chrono::milliseconds(999));
  if (Result r = client_.grant(ttl, id); !r) return r;
  for (const auto& [k, v] : pubs_)
    if (Result r = client_.put(k, v, id); !r) {
      client_.revoke(id);
      return r;
    }
  lease_ = id;
  FERRY_LOG(INFO, self_key_,
            "metadata store: published " + engine_path(self_key_) + " under lease " + hex(id));
  return {};
}

void MetadataSync::keeper() {
  std::unique_lock lk(mu_);
  while (!stop_) {
    // Watch events also notify cv_: wait for the period itself, not any wake-up.
    const auto due = std::chrono::steady_clock::now() + keepalive_period(config_.lease);
    if (cv_.wait_until(lk, due, [&] { return stop_; })) return;
    lk.unlock();
    Result r;
    {
      std::lock_guard pl(pub_mu_);
      if (lease_ != 0) {
        int64_t ttl = 0;
        r = keepalive_client_.keepalive(lease_, ttl);
        if (r && ttl <= 0) {
          // The store let it expire (we were cut off longer than the lease):
          // our keys are gone and peers deregistered us; publish afresh.
          FERRY_LOG(WARN, self_key_,
                    "metadata store: lease " + hex(lease_) + " expired; publishing again");
          lease_ = 0;
        }
      }
      if (r && lease_ == 0) r = ensure_lease_locked();
    }
    if (stopping()) return;  // a request cut by the shutdown is no store failure
    if (note(r)) FERRY_LOG(WARN, self_key_, "metadata store: " + r.message + " (retried)");
    lk.lock();
  }
}

void MetadataSync::republish_self() {
  std::lock_guard pl(pub_mu_);
  const std::string k = engine_path(self_key_);
  pubs_[k] = packed(hooks_.self_desc().pack());
  Result r = lease_ != 0 ? client_.put(k, pubs_[k], lease_) : ensure_lease_locked();
  if (note(r))
    FERRY_LOG(WARN, self_key_, "metadata store: " + r.message + " (published when it answers)");
}

Result MetadataSync::publish_memory(const std::string& name, const MemoryDesc& mem) {
  if (name.empty() || name.size() > 255)
    return {StatusCode::ERR_INVALID_ARGS, "memory name must be 1..255 bytes"};
  if (mem.engine_key != self_key_)
    return {StatusCode::ERR_INVALID_ARGS,
            "memory of engine '" + mem.engine_key + "' is not this engine's to publish"};
  std::lock_guard pl(pub_mu_);
  Result r = ensure_lease_locked();
  const std::string k = mem_path(self_key_, name);
  const std::string v = packed(mem.pack());
  if (r) r = client_.put(k, v, lease_);
  note(r);
  if (r) pubs_[k] = v;
  return r;
}

Result MetadataSync::unpublish_memory(const std::string& name) {
  std::lock_guard pl(pub_mu_);
  const std::string k = mem_path(self_key_, name);
  if (pubs_.erase(k) == 0)
    return {StatusCode::ERR_NOT_FOUND, "no memory published here as '" + name + "'"};
  Result r = client_.remove(k);
  note(r);
  return r;
}

Result MetadataSync::get_waiting(const std::string& path, std::chrono::milliseconds wait,
                                 std::optional<etcd::KeyValue>& kv) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    uint64_t gen;
    {
      std::lock_guard lk(mu_);
      gen = generation_;
    }
    Result r = client_.get(path, kv);
    note(r);
    if (!r) return r;
    if (kv) return {};
    // Absent: wait for a watch event (any PUT in the namespace) or re-ask
    // every 200 ms should the watch be reconnecting.
    std::unique_lock lk(mu_);
    if (std::chrono::steady_clock::now() >= deadline || stop_)
      return {StatusCode::ERR_NOT_FOUND, "'" + path + "' is not in the metadata store"};
    cv_.wait_until(
        lk, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::milliseconds(200)),
        [&] { return stop_ || generation_ != gen; });
  }
}

Result MetadataSync::fetch_engine(const std::string& key, std::chrono::milliseconds wait) {
  if (key == self_key_) return {StatusCode::ERR_INVALID_ARGS, "'" + key + "' is this engine"};
  // Followed before the store is read: a delete (or a newer descriptor) the
  // watch delivers while the answer is on its way is recorded, and wins over
  // the answer. (Inserted after the read, a peer that left in between was
  // registered and never deregistered.)
  {
    std::lock_guard lk(mu_);
    ++peers_[key].fetching;
  }
  std::optional<etcd::KeyValue> kv;
  Result r = get_waiting(engine_path(key), wait, kv);
  EngineDesc d;
  if (r) {
    try {
      d = EngineDesc::unpack(std::vector<uint8_t>(kv->value.begin(), kv->value.end()));
      if (d.key != key)
        r = {StatusCode::ERR_INVALID_ARGS,
             "'" + engine_path(key) + "' holds the descriptor of engine '" + d.key + "'"};
    } catch (const Error& e) {
      r = {StatusCode::ERR_INVALID_ARGS,
           "'" + engine_path(key) + "' holds no valid engine descriptor: " + e.what()};
    }
  }
  {
    std::lock_guard lk(mu_);
    Peer& p = peers_[key];
    --p.fetching;
    if (r && p.revision > kv->mod_revision) {
      if (p.instance != 0) return {};  // the watch registered something newer
      // The watch saw the key deleted after what the store answered.
      r = {StatusCode::ERR_NOT_FOUND,
           "engine '" + key + "' left the metadata store while it was being fetched"};
    }
    if (!r) {
      // Not followed after all, unless another fetch is at it or it was registered once.
      if (p.instance == 0 && p.last_instance == 0 && p.fetching == 0) peers_.erase(key);
      return r;
    }
    if (p.last_instance != 0 && p.last_instance != d.instance) ++counts_.peers_replaced;
    p.revision = kv->mod_revision;
    p.lease = kv->lease;
    p.instance = p.last_instance = d.instance;
  }
  return hooks_.register_peer(d);
}

std::optional<MemoryDesc> MetadataSync::fetch_memory(const std::string& key,
                                                     const std::string& name,
                                                     std::chrono::milliseconds wait, Result* why) {
  std::optional<etcd::KeyValue> kv;
  Result r = get_waiting(mem_path(key, name), wait, kv);
  if (why) *why = r;
  if (!r) return std::nullopt;
  try {
    MemoryDesc m = MemoryDesc::unpack(std::vector<uint8_t>(kv->value.begin(), kv->value.end()));
    if (m.engine_key != key)
      throw Error(StatusCode::ERR_INVALID_ARGS, "it names engine '" + m.engine_key + "'");
    return m;
  } catch (const Error& e) {
    if (why)
      *why = {StatusCode::ERR_INVALID_ARGS,
              "'" + mem_path(key, name) + "' holds no valid memory descriptor: " + e.what()};
    return std::nullopt;
  }
}

std::optional<std::string> MetadataSync::engine_key_of(const std::string& path) const {
  const std::string head = config_.ns + "/";
  static const std::string tail = "/engine";
  if (path.size() <= head.size() + tail.size() || path.compare(0, head.size(), head) != 0 ||
      path.compare(path.size() - tail.size(), tail.size(), tail) != 0)
    return std::nullopt;
  const std::string esc = path.substr(head.size(), path.size() - head.size() - tail.size());
  std::string key;
  for (size_t i = 0; i < esc.size(); ++i) {
    if (esc[i] == '/') return std::nullopt;  // a deeper key (e.g. mem/<name>/engine)
    if (esc[i] == '%' && esc.compare(i, 3, "%25") == 0) {
      key += '%';
      i += 2;
    } else if (esc[i] == '%' && esc.compare(i, 3, "%2F") == 0) {
      key += '/';
      i += 2;
    } else {
      key += esc[i];
    }
  }
  return key;
}

std::function<void()> MetadataSync::apply(const std::string& key,
                                          const std::optional<etcd::KeyValue>& kv,
                                          int64_t revision) {
  std::lock_guard lk(mu_);
  auto it = peers_.find(key);
  if (it == peers_.end()) return {};
  Peer& p = it->second;
  if (!kv) {
    if (revision <= p.revision) return {};  // stale news
    if (p.instance == 0) {  // gone already, or not registered yet (fetch_engine reads it)
      p.revision = revision;
      return {};
    }
    const std::string why = "engine '" + key + "' left the metadata store: its key " +
                            engine_path(key) + " was deleted (etcd lease " + hex(p.lease) +
                            " expired or was revoked: the engine stopped, died or lost the store)";
    p.instance = 0;
    p.revision = revision;
    ++counts_.peers_expired;
    return [this, key, why] { hooks_.deregister_peer(key, why); };
  }
  if (kv->mod_revision <= p.revision) return {};
  EngineDesc d;
  try {
    d = EngineDesc::unpack(std::vector<uint8_t>(kv->value.begin(), kv->value.end()));
  } catch (const Error& e) {
    FERRY_LOG(WARN, self_key_, "metadata store: ignoring " + engine_path(key) + ": " + e.what());
    return {};
  }
  if (d.key != key) return {};
  // A new instance under the key (a restart); the same one coming back after
  // its key was deleted (its lease expired while it lived) is no replacement.
  if (p.last_instance != 0 && p.last_instance != d.instance) ++counts_.peers_replaced;
  p.revision = kv->mod_revision;
  p.lease = kv->lease;
  p.instance = p.last_instance = d.instance;
  return [this, d] {
    Result r = hooks_.register_peer(d);
    if (!r)
      FERRY_LOG(WARN, self_key_,
                "metadata store: could not register engine '" + d.key + "': " + r.message);
  };
}

bool MetadataSync::on_watch(const etcd::WatchMessage& m, bool& resync) {
  if (m.compact_revision > 0 || m.canceled) {
    resync = true;  // history we asked for is gone: read the current state instead
    return false;
  }
  std::vector<std::function<void()>> actions;
  for (const auto& e : m.events) {
    auto key = engine_key_of(e.kv.key);
    if (!key) continue;
    auto a = e.is_delete ? apply(*key, std::nullopt, e.kv.mod_revision)
                         : apply(*key, e.kv, e.kv.mod_revision);
    if (a) actions.push_back(std::move(a));
  }
  for (auto& a : actions) a();
  {
    std::lock_guard lk(mu_);
    if (!m.events.empty()) ++generation_;
    if (stop_) return false;
  }
  cv_.notify_all();
  return true;
}

void MetadataSync::watcher() {
  auto backoff = std::chrono::milliseconds(100);
  for (;;) {
    if (stopping()) return;
    // (Re)connected: first what the store holds now for every followed peer
    // (a key that went while the stream was down is gone now), then the
    // stream from that revision on.
    std::vector<std::string> keys;
    {
      std::lock_guard lk(mu_);
      for (const auto& [k, p] : peers_) keys.push_back(k);
    }
    int64_t revision = 0;
    Result r;
    std::vector<std::function<void()>> actions;
    for (const auto& k : keys) {
      if (stopping()) return;
      std::optional<etcd::KeyValue> kv;
      int64_t rev = 0;
      r = client_.get(engine_path(k), kv, &rev);
      if (!r) break;
      if (revision == 0 || rev < revision) revision = rev;
      if (auto a = apply(k, kv, rev)) actions.push_back(std::move(a));
    }
    if (r && keys.empty()) {
      std::optional<etcd::KeyValue> kv;
      r = client_.get(config_.ns + "/", kv, &revision);
    }
    for (auto& a : actions) a();
    if (stopping()) return;  // a request cut by the shutdown is no store failure
    bool log_it = note(r);
    if (r) {
      bool resync = false, streamed = false;
      r = watch_client_.watch(
          config_.ns + "/", revision + 1,
          [&](const etcd::WatchMessage& m) {
            streamed = true;
            return on_watch(m, resync);
          },
          watch_probe_period(config_.lease));
      // A stream that ran (or asked for a resync) is retried soon; one refused
      // at once backs off like an unreachable store, never a tight loop.
      if (streamed) backoff = std::chrono::milliseconds(100);
      if (!r) log_it = note(r) || log_it;
    }
    if (!r && log_it)
      FERRY_LOG(WARN, self_key_,
                "metadata store: " + r.message + " (retried; known peers stay registered)");
    std::unique_lock lk(mu_);
    if (stop_) return;
    cv_.wait_for(lk, backoff, [&] { return stop_; });
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }
}

MetadataCounts MetadataSync::counts() const {
  std::lock_guard lk(mu_);
  MetadataCounts c = counts_;
  c.watched_peers = peers_.size();
  return c;
}

}  // namespace ferry
