// SPDX-License-Identifier: Apache-2.0
#include "direct_copy.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ferry_tcp::direct {
namespace {

// Pieces per system call (IOV_MAX is 1024; a frame has at most 8192 items).
constexpr size_t kBatch = 256;

std::string Errno(const char* what, int e) { return std::string(what) + ": " + std::strerror(e); }

}  // namespace

bool Gate::BeginPush() {
  // Dekker: announce, then look. With Close's store-then-look, either the
  // initiator sees this push under way or this push sees the lane closed.
  s_->pushing.store(1, std::memory_order_seq_cst);
  if (s_->closed.load(std::memory_order_seq_cst) == 0) return true;
  s_->pushing.store(0, std::memory_order_release);
  return false;
}

void Gate::EndPush() { s_->pushing.store(0, std::memory_order_release); }

void Gate::Close() { s_->closed.store(1, std::memory_order_seq_cst); }

bool Gate::PushUnderWay() const { return s_->pushing.load(std::memory_order_seq_cst) != 0; }

std::unique_ptr<Process> Process::OfPeer(int unix_fd, std::string* why) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (getsockopt(unix_fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    *why = Errno("SO_PEERCRED", errno);
    return nullptr;
  }
  // 0: the peer's pid is not visible in our pid namespace.
  if (cred.pid <= 0) {
    *why = "the peer's process is not visible from here (another pid namespace)";
    return nullptr;
  }
#ifdef SYS_pidfd_open
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, cred.pid, 0));
#else
  const int pidfd = -1;
  errno = ENOSYS;
#endif
  if (pidfd < 0) {
    *why = Errno("pidfd_open", errno);
    return nullptr;
  }
  return std::unique_ptr<Process>(new Process(cred.pid, pidfd));
}

Process::~Process() { ::close(pidfd_); }

bool Process::Exited() const { return WaitExit(0); }

bool Process::WaitExit(int timeout_ms) const {
  pollfd p{pidfd_, POLLIN, 0};
  int rc;
  while ((rc = ::poll(&p, 1, timeout_ms)) < 0 && errno == EINTR) {
  }
  return rc > 0;
}

int Process::Pull(const iovec* ours, const iovec* theirs, size_t n, uint64_t* moved,
                  std::string* why) const {
  return Copy(true, ours, theirs, n, moved, why);
}

int Process::Push(const iovec* ours, const iovec* theirs, size_t n, uint64_t* moved,
                  std::string* why) const {
  return Copy(false, ours, theirs, n, moved, why);
}

int Process::Copy(bool pull, const iovec* ours, const iovec* theirs, size_t n, uint64_t* moved,
                  std::string* why) const {
  *moved = 0;
  iovec l[kBatch], r[kBatch];
  size_t i = 0, off = 0;  // the first piece not copied whole, and how far it is
  while (i < n) {
    size_t k = 0;
    for (size_t j = i; j < n && k < kBatch; ++j, ++k) {
      const size_t skip = j == i ? off : 0;
      l[k] = {static_cast<uint8_t*>(ours[j].iov_base) + skip, ours[j].iov_len - skip};
      r[k] = {static_cast<uint8_t*>(theirs[j].iov_base) + skip, theirs[j].iov_len - skip};
    }
    const ssize_t got =
        pull ? process_vm_readv(pid_, l, k, r, k, 0) : process_vm_writev(pid_, l, k, r, k, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int e = got < 0 ? errno : EFAULT;
      *why = Errno(pull ? "reading the initiator's memory" : "writing the initiator's memory", e);
      return e;
    }
    // A partial copy stops at a piece it could not reach: go on from there
    // (the next call fails on it, or copies the rest of a long one).
    auto left = static_cast<size_t>(got);
    *moved += left;
    while (left > 0) {
      const size_t rest = ours[i].iov_len - off;
      if (left < rest) {
        off += left;
        break;
      }
      left -= rest;
      ++i;
      off = 0;
    }
  }
  return 0;
}

bool PublishProbe(void* spare) {
  // Once per load of this plugin, never freed before its unload: a target
  // whose probe outlived the handover (ours timed out meanwhile) still reads
  // and writes back these 16 bytes (after an unload, it fails on them).
  struct Token {
    uint8_t bytes[kTokenBytes];
    bool ok;
  };
  static Token token = [] {
    Token t{};
    t.ok = getrandom(t.bytes, sizeof t.bytes, 0) == static_cast<ssize_t>(sizeof t.bytes);
    return t;
  }();
  if (!token.ok) return false;
  auto* s = static_cast<Shared*>(spare);
  std::memcpy(s->probe_token, token.bytes, sizeof token.bytes);
  s->probe_addr = reinterpret_cast<uintptr_t>(token.bytes);
  return true;
}

bool CheckProbe(const Process& initiator, const void* spare, std::string* why) {
  // Read once: the initiator may change the shared bytes at any time.
  const auto* s = static_cast<const Shared*>(spare);
  uint64_t addr;
  uint8_t want[kTokenBytes], got[kTokenBytes];
  std::memcpy(&addr, &s->probe_addr, sizeof addr);
  std::memcpy(want, s->probe_token, sizeof want);
  iovec ours{got, sizeof got};
  iovec theirs{reinterpret_cast<void*>(static_cast<uintptr_t>(addr)), sizeof got};
  uint64_t moved = 0;
  if (initiator.Pull(&ours, &theirs, 1, &moved, why) != 0) return false;
  if (std::memcmp(got, want, sizeof got) != 0) {
    *why = "the initiator's process does not hold the token it published";
    return false;
  }
  // The same bytes back: a push needs the same access, and a kernel or
  // sandbox may allow one and not the other.
  return initiator.Push(&ours, &theirs, 1, &moved, why) == 0;
}

}  // namespace ferry_tcp::direct
