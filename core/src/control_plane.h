// SPDX-License-Identifier: Apache-2.0
// One TCP listener per engine: plugin handshakes, notifications a backend cannot
// send itself. Every connection is authenticated (access by descriptor,
// link_auth.h and control_frame.h): the client proves this engine's instance
// secret (it holds our descriptor) and, when we registered its key, its own;
// we prove ours back. An initiator we never registered is admitted when it
// proves our secret. It must finish within kHandshakeTimeout; otherwise it is
// refused, logged with the reason and counted. At most kMaxPendingInbound
// connections may be in the handshake at once (a flood evicts its own source's
// first), so idle sockets cannot pin memory or lock out a good peer. Outbound
// connections are made lazily, one per peer, re-made when the peer went away,
// and check the server's proof before sending anything; one unused for
// `idle_close` is closed by the I/O thread (the server then closes its end), so
// a peer that once needed a fence or a message does not hold a descriptor at
// each end for good.
#pragma once
#include <sys/epoll.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "async_runner.h"
#include "auth.h"
#include "control_frame.h"
#include "ferry/ferry.hpp"
#include "link_auth.h"
#include "log.h"

namespace ferry {

class ControlPlane {
  struct Outbound;  // one peer's connection (below)

 public:
  struct Handlers {
    std::function<void(const std::string& peer, const std::string& plugin, const uint8_t* msg,
                       size_t len)>
        on_plugin;
    // A transfer from `peer` landed here (NOTIFY); `instance`: the life of
    // ours the sender means. What to answer. Runs on the I/O thread.
    std::function<NotifyAck(const std::string& peer, uint64_t uid, int32_t status,
                            uint64_t instance, const NotifySeq& seq)>
        on_notify;
    // A notification message from `peer` (MSG): what to answer. Runs on the I/O
    // thread (it only queues the payload).
    std::function<MsgAck(const std::string& peer, uint64_t instance, uint64_t id,
                         const uint8_t* payload, size_t len)>
        on_message;
    // FENCE from `peer`: fence the listed attempts here; *instance = this engine's
    // instance (the initiator checks it is the life it fenced). Runs on the
    // control plane's fence thread, never on its I/O thread.
    // `wanted`: the life of ours the initiator means; another one's FENCE is
    // answered with our instance and applies nothing.
    std::function<std::vector<FenceResult>(const std::string& peer, uint64_t wanted,
                                           const std::vector<FenceEntry>& entries,
                                           uint64_t* instance)>
        on_fence;
    // This engine's packed EngineDesc, sent when a server asks for it (one-way
    // registration); unset: never sent.
    std::function<std::vector<uint8_t>()> self_desc;
    // A client we did not know presented its descriptor, checked against its
    // proof (its key, its secret): learn it. Runs on the I/O thread. "" when
    // it is learned now or known already under that very secret, else why
    // this connection may not speak for its key (it is closed).
    std::function<std::string(const EngineDesc& desc)> on_peer_desc;
  };
  using Clock = std::chrono::steady_clock;

  static constexpr int kHandshakeTimeoutMs = 5000;
  static constexpr size_t kMaxPendingInbound = 64;
  static constexpr size_t kMaxConnsPerPeer = 16;  // admitted at once; the oldest goes

  // Binds host:port (0 = any free port) and starts the I/O thread. Throws
  // ferry::Error. `auth` (borrowed, outlives this) proves and checks connections.
  // idle_close: an outbound connection unused this long is closed; 0 = never.
  // spin: after a frame arrives, poll this long for the next before sleeping,
  // and for an exchange's answer likewise (EngineConfig::control_spin;
  // 0..kMaxSpin, which the caller checks).
  ControlPlane(std::string self_key, const std::string& host, uint16_t port, Handlers handlers,
               const LinkAuth* auth,
               std::chrono::milliseconds idle_close = std::chrono::seconds(60),
               std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~ControlPlane();
  static constexpr std::chrono::microseconds kMaxSpin{10000};

  uint16_t port() const { return port_; }
  uint64_t rejected() const { return rejected_.load(); }
  // FENCE requests not applied because their sender had closed the connection
  // (it gave up waiting) before the fence thread got to them.
  uint64_t abandoned_fences() const { return abandoned_fences_.load(); }
  // The abstract unix socket this control plane also listens on (no leading
  // NUL), for peers on this host: "" when it could not listen there. Loopback
  // TCP costs more per frame (a NOTIFY on the GPU host: 6-9 us; a raw unix round
  // trip there is 9.8 us p50 against TCP's 15.6).
  const std::string& unix_name() const { return unix_name_; }
  uint64_t unix_connections() const { return unix_connects_.load(); }
  // The core's NOTIFYs sent again on a new connection because the one they
  // went on broke before their answer, and given up unanswered (the peer
  // forgotten, or unreachable for kResendFor).
  struct NotifyCounts {
    uint64_t resent = 0, unconfirmed = 0;
  };
  NotifyCounts notify_counts() const { return {notify_resent_.load(), notify_unconfirmed_.load()}; }
  // NOTIFYs a connection carries unanswered at most: their answers (25
  // bytes each, on a unix socket each its own buffer of under 1 KiB) always
  // fit the sockets' default buffers (208 KiB), so the target never finds an
  // answer it cannot write while we write, e.g. a resent backlog.
  static constexpr size_t kMaxUnanswered = 128;
  // How often the I/O thread looks at connections with NOTIFYs unanswered,
  // and how long it keeps sending them again to a peer that cannot be reached.
  static constexpr std::chrono::milliseconds kWatchUnanswered{200};
  static constexpr std::chrono::seconds kResendFor{60};
  // A peer on this host listens at `name` too (its descriptor's): connections
  // to it try that first and fall back to TCP (another network namespace, where
  // the name is not bound, or no answer). "" forgets it. forget_peer() too.
  void set_same_host_path(const std::string& peer_key, const std::string& name);

  // Send one frame to the peer's control plane; connects (and says HELLO) on
  // first use. Every wait (for another sender to this peer, connect, HELLO) ends
  // by `deadline`. Returns 0 or a FERRY_ERR_* code with *err set: TIMEOUT when
  // the deadline passed, NOT_SENT when nothing left this engine (connect refused,
  // the HELLO was refused or unanswered: no frame of ours was read there).
  int send(const std::string& peer_key, const std::string& host, uint16_t port, CtrlType type,
           const std::vector<uint8_t>& body, std::string* err,
           Clock::time_point deadline = Clock::time_point::max());

  // send(), but only if it cannot block: the connection to the peer is up and
  // nobody else is using it. False when it would have to wait or connect (then
  // nothing was sent); true with *rc set otherwise.
  bool try_send(const std::string& peer_key, CtrlType type, const std::vector<uint8_t>& body,
                int* rc, std::string* err);

  // One frame and its answer on the peer's connection (the one send() uses;
  // MSG -> MSG_ACK), all by `deadline`. 0 with *reply set, or a FERRY_ERR_*
  // code with *err: NOT_SENT when nothing left this engine, TIMEOUT or TRANSPORT
  // when the frame went out but no answer came (the connection is closed then).
  int exchange(const std::string& peer_key, const std::string& host, uint16_t port, CtrlType type,
               const std::vector<uint8_t>& body, CtrlType reply_type, Clock::time_point deadline,
               CtrlFrame* reply, std::string* err);

  // exchange() in two halves, for a sender that must not wait (a plugin's
  // completion thread ending a transfer that carries a message): start_exchange
  // sends the frame now, only if that cannot block - as try_send - and keeps the
  // connection for the answer, which finish_exchange reads later, on another
  // thread maybe (a runner's: no thread hand-off before the frame leaves).
  class Exchange {
   public:
    Exchange() = default;
    Exchange(const Exchange&) = delete;
    Exchange& operator=(const Exchange&) = delete;
    ~Exchange();  // never finished: the answer is not read, the connection closed
    bool started() const { return out_ != nullptr; }

   private:
    friend class ControlPlane;
    std::shared_ptr<Outbound> out_;  // held (busy) until finished
    std::vector<uint8_t> tail_;      // of the frame, what did not fit at once
  };
  // False (nothing sent, *x not started) when it would have to wait or
  // connect, or the frame did not fit the socket now; the caller then uses
  // exchange(). True: the frame is out and *x holds the connection.
  bool start_exchange(const std::string& peer_key, CtrlType type, const std::vector<uint8_t>& body,
                      Exchange* x);
  // Reads the answer to a started exchange and lets the connection go; the
  // returns of exchange() (never NOT_SENT: the frame went out).
  int finish_exchange(Exchange& x, const std::string& peer_key, CtrlType reply_type,
                      Clock::time_point deadline, CtrlFrame* reply, std::string* err);

  // One request and its answer on a connection of its own (FENCE -> FENCE_REPLY),
  // all by `deadline`. 0 with *reply set, or a FERRY_ERR_* code with *err:
  // NOT_SENT when the peer could not be reached at all (nothing listens there:
  // ECONNREFUSED), TIMEOUT when it did not answer in time, TRANSPORT otherwise.
  int request(const std::string& peer_key, const std::string& host, uint16_t port, CtrlType type,
              const std::vector<uint8_t>& body, CtrlType reply_type, Clock::time_point deadline,
              CtrlFrame* reply, std::string* err);

  // Drop connections to and from this peer.
  void forget_peer(const std::string& key);

  // The engine shuts down: every wait of a send, exchange or request - for
  // room, a connection or an answer - ends now, and later ones at once, as if
  // the peer had not answered ("engine shutting down"). A message whose answer
  // was cut ends unknown, rather than holding the engine's destructor to its
  // deadline. Frames that fit the socket still go out (a plugin's farewell).
  void abort_waits();

 private:
  struct Inbound;
  // One sender at a time uses a connection; others wait for it only until their
  // own deadline. (A mutex + condition variable rather than std::timed_mutex,
  // whose try_lock_until ThreadSanitizer cannot follow: pthread_mutex_clocklock.)
  struct Outbound {
    Outbound() = default;
    Outbound(const Outbound&) = delete;
    Outbound& operator=(const Outbound&) = delete;
    // The last holder closes it: forget_peer() never waits for a sender.
    ~Outbound();
    std::mutex mu;
    std::condition_variable free;
    bool busy = false;              // guarded by mu
    int fd = -1;                    // used by the sender holding `busy`
    bool unix_socket = false;       // fd is a same-host unix connection (set with fd)
    Clock::time_point last_used{};  // when `busy` was last released; guarded by mu
    // NOTIFYs sent and not answered yet (NOTIFY_ACK), oldest first: uid and
    // frame. Answers are read when the connection is next used; one that
    // broke first leaves them to go again, first, on the next connection (the
    // target takes a uid once). Used by the holder of `busy`.
    std::deque<std::pair<uint64_t, std::vector<uint8_t>>> unacked;
    CtrlFrameReader answers;  // of this connection: an answer's first bytes read ahead
    std::string host;         // where it was last connected (a resend goes there)
    uint16_t port = 0;
    // Guarded by mu: a resend job is queued for it (watch_unanswered); the
    // peer was forgotten (nothing goes to it again); since when resends fail.
    bool resend_queued = false;
    bool forgotten = false;
    Clock::time_point resend_failing_since{};
    // The control plane's count of NOTIFYs never answered: a forgotten peer's
    // connection that a sender still held when forget_peer() ran adds what it
    // still holds once its last holder lets it go (set by outbound_for).
    std::atomic<uint64_t>* unconfirmed = nullptr;
    // Its NOTIFYs' sequence (NotifySeq): a life of its own (random) and the
    // next seq. A floor must never pass a NOTIFY that was not answered, so
    // where unanswered ones are given up (forget_peer, the resend's 60 s) the
    // sequence starts again under a new life (new_sequence), as it does for a
    // peer's next Outbound. Used by the holder of `busy`.
    uint64_t notify_life = 0;
    uint64_t next_notify_seq = 1;
    // Gives up the unanswered NOTIFYs (counted in *unconfirmed) and starts a
    // new sequence.
    void give_up_unanswered();
    void new_sequence();
    // Closes the connection (its unanswered NOTIFYs stay, to go again).
    void drop();
  };
  // Holds an Outbound's `busy` for its lifetime once acquired.
  class OutboundUse {
   public:
    enum Held { kHeld };
    explicit OutboundUse(Outbound& o) : o_(o) {}
    // Takes over a `busy` acquired earlier (an Exchange's).
    OutboundUse(Outbound& o, Held) : o_(o), held_(true) {}
    ~OutboundUse();
    bool acquire_until(Clock::time_point deadline);
    bool try_acquire();
    void keep() { held_ = false; }  // stays busy past this object (an Exchange holds it)

   private:
    Outbound& o_;
    bool held_ = false;
  };
  struct FenceJob {
    int fd = -1;  // a dup of the inbound connection, owned by the job
    std::string peer;
    uint64_t req = 0, wanted = 0;  // the request's id; the life of ours it means
    std::vector<FenceEntry> entries;
  };
  // FENCEs queued at once per peer, and in all. The fence thread serves the
  // peers in turn, so one that floods waits behind itself, not the others.
  static constexpr size_t kMaxFencesPerPeer = 4;
  static constexpr size_t kMaxFencesQueued = 64;
  void io_loop();
  void accept_all(int listen_fd);
  void arm_listeners(bool on);
  void read_from(int fd);
  void close_inbound(int fd);
  bool handle_frame(Inbound& c, CtrlFrame& f);
  // Answers a frame on its connection (MSG_ACK, NOTIFY_ACK); false when it
  // did not fit (the sender does not read its answers: the caller closes it).
  bool answer(Inbound& c, CtrlType type, const std::vector<uint8_t>& body);
  bool handle_hello(Inbound& c, CtrlFrame& f);
  bool handle_proof(Inbound& c, CtrlFrame& f);
  // The handshake is done: OPEN, frames up to kMaxCtrlBody (kMaxConnsPerPeer).
  void open_admitted(Inbound& c);
  bool handle_peer_desc(Inbound& c, const CtrlFrame& f);
  // Refusals are logged at most 20 per 10 s per (kind, source address): a flood
  // of bad connections must not become a flood of log lines. `from` is
  // address:port; `what` a fixed word for the kind of refusal.
  void warn_from(const char* what, const std::string& from, const std::string& msg);
  bool reject(Inbound& c, const std::string& why, bool answer);
  int expire_handshakes();  // closes overdue handshakes; ms until the next is due, or -1
  int reap_outbound();      // closes idle outbound connections; ms until the next is due, or -1
  // Takes the answers waiting on connections with NOTIFYs unanswered that no
  // sender holds; one found broken is made again, its NOTIFYs sent again, on
  // a thread of resends_ (they would wait for the next transfer to that peer
  // otherwise). ms until the next look, or -1 when none is unanswered.
  int watch_unanswered();
  void resend_later(const std::string& peer_key, const std::shared_ptr<Outbound>& o);
  // A new outbound connection: make sure the I/O thread's wait ends in time to reap it.
  void arm_reaper();
  void evict_oldest_pending();
  // A connected, admitted fd, or -1 with *err and *status (NOT_SENT, TIMEOUT, TRANSPORT).
  // Over the peer's same-host unix socket first where one is known, else (or
  // when that fails) over TCP; *over_unix (where given) says which.
  int connect_and_hello(const std::string& peer_key, const std::string& host, uint16_t port,
                        Clock::time_point deadline, std::string* err, int* status,
                        bool* over_unix = nullptr);
  // The HELLO and auth on a connected blocking fd (closed on failure); `where`
  // names the peer in messages.
  int hello(int fd, const std::string& peer_key, const std::string& where,
            Clock::time_point deadline, std::string* err, int* status);
  std::string same_host_path(const std::string& peer_key);
  void fence_loop();
  // The peer's outbound slot (made on first use).
  std::shared_ptr<Outbound> outbound_for(const std::string& peer_key);
  std::shared_ptr<Outbound> existing_outbound(const std::string& peer_key);  // null: none yet
  // One frame now if that cannot block (try_send, start_exchange); BROKEN:
  // part of it may have gone out, the connection is closed. With `tail`, a
  // frame that partly fit is SENT and the rest left there for the caller.
  enum class SendNow { SENT, NOT_SENT, BROKEN };
  SendNow send_now(Outbound& o, const std::string& peer_key, CtrlType type,
                   const std::vector<uint8_t>& body, std::vector<uint8_t>* tail);
  // With o's `busy` held: o.fd is a live, admitted connection (a dead one is
  // re-made); false with *err and *status as connect_and_hello's.
  bool connected(Outbound& o, const std::string& peer_key, const std::string& host, uint16_t port,
                 Clock::time_point deadline, std::string* err, int* status);
  // With o's `busy` held, nothing else awaited on it: reads the answers to
  // its NOTIFYs that have arrived, without waiting. False when the connection
  // is gone or out of step (then closed).
  bool take_answers(Outbound& o, const std::string& peer_key);
  // A NOTIFY_ACK: it answers o's oldest unanswered NOTIFY, or the stream is
  // out of step (false).
  bool answered(Outbound& o, const std::string& peer_key, const CtrlFrame& f);
  // A whole NOTIFY frame went out on o: kept until answered.
  void sent_notify(Outbound& o, const std::string& peer_key, std::vector<uint8_t> frame);
  // Stamps a NOTIFY frame about to leave on `o` with o's NotifySeq: its seq
  // (once: a frame sent again keeps it) and the oldest seq still unanswered
  // on `o` (the holder of `busy` calls it).
  static void stamp_notify(Outbound& o, std::vector<uint8_t>& frame);
  // o was connected again: its unanswered NOTIFYs go first, by the deadline.
  bool resend_unacked(Outbound& o, Clock::time_point deadline);
  // With o's `busy` held: waits (by the deadline) until fewer than
  // kMaxUnanswered NOTIFYs are unanswered on it, taking their answers. False:
  // not by the deadline (TIMEOUT) or the connection is gone (closed), *err set.
  int wait_for_room(Outbound& o, const std::string& peer_key, Clock::time_point deadline,
                    std::string* err);
  // The answer to a frame just written on o (exchange, finish_exchange), by
  // the deadline; NOTIFY_ACKs ahead of it are taken on the way. On failure
  // the connection is closed. 0 or a FERRY_ERR_* code with *err.
  int read_reply(Outbound& o, const std::string& peer_key, CtrlType reply_type,
                 Clock::time_point deadline, CtrlFrame* reply, std::string* err);
  // Writes what is left of a frame on o (n bytes, maybe none), then reads its answer.
  int write_and_answer(Outbound& o, const uint8_t* p, size_t n, const std::string& peer_key,
                       CtrlType reply_type, Clock::time_point deadline, CtrlFrame* reply,
                       std::string* err);

  std::string self_key_;
  Handlers handlers_;
  const LinkAuth* auth_;
  uint64_t accept_seq_ = 0;  // I/O thread only
  int listen_fd_ = -1;
  int unix_fd_ = -1;  // the abstract unix listener, or -1
  std::string unix_name_;
  std::mutex paths_mu_;
  std::map<std::string, std::string> same_host_paths_;  // peer key -> its unix name
  int epoll_fd_ = -1;
  // Out of descriptors (EMFILE and the like): the listener leaves the epoll set
  // for a while instead of waking it on every loop (level-triggered: a spin).
  bool listen_armed_ = true;
  std::chrono::steady_clock::time_point accept_paused_until_{};
  uint64_t accept_failures_ = 0;  // since the last warning
  std::chrono::steady_clock::time_point accept_warned_{};
  int wake_fd_ = -1;
  int abort_fd_ = -1;  // abort_waits(): readable once the engine shuts down
  uint16_t port_ = 0;
  const std::chrono::milliseconds idle_close_;
  const std::chrono::microseconds spin_;
  // Events of an epoll_wait(0) poll while the I/O thread polls after a frame
  // (until poll_until_), or 0 when none came by then. A `timeout_ms` >= 0 (the
  // next timer) bounds the poll and is reduced by its time, so a timer due
  // meanwhile is not made late.
  int poll_for_events(epoll_event* evs, int max, int& timeout_ms);
  Clock::time_point poll_until_{};  // I/O thread only
  // True while the I/O thread's wait is bounded by an outbound connection's
  // expiry; a new connection wakes it only when it is not (arm_reaper).
  std::atomic<bool> reaper_armed_{false};
  Clock::time_point next_reap_{};  // the earliest expiry the last scan found; I/O thread only
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> abandoned_fences_{0};
  std::atomic<uint64_t> unix_connects_{0};
  std::atomic<uint64_t> notify_resent_{0}, notify_unconfirmed_{0};
  // Some connection may hold unanswered NOTIFYs (cleared by the watch before
  // it looks; a sender that sets it wakes the I/O thread).
  std::atomic<bool> unanswered_{false};
  Clock::time_point next_watch_{};  // I/O thread only
  // Runs resends (connect, HELLO, the NOTIFYs): threads only while there are
  // some. Emptied first in the destructor.
  std::unique_ptr<AsyncRunner> resends_;
  std::atomic<int> resend_jobs_{0};  // queued or running; at most kMaxResendJobs
  static constexpr int kMaxResendJobs = 4;
  LogLimiter refusal_log_{std::chrono::seconds(10), /*burst=*/20};
  std::mutex in_mu_;
  std::map<int, std::unique_ptr<Inbound>> inbound_;  // by fd; touched by the I/O thread
  std::mutex out_mu_;
  std::map<std::string, std::shared_ptr<Outbound>> outbound_;
  std::mutex fence_mu_;
  std::condition_variable fence_cv_;
  std::map<std::string, std::deque<FenceJob>> fence_jobs_;  // per peer
  std::deque<std::string> fence_turns_;  // peers with jobs, in the order they are served
  size_t fence_queued_ = 0;              // jobs in fence_jobs_
  // The inbound connection whose frame the I/O thread is handling: a handler
  // that forgets its peer (a learned peer's new life) must not cut it.
  int handling_fd_ = -1;  // I/O thread only
  std::thread thread_;
  std::thread fence_thread_;  // serves FENCE requests (they may wait for data lanes)
};

}  // namespace ferry
