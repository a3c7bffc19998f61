// SPDX-License-Identifier: Apache-2.0
// The initiator's side of fencing (DESIGN.md, "Failure means not delivered").
//
// After a WRITE attempt whose outcome is unknown (deadline, lost connection,
// missing ack), its target is fenced: no later transfer to it starts, on any
// backend, until the target has confirmed, per attempt, that none of its bytes
// can land any more and said how much had landed. The Fencer keeps that state
// per life of a target engine (an older life fenced after a newer one was
// registered keeps a state of its own), asks the target over the control plane (FENCE on a
// connection of its own, one thread per fenced target so a stopped target never
// delays another's fence), and hands each attempt's answer back.
//
// Per target the gate is:
//   OPEN     nothing pending: transfers start;
//   FENCING  a fence is in flight: new transfers wait (held) until it ends;
//   CLOSED   a fence was not answered by an attempt's deadline, or the backend
//            cannot fence: new transfers fail at once with the reason, until the
//            target answers (the thread keeps asking) or a new instance of it is
//            registered (reset()); registering the same instance again asks at
//            once and holds new transfers for that answer (retry_now()).
//
// A FENCE already on its way when the target is deregistered still reaches it,
// and the target retires every lane of ours it finds then - new ones too. So
// when the same instance is registered again, its transfers wait (HELD) until
// that request has come back: the lanes they make are made after the fence.
#pragma once
#include <atomic>
#include <chrono>
#include <compare>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "async_runner.h"
#include "control_frame.h"
#include "watchdog.h"

namespace ferry {

class ControlPlane;

class Fencer {
 public:
  using Clock = std::chrono::steady_clock;
  struct Target {
    std::string key, host;
    uint16_t port = 0;
    uint64_t instance = 0;  // the life of the engine being fenced
  };
  // An attempt's answer: the state the target reported (UNKNOWN when it did not
  // answer by the attempt's deadline) and words for the user.
  using Done = std::function<void(const FenceResult& r, const std::string& why)>;
  // A held transfer: go = start it now; otherwise fail it with `why`.
  using Resume = std::function<void(bool go, const std::string& why)>;
  enum class Gate { OPEN, HELD, CLOSED };
  // One life of one peer engine: fence state is kept per life, so a fence for
  // an older life (a WRITE to it failing after a new life replaced it) never
  // touches the registered life's pending attempts or held transfers.
  struct Life {
    std::string key;
    uint64_t instance = 0;
    auto operator<=>(const Life&) const = default;
  };

  // How a FENCE request goes out and its answer comes back (the control
  // plane's request(); a test's stand-in): FERRY_OK with *reply, or an error.
  using Ask = std::function<int(const Target& t, const std::vector<uint8_t>& body,
                                Clock::time_point deadline, CtrlFrame* reply, std::string* err)>;
  explicit Fencer(ControlPlane* control);
  explicit Fencer(Ask ask);
  // Whether a life of a peer is the one registered now (the registry's
  // answer; without it every life counts as registered). A fence of a life
  // that is not - an older one, replaced while its WRITE was out - that goes
  // unanswered past its attempts' deadlines is parked rather than asked on
  // forever: the control plane proves only the registered life, so a live old
  // process at another address can never answer it. Set before any fence.
  using Registered = std::function<bool(const std::string& key, uint64_t instance)>;
  void set_registered(Registered registered) { registered_ = std::move(registered); }
  ~Fencer();  // answers every pending attempt UNKNOWN and fails held transfers

  // Fence one attempt on `backend`; `done` runs once, on a fencer thread.
  void fence(const Target& t, const std::string& backend, uint64_t attempt,
             Clock::time_point deadline, Done done);
  // An attempt whose target cannot be asked now (deregistered: the control
  // plane talks only to registered peers). The caller reports it unknown; the
  // attempt stays pending, parked (not asked, no thread) with the gate CLOSED
  // for `why`, until the same instance is registered again (retry_now asks it
  // then, new transfers held for the answer) or a new one replaces it.
  void fence_later(const Target& t, const std::string& backend, uint64_t attempt,
                   const std::string& why);
  // Close the gate of a target's life without asking it: an attempt the
  // watchdog ended, whose plugin has not reported back (its lanes or copies may
  // still move bytes). Returns the close's token: the reopen() for that
  // attempt names it, so a late report never reopens a close made for
  // another attempt (one made after a reset of the life dropped its own).
  uint64_t close(const Target& t, const std::string& why);
  // The same instance of `key` was registered again: a fence that went
  // unanswered (the peer was not registered, so it could not be asked) is
  // asked again now, and new transfers wait for that answer instead of
  // failing; unanswered again, the gate closes again.
  // only_parked: only a state parked by a deregistration (a repeated
  // registration of the same descriptor: a stopped target's closed
  // gate is not reopened by every repeated handshake).
  void retry_now(const std::string& key, uint64_t instance, bool only_parked = false);
  // The attempt of close() `token` has ended. The gate opens once every
  // close() of the life has its reopen(), unless a fence answered that the
  // target cannot tell (then only a new instance does); a fence still
  // pending decides. A token the state does not hold (reset since) is ignored.
  void reopen(const std::string& key, uint64_t instance, uint64_t token);
  // Whether a transfer to `key` may start. HELD: `resume` runs later (not before
  // this returns). CLOSED: *why says why, `resume` is dropped.
  Gate admit(const std::string& key, uint64_t instance, Resume resume, std::string* why);
  // True while no state is kept for any peer (nothing fenced, pending,
  // closed or draining): admit() would answer OPEN for every target. Read
  // without the lock, before each attempt - seeing it true is admit() taking
  // the lock at that moment, before any fence that begins after.
  bool all_open() const { return quiet_.load(std::memory_order_seq_cst); }
  // A new instance was registered under the key, or it was deregistered: its old
  // state is dropped (pending attempts answered UNKNOWN, held transfers failed).
  // `why`: what deregistered it (a metadata store's expired lease), for the
  // message of the transfers that end here. park (a deregistration): pending
  // attempts are answered UNKNOWN but kept, parked, as by fence_later - their
  // bytes may still land, so the same life registered again is fenced first.
  void reset(const std::string& key, const std::string& why = {}, bool park = false);
  // Parked states kept at most (the oldest is forgotten).
  static constexpr size_t kMaxParked = 1024;
  // Fences sent, attempts answered by the target, attempts left unknown.
  struct Counts {
    uint64_t fences = 0, answered = 0, unknown = 0;
    uint64_t gated = 0;  // targets whose gate is not OPEN now (fencing or fenced)
  };
  Counts counts() const;

 private:
  struct Pending {
    std::string backend;
    uint64_t attempt;
    Clock::time_point deadline;
    Done done;
    bool reported = false;  // told "unknown" at its deadline; kept to learn the truth
    // Tells it "unknown" at its deadline if no answer came (Overdue): the
    // request out may be another attempt's, asked by a later deadline.
    std::shared_ptr<WatchItem> timer;
  };
  class Overdue;
  struct PeerState {
    Target target;
    std::vector<Pending> pending;
    std::vector<Resume> held;
    std::string closed_why;  // non-empty: CLOSED
    // Tokens of close() calls not yet matched by reopen(): attempts the
    // watchdog ended whose plugin has not reported back (its lanes may still
    // move bytes).
    std::set<uint64_t> watchdog_closes;
    // A fence answered "unknown" or "unsupported": only a new instance reopens.
    bool closed_for_good = false;
    // Whether the gate stays closed whatever a fence answers next.
    bool sticky() const { return closed_for_good || !watchdog_closes.empty(); }
    // Nothing pending, held or closed: the state may go.
    bool idle() const {
      return pending.empty() && held.empty() && closed_why.empty() && !sticky() && !asking;
    }
    bool running = false;  // a worker thread runs while pending is not empty
    bool asking = false;   // its worker has a FENCE request out (unlocked)
    bool kicked = false;   // retry_now(): ask again without waiting out the backoff
    bool parked = false;   // deregistered: not asked until registered again (retry_now)
    uint64_t parked_seq = 0;
  };
  // The worker of one life's state `p` (it stops once `p` is no longer the
  // life's state: reset meanwhile).
  void run(const Life& life, const std::shared_ptr<PeerState>& p);
  void finish_all(PeerState& p, const std::string& why, std::vector<std::function<void()>>& out);
  // The state of the target's life, made when it has none; mu_ held.
  PeerState& state_for(const Target& t);
  // The state of `key`'s life `instance`, or null; mu_ held.
  PeerState* find_locked(const std::string& key, uint64_t instance);
  // Sets quiet_ from peers_ and draining_ after an erase (mu_ held). Every
  // insert clears it first, so a missed erase only keeps the slow path.
  void note_quiet_locked();
  // Starts the life's worker unless it runs, and wakes it (mu_ held). When no
  // thread can be started, its attempts are answered UNKNOWN and its held
  // transfers failed (through `calls`, run by the caller once mu_ is released)
  // and the gate closes: nothing waits for a worker that does not exist.
  void start_worker_locked(const Life& life, std::vector<std::function<void()>>& calls);
  // reset() of one life's state (mu_ held); the calls run after it is released.
  void reset_locked(std::map<Life, std::shared_ptr<PeerState>>::iterator it, const std::string& why,
                    bool park, std::vector<std::function<void()>>& calls);
  // Every attempt not told yet is told UNKNOWN (`why`) and kept pending, to
  // learn the truth later; held transfers fail (mu_ held; `calls` run after).
  void tell_unknown_locked(PeerState& p, const std::string& why,
                           std::vector<std::function<void()>>& calls);
  // One attempt not told yet is told UNKNOWN (`why`), counted, and kept
  // (mu_ held; the call runs after it is released).
  void tell_one_unknown_locked(Pending& a, const std::string& why,
                               std::vector<std::function<void()>>& calls);
  // Every transfer held for p is resumed (go) or failed with `why`, after
  // mu_ is released.
  static void resume_held(PeerState& p, bool go, const std::string& why,
                          std::vector<std::function<void()>>& calls);
  // retry_now's request: the gate holds (not fails) transfers until the
  // answer, asked at once (mu_ held).
  void ask_now_locked(const Life& life, PeerState& p, std::vector<std::function<void()>>& calls);
  // Parks `p` (mu_ held) and keeps the parked states within kMaxParked.
  void park_locked(const Life& life, PeerState& p);
  // Whether a reset state of `key`'s life `instance` still has its FENCE out;
  // if so `resume` joins its held transfers (mu_ held).
  bool hold_behind_draining(const std::string& key, uint64_t instance, Resume& resume);
  // An attempt's deadline passed (its Overdue timer): told "unknown" now if no
  // answer came, the gate closes and held transfers fail, as when a request
  // comes back unanswered.
  void overdue(const std::weak_ptr<PeerState>& state, uint64_t attempt);
  // The FENCE of reset state `p` came back: it stops draining and its held
  // transfers go (mu_ held; the calls run after it is released).
  void end_draining(const std::string& key, const std::shared_ptr<PeerState>& p,
                    std::vector<std::function<void()>>& out);

  Ask ask_;
  Registered registered_ = [](const std::string&, uint64_t) { return true; };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  uint64_t next_req_ = 1;
  uint64_t park_seq_ = 0;
  uint64_t next_close_ = 1;  // close() tokens
  Counts counts_;
  std::map<Life, std::shared_ptr<PeerState>> peers_;
  // States dropped by reset() while their worker's FENCE was out: the request
  // may still retire lanes at the target, so transfers to that life wait for it.
  std::multimap<std::string, std::shared_ptr<PeerState>> draining_;
  // peers_ and draining_ both empty (all_open()); written under mu_.
  std::atomic<bool> quiet_{true};
  // The attempts' deadline timers. Before the last member: its thread is
  // joined after the workers', and before the state it uses goes; the
  // destructor drops every Pending (and so every timer) while it still runs.
  Watchdog timers_;
  // Last member: destroyed (its threads joined) before the state they use.
  AsyncRunner workers_;
};

}  // namespace ferry
