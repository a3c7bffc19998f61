// SPDX-License-Identifier: Apache-2.0
// A small fixed pool of I/O threads around one epoll set (issue 20): the
// target's TCP lanes are served here, so an engine's thread count does not
// grow with its peers or their lanes.
//
// Every handler is registered EPOLLONESHOT: one pool thread at a time runs its
// OnEvents (a handler armed again during its turn - as it parks, or by a
// caller that took it for parked - goes to a second thread, which waits for
// the turn to end: Turn), which does non-blocking I/O until the socket has nothing more for
// it and says what to wait for next (or that it is done: the pool then removes
// and deletes it). Any thread may take any ready handler, so one busy lane
// does not hold back the others beyond one turn.
//
// Stalls: a handler in the middle of a frame sets a deadline (SetStall); the
// pool's threads bound their waits while any handler has one, and whichever
// wakes first calls Expire on the late ones (which shut their sockets down:
// the next event ends them). An idle pool - every lane between frames, or no
// lane - waits without a timeout and costs no CPU.
//
// Polling (spin > 0, issue 20 item 2): after a turn, one thread at a time
// keeps polling - the sockets' events without waiting, and the handlers kicked
// (Kick) meanwhile - until `spin` passes with nothing to do, then sleeps like
// the others. While it polls, a kick is a push under a lock nobody holds for
// long: post() queues a frame with no system call and no wake-up, and the next
// frame to arrive is read without a wake-up either. It costs at most one CPU
// for `spin` after the pool's last work.
//
// Watching (issue 19 item 4): a handler that waits only for bytes a peer
// writes into shared memory (a target's ring lane between frames) can be
// watched instead of rung. After such a turn the pool keeps it in a watch list
// and the handler withdraws the sleep it announced (Unsleep), so the peer's
// next frame rings no bell; the polling thread looks at every watched handler
// (Peek: shared indices, no system call) and gives the ready ones a turn -
// the first itself, the others handed to the pool's threads (nudged) - and
// while it runs a turn that may be long (the handler's last was) the others
// are rung as before (RingWhileBusy), so no lane waits behind such a turn.
// Watched handlers stay armed in epoll, so their socket's events (the peer
// gone, a shutdown) still reach the pool. When the poller stops, every
// watched handler announces its sleep again (SleepWatched) - or, where bytes
// came meanwhile, is nudged - before the thread sleeps: an idle pool still
// costs no CPU, and a frame that raced the end is never left unread. With
// poll_every_turn false only such turns make a thread poll (a target that
// polls while the same engine's initiator side does not: the initiator's
// waiting thread reads its answers itself, and a polling pool thread would
// take them from it).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "socket_util.h"

namespace ferry_tcp {

class IoPool {
 public:
  class Handler {
   public:
    virtual ~Handler();
    virtual int fd() const = 0;
    // One pool thread at a time. Returns the epoll events to wait for next
    // (EPOLLIN and/or EPOLLOUT), or 0: finished - the pool deregisters the
    // descriptor and deletes the handler (whose destructor closes it) - or
    // kParked: leave it registered but disarmed; whoever holds its work now
    // re-arms it (Rearm) when done.
    virtual uint32_t OnEvents(uint32_t events) = 0;
    // The stall deadline passed while the handler waited: called from another
    // pool thread, maybe while OnEvents runs; it must only shut its socket down.
    virtual void Expire() = 0;
    // Kick's turn when no thread polls: makes fd() ready for the events
    // kicked for. A socket's EPOLLOUT is ready by itself (nothing to do); a
    // ring lane's wait set is not, and nudges it (an eventfd of its own in the set).
    virtual void Nudge() {}
    // Watching (above). After a turn, on the thread that ran it: the handler
    // now waits only for a peer's bytes it can Peek at. The pool then calls
    // Unsleep (withdraw the sleep announced in the turn) before the handler
    // can have another turn.
    virtual bool WatchesData() const { return false; }
    virtual void Unsleep() {}
    // Any thread, also during the handler's turn: bytes are there to read.
    virtual bool Peek() const { return false; }
    // Any thread, also during a turn: announce the sleep again; false when
    // bytes are there after all (the pool then gives it a turn).
    virtual bool SleepWatched() { return true; }

    // Mid-frame: give up once nothing moved for `timeout` (a stall, as
    // SO_RCVTIMEO measures it). Between frames: ClearStall.
    void SetStall(std::chrono::milliseconds timeout);
    void ClearStall();
    bool stall_set() const { return stall_at_ns_.load() != 0; }

   private:
    friend class IoPool;
    IoPool* pool_ = nullptr;
    std::atomic<int64_t> stall_at_ns_{0};  // steady clock; 0 = none
    // Bumped (release) before every re-arm and read (acquire) before every
    // turn: the kernel already orders one EPOLLONESHOT turn after the re-arm
    // that allows it, but ThreadSanitizer does not see epoll_ctl(MOD) as a
    // release, and would report the handler's state as raced between turns on
    // two pool threads.
    std::atomic<uint64_t> turns_{0};
    // A pool thread runs OnEvents now (Turn). A handler re-armed while in a
    // turn can be handed to a second thread: that one finds this set and
    // waits for the turn's end.
    std::atomic<bool> turning_{false};
    // In the pool's watch list, at this index (under watch_mu_).
    bool watched_ = false;
    size_t watch_index_ = 0;
    // The poller found it ready and nudged it for another pool thread: not
    // looked at again until a turn of it has ended (TurnOwned clears it).
    std::atomic<bool> handed_{false};
    // Its last turn took longer than kLongTurn (RingWhileBusy).
    std::atomic<bool> last_turn_long_{false};
  };

  // threads: the pool's size (>= 1). sweep: how often stalls are looked for
  // while any handler has one. spin: how long a thread polls after the last
  // work (0: never). poll_every_turn: every turn makes its thread poll;
  // false: only a turn after which its handler is watched (above).
  IoPool(int threads, std::chrono::milliseconds sweep,
         std::chrono::microseconds spin = std::chrono::microseconds(0),
         bool poll_every_turn = true);
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  static constexpr uint32_t kParked = 1u << 31;

  bool Start(std::string* err);
  // Registers h for `events`. On failure h is returned in *back (not deleted),
  // *err says why.
  bool Add(std::unique_ptr<Handler> h, uint32_t events, std::unique_ptr<Handler>* back,
           std::string* err);
  // Arms a parked handler again (EPOLLONESHOT: one event, to one thread);
  // false when it is no longer registered.
  // nudge: Handler::Nudge first (under the pool's lock: it is not deleted meanwhile).
  bool Rearm(Handler* h, uint32_t events, bool nudge = false);
  // Gives a parked handler a turn for `events`: the polling thread takes it
  // with no system call while one polls, else Rearm (and the handler's
  // Nudge). false: no longer registered.
  bool Kick(Handler* h, uint32_t events);
  // Kicks several parked handlers (a large transfer's lanes) for the price of
  // one: while a thread polls, as Kick; else the first is re-armed here and
  // the others by the pool thread that wakes for it, before its turn, so
  // post() makes one system call and one wake-up however many lanes it fills
  // (each was 3-10 us of a 4-lane post() on the 2-vCPU VM). Leaves kicks empty.
  using Kicks = std::vector<std::pair<Handler*, uint32_t>>;
  void KickAll(Kicks& kicks);
  // Kicks the polling thread took (a turn given without a system call).
  uint64_t kicks_caught() const { return kicks_caught_.load(std::memory_order_relaxed); }
  // Turns given to watched handlers found ready by a look (no bell rung).
  uint64_t watch_turns() const { return watch_turns_.load(std::memory_order_relaxed); }
  // Turns that began while the handler was still in another thread's turn
  // and waited for its end (a handler re-armed as it parked, or re-armed
  // though it was not parked).
  uint64_t turn_waits() const { return turn_waits_.load(std::memory_order_relaxed); }
  // Joins the threads (a handler in OnEvents finishes its call first), then
  // deletes every handler still registered, from this thread.
  void Stop();
  int threads() const { return static_cast<int>(threads_.size()); }
  size_t handlers() const;

  // The pool size when the settings leave it at 0: half the cores, 1..8.
  static int DefaultThreads();

 private:
  void Main();
  // One turn of h: OnEvents, then re-armed, left parked or finished. True
  // when h is watched after it.
  bool Turn(Handler* h, uint32_t events);
  // The same once h->turning_ is this thread's.
  bool TurnOwned(Handler* h, uint32_t events);
  // After OnEvents, on the turn's thread: h into the watch list or out of it.
  bool UpdateWatch(Handler* h);
  void Unwatch(Handler* h);      // watch_mu_ held
  void ForgetWatch(Handler* h);  // Unwatch if watched, taking watch_mu_
  // The poller: turns for the watched handlers that have bytes. True if any.
  bool TurnWatchedReady();
  // The poller stops: every watched handler sleeps again, or gets a turn.
  void SleepWatched();
  // The poller is about to take a turn of `except` whose last turn was long
  // (kLongTurn): the other watched handlers announce their sleep meanwhile
  // (or are handed to another thread if bytes are there), so a long turn -
  // many or large frames, a GPU frame, a copy that faults - holds none of
  // them back; each withdraws it again after its own next turn.
  void RingWhileBusy(const Handler* except);
  static constexpr std::chrono::microseconds kLongTurn{20};
  // Polls until spin_ passes with nothing to do (one thread at a time).
  void Poll();
  // The poller takes kicks (between its turns) or not (during one).
  void TakeKicks(bool on);
  // kick_mu_ held, a thread taking kicks: queues h's turn for it (Poll).
  void ForPollerLocked(Handler* h, uint32_t events);
  // Re-arms what KickAll left for the pool's threads (any thread back from
  // epoll_wait, before its turn: the first kick's wake-up guarantees one).
  void RearmDeferred();
  void SweepIfDue();
  void Sweep();
  void Finish(Handler* h);

  const int want_threads_;
  const std::chrono::milliseconds sweep_;
  int epfd_ = -1;
  Waker stop_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> stalling_{0};  // handlers with a deadline
  std::atomic<int64_t> last_sweep_ns_{0};
  // handlers_: shared while a handler is used (Rearm, Expire: it is not
  // deleted under it), exclusive to add or remove one. Shared, because every
  // kick and response re-arm holds it across epoll_ctl: with one mutex, post()
  // waited on the pool threads' re-arms (a futex wait in most 64 MiB posts).
  mutable std::shared_mutex mu_;
  std::unordered_map<Handler*, std::unique_ptr<Handler>> handlers_;
  std::mutex sweep_mu_;  // one sweeper at a time
  const std::chrono::microseconds spin_;
  const bool poll_every_turn_;
  // The watch list. Lock order: mu_ before watch_mu_; nothing is taken under watch_mu_.
  std::mutex watch_mu_;
  std::vector<Handler*> watched_;
  std::atomic<bool> watching_{false};  // watched_ is not empty (a hint)
  std::atomic<uint64_t> watch_turns_{0};
  std::mutex kick_mu_;   // poller_, taking_kicks_ and kicked_
  bool poller_ = false;  // a thread is in Poll
  // ... and between turns: a kick goes to kicked_. During a turn of its own a
  // kick re-arms instead, so another thread takes it (on 16 cores, kicks kept
  // for the one poller serialised a large transfer's four lanes: 64 MiB WRITE
  // 11.4 -> 3.9 GB/s).
  bool taking_kicks_ = false;
  std::vector<std::pair<Handler*, uint32_t>> kicked_;
  std::atomic<bool> kicks_waiting_{false};  // kicked_ is not empty (a hint read without the lock)
  std::atomic<uint64_t> kicks_caught_{0};
  std::atomic<uint64_t> turn_waits_{0};
  std::vector<std::pair<Handler*, uint32_t>> deferred_;  // KickAll's rest; under kick_mu_
  std::atomic<bool> deferred_waiting_{false};            // deferred_ is not empty (a hint)
};

}  // namespace ferry_tcp
