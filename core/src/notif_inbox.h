// SPDX-License-Identifier: Apache-2.0
// Target side of notification messages: what arrived, per sender, until the
// application drains it (Engine::get_new_notifications).
//
// Exactly once: a sender has at most one message in flight to us (its outbox
// is serialised, messenger.h) and numbers them upwards, so per sender instance
// the inbox keeps one number - the highest id it has decided on - and what it
// decided. A resend of that id gets the same answer and is not stored twice; a
// lower id is a resend from before a later decision and is ignored; a fence of
// an id we have not taken decides it as refused, so that it can never be taken
// afterwards (the sender then knows it was not delivered).
//
// Bounded: per sender at most max_messages / max_bytes unread, all senders
// together max_total_bytes; a message over a bound is refused (the sender's
// status says so), never a silent drop. Decisions are kept for at most
// max_senders sender keys.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "control_frame.h"

namespace ferry {

struct NotifLimits {
  size_t max_messages = 16384;          // unread, per sender
  size_t max_bytes = 16u << 20;         // unread payload bytes, per sender
  size_t max_total_bytes = 256u << 20;  // unread payload bytes, every sender
  size_t max_senders = 4096;            // senders whose last decision is kept
};

class NotifInbox {
 public:
  using Messages = std::map<std::string, std::vector<std::string>>;
  explicit NotifInbox(NotifLimits limits = {});
  ~NotifInbox();
  NotifInbox(const NotifInbox&) = delete;
  NotifInbox& operator=(const NotifInbox&) = delete;

  // A MSG from `sender` (authenticated key), life `instance`.
  MsgAck deliver(const std::string& sender, uint64_t instance, uint64_t id, const uint8_t* payload,
                 size_t len);
  // A FENCE of message `id` from `sender` life `instance`: WHOLE if it was
  // taken, else NONE (and from now on it is refused).
  FenceState fence(const std::string& sender, uint64_t instance, uint64_t id);

  // Everything unread, by sender, in arrival order; the inbox is empty after.
  Messages drain();
  // drain(), after waiting up to `timeout` for something to arrive.
  Messages wait_drain(std::chrono::milliseconds timeout);
  // Readable (POLLIN) while something is unread; never read it yourself.
  int fd() const { return event_fd_; }

  struct Counts {
    uint64_t received = 0;  // taken into the inbox
    uint64_t refused = 0;   // refused over a bound
    uint64_t unread = 0;    // in the inbox now
  };
  Counts counts() const;
  size_t footprint() const;  // senders whose decisions are kept
  // What a message costs against the byte bounds besides its payload (its
  // std::string and deque slot).
  static constexpr size_t kPerMessageCost = 64;

 private:
  struct Sender {
    uint64_t instance = 0;
    uint64_t high = 0;  // the highest id decided
    MsgAck decided = MsgAck::TAKEN;
    std::deque<std::string> unread;
    size_t unread_bytes = 0;
    uint64_t last_use = 0;  // for evicting decisions when there are too many senders
  };
  Sender& sender_locked(const std::string& key);
  void signal_locked();  // something unread: make fd() readable
  Messages drain_locked();

  const NotifLimits limits_;
  int event_fd_ = -1;
  mutable std::mutex mu_;
  std::condition_variable arrived_;
  std::map<std::string, Sender> senders_;
  uint64_t clock_ = 0;
  size_t total_bytes_ = 0;
  uint64_t unread_ = 0, received_ = 0, refused_ = 0;
  bool signalled_ = false;
};

}  // namespace ferry
