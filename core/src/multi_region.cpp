// SPDX-License-Identifier: Apache-2.0
// Engine::transfer over many regions, and prepared lists (ferry.hpp): both end
// in Transfers::submit_groups with one part per (local region, remote region).
// A prepared list checks its slices once and keeps, per region pair it has
// been posted with, the resolved pair, so a post costs per index, not per
// list entry or region descriptor.

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

// Groups items by region pair, in one pass over the items: each item's pair
// found (the last pair's group first, then a flat table by region indices, or
// an open-addressing table where the region lists are long),
// its ranges checked, the item written in call order. Items that come pair
// by pair - a connector's layer after layer, the usual order - are then
// already grouped, and the list goes to the transfer as it is. Only when a
// pair comes back after another one does the grouper note each item's group
// and, at the end, write the items into one list, group after group (a second
// pass). One list, each group's items together, is what a multi-pair post
// (plugin ABI 1.7) hands the backend. Each group's region sizes sit beside
// its index (reaching them through the pair was two dependent loads an item).
class Grouper {
 public:
  Grouper(size_t n_local, size_t n_remote, size_t n_items) : n_remote_(n_remote) {
    if (n_local * n_remote <= kFlatMax)
      flat_.assign(n_local * n_remote, -1);
    else
      slots_.resize(kFirstSlots);
    staged_.resize(n_items);
  }
  // The group of (l, r), or nullptr before add().
  Transfers::Group* find(size_t l, size_t r) {
    if (l == last_l_ && r == last_r_) return &groups[last_];
    if (!flat_.empty()) {
      const int32_t at = flat_[l * n_remote_ + r];
      if (at < 0) return nullptr;
      remember(l, r, static_cast<size_t>(at));
      return &groups[last_];
    }
    const uint64_t key = uint64_t{l} << 32 | r;
    for (size_t at = slot_of(key);; at = (at + 1) & (slots_.size() - 1)) {
      const Slot& e = slots_[at];
      if (e.group == kEmpty) return nullptr;
      if (e.key == key) {
        remember(l, r, e.group);
        return &groups[last_];
      }
    }
  }
  // `trusted`: its ranges need no check per item (a prepared list's entries
  // that fit the registered regions).
  Transfers::Group& add(size_t l, size_t r, MemPair pair, bool trusted = false) {
    const size_t at = groups.size();
    if (!flat_.empty()) {
      flat_[l * n_remote_ + r] = static_cast<int32_t>(at);
    } else {
      if (2 * (at + 1) > slots_.size()) grow();
      place(uint64_t{l} << 32 | r, static_cast<uint32_t>(at));
    }
    groups.push_back({std::move(pair), 0, 0, 0});
    const MemPair& p = groups.back().pair;
    fits_.push_back({p.local->desc.size, p.remote->desc.size, trusted});
    remember(l, r, at);
    return groups.back();
  }
  // The group find/add returned last: its region sizes, and whether its ranges
  // need no check (a prepared list's entries that fit the registered regions).
  struct Fit {
    uint64_t local, remote;
    bool trusted;
  };
  const Fit& fit() const { return fits_[last_]; }
  // Where the caller writes item i's ranges (in call order).
  ferry_iov_v1* staged() { return staged_.data(); }
  // Ends the run of items [first, end) of the group find/add returned last
  // (their lengths summing to `bytes`; `bad`: one of them is outside its
  // regions): "" once it is noted, else why its first bad item is refused,
  // named by its number in the call.
  std::string EndRun(size_t first, size_t end, uint64_t bytes, bool bad) {
    const Fit& m = fits_[last_];
    if (bad && !m.trusted) {
      size_t k = first;
      while (range_fits(staged_[k].local_off, staged_[k].remote_off, staged_[k].len, m.local,
                        m.remote))
        ++k;
      return Transfers::check_items(groups[last_].pair, &staged_[k], 1, &k);
    }
    NoteRun(first, end, bytes);
    return {};
  }
  // Each group's place; `iov` every item, group after group.
  void Fill() {
    size_t first = 0;
    for (auto& g : groups) {
      g.first = first;
      first += g.n;
    }
    if (in_order_) {
      iov = std::move(staged_);
      return;
    }
    std::vector<ferry_iov_v1*> next(groups.size());
    iov.resize(staged_.size());
    for (size_t gi = 0; gi < groups.size(); ++gi) next[gi] = iov.data() + groups[gi].first;
    const size_t n = staged_.size();
    for (size_t i = 0; i < n; ++i) *next[group_of_[i]]++ = staged_[i];
  }
  std::vector<Transfers::Group> groups;
  IovList iov;  // after Fill: every item, grouped

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  static constexpr size_t kFirstSlots = 128;   // room for 64 pairs before it grows
  static constexpr size_t kFlatMax = 1 << 16;  // region lists up to this product: a flat table
  struct Slot {
    uint64_t key = 0;
    uint32_t group = kEmpty;
  };
  size_t slot_of(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> 40) & (slots_.size() - 1);
  }
  void place(uint64_t key, uint32_t group) {
    size_t at = slot_of(key);
    while (slots_[at].group != kEmpty) at = (at + 1) & (slots_.size() - 1);
    slots_[at] = {key, group};
  }
  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    for (const Slot& e : old)
      if (e.group != kEmpty) place(e.key, e.group);
  }
  // Items [i, j) of the group find/add returned last, `bytes` long together,
  // are counted. The first run of the newest group keeps the order; a group's
  // second run (its pair came back after another) ends it.
  void NoteRun(size_t i, size_t j, uint64_t bytes) {
    Transfers::Group& g = groups[last_];
    g.n += j - i;
    g.bytes += bytes;
    if (in_order_ && last_ + 1 == groups.size() && g.n == j - i) return;
    if (in_order_) Unsort(j - i);
    for (size_t k = i; k < j; ++k) group_of_[k] = static_cast<uint32_t>(last_);
  }
  void remember(size_t l, size_t r, size_t at) {
    last_l_ = l;
    last_r_ = r;
    last_ = at;
  }
  // A run of `run` items belongs to a pair that came before another: from
  // here every item notes its group. Those before the run came pair by pair,
  // each group's items together, in group order (the run is counted already).
  void Unsort(size_t run) {
    in_order_ = false;
    group_of_.resize(staged_.size());
    size_t at = 0;
    for (size_t gi = 0; gi < groups.size(); ++gi)
      for (size_t n = groups[gi].n - (gi == last_ ? run : 0); n > 0; --n)
        group_of_[at++] = static_cast<uint32_t>(gi);
  }
  IovList staged_;         // per item, in call order
  std::vector<Fit> fits_;  // per group
  const size_t n_remote_;
  std::vector<int32_t> flat_;  // group by local * n_remote + remote, -1 none (small lists)
  std::vector<Slot> slots_;    // else (local, remote) -> group, open addressing
  // Out of order only: each item's group.
  std::vector<uint32_t, UninitAllocator<uint32_t>> group_of_;
  bool in_order_ = true;  // items so far came pair by pair
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
  ferry_iov_v1* out = g.staged();
  // One pass. The items of a run (the same pair as the item before: a layer's
  // blocks, as connectors post them) are copied, checked and summed in the
  // short branch; a new pair closes the run and finds (or resolves) its group.
  size_t l = SIZE_MAX, r = SIZE_MAX, run = 0;  // the run: its pair, its first item
  Transfers::Group* grp = nullptr;
  Grouper::Fit f{0, 0, false};
  uint64_t bytes = 0;
  bool bad = false;
  auto close = [&](size_t end) { return g.EndRun(run, end, bytes, bad); };
  for (size_t i = 0; i < n_items; ++i) {
    const TransferItem& it = item[i];
    if (it.local != l || it.remote != r) {
      if (grp)
        if (std::string why = close(i); !why.empty())
          return failed(StatusCode::ERR_INVALID_ARGS, why);
      if (it.local >= n_local || it.remote >= n_remote)
        return failed(StatusCode::ERR_INVALID_ARGS,
                      "item " + std::to_string(i) + " names region " +
                          std::to_string(it.local >= n_local ? it.local : it.remote) + " of " +
                          std::to_string(it.local >= n_local ? n_local : n_remote) +
                          (it.local >= n_local ? " local" : " remote") + " regions");
      grp = g.find(it.local, it.remote);
      if (!grp) {
        MemPair pair;
        std::string why;
        StatusCode c = impl_->registry().resolve(local_regions[it.local], remote_regions[it.remote],
                                                 pair, why);
        if (c != StatusCode::SUCCESS) return failed(c, "item " + std::to_string(i) + ": " + why);
        grp = &g.add(it.local, it.remote, std::move(pair));
      }
      l = it.local;
      r = it.remote;
      run = i;
      f = g.fit();
      bytes = 0;
      bad = false;
    }
    out[i] = {it.local_offset, it.remote_offset, it.size};
    bytes += it.size;
    bad |= !range_fits(it.local_offset, it.remote_offset, it.size, f.local, f.remote);
  }
  if (std::string why = close(n_items); !why.empty())
    return failed(StatusCode::ERR_INVALID_ARGS, why);
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
  // Our own regions are looked up now (a remote list's are the peer's to
  // check: it refuses an unknown one when a transfer uses it).
  for (size_t i = 0; impl->local && i < regions.size(); ++i) {
    if (!impl_->registry().local_registered(regions[i]))
      throw Error(StatusCode::ERR_NOT_FOUND, "region " + std::to_string(i) + " (memory " +
                                                 std::to_string(regions[i].id) +
                                                 ") is not registered with this engine");
  }
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
  ferry_iov_v1* out = g.staged();
  const uint64_t n_lentries = L.entries.size(), n_rentries = R.entries.size();
  const ListEntry* lentry = L.entries.data();
  const ListEntry* rentry = R.entries.data();
  // One pass, a run at a time, as for items (Engine::transfer above).
  size_t lr = SIZE_MAX, rr = SIZE_MAX, run = 0;
  Transfers::Group* grp = nullptr;
  Grouper::Fit f{0, 0, false};
  uint64_t bytes = 0;
  bool bad = false;
  auto close = [&](size_t end) { return g.EndRun(run, end, bytes, bad); };
  // An item refused for its indices or sizes: a bad range earlier in the run
  // going on is named first (the first bad item of the call).
  auto refuse = [&](size_t i, std::string why) {
    if (grp && bad && !f.trusted) why = close(i);
    return failed(StatusCode::ERR_INVALID_ARGS, why);
  };
  // The first item of a run takes the checks and the group lookup below; the
  // items after it that stay in the same region pair go through the tight
  // loop at the end, whose state is local (the lambdas above keep theirs in
  // memory: a store per item, 6 ns an item of 10,000 where this takes ~3).
  for (size_t i = 0; i < n;) {
    if (li[i] < 0 || static_cast<uint64_t>(li[i]) >= n_lentries || ri[i] < 0 ||
        static_cast<uint64_t>(ri[i]) >= n_rentries)
      return refuse(i, "item " + std::to_string(i) + ": index " + std::to_string(li[i]) + " / " +
                           std::to_string(ri[i]) + " outside the lists (" +
                           std::to_string(L.entries.size()) + " local, " +
                           std::to_string(R.entries.size()) + " remote entries)");
    const ListEntry& le = lentry[li[i]];
    const ListEntry& re = rentry[ri[i]];
    if (le.size != re.size)
      return refuse(i, "item " + std::to_string(i) + ": local entry " + std::to_string(li[i]) +
                           " is " + std::to_string(le.size) + " bytes, remote entry " +
                           std::to_string(ri[i]) + " " + std::to_string(re.size));
    if (le.region != lr || re.region != rr) {
      if (grp)
        if (std::string why = close(i); !why.empty())
          return failed(StatusCode::ERR_INVALID_ARGS, why);
      grp = g.find(le.region, re.region);
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
        // or forged descriptor): else every range is checked, item by item.
        const bool trusted = L.regions[le.region].size <= pair.local->desc.size &&
                             R.regions[re.region].size <= pair.remote->desc.size;
        grp = &g.add(le.region, re.region, std::move(pair), trusted);
      }
      lr = le.region;
      rr = re.region;
      run = i;
      f = g.fit();
      bytes = 0;
      bad = false;
    }
    // This item and those after it in the same pair; an item that is not
    // (another pair, a bad index or unequal sizes) goes round the outer loop.
    const uint64_t fl = f.local, fr = f.remote, run_l = lr, run_r = rr;
    uint64_t b = bytes;
    bool bd = bad;
    size_t j = i;
    const ListEntry* a = &le;
    const ListEntry* z = &re;
    for (;;) {
      out[j] = {a->offset, z->offset, a->size};
      b += a->size;
      bd |= !range_fits(a->offset, z->offset, a->size, fl, fr);
      if (++j == n) break;
      // Unsigned: a negative index is a huge one, outside the list.
      const auto nl = static_cast<uint64_t>(li[j]), nr = static_cast<uint64_t>(ri[j]);
      if (nl >= n_lentries || nr >= n_rentries) break;
      a = lentry + nl;
      z = rentry + nr;
      if (a->size != z->size || a->region != run_l || z->region != run_r) break;
    }
    bytes = b;
    bad = bd;
    i = j;
  }
  if (std::string why = close(n); !why.empty()) return failed(StatusCode::ERR_INVALID_ARGS, why);
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
