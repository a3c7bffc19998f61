// SPDX-License-Identifier: Apache-2.0
// Sender side of notification messages (Engine::send_notification, and the
// message attached to a transfer, sent once its data has landed).
//
// Per receiver one outbox, drained in order by one job at a time: a message is
// sent (MSG) and answered (MSG_ACK) on the receiver's control connection before
// the next one goes (the first message of an idle outbox leaves from the thread
// that sends it, when the connection is up and free; a runner thread reads the
// answer), so messages arrive in the order they were queued and the
// receiver needs to remember only the last id it decided on (notif_inbox.h).
// When the answer does not come (a lost connection) the same id is sent once
// more on a new connection (the receiver takes it at most once); when that
// does not answer either, the message is fenced (a FENCE entry "@msg" on a
// connection of its own): the receiver says whether it took it and refuses it
// from then on. So a message ends SUCCESS (taken exactly once), failed (not
// taken, and never will be), or - when even the fence is unanswered by the
// deadline - ERR_OUTCOME_UNKNOWN.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>

#include "async_runner.h"
#include "control_plane.h"
#include "ferry/ferry.hpp"

namespace ferry {

class Messenger {
 public:
  using Clock = std::chrono::steady_clock;
  struct Target {
    std::string key, host;
    uint16_t port = 0;
    uint64_t instance = 0;  // the receiver's life (checked in a fence's answer)
  };
  using Done = std::function<void(StatusCode code, const std::string& why)>;

  Messenger(ControlPlane& control, uint64_t self_instance);
  ~Messenger();  // waits for the jobs in progress; what is still queued fails
  Messenger(const Messenger&) = delete;
  Messenger& operator=(const Messenger&) = delete;

  // Queue `payload` (at most kMaxNotifPayload bytes: the caller checks) for
  // `t`; `done` runs once, on a messenger thread, by `deadline` (plus the time
  // one exchange may take past it).
  void send(const Target& t, std::string payload, Clock::time_point deadline, Done done);

 private:
  struct Item {
    Target target;
    std::string payload;
    Clock::time_point deadline;
    Done done;
  };
  struct Outbox {
    std::deque<Item> items;
    bool draining = false;
    uint64_t next_id = 1;
  };
  void drain(const std::string& key);
  // A message send() tried to send at once: whether it did (decided, then
  // exchange.started()), and by when its answer must come.
  struct Launch {
    std::mutex mu;
    std::condition_variable cv;
    bool decided = false;  // guarded by mu
    ControlPlane::Exchange exchange;
    Clock::time_point send_until{};
  };
  // Sends one message and finds out what became of it; `started`: it went out
  // already (send()), its answer is read first.
  void deliver(const Item& item, uint64_t id, Launch* started);
  StatusCode fence(const Item& item, uint64_t id, std::string& why);

  ControlPlane& control_;
  const uint64_t self_instance_;
  std::mutex mu_;
  std::map<std::string, Outbox> outboxes_;
  bool stopping_ = false;
  AsyncRunner runner_;  // last: its destructor joins jobs that use the rest
};

}  // namespace ferry
