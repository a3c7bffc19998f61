// SPDX-License-Identifier: Apache-2.0
#include "channel.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace ferry_tcp {
namespace {

// "As long as the peer lives" for a ring write, whose timeout of 0 means "do
// not wait" (shm_ring.h).
constexpr std::chrono::milliseconds kNoStallLimit = std::chrono::hours(24 * 365);

// Reads a ring lane: straight from the shared ring into the destination, so
// no read-ahead buffer is needed (no system call per read to save).
class RingReader final : public ByteReader {
 public:
  RingReader(shm::Ring* ring, int liveness_fd, std::chrono::milliseconds timeout)
      : ring_(ring), fd_(liveness_fd), timeout_(timeout) {}

  int ReadIov(const iovec* iov, size_t n, bool idle_ok) override {
    bool any = false;
    for (size_t i = 0; i < n; ++i) {
      auto* p = static_cast<uint8_t*>(iov[i].iov_base);
      size_t left = iov[i].iov_len;
      while (left > 0) {
        size_t got = 0;
        const int err = ring_->Read(p, left, &got, timeout_, fd_);
        p += got;
        left -= got;
        any = any || got > 0;
        if (err == ETIMEDOUT && idle_ok && !any) continue;
        // The socket's end (the peer gone, or ours shut down) reads as a socket
        // lane's recv() does: end of stream.
        if (err == EPIPE) return kEof;
        if (err != 0) return err;
      }
    }
    return 0;
  }

  // Never waits: what the ring holds now (a reader driven by progress() and
  // the lane's receiver thread, responses.h).
  int ReadSome(std::vector<iovec>& v, size_t* first, size_t* moved) override {
    *moved = 0;
    while (*first < v.size()) {
      iovec& piece = v[*first];
      size_t got = 0;
      const int err = ring_->ReadSome(piece.iov_base, piece.iov_len, &got);
      piece.iov_base = static_cast<uint8_t*>(piece.iov_base) + got;
      piece.iov_len -= got;
      *moved += got;
      if (err != 0) return err;
      ++*first;
    }
    return 0;
  }

  int DiscardSome(uint64_t* left, size_t* moved) override {
    uint8_t scratch[16 * 1024];
    *moved = 0;
    while (*left > 0) {
      size_t got = 0;
      const int err = ring_->ReadSome(
          scratch, static_cast<size_t>(std::min<uint64_t>(*left, sizeof scratch)), &got);
      *left -= got;
      *moved += got;
      if (err != 0) return err;
    }
    return 0;
  }

  int Discard(uint64_t len) override {
    uint8_t scratch[16 * 1024];
    while (len > 0) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(len, sizeof scratch));
      const int err = Read(scratch, k);
      if (err != 0) return err;
      len -= k;
    }
    return 0;
  }

 private:
  shm::Ring* ring_;
  const int fd_;
  const std::chrono::milliseconds timeout_;
};

}  // namespace

Channel::Channel(int fd, shm::Ring out, shm::Ring in, std::chrono::milliseconds io_timeout)
    : fd_(fd), out_(std::move(out)), in_(std::move(in)), io_timeout_(io_timeout) {}

Channel::~Channel() {
  for (auto& pin : ring_pins_) pin.reset();  // before the rings unmap their bytes
  for (int ep : wait_sets_)
    if (ep >= 0) ::close(ep);
  for (int fd : nudges_)
    if (fd >= 0) ::close(fd);
}

int Channel::NudgeFd(Side side) {
  int& fd = nudges_[static_cast<int>(side)];
  if (fd < 0) fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return fd;
}

int Channel::WaitSet(Side side) {
  if (!on_rings()) return fd_;
  int& ep = wait_sets_[static_cast<int>(side)];
  if (ep >= 0) return ep;
  const int made = epoll_create1(EPOLL_CLOEXEC);
  if (made < 0) return -1;
  // Level-triggered: a bell stays readable until Woken quiets it, and a socket
  // that is over stays so; the pool re-arms its one-shot watch of this set
  // after every turn, so nothing that fired during a turn is missed.
  const int nudge = NudgeFd(side);
  if (nudge < 0) {
    const int err = errno;
    ::close(made);
    errno = err;
    return -1;
  }
  std::pair<int, uint32_t> watched[4];
  size_t n = 0;
  if (side != Side::kOut) watched[n++] = {in_.handover().data_bell, EPOLLIN};
  if (side != Side::kIn) watched[n++] = {out_.handover().space_bell, EPOLLIN};
  watched[n++] = {nudge, EPOLLIN};
  watched[n++] = {fd_, EPOLLIN | EPOLLRDHUP};
  for (size_t i = 0; i < n; ++i) {
    epoll_event ev{};
    ev.events = watched[i].second;
    ev.data.fd = watched[i].first;
    if (epoll_ctl(made, EPOLL_CTL_ADD, watched[i].first, &ev) != 0) {
      const int err = errno;
      ::close(made);
      errno = err;
      return -1;
    }
  }
  ep = made;
  return ep;
}

uint32_t Channel::RoomEvents() const { return on_rings() ? EPOLLIN : EPOLLOUT; }

bool Channel::Woken(Side side) {
  if (side != Side::kOut) in_.AwakeForData();
  if (side != Side::kIn) out_.AwakeForRoom();
  const int ep = wait_sets_[static_cast<int>(side)];
  if (ep < 0) return false;
  epoll_event evs[4];
  int n;
  while ((n = epoll_wait(ep, evs, 4, 0)) < 0 && errno == EINTR) {
  }
  bool gone = false;
  for (int i = 0; i < n; ++i) {
    const int fd = evs[i].data.fd;
    if (fd == fd_) {
      gone = true;
    } else if (fd == nudges_[static_cast<int>(side)]) {
      uint64_t v;  // our own eventfd (the peer never holds it): non-blocking
      while (::read(fd, &v, sizeof v) < 0 && errno == EINTR) {
      }
    } else if (shm::QuietBell(fd) != 0) {
      // The peer closed its end of a bell, or it is no bell that works (a
      // hang-up or error would fire this set at every turn): the lane is over.
      gone = true;
    }
  }
  return gone;
}

void Channel::Nudge(Side side) {
  // Our own eventfd in that side's wait set, not a bell: the peer's end of a
  // bell is what rings ours, and it holds no descriptor of this one.
  const int fd = NudgeFd(side);
  if (fd < 0) return;  // no descriptor: the set could not be made either
  const uint64_t one = 1;
  while (::write(fd, &one, sizeof one) < 0 && errno == EINTR) {
  }
}

void Channel::EnableDirect(std::unique_ptr<direct::Process> initiator) {
  direct_peer_ = std::move(initiator);
}

void Channel::SetSpin(std::chrono::microseconds spin) {
  out_.waiting.spin = in_.waiting.spin = spin;
}

int Channel::Send(const iovec* iov, size_t n, size_t* progress, int flags) {
  if (!on_rings()) return SendIov(fd_, iov, n, progress, flags);
  std::chrono::milliseconds wait = io_timeout_.count() == 0 ? kNoStallLimit : io_timeout_;
  if (flags & MSG_DONTWAIT) wait = std::chrono::milliseconds(0);
  return out_.Write(iov, n, progress, wait, fd_);
}

int Channel::SendAll(const void* buf, size_t len) {
  if (!on_rings()) return ferry_tcp::SendAll(fd_, buf, len);
  iovec v{const_cast<void*>(buf), len};
  size_t progress = 0;
  return Send(&v, 1, &progress);
}

int Channel::WaitReadable() { return in_.WaitReadable(io_timeout_, fd_); }

std::chrono::milliseconds Channel::ring_wait() const {
  return io_timeout_.count() == 0 ? kNoStallLimit : io_timeout_;
}

std::unique_ptr<ByteReader> Channel::Reader() {
  if (!on_rings()) return std::make_unique<SocketReader>(fd_);
  return std::make_unique<RingReader>(&in_, fd_, io_timeout_);
}

void Channel::AbortOutgoing() {
  if (on_rings()) {
    out_.Abort();
    return;
  }
  // connect() with AF_UNSPEC is Linux's abortive disconnect for TCP: RST to the
  // peer and the unsent queue dropped at once, while the descriptor stays valid
  // for the threads still using it (they see ECONNRESET or EOF); linger 0 makes
  // the final close a RST too, in case the disconnect could not be made.
  sockaddr unspec{};
  unspec.sa_family = AF_UNSPEC;
  ::connect(fd_, &unspec, sizeof unspec);
  linger abort{1, 0};
  ::setsockopt(fd_, SOL_SOCKET, SO_LINGER, &abort, sizeof abort);
}

void Channel::CloseOutgoing() {
  if (on_rings()) out_.Close();
}

}  // namespace ferry_tcp
