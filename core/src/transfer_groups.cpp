// SPDX-License-Identifier: Apache-2.0
// One transfer over many region pairs (transfer.h, Transfers::submit_groups).
// Where the route's first backend takes several region pairs in one post
// (plugin ABI 1.7, FERRY_CAP_MULTI_PAIR) the call is one ordinary transfer:
// one attempt, one completion, one fence, the target told once. Otherwise -
// and from the point where a multi-pair transfer fails over to a backend
// without the capability (split) - the parts run through the ordinary
// lifecycle each, with no notification of their own; the last part to end
// decides the call's status, and only when every part landed does the target
// hear of it - its NOTIFY (uid) and the message, each once, after all the data.
#include <algorithm>
#include <mutex>

#include "control_plane.h"
#include "log.h"
#include "transfer.h"

namespace ferry {

namespace {

struct Call {
  std::mutex mu;
  size_t left = 0;
  StatusCode code = StatusCode::SUCCESS;  // the first failure's
  std::string why;                        // every failure, in the order they ended
  std::vector<std::string> histories;     // successes after a failover
};

TransferStatus failed(StatusCode code, std::string msg) {
  TransferStatus s;
  s.Finish(code, std::move(msg));
  return s;
}

std::string part_name(const Transfers::Group& g) {
  return "regions " + std::to_string(g.pair.local->desc.id) + " -> " +
         std::to_string(g.pair.remote->desc.id);
}

}  // namespace

TransferStatus Transfers::submit_groups(std::vector<Group> groups, IovList iov, Op op,
                                        TransferUid uid, std::optional<bool> notify,
                                        std::optional<std::string> message) {
  if (shutting_down_) return failed(StatusCode::ERR_BAD_STATE, "engine is shutting down");
  if (groups.empty()) return failed(StatusCode::ERR_INVALID_ARGS, "empty transfer");
  if (iov.size() > UINT32_MAX) return failed(StatusCode::ERR_INVALID_ARGS, "too many items");
  if (std::string bad = check_message_size(message ? message->size() : 0); !bad.empty())
    return failed(StatusCode::ERR_INVALID_ARGS, bad);
  const auto& peer = groups.front().pair.peer;
  for (const auto& g : groups) {
    if (g.pair.peer != peer)
      return failed(StatusCode::ERR_INVALID_ARGS,
                    "a transfer goes to one remote engine; it names '" + peer->desc.key +
                        "' and '" + g.pair.peer->desc.key + "'");
    if (g.n == 0) return failed(StatusCode::ERR_INVALID_ARGS, "empty part");
  }
  const uint32_t flags = notify.value_or(policy_.notify) ? FERRY_XFER_NOTIFY : 0;
  if (groups.size() == 1) {  // one pair: the ordinary path (a backend may notify natively)
    auto t = make_transfer(op, flags, uid);
    t->message = std::move(message);
    t->iov = std::move(iov);
    t->total = groups.front().bytes;
    return start(groups.front().pair, t);
  }
  // One transfer for every pair when each pair routes the same way (the
  // policy may rank by memory kind and size) and the first backend takes
  // several pairs in one post.
  std::string why;
  const Op rop = op == Op::READ ? Op::READ : Op::WRITE;
  const Route route = route_for(groups.front().pair, rop, groups.front().bytes, why);
  bool one = !route->empty() && (route->front()->caps & FERRY_CAP_MULTI_PAIR);
  for (size_t gi = 1; one && gi < groups.size(); ++gi)
    one = *route_for(groups[gi].pair, rop, groups[gi].bytes, why) == *route;
  if (one) {
    auto t = make_transfer(op, flags, uid);
    t->message = std::move(message);
    t->iov = std::move(iov);
    uint64_t total = 0;
    for (const Group& g : groups) total += g.bytes;
    t->total = total;
    const MemPair first = groups.front().pair;
    t->parts = std::move(groups);
    return start(first, t, &route);
  }
  TransferStatus status;
  status.SetInProgress();
  auto parts = std::make_shared<std::vector<TransferStatus>>();
  PartsSpec spec{
      op == Op::READ ? FERRY_OP_READ : FERRY_OP_WRITE,    uid,     flags != 0, std::move(message),
      std::chrono::steady_clock::now() + policy_.timeout, nullptr, 0};
  start_parts(
      groups, iov.data(), std::move(spec),
      [status](StatusCode code, const std::string& w) mutable { status.Finish(code, w); },
      parts.get());
  // Cancelling the call cancels every part (each ends once nothing of it can land).
  status.SetCanceller([parts] {
    for (const auto& p : *parts) p.Cancel();
  });
  // A wait for the call drives the backend of the first part still in flight
  // (ABI 1.6, where it can): parts end about in order, and one progress() call
  // reports whatever of that backend's work has finished, other parts' too.
  status.SetProgress([parts] {
    for (const auto& p : *parts)
      if (p.InProgress()) return p.Progress();
  });
  return status;
}

void Transfers::start_parts(const std::vector<Group>& groups, const ferry_iov_v1* iov,
                            PartsSpec spec,
                            std::function<void(StatusCode, const std::string&)> done,
                            std::vector<TransferStatus>* statuses) {
  const EngineDesc target = groups.front().pair.peer->desc;
  const bool owes_notify = spec.owes_notify;
  const uint64_t uid = spec.uid;
  const auto deadline = spec.deadline;
  auto call = std::make_shared<Call>();
  call->left = groups.size();
  // The last part to end: the call's outcome, and (all landed) the target told.
  // `notified`: the NOTIFY already went (or none is owed).
  auto tell_target = [this, call, owes_notify, uid, target, deadline, done,
                      message = std::move(spec.message)](bool notified) mutable {
    std::string after;
    for (const auto& h : call->histories) after += (after.empty() ? "after: " : "; ") + h;
    if (owes_notify && !notified) {
      std::string err;
      int rc = FERRY_ERR_TIMEOUT;
      // Queued behind others to this peer until after the deadline: not sent.
      if (std::chrono::steady_clock::now() >= deadline)
        err = "the call's deadline passed before the NOTIFY could leave";
      else
        rc = control_.send(target.key, target.host, target.port, CtrlType::NOTIFY,
                           notify_body(uid, 0, target.instance), &err, deadline);
      if (rc != FERRY_OK) {
        done(StatusCode::ERR_TRANSPORT,
             "the data landed but the target could not be notified: " + err);
        return;
      }
    }
    if (!message) {
      done(StatusCode::SUCCESS, after);
      return;
    }
    messenger_.send({target.key, target.host, target.port, target.instance}, std::move(*message),
                    deadline, [done, after](StatusCode code, const std::string& why) {
                      if (code == StatusCode::SUCCESS)
                        done(code, after);
                      else
                        done(code, "the data landed but its notification message did not: " + why);
                    });
  };
  auto part_ended = [this, call, owes_notify, uid, target, deadline, done,
                     tell = std::move(tell_target)](const std::string& name, StatusCode code,
                                                    const std::string& why) mutable {
    std::unique_lock<std::mutex> lk(call->mu);
    if (code != StatusCode::SUCCESS) {
      if (call->code == StatusCode::SUCCESS) call->code = code;
      call->why += (call->why.empty() ? "" : "; ") + name + ": " + why;
    } else if (!why.empty()) {
      call->histories.push_back(name + " " + why);
    }
    if (--call->left > 0) return;
    lk.unlock();
    if (call->code != StatusCode::SUCCESS) {
      done(call->code, call->why);
      return;
    }
    // What needs no wait happens here (the message is only queued); a NOTIFY
    // that has to connect first goes on a thread of its own, never on a
    // plugin's completion thread.
    if (owes_notify) {
      int rc = FERRY_ERR_BAD_STATE;
      std::string err;
      if (!control_.try_send(target.key, CtrlType::NOTIFY, notify_body(uid, 0, target.instance),
                             &rc, &err)) {
        notifies_.run(target.key, deadline, [tell, done](bool on_runner) mutable {
          if (on_runner) {
            tell(false);
            return;
          }
          // No thread for it: the call ends (its status must not hang), the
          // target not told - the NOTIFY did not leave.
          done(StatusCode::ERR_TRANSPORT,
               "the data landed but the target could not be notified: no thread to send the "
               "NOTIFY on");
        });
        return;
      }
      if (rc != FERRY_OK) {
        done(StatusCode::ERR_TRANSPORT,
             "the data landed but the target could not be notified: " + err);
        return;
      }
    }
    tell(true);
  };
  auto shared_end = std::make_shared<decltype(part_ended)>(std::move(part_ended));
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const Group& g = groups[gi];
    // No flags: the target hears of the call once, after every part.
    auto t = make_transfer(spec.op == FERRY_OP_READ ? Op::READ : Op::WRITE, 0, uid);
    t->iov.assign(iov + g.first, iov + g.first + g.n);
    t->total = g.bytes;
    t->more_follows = gi + 1 < groups.size();
    t->deadline = deadline;
    t->attempts = spec.attempts_used;
    const std::string name = part_name(g);
    t->on_end = [shared_end, name](StatusCode code, const std::string& why) {
      (*shared_end)(name, code, why);
    };
    TransferStatus s = start(g.pair, t, spec.route);
    statuses->push_back(s);
    // Refused before it started (no route, peer gone): finish() never ran for it.
    if (!s.InProgress() && !t->pair.local) (*shared_end)(name, s.Code(), s.Message());
  }
}

void Transfers::split(const TransferPtr& t) {
  // The parts go on from the backend this transfer had come to, with what is
  // left of its attempts and its deadline; the call ends when the last does.
  const Route rest = std::make_shared<const std::vector<BackendPtr>>(
      t->route->begin() + static_cast<ptrdiff_t>(t->next), t->route->end());
  FERRY_LOG(INFO, self_key_,
            "transfer " + std::to_string(t->uid) + " to " + t->pair.peer->desc.key + " goes on " +
                rest->front()->name + " as " + std::to_string(t->parts.size()) +
                " transfers, one per region pair (it takes one pair per post)");
  PartsSpec spec{
      t->op, t->uid,     (t->flags & FERRY_XFER_NOTIFY) != 0, std::move(t->message), t->deadline,
      &rest, t->attempts};
  const std::string before = t->history;
  std::vector<TransferStatus> statuses;
  start_parts(
      t->parts, t->iov.data(), std::move(spec),
      [this, t, before](StatusCode code, const std::string& why) {
        std::string msg = before;
        if (!why.empty()) msg += (msg.empty() ? "" : "; then per region pair: ") + why;
        finish(t, code, code == StatusCode::SUCCESS && !before.empty() ? "after: " + msg : msg);
      },
      &statuses);
  {
    std::lock_guard<std::mutex> lk(t->current_mu);
    t->split = statuses;
  }
  // A cancel that came while the parts started saw no parts: it is passed on here.
  if (t->cancelled)
    for (const auto& s : statuses) s.Cancel();
}

}  // namespace ferry
