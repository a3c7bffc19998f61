// SPDX-License-Identifier: Apache-2.0
#include "target.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <functional>
#include <optional>

#include "handshake.h"
#include "log.h"
#include "polled_lane.h"
#include "ring_handover.h"
#include "socket_util.h"
#include "thread_name.h"

namespace ferry_tcp {

// One byte of registered memory, copied for a reply. Payload bytes are ordered
// by the protocol through the kernel (acks on sockets, the application's own
// messages), which ThreadSanitizer cannot follow; like the socket calls that
// move every other payload byte (plugins/tcp/tests/tsan.supp), this load is not checked.
__attribute__((no_sanitize("thread"), noinline)) uint8_t PayloadByte(const uint8_t* p) {
  return *static_cast<const volatile uint8_t*>(p);  // volatile: the load stays in here
}

TargetServer::TargetServer(const ferry_host_v1* host, std::string engine_key,
                           const Settings& settings, RegionTable* regions, StagePool* stages,
                           IoPool* pool)
    : host_(host),
      engine_key_(std::move(engine_key)),
      settings_(settings),
      regions_(regions),
      stages_(stages),
      pool_(pool) {}

TargetServer::~TargetServer() { Stop(); }

bool TargetServer::Start(std::string* err) {
  if (ListenTcp(settings_.listen_host, settings_.listen_port, &listen_fd_, &port_, err) != 0) {
    return false;
  }
  if (!stop_waker_.ok()) {
    *err = std::string("eventfd: ") + std::strerror(errno);
    return false;
  }
  if (settings_.same_host_rings) {
    std::string why;
    // Without it, peers on this host use TCP: said, not fatal.
    if (ListenUnix(&unix_fd_, &unix_name_, &why) != 0)
      Log(host_, FERRY_LOG_WARN, "same-host lanes over shared rings are off: %s", why.c_str());
  }
  accept_thread_ = ferry::named_thread("tcp-accept", [this] { AcceptMain(); });
  return true;
}

bool TargetServer::AddPeer(const std::string& key, bool same_host) {
  std::lock_guard lk(mu_);
  // Lanes admitted before see this and check their proof again (LaneStillProven).
  registrations_.fetch_add(1, std::memory_order_acq_rel);
  auto [it, added] = peers_.emplace(key, std::make_shared<TargetPeer>(key, same_host));
  // Served before it was registered: keep what it applied (a fence may ask) and
  // its lanes, whose proofs are checked again before their next frame.
  return added || it->second->Adopt(same_host);
}

void TargetServer::RemovePeer(const std::string& key) {
  std::shared_ptr<TargetPeer> tp;
  {
    std::lock_guard lk(mu_);
    auto it = peers_.find(key);
    if (it == peers_.end()) return;
    tp = std::move(it->second);
    peers_.erase(it);
  }
  tp->Remove();
}

void TargetServer::Stop() {
  {
    std::lock_guard lk(mu_);
    if (stopping_) return;
    stopping_ = true;
    stopped_.store(true);
    // shutdown (not close) wakes accept() and every blocked recv; the owners close.
    stop_waker_.Signal();
    for (auto& c : conns_) {
      if (c->fd >= 0) ::shutdown(c->fd, SHUT_RDWR);
    }
  }
  cv_.notify_all();
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  listen_fd_ = -1;
  if (unix_fd_ >= 0) ::close(unix_fd_);
  unix_fd_ = -1;
  // No new connections now; the list is ours.
  for (auto& c : conns_) {
    if (c->thread.joinable()) c->thread.join();
  }
  // Pooled lanes: their sockets are shut down, so each ends at its next event
  // and releases its Conn (ReleaseConn) - before the list goes. A pool that
  // stopped already deleted them.
  {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] {
      return std::none_of(conns_.begin(), conns_.end(),
                          [](const auto& c) { return c->pooled && !c->done; });
    });
  }
  conns_.clear();
  peers_.clear();
}

void TargetServer::ReapLocked() {
  for (auto it = conns_.begin(); it != conns_.end();) {
    Conn& c = **it;
    // It set thread_done as its last act: it has nothing left to do but return.
    if (c.thread_done && c.thread.joinable()) c.thread.join();
    if (c.done && !c.thread.joinable()) {
      it = conns_.erase(it);
    } else {
      ++it;
    }
  }
}

void TargetServer::ReleaseConn(Conn* c) {
  {
    std::lock_guard lk(mu_);
    if (c->fd >= 0) ::close(c->fd);
    c->fd = -1;
    c->done = true;
  }
  cv_.notify_all();  // Stop may be waiting for the pooled lanes
}

int TargetServer::AcceptOne(bool* local) {
  for (;;) {
    pollfd p[3] = {{stop_waker_.fd(), POLLIN, 0}, {listen_fd_, POLLIN, 0}, {unix_fd_, POLLIN, 0}};
    const int n = ::poll(p, unix_fd_ >= 0 ? 3 : 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (p[0].revents != 0) {
      errno = ECANCELED;
      return -1;
    }
    // Both listeners ready: take TCP first this time, the unix one next poll.
    *local = p[1].revents == 0;
    const int fd = accept4(*local ? unix_fd_ : listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    return fd;
  }
}

void TargetServer::AcceptMain() {
  for (;;) {
    bool local = false;
    const int fd = AcceptOne(&local);
    std::unique_lock lk(mu_);
    if (stopping_) {
      if (fd >= 0) ::close(fd);
      return;
    }
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Out of descriptors: the pending connection stays in the backlog; retry
        // when something may have been freed rather than spin on it.
        // Said once per 10 s, with how often it failed meanwhile.
        ++accept_failures_;
        const uint64_t now = host_->now_ns(host_->host_ctx);
        if (accept_warned_ns_ == 0 || now - accept_warned_ns_ >= 10'000'000'000ull) {
          const uint64_t times = accept_failures_;
          accept_failures_ = 0;
          accept_warned_ns_ = now;
          lk.unlock();
          Log(host_, FERRY_LOG_WARN, "accept failed: %s (%llu times since the last report)",
              std::strerror(err), static_cast<unsigned long long>(times));
          lk.lock();
        }
        ReapLocked();
        cv_.wait_for(lk, std::chrono::milliseconds(100), [&] { return stopping_; });
        continue;
      }
      lk.unlock();
      Log(host_, FERRY_LOG_ERROR, "accept failed, no more lanes accepted: %s", std::strerror(err));
      return;
    }
    ReapLocked();
    // A flood of connections that never finish the handshake must not pin a
    // thread each: past the limit, the oldest of the source with the most of
    // them is cut (a flood from one address evicts its own, not a good peer's).
    // Every same-host lane shares one source: "local".
    std::string source = local ? "local:" : PeerAddress(fd);
    source = source.substr(0, source.rfind(':'));
    size_t pending = 0;
    std::map<std::string, size_t> by_source;
    for (auto& c : conns_) {
      if (c->admitted || c->done || c->evicted) continue;
      ++by_source[c->source];
      ++pending;
    }
    Conn* oldest = nullptr;
    if (pending >= kMaxPendingLanes) {
      auto worst =
          std::max_element(by_source.begin(), by_source.end(),
                           [](const auto& a, const auto& b) { return a.second < b.second; });
      for (auto& c : conns_)  // in accept order: the first match is the oldest
        if (!c->admitted && !c->done && !c->evicted && c->source == worst->first) {
          oldest = c.get();
          break;
        }
    }
    if (pending >= kMaxPendingLanes && oldest != nullptr && oldest->fd >= 0) {
      oldest->evicted = true;
      ::shutdown(oldest->fd, SHUT_RDWR);  // its thread logs and counts the refusal
      const std::string cut = oldest->source;
      lk.unlock();
      WarnFrom("evicted", cut + ":",
               "cut a lane from " + cut + " still in its handshake: more than " +
                   std::to_string(kMaxPendingLanes) + " pending");
      lk.lock();
      if (stopping_) {
        ::close(fd);
        return;
      }
    }
    try {
      conns_.push_back(std::make_unique<Conn>());
      Conn* c = conns_.back().get();
      c->fd = fd;
      c->local = local;
      c->source = source;
      c->thread = ferry::named_thread("tcp-serve", [this, c] { Serve(c); });
    } catch (const std::exception& e) {
      if (!conns_.empty() && conns_.back()->fd == fd && !conns_.back()->thread.joinable()) {
        conns_.pop_back();
      }
      ::close(fd);
      lk.unlock();
      Log(host_, FERRY_LOG_WARN, "cannot serve a new lane: %s", e.what());
    }
  }
}

void TargetServer::Serve(Conn* c) {
  int fd;
  {
    std::lock_guard lk(mu_);
    fd = c->fd;
  }
  bool pooled = false;
  try {
    pooled = ServeLane(c, fd, c->local ? "this host (unix socket)" : PeerAddress(fd));
  } catch (const std::exception& e) {
    Log(host_, FERRY_LOG_ERROR, "lane thread failed: %s", e.what());
  }
  std::lock_guard lk(mu_);
  if (!pooled) {  // a pooled lane's socket is the pool's now (ReleaseConn)
    ::close(c->fd);
    c->fd = -1;
    c->done = true;
  }
  c->thread_done = true;
}

std::vector<uint8_t> TargetServer::ErrorFrame(uint64_t req_id, int status, const std::string& msg) {
  wire::Header h;
  h.type = wire::Type::kError;
  h.req_id = req_id;
  h.status = status;
  const std::string text = msg.substr(0, wire::kMaxErrorLen);
  h.payload_len = text.size();
  std::vector<uint8_t> out = wire::EncodeFrameHead(h, {});
  out.insert(out.end(), text.begin(), text.end());
  return out;
}

int TargetServer::SendError(Channel& ch, uint64_t req_id, int status, const std::string& msg) {
  const std::vector<uint8_t> out = ErrorFrame(req_id, status, msg);
  return ch.SendAll(out.data(), out.size());
}

void TargetServer::WarnFrom(const char* what, const std::string& from, const std::string& msg) {
  uint64_t held = 0;
  if (!refusal_log_.Allow(std::string(what) + " " + from.substr(0, from.rfind(':')), &held)) return;
  if (held == 0)
    Log(host_, FERRY_LOG_WARN, "%s", msg.c_str());
  else
    Log(host_, FERRY_LOG_WARN, "%s (%llu more from this address not logged)", msg.c_str(),
        static_cast<unsigned long long>(held));
}

void TargetServer::Refuse(int fd, const std::string& from, const std::string& why, int status) {
  ++rejected_;
  WarnFrom("refused", from, "refusing lane from " + from + ": " + why);
  Channel socket(fd);  // a refusal is always said on the socket, before any ring
  if (SendError(socket, 0, status, why) == 0) {
    // Closing with the initiator's frames unread would reset the connection and
    // could destroy the refusal before it is read; let the initiator close first.
    ::shutdown(fd, SHUT_WR);
    Discard(fd, wire::kMaxPayload);
  }
}

bool TargetServer::Authenticate(int fd, const std::string& key, bool theirs,
                                std::chrono::steady_clock::time_point deadline, std::string* why,
                                LaneProof* kept) {
  const bool ours = LinkAuthAvailable(host_);
  if (ours && !theirs) {
    *why = "engine '" + key +
           "' did not prove access by descriptor (a ferry older than plugin ABI 1.4?)";
    return false;
  }
  if (!ours && theirs) {
    *why = "engine '" + engine_key_ + "' cannot check link proofs (its core predates ABI 1.4)";
    return false;
  }
  if (!ours) return true;
  // AUTH(Ni) follows HELLO at once.
  uint8_t hb[wire::kHeaderSize];
  wire::Header h;
  std::string bad;
  uint8_t ni[wire::kAuthNonceSize];
  int err = RecvAllBy(fd, hb, sizeof(hb), deadline);
  if (err == 0 && (!wire::DecodeHeader(hb, &h, &bad) || h.type != wire::Type::kAuth ||
                   h.payload_len != wire::kAuthNonceSize)) {
    *why = "expected an AUTH challenge after HELLO" + (bad.empty() ? "" : ": " + bad);
    return false;
  }
  if (err == 0) err = RecvAllBy(fd, ni, sizeof(ni), deadline);
  if (err != 0) {
    *why = "auth handshake: " + IoErrorString(err);
    return false;
  }
  uint8_t out[wire::kAuthNonceSize + wire::kAuthProofSize];
  uint8_t* nt = out;
  if (!RandomBytes(nt, wire::kAuthNonceSize)) {
    *why = "no random bytes for an auth challenge";
    return false;
  }
  std::vector<uint8_t> t = wire::AuthTranscript(wire::kAuthTargetLabel, ni, nt, key, engine_key_);
  if (host_->link_prove(host_->host_ctx, key.c_str(), FERRY_LINK_TARGET, t.data(), t.size(),
                        out + wire::kAuthNonceSize) != FERRY_OK) {
    *why = "cannot compute this engine's proof";
    return false;
  }
  wire::Header ah;
  ah.type = wire::Type::kAuth;
  ah.payload_len = sizeof(out);
  std::vector<uint8_t> frame = wire::EncodeFrameHead(ah, {});
  frame.insert(frame.end(), out, out + sizeof(out));
  err = SendAll(fd, frame.data(), frame.size());
  uint8_t proof[wire::kAuthProofSize];
  if (err == 0) err = RecvAllBy(fd, hb, sizeof(hb), deadline);
  if (err == 0 && (!wire::DecodeHeader(hb, &h, &bad) || h.type != wire::Type::kAuth ||
                   h.payload_len != wire::kAuthProofSize)) {
    *why = "expected an AUTH answer" + (bad.empty() ? "" : ": " + bad);
    return false;
  }
  if (err == 0) err = RecvAllBy(fd, proof, sizeof(proof), deadline);
  if (err != 0) {
    *why = "auth handshake: " + IoErrorString(err);
    return false;
  }
  t = wire::AuthTranscript(wire::kAuthInitiatorLabel, ni, nt, key, engine_key_);
  char reason[512] = "";
  if (host_->link_check(host_->host_ctx, key.c_str(), FERRY_LINK_TARGET, t.data(), t.size(), proof,
                        reason, sizeof reason) != FERRY_OK) {
    *why = reason[0] ? reason : "engine '" + key + "' failed authentication";
    return false;
  }
  kept->transcript = std::move(t);
  std::memcpy(kept->proof.data(), proof, sizeof proof);
  return true;
}

bool TargetServer::LaneStillProven(const std::string& key, const LaneProof& kept, uint64_t* seen,
                                   std::string* why) {
  const uint64_t now = registrations_.load(std::memory_order_acquire);
  if (now == *seen || kept.transcript.empty()) return true;
  *seen = now;
  char reason[512] = "";
  if (host_->link_check(host_->host_ctx, key.c_str(), FERRY_LINK_TARGET, kept.transcript.data(),
                        kept.transcript.size(), kept.proof.data(), reason,
                        sizeof reason) == FERRY_OK)
    return true;
  *why = "its handshake no longer proves '" + key + "' now that the key is registered here" +
         (reason[0] ? std::string(": ") + reason : std::string());
  return false;
}

std::shared_ptr<TargetPeer> TargetServer::PeerForLane(const std::string& key, bool authenticated,
                                                      std::string* why) {
  std::lock_guard lk(mu_);
  auto it = peers_.find(key);
  if (it != peers_.end()) return it->second;
  // An initiator the core never registered (real connectors register one way)
  // is served once it proved this engine's descriptor, up to a bound.
  if (!authenticated) {
    *why = "engine '" + key + "' is not a registered peer here";
    return nullptr;
  }
  size_t unregistered = 0;
  for (const auto& [k, tp] : peers_) unregistered += tp->registered() ? 0 : 1;
  if (unregistered >= kMaxUnregisteredPeers) {
    *why = "engine '" + key + "' is not registered here and " +
           std::to_string(kMaxUnregisteredPeers) + " unregistered initiators already are";
    return nullptr;
  }
  auto tp = std::make_shared<TargetPeer>(key, /*same_host=*/false, /*registered=*/false);
  peers_.emplace(key, tp);
  return tp;
}

bool TargetServer::ServeLane(Conn* c, int fd, const std::string& from) {
  if (!c->local) {
    SetNoDelay(fd);
    SetKeepAlive(fd, settings_.keepalive_s);
  }
  // The whole handshake (HELLO, key, auth) must finish within the connect
  // timeout, however its bytes trickle in; after it, a frame that stops moving
  // for io_timeout_ms is given up on.
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(settings_.connect_timeout_ms);
  SetIoTimeout(fd, std::min(settings_.io_timeout_ms, settings_.connect_timeout_ms));

  uint8_t hb[wire::kHeaderSize];
  wire::Header h;
  std::string why;
  int err = RecvAllBy(fd, hb, sizeof(hb), deadline);
  if (err != 0) {
    ++rejected_;
    WarnFrom("hello", from, "closing lane from " + from + " before HELLO: " + IoErrorString(err));
    return false;
  }
  if (!wire::DecodeHeader(hb, &h, &why) || h.type != wire::Type::kHello) {
    if (why.empty()) why = std::string("got ") + wire::TypeName(h.type) + " before HELLO";
    ++rejected_;
    WarnFrom("handshake", from, "closing lane from " + from + ": " + why);
    return false;
  }
  const bool wants_auth = (h.flags & wire::kFlagAuth) != 0;
  const uint64_t hello_clock = h.expires_ns;
  std::string key(h.payload_len, '\0');
  err = RecvAllBy(fd, key.data(), key.size(), deadline);
  if (err != 0) {
    ++rejected_;
    WarnFrom("handshake", from, "closing lane from " + from + ": " + IoErrorString(err));
    return false;
  }
  // A registration from here on makes the lane check its proof again.
  uint64_t registrations_seen = registrations_.load(std::memory_order_acquire);
  LaneProof proven;
  if (!Authenticate(fd, key, wants_auth, deadline, &why, &proven)) {
    Refuse(fd, from, why);
    return false;
  }
  const std::string not_peer = "engine '" + key + "' is not a registered peer here";
  std::shared_ptr<TargetPeer> tp = PeerForLane(key, LinkAuthAvailable(host_), &why);
  if (!tp) {
    Refuse(fd, from, why);
    return false;
  }
  if (!tp->Attach(fd)) {
    Refuse(fd, from, not_peer);
    return false;
  }
  if (!LaneStillProven(key, proven, &registrations_seen, &why)) {
    tp->Detach(fd);
    Refuse(fd, from, why);
    return false;
  }
  // A same-host lane switches to the rings its initiator hands over; the
  // socket stays as the lane's identity (fences and revocations shut it down)
  // and its liveness signal.
  std::unique_ptr<Channel> ch;
  if (c->local) {
    shm::Ring out, in;
    std::unique_ptr<direct::Process> initiator;
    std::string no_direct;
    if (!AcceptRings(fd, deadline, settings_.same_host_direct, &out, &in, &initiator, &why,
                     &no_direct)) {
      tp->Detach(fd);
      Refuse(fd, from, why, FERRY_ERR_UNSUPPORTED);
      return false;
    }
    ch = std::make_unique<Channel>(fd, std::move(out), std::move(in),
                                   std::chrono::milliseconds(settings_.io_timeout_ms));
    ch->SetSpin(std::chrono::microseconds(settings_.ring_spin_us));
    ++ring_lanes_;
    if (initiator) {
      Log(host_, FERRY_LOG_DEBUG, "ring lane from %s: direct copies with pid %d", from.c_str(),
          static_cast<int>(initiator->pid()));
      ch->EnableDirect(std::move(initiator));
      ++direct_lanes_;
    } else {
      Log(host_, FERRY_LOG_DEBUG, "ring lane from %s: no direct copies: %s", from.c_str(),
          no_direct.c_str());
    }
  } else {
    ch = std::make_unique<Channel>(fd);
  }
  // Request expiries are compared on our clock. An initiator on this kernel
  // shares it (steady_clock is CLOCK_MONOTONIC). Another host's is mapped by the
  // clock its HELLO carried: the HELLO's transit time, or our being stopped
  // before reading it, makes that err late (fewer frames dropped), never early;
  // the fence stays the exact answer either way.
  int64_t clock_offset = 0;
  if (!tp->same_host() && hello_clock != 0)
    clock_offset =
        static_cast<int64_t>(host_->now_ns(host_->host_ctx)) - static_cast<int64_t>(hello_clock);
  {
    std::lock_guard lk(mu_);
    c->admitted = true;
  }
  SetIoTimeout(fd, settings_.io_timeout_ms);
  LaneCtx ctx{tp, key, "'" + key + "' (" + from + ")", clock_offset};
  Log(host_, FERRY_LOG_DEBUG, "lane from %s open", ctx.who.c_str());

  {
    // From here on the I/O pool serves it (a ring lane through its wait set:
    // the rings' bells and the socket): this thread ends.
    std::string err_msg;
    if (SetNonBlocking(fd, true) && ch->WaitSet() >= 0) {
      std::unique_ptr<IoPool::Handler> back;
      auto lane = std::make_unique<PolledLane>(this, c, std::move(ch), ctx, from, proven,
                                               registrations_seen);
      {
        std::lock_guard lk(mu_);
        c->pooled = true;
      }
      if (pool_->Add(std::move(lane), PolledLane::kFirstEvents, &back, &err_msg)) return true;
      {
        std::lock_guard lk(mu_);
        c->pooled = false;
      }
      // The lane's destructor would release the Conn: take the lane back apart
      // (its channel with it) and serve it here.
      auto* lane_back = static_cast<PolledLane*>(back.get());
      lane_back->Disown();
      ch = lane_back->TakeChannel();
    } else {
      err_msg = std::strerror(errno);
    }
    Log(host_, FERRY_LOG_WARN, "lane from %s served by its own thread: %s", ctx.who.c_str(),
        err_msg.c_str());
    SetNonBlocking(fd, false);
  }

  std::vector<uint8_t> item_buf;
  std::vector<wire::Item> items;
  std::vector<uint64_t> addrs;
  std::string close_why;
  // From here on the lane carries frames only: read them with read-ahead, so a
  // small request costs one recv() rather than three.
  const std::unique_ptr<ByteReader> reader = ch->Reader();
  ByteReader& in = *reader;
  for (;;) {
    err = in.Read(hb, sizeof(hb), /*idle_ok=*/true);
    if (err != 0) {
      if (err == kEof) {
        Log(host_, FERRY_LOG_DEBUG, "lane from %s closed", ctx.who.c_str());
      } else {
        close_why = IoErrorString(err);
      }
      break;
    }
    close_why = AcceptHead(hb, key, proven, &registrations_seen, ch->direct_peer() != nullptr, &h);
    if (!close_why.empty()) break;
    item_buf.resize(BodyBytes(h));
    err = in.Read(item_buf.data(), item_buf.size());
    if (err != 0) {
      close_why = IoErrorString(err);
      break;
    }
    close_why = AcceptItems(h, item_buf, &items, &addrs);
    if (!close_why.empty()) break;
    if (!ServeFrame(*ch, in, ctx, h, items, addrs, &close_why)) break;
  }
  if (!close_why.empty()) {
    WarnFrom("closed", from, "closing lane from " + ctx.who + ": " + close_why);
  }
  tp->Detach(fd);
  return false;
}

std::string TargetServer::AcceptHead(const uint8_t* head, const std::string& key,
                                     const LaneProof& proven, uint64_t* registrations_seen,
                                     bool direct_lane, wire::Header* h) {
  std::string why;
  if (!wire::DecodeHeader(head, h, &why)) return "malformed frame: " + why;
  if (h->type != wire::Type::kWrite && h->type != wire::Type::kRead)
    return std::string("unexpected ") + wire::TypeName(h->type) + " frame";
  if ((h->flags & wire::kFlagDirect) != 0 && !direct_lane)
    return "a direct request on a lane that did not agree to direct copies";
  if (!LaneStillProven(key, proven, registrations_seen, &why)) return why;
  return {};
}

size_t TargetServer::BodyBytes(const wire::Header& h) {
  const size_t per_item =
      wire::kItemSize + ((h.flags & wire::kFlagDirect) != 0 ? wire::kAddrSize : 0);
  return size_t{h.n_items} * per_item;
}

std::string TargetServer::AcceptItems(const wire::Header& h, const std::vector<uint8_t>& item_buf,
                                      std::vector<wire::Item>* items,
                                      std::vector<uint64_t>* addrs) {
  std::string why;
  uint64_t total = 0;
  if (!wire::DecodeItems(item_buf.data(), h.n_items, items, &total, &why))
    return "malformed frame: " + why;
  if ((h.flags & wire::kFlagDirect) != 0) {
    // The addresses are the initiator's own: whatever they say, the copy
    // reaches only its memory (direct_copy.h).
    wire::DecodeAddrs(item_buf.data() + size_t{h.n_items} * wire::kItemSize, h.n_items, addrs);
    return {};
  }
  addrs->clear();
  if (h.type == wire::Type::kWrite && total != h.payload_len)
    return "malformed frame: WRITE items do not add up to its payload";
  return {};
}

bool TargetServer::Count(const LaneCtx& ctx, const wire::Header& h, int frame_status,
                         std::string* close_why) {
  int report = FERRY_OK;
  std::string why;
  const TargetPeer::Count c = ctx.tp->CountFrame(h, frame_status, &report, &why);
  if (c == TargetPeer::Count::kBad) {
    *close_why = "malformed frame: " + why;
    return false;
  }
  if (c == TargetPeer::Count::kReport && host_->inbound != nullptr) {
    host_->inbound(host_->host_ctx, ctx.key.c_str(), h.uid, report);
  }
  return true;
}

bool TargetServer::ServeFrame(Channel& ch, ByteReader& in, const LaneCtx& ctx,
                              const wire::Header& h, const std::vector<wire::Item>& items,
                              const std::vector<uint64_t>& addrs, std::string* close_why) {
  auto count = [&](int frame_status) { return Count(ctx, h, frame_status, close_why); };
  int status = FERRY_OK;
  std::string reason;
  const Outcome out = ServeRequest(ch, in, *ctx.tp, h, items, addrs, count, ctx.clock_offset,
                                   &status, &reason, close_why);
  if (out == Outcome::kCloseLane) return false;
  int err = 0;
  if (out == Outcome::kRefused) {
    Log(host_, FERRY_LOG_INFO, "refused %s from %s: %s", wire::TypeName(h.type), ctx.who.c_str(),
        reason.c_str());
    err = SendError(ch, h.req_id, status, reason);
  } else if (h.type == wire::Type::kWrite) {
    wire::Header ack;
    ack.type = wire::Type::kWriteAck;
    ack.req_id = h.req_id;
    uint8_t ab[wire::kHeaderSize];
    wire::EncodeHeader(ack, ab);
    err = ch.SendAll(ab, sizeof(ab));
  }
  if (err != 0) {
    *close_why = "cannot answer: " + IoErrorString(err);
    return false;
  }
  return true;
}

int TargetServer::CheckRequest(const wire::Header& h, const std::vector<wire::Item>& items,
                               std::shared_ptr<Region>* r, std::string* reason) const {
  if (!(*r = regions_->Find(h.region_id)) || !(*r)->KeyIs(h.region_key)) {
    // One answer for both: a wrong key must not tell a prober the id exists.
    r->reset();
    *reason = "memory " + std::to_string(h.region_id) +
              " is not registered (or was deregistered, or the request's key is not its key)";
    return FERRY_ERR_NOT_FOUND;
  }
  if ((h.flags & wire::kFlagDirect) != 0 && (*r)->on_gpu()) {
    // Its initiator was told the region's kind (wire.h MemInfo) and must not ask.
    *reason = "memory " + std::to_string(h.region_id) +
              " is GPU memory: direct copies reach host memory only";
    return FERRY_ERR_UNSUPPORTED;
  }
  for (size_t i = 0; i < items.size(); ++i) {
    if (!(*r)->Contains(items[i].offset, items[i].len)) {
      *reason = "item " + std::to_string(i) + " [" + std::to_string(items[i].offset) + ", +" +
                std::to_string(items[i].len) + ") is outside memory " +
                std::to_string(h.region_id) + " of " + std::to_string((*r)->size()) + " bytes";
      return FERRY_ERR_INVALID_ARGS;
    }
  }
  return FERRY_OK;
}

void TargetServer::EncodeReadDataHead(const wire::Header& req, const std::vector<wire::Item>& items,
                                      uint8_t* out) {
  uint64_t total = 0;
  for (const auto& it : items) total += it.len;
  wire::Header resp;
  resp.type = wire::Type::kReadData;
  resp.req_id = req.req_id;
  resp.payload_len = total;
  wire::EncodeHeader(resp, out);
}

void TargetServer::EncodeDirectReadDone(const wire::Header& req, uint8_t* out) {
  wire::Header resp;
  resp.type = wire::Type::kReadData;
  resp.req_id = req.req_id;
  wire::EncodeHeader(resp, out);
}

int TargetServer::CopyDirect(const Channel& ch, const wire::Header& h,
                             const std::vector<wire::Item>& items,
                             const std::vector<uint64_t>& addrs, const Region& r,
                             std::string* reason, bool* close_lane) {
  const direct::Process& initiator = *ch.direct_peer();
  std::vector<iovec> ours(items.size()), theirs(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    ours[i] = {r.addr() + items[i].offset, items[i].len};
    theirs[i] = {reinterpret_cast<void*>(static_cast<uintptr_t>(addrs[i])), items[i].len};
  }
  *close_lane = true;
  // Its pid names the lane's process only while that has not exited: looked
  // at before any copy, and after a pull (before its bytes count).
  if (initiator.Exited()) {
    *reason = "the initiator exited";
    return FERRY_ERR_TRANSPORT;
  }
  uint64_t moved = 0;
  int err;
  if (h.type == wire::Type::kWrite) {
    err = initiator.Pull(ours.data(), theirs.data(), ours.size(), &moved, reason);
    if (err == 0 && initiator.Exited()) {
      err = ESRCH;
      *reason = "the initiator exited during the copy";
    }
  } else {
    direct::Gate gate = ch.gate();
    if (!gate.BeginPush()) {
      *reason = "the initiator closed the lane to direct copies";
      return FERRY_ERR_TRANSPORT;
    }
    struct PushEnd {  // however the push ends (its reason may fail to allocate)
      direct::Gate& gate;
      ~PushEnd() { gate.EndPush(); }
    } end{gate};
    err = initiator.Push(ours.data(), theirs.data(), ours.size(), &moved, reason);
  }
  if (err == 0) {
    *close_lane = false;
    return FERRY_OK;
  }
  // An address that is not the initiator's, nothing moved: its own mistake,
  // refused as an item out of bounds is. Anything else (part of it moved, the
  // access or the process gone) ends the lane as a break mid-payload does: the
  // initiator fails over, and fences a WRITE to learn what landed.
  *close_lane = !(err == EFAULT && moved == 0);
  return FERRY_ERR_INVALID_ARGS;
}

std::string TargetServer::FencedReason(const wire::Header& h) {
  return "attempt " + std::to_string(h.attempt_id) +
         " expired or was fenced by its initiator: not applied";
}

std::string TargetServer::RevokedReason(const wire::Header& h) {
  return "memory " + std::to_string(h.region_id) + " was deregistered";
}

TargetServer::Outcome TargetServer::ServeRequest(Channel& ch, ByteReader& in, TargetPeer& tp,
                                                 const wire::Header& h,
                                                 const std::vector<wire::Item>& items,
                                                 const std::vector<uint64_t>& addrs,
                                                 const std::function<bool(int)>& count,
                                                 int64_t clock_offset, int* status,
                                                 std::string* reason, std::string* close_why) {
  const bool is_write = h.type == wire::Type::kWrite;
  const bool direct = (h.flags & wire::kFlagDirect) != 0;
  const int fd = ch.fd();  // the lane's identity for fences and revocation
  std::shared_ptr<Region> r;
  if (tp.removed() || stopped_.load(std::memory_order_relaxed)) {
    // The peer was removed or this engine is stopping: both shut the lane's
    // socket down, which ends a TCP lane's next read. A ring lane may still
    // hold frames in its ring; it ends here the same way (the initiator sees
    // the lane lost and may fail over), rather than refusing them one by one.
    return Outcome::kCloseLane;
  }
  *status = CheckRequest(h, items, &r, reason);
  // Removed meanwhile: a backend being removed deregisters its regions right
  // after removing its peers (the core's detach), so "not registered" may be
  // that, not the application's refusal: the lane ends as above instead.
  if (*status == FERRY_ERR_NOT_FOUND && (tp.removed() || stopped_.load(std::memory_order_relaxed)))
    return Outcome::kCloseLane;

  // A WRITE of a fenced attempt is dropped, unread into memory: its initiator
  // has given up on it and was told what had landed. Otherwise EndApply must
  // follow on every path below (Fence() waits for it).
  bool applying = false;
  if (*status == FERRY_OK && is_write) {
    applying = tp.BeginApply(h, fd, clock_offset);
    if (!applying) {
      *status = FERRY_ERR_TIMEOUT;
      *reason = FencedReason(h);
    }
  }
  struct ApplyEnd {  // ends the apply however the frame's serving ends
    TargetPeer& tp;
    const wire::Header& h;
    const std::vector<wire::Item>& items;
    int fd;
    bool active;
    bool whole = false;
    ~ApplyEnd() {
      if (active) tp.EndApply(h, fd, whole, whole ? ItemBytes(items) : 0);
    }
  } apply_end{tp, h, items, fd, applying};

  if (*status == FERRY_OK) {
    std::optional<RegionUse> use(std::in_place, r.get(), fd);
    StagePool::Lease stage;
    if (!use->ok()) {
      *status = FERRY_ERR_NOT_FOUND;
      *reason = RevokedReason(h);
    } else if (r->on_gpu() && !(stage = stages_->Acquire(r->device(), reason))) {
      *status = FERRY_ERR_GPU;
      *reason = "cannot stage GPU memory " + std::to_string(h.region_id) + ": " + *reason;
    } else if (r->on_gpu()) {
      const Outcome out = ServeStaged(ch, in, *r, h, items, *stage, count, close_why);
      use.reset();
      apply_end.whole = out == Outcome::kServed;
      return out;
    } else if (direct) {
      bool close_lane = false;
      *status = CopyDirect(ch, h, items, addrs, *r, reason, &close_lane);
      use.reset();
      if (close_lane) {
        *close_why = *reason;
        return Outcome::kCloseLane;  // a WRITE's apply ends not whole
      }
      if (*status == FERRY_OK && is_write) {
        apply_end.whole = count(FERRY_OK);
        return apply_end.whole ? Outcome::kServed : Outcome::kCloseLane;
      }
      if (*status == FERRY_OK) {
        // Counted before the answer that lets the initiator complete.
        if (!count(FERRY_OK)) return Outcome::kCloseLane;
        uint8_t rb[wire::kHeaderSize];
        EncodeDirectReadDone(h, rb);
        const int err = ch.SendAll(rb, sizeof rb);
        if (err != 0) {
          *close_why = IoErrorString(err);
          return Outcome::kCloseLane;
        }
        return Outcome::kServed;
      }
      // Refused below (an address not the initiator's, nothing moved); a
      // WRITE's apply still ends not whole, as any refused after it began.
    } else {
      std::vector<iovec> iov;
      iov.reserve(items.size() + 1);
      uint8_t rb[wire::kHeaderSize];
      if (!is_write) {
        EncodeReadDataHead(h, items, rb);
        iov.push_back({rb, sizeof(rb)});
      }
      for (const auto& it : items) iov.push_back({r->addr() + it.offset, it.len});
      // Straight between the socket and registered memory: no staging copy.
      if (is_write) {
        const int err = in.ReadIov(iov.data(), iov.size());
        use.reset();
        if (err != 0) {
          *close_why = IoErrorString(err);
          return Outcome::kCloseLane;
        }
        // Counted (the notification recorded) before EndApply: a fence that
        // sees the attempt whole also sees the target told.
        apply_end.whole = count(FERRY_OK);
        return apply_end.whole ? Outcome::kServed : Outcome::kCloseLane;
      }
      // A notify READ holds back its last byte (copied out) until it is counted:
      // the initiator cannot complete before the target has been told, and the
      // target is told only once its memory has been read in full.
      const bool notify = (h.flags & wire::kFlagNotify) != 0;
      uint8_t last = 0;
      if (notify) {
        iovec& tail = iov.back();
        tail.iov_len -= 1;
        last = PayloadByte(static_cast<uint8_t*>(tail.iov_base) + tail.iov_len);
      }
      size_t progress = 0;
      // MSG_MORE: the held-back byte follows at once, so the tail of the data waits
      // for it in the socket and leaves in the same segment - one wake-up of the
      // initiator, not two.
      int err = ch.Send(iov.data(), iov.size(), &progress, notify ? MSG_MORE : 0);
      use.reset();
      if (err == 0 && notify) {
        if (!count(FERRY_OK)) return Outcome::kCloseLane;
        err = ch.SendAll(&last, 1);
      }
      if (err != 0) {
        *close_why = IoErrorString(err);
        return Outcome::kCloseLane;
      }
      return notify || count(FERRY_OK) ? Outcome::kServed : Outcome::kCloseLane;
    }
  }

  // Refused (or fenced): a WRITE's payload is still on its way and must be
  // skipped (a direct one's addresses were read with its items).
  if (is_write && !direct) {
    const int err = in.Discard(h.payload_len);
    if (err != 0) {
      *close_why = IoErrorString(err);
      return Outcome::kCloseLane;
    }
  }
  return count(*status) ? Outcome::kRefused : Outcome::kCloseLane;
}

TargetServer::Outcome TargetServer::ServeStaged(Channel& ch, ByteReader& in, const Region& r,
                                                const wire::Header& h,
                                                const std::vector<wire::Item>& items, Stage& stage,
                                                const std::function<bool(int)>& count,
                                                std::string* close_why) {
  // The protocol of ServeRequest, with the region's bytes passing through the
  // stage: a WRITE is acknowledged once they are on the device, a notify READ
  // holds back its last byte (from the staging buffer) until it is counted.
  std::vector<iovec> mem;
  mem.reserve(items.size());
  for (const auto& it : items) mem.push_back({r.addr() + it.offset, it.len});
  auto lost = [&](int err) {
    *close_why = err == kGpuError ? stage.error() : IoErrorString(err);
    return Outcome::kCloseLane;
  };
  if (h.type == wire::Type::kWrite) {
    const int err = stage.Recv(ch, in, mem.data(), mem.size());
    if (err != 0) return lost(err);
    return count(FERRY_OK) ? Outcome::kServed : Outcome::kCloseLane;
  }
  const bool notify = (h.flags & wire::kFlagNotify) != 0;
  uint8_t rb[wire::kHeaderSize];
  EncodeReadDataHead(h, items, rb);
  iovec head{rb, sizeof(rb)};
  size_t progress = 0;
  int err = ch.Send(&head, 1, &progress, MSG_MORE);
  uint8_t last = 0;
  if (err == 0)
    err = stage.Send(ch, mem.data(), mem.size(), notify ? MSG_MORE : 0, notify ? &last : nullptr);
  if (err != 0) return lost(err);
  if (notify) {
    if (!count(FERRY_OK)) return Outcome::kCloseLane;
    err = ch.SendAll(&last, 1);
    if (err != 0) return lost(err);
    return Outcome::kServed;
  }
  return count(FERRY_OK) ? Outcome::kServed : Outcome::kCloseLane;
}

int TargetServer::Fence(const std::string& key, const uint64_t* ids, size_t n,
                        std::chrono::steady_clock::time_point deadline,
                        ferry_fence_result_v1* out) {
  std::shared_ptr<TargetPeer> tp;
  {
    std::lock_guard lk(mu_);
    auto it = peers_.find(key);
    if (it != peers_.end()) tp = it->second;
  }
  if (!tp) {
    // Not a peer here: its lanes are refused, so nothing of it was or will be applied.
    for (size_t i = 0; i < n; ++i) out[i] = {0, FERRY_FENCE_NONE, 0};
    return FERRY_OK;
  }
  return tp->Fence(ids, n, deadline, out);
}

}  // namespace ferry_tcp
