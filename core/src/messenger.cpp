// SPDX-License-Identifier: Apache-2.0
#include "messenger.h"

#include <algorithm>

#include "control_frame.h"
#include "control_plane.h"
#include "ferry/plugin.h"

namespace ferry {

static_assert(kMaxNotifPayload == kMaxNotificationBytes, "one limit, said in ferry.hpp");

namespace {

// Of a message's time, this much is kept for its fence.
Messenger::Clock::duration fence_reserve(Messenger::Clock::duration left) {
  return std::clamp<Messenger::Clock::duration>(left / 4, std::chrono::milliseconds(10),
                                                std::chrono::milliseconds(1000));
}

std::string ack_words(MsgAck a) {
  switch (a) {
    case MsgAck::TAKEN:
      return "taken";
    case MsgAck::FULL:
      return "refused: the target's notification inbox holds too much unread from this engine "
             "(it must call get_new_notifications)";
    case MsgAck::FENCED:
      return "not delivered: the target had already refused it (fenced)";
    case MsgAck::STALE:
      return "the target answered for an older message (protocol error)";
  }
  return "?";
}

}  // namespace

Messenger::Messenger(ControlPlane& control, uint64_t self_instance)
    : control_(control), self_instance_(self_instance) {}

Messenger::~Messenger() {
  std::deque<Item> left;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    for (auto& [key, box] : outboxes_) {
      // A draining job ends the rest of its own outbox when it sees stopping_.
      if (box.draining) continue;
      for (auto& it : box.items) left.push_back(std::move(it));
      box.items.clear();
    }
  }
  for (auto& it : left) it.done(StatusCode::ERR_BAD_STATE, "engine is shutting down");
}

void Messenger::send(const Target& t, std::string payload, Clock::time_point deadline, Done done) {
  bool stopping = true;
  uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping = stopping_;
    if (!stopping_) {
      Outbox& box = outboxes_[t.key];
      if (box.draining || !box.items.empty()) {  // behind others: in turn
        box.items.push_back({t, std::move(payload), deadline, std::move(done)});
        return;
      }
      box.draining = true;  // this one first, and the outbox's drain after it
      id = box.next_id++;
    }
  }
  if (stopping) {
    done(StatusCode::ERR_BAD_STATE, "engine is shutting down");
    return;
  }
  // An idle outbox: the message leaves from this thread when it can without
  // waiting (the connection is up and free), and a runner thread reads its
  // answer - no thread hand-off before it is on its way (the hand-off cost a
  // KV request on the GPU host tens of us; docs/benchmarks.md). The job is
  // handed over first and waits for that decision, so that a runner that has
  // no thread fails the message before anything of it was sent.
  auto item = std::make_shared<Item>(Item{t, std::move(payload), deadline, std::move(done)});
  auto launch = std::make_shared<Launch>();
  const std::string key = t.key;
  try {
    runner_.run([this, key, item, id, launch] {
      {
        std::unique_lock<std::mutex> lk(launch->mu);
        launch->cv.wait(lk, [&] { return launch->decided; });
      }
      bool stop = false;
      if (!launch->exchange.started()) {
        std::lock_guard<std::mutex> lk(mu_);
        stop = stopping_;
      }
      if (stop)  // nothing of it went out: as drain() ends a stopping outbox
        item->done(StatusCode::ERR_BAD_STATE, "engine is shutting down");
      else
        deliver(*item, id, launch->exchange.started() ? launch.get() : nullptr);
      drain(key);
    });
  } catch (const std::exception&) {
    // No thread: this message fails unsent; the outbox stays usable.
    item->done(StatusCode::ERR_BAD_STATE, "no thread to send the message on");
    std::deque<Item> left;
    {
      std::lock_guard<std::mutex> lk(mu_);
      Outbox& box = outboxes_[key];
      box.draining = false;
      left.swap(box.items);  // queued meanwhile: they would need the same thread
    }
    for (auto& it : left) it.done(StatusCode::ERR_BAD_STATE, "no thread to send the message on");
    return;
  }
  try {
    const auto now = Clock::now();
    launch->send_until = deadline - fence_reserve(deadline - now);
    if (now < deadline && launch->send_until > now)
      control_.start_exchange(
          key, CtrlType::MSG,
          msg_body(self_instance_, id, item->payload.data(), item->payload.size()),
          &launch->exchange);
  } catch (const std::exception&) {  // (no memory for the frame) the runner sends it
  }
  {
    std::lock_guard<std::mutex> lk(launch->mu);
    launch->decided = true;
  }
  launch->cv.notify_one();
}

void Messenger::drain(const std::string& key) {
  for (;;) {
    Item item;
    uint64_t id = 0;
    bool stopping;
    {
      std::lock_guard<std::mutex> lk(mu_);
      Outbox& box = outboxes_[key];
      if (box.items.empty()) {
        box.draining = false;
        return;
      }
      item = std::move(box.items.front());
      box.items.pop_front();
      id = box.next_id++;
      stopping = stopping_;
    }
    if (stopping)
      item.done(StatusCode::ERR_BAD_STATE, "engine is shutting down");
    else
      deliver(item, id, nullptr);
  }
}

void Messenger::deliver(const Item& item, uint64_t id, Launch* started) {
  const Target& t = item.target;
  const auto now = Clock::now();
  const bool out = started != nullptr;  // it left from send(), by send_until
  if (!out && now >= item.deadline) {
    item.done(StatusCode::ERR_TIMEOUT, "not sent: its deadline passed while earlier messages to '" +
                                           t.key + "' were on their way");
    return;
  }
  const auto send_until =
      out ? started->send_until : item.deadline - fence_reserve(item.deadline - now);
  if (!out && send_until <= now) {  // no time to send and still find out what became of it
    item.done(StatusCode::ERR_TIMEOUT,
              "not sent: too little of its deadline was left to send it to '" + t.key + "'");
    return;
  }
  const auto body = msg_body(self_instance_, id, item.payload.data(), item.payload.size());
  std::string err;
  for (int tries = 0; tries < 2; ++tries) {
    CtrlFrame reply;
    err.clear();
    int rc = tries == 0 && out
                 ? control_.finish_exchange(started->exchange, t.key, CtrlType::MSG_ACK, send_until,
                                            &reply, &err)
                 : control_.exchange(t.key, t.host, t.port, CtrlType::MSG, body, CtrlType::MSG_ACK,
                                     send_until, &reply, &err);
    if (rc == FERRY_ERR_NOT_SENT && tries == 0) {
      // Nothing of this message left (no connection could be made): nothing to find out.
      item.done(StatusCode::ERR_TRANSPORT, "not delivered to '" + t.key + "': " + err);
      return;
    }
    if (rc == FERRY_OK) {
      uint64_t got = 0;
      MsgAck ack;
      if (!decode_msg_ack(reply.body, got, ack) || got != id) {
        err = "malformed answer";
        break;  // find out by the fence
      }
      if (ack == MsgAck::TAKEN)
        item.done(StatusCode::SUCCESS, tries ? "taken after a resend" : "");
      else
        item.done(ack == MsgAck::FULL ? StatusCode::ERR_BAD_STATE : StatusCode::ERR_TRANSPORT,
                  "message to '" + t.key + "' " + ack_words(ack));
      return;
    }
    // It went out (or may have, NOT_SENT on the resend): no answer. Once more,
    // on a new connection, while there is time; the receiver takes an id once.
    if (Clock::now() >= send_until) break;
  }
  std::string why;
  StatusCode code = fence(item, id, why);
  item.done(code,
            code == StatusCode::SUCCESS ? "" : "message to '" + t.key + "': " + err + "; " + why);
}

StatusCode Messenger::fence(const Item& item, uint64_t id, std::string& why) {
  const Target& t = item.target;
  CtrlFrame reply;
  std::string err;
  int rc = control_.request(t.key, t.host, t.port, CtrlType::FENCE,
                            fence_body(id, t.instance, {{kMsgFenceBackend, id}}),
                            CtrlType::FENCE_REPLY, item.deadline, &reply, &err);
  uint64_t req = 0, instance = 0;
  std::vector<FenceResult> results;
  if (rc != FERRY_OK) {
    why = "the fence got no answer either (" + err + "): it may or may not have been taken";
    return StatusCode::ERR_OUTCOME_UNKNOWN;
  }
  if (!decode_fence_reply(reply.body, req, instance, results) || req != id ||
      instance != t.instance || results.size() != 1 || results[0].attempt != id) {
    why = "the fence's answer is not for this message: it may or may not have been taken";
    return StatusCode::ERR_OUTCOME_UNKNOWN;
  }
  if (results[0].state == FenceState::WHOLE) return StatusCode::SUCCESS;
  if (results[0].state == FenceState::NONE) {
    why = "not delivered (the target confirmed it never took it, and never will)";
    return StatusCode::ERR_TRANSPORT;
  }
  why = "the target could not say whether it took it";
  return StatusCode::ERR_OUTCOME_UNKNOWN;
}

}  // namespace ferry
