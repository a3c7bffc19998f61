// SPDX-License-Identifier: Apache-2.0
// One initiator-side data connection to a peer.
//
// A thread connects the lane lazily (never inside post()) - over the peer's
// unix socket and then shared rings when it is on this host, else TCP
// (channel.h) - and says HELLO (authenticating both ways when the host has a
// secret, handshake.h): one of the engine's Connector threads for a lane the
// pool will serve, else the lane's own thread. What happens next depends on
// the connection:
// - with the engine's I/O pool, TCP or rings, the pool serves it (issue 20):
//   the thread ends, a PooledSender on the pool writes queued frames without
//   blocking (waiting for EPOLLOUT when the socket is full - on rings, for
//   the channel's kOut wait set, after announcing the sleep so the target
//   rings once it made room; with sender_spin_us a polling pool thread takes
//   them without a wake-up), the responses are read there too (a ring's
//   kIn wait set), the engine's IdleReaper closes the lane when idle, and
//   whichever of the two pool handlers finishes last retires the connection.
//   An open lane costs no thread;
// - otherwise (no pool, or the pool refused it) the thread stays as the
//   lane's sender and writes frames from its queue with blocking sends, and
//   times the idle close; a receiver thread reads the responses.
// Responses are matched to frames in flight and completed by a
// ResponseReader (responses.h): the I/O pool runs it (or the receiver
// thread) - and a thread waiting for a transfer (progress()), whichever
// comes first. A broken connection fails
// every frame queued or in flight on it, and the next frame submitted
// reconnects.
//
// Locks: send_mu_ (the socket's send side) is taken before mu_ (everything
// else); the I/O pool's lock after both. Frames are resolved - which may
// call host->complete - with no lock held.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "channel.h"
#include "connector.h"
#include "ferry/plugin.h"
#include "gpu_stage.h"
#include "idle_reaper.h"
#include "io_pool.h"
#include "push_waiter.h"
#include "responses.h"
#include "socket_util.h"
#include "xfer.h"

namespace ferry_tcp {

class PostQueue;

// What every lane of one peer needs to know; fixed at peer_add.
struct PeerInfo {
  const ferry_host_v1* host = nullptr;
  std::string key;   // the peer's engine key
  std::string addr;  // host to dial
  uint16_t port = 0;
  std::string label;   // "key (addr:port)" for messages
  std::string my_key;  // sent in HELLO
  int connect_timeout_ms = 5000;
  int keepalive_s = 10;
  StagePool* stages = nullptr;  // for frames whose local memory is on a GPU
  // Same host: the target's unix socket (empty: TCP only) and the size of
  // each of a lane's two rings.
  std::string unix_name;
  uint64_t ring_bytes = 1 << 20;
  int ring_spin_us = 0;
  // Senders poll for the next frame this long after a send (settings.h): a
  // ring lane's own thread; for TCP lanes the I/O pool.
  int sender_spin_us = 0;
  std::atomic<uint64_t>* sender_polls_caught = nullptr;  // polls that caught a frame (counters)
  // A lane with nothing queued or in flight for this long closes, and its
  // threads end (the target's lane thread with it); the next frame reopens it.
  // 0: never.
  int idle_close_ms = 0;
  std::atomic<uint64_t>* ring_lanes_opened = nullptr;  // counted for describe/counters
  // Offer the target direct copies on ring lanes (direct_copy.h); one-frame
  // transfers of host memory both sides with at least direct_min_bytes then
  // go as direct requests. Counted for describe/counters.
  bool offer_direct = false;
  uint64_t direct_min_bytes = 0;
  std::atomic<uint64_t>* direct_lanes_opened = nullptr;
  std::atomic<uint64_t>* direct_frames = nullptr;
  PushWaiter* push_waiter = nullptr;  // completes failed direct READs (push_waiter.h)
  // Reads a TCP lane's responses; null: a receiver thread per lane.
  IoPool* pool = nullptr;
  // Where lanes with frames in flight are found by progress() (with pool).
  ProgressSet* progress = nullptr;
  // Closes idle lanes served by the pool (with pool and idle_close_ms).
  IdleReaper* reaper = nullptr;
  // Connects the lanes the pool will serve (with pool); null: the lane's own thread.
  Connector* connector = nullptr;
  // Where post() leaves an accepted transfer for a waiter or the flusher to
  // hand to the lanes (post_queue.h); null: post() hands it over itself.
  PostQueue* posts = nullptr;
};

class Lane final : public IdleReaper::Target, public Connector::Client {
 public:
  friend class ResponseReader;
  friend class PooledSender;

  Lane(const PeerInfo* info, int index);
  ~Lane() override;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  // Starts the sender thread on first use (again after an idle close) of a
  // lane that has one; throws std::system_error. (A lane the Connector
  // connects queues its connect when its first frame is submitted.)
  void EnsureStarted();
  // With try_direct, a connected lane with nothing queued sends from the
  // calling thread (without blocking) instead of waking the sender thread.
  void Submit(FramePtr f, bool try_direct);
  // Queues frames for the sender thread in one go: one lock and at most one
  // wake-up however many there are (a large transfer's frames on this lane).
  // Takes them (the vector is left empty) unless it throws (std::system_error:
  // no sender thread), when they are still the caller's to fail.
  // kicks (a pool-served lane): where its sender's kick goes, for the caller's
  // IoPool::KickAll over every lane it filled (made with no lane lock held);
  // it must have room for one more (push_back does not throw).
  void SubmitAll(std::vector<FramePtr>& frames, IoPool::Kicks* kicks = nullptr);
  // Its sender thread polls for frames now (sender_spin_us): one submitted is
  // sent without a wake-up.
  bool SenderPolling() const { return spinning_.load(std::memory_order_relaxed); }
  // Frames to resolve once the locks are released (a direct READ through its
  // link's PushWaiter).
  using Doomed = std::vector<std::tuple<FramePtr, int, std::string>>;
  // Drops the connection; everything queued or in flight fails with status/msg.
  void Reset(int status, const std::string& msg);
  // Reset's first half: drops the connection and moves what it carried into
  // *doomed, for the caller to fail (Fail) once every lane it resets is down.
  // Queued frames of transfers with seq >= keep_from (posted after the reset
  // began: the failure of one it aborts already completed elsewhere and the
  // application posted again) stay queued for the next connection.
  void Abort(int status, const std::string& msg, Doomed* doomed, uint64_t keep_from = UINT64_MAX);
  static void Fail(Doomed& doomed);
  // Reset, then join the lane's threads (and wait for the pool to let go of
  // it). Later submissions fail at once.
  void Stop(int status, const std::string& msg);
  // IdleReaper::Target: closes a pool-served connection idle for idle_close_ms.
  bool CloseIfIdle(std::chrono::steady_clock::time_point now) override;

 private:
  enum class State { kDown, kConnecting, kUp, kBroken };

  void SenderMain();
  // Connector::Client: connects while frames are queued and nothing is up.
  void Connect() override;
  // Connected by the Connector, served by the pool (unless it refuses).
  bool UsesConnector() const;
  // Polls for sender_spin_us, without mu_, until a frame is queued; called and
  // returns with mu_ held.
  void SpinForWorkLocked(std::unique_lock<std::mutex>& lk);
  // A ring lane's responses (or a TCP lane's when the pool refused it).
  void ReceiverMain(Channel* chan);
  // Starts reading the new connection's responses: on the pool, else a thread.
  void StartReceiverLocked(Channel* chan);
  // In the progress set exactly while responses are read on the pool and frames are in flight.
  void SyncProgressLocked();
  // A new TCP connection whose responses are on the pool: its sends go there
  // too (true), unless the sender must poll or the pool refuses.
  bool StartPooledSenderLocked();
  // The PooledSender's turn: sends what is queued without blocking (a GPU
  // frame excepted: staging waits on copies), retires the connection once it
  // is over. Returns the events to wait for, IoPool::kParked, or 0 (done).
  uint32_t PoolSend(IoPool::Handler* h);
  // Gives the PooledSender a turn, unless it has one coming; with kicks, the
  // kick is added there for the caller to make.
  void ArmSenderLocked(IoPool::Kicks* kicks = nullptr);
  // Both pool handlers are done with a broken connection: closes it, fails
  // what was in flight, and connects again if frames are queued.
  void RetireLocked(Doomed* doomed);
  // Every user of a broken connection's descriptor is done (send_mu_ held):
  // closes it and moves what was in flight into *doomed; the lane is down.
  void CloseConnectionLocked(Doomed* doomed);
  // The queue's first frame, now sending and in flight; null (and in
  // *doomed) when another frame of its transfer already failed.
  FramePtr TakeQueuedLocked(Doomed* doomed);
  // The connection (kUp or kBroken) is served by the pool: no sender thread.
  bool Pooled() const { return send_handler_ != nullptr; }
  // The frame answered by a response with this id, taken out of the in-flight set.
  FramePtr TakeInflight(uint64_t req_id);
  // The receiving side of the connection is over (status/msg: why): breaks the
  // lane, fails what is in flight (and `current`, the frame it was reading).
  // Its last touch of the lane.
  void ReceiverEnded(int status, const std::string& msg, FramePtr current);
  bool ConnectLocked(std::unique_lock<std::mutex>& lk);
  void StartLocked();
  // Nothing queued, half-sent or awaiting a response.
  bool QuietLocked() const;
  // Connects and says HELLO: over the unix socket with rings when the peer is
  // on this host and reachable so, else over TCP. FERRY_OK with *chan (whose
  // fd() the lane then owns).
  // abort_fd: readable once the connect is to be given up (waker_).
  int Open(int abort_fd, std::unique_ptr<Channel>* chan, std::string* err);
  int SendOne(Frame& f, int flags);
  // A WRITE from GPU memory: the head, then the payload through a stage.
  int SendStaged(Frame& f);
  // A READ's payload into GPU memory; on failure *status/*msg say why the lane breaks.
  int ReceiveStaged(ByteReader& in, Frame& f, int* status, std::string* msg);
  void AfterSendLocked(const FramePtr& f, int err, Doomed* doomed);
  // Makes f a direct request when this connection agreed to direct copies
  // and f qualifies (host memory both ends, direct_min_bytes); before it is in flight.
  void MaybeDirectLocked(Frame& f);
  // Breaks the connection and fails what is queued. reset: an explicit Reset or
  // Stop, which also fails frames queued after an earlier break.
  void BreakLocked(int status, const std::string& msg, Doomed* doomed, bool reset = false,
                   uint64_t keep_from = UINT64_MAX);
  std::string Lost(int err) const;

  const PeerInfo* info_;
  const int index_;

  std::mutex send_mu_;
  std::string gpu_error_;  // why the last staged send failed; guarded by send_mu_
  std::mutex mu_;
  std::condition_variable cv_;
  State state_ = State::kDown;
  int fd_ = -1;                    // written by the sender thread only, under both locks
  std::unique_ptr<Channel> chan_;  // fd_'s byte stream; same rules
  bool started_ = false;
  std::chrono::steady_clock::time_point last_used_;  // a frame queued or answered
  bool stopping_ = false;
  bool abort_connect_ = false;
  bool receiver_done_ = false;
  int reason_status_ = FERRY_OK;  // why the current connection broke
  std::string reason_msg_;
  std::deque<FramePtr> queue_;
  FramePtr partial_;  // half-sent by a direct send; the sender thread finishes it
  std::unordered_map<uint64_t, FramePtr> inflight_;
  std::shared_ptr<PolledResponses> polled_;  // this connection's responses, when on the pool
  std::shared_ptr<Pumpable> pumped_;         // what progress() pumps for it: polled_, or a ring's
  bool in_progress_set_ = false;
  // While the connection is served by the pool (Pooled()): its sends'
  // handler (registered on a dup of fd_, owned by the pool), which has a
  // turn coming or running while send_armed_.
  IoPool::Handler* send_handler_ = nullptr;
  bool send_armed_ = false;
  std::unique_ptr<Waker> waker_;  // aborts a connect in progress; exists only then
  // The sender polls (SpinForWorkLocked; Peer::Post prefers such a lane for a
  // one-frame transfer). work_posted_: a frame was queued since the poll
  // began. Both written under mu_, read without it.
  std::atomic<bool> spinning_{false};
  std::atomic<bool> work_posted_{false};
  std::thread sender_;
  std::thread receiver_;
};

}  // namespace ferry_tcp
