// SPDX-License-Identifier: Apache-2.0
// One transfer over many region pairs (transfer.h, Transfers::submit_groups):
// the parts run through the ordinary lifecycle with no notification of their
// own; the last part to end decides the call's status, and only when every
// part landed does the target hear of it - its NOTIFY (uid) and the message,
// each once, after all the data.
#include <mutex>

#include "control_plane.h"
#include "transfer.h"

namespace ferry {

namespace {

struct Call {
  TransferStatus status;
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

TransferStatus Transfers::submit_groups(std::vector<Group> groups, Op op, TransferUid uid,
                                        std::optional<bool> notify,
                                        std::optional<std::string> message) {
  if (shutting_down_) return failed(StatusCode::ERR_BAD_STATE, "engine is shutting down");
  if (groups.empty()) return failed(StatusCode::ERR_INVALID_ARGS, "empty transfer");
  if (std::string bad = check_message_size(message ? message->size() : 0); !bad.empty())
    return failed(StatusCode::ERR_INVALID_ARGS, bad);
  const auto& peer = groups.front().pair.peer;
  for (const auto& g : groups) {
    if (g.pair.peer != peer)
      return failed(StatusCode::ERR_INVALID_ARGS,
                    "a transfer goes to one remote engine; it names '" + peer->desc.key +
                        "' and '" + g.pair.peer->desc.key + "'");
    if (g.iov.empty()) return failed(StatusCode::ERR_INVALID_ARGS, "empty part");
  }
  if (groups.size() == 1) {  // one pair: the ordinary path (a backend may notify natively)
    Group& g = groups.front();
    auto t = make_transfer(op, notify.value_or(policy_.notify) ? FERRY_XFER_NOTIFY : 0, uid);
    t->message = std::move(message);
    t->iov = std::move(g.iov);
    return start(g.pair, t);
  }
  const bool owes_notify = notify.value_or(policy_.notify);
  const EngineDesc target = peer->desc;
  auto call = std::make_shared<Call>();
  call->status.SetInProgress();
  call->left = groups.size();
  const auto deadline = std::chrono::steady_clock::now() + policy_.timeout;
  // The last part to end: the call's outcome, and (all landed) the target told.
  // `notified`: the NOTIFY already went (or none is owed).
  auto tell_target = [this, call, owes_notify, uid, target, deadline,
                      message = std::move(message)](bool notified) mutable {
    std::string after;
    for (const auto& h : call->histories) after += (after.empty() ? "after: " : "; ") + h;
    if (owes_notify && !notified) {
      std::string err;
      int rc = control_.send(target.key, target.host, target.port, CtrlType::NOTIFY,
                             notify_body(uid, 0), &err, deadline);
      if (rc != FERRY_OK) {
        call->status.Finish(StatusCode::ERR_TRANSPORT,
                            "the data landed but the target could not be notified: " + err);
        return;
      }
    }
    if (!message) {
      call->status.Finish(StatusCode::SUCCESS, after);
      return;
    }
    messenger_.send({target.key, target.host, target.port, target.instance}, std::move(*message),
                    deadline, [call, after](StatusCode code, const std::string& why) {
                      if (code == StatusCode::SUCCESS)
                        call->status.Finish(code, after);
                      else
                        call->status.Finish(
                            code, "the data landed but its notification message did not: " + why);
                    });
  };
  auto part_ended = [this, call, owes_notify, uid, target, tell = std::move(tell_target)](
                        const std::string& name, StatusCode code, const std::string& why) mutable {
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
      call->status.Finish(call->code, call->why);
      return;
    }
    // What needs no wait happens here (the message is only queued); a NOTIFY
    // that has to connect first goes on a thread of its own, never on a
    // plugin's completion thread.
    if (owes_notify) {
      int rc = FERRY_ERR_BAD_STATE;
      std::string err;
      if (!control_.try_send(target.key, CtrlType::NOTIFY, notify_body(uid, 0), &rc, &err)) {
        async_.run([tell]() mutable { tell(false); });
        return;
      }
      if (rc != FERRY_OK) {
        call->status.Finish(StatusCode::ERR_TRANSPORT,
                            "the data landed but the target could not be notified: " + err);
        return;
      }
    }
    tell(true);
  };
  auto shared_end = std::make_shared<decltype(part_ended)>(std::move(part_ended));
  // Cancelling the call cancels every part (each ends once nothing of it can land).
  auto parts = std::make_shared<std::vector<TransferStatus>>();
  call->status.SetCanceller([parts] {
    for (const auto& p : *parts) p.Cancel();
  });
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    auto t =
        make_transfer(op, 0, uid);  // no flags: the target hears of the call once, after every part
    t->iov = std::move(g.iov);
    t->more_follows = gi + 1 < groups.size();
    const std::string name = part_name(g);
    t->on_end = [shared_end, name](StatusCode code, const std::string& why) {
      (*shared_end)(name, code, why);
    };
    TransferStatus s = start(g.pair, t);
    parts->push_back(s);
    // Refused before it started (no route, peer gone): finish() never ran for it.
    if (!s.InProgress() && !t->pair.local) (*shared_end)(name, s.Code(), s.Message());
  }
  // A wait for the call drives the backend of the first part still in flight
  // (ABI 1.6, where it can): parts end about in order, and one progress() call
  // reports whatever of that backend's work has finished, other parts' too.
  call->status.SetProgress([parts] {
    for (const auto& p : *parts)
      if (p.InProgress()) return p.Progress();
  });
  return call->status;
}

}  // namespace ferry
