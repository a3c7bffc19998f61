// SPDX-License-Identifier: Apache-2.0
// The transfer lifecycle (transfer.cpp): the one component where a transfer's
// outcome is decided - its attempts, deadline, fence, failover, completion and
// the notification the core owes. It owns the watchdog, the fencer and the
// runner for notifications that must connect first; it borrows the registry
// (pairs and plugin handles), the backends, the policy, the health table and
// the control plane from the engine, which outlives it.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "async_runner.h"
#include "backend_set.h"
#include "fence.h"
#include "ferry/ferry.hpp"
#include "health.h"
#include "messenger.h"
#include "peer_job_queue.h"
#include "policy.h"
#include "range_fits.h"
#include "registry.h"
#include "status_state.h"
#include "watchdog.h"

namespace ferry {

class ControlPlane;
class Transfers;

// A vector whose resize() leaves new items uninitialised, for item lists that
// the caller fills in full right after (a value-initialising resize cleared
// ~100 KB of a 4096-item batch before it was written).
template <typename T>
struct UninitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <typename U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using IovList = std::vector<ferry_iov_v1, UninitAllocator<ferry_iov_v1>>;

// A transfer's items: a single one (a plain read or write) inline, with no
// allocation of its own; more in an IovList.
class TransferIov {
 public:
  size_t size() const { return n_; }
  ferry_iov_v1* data() { return n_ > 1 ? many_.data() : &one_; }
  const ferry_iov_v1* data() const { return n_ > 1 ? many_.data() : &one_; }
  // Room for n items, left unset: the caller writes them all.
  void resize(size_t n) {
    n_ = n;
    if (n > 1) many_.resize(n);
  }
  void assign(const ferry_iov_v1* first, const ferry_iov_v1* last) {
    resize(static_cast<size_t>(last - first));
    std::copy(first, last, data());
  }
  TransferIov& operator=(IovList&& items) {
    n_ = items.size();
    if (n_ == 1)
      one_ = items[0];
    else
      many_ = std::move(items);
    return *this;
  }

 private:
  ferry_iov_v1 one_{};
  IovList many_;
  size_t n_ = 0;
};

// The items of one region pair in a multi-region call: iov[first, first + n)
// of the call's list, every range inside the pair's regions.
struct PairItems {
  MemPair pair;
  size_t first = 0, n = 0;
  uint64_t bytes = 0;  // their lengths' sum
};

// One logical transfer, across however many backends it takes; the driver
// of its own status (Cancel(), a wait's progress rounds).
struct Attempt;
struct Transfer final : StatusDriver, std::enable_shared_from_this<Transfer> {
  Transfers* owner = nullptr;
  TransferStatus status;
  MemPair pair;
  // A transfer over several region pairs in one attempt (plugin ABI 1.7,
  // FERRY_CAP_MULTI_PAIR): each pair's items in iov, in iov's order;
  // parts[0].pair is `pair`. Empty for one pair.
  std::vector<PairItems> parts;
  // What it became when its route reached a backend without MULTI_PAIR: one
  // transfer per pair (guarded by current_mu; cancel and progress go to them).
  std::vector<TransferStatus> split;
  uint32_t op = FERRY_OP_WRITE;
  uint32_t flags = 0;
  uint64_t uid = 0;
  // Sent to the target once the data has landed, before the status ends.
  std::optional<std::string> message;
  // TransferStatus::Cancel() was called: no new attempt starts, and the one in
  // flight is fenced or waited for; then it ends ERR_CANCELLED.
  std::atomic<bool> cancelled{false};
  std::mutex current_mu;
  std::weak_ptr<Attempt> current;  // the attempt in flight (guarded by current_mu)
  // While held behind a fence (Transfers::HeldTransfer; guarded by current_mu):
  // a cancel ends it at once instead of waiting for the fence's answer.
  std::weak_ptr<WatchItem> held;
  // A part of a multi-region transfer: told once when this part ends.
  std::function<void(StatusCode code, const std::string& why)> on_end;
  TransferIov iov;
  uint64_t total = 0;  // of iov's lengths (set by whoever builds the transfer)
  Route route;         // set by start()
  // The whole transfer ends by this (submit + policy timeout): attempts, fences,
  // failovers and the notification all fit inside it.
  std::chrono::steady_clock::time_point deadline;
  size_t next = 0;
  // A part of a multi-region call with more parts posted right after it
  // (FERRY_XFER_MORE on its first attempt, for backends that take it).
  bool more_follows = false;
  uint32_t attempts = 0;
  StatusCode last_code = StatusCode::ERR_BAD_STATE;
  std::string history;  // "tcp: connection reset; ofi: timeout"
  ~Transfer();          // releases the local region (LocalMem::inflight)
  void cancel() override;
  void progress() override;
};
using TransferPtr = std::shared_ptr<Transfer>;

// One try of a transfer on one backend. The plugin holds it by its id (the
// xfer_ctx; the backend's AttemptTable keeps it alive) until it calls
// complete(); the watchdog fires if it never does.
struct Attempt : WatchItem, std::enable_shared_from_this<Attempt> {
  TransferPtr transfer;
  BackendPtr backend;
  uint64_t id = 0;  // ferry_xfer_v1.attempt_id
  std::atomic<bool> settled{false};
  bool by_watchdog = false;  // ended by the core's watchdog, not by the plugin
  // The watchdog closed the peer's gate (its plugin may still move bytes); the
  // plugin's late completion reopens it. Whichever of the two comes second
  // reopens: a completion that arrives while the watchdog is closing is not
  // lost (the gate would stay closed for good).
  enum GateMark : int { kGateUntouched = 0, kGateClosed = 1, kGateLate = 2 };
  std::atomic<int> gate_mark{kGateUntouched};
  uint64_t gate_token = 0;  // Fencer::close()'s, written before gate_mark says closed
  void on_deadline() override;
  ~Attempt() override;
};

class Transfers {
 public:
  struct Parts {
    const std::string& self_key;  // for logs
    const Policy& policy;
    Health& health;
    BackendSet& backends;
    Registry& registry;
    ControlPlane& control;
  };
  Transfers(Parts parts, uint64_t self_instance);
  // Waits for notifications on their way and ends pending fences (both end
  // their transfers). Backends must have been removed first.
  ~Transfers() { shutting_down_ = true; }
  Transfers(const Transfers&) = delete;
  Transfers& operator=(const Transfers&) = delete;

  // Validates offsets and sizes against the pair, routes and starts the transfer.
  TransferStatus submit(const MemPair& pair, Op op, const size_t* local_offs,
                        const size_t* remote_offs, const size_t* sizes, size_t n, TransferUid uid,
                        std::optional<bool> notify, std::optional<std::string> message = {});
  // One transfer over many region pairs of one remote engine (Engine::transfer,
  // prepared lists): per pair one part, routed, fenced and failed over on its
  // own; one status, which ends when every part has, SUCCESS when all landed -
  // then, once, the target's notification and the message.
  // Where a backend of the route takes several region pairs in one post
  // (FERRY_CAP_MULTI_PAIR) the whole call is one transfer, one attempt; it
  // splits into parts only if it fails over to a backend that does not.
  using Group = PairItems;
  TransferStatus submit_groups(std::vector<Group> groups, IovList iov, Op op, TransferUid uid,
                               std::optional<bool> notify, std::optional<std::string> message);
  // "" when every range fits its pair's regions, else why not (item numbers
  // from item_numbers, else 0..n-1).
  static std::string check_items(const MemPair& pair, const ferry_iov_v1* iov, size_t n,
                                 const size_t* item_numbers = nullptr);
  // "" when a notification message of `n` bytes may be sent, else why not.
  static std::string check_message_size(size_t n);
  // A notification message on its own (Engine::send_notification), by the
  // policy's deadline.
  TransferStatus send_message(const Messenger::Target& to, std::string payload);
  // The ranked backends for a transfer over `pair` now (cached per pair, op and size band).
  Route route_for(const MemPair& pair, Op op, uint64_t bytes, std::string& why);
  // Which of the policy's size bands `bytes` falls in (Policy::size_breaks).
  int size_band(uint64_t bytes) const;
  // host->complete: a plugin ended an attempt (it drops its reference after this).
  void complete(std::shared_ptr<Attempt> a, int status, const char* message);
  // TransferStatus::Cancel() of `t` (through Transfer::cancel()).
  void cancel(const TransferPtr& t);
  // New transfers fail at once from now on.
  void shut_down() { shutting_down_ = true; }
  // A peer was deregistered (park: WRITEs of unknown outcome stay pending for a
  // re-registration of the same instance) or replaced by a new instance
  // (forgotten).
  void forget_fences(const std::string& peer_key, const std::string& why, bool park) {
    fencer_.reset(peer_key, why, park);
  }
  Fencer::Counts fence_counts() const { return fencer_.counts(); }
  // The same instance of a peer was registered again (Fencer::retry_now).
  void peer_registered(const std::string& key, uint64_t instance, bool only_parked = false) {
    fencer_.retry_now(key, instance, only_parked);
  }

 private:
  friend struct Attempt;
  friend struct Transfer;
  // A new transfer owned by this lifecycle, not yet started.
  TransferPtr make_transfer(Op op, uint32_t flags, TransferUid uid);
  // Routes a built, checked transfer (unless `route` is given) and posts its
  // first attempt. Its deadline is set here unless it has one.
  TransferStatus start(const MemPair& pair, const TransferPtr& t, const Route* route = nullptr);
  // One transfer per group (items iov[first, first + n)), each routed on its
  // own unless `route` is given; done(code, why) once, when the last has
  // ended: SUCCESS only when every part landed, and then after the target's
  // NOTIFY (owes_notify) and the message. Their statuses go to *statuses.
  struct PartsSpec {
    uint32_t op;
    uint64_t uid;
    bool owes_notify;
    std::optional<std::string> message;
    std::chrono::steady_clock::time_point deadline;
    const Route* route;      // nullptr: each part routes itself
    uint32_t attempts_used;  // of policy max_attempts, by the caller
  };
  void start_parts(const std::vector<Group>& groups, const ferry_iov_v1* iov, PartsSpec spec,
                   std::function<void(StatusCode, const std::string&)> done,
                   std::vector<TransferStatus>* statuses);
  // A multi-pair transfer whose next backend (t->route[t->next]) cannot take
  // several pairs: from there on it runs as one transfer per pair.
  void split(const TransferPtr& t);
  // fresh: called by start(), a moment after the submission - the transfer's
  // start time stands for now (no clock read on the submit path).
  void start_next(const TransferPtr& t, bool fresh = false);
  // A waiter's progress hook: the attempt in flight's backend reports what has
  // finished, on the waiting thread (plugin ABI 1.6). Touches only the transfer
  // and what it keeps alive, never the engine: a status may outlive it.
  static void drive_progress(const TransferPtr& t);
  // *unregistered: it failed because our memory or the peer is no longer
  // registered with b (a refusal, not b's failure).
  int post_attempt(const TransferPtr& t, const BackendPtr& b, std::string& why,
                   std::chrono::steady_clock::time_point now, bool* unregistered);
  void attempt_done(const std::shared_ptr<Attempt>& a, int status, const std::string& msg);
  // Ends the transfer's status (at `ended`, read by the caller; unset: now).
  void finish(const TransferPtr& t, StatusCode code, std::string msg,
              std::chrono::steady_clock::time_point ended = {});
  // An attempt failed in a way that leaves nothing to land later: count it
  // against the backend's health and go on with the next backend.
  void attempt_failed(const std::shared_ptr<Attempt>& a, int status, const std::string& msg,
                      bool backend_at_fault = true);
  // The target's answer to the fence of an attempt whose outcome was unknown.
  void attempt_fenced(const std::shared_ptr<Attempt>& a, int status, const std::string& msg,
                      const FenceResult& r, const std::string& why);
  // The target's answer to the fence a cancel sent for the attempt in flight.
  void cancel_fenced(const std::shared_ptr<Attempt>& a, const FenceResult& r,
                     const std::string& why);
  // Tell the target a transfer landed when the backend cannot (or, for a READ,
  // must not: its target cannot know the data arrived). "" or why it failed.
  std::string notify_by_core(const TransferPtr& t);
  // The attempt's data is in place: notify if the core owes it (at once when the
  // control connection is up and free, else on a thread of its own, by the
  // deadline), then end the transfer SUCCESS, or fail the attempt over when the
  // target could not be told.
  void land(const std::shared_ptr<Attempt>& a, bool owes_notify);
  void landed(const std::shared_ptr<Attempt>& a, const std::string& notify_error);
  // host->complete for an attempt the watchdog had already ended.
  void late_completion(const std::shared_ptr<Attempt>& a);
  // A transfer held by the fencer (Fencer::Gate::HELD), timed by its own
  // deadline: whichever of the fencer's resume and the deadline claims it
  // first decides; the deadline ends it ERR_TIMEOUT (nothing of this attempt
  // was started). Kept alive by the resume the fencer holds.
  struct HeldTransfer final : WatchItem {
    HeldTransfer(Transfers* o, const TransferPtr& t) : owner(o), transfer(t) {}
    ~HeldTransfer() override;
    // True for the one caller that decides its end (disarmed then).
    bool claim();
    void on_deadline() override;
    Transfers* const owner;
    const std::weak_ptr<Transfer> transfer;
    std::atomic<bool> claimed{false};
  };
  // The peer's gate for a watchdog-ended attempt: closed now, reopened when its
  // plugin reports (maybe already has).
  void close_gate_for(const std::shared_ptr<Attempt>& a, const std::string& why);
  Fencer::Target fence_target(const TransferPtr& t) const;

  const std::string& self_key_;
  const Policy& policy_;
  const std::vector<uint64_t> size_breaks_;  // the policy's, for size_band()
  Health& health_;
  BackendSet& backends_;
  Registry& registry_;
  ControlPlane& control_;
  // Attempt ids (ferry_xfer_v1.attempt_id) start at the wall clock in ns, so an
  // engine that restarts under its key numbers above its earlier life: a
  // target's plugin remembers attempts by id for fences, and ids restarting
  // at 1 met an old life's records (a fence of a new attempt answered with what
  // an old one of the same number had landed). One attempt per ns is never reached.
  std::atomic<uint64_t> next_attempt_{first_attempt_id()};
  static uint64_t first_attempt_id();
  std::atomic<bool> shutting_down_{false};
  // Destroyed in reverse: the fencer first (its pending attempts end UNKNOWN;
  // an answer may still hand a landing to async_ or a message to messenger_),
  // then the notifications on their way (a multi-region call's may hand its
  // message to messenger_), then the messages on their way (their jobs only end
  // statuses), then the watchdog that every ended attempt disarms. Once
  // shutting_down_ is set start_next() ends a transfer without the fencer.
  Watchdog watchdog_;
  Messenger messenger_;
  // NOTIFYs that could not leave at once, one queue per peer, drained on
  // async_'s threads; destroyed after async_ has joined them.
  PeerJobQueue notifies_{async_};
  AsyncRunner async_;
  Fencer fencer_;  // uses control_
};

}  // namespace ferry
