// SPDX-License-Identifier: Apache-2.0
#include "socket_util.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <vector>

namespace ferry_tcp {
namespace {

// Skips `*skip` bytes of iov into a private copy the loops can trim in place.
std::vector<iovec> Remaining(const iovec* iov, size_t n, size_t skip) {
  std::vector<iovec> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (iov[i].iov_len == 0) continue;
    if (skip >= iov[i].iov_len) {
      skip -= iov[i].iov_len;
      continue;
    }
    out.push_back({static_cast<char*>(iov[i].iov_base) + skip, iov[i].iov_len - skip});
    skip = 0;
  }
  return out;
}

void Advance(std::vector<iovec>& v, size_t* first, size_t done) {
  while (done > 0 && *first < v.size()) {
    iovec& cur = v[*first];
    const size_t take = std::min(done, cur.iov_len);
    cur.iov_base = static_cast<char*>(cur.iov_base) + take;
    cur.iov_len -= take;
    done -= take;
    if (cur.iov_len == 0) ++*first;
  }
}

}  // namespace

bool SetNonBlocking(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) return false;
  const int want = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  return want == flags || fcntl(fd, F_SETFL, want) == 0;
}

std::string IoErrorString(int err) {
  if (err == 0) return "no error";
  if (err == kEof) return "connection closed by peer";
  if (err == EAGAIN || err == EWOULDBLOCK) return "no progress within the I/O timeout";
  return std::strerror(err);
}

int SendIov(int fd, const iovec* iov, size_t n, size_t* progress, int extra_flags) {
  std::vector<iovec> v = Remaining(iov, n, *progress);
  size_t first = 0;
  while (first < v.size()) {
    msghdr msg{};
    msg.msg_iov = v.data() + first;
    msg.msg_iovlen = std::min<size_t>(v.size() - first, IOV_MAX);
    const ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | extra_flags);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    *progress += static_cast<size_t>(r);
    Advance(v, &first, static_cast<size_t>(r));
  }
  return 0;
}

int SendAll(int fd, const void* buf, size_t len) {
  iovec iov{const_cast<void*>(buf), len};
  size_t progress = 0;
  return SendIov(fd, &iov, 1, &progress);
}

int RecvIov(int fd, const iovec* iov, size_t n, bool idle_ok) {
  std::vector<iovec> v = Remaining(iov, n, 0);
  size_t first = 0;
  bool any = false;
  while (first < v.size()) {
    ssize_t r;
    if (v.size() - first == 1) {
      r = recv(fd, v[first].iov_base, v[first].iov_len, 0);
    } else {
      r = readv(fd, v.data() + first,
                static_cast<int>(std::min<size_t>(v.size() - first, IOV_MAX)));
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && idle_ok && !any) continue;
      return errno;
    }
    if (r == 0) return kEof;
    any = true;
    Advance(v, &first, static_cast<size_t>(r));
  }
  return 0;
}

int RecvAll(int fd, void* buf, size_t len, bool idle_ok) {
  iovec iov{buf, len};
  return RecvIov(fd, &iov, 1, idle_ok);
}

int RecvAllBy(int fd, void* buf, size_t len, std::chrono::steady_clock::time_point deadline,
              int abort_fd) {
  size_t n_fds = 0;
  bool truncated = false;  // a descriptor sent along here is closed, not kept
  return RecvWithFds(fd, buf, len, nullptr, 0, &n_fds, &truncated, deadline, abort_fd);
}

int Discard(int fd, uint64_t len) {
  std::vector<char> scratch(std::min<uint64_t>(len, 256 * 1024));
  while (len > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(len, scratch.size()));
    const int err = RecvAll(fd, scratch.data(), take);
    if (err) return err;
    len -= take;
  }
  return 0;
}

SocketReader::SocketReader(int fd, size_t buffer_bytes) : fd_(fd), buf_(buffer_bytes) {}

bool SocketReader::Drain(std::vector<iovec>& v, size_t* first) {
  while (*first < v.size() && pos_ < end_) {
    iovec& cur = v[*first];
    const size_t take = std::min(cur.iov_len, end_ - pos_);
    std::memcpy(cur.iov_base, buf_.data() + pos_, take);
    pos_ += take;
    cur.iov_base = static_cast<char*>(cur.iov_base) + take;
    cur.iov_len -= take;
    if (cur.iov_len == 0) ++*first;
  }
  return *first == v.size();
}

int SocketReader::ReadIov(const iovec* iov, size_t n, bool idle_ok) {
  std::vector<iovec> v = Remaining(iov, n, 0);
  size_t first = 0;
  bool any = pos_ < end_;
  if (Drain(v, &first)) return 0;
  for (;;) {
    size_t left = 0;
    for (size_t i = first; i < v.size(); ++i) left += v[i].iov_len;
    ssize_t r;
    const bool buffered = left < buf_.size();
    if (buffered) {
      // Short: fill the buffer with whatever has arrived, which may be the next frame too.
      r = recv(fd_, buf_.data(), buf_.size(), 0);
    } else if (v.size() - first == 1) {
      r = recv(fd_, v[first].iov_base, v[first].iov_len, 0);
    } else {
      r = readv(fd_, v.data() + first,
                static_cast<int>(std::min<size_t>(v.size() - first, IOV_MAX)));
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && idle_ok && !any) continue;
      return errno;
    }
    if (r == 0) return kEof;
    any = true;
    if (buffered) {
      pos_ = 0;
      end_ = static_cast<size_t>(r);
      if (Drain(v, &first)) return 0;
    } else {
      Advance(v, &first, static_cast<size_t>(r));
      if (first == v.size()) return 0;
    }
  }
}

int SocketReader::Discard(uint64_t len) {
  const uint64_t from_buf = std::min<uint64_t>(len, end_ - pos_);
  pos_ += static_cast<size_t>(from_buf);
  len -= from_buf;
  return len == 0 ? 0 : ferry_tcp::Discard(fd_, len);
}

int ByteReader::ReadSome(std::vector<iovec>& v, size_t* first, size_t* moved) {
  size_t total = 0;
  for (size_t i = *first; i < v.size(); ++i) total += v[i].iov_len;
  const int err = ReadIov(v.data() + *first, v.size() - *first);
  *moved = err == 0 ? total : 0;
  if (err == 0) *first = v.size();
  return err;
}

int ByteReader::DiscardSome(uint64_t* left, size_t* moved) {
  const int err = Discard(*left);
  *moved = err == 0 ? static_cast<size_t>(*left) : 0;
  if (err == 0) *left = 0;
  return err;
}

int SocketReader::ReadSome(std::vector<iovec>& v, size_t* first, size_t* moved) {
  *moved = 0;
  for (;;) {
    const size_t before = pos_;
    const bool done = Drain(v, first);
    *moved += pos_ - before;
    if (done) return 0;
    size_t left = 0;
    for (size_t i = *first; i < v.size(); ++i) left += v[i].iov_len;
    ssize_t r;
    const bool buffered = left < buf_.size();
    if (buffered) {
      r = recv(fd_, buf_.data(), buf_.size(), MSG_DONTWAIT);
    } else if (v.size() - *first == 1) {
      r = recv(fd_, v[*first].iov_base, v[*first].iov_len, MSG_DONTWAIT);
    } else {
      msghdr msg{};
      msg.msg_iov = v.data() + *first;
      msg.msg_iovlen = std::min<size_t>(v.size() - *first, IOV_MAX);
      r = recvmsg(fd_, &msg, MSG_DONTWAIT);
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;  // EAGAIN: nothing more has arrived
    }
    if (r == 0) return kEof;
    if (buffered) {
      pos_ = 0;
      end_ = static_cast<size_t>(r);
    } else {
      *moved += static_cast<size_t>(r);
      Advance(v, first, static_cast<size_t>(r));
      if (*first == v.size()) return 0;
    }
  }
}

int SocketReader::DiscardSome(uint64_t* left, size_t* moved) {
  *moved = 0;
  for (;;) {
    const uint64_t from_buf = std::min<uint64_t>(*left, end_ - pos_);
    pos_ += static_cast<size_t>(from_buf);
    *left -= from_buf;
    *moved += static_cast<size_t>(from_buf);
    if (*left == 0) return 0;
    const ssize_t r = recv(fd_, buf_.data(), buf_.size(), MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return kEof;
    pos_ = 0;
    end_ = static_cast<size_t>(r);
  }
}

int ConnectTcp(const std::string& host, uint16_t port, int timeout_ms, int abort_fd, int* out_fd,
               std::string* err) {
  const std::string where = host + ":" + std::to_string(port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int gai = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (gai != 0) {
    *err = "cannot resolve " + host + ": " + gai_strerror(gai);
    return EHOSTUNREACH;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  int last = ECONNREFUSED;
  std::string last_msg = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd =
        socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      last = errno;
      last_msg = std::strerror(last);
      continue;
    }
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno != EINPROGRESS) {
      last = errno;
      last_msg = std::strerror(last);
      close(fd);
      continue;
    }
    bool aborted = false;
    while (rc != 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now())
                            .count();
      if (left <= 0) {
        last = ETIMEDOUT;
        last_msg = "no answer within " + std::to_string(timeout_ms) + " ms";
        break;
      }
      pollfd pfd[2] = {{fd, POLLOUT, 0}, {abort_fd, POLLIN, 0}};
      const int n = poll(pfd, abort_fd >= 0 ? 2 : 1, static_cast<int>(left));
      if (n < 0) {
        if (errno == EINTR) continue;
        last = errno;
        last_msg = std::strerror(last);
        break;
      }
      if (abort_fd >= 0 && (pfd[1].revents & POLLIN)) {
        aborted = true;
        last = ECANCELED;
        last_msg = "connect aborted";
        break;
      }
      if (pfd[0].revents) {
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        if (soerr == 0) {
          rc = 0;
        } else {
          last = soerr;
          last_msg = std::strerror(soerr);
          break;
        }
      }
    }
    if (rc == 0 && SetNonBlocking(fd, false)) {
      freeaddrinfo(res);
      *out_fd = fd;
      return 0;
    }
    close(fd);
    if (aborted) break;
  }
  freeaddrinfo(res);
  *err = "connect to " + where + " failed: " + last_msg;
  return last;
}

int ListenTcp(const std::string& host, uint16_t port, int* out_fd, uint16_t* bound_port,
              std::string* err) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int gai = getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  if (gai != 0) {
    *err = "cannot resolve listen_host " + host + ": " + gai_strerror(gai);
    return EINVAL;
  }
  int last = EADDRNOTAVAIL;
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      last = errno;
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      last = errno;
      close(fd);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t sl = sizeof(ss);
    getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &sl);
    *bound_port = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                 : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    freeaddrinfo(res);
    *out_fd = fd;
    return 0;
  }
  freeaddrinfo(res);
  *err = "cannot listen on " + host + ":" + std::to_string(port) + ": " + std::strerror(last);
  return last;
}

namespace {

// An abstract-namespace address: sun_path starts with a NUL, no file exists.
socklen_t AbstractAddress(const std::string& name, sockaddr_un* a) {
  *a = {};
  a->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a->sun_path) - 1);
  std::memcpy(a->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

}  // namespace

int ListenUnix(int* out_fd, std::string* name, std::string* err) {
  uint8_t r[8];
  if (getrandom(r, sizeof r, 0) != static_cast<ssize_t>(sizeof r)) {
    *err = "no random bytes for a unix socket name";
    return EIO;
  }
  char hex[17];
  for (size_t i = 0; i < sizeof r; ++i) std::snprintf(hex + 2 * i, 3, "%02x", r[i]);
  const std::string n = std::string("ferry-tcp-") + hex;
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("unix socket: ") + std::strerror(errno);
    return errno;
  }
  sockaddr_un a;
  const socklen_t len = AbstractAddress(n, &a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || listen(fd, 128) != 0) {
    const int e = errno;
    *err = "cannot listen on unix socket @" + n + ": " + std::strerror(e);
    close(fd);
    return e;
  }
  *out_fd = fd;
  *name = n;
  return 0;
}

int ConnectUnix(const std::string& name, int timeout_ms, int* out_fd, std::string* err) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = std::string("unix socket: ") + std::strerror(errno);
    return errno;
  }
  // A full backlog makes connect() wait; SO_SNDTIMEO bounds that wait.
  SetIoTimeout(fd, timeout_ms);
  sockaddr_un a;
  const socklen_t len = AbstractAddress(name, &a);
  int rc;
  do {
    rc = connect(fd, reinterpret_cast<sockaddr*>(&a), len);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int e = errno == EAGAIN || errno == EINPROGRESS ? ETIMEDOUT : errno;
    *err = "cannot connect to unix socket @" + name + ": " + std::strerror(e);
    close(fd);
    return e;
  }
  SetIoTimeout(fd, 0);
  *out_fd = fd;
  return 0;
}

int SendWithFds(int fd, const void* buf, size_t len, const int* fds, size_t n_fds) {
  std::vector<char> control(CMSG_SPACE(sizeof(int) * n_fds));
  iovec v{const_cast<void*>(buf), len};
  msghdr m{};
  m.msg_iov = &v;
  m.msg_iovlen = 1;
  m.msg_control = control.data();
  m.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * n_fds);
  std::memcpy(CMSG_DATA(c), fds, sizeof(int) * n_fds);
  ssize_t r;
  do {
    r = sendmsg(fd, &m, MSG_NOSIGNAL);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return errno;
  // The descriptors went with the first byte; the rest, if any, follows plainly.
  const size_t sent = static_cast<size_t>(r);
  return sent == len ? 0 : SendAll(fd, static_cast<const uint8_t*>(buf) + sent, len - sent);
}

int RecvWithFds(int fd, void* buf, size_t len, int* fds, size_t max_fds, size_t* n_fds,
                bool* truncated, std::chrono::steady_clock::time_point deadline, int abort_fd) {
  *n_fds = 0;
  *truncated = false;
  auto* p = static_cast<uint8_t*>(buf);
  std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
  while (len > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return ETIMEDOUT;
    pollfd pf[2] = {{fd, POLLIN, 0}, {abort_fd, POLLIN, 0}};
    const int n = ::poll(pf, abort_fd >= 0 ? 2 : 1,
                         static_cast<int>(std::min<int64_t>(left.count() + 1, INT_MAX)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return ETIMEDOUT;
    if (abort_fd >= 0 && (pf[1].revents & POLLIN)) return ECANCELED;
    iovec v{p, len};
    msghdr m{};
    m.msg_iov = &v;
    m.msg_iovlen = 1;
    m.msg_control = control.data();
    m.msg_controllen = control.size();
    const ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (r < 0) return errno;
    if (m.msg_flags & MSG_CTRUNC) *truncated = true;
    for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int got;
        std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
        if (*n_fds < max_fds) {
          fds[(*n_fds)++] = got;
        } else {
          close(got);
          *truncated = true;
        }
      }
    }
    if (r == 0) return kEof;
    p += r;
    len -= static_cast<size_t>(r);
  }
  return 0;
}

void SetNoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void SetKeepAlive(int fd, int idle_s) {
  if (idle_s <= 0) return;
  const int one = 1, interval = std::max(1, idle_s / 5), probes = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
}

void SetIoTimeout(int fd, int timeout_ms) {
  timeval tv{};
  tv.tv_sec = timeout_ms / 1000;
  tv.tv_usec = (timeout_ms % 1000) * 1000;
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

std::string PeerAddress(int fd) {
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &sl) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {0};
  uint16_t port = 0;
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
    return std::string("[") + host + "]:" + std::to_string(port);
  }
  auto* a = reinterpret_cast<sockaddr_in*>(&ss);
  inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
  port = ntohs(a->sin_port);
  return std::string(host) + ":" + std::to_string(port);
}

Waker::Waker() : fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

Waker::~Waker() {
  if (fd_ >= 0) close(fd_);
}

void Waker::Signal() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = write(fd_, &one, sizeof(one));
}

void Waker::Clear() {
  uint64_t v;
  [[maybe_unused]] ssize_t r = read(fd_, &v, sizeof(v));
}

}  // namespace ferry_tcp
