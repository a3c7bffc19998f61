// SPDX-License-Identifier: Apache-2.0
#include "backend_set.h"

#include <algorithm>
#include <mutex>

#include "host_link.h"

namespace ferry {

Backend::~Backend() {
  if (link) link->detach();
}

std::vector<BackendPtr> BackendSet::snapshot() const {
  std::shared_lock lk(mu_);
  return loaded_;
}

BackendPtr BackendSet::find(const std::string& name) const {
  std::shared_lock lk(mu_);
  for (const auto& b : loaded_)
    if (b->name == name) return b;
  return nullptr;
}

BackendPtr BackendSet::find_retired(const std::string& name) const {
  std::shared_lock lk(mu_);
  auto it = retired_.find(name);
  return it == retired_.end() ? nullptr : it->second;
}

std::vector<std::pair<std::string, uint64_t>> BackendSet::loaded() const {
  std::shared_lock lk(mu_);
  std::vector<std::pair<std::string, uint64_t>> out;
  out.reserve(loaded_.size());
  for (const auto& b : loaded_) out.emplace_back(b->name, b->caps);
  return out;
}

std::shared_ptr<BackendCounters> BackendSet::counters_for(const std::string& name) {
  std::unique_lock lk(mu_);
  auto& c = counters_[name];
  if (!c) c = std::make_shared<BackendCounters>();
  return c;
}

void AttemptTable::put(uint64_t id, std::shared_ptr<Attempt> a) {
  Shard& s = shard(id);
  std::lock_guard<std::mutex> lk(s.mu);
  s.held[id] = std::move(a);
}

std::shared_ptr<Attempt> AttemptTable::take(uint64_t id) {
  Shard& s = shard(id);
  std::lock_guard<std::mutex> lk(s.mu);
  auto it = s.held.find(id);
  if (it == s.held.end()) return nullptr;
  std::shared_ptr<Attempt> a = std::move(it->second);
  s.held.erase(it);
  return a;
}

std::vector<std::shared_ptr<Attempt>> AttemptTable::take_all() {
  std::vector<std::shared_ptr<Attempt>> out;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mu);
    for (auto& [id, a] : s.held) out.push_back(std::move(a));
    s.held.clear();
  }
  return out;
}

std::map<std::string, BackendStats> BackendSet::counter_values() const {
  std::shared_lock lk(mu_);
  std::map<std::string, BackendStats> out;
  for (const auto& [name, c] : counters_) {
    BackendStats& s = out[name];
    s.bytes = c->bytes;
    s.transfers = c->transfers;
    s.failures = c->failures;
    s.failovers = c->failovers;
    s.quarantines = c->quarantines;
    s.stray_completions = c->stray_completions;
  }
  return out;
}

std::map<std::string, std::shared_ptr<BackendCounters>> BackendSet::all_counters() const {
  std::shared_lock lk(mu_);
  return counters_;
}

void BackendSet::add(const BackendPtr& b) {
  std::unique_lock lk(mu_);
  retired_.erase(b->name);
  loaded_.push_back(b);
  generation_.fetch_add(1, std::memory_order_acq_rel);
}

BackendPtr BackendSet::remove(const std::string& name) {
  std::unique_lock lk(mu_);
  auto it = std::find_if(loaded_.begin(), loaded_.end(),
                         [&](const BackendPtr& x) { return x->name == name; });
  if (it == loaded_.end()) return nullptr;
  BackendPtr b = *it;
  loaded_.erase(it);
  retired_[name] = b;
  generation_.fetch_add(1, std::memory_order_acq_rel);
  return b;
}

}  // namespace ferry
