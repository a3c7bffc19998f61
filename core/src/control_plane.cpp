// SPDX-License-Identifier: Apache-2.0
#include "control_plane.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>

#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "hex.h"
#include "log.h"
#include "thread_name.h"

namespace ferry {

struct ControlPlane::Inbound {
  // DESC: authenticated with a secret we do not know; still in the
  // handshake (its deadline, the pending bound) until its descriptor is
  // taken - nothing it sends before is acted on under its key.
  enum class State { HELLO, PROOF, DESC, OPEN };
  int fd = -1;
  State state = State::HELLO;
  std::string peer;    // the key claimed in HELLO; trusted once OPEN
  std::string from;    // address:port, for messages
  std::string source;  // the address alone: whose handshakes a flood evicts
  uint64_t seq = 0;    // accept order (the oldest handshake is evicted first)
  std::chrono::steady_clock::time_point deadline;  // for the handshake
  auth::Nonce client_nonce{}, server_nonce{};
  // The client passed with a secret of its own we do not know: its descriptor
  // (PEER_DESC) must come next (state DESC) and match `self_mac` over `transcript`.
  std::vector<uint8_t> transcript;
  auth::Mac self_mac{};
  CtrlFrameReader reader;
  // The sender closed its end (an answer failed with EPIPE): what it sent
  // before is still read and taken, unanswered, until the end of the stream.
  bool sender_gone = false;
};

namespace {

constexpr int kConnectTimeoutMs = 3000;
constexpr int kHelloTimeoutMs = 3000;
constexpr const char* kServerLabel = "ferry-ctrl-v2 server";
constexpr const char* kClientLabel = "ferry-ctrl-v2 client";
constexpr const char* kTokenHint =
    "set the same EngineConfig::auth_token or FERRY_AUTH_TOKEN on both engines";

std::string address_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  } else if (ss.ss_family == AF_UNIX) {
    // A peer on this host: its process is the source (a flood's handshakes
    // evict its own), as an address is over TCP.
    ucred cred{};
    socklen_t cl = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0)
      return "unix pid " + std::to_string(cred.pid);
    return "unix";
  }
  return std::string(host) + ":" + std::to_string(port);
}

// The abstract unix address `name` (no leading NUL); false when it is too long.
bool unix_address(const std::string& name, sockaddr_un& a, socklen_t& len) {
  a = sockaddr_un{};
  a.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof a.sun_path) return false;
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return true;
}

// A non-blocking abstract unix listener under a random name; -1 when none.
int listen_unix(std::string* name) {
  uint8_t r[8];
  if (!auth::random_bytes(r, sizeof r)) return -1;
  const std::string n = "ferry-ctrl-" + to_hex(r, sizeof r);
  sockaddr_un a{};
  socklen_t len = 0;
  unix_address(n, a, len);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd, 128) != 0) {
    ::close(fd);
    return -1;
  }
  *name = n;
  return fd;
}

// A connected, blocking unix socket to the abstract `name`, or -1 with *err.
// Never waits: a listener that is absent (another network namespace) refuses
// at once, and a full backlog counts as a failure (the caller uses TCP).
int connect_unix(const std::string& name, std::string* err) {
  sockaddr_un a{};
  socklen_t len = 0;
  if (!unix_address(name, a, len)) {
    *err = "bad unix name";
    return -1;
  }
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
    *err = std::strerror(errno);
    if (fd >= 0) ::close(fd);
    return -1;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

bool resolve(const std::string& host, uint16_t port, sockaddr_storage& ss, socklen_t& len) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res)
    return false;
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  len = res->ai_addrlen;
  freeaddrinfo(res);
  return true;
}

bool write_all(int fd, const uint8_t* p, size_t n) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Waits for `events` on fd until `ms` passes, or abort_fd (an eventfd that
// stays readable once the engine shuts down: ControlPlane::abort_waits) fires.
// poll()'s return for fd alone; -1 with errno ECANCELED once aborted.
int poll_or_abort(int fd, short events, int ms, int abort_fd) {
  pollfd pfd[2] = {{fd, events, 0}, {abort_fd, POLLIN, 0}};
  const int r = ::poll(pfd, abort_fd >= 0 ? 2 : 1, ms);
  if (r > 0 && abort_fd >= 0 && (pfd[1].revents & POLLIN)) {
    errno = ECANCELED;
    return -1;
  }
  return r;
}

bool aborted(int abort_fd) {
  pollfd pfd{abort_fd, POLLIN, 0};
  return abort_fd >= 0 && ::poll(&pfd, 1, 0) > 0;
}

// write_all, but ending by `deadline` however little the peer reads (a
// blocking socket: each send is non-blocking, poll waits for room). False on
// error or when the deadline passed (part of the frame may have gone out).
bool write_until(int fd, const uint8_t* p, size_t n, std::chrono::steady_clock::time_point deadline,
                 int abort_fd = -1) {
  while (n > 0) {
    ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
      if (poll_or_abort(fd, POLLOUT, static_cast<int>(std::min<int64_t>(ms, INT32_MAX)), abort_fd) <
              0 &&
          errno != EINTR)
        return false;
      continue;
    }
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Read exactly n bytes by the deadline (the socket is blocking). One deadline
// for the whole read, not one per recv: a peer that trickles a byte at a time
// must not stretch the wait (every caller's wait is bounded by its deadline).
bool read_exact(int fd, uint8_t* p, size_t n, std::chrono::steady_clock::time_point deadline,
                int abort_fd = -1) {
  while (n > 0) {
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())
            .count();
    if (left <= 0) return false;
    int r =
        poll_or_abort(fd, POLLIN, static_cast<int>(std::min<int64_t>(left, INT32_MAX)), abort_fd);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// One whole frame (header, then body) within timeout_ms, all of it; at most
// max_body bytes of body. False with *why on timeout, EOF or a malformed frame.
bool read_frame(int fd, CtrlFrame& out, int timeout_ms, std::string* why,
                uint32_t max_body = kMaxHandshakeBody, int abort_fd = -1) {
  uint8_t hdr[kCtrlHeaderSize];
  CtrlFrameReader reader;
  reader.set_max_body(max_body);
  std::vector<CtrlFrame> frames;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  if (!read_exact(fd, hdr, sizeof hdr, deadline, abort_fd)) {
    *why = aborted(abort_fd) ? "engine shutting down" : "no answer";
    return false;
  }
  if (!reader.feed(hdr, sizeof hdr, frames)) {
    *why = "malformed answer (" + reader.error() + ")";
    return false;
  }
  if (frames.empty()) {
    uint32_t blen = hdr[8] | hdr[9] << 8 | hdr[10] << 16 | static_cast<uint32_t>(hdr[11]) << 24;
    std::vector<uint8_t> body(blen);
    if (!read_exact(fd, body.data(), blen, deadline, abort_fd) ||
        !reader.feed(body.data(), blen, frames) || frames.size() != 1) {
      *why = aborted(abort_fd) ? "engine shutting down" : "truncated answer";
      return false;
    }
  }
  out = std::move(frames[0]);
  return true;
}

// Milliseconds from now until `deadline`, capped at `cap`; 0 when it has passed.
int ms_until(ControlPlane::Clock::time_point deadline, int cap) {
  auto now = ControlPlane::Clock::now();
  if (deadline <= now) return 0;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count() + 1;
  return static_cast<int>(std::min<int64_t>(ms, cap));
}

// A connection whose peer closed shows up readable (EOF) or hung up.
bool looks_dead(int fd) {
  pollfd pfd{fd, POLLIN | POLLRDHUP, 0};
  return ::poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR));
}

// NotifySeq's life: no other Outbound (of this engine, another one, or this
// one restarted) continues this one's sequence.
uint64_t random_life() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t{rd()} << 32) ^ rd();
  return v;
}
// A u64 of a NOTIFY frame's body at byte `at`, in place (little-endian, as
// the wire codec writes it): its uid at 0, its NotifySeq's life, seq, floor.
constexpr size_t kUidAt = 0, kLifeAt = kNotifySeqAt, kSeqAt = kNotifySeqAt + 8,
                 kFloorAt = kNotifySeqAt + 16;
uint64_t notify_field(const std::vector<uint8_t>& frame, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, frame.data() + kCtrlHeaderSize + at, sizeof v);
  return v;
}
void set_notify_field(std::vector<uint8_t>& frame, size_t at, uint64_t v) {
  std::memcpy(frame.data() + kCtrlHeaderSize + at, &v, sizeof v);
}
}  // namespace

ControlPlane::ControlPlane(std::string self_key, const std::string& host, uint16_t port,
                           Handlers handlers, const LinkAuth* auth,
                           std::chrono::milliseconds idle_close, std::chrono::microseconds spin)
    : self_key_(std::move(self_key)),
      handlers_(std::move(handlers)),
      auth_(auth),
      idle_close_(idle_close),
      spin_(spin) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (!resolve(host, port, ss, len))
    throw Error(StatusCode::ERR_INVALID_ARGS, "control plane: cannot resolve host '" + host + "'");
  listen_fd_ = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&ss), len) != 0 ||
      ::listen(listen_fd_, 128) != 0) {
    std::string why = std::strerror(errno);
    if (listen_fd_ >= 0) ::close(listen_fd_);
    throw Error(StatusCode::ERR_BAD_STATE, "control plane: cannot listen on " + host + ":" +
                                               std::to_string(port) + ": " + why);
  }
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&bound), &blen);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  abort_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  unix_fd_ = listen_unix(&unix_name_);
  if (unix_fd_ >= 0) {
    ev.data.fd = unix_fd_;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, unix_fd_, &ev);
  }
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  resends_ = std::make_unique<AsyncRunner>();
  thread_ = ferry::named_thread("ferry-ctrl", [this] { io_loop(); });
  fence_thread_ = ferry::named_thread("ferry-fence", [this] { fence_loop(); });
}

ControlPlane::~ControlPlane() {
  stop_ = true;
  uint64_t one = 1;
  [[maybe_unused]] auto k = ::write(wake_fd_, &one, sizeof one);
  thread_.join();  // no resend is queued after this
  abort_waits();   // a resend waiting on a peer ends now
  resends_.reset();
  {
    std::lock_guard<std::mutex> lk(fence_mu_);
    fence_cv_.notify_all();
  }
  fence_thread_.join();
  for (auto& [peer, jobs] : fence_jobs_)
    for (auto& j : jobs) ::close(j.fd);
  for (auto& [fd, c] : inbound_) ::close(fd);
  outbound_.clear();  // each Outbound closes its connection
  ::close(listen_fd_);
  if (unix_fd_ >= 0) ::close(unix_fd_);
  ::close(epoll_fd_);
  ::close(wake_fd_);
  if (abort_fd_ >= 0) ::close(abort_fd_);
}

void ControlPlane::abort_waits() {
  // Never read back: readable from now on, every wait of ours sees it.
  const uint64_t one = 1;
  [[maybe_unused]] auto k = ::write(abort_fd_, &one, sizeof one);
}

void ControlPlane::io_loop() {
  epoll_event evs[32];
  while (!stop_) {
    // Blocks without a timeout when no handshake is pending and no outbound
    // connection is open: an idle engine costs no CPU.
    int timeout = expire_handshakes();
    if (const int reap = reap_outbound(); reap >= 0)
      timeout = timeout < 0 ? reap : std::min(timeout, reap);
    if (const int watch = watch_unanswered(); watch >= 0)
      timeout = timeout < 0 ? watch : std::min(timeout, watch);
    if (!listen_armed_) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= accept_paused_until_) {
        arm_listeners(true);
      } else {
        const int left = static_cast<int>(
            std::chrono::duration_cast<std::chrono::milliseconds>(accept_paused_until_ - now)
                .count() +
            1);
        timeout = timeout < 0 ? left : std::min(timeout, left);
      }
    }
    // (The timeouts above hold to the millisecond; a poll lasts at most 10 ms.)
    int n = poll_for_events(evs, 32, timeout);
    if (n == 0) n = epoll_wait(epoll_fd_, evs, 32, timeout);
    if (n < 0 && errno == EINTR) continue;
    bool frames = false;
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wake_fd_, &v, sizeof v);  // level-triggered: drain
        continue;
      }
      if (fd == listen_fd_ || fd == unix_fd_) {
        accept_all(fd);
      } else {
        read_from(fd);
        frames = true;
      }
    }
    if (frames && spin_.count() > 0) poll_until_ = std::chrono::steady_clock::now() + spin_;
  }
}

int ControlPlane::poll_for_events(epoll_event* evs, int max, int& timeout_ms) {
  // A frame's sender wakes a thread asleep in epoll_wait inside its send()
  // (an inter-processor wake-up); one that finds this thread polling only
  // queues the frame.
  const auto start = std::chrono::steady_clock::now();
  if (start >= poll_until_) return 0;
  auto until = poll_until_;
  if (timeout_ms >= 0) until = std::min(until, start + std::chrono::milliseconds(timeout_ms));
  int n = 0;
  while (n == 0 && !stop_ && std::chrono::steady_clock::now() < until)
    n = epoll_wait(epoll_fd_, evs, max, 0);
  if (timeout_ms >= 0) {
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    timeout_ms = std::max(0, timeout_ms - static_cast<int>(spent.count()));
  }
  return n;
}

void ControlPlane::arm_listeners(bool on) {
  for (int lfd : {listen_fd_, unix_fd_}) {
    if (lfd < 0) continue;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = lfd;
    epoll_ctl(epoll_fd_, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, lfd, on ? &ev : nullptr);
  }
  listen_armed_ = on;
}

void ControlPlane::accept_all(int listen_fd) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // The connection stays in the backlog. Try again in 100 ms, not at once:
        // until a descriptor is freed every try fails the same way.
        arm_listeners(false);
        const auto now = std::chrono::steady_clock::now();
        accept_paused_until_ = now + std::chrono::milliseconds(100);
        ++accept_failures_;
        if (now - accept_warned_ >= std::chrono::seconds(10)) {
          FERRY_LOG(WARN, "control",
                    std::string("cannot accept control connections: ") + std::strerror(err) + " (" +
                        std::to_string(accept_failures_) +
                        " times since the last report); retrying every 100 ms");
          accept_warned_ = now;
          accept_failures_ = 0;
        }
      }
      return;
    }
    auto c = std::make_unique<Inbound>();
    c->fd = fd;
    c->from = address_of(fd);
    c->source = c->from.substr(0, c->from.rfind(':'));
    c->seq = ++accept_seq_;
    c->deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kHandshakeTimeoutMs);
    c->reader.set_max_body(kMaxHandshakeBody);
    evict_oldest_pending();
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    {
      std::lock_guard<std::mutex> lk(in_mu_);
      inbound_[fd] = std::move(c);
    }
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  }
}

void ControlPlane::evict_oldest_pending() {
  // The victim is the oldest handshake of the source with the most of them: a
  // flood from one address evicts its own connections, not a good peer's.
  int victim = -1;
  size_t pending = 0;
  std::string from;
  {
    std::lock_guard<std::mutex> lk(in_mu_);
    std::map<std::string, std::pair<size_t, uint64_t>> by_source;  // count, oldest seq
    for (auto& [fd, c] : inbound_) {
      if (c->state == Inbound::State::OPEN) continue;
      ++pending;
      auto& [n, oldest] = by_source.try_emplace(c->source, 0, UINT64_MAX).first->second;
      ++n;
      oldest = std::min(oldest, c->seq);
    }
    if (pending < kMaxPendingInbound) return;
    const std::string* worst = nullptr;
    for (auto& [src, e] : by_source)
      if (!worst || e.first > by_source[*worst].first) worst = &src;
    uint64_t oldest = UINT64_MAX;
    for (auto& [fd, c] : inbound_)
      if (c->state != Inbound::State::OPEN && c->source == *worst && c->seq < oldest) {
        oldest = c->seq;
        victim = fd;
        from = c->from;
      }
  }
  if (victim < 0) return;
  warn_from("evicted", from,
            "dropping connection from " + from + ": more than " +
                std::to_string(kMaxPendingInbound) + " connections are in the handshake");
  ++rejected_;
  close_inbound(victim);
}

int ControlPlane::expire_handshakes() {
  auto now = std::chrono::steady_clock::now();
  std::vector<std::pair<int, std::string>> overdue;
  auto next = std::chrono::steady_clock::time_point::max();
  {
    std::lock_guard<std::mutex> lk(in_mu_);
    for (auto& [fd, c] : inbound_) {
      if (c->state == Inbound::State::OPEN) continue;
      if (c->deadline <= now)
        overdue.emplace_back(fd, c->from);
      else
        next = std::min(next, c->deadline);
    }
  }
  for (auto& [fd, from] : overdue) {
    warn_from("timeout", from,
              "closing connection from " + from + ": handshake not completed within " +
                  std::to_string(kHandshakeTimeoutMs) + " ms");
    ++rejected_;
    close_inbound(fd);
  }
  if (next == std::chrono::steady_clock::time_point::max()) return -1;
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
  return static_cast<int>(std::min<int64_t>(ms, kHandshakeTimeoutMs));
}

void ControlPlane::close_inbound(int fd) {
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  std::lock_guard<std::mutex> lk(in_mu_);
  inbound_.erase(fd);
  ::close(fd);
}

void ControlPlane::read_from(int fd) {
  Inbound* c;
  {
    std::lock_guard<std::mutex> lk(in_mu_);
    auto it = inbound_.find(fd);
    if (it == inbound_.end()) return;
    c = it->second.get();
  }
  uint8_t buf[64 * 1024];
  // At most this much per wake-up, then back to epoll (level-triggered: it
  // reports the rest): a peer that sends faster than its frames are handled
  // must not keep this thread from accepting, expiring handshakes and
  // reading the other peers.
  constexpr size_t kReadBudget = 256 * 1024;
  for (size_t taken = 0; taken < kReadBudget;) {
    ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {
      if (c->state != Inbound::State::OPEN) {
        warn_from("closed", c->from,
                  "connection from " + c->from + (c->peer.empty() ? "" : " ('" + c->peer + "')") +
                      " closed during the handshake");
        ++rejected_;
      }
      close_inbound(fd);
      return;
    }
    taken += static_cast<size_t>(k);
    std::vector<CtrlFrame> frames;
    bool ok = c->reader.feed(buf, static_cast<size_t>(k), frames);
    handling_fd_ = fd;
    for (auto& f : frames) {
      if (!handle_frame(*c, f)) {
        handling_fd_ = -1;
        close_inbound(fd);
        return;
      }
    }
    handling_fd_ = -1;
    if (!ok) {
      warn_from(
          "malformed", c->from,
          "closing connection from " +
              (c->state == Inbound::State::OPEN ? "'" + c->peer + "' (" + c->from + ")" : c->from) +
              ": malformed frame (" + c->reader.error() + ")");
      ++rejected_;
      close_inbound(fd);
      return;
    }
  }
}

void ControlPlane::warn_from(const char* what, const std::string& from, const std::string& msg) {
  if (!log_enabled(LogLevel::WARN)) return;
  uint64_t held = 0;
  if (!refusal_log_.Allow(std::string(what) + " " + from.substr(0, from.rfind(':')), &held)) return;
  log_line(LogLevel::WARN, "control",
           msg + (held ? " (" + std::to_string(held) + " more from this address not logged)" : ""));
}

bool ControlPlane::reject(Inbound& c, const std::string& why, bool answer) {
  warn_from("refused", c.from, "refusing connection from " + c.from + ": " + why);
  if (answer) {
    auto frame = encode_ctrl_frame(CtrlType::HELLO_REFUSED, refused_body(why));
    write_all(c.fd, frame.data(), frame.size());
  }
  ++rejected_;
  return false;
}

bool ControlPlane::handle_hello(Inbound& c, CtrlFrame& f) {
  std::string key;
  uint8_t flags = 0;
  if (f.type != CtrlType::HELLO || !decode_hello(f.body, key, c.client_nonce.data(), &flags))
    return reject(c, "first frame is not a valid HELLO (a ferry of another protocol version?)",
                  false);
  const bool ours = auth_->has_token();
  const bool theirs = (flags & kHelloHasToken) != 0;
  if (ours && !theirs)
    return reject(c,
                  "engine '" + self_key_ + "' requires an auth token but engine '" + key +
                      "' has none (" + kTokenHint + ")",
                  true);
  if (!ours && theirs)
    return reject(c,
                  "engine '" + key + "' uses an auth token but engine '" + self_key_ +
                      "' has none (" + kTokenHint + ")",
                  true);
  {
    std::lock_guard<std::mutex> lk(in_mu_);  // forget_peer() reads it from other threads
    c.peer = key;
  }
  uint8_t proof[kCtrlProofSize];
  if (!auth::random_bytes(c.server_nonce.data(), c.server_nonce.size()))
    return reject(c, "no random bytes for a challenge", true);
  auto t = auth::ctrl_transcript(kServerLabel, c.client_nonce, c.server_nonce, key, self_key_);
  if (auth_->prove(key, FERRY_LINK_TARGET, t.data(), t.size(), proof) != FERRY_OK)
    return reject(c, "cannot compute a MAC", true);
  c.state = Inbound::State::PROOF;
  auto frame =
      encode_ctrl_frame(CtrlType::AUTH_CHALLENGE, challenge_body(c.server_nonce.data(), proof));
  return write_all(c.fd, frame.data(), frame.size());
}

bool ControlPlane::handle_proof(Inbound& c, CtrlFrame& f) {
  uint8_t proof[kCtrlProofSize];
  if (f.type != CtrlType::AUTH_PROOF || !decode_proof(f.body, proof))
    return reject(c, "engine '" + c.peer + "' did not answer the auth challenge", true);
  auto t = auth::ctrl_transcript(kClientLabel, c.client_nonce, c.server_nonce, c.peer, self_key_);
  std::string why;
  bool unknown = false;
  if (auth_->check(c.peer, FERRY_LINK_TARGET, t.data(), t.size(), proof, &why, &unknown) !=
      FERRY_OK)
    return reject(c, why, true);
  FERRY_LOG(DEBUG, "control", "engine '" + c.peer + "' (" + c.from + ") authenticated");
  if (unknown && handlers_.on_peer_desc) {
    c.transcript = std::move(t);
    std::memcpy(c.self_mac.data(), proof + auth::kMacSize, auth::kMacSize);
    c.state = Inbound::State::DESC;
    c.reader.set_max_body(kMaxPeerDescBody);
    auto ok = encode_ctrl_frame(CtrlType::HELLO_OK, hello_ok_body(kHelloOkSendDesc));
    return write_all(c.fd, ok.data(), ok.size());
  }
  open_admitted(c);
  auto ok = encode_ctrl_frame(CtrlType::HELLO_OK, hello_ok_body(0));
  return write_all(c.fd, ok.data(), ok.size());
}

bool ControlPlane::handle_peer_desc(Inbound& c, const CtrlFrame& f) {
  if (f.type != CtrlType::PEER_DESC)
    return reject(c,
                  "engine '" + c.peer + "' sent a " + std::to_string(static_cast<int>(f.type)) +
                      " frame before its descriptor",
                  false);
  EngineDesc d;
  std::vector<uint8_t> plain;
  if (!auth_->unseal_own(c.transcript, f.body, &plain))
    return reject(c, "engine '" + c.peer + "' sent a descriptor not sealed for this engine", false);
  try {
    d = EngineDesc::unpack(plain);
  } catch (const Error& e) {
    return reject(c, "engine '" + c.peer + "' sent a bad descriptor: " + e.what(), false);
  }
  // The descriptor must be the prover's: its key, and the secret it proved.
  if (d.key != c.peer ||
      !auth_->credentials().check(d.secret, auth::kInitiatorRole, c.transcript.data(),
                                  c.transcript.size(), c.self_mac.data()))
    return reject(c,
                  "engine '" + c.peer +
                      "' sent a descriptor that is not its own (its key or "
                      "secret does not match its proof)",
                  false);
  // Learned now, or known already under this very secret. Anything else
  // (the key registered meanwhile under another secret, our own key, no room
  // for one more learned engine) is not this connection's to speak for.
  if (std::string why = handlers_.on_peer_desc(d); !why.empty())
    return reject(c, "engine '" + c.peer + "': " + why, false);
  open_admitted(c);
  return true;
}

void ControlPlane::open_admitted(Inbound& c) {
  // A peer needs a few connections (its sends, its fences); more than
  // kMaxConnsPerPeer admitted at once are old ones it lost track of, or a
  // flood: the oldest goes (each may hold a frame of up to 1 MiB).
  int oldest_fd = -1;
  size_t open = 0;
  {
    std::lock_guard<std::mutex> lk(in_mu_);
    uint64_t oldest = UINT64_MAX;
    for (auto& [fd, o] : inbound_)
      if (o.get() != &c && o->state == Inbound::State::OPEN && o->peer == c.peer) {
        ++open;
        if (o->seq < oldest) {
          oldest = o->seq;
          oldest_fd = fd;
        }
      }
  }
  if (open >= kMaxConnsPerPeer && oldest_fd >= 0) {
    FERRY_LOG(INFO, "control",
              "closing the oldest control connection of '" + c.peer + "': more than " +
                  std::to_string(kMaxConnsPerPeer) + " are open");
    close_inbound(oldest_fd);
  }
  c.state = Inbound::State::OPEN;
  c.reader.set_max_body(kMaxCtrlBody);
}

bool ControlPlane::answer(Inbound& c, CtrlType type, const std::vector<uint8_t>& body) {
  // The sender reads this answer before it uses the connection again, so the
  // socket has room for it; one that does not read its answers is cut rather
  // than let block this thread (or its unread answers pile up here).
  if (c.sender_gone) return true;
  auto frame = encode_ctrl_frame(type, body);
  ssize_t k = ::send(c.fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k == static_cast<ssize_t>(frame.size())) return true;
  if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) {
    // Its sender closed (it gave up waiting, or went idle): frames it sent
    // whole before that are still taken - a NOTIFY it counted as sent must
    // not be dropped with the connection.
    c.sender_gone = true;
    return true;
  }
  warn_from("unread-acks", c.from,
            "closing connection from '" + c.peer + "' (" + c.from +
                "): it does not read the answers to its notifications");
  ++rejected_;
  return false;
}

bool ControlPlane::handle_frame(Inbound& c, CtrlFrame& f) {
  if (c.state == Inbound::State::HELLO) return handle_hello(c, f);
  if (c.state == Inbound::State::PROOF) return handle_proof(c, f);
  // An initiator we did not know speaks only after it presented its
  // descriptor: until then nothing it sends is acted on under its key.
  if (c.state == Inbound::State::DESC) return handle_peer_desc(c, f);
  switch (f.type) {
    case CtrlType::PLUGIN: {
      std::string plugin;
      size_t off = 0;
      if (!decode_plugin(f.body, plugin, off)) break;
      handlers_.on_plugin(c.peer, plugin, f.body.data() + off, f.body.size() - off);
      return true;
    }
    case CtrlType::NOTIFY: {
      uint64_t uid, instance;
      int32_t status;
      NotifySeq seq;
      if (!decode_notify(f.body, uid, status, instance, seq)) break;
      const NotifyAck ack = handlers_.on_notify(c.peer, uid, status, instance, seq);
      return answer(c, CtrlType::NOTIFY_ACK, notify_ack_body(uid, ack));
    }
    case CtrlType::MSG: {
      uint64_t instance, id;
      size_t off = 0;
      if (!handlers_.on_message || !decode_msg(f.body, instance, id, off)) break;
      MsgAck ack =
          handlers_.on_message(c.peer, instance, id, f.body.data() + off, f.body.size() - off);
      return answer(c, CtrlType::MSG_ACK, msg_ack_body(id, ack));
    }
    case CtrlType::FENCE: {
      // Fencing may wait for data lanes to pass their fence check: not on this
      // thread. The job answers on its own dup of the connection.
      // Decoded here: a malformed one closes the connection like any other.
      FenceJob job;
      if (!handlers_.on_fence || !decode_fence(f.body, job.req, job.wanted, job.entries)) break;
      std::lock_guard<std::mutex> lk(fence_mu_);
      auto& queued = fence_jobs_[c.peer];
      if (queued.size() >= kMaxFencesPerPeer || fence_queued_ >= kMaxFencesQueued) {
        // Left unanswered: its requester times out and asks again.
        if (queued.empty()) fence_jobs_.erase(c.peer);
        warn_from("fences", c.from,
                  "FENCE from '" + c.peer + "' not queued: " + std::to_string(kMaxFencesPerPeer) +
                      " of it or " + std::to_string(kMaxFencesQueued) + " in all are waiting");
        ++rejected_;
        return true;
      }
      job.fd = ::fcntl(c.fd, F_DUPFD_CLOEXEC, 0);
      if (job.fd < 0) {
        if (queued.empty()) fence_jobs_.erase(c.peer);
        return true;
      }
      job.peer = c.peer;
      if (queued.empty()) fence_turns_.push_back(c.peer);
      queued.push_back(std::move(job));
      ++fence_queued_;
      fence_cv_.notify_one();
      return true;
    }
    default:
      break;
  }
  warn_from("unexpected", c.from,
            "closing connection from '" + c.peer + "' (" + c.from + "): unexpected or malformed " +
                std::to_string(static_cast<int>(f.type)) + " frame");
  ++rejected_;
  return false;
}

namespace {

// The requester closed (or reset) the connection: end of stream is all that is
// left to read. It sends nothing after its FENCE but waits for the answer.
bool sender_gave_up(int fd) {
  char probe;
  const ssize_t n = ::recv(fd, &probe, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace

void ControlPlane::fence_loop() {
  for (;;) {
    FenceJob job;
    {
      std::unique_lock<std::mutex> lk(fence_mu_);
      fence_cv_.wait(lk, [&] { return stop_ || !fence_turns_.empty(); });
      if (stop_) return;
      // The next peer in turn gives one job; one with more goes to the back.
      const std::string peer = std::move(fence_turns_.front());
      fence_turns_.pop_front();
      auto& queued = fence_jobs_[peer];
      job = std::move(queued.front());
      queued.pop_front();
      --fence_queued_;
      if (queued.empty())
        fence_jobs_.erase(peer);
      else
        fence_turns_.push_back(peer);
    }
    uint64_t mine = 0;
    std::vector<FenceResult> results;
    if (sender_gave_up(job.fd)) {
      // Its request timed out and it closed the connection: it counts this
      // FENCE unanswered and asks again if it still needs to. Applied now it
      // could retire lanes made since - of that peer registered again.
      ++abandoned_fences_;
      FERRY_LOG(INFO, "control",
                "FENCE from '" + job.peer + "' not applied: its sender gave up waiting");
    } else {
      results = handlers_.on_fence(job.peer, job.wanted, job.entries, &mine);
      // The dup shares the original's file flags: clearing O_NONBLOCK here made
      // the I/O thread's next recv on that connection block (every control
      // connection stalled until the requester sent more or closed). The reply
      // is small; a requester that does not read it by the bound gets none
      // (and holds up the other peers' fences no longer than that).
      constexpr auto kReplyWait = std::chrono::seconds(1);
      auto frame =
          encode_ctrl_frame(CtrlType::FENCE_REPLY, fence_reply_body(job.req, mine, results));
      write_until(job.fd, frame.data(), frame.size(),
                  std::chrono::steady_clock::now() + kReplyWait);
    }
    ::close(job.fd);
  }
}

void ControlPlane::set_same_host_path(const std::string& peer_key, const std::string& name) {
  std::lock_guard<std::mutex> lk(paths_mu_);
  if (name.empty())
    same_host_paths_.erase(peer_key);
  else
    same_host_paths_[peer_key] = name;
}

std::string ControlPlane::same_host_path(const std::string& peer_key) {
  std::lock_guard<std::mutex> lk(paths_mu_);
  auto it = same_host_paths_.find(peer_key);
  return it == same_host_paths_.end() ? std::string() : it->second;
}

int ControlPlane::connect_and_hello(const std::string& peer_key, const std::string& host,
                                    uint16_t port, Clock::time_point deadline, std::string* err,
                                    int* status, bool* over_unix) {
  *status = FERRY_ERR_NOT_SENT;
  if (over_unix) *over_unix = false;
  if (const std::string name = same_host_path(peer_key); !name.empty()) {
    std::string why;
    if (const int ufd = connect_unix(name, &why); ufd >= 0) {
      const int fd =
          hello(ufd, peer_key, "'" + peer_key + "' (unix @" + name + ")", deadline, &why, status);
      if (fd >= 0) {
        ++unix_connects_;
        if (over_unix) *over_unix = true;
        return fd;
      }
    }
    // Another network namespace (the name is not bound there), or nothing
    // answered on it: TCP, as to any peer.
    FERRY_LOG(DEBUG, "control",
              "same-host control connection to '" + peer_key + "' over unix: " + why + "; TCP");
    *status = FERRY_ERR_NOT_SENT;
    if (Clock::now() >= deadline) {
      *err = why;
      *status = FERRY_ERR_TIMEOUT;
      return -1;
    }
  }
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (!resolve(host, port, ss, len)) {
    *err = "cannot resolve " + host;
    return -1;
  }
  int fd = ::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = std::strerror(errno);
    return -1;
  }
  int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&ss), len);
  if (rc != 0 && errno == EINPROGRESS) {
    rc = poll_or_abort(fd, POLLOUT, ms_until(deadline, kConnectTimeoutMs), abort_fd_) == 1 ? 0 : -1;
    int soerr = rc != 0 && aborted(abort_fd_) ? ECANCELED : ETIMEDOUT;
    socklen_t sl = sizeof soerr;
    if (rc == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    if (rc != 0 || soerr != 0) {
      errno = soerr;
      rc = -1;
    }
  }
  if (rc != 0) {
    if (errno == ETIMEDOUT && Clock::now() >= deadline) *status = FERRY_ERR_TIMEOUT;
    *err = "connect to " + host + ":" + std::to_string(port) + ": " +
           (errno == ECANCELED ? "engine shutting down" : std::strerror(errno));
    ::close(fd);
    return -1;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return hello(fd, peer_key, "'" + peer_key + "' (" + host + ":" + std::to_string(port) + ")",
               deadline, err, status);
}

int ControlPlane::hello(int fd, const std::string& peer_key, const std::string& where,
                        Clock::time_point deadline, std::string* err, int* status) {
  auth::Nonce nc{};
  if (!auth::random_bytes(nc.data(), nc.size())) {
    *err = "no random bytes for an auth challenge";
    ::close(fd);
    return -1;
  }
  auto fail = [&](std::string why, bool count) {
    *err = std::move(why);
    if (count) {
      ++rejected_;
      FERRY_LOG(WARN, "control", "control connection to " + where + ": " + *err);
    }
    ::close(fd);
    return -1;
  };
  // Until HELLO_OK the peer reads no frame but the handshake: whatever fails
  // here, nothing of ours was acted on (NOT_SENT), but a deadline is a deadline.
  auto answer_wait = [&] { return ms_until(deadline, kHelloTimeoutMs); };
  auto hello = encode_ctrl_frame(
      CtrlType::HELLO, hello_body(self_key_, nc.data(), auth_->has_token() ? kHelloHasToken : 0));
  CtrlFrame f;
  std::string why;
  if (!write_until(fd, hello.data(), hello.size(), deadline, abort_fd_) ||
      !read_frame(fd, f, answer_wait(), &why, kMaxHandshakeBody, abort_fd_)) {
    if (Clock::now() >= deadline) *status = FERRY_ERR_TIMEOUT;
    return fail("HELLO to " + where + ": " + why, false);
  }
  std::vector<uint8_t> tc;  // what our proof covered: also seals our descriptor
  if (f.type == CtrlType::AUTH_CHALLENGE) {
    auth::Nonce ns{};
    uint8_t proof[kCtrlProofSize];
    if (!decode_challenge(f.body, ns.data(), proof))
      return fail("malformed auth challenge from " + where, true);
    auto ts = auth::ctrl_transcript(kServerLabel, nc, ns, self_key_, peer_key);
    if (auth_->check(peer_key, FERRY_LINK_INITIATOR, ts.data(), ts.size(), proof, &why) != FERRY_OK)
      return fail(why, true);
    tc = auth::ctrl_transcript(kClientLabel, nc, ns, self_key_, peer_key);
    if (auth_->prove(peer_key, FERRY_LINK_INITIATOR, tc.data(), tc.size(), proof) != FERRY_OK)
      return fail("engine '" + peer_key + "' is not registered here", false);
    auto pf = encode_ctrl_frame(CtrlType::AUTH_PROOF, proof_body(proof));
    if (!write_until(fd, pf.data(), pf.size(), deadline, abort_fd_) ||
        !read_frame(fd, f, answer_wait(), &why, kMaxHandshakeBody, abort_fd_)) {
      if (Clock::now() >= deadline) *status = FERRY_ERR_TIMEOUT;
      return fail("auth with " + where + ": " + why, false);
    }
  } else if (f.type == CtrlType::HELLO_OK) {
    return fail("peer " + where + " admitted us without proving its identity", true);
  }
  if (f.type != CtrlType::HELLO_OK) {
    std::string reason = "unexpected answer";
    if (f.type == CtrlType::HELLO_REFUSED) decode_refused(f.body, reason);
    return fail("peer refused the control connection: " + reason, false);
  }
  uint8_t ok_flags = 0;
  if (!decode_hello_ok(f.body, &ok_flags)) return fail("malformed HELLO_OK from " + where, true);
  if ((ok_flags & kHelloOkSendDesc) && handlers_.self_desc) {
    // The server does not know us (it never registered us): our descriptor
    // lets it answer and connect back (one-way registration). It carries our
    // secret, so it is sealed for the server: only the holder of its secret,
    // which just proved itself, can read it.
    std::vector<uint8_t> sealed;
    if (!auth_->seal_for(peer_key, tc, handlers_.self_desc(), &sealed))
      return fail("cannot seal our descriptor for " + where, false);
    auto desc = encode_ctrl_frame(CtrlType::PEER_DESC, sealed);
    if (!write_until(fd, desc.data(), desc.size(), deadline, abort_fd_)) {
      if (Clock::now() >= deadline) *status = FERRY_ERR_TIMEOUT;
      return fail("sending our descriptor to " + where + ": " + std::strerror(errno), false);
    }
  }
  return fd;
}

ControlPlane::OutboundUse::~OutboundUse() {
  if (!held_) return;
  {
    std::lock_guard<std::mutex> lk(o_.mu);
    o_.busy = false;
    o_.last_used = Clock::now();
  }
  o_.free.notify_one();
}

bool ControlPlane::OutboundUse::acquire_until(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(o_.mu);
  if (!o_.free.wait_until(lk, deadline, [&] { return !o_.busy; })) return false;
  o_.busy = held_ = true;
  return true;
}

bool ControlPlane::OutboundUse::try_acquire() {
  std::lock_guard<std::mutex> lk(o_.mu);
  if (o_.busy) return false;
  o_.busy = held_ = true;
  return true;
}

std::shared_ptr<ControlPlane::Outbound> ControlPlane::outbound_for(const std::string& peer_key) {
  std::lock_guard<std::mutex> lk(out_mu_);
  auto& slot = outbound_[peer_key];
  if (!slot) {
    slot = std::make_shared<Outbound>();
    slot->unconfirmed = &notify_unconfirmed_;
    slot->new_sequence();
  }
  return slot;
}

bool ControlPlane::connected(Outbound& o, const std::string& peer_key, const std::string& host,
                             uint16_t port, Clock::time_point deadline, std::string* err,
                             int* status) {
  // Data waiting on an idle connection is answers to our NOTIFYs, or its end.
  if (o.fd >= 0 && (o.unacked.empty() ? looks_dead(o.fd) : !take_answers(o, peer_key))) o.drop();
  if (o.fd >= 0) return true;
  if (o.host != host) o.host = host;
  o.port = port;
  o.fd = connect_and_hello(peer_key, host, port, deadline, err, status, &o.unix_socket);
  if (o.fd < 0) return false;
  arm_reaper();
  if (resend_unacked(o, deadline)) {
    std::lock_guard<std::mutex> lk(o.mu);
    o.resend_failing_since = {};  // reachable again, whoever made the connection
    return true;
  }
  *err = "control connection to '" + peer_key +
         "': the notifications it had not answered could not be sent again";
  *status = FERRY_ERR_NOT_SENT;  // the caller's frame did not go
  return false;
}

void ControlPlane::Outbound::drop() {
  if (fd >= 0) ::close(fd);
  fd = -1;
  answers = CtrlFrameReader{};
}

bool ControlPlane::answered(Outbound& o, const std::string& peer_key, const CtrlFrame& f) {
  uint64_t uid = 0;
  NotifyAck ack;
  if (f.type != CtrlType::NOTIFY_ACK || !decode_notify_ack(f.body, uid, ack) || o.unacked.empty() ||
      o.unacked.front().first != uid)
    return false;
  o.unacked.pop_front();
  if (ack == NotifyAck::OTHER_LIFE) {
    // Our descriptor of it is of a life that has ended: the data went there.
    warn_from("notify-other-life", peer_key,
              "'" + peer_key + "' answered a notification (transfer uid " + std::to_string(uid) +
                  ") as another life of that engine: the transfer's data went to the one before");
  }
  return true;
}

bool ControlPlane::take_answers(Outbound& o, const std::string& peer_key) {
  uint8_t buf[4096];
  for (;;) {
    const ssize_t k = ::recv(o.fd, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (k <= 0) return false;  // its end, or a failed connection
    std::vector<CtrlFrame> frames;
    if (!o.answers.feed(buf, static_cast<size_t>(k), frames)) return false;
    for (const CtrlFrame& f : frames)
      if (!answered(o, peer_key, f)) return false;
  }
}

void ControlPlane::sent_notify(Outbound& o, const std::string& peer_key,
                               std::vector<uint8_t> frame) {
  const uint64_t uid = notify_field(frame, kUidAt);
  o.unacked.emplace_back(uid, std::move(frame));  // at most kMaxUnanswered (the senders wait)
  if (!unanswered_.exchange(true)) {              // the I/O thread may wait without a timeout
    const uint64_t one = 1;
    [[maybe_unused]] auto k = ::write(wake_fd_, &one, sizeof one);
  }
}

void ControlPlane::stamp_notify(Outbound& o, std::vector<uint8_t>& frame) {
  if (frame.size() != kCtrlHeaderSize + kFloorAt + 8) return;  // not a NOTIFY of ours
  uint64_t seq = notify_field(frame, kSeqAt);
  if (seq == 0) {
    seq = o.next_notify_seq++;
    set_notify_field(frame, kLifeAt, o.notify_life);
    set_notify_field(frame, kSeqAt, seq);
  }
  // Sent in seq order on `o`: the front is the oldest unanswered.
  set_notify_field(
      frame, kFloorAt,
      o.unacked.empty() ? seq : std::min(seq, notify_field(o.unacked.front().second, kSeqAt)));
}

int ControlPlane::watch_unanswered() {
  if (!unanswered_.load()) return -1;
  const auto now = Clock::now();
  if (now < next_watch_) return ms_until(next_watch_, INT32_MAX);
  unanswered_.store(false);  // before the look: a NOTIFY sent during it sets it again
  std::vector<std::pair<std::string, std::shared_ptr<Outbound>>> slots;
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    for (auto& [key, o] : outbound_) slots.emplace_back(key, o);
  }
  bool left = false;
  for (auto& [key, o] : slots) {
    std::lock_guard<std::mutex> lk(o->mu);
    // A holder of `busy` owns the fd and the list (and reads its answers);
    // without one they are ours while we hold mu (a sender takes `busy`
    // under mu first).
    if (o->busy || o->resend_queued) {
      left = true;  // looked at again next time
      continue;
    }
    if (o->unacked.empty() || o->forgotten) continue;
    if (o->fd >= 0 && take_answers(*o, key)) {
      if (o->unacked.empty()) continue;
    } else if (resend_jobs_.load() < kMaxResendJobs) {
      o->drop();  // broken, or closed idle: made again off this thread
      o->resend_queued = true;
      ++resend_jobs_;
      resend_later(key, o);
    }
    left = true;
  }
  if (!left) return -1;
  unanswered_.store(true);
  next_watch_ = now + kWatchUnanswered;
  return static_cast<int>(kWatchUnanswered.count());
}

void ControlPlane::resend_later(const std::string& peer_key, const std::shared_ptr<Outbound>& o) {
  try {
    resends_->run([this, peer_key, o] {
      struct Done {
        std::atomic<int>& jobs;
        ~Done() { --jobs; }
      } done{resend_jobs_};
      const auto deadline = Clock::now() + std::chrono::milliseconds(kHelloTimeoutMs);
      OutboundUse use(*o);
      const bool held = use.acquire_until(deadline);
      bool give_up = false;
      {
        std::lock_guard<std::mutex> lk(o->mu);
        o->resend_queued = false;
        if (!held || o->forgotten || o->unacked.empty() || o->fd >= 0) return;
      }
      std::string err;
      int status = 0;
      const bool ok = connected(*o, peer_key, o->host, o->port, deadline, &err, &status);
      {
        std::lock_guard<std::mutex> lk(o->mu);
        const auto now = Clock::now();
        if (ok) {
          o->resend_failing_since = {};
        } else if (o->resend_failing_since == Clock::time_point{}) {
          o->resend_failing_since = now;
        } else if (now - o->resend_failing_since >= kResendFor) {
          give_up = true;
        }
      }
      if (!give_up) return;  // the watch tries again
      warn_from("notify-unanswered", peer_key,
                "giving up " + std::to_string(o->unacked.size()) + " notifications to '" +
                    peer_key + "' after " + std::to_string(kResendFor.count()) +
                    " s of failing to send them again: " + err);
      o->give_up_unanswered();
      o->resend_failing_since = {};
    });
  } catch (...) {  // no thread now: the watch's next look tries again
    o->resend_queued = false;
    --resend_jobs_;
  }
}

int ControlPlane::wait_for_room(Outbound& o, const std::string& peer_key,
                                Clock::time_point deadline, std::string* err) {
  while (o.unacked.size() >= kMaxUnanswered) {
    const int left = ms_until(deadline, INT32_MAX);
    const int r = left > 0 ? poll_or_abort(o.fd, POLLIN, left, abort_fd_) : 0;
    if (r < 0 && errno == EINTR) continue;
    if (r > 0 && !aborted(abort_fd_) && take_answers(o, peer_key)) continue;
    if (r > 0 && !aborted(abort_fd_)) {
      o.drop();
      *err = "control connection to '" + peer_key + "' broke while its notifications were due";
      return FERRY_ERR_TRANSPORT;
    }
    *err = "'" + peer_key + "' has not answered the " + std::to_string(kMaxUnanswered) +
           " notifications before this one by the deadline";
    return FERRY_ERR_TIMEOUT;
  }
  return FERRY_OK;
}

bool ControlPlane::resend_unacked(Outbound& o, Clock::time_point deadline) {
  for (const auto& [uid, frame] : o.unacked) {
    if (!write_until(o.fd, frame.data(), frame.size(), deadline, abort_fd_)) {
      o.drop();
      return false;
    }
    ++notify_resent_;
  }
  return true;
}

void ControlPlane::arm_reaper() {
  if (idle_close_.count() <= 0 || reaper_armed_.exchange(true)) return;
  const uint64_t one = 1;
  [[maybe_unused]] auto k = ::write(wake_fd_, &one, sizeof one);
}

int ControlPlane::reap_outbound() {
  if (idle_close_.count() <= 0) return -1;
  auto ms_until = [](Clock::duration d) {
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + 1;
  };
  // Every connection has the same idle period, and one used or made since the
  // last scan expires after what that scan found: nothing is due before
  // next_reap_, so an I/O wake-up (every inbound frame) scans nothing.
  if (reaper_armed_.load() && Clock::now() < next_reap_) return ms_until(next_reap_ - Clock::now());
  // Disarmed before the scan: a connection made after it wakes us (arm_reaper).
  reaper_armed_.store(false);
  std::vector<std::pair<std::string, std::shared_ptr<Outbound>>> slots;
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    for (auto& [key, o] : outbound_) slots.emplace_back(key, o);
  }
  const auto now = Clock::now();
  auto next = Clock::time_point::max();
  for (auto& [key, o] : slots) {
    std::lock_guard<std::mutex> lk(o->mu);
    // The fd belongs to whoever holds `busy`: read only when nobody does.
    if (o->busy) {
      next = std::min(next, now + idle_close_);  // in use (or connecting): look again later
    } else if (o->fd < 0) {
      continue;
    } else if (!o->unacked.empty() && !o->forgotten && take_answers(*o, key) &&
               !o->unacked.empty()) {
      // Answers still due: not idle (the watch looks at it meanwhile).
      next = std::min(next, now + idle_close_);
    } else if (now - o->last_used >= idle_close_) {
      // Nobody holds `busy`, so nobody uses the fd: ours to close. Unanswered
      // NOTIFYs stay to go again on the next connection (the target takes a
      // uid once).
      o->drop();
    } else {
      next = std::min(next, o->last_used + idle_close_);
    }
  }
  if (next == Clock::time_point::max()) {
    next_reap_ = {};  // nothing open: the next arm_reaper() wake scans
    return -1;
  }
  next_reap_ = next;
  reaper_armed_.store(true);
  return ms_until(next - now);
}

int ControlPlane::send(const std::string& peer_key, const std::string& host, uint16_t port,
                       CtrlType type, const std::vector<uint8_t>& body, std::string* err,
                       Clock::time_point deadline) {
  if (body.size() > kMaxCtrlBody) {
    *err = "control message too large";
    return FERRY_ERR_INVALID_ARGS;
  }
  std::shared_ptr<Outbound> o = outbound_for(peer_key);
  auto frame = encode_ctrl_frame(type, body);
  // Another transfer's connect or HELLO to this peer may hold the connection:
  // wait for it only until our own deadline.
  OutboundUse use(*o);
  if (!use.acquire_until(deadline)) {
    *err = "control connection to '" + peer_key +
           "' is busy (another transfer is connecting to it) past this transfer's deadline";
    return FERRY_ERR_TIMEOUT;
  }
  // A peer that restarted left us a dead socket: find out before writing into it.
  for (int tries = 0; tries < 2; ++tries) {
    if (int status; !connected(*o, peer_key, host, port, deadline, err, &status)) return status;
    if (type == CtrlType::NOTIFY) {
      const int room = wait_for_room(*o, peer_key, deadline, err);
      if (room == FERRY_ERR_TIMEOUT) return room;
      if (room != FERRY_OK) continue;  // gone: made again, its NOTIFYs resent
    }
    // By the deadline: a peer that stopped reading (stopped, or its control
    // thread stalled) fills the socket, and a blocking write would hold this
    // thread and the connection for as long as it does.
    if (type == CtrlType::NOTIFY) stamp_notify(*o, frame);
    if (write_until(o->fd, frame.data(), frame.size(), deadline, abort_fd_)) {
      if (type == CtrlType::NOTIFY) sent_notify(*o, peer_key, std::move(frame));
      return FERRY_OK;
    }
    const bool late = Clock::now() >= deadline;
    o->drop();  // part of the frame may be out: the stream is out of step
    if (late) {
      *err = "control connection to '" + peer_key + "': the peer took nothing more by the deadline";
      return FERRY_ERR_TIMEOUT;
    }
  }
  *err = "control connection to " + peer_key + " failed while sending";
  return FERRY_ERR_TRANSPORT;
}

ControlPlane::SendNow ControlPlane::send_now(Outbound& o, const std::string& peer_key,
                                             CtrlType type, const std::vector<uint8_t>& body,
                                             std::vector<uint8_t>* tail) {
  // A TCP connection whose peer closed still takes a send (the bytes are lost),
  // so it is checked first; a unix one fails the send instead (EPIPE, nothing
  // sent), which saves a transfer's notification that system call (a
  // zero-timeout poll cost 1.7 us on the 2-vCPU CI machine).
  // With NOTIFYs unanswered, what waits is their answers (read now), or the end.
  if (o.fd < 0) return SendNow::NOT_SENT;
  if (!o.unacked.empty()) {
    if (!take_answers(o, peer_key)) {
      o.drop();  // they go again on the next connection (exchange, send)
      return SendNow::NOT_SENT;
    }
  } else if (!o.unix_socket && looks_dead(o.fd)) {
    return SendNow::NOT_SENT;
  }
  // Answers due for as many NOTIFYs as may wait: this one waits (send()).
  if (type == CtrlType::NOTIFY && o.unacked.size() >= kMaxUnanswered) return SendNow::NOT_SENT;
  auto frame = encode_ctrl_frame(type, body);
  if (type == CtrlType::NOTIFY) stamp_notify(o, frame);
  // A blocking socket: a full send buffer (a stopped peer) would block here, so
  // only what fits now (MSG_DONTWAIT) goes.
  ssize_t k = ::send(o.fd, frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  if (k == static_cast<ssize_t>(frame.size())) {
    if (type == CtrlType::NOTIFY) sent_notify(o, peer_key, std::move(frame));
    return SendNow::SENT;
  }
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return SendNow::NOT_SENT;
  if (k > 0 && tail != nullptr) {  // the rest is the caller's to write (finish_exchange)
    tail->assign(frame.begin() + k, frame.end());
    return SendNow::SENT;
  }
  // Part of a frame went out, or the socket failed: the stream is broken.
  o.drop();
  // A unix peer that closed its end (its idle close, a restart) failed the
  // send with nothing sent; so did any failed send (k < 0) for start_exchange,
  // whose caller connects again: NOT_SENT.
  return k < 0 && (o.unix_socket || tail != nullptr) ? SendNow::NOT_SENT : SendNow::BROKEN;
}

std::shared_ptr<ControlPlane::Outbound> ControlPlane::existing_outbound(
    const std::string& peer_key) {
  std::lock_guard<std::mutex> lk(out_mu_);
  auto it = outbound_.find(peer_key);
  return it == outbound_.end() ? nullptr : it->second;
}

bool ControlPlane::try_send(const std::string& peer_key, CtrlType type,
                            const std::vector<uint8_t>& body, int* rc, std::string* err) {
  if (body.size() > kMaxCtrlBody) return false;
  std::shared_ptr<Outbound> o = existing_outbound(peer_key);
  if (!o) return false;
  OutboundUse use(*o);
  if (!use.try_acquire()) return false;
  switch (send_now(*o, peer_key, type, body, nullptr)) {
    case SendNow::SENT:
      *rc = FERRY_OK;
      return true;
    case SendNow::NOT_SENT:
      return false;
    case SendNow::BROKEN:
      break;
  }
  *err = "control connection to " + peer_key + " failed while sending";
  *rc = FERRY_ERR_TRANSPORT;
  return true;
}

namespace {

// A frame's write did not finish by the deadline, or failed (errno).
int write_failed(const std::string& peer_key, ControlPlane::Clock::time_point deadline,
                 std::string* err) {
  const bool late = ControlPlane::Clock::now() >= deadline;
  *err = late ? "the peer took nothing more by the deadline"
              : "sending to '" + peer_key + "' failed: " + std::strerror(errno);
  return late ? FERRY_ERR_TIMEOUT : FERRY_ERR_TRANSPORT;
}

}  // namespace

int ControlPlane::read_reply(Outbound& o, const std::string& peer_key, CtrlType reply_type,
                             Clock::time_point deadline, CtrlFrame* reply, std::string* err) {
  // Answers are small (kMaxHandshakeBody); NOTIFY_ACKs for NOTIFYs sent
  // before the frame come first, and are taken on the way.
  o.answers.set_max_body(kMaxHandshakeBody);
  std::vector<CtrlFrame> frames;
  std::string why = "no answer";
  // With control_spin, the answer is polled for that long before this thread
  // sleeps in poll(): a peer that answers within microseconds (a message's
  // MSG_ACK) is not waited for through a wake-up.
  const auto spin_until = spin_.count() > 0 ? Clock::now() + spin_ : Clock::time_point{};
  for (;;) {
    for (CtrlFrame& f : frames) {
      if (f.type == CtrlType::NOTIFY_ACK && answered(o, peer_key, f)) continue;
      if (f.type != reply_type) {
        *err = "unexpected answer from '" + peer_key + "'";
        o.drop();
        return FERRY_ERR_TRANSPORT;
      }
      *reply = std::move(f);
      return FERRY_OK;  // one answer per frame: nothing follows it yet
    }
    frames.clear();
    uint8_t buf[512];
    // While the spin lasts a look that does not wait stands in for poll()
    // (each is a system call: no pause needed between them).
    const bool spinning =
        spin_until != Clock::time_point{} && Clock::now() < spin_until && !aborted(abort_fd_);
    int r = 1;
    if (!spinning) {
      const int left = ms_until(deadline, INT32_MAX);
      r = left > 0 ? poll_or_abort(o.fd, POLLIN, left, abort_fd_) : 0;
    }
    if (r < 0 && errno == EINTR) continue;
    ssize_t k = r > 0 ? ::recv(o.fd, buf, sizeof buf, spinning ? MSG_DONTWAIT : 0) : -1;
    if (k < 0 && r > 0 &&
        (errno == EINTR || (spinning && (errno == EAGAIN || errno == EWOULDBLOCK))))
      continue;
    if (k <= 0 || !o.answers.feed(buf, static_cast<size_t>(k), frames)) {
      if (k > 0)
        why = "malformed answer (" + o.answers.error() + ")";
      else if (aborted(abort_fd_))
        why = "engine shutting down";
      *err = "no answer from '" + peer_key + "': " + why;
      o.drop();
      return Clock::now() >= deadline ? FERRY_ERR_TIMEOUT : FERRY_ERR_TRANSPORT;
    }
  }
}

int ControlPlane::write_and_answer(Outbound& o, const uint8_t* p, size_t n,
                                   const std::string& peer_key, CtrlType reply_type,
                                   Clock::time_point deadline, CtrlFrame* reply, std::string* err) {
  if (n > 0 && !write_until(o.fd, p, n, deadline, abort_fd_)) {
    const int rc = write_failed(peer_key, deadline, err);
    o.drop();  // the stream is out of step: the next exchange makes a new one
    return rc;
  }
  return read_reply(o, peer_key, reply_type, deadline, reply, err);
}

int ControlPlane::exchange(const std::string& peer_key, const std::string& host, uint16_t port,
                           CtrlType type, const std::vector<uint8_t>& body, CtrlType reply_type,
                           Clock::time_point deadline, CtrlFrame* reply, std::string* err) {
  std::shared_ptr<Outbound> o = outbound_for(peer_key);
  OutboundUse use(*o);
  if (!use.acquire_until(deadline)) {
    *err = "control connection to '" + peer_key + "' is busy past the deadline";
    return FERRY_ERR_NOT_SENT;
  }
  if (int status; !connected(*o, peer_key, host, port, deadline, err, &status))
    return FERRY_ERR_NOT_SENT;
  auto frame = encode_ctrl_frame(type, body);
  return write_and_answer(*o, frame.data(), frame.size(), peer_key, reply_type, deadline, reply,
                          err);
}

bool ControlPlane::start_exchange(const std::string& peer_key, CtrlType type,
                                  const std::vector<uint8_t>& body, Exchange* x) {
  if (body.size() > kMaxCtrlBody) return false;
  std::shared_ptr<Outbound> o = existing_outbound(peer_key);
  if (!o) return false;
  OutboundUse use(*o);
  // A broken stream is left to exchange(), which connects again. A frame
  // that only partly fit stays on this connection: finish_exchange writes
  // the rest (a 64 KiB message into a send buffer with less room left).
  x->tail_.clear();
  if (!use.try_acquire() || send_now(*o, peer_key, type, body, &x->tail_) != SendNow::SENT)
    return false;
  use.keep();  // the connection stays busy for finish_exchange
  x->out_ = std::move(o);
  return true;
}

int ControlPlane::finish_exchange(Exchange& x, const std::string& peer_key, CtrlType reply_type,
                                  Clock::time_point deadline, CtrlFrame* reply, std::string* err) {
  std::shared_ptr<Outbound> o = std::move(x.out_);
  if (!o) {
    *err = "no exchange with '" + peer_key + "' was started";
    return FERRY_ERR_NOT_SENT;
  }
  OutboundUse use(*o, OutboundUse::kHeld);  // lets it go on return
  return write_and_answer(*o, x.tail_.data(), x.tail_.size(), peer_key, reply_type, deadline, reply,
                          err);
}

ControlPlane::Exchange::~Exchange() {
  if (!out_) return;
  // Never finished: its answer may still come, so the stream is out of step.
  OutboundUse use(*out_, OutboundUse::kHeld);
  out_->drop();
}

int ControlPlane::request(const std::string& peer_key, const std::string& host, uint16_t port,
                          CtrlType type, const std::vector<uint8_t>& body, CtrlType reply_type,
                          Clock::time_point deadline, CtrlFrame* reply, std::string* err) {
  int status;
  int fd = connect_and_hello(peer_key, host, port, deadline, err, &status);
  if (fd < 0) {
    // Refused outright: nothing listens on that port, so the engine is gone.
    if (status == FERRY_ERR_NOT_SENT && err->find("Connection refused") == std::string::npos)
      status = Clock::now() >= deadline ? FERRY_ERR_TIMEOUT : FERRY_ERR_TRANSPORT;
    return status;
  }
  auto frame = encode_ctrl_frame(type, body);
  std::string why;
  int rc = FERRY_OK;
  // By the deadline too: a FENCE of thousands of entries to a peer that stopped
  // reading would otherwise block here once its socket buffers are full.
  if (!write_until(fd, frame.data(), frame.size(), deadline, abort_fd_)) {
    *err = "sending to '" + peer_key + "' failed";
    rc = Clock::now() >= deadline ? FERRY_ERR_TIMEOUT : FERRY_ERR_TRANSPORT;
  } else if (!read_frame(fd, *reply, ms_until(deadline, INT32_MAX), &why, kMaxCtrlBody,
                         abort_fd_)) {
    *err = "no answer from '" + peer_key + "': " + why;
    rc = Clock::now() >= deadline ? FERRY_ERR_TIMEOUT : FERRY_ERR_TRANSPORT;
  } else if (reply->type != reply_type) {
    *err = "unexpected answer from '" + peer_key + "'";
    rc = FERRY_ERR_PROTOCOL;
  }
  ::close(fd);
  return rc;
}

void ControlPlane::Outbound::new_sequence() {
  notify_life = random_life();
  next_notify_seq = 1;
}

void ControlPlane::Outbound::give_up_unanswered() {
  if (unacked.empty()) return;
  if (unconfirmed != nullptr) *unconfirmed += unacked.size();
  unacked.clear();
  // Their seqs were never answered: a floor of this life must not pass them
  // (one may still be in a connection's buffer at the target).
  new_sequence();
}

ControlPlane::Outbound::~Outbound() {
  if (fd >= 0) ::close(fd);
  // (Not forgotten: the engine is going away with its counters.)
  if (forgotten && unconfirmed != nullptr) *unconfirmed += unacked.size();
}

void ControlPlane::forget_peer(const std::string& key) {
  set_same_host_path(key, "");
  std::shared_ptr<Outbound> o;
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    auto it = outbound_.find(key);
    if (it != outbound_.end()) {
      o = std::move(it->second);
      outbound_.erase(it);
    }
  }
  if (o) {
    // Closed now when idle; a sender in progress keeps it until its frame is
    // out, and the last holder closes it (never a wait here: this may run on
    // the I/O thread, learning a peer's new life).
    OutboundUse use(*o);
    {
      std::lock_guard<std::mutex> lk(o->mu);
      o->forgotten = true;  // a resend in progress sends nothing more to it
    }
    if (use.try_acquire()) {
      o->drop();
      o->give_up_unanswered();  // never sent again: the peer is gone
    }
  }
  const bool io_thread = std::this_thread::get_id() == thread_.get_id();
  std::lock_guard<std::mutex> lk(in_mu_);
  for (auto& [fd, c] : inbound_)
    if (c->peer == key && !(io_thread && fd == handling_fd_))
      ::shutdown(fd, SHUT_RDWR);  // the I/O thread sees EOF and cleans up
}

}  // namespace ferry
