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
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "log.h"

namespace ferry {

struct ControlPlane::Inbound {
  int fd = -1;
  std::string peer;  // set after a good HELLO
  CtrlFrameReader reader;
};

namespace {

constexpr int kConnectTimeoutMs = 3000;
constexpr int kHelloTimeoutMs = 3000;

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

// Read exactly n bytes within timeout_ms (the socket is blocking).
bool read_exact(int fd, uint8_t* p, size_t n, int timeout_ms) {
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int r = ::poll(&pfd, 1, timeout_ms);
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

// A connection whose peer closed shows up readable (EOF) or hung up.
bool looks_dead(int fd) {
  pollfd pfd{fd, POLLIN | POLLRDHUP, 0};
  return ::poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR));
}

}  // namespace

ControlPlane::ControlPlane(std::string self_key, const std::string& host, uint16_t port,
                           Handlers handlers)
    : self_key_(std::move(self_key)), handlers_(std::move(handlers)) {
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
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.fd = wake_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  thread_ = std::thread([this] { io_loop(); });
}

ControlPlane::~ControlPlane() {
  stop_ = true;
  uint64_t one = 1;
  [[maybe_unused]] auto k = ::write(wake_fd_, &one, sizeof one);
  thread_.join();
  for (auto& [fd, c] : inbound_) ::close(fd);
  for (auto& [key, o] : outbound_)
    if (o->fd >= 0) ::close(o->fd);
  ::close(listen_fd_);
  ::close(epoll_fd_);
  ::close(wake_fd_);
}

void ControlPlane::io_loop() {
  epoll_event evs[32];
  while (!stop_) {
    int n = epoll_wait(epoll_fd_, evs, 32, -1);  // blocks: an idle engine costs no CPU
    if (n < 0 && errno == EINTR) continue;
    for (int i = 0; i < n; ++i) {
      int fd = evs[i].data.fd;
      if (fd == wake_fd_) continue;
      if (fd == listen_fd_) accept_all();
      else read_from(fd);
    }
  }
}

void ControlPlane::accept_all() {
  for (;;) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) return;
    auto c = std::make_unique<Inbound>();
    c->fd = fd;
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
  for (;;) {
    ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {
      close_inbound(fd);
      return;
    }
    std::vector<CtrlFrame> frames;
    bool ok = c->reader.feed(buf, static_cast<size_t>(k), frames);
    for (auto& f : frames) {
      if (!handle_frame(*c, f)) {
        close_inbound(fd);
        return;
      }
    }
    if (!ok) {
      FERRY_LOG(WARN, "control",
                "closing connection from " + (c->peer.empty() ? "unknown peer" : c->peer) +
                    ": malformed frame (" + c->reader.error() + ")");
      ++rejected_;
      close_inbound(fd);
      return;
    }
  }
}

bool ControlPlane::handle_frame(Inbound& c, CtrlFrame& f) {
  if (c.peer.empty()) {
    std::string key;
    if (f.type != CtrlType::HELLO || !decode_hello(f.body, key)) {
      FERRY_LOG(WARN, "control", "refusing connection: first frame is not a valid HELLO");
      ++rejected_;
      return false;
    }
    if (!handlers_.is_known_peer(key)) {
      std::string why = "engine '" + key + "' is not registered with engine '" + self_key_ + "'";
      FERRY_LOG(WARN, "control", "refusing connection: " + why);
      auto frame = encode_ctrl_frame(CtrlType::HELLO_REFUSED, refused_body(why));
      write_all(c.fd, frame.data(), frame.size());
      ++rejected_;
      return false;
    }
    c.peer = key;
    auto ok = encode_ctrl_frame(CtrlType::HELLO_OK, {});
    return write_all(c.fd, ok.data(), ok.size());
  }
  switch (f.type) {
    case CtrlType::PLUGIN: {
      std::string plugin;
      size_t off = 0;
      if (!decode_plugin(f.body, plugin, off)) break;
      handlers_.on_plugin(c.peer, plugin, f.body.data() + off, f.body.size() - off);
      return true;
    }
    case CtrlType::NOTIFY: {
      uint64_t uid;
      int32_t status;
      if (!decode_notify(f.body, uid, status)) break;
      handlers_.on_notify(c.peer, uid, status);
      return true;
    }
    default:
      break;
  }
  FERRY_LOG(WARN, "control", "closing connection from " + c.peer + ": unexpected or malformed frame");
  ++rejected_;
  return false;
}

int ControlPlane::connect_and_hello(const std::string& host, uint16_t port, std::string* err) {
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
    pollfd pfd{fd, POLLOUT, 0};
    rc = ::poll(&pfd, 1, kConnectTimeoutMs) == 1 ? 0 : -1;
    int soerr = ETIMEDOUT;
    socklen_t sl = sizeof soerr;
    if (rc == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
    if (rc != 0 || soerr != 0) {
      errno = soerr;
      rc = -1;
    }
  }
  if (rc != 0) {
    *err = "connect to " + host + ":" + std::to_string(port) + ": " + std::strerror(errno);
    ::close(fd);
    return -1;
  }
  int flags = fcntl(fd, F_GETFL);
  fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  auto hello = encode_ctrl_frame(CtrlType::HELLO, hello_body(self_key_));
  uint8_t hdr[kCtrlHeaderSize];
  std::vector<CtrlFrame> frames;
  CtrlFrameReader reader;
  if (!write_all(fd, hello.data(), hello.size()) ||
      !read_exact(fd, hdr, sizeof hdr, kHelloTimeoutMs) || !reader.feed(hdr, sizeof hdr, frames)) {
    *err = "no HELLO answer from " + host + ":" + std::to_string(port);
    ::close(fd);
    return -1;
  }
  if (frames.empty()) {  // HELLO_REFUSED carries a reason body
    uint8_t body[256];
    uint32_t blen = hdr[8] | hdr[9] << 8 | hdr[10] << 16 | static_cast<uint32_t>(hdr[11]) << 24;
    if (blen <= sizeof body && read_exact(fd, body, blen, kHelloTimeoutMs))
      reader.feed(body, blen, frames);
  }
  if (frames.size() != 1 || frames[0].type != CtrlType::HELLO_OK) {
    std::string reason = "unexpected answer";
    if (frames.size() == 1 && frames[0].type == CtrlType::HELLO_REFUSED)
      decode_refused(frames[0].body, reason);
    *err = "peer refused the control connection: " + reason;
    ::close(fd);
    return -1;
  }
  return fd;
}

int ControlPlane::send(const std::string& peer_key, const std::string& host, uint16_t port,
                       CtrlType type, const std::vector<uint8_t>& body, std::string* err) {
  if (body.size() > kMaxCtrlBody) {
    *err = "control message too large";
    return FERRY_ERR_INVALID_ARGS;
  }
  std::shared_ptr<Outbound> o;
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    auto& slot = outbound_[peer_key];
    if (!slot) slot = std::make_shared<Outbound>();
    o = slot;
  }
  auto frame = encode_ctrl_frame(type, body);
  std::lock_guard<std::mutex> lk(o->mu);
  // A peer that restarted left us a dead socket: find out before writing into it.
  for (int tries = 0; tries < 2; ++tries) {
    if (o->fd >= 0 && looks_dead(o->fd)) {
      ::close(o->fd);
      o->fd = -1;
    }
    if (o->fd < 0) o->fd = connect_and_hello(host, port, err);
    if (o->fd < 0) return FERRY_ERR_TRANSPORT;
    if (write_all(o->fd, frame.data(), frame.size())) return FERRY_OK;
    ::close(o->fd);
    o->fd = -1;
  }
  *err = "control connection to " + peer_key + " failed while sending";
  return FERRY_ERR_TRANSPORT;
}

void ControlPlane::forget_peer(const std::string& key) {
  {
    std::lock_guard<std::mutex> lk(out_mu_);
    auto it = outbound_.find(key);
    if (it != outbound_.end()) {
      std::lock_guard<std::mutex> olk(it->second->mu);
      if (it->second->fd >= 0) ::close(it->second->fd);
      it->second->fd = -1;
      outbound_.erase(it);
    }
  }
  std::lock_guard<std::mutex> lk(in_mu_);
  for (auto& [fd, c] : inbound_)
    if (c->peer == key) ::shutdown(fd, SHUT_RDWR);  // the I/O thread sees EOF and cleans up
}

}  // namespace ferry
