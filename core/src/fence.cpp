// SPDX-License-Identifier: Apache-2.0
#include "fence.h"

#include <algorithm>

#include "control_plane.h"
#include "ferry/plugin.h"
#include "log.h"

namespace ferry {

namespace {

// How long a fence thread waits between two unanswered FENCE requests to a
// target whose attempts have all ended "unknown" (it keeps asking until the
// target answers or is registered again).
constexpr auto kRetryMin = std::chrono::milliseconds(100);
constexpr auto kRetryMax = std::chrono::milliseconds(2000);
// The request retry_now() makes while transfers wait for it: as long as the
// target may take to serve a fence (fence_serve.cpp; tcp lets a frame being
// applied finish for up to 200 ms first), not a short retry's.
constexpr auto kKickedAsk = std::chrono::milliseconds(5000);

const char* state_name(FenceState s) {
  switch (s) {
    case FenceState::NONE:
      return "none of it had landed";
    case FenceState::PARTIAL:
      return "part of it had landed";
    case FenceState::WHOLE:
      return "all of it had landed";
    case FenceState::UNSUPPORTED:
      return "that backend cannot fence there";
    case FenceState::UNKNOWN:
      return "the target could not tell";
  }
  return "?";
}

}  // namespace

// One pending attempt's deadline. Owned by its Pending: gone with it (answered,
// reset), disarmed then.
class Fencer::Overdue final : public WatchItem {
 public:
  Overdue(Fencer* f, std::weak_ptr<PeerState> state, uint64_t attempt)
      : f_(f), state_(std::move(state)), attempt_(attempt) {}
  ~Overdue() override { f_->timers_.disarm(this); }
  void on_deadline() override { f_->overdue(state_, attempt_); }

 private:
  Fencer* const f_;
  const std::weak_ptr<PeerState> state_;
  const uint64_t attempt_;
};

Fencer::Fencer(ControlPlane* control)
    : Fencer([control](const Target& t, const std::vector<uint8_t>& body,
                       Clock::time_point deadline, CtrlFrame* reply, std::string* err) {
        return control->request(t.key, t.host, t.port, CtrlType::FENCE, body, CtrlType::FENCE_REPLY,
                                deadline, reply, err);
      }) {}

Fencer::Fencer(Ask ask) : ask_(std::move(ask)) {}

Fencer::~Fencer() {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    for (auto& [key, p] : peers_) finish_all(*p, "engine shutting down", calls);
    for (auto& [key, p] : draining_) finish_all(*p, "engine shutting down", calls);
    cv_.notify_all();
  }
  for (auto& c : calls) c();
  // workers_ joins the worker threads as the members go (it is the last one).
}

Fencer::PeerState& Fencer::state_for(const Target& t) {
  auto& p = peers_[Life{t.key, t.instance}];
  quiet_.store(false, std::memory_order_seq_cst);
  if (!p) {
    p = std::make_shared<PeerState>();
    p->target = t;
  }
  return *p;
}

void Fencer::note_quiet_locked() {
  quiet_.store(peers_.empty() && draining_.empty(), std::memory_order_seq_cst);
}

Fencer::PeerState* Fencer::find_locked(const std::string& key, uint64_t instance) {
  auto it = peers_.find(Life{key, instance});
  return it == peers_.end() ? nullptr : it->second.get();
}

void Fencer::finish_all(PeerState& p, const std::string& why,
                        std::vector<std::function<void()>>& out) {
  tell_unknown_locked(p, why, out);
  p.pending.clear();  // told, and not kept
}

void Fencer::tell_unknown_locked(PeerState& p, const std::string& why,
                                 std::vector<std::function<void()>>& calls) {
  for (auto& a : p.pending)
    if (!a.reported) tell_one_unknown_locked(a, why, calls);
  resume_held(p, false, why, calls);
}

void Fencer::tell_one_unknown_locked(Pending& a, const std::string& why,
                                     std::vector<std::function<void()>>& calls) {
  ++counts_.unknown;
  a.reported = true;
  calls.push_back([d = std::move(a.done), r = FenceResult{a.attempt, FenceState::UNKNOWN, 0}, why] {
    d(r, why);
  });
  a.done = [](const FenceResult&, const std::string&) {};
}

void Fencer::resume_held(PeerState& p, bool go, const std::string& why,
                         std::vector<std::function<void()>>& calls) {
  for (auto& h : p.held) calls.push_back([h = std::move(h), go, why] { h(go, why); });
  p.held.clear();
}

void Fencer::fence(const Target& t, const std::string& backend, uint64_t attempt,
                   Clock::time_point deadline, Done done) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) {
    lk.unlock();
    done({attempt, FenceState::UNKNOWN, 0}, "engine shutting down");
    return;
  }
  PeerState& p = state_for(t);
  p.pending.push_back({backend, attempt, deadline, std::move(done), false, nullptr});
  if (deadline > Clock::now()) {
    auto timer = std::make_shared<Overdue>(this, peers_[Life{t.key, t.instance}], attempt);
    timers_.arm(timer, deadline);
    p.pending.back().timer = std::move(timer);
  }
  p.parked = false;  // a registered life's fence is asked (what was parked with it too)
  std::vector<std::function<void()>> calls;
  start_worker_locked({t.key, t.instance}, calls);
  lk.unlock();
  for (auto& c : calls) c();
}

void Fencer::fence_later(const Target& t, const std::string& backend, uint64_t attempt,
                         const std::string& why) {
  std::unique_lock<std::mutex> lk(mu_);
  if (stopping_) return;
  PeerState& p = state_for(t);
  // Reported already (the caller ends the transfer unknown): kept only to learn
  // the truth before anything new starts.
  p.pending.push_back({backend, attempt, Clock::now(),
                       [](const FenceResult&, const std::string&) {},
                       /*reported=*/true, nullptr});
  ++counts_.unknown;
  if (p.closed_why.empty()) p.closed_why = why;
  const bool waiting = !p.held.empty() || std::any_of(p.pending.begin(), p.pending.end(),
                                                      [](const Pending& a) { return !a.reported; });
  if (!waiting && !p.running) {
    park_locked({t.key, t.instance}, p);
    return;
  }
  // Attempts of the registered life still wait for their answer (their worker
  // asks on; a deregistration parks them all through reset), or the state was
  // unparked by a registration meanwhile: this one is asked with them.
  std::vector<std::function<void()>> calls;
  start_worker_locked({t.key, t.instance}, calls);
  lk.unlock();
  for (auto& c : calls) c();
}

void Fencer::start_worker_locked(const Life& life, std::vector<std::function<void()>>& calls) {
  const std::shared_ptr<PeerState> p = peers_.at(life);
  if (!p->running) {
    try {
      workers_.run([this, life, p] { run(life, p); });
      p->running = true;
    } catch (const std::exception& e) {
      // No thread to ask the target: what waits for the answer ends now, and
      // the gate stays closed (a registration of the life after a
      // deregistration, or a reopen, tries again) - never a transfer held for
      // a worker that does not exist.
      const std::string why = "peer '" + life.key +
                              "' is fenced: no thread could be started to ask its fence (" +
                              e.what() + ")";
      tell_unknown_locked(*p, why, calls);
      if (p->closed_why.empty()) p->closed_why = why;
      FERRY_LOG(WARN, "fence", why);
    }
  }
  cv_.notify_all();
}

void Fencer::park_locked(const Life& life, PeerState& p) {
  // Not asked until the same life is registered again (retry_now): a dead
  // peer costs no thread and no traffic, only this entry.
  p.parked = true;
  p.parked_seq = ++park_seq_;
  cv_.notify_all();  // a running worker stops at its next turn
  size_t parked = 0;
  auto oldest = peers_.end();
  for (auto it = peers_.begin(); it != peers_.end(); ++it) {
    if (!it->second->parked || it->second->asking) continue;
    ++parked;
    if (oldest == peers_.end() || it->second->parked_seq < oldest->second->parked_seq) oldest = it;
  }
  // Bounded: the oldest goes (its attempts were reported unknown already; a
  // registration of that life then starts without waiting for them).
  if (parked > kMaxParked && oldest != peers_.end() && oldest->first != life) {
    FERRY_LOG(WARN, "fence",
              "forgetting the unanswered fence of deregistered peer '" + oldest->first.key +
                  "' (more than " + std::to_string(kMaxParked) + " such peers)");
    peers_.erase(oldest);
    note_quiet_locked();
  }
}

uint64_t Fencer::close(const Target& t, const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  PeerState& p = state_for(t);
  p.closed_why = why;
  const uint64_t token = next_close_++;
  p.watchdog_closes.insert(token);
  return token;
}

void Fencer::retry_now(const std::string& key, uint64_t instance, bool only_parked) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard<std::mutex> lk(mu_);
    PeerState* found = find_locked(key, instance);
    if (found == nullptr) return;
    PeerState& p = *found;
    if (only_parked && !p.parked) return;
    p.parked = false;  // registered: never evicted as a parked state
    // A gate closed by an answer waits for a new instance; one closed by the
    // watchdog for the plugin's late report (reopen asks then).
    if (p.pending.empty() || p.sticky()) return;
    ask_now_locked({key, instance}, p, calls);
  }
  for (auto& c : calls) c();
}

void Fencer::ask_now_locked(const Life& life, PeerState& p,
                            std::vector<std::function<void()>>& calls) {
  p.closed_why.clear();  // HELD until this request's answer (or its miss)
  p.kicked = true;
  start_worker_locked(life, calls);
}

void Fencer::reopen(const std::string& key, uint64_t instance, uint64_t token) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard<std::mutex> lk(mu_);
    PeerState* found = find_locked(key, instance);
    if (found == nullptr || found->watchdog_closes.erase(token) == 0) return;
    PeerState& p = *found;
    // Another attempt the watchdog ended may still move bytes, or a fence
    // answered that the target cannot tell: the gate stays closed.
    if (!p.watchdog_closes.empty() || p.closed_for_good) return;
    if (!p.pending.empty()) {
      // A fence of this life decides. A registration meanwhile left it to this
      // reopen (retry_now does not ask past a watchdog's close): ask now.
      if (!p.parked) ask_now_locked({key, instance}, p, calls);
      return;
    }
    p.closed_why.clear();
    resume_held(p, true, {}, calls);
    if (p.idle() && !p.running) {  // nothing left of it
      peers_.erase(Life{key, instance});
      note_quiet_locked();
    }
  }
  for (auto& c : calls) c();
}

bool Fencer::hold_behind_draining(const std::string& key, uint64_t instance, Resume& resume) {
  auto [b, e] = draining_.equal_range(key);
  for (auto d = b; d != e; ++d) {
    if (d->second->target.instance != instance) continue;
    d->second->held.push_back(std::move(resume));
    return true;
  }
  return false;
}

Fencer::Gate Fencer::admit(const std::string& key, uint64_t instance, Resume resume,
                           std::string* why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (PeerState* found = find_locked(key, instance)) {
    PeerState& p = *found;
    if (!p.closed_why.empty()) {
      *why = p.closed_why;
      return Gate::CLOSED;
    }
    if (!p.pending.empty()) {
      p.held.push_back(std::move(resume));
      return Gate::HELD;
    }
  }
  return hold_behind_draining(key, instance, resume) ? Gate::HELD : Gate::OPEN;
}

void Fencer::reset(const std::string& key, const std::string& why, bool park) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard<std::mutex> lk(mu_);
    // Every life of the key: the registered one and any older one whose fence
    // was still out (park_locked may forget a parked state, so each is found
    // afresh).
    std::vector<Life> lives;
    for (auto it = peers_.lower_bound(Life{key, 0}); it != peers_.end() && it->first.key == key;
         ++it)
      lives.push_back(it->first);
    for (const Life& life : lives) {
      auto it = peers_.find(life);
      if (it != peers_.end()) reset_locked(it, why, park, calls);
    }
  }
  for (auto& c : calls) c();
}

void Fencer::reset_locked(std::map<Life, std::shared_ptr<PeerState>>::iterator it,
                          const std::string& why, bool park,
                          std::vector<std::function<void()>>& calls) {
  const std::string& key = it->first.key;
  PeerState& p = *it->second;
  const std::string told = why.empty() ? "the peer was registered again or deregistered"
                                       : "the peer was deregistered: " + why;
  // (A gate closed with nothing pending - a backend that cannot fence, the
  // watchdog - is dropped as before: registering the peer again is what
  // reopens it, docs/policy.md.)
  if (park && !p.pending.empty()) {
    // Deregistered: its attempts end unknown now, but stay pending - the same
    // life registered again is fenced before anything new starts to it.
    tell_unknown_locked(p, told, calls);
    if (p.closed_why.empty())
      p.closed_why = "peer '" + key + "' was deregistered with a WRITE of unknown outcome (" +
                     told + "); registering it again fences that WRITE first";
    park_locked(it->first, p);
  } else {
    finish_all(p, told, calls);
    if (p.asking) draining_.emplace(key, it->second);
    peers_.erase(it);
    note_quiet_locked();
    cv_.notify_all();
  }
}

void Fencer::end_draining(const std::string& key, const std::shared_ptr<PeerState>& p,
                          std::vector<std::function<void()>>& out) {
  auto [b, e] = draining_.equal_range(key);
  for (auto d = b; d != e; ++d) {
    if (d->second != p) continue;
    draining_.erase(d);
    note_quiet_locked();
    break;
  }
  resume_held(*p, true, {}, out);
}

Fencer::Counts Fencer::counts() const {
  std::lock_guard<std::mutex> lk(mu_);
  Counts c = counts_;
  // Peers, not lives: an older life fenced beside the registered one is the
  // same peer (lives of one key are adjacent in the map).
  const std::string* last = nullptr;
  for (const auto& [life, p] : peers_) {
    if (p->parked || (p->closed_why.empty() && p->pending.empty())) continue;
    if (last == nullptr || *last != life.key) ++c.gated;
    last = &life.key;
  }
  return c;
}

void Fencer::overdue(const std::weak_ptr<PeerState>& state, uint64_t attempt) {
  std::vector<std::function<void()>> calls;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const std::shared_ptr<PeerState> p = state.lock();
    if (stopping_ || p == nullptr) return;
    auto a = std::find_if(p->pending.begin(), p->pending.end(),
                          [&](const Pending& x) { return x.attempt == attempt; });
    if (a == p->pending.end() || a->reported) return;  // answered, or told already
    // What the worker does once a request comes back unanswered - now, at this
    // attempt's own deadline: the request still out may be one for an attempt
    // due later, which the target (stopped, say) lets run to its end.
    tell_one_unknown_locked(*a, "fence unanswered by the attempt's deadline", calls);
    if (p->closed_why.empty()) {
      p->closed_why = "peer '" + p->target.key + "' is fenced: a WRITE on " + a->backend +
                      " ended with its outcome unknown (its fence was not answered by its "
                      "deadline); transfers to it fail until it answers the fence or a new "
                      "instance of it is registered";
      FERRY_LOG(WARN, "fence", p->closed_why);
    }
    resume_held(*p, false, p->closed_why, calls);
  }
  for (auto& c : calls) c();
}

void Fencer::run(const Life& life, const std::shared_ptr<PeerState>& p) {
  const std::string& key = life.key;
  auto backoff = kRetryMin;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    auto it = peers_.find(life);
    if (stopping_ || it == peers_.end() || it->second != p) return;
    if (p->pending.empty() || p->parked) {
      p->running = false;
      if (p->idle()) {  // answered: an older life's state goes
        peers_.erase(it);
        note_quiet_locked();
      }
      return;
    }
    const bool kicked = p->kicked;  // registered again: ask now, as if for the first time
    if (kicked) {
      p->kicked = false;
      backoff = kRetryMin;
    }
    // Ask for every pending attempt at once, by the earliest deadline still ahead
    // (or, when all have passed and the gate is closed, a retry interval).
    std::vector<FenceEntry> entries;
    auto deadline = Clock::time_point::max();
    const auto now = Clock::now();
    for (const auto& a : p->pending) {
      entries.push_back({a.backend, a.attempt});
      if (a.deadline > now) deadline = std::min(deadline, a.deadline);
    }
    if (deadline == Clock::time_point::max())  // all already "unknown"
      deadline = now + (kicked ? kKickedAsk : backoff);
    const Target t = p->target;
    const uint64_t req = next_req_++;
    ++counts_.fences;
    p->asking = true;
    lk.unlock();

    CtrlFrame reply;
    std::string err;
    int rc = ask_(t, fence_body(req, t.instance, entries), deadline, &reply, &err);
    uint64_t rreq = 0, rinst = 0;
    std::vector<FenceResult> results;
    bool answered = false, gone = false;
    if (rc == FERRY_OK) {
      if (!decode_fence_reply(reply.body, rreq, rinst, results) || rreq != req) {
        err = "malformed FENCE_REPLY from '" + t.key + "'";
      } else if (rinst != t.instance) {
        gone = true;  // another life of the engine answers on that port: the old one is dead
      } else {
        answered = true;
      }
    } else if (rc == FERRY_ERR_NOT_SENT) {
      gone = true;  // nothing listens there any more: the process and its lanes are gone
    }
    // Asked outside mu_ (the registry has a lock of its own).
    const bool registered = answered || gone || registered_(key, t.instance);

    std::vector<std::function<void()>> calls;
    lk.lock();
    p->asking = false;
    it = peers_.find(life);
    if (it == peers_.end() || it->second != p) {
      // Reset meanwhile (its attempts were answered there). The request is back:
      // transfers to a new registration of that life that waited for it start
      // (start_next asks admit() again: another fence may hold them).
      end_draining(key, p, calls);
      lk.unlock();
      for (auto& c : calls) c();
      return;
    }
    if (answered || gone) {
      backoff = kRetryMin;
      std::vector<Pending> left;
      for (auto& a : p->pending) {
        if (std::none_of(entries.begin(), entries.end(),
                         [&](const FenceEntry& e) { return e.attempt == a.attempt; })) {
          left.push_back(std::move(a));  // arrived after the request went out
          continue;
        }
        FenceResult r{a.attempt, FenceState::NONE, 0};
        std::string why;
        if (gone) {
          why = "fence: the target engine is gone (" + (err.empty() ? "new instance" : err) +
                "); nothing more of the attempt can land";
        } else {
          auto m = std::find_if(results.begin(), results.end(),
                                [&](const FenceResult& x) { return x.attempt == a.attempt; });
          if (m == results.end())
            r.state = FenceState::UNKNOWN;
          else
            r = *m;
          why = std::string("fence answered: ") + state_name(r.state);
        }
        if (r.state == FenceState::UNSUPPORTED || r.state == FenceState::UNKNOWN) {
          ++counts_.unknown;
          if (p->closed_why.empty())
            p->closed_why = "peer '" + key + "' is fenced: an earlier WRITE on " + a.backend +
                            " may still land and the target " +
                            (r.state == FenceState::UNSUPPORTED ? "cannot fence that backend"
                                                                : "could not fence it") +
                            "; register a new instance of the peer";
          p->closed_for_good = true;  // only a new instance reopens it
        } else {
          ++counts_.answered;
        }
        if (a.reported) {
          FERRY_LOG(INFO, "fence",
                    "attempt " + std::to_string(a.attempt) + " to '" + key +
                        "', reported with its outcome unknown: " + why);
          continue;
        }
        calls.push_back([d = std::move(a.done), r, why] { d(r, why); });
      }
      p->pending = std::move(left);
      if (p->pending.empty() && !p->sticky()) {
        if (!p->closed_why.empty())
          FERRY_LOG(INFO, "fence", "peer '" + key + "' answered its fence; transfers to it resume");
        p->closed_why.clear();
        resume_held(*p, true, {}, calls);
      } else if (p->pending.empty()) {
        resume_held(*p, false, p->closed_why, calls);
      }
    } else {
      // No answer. Attempts whose deadline passed end "unknown", the gate closes,
      // and this thread keeps asking for them.
      const auto t_now = Clock::now();
      for (auto& a : p->pending) {
        if (a.deadline > t_now || a.reported) continue;
        tell_one_unknown_locked(a, "fence unanswered: " + err, calls);
        if (p->closed_why.empty()) {
          p->closed_why = "peer '" + key + "' is fenced: a WRITE on " + a.backend +
                          " ended with its outcome unknown (" + err +
                          "); transfers to it fail until it answers the fence or a new instance "
                          "of it is registered";
          FERRY_LOG(WARN, "fence", p->closed_why);
        }
      }
      // (Kicked meanwhile: this request went out before the registration; the
      // next one, asked at once, decides.)
      if (p->closed_why.empty() && !p->kicked &&
          std::any_of(p->pending.begin(), p->pending.end(),
                      [](const Pending& a) { return a.reported; })) {
        // Opened by retry_now() for this request, which went unanswered too.
        p->closed_why = "peer '" + key + "' is fenced: a WRITE on " + p->pending.front().backend +
                        " ended with its outcome unknown and the fence is still unanswered (" +
                        err + ")";
      }
      if (!p->closed_why.empty()) resume_held(*p, false, p->closed_why, calls);
      // A life that is not registered (replaced by a new instance), with
      // every attempt told already: parked - it is asked again if that life is
      // registered again (retry_now), and costs no thread or traffic before.
      if (!registered && p->held.empty() &&
          std::all_of(p->pending.begin(), p->pending.end(),
                      [](const Pending& a) { return a.reported; })) {
        FERRY_LOG(INFO, "fence",
                  "instance " + std::to_string(t.instance) + " of '" + key +
                      "' is not registered and did not answer its fence: parked until it is "
                      "registered again");
        park_locked(life, *p);
      }
      // Ask again after a pause (a refused or reset connection answers at once:
      // do not spin), never past the earliest deadline still ahead.
      auto pause = backoff;
      const auto t_after = Clock::now();
      for (const auto& a : p->pending)
        if (a.deadline > t_after)
          pause = std::min(
              pause, std::chrono::duration_cast<std::chrono::milliseconds>(a.deadline - t_after));
      backoff =
          std::min(backoff * 2, std::chrono::duration_cast<std::chrono::milliseconds>(kRetryMax));
      lk.unlock();
      for (auto& c : calls) c();
      calls.clear();
      lk.lock();
      if (pause.count() > 0)
        cv_.wait_for(lk, pause, [&] { return stopping_ || p->kicked || p->parked; });
      continue;
    }
    lk.unlock();
    for (auto& c : calls) c();
    lk.lock();
  }
}

}  // namespace ferry
