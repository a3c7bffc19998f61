// SPDX-License-Identifier: Apache-2.0
// The life of a transfer, decided here and nowhere else: validate, resolve,
// route, pass the target's fence gate, post, and then by the attempt's outcome:
//   success            -> SUCCESS (after the core's notification, if it owes one);
//   target's refusal   -> that error at once: no failover, no health penalty;
//   failed, nothing can land later (nothing sent, a READ, an initiator-side copy)
//                      -> count it against the backend, re-run the whole transfer
//                         on the next backend while the attempt budget lasts;
//   WRITE, outcome unknown (deadline, lost connection)
//                      -> fence the target (fence.h): its answer decides -
//                         all landed: SUCCESS; none or part: as above; no answer
//                         by the deadline: ERR_OUTCOME_UNKNOWN, the peer fenced.
// The final error names every attempt. Everything ends by the transfer's
// deadline (submit + policy timeout). Peers and memory are the registry's: a
// transfer gets its pair from Registry::resolve() and keeps it.
#include "transfer.h"

#include <algorithm>
#include <chrono>

#include "control_plane.h"
#include "hot_path.h"
#include "item_pass.h"
#include "log.h"
#include "router.h"

namespace ferry {

namespace {

// The core's watchdog fires this long after the plugin's own deadline, so a
// plugin reports its own (more precise) timeout first when it works properly.
// Of a transfer's time, this part is kept back from its attempts, so that after an
// attempt that timed out the fence (and a failover) still fit before the deadline.
std::chrono::milliseconds fence_reserve(std::chrono::milliseconds timeout) {
  return std::clamp(timeout / 4, std::chrono::milliseconds(10), std::chrono::milliseconds(1000));
}

uint64_t to_ns(std::chrono::steady_clock::time_point t) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
}

// The target said no (not registered, out of bounds, stale): the application's
// error, not the backend's - no failover, no quarantine.
bool is_refusal(int status) {
  return status == FERRY_ERR_REMOTE || status == FERRY_ERR_NOT_FOUND ||
         status == FERRY_ERR_INVALID_ARGS;
}

// Whether the core, not the plugin, tells the target of this landed transfer:
// a plugin's own notification (NATIVE_NOTIFY) covers READ only with
// NATIVE_NOTIFY_READ (plugin.h).
bool core_notifies(const Transfer& t, uint64_t caps) {
  if (!(t.flags & FERRY_XFER_NOTIFY)) return false;
  const uint64_t native = t.op == FERRY_OP_READ
                              ? FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_NATIVE_NOTIFY_READ
                              : FERRY_CAP_NATIVE_NOTIFY;
  return (caps & native) != native;
}

void add_history(std::string& h, const std::string& entry) {
  h += std::string(h.empty() ? "" : "; ") + entry;
}

TransferStatus failed(StatusCode code, std::string msg) {
  TransferStatus s;
  s.Finish(code, std::move(msg));
  return s;
}

// A transfer's local region is in use from its start to its end: a
// deregistration waits for it (Registry, `inflight`).
void release(LocalMem& m) {
  if (--m.inflight != 0 || !m.draining) return;
  std::lock_guard<std::mutex> lk(m.mu);  // the deregistration waits or is about to
  m.idle.notify_all();
}
// False once its deregistration began: a session (or a call that looked the
// region up a moment ago) may still hold the region, and a hold taken after
// the deregistration saw no transfer would let this one move bytes after
// deregister_memory() returned. Count, then look: both seq_cst, as the
// deregistration sets draining, then looks at the count - either it waits
// for this transfer or this transfer sees it draining.
bool hold(LocalMem& m) {
  ++m.inflight;
  if (!m.draining.load()) return true;
  release(m);
  return false;
}

}  // namespace

FERRY_HOT Transfer::~Transfer() {
  if (!pair.local) return;
  if (parts.empty()) {
    release(*pair.local);
    return;
  }
  for (const PairItems& p : parts) release(*p.pair.local);
}

void Transfer::cancel() { owner->cancel(shared_from_this()); }
FERRY_HOT void Transfer::progress() { Transfers::drive_progress(shared_from_this()); }

FERRY_HOT Attempt::~Attempt() { transfer->owner->watchdog_.disarm(this); }

void Attempt::on_deadline() {
  if (settled.exchange(true)) return;
  by_watchdog = true;
  transfer->owner->attempt_done(shared_from_this(), FERRY_ERR_TIMEOUT,
                                "no completion from the backend within the deadline");
}

uint64_t Transfers::first_attempt_id() {
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::system_clock::now().time_since_epoch())
                      .count();
  return ns > 0 ? static_cast<uint64_t>(ns) : 1;
}

Transfers::Transfers(Parts parts, uint64_t self_instance)
    : self_key_(parts.self_key),
      policy_(parts.policy),
      size_breaks_(parts.policy.size_breaks()),
      health_(parts.health),
      backends_(parts.backends),
      registry_(parts.registry),
      control_(parts.control),
      messenger_(parts.control, self_instance),
      fencer_(&parts.control) {
  fencer_.set_registered([this](const std::string& key, uint64_t instance) {
    const auto registered = registry_.peer_instance(key);
    return registered && *registered == instance;
  });
}

FERRY_HOT void Transfers::complete(std::shared_ptr<Attempt> a, int status, const char* message) {
  if (a->settled.exchange(true)) {  // the watchdog already ended this attempt
    late_completion(a);
    return;
  }
  // The text may come from the peer (a tcp ERROR frame): printable, bounded.
  attempt_done(a, status, message ? printable(message, 512) : "");
}

int Transfers::size_band(uint64_t bytes) const {
  return static_cast<int>(std::upper_bound(size_breaks_.begin(), size_breaks_.end(), bytes) -
                          size_breaks_.begin());
}

FERRY_HOT Route Transfers::route_for(const MemPair& pair, Op op, uint64_t bytes, std::string& why) {
  // Cached by what the policy's answer can depend on besides the pair: the op
  // and the size band (policy.h). A hit reads no rule and copies no string: a
  // post() right after its thread woke from a long wait paid ~5 us here for
  // the policy match and its query's strings, the caches cold.
  const auto key = std::make_tuple(pair.local->desc.id, static_cast<int>(op), size_band(bytes));
  const uint64_t bgen = backends_.generation();
  const uint64_t hgen = health_.generation();
  // (The clock only where the cached route expires: a quarantine in it ends.)
  const auto never = std::chrono::steady_clock::time_point::max();
  {
    std::lock_guard<std::mutex> lk(pair.remote->route_mu);
    auto it = pair.remote->routes.find(key);
    if (it != pair.remote->routes.end() && it->second.backend_generation == bgen &&
        it->second.health_generation == hgen &&
        (it->second.valid_until == never ||
         std::chrono::steady_clock::now() < it->second.valid_until)) {
      why = it->second.why;
      return it->second.route;
    }
  }
  RouteInputs in;
  in.query.peer_key = pair.peer->desc.key;
  in.query.peer_host = pair.peer->desc.host;
  in.query.same_host = pair.peer->same_host;
  in.query.local = pair.local->desc.location;
  in.query.remote = pair.remote->desc.location;
  in.query.bytes = bytes;
  in.query.op = op;
  const auto now = std::chrono::steady_clock::now();
  CachedRoute c;
  c.backend_generation = bgen;
  c.health_generation = hgen;
  c.valid_until = never;
  // Copies: attach() may add to them meanwhile (a miss only, so not per post).
  const Registry::Advertised offered = registry_.advertised(pair);
  in.peer_backends = &offered.peer;
  in.local_mem_backends = &offered.local;
  in.remote_mem_backends = &offered.remote;
  const std::vector<BackendPtr> loaded = backends_.snapshot();
  for (const auto& b : loaded) in.loaded.emplace_back(b->name, b->caps);
  in.unusable = [&](const std::string& name) -> std::string {
    if (std::string why_not = registry_.unusable(pair, name); !why_not.empty()) return why_not;
    if (health_.state(pair.peer->desc.key, name) == Health::State::QUARANTINED) {
      auto until = health_.quarantined_until(pair.peer->desc.key, name);
      c.valid_until = std::min(c.valid_until, until);
      return "quarantined for this peer for another " +
             std::to_string(
                 std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count()) +
             " ms";
    }
    return {};
  };
  RouteDecision d = route(policy_, in);
  std::vector<BackendPtr> ranked;
  for (const auto& name : d.kept())
    for (const auto& b : loaded)
      if (b->name == name) ranked.push_back(b);
  if (ranked.empty()) c.why = "no backend can serve this transfer (" + d.dropped_summary() + ")";
  c.route = std::make_shared<const std::vector<BackendPtr>>(std::move(ranked));
  why = c.why;
  Route out = c.route;
  std::lock_guard<std::mutex> lk(pair.remote->route_mu);
  // Not for a region being deregistered: its deregistration sets draining
  // before it erases the region's routes under this lock, so a route cached
  // here after that erase would stay for good (a post racing the
  // deregistration, or a session that outlived its region).
  if (!pair.local->draining.load()) pair.remote->routes[key] = std::move(c);
  return out;
}

std::string Transfers::check_items(const MemPair& pair, const ferry_iov_v1* iov, size_t n,
                                   const size_t* item_numbers) {
  const uint64_t lsize = pair.local->desc.size, rsize = pair.remote->desc.size;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t lo = iov[i].local_off, ro = iov[i].remote_off, len = iov[i].len;
    if (range_fits(lo, ro, len, lsize, rsize)) continue;
    const std::string item = "item " + std::to_string(item_numbers ? item_numbers[i] : i);
    if (len == 0) return item + " has size 0";
    if (lo > lsize || len > lsize - lo)
      return item + ": local range [" + std::to_string(lo) + ", +" + std::to_string(len) +
             ") exceeds the local region of " + std::to_string(lsize) + " bytes";
    return item + ": remote range [" + std::to_string(ro) + ", +" + std::to_string(len) +
           ") exceeds the remote region of " + std::to_string(rsize) + " bytes";
  }
  return {};
}

FERRY_HOT TransferStatus Transfers::submit(const MemPair& pair, Op op, const size_t* local_offs,
                                           const size_t* remote_offs, const size_t* sizes, size_t n,
                                           TransferUid uid, std::optional<bool> notify,
                                           std::optional<std::string> message) {
  if (shutting_down_) return failed(StatusCode::ERR_BAD_STATE, "engine is shutting down");
  if (n == 0) return failed(StatusCode::ERR_INVALID_ARGS, "empty transfer");
  // A plugin's post() counts items in 32 bits (ferry_xfer_v1::n_iov).
  if (n > UINT32_MAX) return failed(StatusCode::ERR_INVALID_ARGS, "too many items");
  if (std::string bad = check_message_size(message ? message->size() : 0); !bad.empty())
    return failed(StatusCode::ERR_INVALID_ARGS, bad);
  // Unset: the engine's default (EngineConfig::notify, else the policy's `notify`).
  auto t = make_transfer(op, notify.value_or(policy_.notify) ? FERRY_XFER_NOTIFY : 0, uid);
  t->message = std::move(message);
  // One pass copies, checks and counts the items; the check only notes a bad
  // item, and check_items then says which and why. Three passes (append,
  // check, sum) were a 4096-item batch's ~23 us of core time on the GPU host.
  t->iov.resize(n);
  ferry_iov_v1* out = t->iov.data();
  const uint64_t lsize = pair.local->desc.size, rsize = pair.remote->desc.size;
  uint64_t total = 0;
  bool bad = false;
  // Four at a time where the CPU can (item_pass.h); the rest here.
  for (size_t i = item_pass::copy_items(local_offs, remote_offs, sizes, n, out, lsize, rsize,
                                        &total, &bad);
       i < n; ++i) {
    const uint64_t lo = local_offs[i], ro = remote_offs[i], len = sizes[i];
    out[i] = {lo, ro, len};
    total += len;
    bad |= !range_fits(lo, ro, len, lsize, rsize);
  }
  if (bad) return failed(StatusCode::ERR_INVALID_ARGS, check_items(pair, out, n));
  t->total = total;
  return start(pair, t);
}

FERRY_HOT TransferPtr Transfers::make_transfer(Op op, uint32_t flags, TransferUid uid) {
  auto t = std::make_shared<Transfer>();
  t->owner = this;
  t->op = op == Op::READ ? FERRY_OP_READ : FERRY_OP_WRITE;
  t->flags = flags;
  t->uid = uid;
  return t;
}

namespace {
// Holds the local region of every pair of t; none and the first that could
// not be held (it is being deregistered) if one could not.
const LocalMem* hold_all(const MemPair& pair, const Transfer& t) {
  if (t.parts.empty()) return hold(*pair.local) ? nullptr : pair.local.get();
  for (size_t i = 0; i < t.parts.size(); ++i) {
    if (hold(*t.parts[i].pair.local)) continue;
    for (size_t j = 0; j < i; ++j) release(*t.parts[j].pair.local);
    return t.parts[i].pair.local.get();
  }
  return nullptr;
}
}  // namespace

FERRY_HOT TransferStatus Transfers::start(const MemPair& pair, const TransferPtr& t,
                                          const Route* route) {
  if (pair.peer->gone.load(std::memory_order_relaxed))
    return failed(StatusCode::ERR_NOT_FOUND,
                  "remote engine '" + pair.peer->desc.key +
                      "' was deregistered or registered again since this session was created; "
                      "create a new session");
  std::string why;
  if (route)
    t->route = *route;
  else
    t->route = route_for(pair, t->op == FERRY_OP_READ ? Op::READ : Op::WRITE, t->total, why);
  if (t->route->empty()) return failed(StatusCode::ERR_BAD_STATE, why);
  // Submitted when its status was made (make_transfer), a moment ago. (A
  // part of a larger call has the call's deadline, perhaps long since set.)
  const bool fresh = t->deadline == std::chrono::steady_clock::time_point{};
  if (fresh) t->deadline = t->status.state()->created + policy_.timeout;
  if (const LocalMem* gone = hold_all(pair, *t))
    return failed(StatusCode::ERR_NOT_FOUND,
                  "memory " + std::to_string(gone->desc.id) + " was deregistered");
  t->pair = pair;  // from here on ~Transfer releases the local regions
  // The transfer answers its status's Cancel() and, only where a backend of
  // the route can report completions on a waiter's thread, a wait's progress
  // rounds (otherwise a wait just polls the code). Held weakly: the status
  // may outlive the transfer.
  set_driver(t->status, t, std::any_of(t->route->begin(), t->route->end(), [](const BackendPtr& b) {
               return b->has_progress;
             }));
  // When it should end, from how long the first backend's transfers of about
  // this size took lately: a wait is awake for it (status.cpp). Counted from
  // its submission, deadline - timeout, as landed() measures what it took
  // (no second clock read on this path).
  if (const auto due = t->route->front()->durations.expected(t->total); due.count() > 0)
    t->status.SetExpectedEnd(t->deadline - policy_.timeout + due);
  TransferStatus status = t->status;
  start_next(t, fresh);
  return status;
}

FERRY_HOT void Transfers::drive_progress(const TransferPtr& t) {
  std::shared_ptr<Attempt> a;
  std::vector<TransferStatus> split;
  {
    std::lock_guard<std::mutex> lk(t->current_mu);
    a = t->current.lock();
    split = t->split;
  }
  for (const auto& s : split)  // it runs as one transfer per pair now: the first still going
    if (s.InProgress()) return s.Progress();
  if (!a || a->settled.load(std::memory_order_acquire) || !a->backend->has_progress) return;
  Backend& b = *a->backend;
  // Removal holds `life` exclusively around fini(): then the waiter just polls.
  std::shared_lock life(b.life, std::try_to_lock);
  if (!life.owns_lock() || b.removed) return;
  b.ops->progress(b.ctx);
}

void Transfers::cancel(const TransferPtr& t) {
  t->cancelled = true;
  std::shared_ptr<Attempt> a;
  std::vector<TransferStatus> split;
  std::shared_ptr<WatchItem> held;
  {
    std::lock_guard<std::mutex> lk(t->current_mu);
    a = t->current.lock();
    split = t->split;
    held = t->held.lock();
  }
  if (held) {
    // Held behind a fence: no attempt of it is running. Whichever of this, the
    // fence's answer and the deadline claims it first ends it (the fence's
    // answer would find it cancelled too, but only once the peer answers).
    if (static_cast<HeldTransfer*>(held.get())->claim()) {
      finish(t, StatusCode::ERR_CANCELLED,
             "cancelled while waiting for peer '" + t->pair.peer->desc.key + "' to answer a fence" +
                 (t->history.empty() ? std::string() : " (after: " + t->history + ")"));
      return;
    }
  }
  for (const auto& s : split) s.Cancel();  // (split() passes on a cancel it started under)
  // No attempt in flight: the next step (start_next, a fence's answer) ends it.
  if (!a || a->settled) return;
  Backend& b = *a->backend;
  // A READ, or a copy made by this process, ends when the plugin reports it:
  // until then bytes may still arrive here. attempt_done ends it cancelled. So
  // does a WRITE on a backend whose fence is not selective (rdma retires every
  // QP of the initiator: a fence for one cancel would fail every other transfer
  // in flight to that target).
  if (t->op != FERRY_OP_WRITE || (b.caps & FERRY_CAP_INITIATOR_COPY) ||
      !(b.caps & FERRY_CAP_FENCE_SELECTIVE) || t->pair.peer->gone.load(std::memory_order_acquire))
    return;  // (a deregistered peer cannot be asked: attempt_done parks its fence)
  // A WRITE in flight: the target fences it now - from its answer nothing more
  // lands. The plugin's own completion comes later and changes nothing.
  if (a->settled.exchange(true)) return;  // it completed meanwhile: attempt_done has it
  watchdog_.disarm(a.get());
  auto self = a;
  fencer_.fence(
      fence_target(t), b.name, a->id, t->deadline,
      [this, self](const FenceResult& r, const std::string& why) { cancel_fenced(self, r, why); });
}

void Transfers::cancel_fenced(const std::shared_ptr<Attempt>& a, const FenceResult& r,
                              const std::string& why) {
  const TransferPtr& t = a->transfer;
  Backend& b = *a->backend;
  switch (r.state) {
    case FenceState::WHOLE:  // it had all landed: the cancel came too late
      land(a, core_notifies(*t, b.caps));
      return;
    case FenceState::NONE:
    case FenceState::PARTIAL:
      add_history(t->history, b.name + ": cancelled in flight; " + std::to_string(r.landed) +
                                  " of " + std::to_string(t->total) +
                                  " bytes had landed, none lands now (" + why + ")");
      finish(t, StatusCode::ERR_CANCELLED, "cancelled: " + t->history);
      return;
    case FenceState::UNSUPPORTED:
    case FenceState::UNKNOWN:
      break;
  }
  add_history(t->history, b.name + ": cancelled in flight, but " + why);
  finish(t, StatusCode::ERR_OUTCOME_UNKNOWN, t->history);
}

FERRY_HOT void Transfers::finish(const TransferPtr& t, StatusCode code, std::string msg,
                                 std::chrono::steady_clock::time_point ended) {
  if (ended == std::chrono::steady_clock::time_point{}) ended = std::chrono::steady_clock::now();
  if (!t->on_end) {
    finish_at(t->status, code, std::move(msg), ended);
    return;
  }
  const std::string copy = msg;
  if (finish_at(t->status, code, std::move(msg), ended)) t->on_end(code, copy);
}

Fencer::Target Transfers::fence_target(const TransferPtr& t) const {
  const EngineDesc& d = t->pair.peer->desc;
  return {d.key, d.host, d.port, d.instance};
}

FERRY_HOT void Transfers::start_next(const TransferPtr& t, bool fresh) {
  if (t->cancelled) {  // whatever came before, nothing of it can land any more
    finish(t, StatusCode::ERR_CANCELLED,
           "cancelled" + (t->history.empty() ? std::string() : " (after: " + t->history + ")"));
    return;
  }
  if (shutting_down_) {
    add_history(t->history, "engine shutting down");
    finish(t, t->last_code, t->history);
    return;
  }
  // No attempt starts while the target is being fenced (it waits) or stays
  // fenced (it fails): an earlier attempt's bytes could still land over it.
  // (Nothing fenced anywhere, the usual case: no lock, no callback made.)
  std::string why;
  const EngineDesc& peer = t->pair.peer->desc;
  auto gate = Fencer::Gate::OPEN;
  if (!fencer_.all_open()) {
    // Held, it is resumed by the fence's answer or ended by its own deadline,
    // whichever comes first (the other then does nothing): the answer may wait
    // for a request asked by another transfer's later deadline.
    auto held = std::make_shared<HeldTransfer>(this, t);
    gate = fencer_.admit(
        peer.key, peer.instance,
        [this, t, held](bool go, const std::string& w) {
          if (!held->claim()) return;  // its deadline (or a cancel) came first
          if (go) {
            start_next(t);
            return;
          }
          add_history(t->history, w);
          finish(t, StatusCode::ERR_BAD_STATE, t->history);
        },
        &why);
    if (gate == Fencer::Gate::HELD) {
      watchdog_.arm(held, t->deadline);
      std::lock_guard<std::mutex> lk(t->current_mu);
      t->held = held;
    }
  }
  if (gate == Fencer::Gate::HELD) return;
  if (gate == Fencer::Gate::CLOSED) {
    add_history(t->history, why);
    finish(t, StatusCode::ERR_BAD_STATE, t->history);
    return;
  }
  while (t->next < t->route->size() && t->attempts < policy_.max_attempts) {
    if (t->cancelled) {  // cancelled while an attempt was refused at post(): no other
      add_history(t->history, "cancelled");
      finish(t, StatusCode::ERR_CANCELLED, t->history);
      return;
    }
    if (shutting_down_) {
      add_history(t->history, "engine shutting down");
      break;
    }
    const auto now = fresh ? t->deadline - policy_.timeout : std::chrono::steady_clock::now();
    fresh = false;
    if (now >= t->deadline) {
      add_history(t->history, "the transfer's deadline passed before " +
                                  (*t->route)[t->next]->name + " could be tried");
      t->last_code = StatusCode::ERR_TIMEOUT;
      break;
    }
    BackendPtr b = (*t->route)[t->next++];
    auto hs = health_.state(t->pair.peer->desc.key, b->name);
    if (hs == Health::State::QUARANTINED) {
      add_history(t->history, b->name + ": quarantined");
      continue;
    }
    if (!t->parts.empty() && !(b->caps & FERRY_CAP_MULTI_PAIR)) {
      --t->next;  // b takes one region pair per post: one transfer per pair from b on
      split(t);
      return;
    }
    ++t->attempts;
    bool unregistered = false;
    int rc = post_attempt(t, b, why, now, &unregistered);
    if (rc == FERRY_OK) return;  // the completion continues from attempt_done
    if (unregistered) {
      // Our own memory or the peer is no longer registered: a refusal (every
      // backend would meet it), not the backend's failure - no failover, and
      // nothing counts toward its health.
      add_history(t->history, b->name + ": " + why);
      finish(t, StatusCode::ERR_NOT_FOUND, t->history);
      return;
    }
    t->last_code = status_from_plugin(rc);
    add_history(t->history, b->name + ": " + why);
    ++b->counters->failures;
    if (!t->pair.peer->gone && health_.fail(t->pair.peer->desc.key, b->name))
      ++b->counters->quarantines;
    if (t->next < t->route->size()) ++b->counters->failovers;
  }
  if (t->history.empty()) t->history = "no backend left to try";
  finish(t, t->last_code, t->history);
}

FERRY_HOT int Transfers::post_attempt(const TransferPtr& t, const BackendPtr& b, std::string& why,
                                      std::chrono::steady_clock::time_point now,
                                      bool* unregistered) {
  // Hold the backend's life lock from the handle lookup through post(): the
  // calls that free plugin handles take it exclusively, so a handle found here
  // stays valid until the plugin has taken the transfer.
  std::shared_lock life(b->life);
  if (b->removed) {
    why = "backend was removed";
    return FERRY_ERR_BAD_STATE;
  }
  Registry::Handles h;
  if (!registry_.handles(t->pair, b->name, h)) {
    why = "the peer or the memory is no longer registered with this backend";
    *unregistered = true;
    return FERRY_ERR_NOT_FOUND;
  }
  // A multi-pair transfer (only on a MULTI_PAIR backend: start_next splits it
  // before any other): each pair's handles beside its item count.
  std::vector<ferry_pair_v1> pairs;
  if (!t->parts.empty()) {
    pairs.reserve(t->parts.size());
    for (const auto& p : t->parts) {
      Registry::Handles ph;
      if (!registry_.handles(p.pair, b->name, ph)) {
        why = "the peer or the memory of regions " + std::to_string(p.pair.local->desc.id) +
              " -> " + std::to_string(p.pair.remote->desc.id) +
              " is no longer registered with this backend";
        *unregistered = true;
        return FERRY_ERR_NOT_FOUND;
      }
      pairs.push_back({ph.local, ph.remote, p.n});
    }
  }
  auto a = std::make_shared<Attempt>();
  a->transfer = t;
  a->backend = b;
  a->id = next_attempt_.fetch_add(1);
  // The first attempt ends a fence reserve before the transfer, so a fence of it
  // (and perhaps a failover) still fits; a failover attempt gets half of what is
  // left, keeping the other half for its own fence. The watchdog fires halfway
  // between the attempt's deadline and the transfer's.
  const auto attempt_deadline =
      std::max(t->deadline - fence_reserve(policy_.timeout), now + (t->deadline - now) / 2);
  const auto reserve = t->deadline - attempt_deadline;
  ferry_xfer_v1 x{};
  x.struct_size = sizeof x;
  x.op = t->op;
  // A READ's target is told by the core once the data is here (the target
  // cannot know whether what it sent arrived), unless the plugin's own
  // notification covers READ (NATIVE_NOTIFY_READ).
  x.flags = t->op == FERRY_OP_READ && core_notifies(*t, b->caps) ? t->flags & ~FERRY_XFER_NOTIFY
                                                                 : t->flags;
  // Only the first attempt: a failover runs alone, with no part after it.
  if (t->more_follows && t->attempts == 1 && (b->caps & FERRY_CAP_POST_MORE))
    x.flags |= FERRY_XFER_MORE;
  x.n_iov = static_cast<uint32_t>(t->iov.size());
  x.peer = h.peer;
  x.local_mem = h.local;
  x.remote_mem = h.remote;
  x.iov = t->iov.data();
  x.uid = t->uid;
  x.deadline_ns = to_ns(attempt_deadline);
  x.total_bytes = t->total;
  x.attempt_id = a->id;
  x.n_pairs = static_cast<uint32_t>(pairs.size());
  x.pairs = pairs.empty() ? nullptr : pairs.data();
  // The plugin holds the attempt by its id (AttemptTable), never its address.
  b->attempts.put(a->id, a);
  x.xfer_ctx = reinterpret_cast<void*>(static_cast<uintptr_t>(a->id));
  char reason[256] = {};
  x.reason = reason;
  x.reason_len = sizeof reason;
  watchdog_.arm(a, attempt_deadline + reserve / 2);
  int rc = b->ops->post(b->ctx, &x);
  if (rc != FERRY_OK) {
    b->attempts.take(a->id);  // refused: the plugin holds nothing (a complete() after is stray)
    if (a->settled.exchange(true)) {
      // post() took longer than the attempt's watchdog time, which ended the
      // transfer (unknown) and closed the gate to the peer meanwhile. A
      // refusal started nothing: reopen it as a late report does, and touch
      // the transfer no more (it is the watchdog's, and finished).
      late_completion(a);
      return FERRY_OK;
    }
    reason[sizeof reason - 1] = '\0';  // whatever the plugin wrote, it ends here
    why = "refused the transfer: " + plugin_error_name(rc) +
          (reason[0] ? " (" + printable(reason, 255) + ")" : "");
    return rc;
  }
  // In flight from here (unless it completed inside post(): then a later
  // attempt may be current already). Published only now, so a cancel never
  // fences an attempt whose post() may still be refused.
  {
    // Looked at under the lock: a completion inside post() settles this
    // attempt before a failover publishes the next one under the same lock,
    // which this must not overwrite (a cancel would then miss it).
    std::lock_guard<std::mutex> lk(t->current_mu);
    if (!a->settled) t->current = a;
  }
  if (t->cancelled) cancel(t);  // asked while post() ran: fence it now
  return rc;
}

std::string Transfers::notify_by_core(const TransferPtr& t) {
  // Queued behind others to this peer until after its deadline: do not connect now.
  if (std::chrono::steady_clock::now() >= t->deadline)
    return "the transfer's deadline passed before the NOTIFY could leave";
  std::string err;
  const EngineDesc& d = t->pair.peer->desc;
  int rc = control_.send(d.key, d.host, d.port, CtrlType::NOTIFY,
                         notify_body(t->uid, 0, d.instance), &err, t->deadline);
  return rc == FERRY_OK ? std::string() : (err.empty() ? plugin_error_name(rc) : err);
}

FERRY_HOT void Transfers::attempt_done(const std::shared_ptr<Attempt>& a, int status,
                                       const std::string& msg) {
  watchdog_.disarm(a.get());
  const TransferPtr& t = a->transfer;
  Backend& b = *a->backend;
  const std::string& peer = t->pair.peer->desc.key;
  if (status == FERRY_OK || status == FERRY_OK_NOTIFY_BY_CORE) {
    land(a, status == FERRY_OK ? core_notifies(*t, b.caps) : (t->flags & FERRY_XFER_NOTIFY) != 0);
    return;
  }
  const std::string message = msg.empty() ? plugin_error_name(status) : msg;
  const bool nothing_can_land =
      status == FERRY_ERR_NOT_SENT || t->op == FERRY_OP_READ || (b.caps & FERRY_CAP_INITIATOR_COPY);
  if (t->cancelled && !a->by_watchdog && (nothing_can_land || is_refusal(status))) {
    add_history(t->history, b.name + ": " + message);
    finish(t, StatusCode::ERR_CANCELLED, "cancelled: " + t->history);
    return;
  }
  if (is_refusal(status)) {
    add_history(t->history, b.name + ": " + message);
    finish(t, status_from_plugin(status), t->history);
    return;
  }
  if (a->by_watchdog) {
    // The plugin never reported back: its lanes or copies may still move bytes,
    // into the target (WRITE) or into our memory (READ). The gate to the peer
    // stays closed until the plugin's late completion says the attempt is over.
    ++b.counters->failures;
    close_gate_for(a, "peer '" + peer + "' is fenced: a " + b.name +
                          " attempt to it has not ended (" + message + ")");
    add_history(t->history, b.name + ": " + message);
    finish(t, StatusCode::ERR_OUTCOME_UNKNOWN, t->history);
    return;
  }
  if (nothing_can_land) {
    attempt_failed(a, status, message);
    return;
  }
  ++b.counters->failures;
  if (shutting_down_) {
    add_history(t->history, b.name + ": " + message + " (engine shutting down: not fenced)");
    finish(t, StatusCode::ERR_OUTCOME_UNKNOWN, t->history);
    return;
  }
  if (t->pair.peer->gone.load(std::memory_order_acquire) && !registry_.peer_instance(peer)) {
    // The application deregistered the peer under it, and has not registered
    // it again: the fence cannot be asked now, so waiting for it would only
    // hold this transfer to its deadline. It ends unknown at once; the fence
    // stays pending and closes the gate, so a new transfer to the same engine
    // registered again waits for the answer (a late byte of this one must not
    // land over it). (Replaced by another instance, the old one is fenced as
    // usual: the new one answers "gone".)
    const std::string& gone = t->pair.peer->gone_why;  // written before `gone`
    const std::string why = "peer '" + peer + "' was deregistered with a WRITE on " + b.name +
                            " in flight whose outcome is unknown" +
                            (gone.empty() ? "" : " (" + gone + ")") +
                            "; registering it again fences that WRITE first";
    fencer_.fence_later(fence_target(t), b.name, a->id, why);
    // Registered again meanwhile: its retry may have come before the fence was
    // kept (it asks on the registration's side otherwise).
    if (auto inst = registry_.peer_instance(peer); inst && *inst == t->pair.peer->desc.instance)
      fencer_.retry_now(peer, *inst);
    add_history(t->history, b.name + ": " + message + " (" + why + ")");
    finish(t, StatusCode::ERR_OUTCOME_UNKNOWN, t->history);
    return;
  }
  auto self = a;
  fencer_.fence(fence_target(t), b.name, a->id, t->deadline,
                [this, self, status, message](const FenceResult& r, const std::string& why) {
                  attempt_fenced(self, status, message, r, why);
                });
}

void Transfers::attempt_fenced(const std::shared_ptr<Attempt>& a, int status,
                               const std::string& msg, const FenceResult& r,
                               const std::string& why) {
  const TransferPtr& t = a->transfer;
  Backend& b = *a->backend;
  if (!t->pair.peer->gone && health_.fail(t->pair.peer->desc.key, b.name))
    ++b.counters->quarantines;
  const std::string entry = b.name + ": " + msg + " (" + why + ")";
  switch (r.state) {
    case FenceState::WHOLE:
      add_history(t->history, entry);
      land(a, core_notifies(*t, b.caps));
      return;
    case FenceState::NONE:
    case FenceState::PARTIAL:
      t->last_code = status_from_plugin(status);
      add_history(t->history, entry);
      if (t->next < t->route->size() && t->attempts < policy_.max_attempts && !shutting_down_)
        ++b.counters->failovers;
      start_next(t);
      return;
    case FenceState::UNSUPPORTED:
    case FenceState::UNKNOWN:
      break;
  }
  add_history(t->history, entry);
  finish(t, StatusCode::ERR_OUTCOME_UNKNOWN, t->history);
}

FERRY_HOT void Transfers::land(const std::shared_ptr<Attempt>& a, bool owes_notify) {
  if (!owes_notify) {
    landed(a, {});
    return;
  }
  const TransferPtr& t = a->transfer;
  const EngineDesc& d = t->pair.peer->desc;
  int rc = FERRY_ERR_BAD_STATE;
  std::string err;
  if (control_.try_send(d.key, CtrlType::NOTIFY, notify_body(t->uid, 0, d.instance), &rc, &err)) {
    landed(a, rc == FERRY_OK ? std::string() : err);
    return;
  }
  // It has to wait for the connection (busy, or to be made and greeted), which
  // may take until the deadline: not on this thread, perhaps the application's
  // own inside post(); behind the peer's other waiting NOTIFYs, on one thread.
  auto self = a;
  notifies_.run(d.key, a->transfer->deadline, [this, self](bool on_runner) {
    // No thread for it (this may be a fence's or a plugin's callback: nothing
    // may escape): the NOTIFY did not leave, as if it had failed.
    landed(self, on_runner ? notify_by_core(self->transfer)
                           : std::string("no thread to send the NOTIFY on"));
  });
}

FERRY_HOT void Transfers::landed(const std::shared_ptr<Attempt>& a,
                                 const std::string& notify_error) {
  const TransferPtr& t = a->transfer;
  Backend& b = *a->backend;
  if (!notify_error.empty()) {
    // The data is in place but the target was not told (the NOTIFY never
    // left): a re-run elsewhere writes the same bytes and notifies. The control
    // plane failed, not the backend: no health penalty.
    attempt_failed(a, FERRY_ERR_TRANSPORT,
                   "data delivered but the target could not be notified: " + notify_error,
                   /*backend_at_fault=*/false);
    return;
  }
  b.counters->bytes += t->total;
  ++b.counters->transfers;
  // Submitted at deadline - timeout (Transfers::start): no lock on this path.
  const auto now = std::chrono::steady_clock::now();
  const auto took = now - (t->deadline - policy_.timeout);
  b.counters->metrics.record(t->op == FERRY_OP_READ ? Op::READ : Op::WRITE, t->total, took);
  if (t->history.empty()) b.durations.record(t->total, took);  // its first attempt's time alone
  health_.succeed(t->pair.peer->desc.key, b.name);
  std::string after = t->history.empty() ? std::string() : "after: " + t->history;
  if (!t->message) {
    finish(t, StatusCode::SUCCESS, std::move(after), now);
    return;
  }
  // The data is in place: now its message, once (however many attempts the
  // data took). Its failure is the transfer's, though the data stays landed.
  const EngineDesc& d = t->pair.peer->desc;
  auto self = t;
  messenger_.send({d.key, d.host, d.port, d.instance}, std::move(*t->message), t->deadline,
                  [this, self, after](StatusCode code, const std::string& why) {
                    if (code == StatusCode::SUCCESS)
                      finish(self, code, after);
                    else
                      finish(self, code,
                             "the data landed but its notification message did not: " + why +
                                 (after.empty() ? "" : " (" + after + ")"));
                  });
}

std::string Transfers::check_message_size(size_t n) {
  if (n <= kMaxNotifPayload) return {};
  return "notification message of " + std::to_string(n) + " bytes exceeds the limit of " +
         std::to_string(kMaxNotifPayload);
}

TransferStatus Transfers::send_message(const Messenger::Target& to, std::string payload) {
  if (shutting_down_) return failed(StatusCode::ERR_BAD_STATE, "engine is shutting down");
  if (std::string bad = check_message_size(payload.size()); !bad.empty())
    return failed(StatusCode::ERR_INVALID_ARGS, bad);
  TransferStatus status;
  status.SetInProgress();
  messenger_.send(
      to, std::move(payload), std::chrono::steady_clock::now() + policy_.timeout,
      [status](StatusCode code, const std::string& why) mutable { status.Finish(code, why); });
  return status;
}

void Transfers::attempt_failed(const std::shared_ptr<Attempt>& a, int status,
                               const std::string& msg, bool backend_at_fault) {
  const TransferPtr& t = a->transfer;
  Backend& b = *a->backend;
  const std::string& peer = t->pair.peer->desc.key;
  t->last_code = status_from_plugin(status);
  add_history(t->history, b.name + ": " + msg);
  ++b.counters->failures;
  if (backend_at_fault && !t->pair.peer->gone && health_.fail(peer, b.name))
    ++b.counters->quarantines;
  if (t->next < t->route->size() && t->attempts < policy_.max_attempts && !shutting_down_) {
    ++b.counters->failovers;
    FERRY_LOG(INFO, self_key_,
              "transfer " + std::to_string(t->uid) + " to " + peer + " failed on " + b.name + " (" +
                  msg + "); trying " + (*t->route)[t->next]->name);
  }
  start_next(t);
}

void Transfers::close_gate_for(const std::shared_ptr<Attempt>& a, const std::string& why) {
  const TransferPtr& t = a->transfer;
  a->gate_token = fencer_.close(fence_target(t), why);
  // The plugin reported between the watchdog's end and the close: reopen here.
  if (a->gate_mark.exchange(Attempt::kGateClosed) == Attempt::kGateLate) {
    const EngineDesc& d = t->pair.peer->desc;
    fencer_.reopen(d.key, d.instance, a->gate_token);
  }
}

Transfers::HeldTransfer::~HeldTransfer() { owner->watchdog_.disarm(this); }

bool Transfers::HeldTransfer::claim() {
  if (claimed.exchange(true)) return false;
  owner->watchdog_.disarm(this);  // a no-op once it fired
  return true;
}

void Transfers::HeldTransfer::on_deadline() {
  if (!claim()) return;  // resumed (or failed, or cancelled) first
  TransferPtr t = transfer.lock();
  if (!t) return;
  add_history(t->history, "the deadline passed while transfers to '" + t->pair.peer->desc.key +
                              "' waited for its fence");
  owner->finish(t, StatusCode::ERR_TIMEOUT, t->history);
}

void Transfers::late_completion(const std::shared_ptr<Attempt>& a) {
  // Only the watchdog's close is reopened, once; before it, the mark tells
  // close_gate_for to reopen instead.
  if (a->gate_mark.exchange(Attempt::kGateLate) != Attempt::kGateClosed) return;
  const EngineDesc& d = a->transfer->pair.peer->desc;
  FERRY_LOG(INFO, self_key_,
            a->backend->name + " copy to '" + d.key +
                "' ended after its deadline; transfers to it resume");
  fencer_.reopen(d.key, d.instance, a->gate_token);
}

}  // namespace ferry
