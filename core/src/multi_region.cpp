// SPDX-License-Identifier: Apache-2.0
// Engine::transfer over many regions, and prepared lists (ferry.hpp): both end
// in Transfers::submit_groups with one part per (local region, remote region).
// A prepared list checks its slices once and keeps, per region pair it has
// been posted with, the resolved pair, so a post costs per index, not per
// list entry or region descriptor.
#include <unordered_map>

#include "engine_impl.h"

namespace ferry {

struct PreparedList::Impl {
  EngineImpl* engine = nullptr;
  bool local = true;
  std::string engine_key;
  std::vector<MemoryDesc> regions;
  std::vector<ListEntry> entries;
  // Remote lists: resolved pairs by (local region id, remote region index).
  std::mutex mu;
  std::map<std::pair<uint64_t, size_t>, MemPair> pairs;
};

size_t PreparedList::size() const { return impl_->entries.size(); }
bool PreparedList::local() const { return impl_->local; }
const std::string& PreparedList::engine_key() const { return impl_->engine_key; }

namespace {

TransferStatus failed(StatusCode code, std::string msg) {
  TransferStatus s;
  s.Finish(code, std::move(msg));
  return s;
}

// Groups items by region pair: a flat table when the two region lists are
// small (the common case: a few dozen layers), a hash map otherwise. Two
// passes: the first finds each item's group (Note) and counts, the second
// (Fill) writes the items into one list, group after group, each group's
// items together - growing 64 vectors item by item, and an item-number array
// beside each for error messages, was most of a 10,000-item post's 22 ns an
// item; one list is what a multi-pair post (plugin ABI 1.7) hands the
// backend as it is. Each group's region sizes sit beside its index (reaching
// them through the pair was two dependent loads an item).
class Grouper {
 public:
  Grouper(size_t n_local, size_t n_remote, size_t n_items) : n_remote_(n_remote) {
    if (n_local * n_remote <= kFlatMax) flat_.assign(n_local * n_remote, -1);
    group_of_.resize(n_items);
    staged_.resize(n_items);
  }
  // The group of (l, r), or nullptr before add().
  Transfers::Group* find(size_t l, size_t r) {
    if (l == last_l_ && r == last_r_) return &groups[last_];
    int64_t at = -1;
    if (!flat_.empty()) {
      at = flat_[l * n_remote_ + r];
    } else if (auto it = index_.find(uint64_t{l} << 32 | r); it != index_.end()) {
      at = static_cast<int64_t>(it->second);
    }
    if (at < 0) return nullptr;
    remember(l, r, static_cast<size_t>(at));
    return &groups[last_];
  }
  // `trusted`: its ranges need no check per item (a prepared list's entries
  // that fit the registered regions).
  Transfers::Group& add(size_t l, size_t r, MemPair pair, bool trusted = false) {
    const size_t at = groups.size();
    if (!flat_.empty())
      flat_[l * n_remote_ + r] = static_cast<int32_t>(at);
    else
      index_.emplace(uint64_t{l} << 32 | r, at);
    groups.push_back({std::move(pair), 0, 0, 0});
    const MemPair& p = groups.back().pair;
    limits_.push_back({p.local->desc.size, p.remote->desc.size, trusted});
    counts_.push_back(0);
    remember(l, r, at);
    return groups.back();
  }
  // Whether the ranges of an item of the group find/add returned last fit its
  // regions (always, for a trusted group).
  bool fits(uint64_t lo, uint64_t ro, uint64_t len) const {
    const Limits& m = limits_[last_];
    return m.trusted || range_fits(lo, ro, len, m.local, m.remote);
  }
  // Item i, ranges v, belongs to the group find/add returned last. Its ranges
  // are kept in call order, so Fill reads them in one sequential pass (a
  // prepared list's entries, read again by index, were a second random pass).
  void Note(size_t i, const ferry_iov_v1& v) {
    group_of_[i] = static_cast<uint32_t>(last_);
    staged_[i] = v;
    ++counts_[last_];
  }
  // Writes every noted item into `iov`, group after group, and each group's
  // place and bytes into it. With one group the staged list is the list.
  void Fill() {
    const size_t n = staged_.size();
    if (groups.size() == 1) {
      uint64_t bytes = 0;
      for (size_t i = 0; i < n; ++i) bytes += staged_[i].len;
      groups[0].n = n;
      groups[0].bytes = bytes;
      iov = std::move(staged_);
      return;
    }
    std::vector<ferry_iov_v1*> next(groups.size());
    iov.resize(n);
    size_t first = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      groups[gi].first = first;
      groups[gi].n = counts_[gi];
      next[gi] = iov.data() + first;
      first += counts_[gi];
    }
    std::vector<uint64_t> bytes(groups.size());
    for (size_t i = 0; i < n; ++i) {
      const uint32_t g = group_of_[i];
      *next[g]++ = staged_[i];
      bytes[g] += staged_[i].len;
    }
    for (size_t gi = 0; gi < groups.size(); ++gi) groups[gi].bytes = bytes[gi];
  }
  std::vector<Transfers::Group> groups;
  IovList iov;  // after Fill: every item, grouped

 private:
  static constexpr size_t kFlatMax = 1 << 16;
  void remember(size_t l, size_t r, size_t at) {
    last_l_ = l;
    last_r_ = r;
    last_ = at;
  }
  const size_t n_remote_;
  std::vector<uint32_t, UninitAllocator<uint32_t>> group_of_;  // per item, each set by Note
  IovList staged_;                                             // per item, in call order
  std::vector<size_t> counts_;                                 // per group
  struct Limits {
    uint64_t local, remote;  // region sizes
    bool trusted;
  };
  std::vector<Limits> limits_;  // per group
  std::vector<int32_t> flat_;   // group index by (local, remote), -1 none
  std::unordered_map<uint64_t, size_t> index_;
  size_t last_l_ = SIZE_MAX, last_r_ = SIZE_MAX, last_ = 0;
};

}  // namespace

TransferStatus Engine::transfer(Op op, const std::vector<MemoryDesc>& local_regions,
                                const std::vector<MemoryDesc>& remote_regions,
                                const std::vector<TransferItem>& items, TransferUid uid,
                                std::optional<bool> notify, std::optional<std::string> message) {
  if (items.empty()) return failed(StatusCode::ERR_INVALID_ARGS, "empty transfer");
  if (local_regions.size() > UINT32_MAX || remote_regions.size() > UINT32_MAX)
    return failed(StatusCode::ERR_INVALID_ARGS, "too many regions");
  if (items.size() > UINT32_MAX) return failed(StatusCode::ERR_INVALID_ARGS, "too many items");
  // The counts read once: through the vectors they were a division an item.
  const size_t n_local = local_regions.size(), n_remote = remote_regions.size();
  const size_t n_items = items.size();
  const TransferItem* item = items.data();
  Grouper g(n_local, n_remote, n_items);
  for (size_t i = 0; i < n_items; ++i) {
    const TransferItem& it = item[i];
    if (it.local >= n_local || it.remote >= n_remote)
      return failed(StatusCode::ERR_INVALID_ARGS,
                    "item " + std::to_string(i) + " names region " +
                        std::to_string(it.local >= local_regions.size() ? it.local : it.remote) +
                        " of " +
                        std::to_string(it.local >= local_regions.size() ? local_regions.size()
                                                                        : remote_regions.size()) +
                        (it.local >= local_regions.size() ? " local" : " remote") + " regions");
    Transfers::Group* grp = g.find(it.local, it.remote);
    if (!grp) {
      MemPair pair;
      std::string why;
      StatusCode c =
          impl_->registry().resolve(local_regions[it.local], remote_regions[it.remote], pair, why);
      if (c != StatusCode::SUCCESS) return failed(c, "item " + std::to_string(i) + ": " + why);
      grp = &g.add(it.local, it.remote, std::move(pair));
    }
    // Checked here, so an error names the item by its number in the call.
    const uint64_t lo = it.local_offset, ro = it.remote_offset, len = it.size;
    if (!g.fits(lo, ro, len)) {
      const ferry_iov_v1 v{lo, ro, len};
      return failed(StatusCode::ERR_INVALID_ARGS, Transfers::check_items(grp->pair, &v, 1, &i));
    }
    g.Note(i, {lo, ro, len});
  }
  g.Fill();
  return impl_->transfers().submit_groups(std::move(g.groups), std::move(g.iov), op, uid, notify,
                                          std::move(message));
}

PreparedList Engine::prepare_list(const std::vector<MemoryDesc>& regions,
                                  const std::vector<ListEntry>& entries) {
  if (regions.empty() || entries.empty())
    throw Error(StatusCode::ERR_INVALID_ARGS, "a prepared list needs regions and entries");
  auto impl = std::make_shared<PreparedList::Impl>();
  impl->engine = impl_.get();
  impl->engine_key = regions.front().engine_key;
  impl->local = impl->engine_key == impl_->key_;
  for (size_t i = 0; i < regions.size(); ++i) {
    const MemoryDesc& m = regions[i];
    if (m.engine_key != impl->engine_key)
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "a prepared list's regions are of one engine: region " + std::to_string(i) +
                      " is of '" + m.engine_key + "', region 0 of '" + impl->engine_key + "'");
  }
  if (!impl->local && !impl_->registry().peer_instance(impl->engine_key))
    throw Error(StatusCode::ERR_NOT_FOUND,
                "remote engine '" + impl->engine_key + "' is not registered");
  for (size_t i = 0; i < entries.size(); ++i) {
    const ListEntry& e = entries[i];
    if (e.region >= regions.size())
      throw Error(StatusCode::ERR_INVALID_ARGS, "entry " + std::to_string(i) + " names region " +
                                                    std::to_string(e.region) + " of " +
                                                    std::to_string(regions.size()));
    const uint64_t size = regions[e.region].size;
    if (e.size == 0 || e.offset > size || e.size > size - e.offset)
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "entry " + std::to_string(i) + ": [" + std::to_string(e.offset) + ", +" +
                      std::to_string(e.size) + ") is not inside region " +
                      std::to_string(e.region) + " of " + std::to_string(size) + " bytes");
  }
  impl->regions = regions;
  impl->entries = entries;
  return PreparedList(std::move(impl));
}

TransferStatus Engine::transfer(Op op, const PreparedList& local, const int64_t* li,
                                const PreparedList& remote, const int64_t* ri, size_t n,
                                TransferUid uid, std::optional<bool> notify,
                                std::optional<std::string> message) {
  PreparedList::Impl& L = *local.impl();
  PreparedList::Impl& R = *remote.impl();
  if (L.engine != impl_.get() || R.engine != impl_.get())
    return failed(StatusCode::ERR_INVALID_ARGS, "a prepared list of another engine");
  if (!L.local || R.local)
    return failed(StatusCode::ERR_INVALID_ARGS,
                  "prepared lists: the first must be local, the second remote");
  if (n == 0) return failed(StatusCode::ERR_INVALID_ARGS, "empty transfer");
  if (n > UINT32_MAX) return failed(StatusCode::ERR_INVALID_ARGS, "too many items");
  Grouper g(L.regions.size(), R.regions.size(), n);
  const uint64_t n_lentries = L.entries.size(), n_rentries = R.entries.size();
  const ListEntry* lentry = L.entries.data();
  const ListEntry* rentry = R.entries.data();
  for (size_t i = 0; i < n; ++i) {
    if (li[i] < 0 || static_cast<uint64_t>(li[i]) >= n_lentries || ri[i] < 0 ||
        static_cast<uint64_t>(ri[i]) >= n_rentries)
      return failed(StatusCode::ERR_INVALID_ARGS,
                    "item " + std::to_string(i) + ": index " + std::to_string(li[i]) + " / " +
                        std::to_string(ri[i]) + " outside the lists (" +
                        std::to_string(L.entries.size()) + " local, " +
                        std::to_string(R.entries.size()) + " remote entries)");
    const ListEntry& le = lentry[li[i]];
    const ListEntry& re = rentry[ri[i]];
    if (le.size != re.size)
      return failed(StatusCode::ERR_INVALID_ARGS,
                    "item " + std::to_string(i) + ": local entry " + std::to_string(li[i]) +
                        " is " + std::to_string(le.size) + " bytes, remote entry " +
                        std::to_string(ri[i]) + " " + std::to_string(re.size));
    Transfers::Group* grp = g.find(le.region, re.region);
    if (!grp) {
      MemPair pair;
      const auto key = std::make_pair(L.regions[le.region].id, re.region);
      {
        std::lock_guard<std::mutex> lk(R.mu);
        if (auto it = R.pairs.find(key); it != R.pairs.end()) pair = it->second;
      }
      // A cached pair stays good while its peer and local region are the ones registered.
      if (!pair.peer || pair.peer->gone || !impl_->registry().alive(pair)) {
        std::string why;
        StatusCode c =
            impl_->registry().resolve(L.regions[le.region], R.regions[re.region], pair, why);
        if (c != StatusCode::SUCCESS) return failed(c, "item " + std::to_string(i) + ": " + why);
        std::lock_guard<std::mutex> lk(R.mu);
        R.pairs[key] = pair;
      }
      // Entries were checked against the caller's descriptor when prepared; that
      // holds for the registered region only if its size is no larger (a stale
      // or forged descriptor): else every range is checked below, item by item.
      const bool trusted = L.regions[le.region].size <= pair.local->desc.size &&
                           R.regions[re.region].size <= pair.remote->desc.size;
      grp = &g.add(le.region, re.region, std::move(pair), trusted);
    }
    if (!g.fits(le.offset, re.offset, le.size)) {  // an error names the item by its number
      const ferry_iov_v1 v{le.offset, re.offset, le.size};
      return failed(StatusCode::ERR_INVALID_ARGS, Transfers::check_items(grp->pair, &v, 1, &i));
    }
    g.Note(i, {le.offset, re.offset, le.size});
  }
  g.Fill();
  return impl_->transfers().submit_groups(std::move(g.groups), std::move(g.iov), op, uid, notify,
                                          std::move(message));
}

TransferStatus Engine::transfer(Op op, const PreparedList& local,
                                const std::vector<int64_t>& local_indices,
                                const PreparedList& remote,
                                const std::vector<int64_t>& remote_indices, TransferUid uid,
                                std::optional<bool> notify, std::optional<std::string> message) {
  if (local_indices.size() != remote_indices.size())
    return failed(StatusCode::ERR_INVALID_ARGS, "index arrays differ in length");
  return transfer(op, local, local_indices.data(), remote, remote_indices.data(),
                  local_indices.size(), uid, notify, std::move(message));
}

}  // namespace ferry
