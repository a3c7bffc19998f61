// SPDX-License-Identifier: Apache-2.0
#include "backend_set.h"

#include <algorithm>
#include <mutex>

#include "host_link.h"
#include "hot_path.h"

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

FERRY_HOT size_t AttemptTable::Shard::home(uint64_t id) const {
  // Fibonacci hashing: consecutive ids (one shard sees every 16th or so)
  // spread over the array.
  return static_cast<size_t>((id * 0x9E3779B97F4A7C15ULL) >> 32) & (slots.size() - 1);
}

void AttemptTable::Shard::resize(size_t cap) {
  std::vector<Slot> old(cap);
  old.swap(slots);
  for (Slot& o : old) {
    if (o.id == 0) continue;
    size_t i = home(o.id);
    while (slots[i].id != 0) i = (i + 1) & (slots.size() - 1);
    slots[i] = std::move(o);
  }
}

FERRY_HOT void AttemptTable::put(uint64_t id, std::shared_ptr<Attempt> a) {
  Shard& s = shard(id);
  std::lock_guard<std::mutex> lk(s.mu);
  if (2 * (s.used + 1) > s.slots.size()) s.resize(std::max<size_t>(16, 2 * s.slots.size()));
  size_t i = s.home(id);
  while (s.slots[i].id != 0 && s.slots[i].id != id) i = (i + 1) & (s.slots.size() - 1);
  if (s.slots[i].id == 0) ++s.used;
  s.slots[i] = {id, std::move(a)};
}

FERRY_HOT std::shared_ptr<Attempt> AttemptTable::take(uint64_t id) {
  if (id == 0) return nullptr;
  Shard& s = shard(id);
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.used == 0) return nullptr;
  const size_t mask = s.slots.size() - 1;
  size_t i = s.home(id);
  while (s.slots[i].id != id) {
    if (s.slots[i].id == 0) return nullptr;
    i = (i + 1) & mask;
  }
  std::shared_ptr<Attempt> a = std::move(s.slots[i].a);
  // Deletion without tombstones: each slot after the hole, up to the next free
  // one, moves into the hole unless its home lies cyclically in (hole, slot].
  for (size_t j = (i + 1) & mask; s.slots[j].id != 0; j = (j + 1) & mask) {
    const size_t h = s.home(s.slots[j].id);
    const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
    if (stays) continue;
    s.slots[i] = std::move(s.slots[j]);
    i = j;
  }
  s.slots[i] = {};
  --s.used;
  // A burst of transfers in flight leaves a big array: give most of it back.
  if (s.slots.size() > 1024 && 8 * s.used < s.slots.size()) s.resize(s.slots.size() / 4);
  return a;
}

std::vector<std::shared_ptr<Attempt>> AttemptTable::take_all() {
  std::vector<std::shared_ptr<Attempt>> out;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mu);
    for (Slot& o : s.slots)
      if (o.id != 0) out.push_back(std::move(o.a));
    s.slots.clear();
    s.used = 0;
  }
  return out;
}

size_t AttemptTable::size() const {
  size_t n = 0;
  for (const Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mu);
    n += s.used;
  }
  return n;
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
