// SPDX-License-Identifier: Apache-2.0
#include "shm_ring.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <utility>

#include "socket_util.h"

namespace ferry_tcp::shm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x46525347;  // "FRSG"
constexpr uint32_t kVersion = 3;  // 2: bells (eventfds) instead of futex words; 3: socket pairs
// The control block's share of the segment; the ring's bytes follow it. Its
// second half is spare (Ring::spare): a peer that does not use it ignores it.
constexpr size_t kControlBytes = 4096;
constexpr size_t kSpareOffset = kControlBytes - Ring::kSpareBytes;
// Each copy publishes at most this much, so the peer starts on a large write
// while its tail is still being copied in.
constexpr uint64_t kPublishBytes = 256 << 10;
// A Wait predicate's "not yet" (every other answer is returned as is).
constexpr int kNotYet = INT_MIN;

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Wakes the other end's sleep: a byte into our end of the bell's socket pair.
// Non-blocking per call (MSG_DONTWAIT), whatever flags the peer sets on its
// end: each end is its own open file. A full buffer already means "rung".
void RingBell(int bell) {
  const char one = 1;
  while (::send(bell, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL) < 0 && errno == EINTR) {
  }
}

#if defined(__SANITIZE_THREAD__)
}  // namespace
}  // namespace ferry_tcp::shm
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
namespace ferry_tcp::shm {
namespace {
// Both ends of a ring in one process (tests) map its segment at two
// addresses, so ThreadSanitizer cannot pair the producer's index store with
// the consumer's load, and misses that what the producer wrote before (a
// target's payload into registered memory, then its ack) happens before what
// the consumer does after. One sync object per segment (by inode), released
// where an index is published and acquired where the peer's index is read,
// tells it. Kept for the process's life: TSan builds only, a few bytes a ring.
uint8_t* SyncFor(int memfd) {
  struct stat st {};
  if (memfd < 0 || fstat(memfd, &st) != 0) return nullptr;
  static std::mutex mu;
  static std::map<std::pair<dev_t, ino_t>, std::unique_ptr<uint8_t[]>> syncs;
  std::lock_guard lk(mu);
  auto& slot = syncs[{st.st_dev, st.st_ino}];
  if (!slot) slot = std::make_unique<uint8_t[]>(2);
  return slot.get();
}
void SyncRelease(uint8_t* s) {
  if (s != nullptr) __tsan_release(s);
}
void SyncAcquire(uint8_t* s) {
  if (s != nullptr) __tsan_acquire(s);
}
#else
uint8_t* SyncFor(int) { return nullptr; }
void SyncRelease(uint8_t*) {}
void SyncAcquire(uint8_t*) {}
#endif

// Makes a new index visible, then rings the peer's bell if it announced a
// sleep. Both this store and load and the sleeper's flag store and index load
// (Ring::Wait) are seq_cst, so they fall in one order: either the sleeper sees
// the index or this side sees its flag. (Operations, not fences: GCC's TSan
// does not model atomic_thread_fence and refuses to build it.)
void Publish(std::atomic<uint64_t>* index, uint64_t value, std::atomic<uint32_t>* sleeping,
             int bell, uint8_t* sync) {
  SyncRelease(sync);
  index->store(value, std::memory_order_seq_cst);
  if (sleeping->load(std::memory_order_seq_cst) != 0) RingBell(bell);
}

// A descriptor the peer says is its end of a bell: a connected unix stream
// socket (a regular file or a pipe would be always or never readable, or
// block; an unconnected or listening socket hangs up at every poll). Its
// flags do not matter: every call on it is MSG_DONTWAIT.
bool IsBell(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  auto opt = [fd](int name, int want) {
    int v = 0;
    socklen_t len = sizeof v;
    return getsockopt(fd, SOL_SOCKET, name, &v, &len) == 0 && v == want;
  };
  if (!opt(SO_DOMAIN, AF_UNIX) || !opt(SO_TYPE, SOCK_STREAM) || !opt(SO_ACCEPTCONN, 0))
    return false;
  sockaddr_storage peer{};
  socklen_t len = sizeof peer;
  return getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) == 0;
}

// A bell: a unix stream socket pair, one end ours, one the peer's.
bool MakeBell(int* ours, int* theirs) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return false;
  *ours = sv[0];
  *theirs = sv[1];
  return true;
}

// What every index the peer publishes must satisfy: the reader never ahead of
// the writer, the writer never more than a ring ahead of the reader.
bool InOrder(uint64_t head, uint64_t tail, uint64_t capacity) {
  return tail <= head && head - tail <= capacity;
}

bool PowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

enum : uint32_t { kOpen = 0, kClosed = 1, kAborted = 2 };

// At offset 0 of the segment. Each index is written by one side only and
// lives on its own cache line, so the two ends do not share a written line.
struct Ring::Control {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint64_t capacity = 0;
  alignas(64) std::atomic<uint64_t> head{0};  // bytes ever written (the producer's)
  std::atomic<uint32_t> reader_sleeping{0};
  alignas(64) std::atomic<uint64_t> tail{0};  // bytes ever read (the consumer's)
  std::atomic<uint32_t> writer_sleeping{0};
  // kOpen, kClosed (the bytes before it are still read) or kAborted (they are not).
  alignas(64) std::atomic<uint32_t> closed{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "the ring's indices are shared between processes: they must be lock-free");

int QuietBell(int bell) {
  // Bounded: a peer that rings without pause costs a few reads per turn.
  char buf[256];
  for (int i = 0; i < 16; ++i) {
    const ssize_t n = ::recv(bell, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return EPIPE;  // the peer closed its end: it is going (or broke the ring's rules)
    if (n < 0) return errno == EINTR ? 0 : (errno == EAGAIN || errno == EWOULDBLOCK ? 0 : errno);
    if (static_cast<size_t>(n) < sizeof buf) return 0;
  }
  return 0;
}

void Handover::Close() {
  for (int* fd : {&memfd, &data_bell, &space_bell}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

Ring::Ring(Handover h, Handover theirs, void* map, size_t map_bytes, uint64_t capacity)
    : sync_(SyncFor(h.memfd)),
      h_(h),
      theirs_(theirs),
      map_(map),
      map_bytes_(map_bytes),
      ctl_(static_cast<Control*>(map)),
      data_(static_cast<uint8_t*>(map) + kControlBytes),
      capacity_(capacity) {}

Ring::~Ring() { Release(); }

Ring::Ring(Ring&& o) noexcept { *this = std::move(o); }

Ring& Ring::operator=(Ring&& o) noexcept {
  if (this == &o) return *this;
  Release();
  waiting = o.waiting;
  h_ = std::exchange(o.h_, Handover{});
  theirs_ = std::exchange(o.theirs_, Handover{});
  sync_ = std::exchange(o.sync_, nullptr);
  map_ = std::exchange(o.map_, nullptr);
  map_bytes_ = std::exchange(o.map_bytes_, 0);
  ctl_ = std::exchange(o.ctl_, nullptr);
  data_ = std::exchange(o.data_, nullptr);
  capacity_ = std::exchange(o.capacity_, 0);
  head_ = std::exchange(o.head_, 0);
  tail_ = std::exchange(o.tail_, 0);
  reserved_ = std::exchange(o.reserved_, 0);
  peeked_ = std::exchange(o.peeked_, 0);
  return *this;
}

void Ring::Release() {
  if (map_ != nullptr) munmap(map_, map_bytes_);
  h_.Close();
  theirs_.Close();
  map_ = nullptr;
  ctl_ = nullptr;
  data_ = nullptr;
}

void Ring::CloseSegmentFd() {
  if (h_.memfd >= 0) ::close(h_.memfd);
  h_.memfd = -1;
  theirs_.Close();
}

Handover Ring::ForPeer() const { return {h_.memfd, theirs_.data_bell, theirs_.space_bell}; }

Handover Ring::Duplicate() const {
  const Handover p = ForPeer();
  Handover d;
  d.memfd = fcntl(p.memfd, F_DUPFD_CLOEXEC, 0);
  d.data_bell = fcntl(p.data_bell, F_DUPFD_CLOEXEC, 0);
  d.space_bell = fcntl(p.space_bell, F_DUPFD_CLOEXEC, 0);
  return d;
}

Ring Ring::Create(uint64_t capacity, std::string* why) {
  static_assert(sizeof(Control) <= kSpareOffset);
  if (!PowerOfTwo(capacity) || capacity < kMinCapacity || capacity > kMaxCapacity) {
    *why = "shared ring: capacity must be a power of two in 64KiB..64MiB";
    return {};
  }
  Handover h, theirs;
  h.memfd = memfd_create("ferry-tcp-lane", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (h.memfd < 0) {
    *why = Errno("shared ring: memfd_create");
    return {};
  }
  if (!MakeBell(&h.data_bell, &theirs.data_bell) || !MakeBell(&h.space_bell, &theirs.space_bell)) {
    *why = Errno("shared ring: socketpair");
    h.Close();
    theirs.Close();
    return {};
  }
  const size_t bytes = kControlBytes + capacity;
  // Sealed before the peer sees it: neither side can shrink what the other mapped.
  if (ftruncate(h.memfd, static_cast<off_t>(bytes)) != 0 ||
      fcntl(h.memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    *why = Errno("shared ring: sizing and sealing the segment");
    h.Close();
    theirs.Close();
    return {};
  }
  void* map = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, h.memfd, 0);
  if (map == MAP_FAILED) {
    *why = Errno("shared ring: mmap");
    h.Close();
    theirs.Close();
    return {};
  }
  auto* ctl = new (map) Control();
  ctl->capacity = capacity;
  return Ring(h, theirs, map, bytes, capacity);
}

void* Ring::spare() const { return static_cast<uint8_t*>(map_) + kSpareOffset; }

std::shared_ptr<void> Ring::ShareSpare(std::string* why) const {
  if (h_.memfd < 0) {
    *why = "shared ring: its segment's descriptor is closed";
    return nullptr;
  }
  void* map = mmap(nullptr, kControlBytes, PROT_READ | PROT_WRITE, MAP_SHARED, h_.memfd, 0);
  if (map == MAP_FAILED) {
    *why = Errno("shared ring: mmap");
    return nullptr;
  }
  return std::shared_ptr<void>(static_cast<uint8_t*>(map) + kSpareOffset, [](void* p) {
    munmap(static_cast<uint8_t*>(p) - kSpareOffset, kControlBytes);
  });
}

Ring Ring::Attach(Handover h, std::string* why) {
  auto refuse = [&](std::string msg) {
    *why = "shared ring from the peer refused: " + std::move(msg);
    h.Close();
    return Ring();
  };
  const int fd = h.memfd;
  if (fd < 0) return refuse("no segment");
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0)
    return refuse("not a sealable memory file (" + std::string(std::strerror(errno)) + ")");
  if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
    return refuse("not sealed against shrinking and growing");
  }
  if (!IsBell(h.data_bell) || !IsBell(h.space_bell)) {
    return refuse("its bells are not unix stream sockets");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) return refuse(Errno("fstat"));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  const uint64_t capacity = size > kControlBytes ? size - kControlBytes : 0;
  if (!PowerOfTwo(capacity) || capacity < kMinCapacity || capacity > kMaxCapacity) {
    return refuse("size " + std::to_string(size) +
                  " is not a control block and a ring of 64KiB..64MiB");
  }
  void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) return refuse(Errno("mmap"));
  const auto* ctl = static_cast<const Control*>(map);
  if (ctl->magic != kMagic || ctl->version != kVersion || ctl->capacity != capacity) {
    munmap(map, size);
    return refuse("bad magic, version or capacity in its control block");
  }
  Ring r(h, Handover{}, map, size, capacity);
  r.CloseSegmentFd();
  // Where the ring stands now; from here on each side trusts only its own index.
  r.head_ = r.ctl_->head.load(std::memory_order_acquire);
  r.tail_ = r.ctl_->tail.load(std::memory_order_acquire);
  if (!InOrder(r.head_, r.tail_, capacity)) {
    *why = "shared ring from the peer refused: corrupt indices";
    return Ring();
  }
  return r;
}

template <typename Ready>
int Ring::Wait(Ready ready, int bell, std::atomic<uint32_t>* sleeping,
               std::chrono::milliseconds timeout, int liveness_fd) {
  const bool forever = timeout.count() == 0;
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  auto spin_until = start + waiting.spin;
  bool gone = false;  // the liveness descriptor fired: one last look, then EPIPE
  for (;;) {
    if (const int r = ready(); r != kNotYet) return r;
    if (gone) return EPIPE;
    const auto now = Clock::now();
    if (!forever && now >= deadline) return ETIMEDOUT;
    if (now < spin_until) {
      CpuRelax();
      continue;
    }
    // Announce the sleep, then look once more: the peer either sees the flag
    // (and rings) or published before we looked (and we do not sleep).
    sleeping->store(1, std::memory_order_seq_cst);
    if (const int r = ready(); r != kNotYet) {
      sleeping->store(0, std::memory_order_relaxed);
      return r;
    }
    int ms = -1;
    if (!forever) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
      ms = static_cast<int>(std::min<int64_t>(left.count(), INT_MAX));
    }
    pollfd p[2] = {{bell, POLLIN, 0}, {liveness_fd, POLLIN | POLLRDHUP, 0}};
    const int n = ::poll(p, liveness_fd >= 0 ? 2 : 1, ms);
    sleeping->store(0, std::memory_order_relaxed);
    if (n < 0 && errno != EINTR) return errno;
    if (n <= 0) continue;
    if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
      if (QuietBell(bell) != 0) gone = true;  // the peer closed its end of the bell
      // Woken by the peer: a burst usually follows, so poll again first.
      spin_until = Clock::now() + waiting.spin;
    }
    if (liveness_fd >= 0 && p[1].revents != 0) gone = true;
  }
}

int Ring::Write(const iovec* iov, size_t n, size_t* progress, std::chrono::milliseconds timeout,
                int liveness_fd) {
  if (ctl_ == nullptr) return EBADF;
  if (reserved_ != 0) return EINVAL;  // bytes reserved in place come first
  // Find where *progress left off.
  size_t idx = 0, off = *progress;
  while (idx < n && off >= iov[idx].iov_len) off -= iov[idx++].iov_len;
  const uint64_t mask = capacity_ - 1;
  uint64_t space = 0;
  auto room = [&] { return Room(&space); };
  while (idx < n) {
    int r = room();
    if (r == kNotYet) {
      if (timeout.count() == 0) return EAGAIN;
      r = Wait(room, h_.space_bell, &ctl_->writer_sleeping, timeout, liveness_fd);
    }
    if (r != 0) return r;
    const uint64_t k = std::min(space, kPublishBytes);
    uint64_t done = 0;
    while (done < k && idx < n) {
      const uint64_t pos = (head_ + done) & mask;
      const uint64_t take =
          std::min({k - done, static_cast<uint64_t>(iov[idx].iov_len - off), capacity_ - pos});
      std::memcpy(data_ + pos, static_cast<const uint8_t*>(iov[idx].iov_base) + off, take);
      done += take;
      off += take;
      if (off == iov[idx].iov_len) {
        ++idx;
        off = 0;
      }
    }
    head_ += done;
    *progress += done;
    PublishHead();
  }
  return 0;
}

int Ring::Room(uint64_t* space) {
  const uint64_t tail = ctl_->tail.load(std::memory_order_seq_cst);  // pairs with Publish
  SyncAcquire(sync_ == nullptr ? nullptr : sync_ + 1);
  if (!InOrder(head_, tail, capacity_)) return EPROTO;
  if (ctl_->closed.load(std::memory_order_acquire) != kOpen) return EPIPE;
  const uint64_t used = head_ - tail + reserved_;
  *space = used < capacity_ ? capacity_ - used : 0;
  return *space > 0 ? 0 : kNotYet;
}

void Ring::PublishHead() {
  Publish(&ctl_->head, head_, &ctl_->reader_sleeping, h_.data_bell, sync_);
}

void Ring::PublishTail() {
  Publish(&ctl_->tail, tail_, &ctl_->writer_sleeping, h_.space_bell,
          sync_ == nullptr ? nullptr : sync_ + 1);
}

int Ring::Reserve(uint64_t max, uint8_t** at, uint64_t* len, std::chrono::milliseconds timeout,
                  int liveness_fd) {
  if (ctl_ == nullptr) return EBADF;
  if (max == 0) return EINVAL;
  uint64_t space = 0;
  auto room = [&] { return Room(&space); };
  int r = room();
  if (r == kNotYet) {
    if (timeout.count() == 0) return EAGAIN;
    r = Wait(room, h_.space_bell, &ctl_->writer_sleeping, timeout, liveness_fd);
  }
  if (r != 0) return r;
  const uint64_t pos = (head_ + reserved_) & (capacity_ - 1);
  *len = std::min({max, space, capacity_ - pos});
  *at = data_ + pos;
  reserved_ += *len;
  return 0;
}

void Ring::Commit(uint64_t len) {
  len = std::min(len, reserved_);
  reserved_ -= len;
  head_ += len;
  PublishHead();
}

int Ring::Peek(uint64_t max, const uint8_t** at, uint64_t* len, std::chrono::milliseconds timeout,
               int liveness_fd) {
  if (ctl_ == nullptr) return EBADF;
  if (max == 0) return EINVAL;
  uint64_t avail = 0;
  auto ready = [&] { return Available(&avail, peeked_); };
  int r = ready();
  if (r == kNotYet) {
    if (timeout.count() == 0) return EAGAIN;
    r = Wait(ready, h_.data_bell, &ctl_->reader_sleeping, timeout, liveness_fd);
  }
  if (r != 0) return r;
  const uint64_t pos = (tail_ + peeked_) & (capacity_ - 1);
  *len = std::min({max, avail, capacity_ - pos});
  *at = data_ + pos;
  peeked_ += *len;
  return 0;
}

void Ring::Consume(uint64_t len) {
  len = std::min(len, peeked_);
  peeked_ -= len;
  tail_ += len;
  PublishTail();
}

uint64_t Ring::Readable() const {
  if (ctl_ == nullptr) return 0;
  const uint64_t head = ctl_->head.load(std::memory_order_acquire);
  return InOrder(head, tail_, capacity_) ? head - tail_ : 0;
}

int Ring::Available(uint64_t* avail, uint64_t skip) {
  // The close first: a head read after it includes every byte written before
  // it, so "closed and nothing left" is the end, never a lost tail.
  const uint32_t closed = ctl_->closed.load(std::memory_order_acquire);
  if (closed == kAborted) return ECONNRESET;
  const uint64_t head = ctl_->head.load(std::memory_order_seq_cst);  // pairs with Publish
  SyncAcquire(sync_);
  // The peer may only move head forward: below what was peeked is a broken rule.
  if (!InOrder(head, tail_, capacity_) || head - tail_ < skip) return EPROTO;
  *avail = head - tail_ - skip;
  if (*avail > 0) return 0;
  return closed != kOpen ? kEof : kNotYet;
}

void Ring::Take(uint8_t* out, uint64_t k) {
  const uint64_t pos = tail_ & (capacity_ - 1);
  const uint64_t first = std::min(k, capacity_ - pos);
  std::memcpy(out, data_ + pos, first);
  std::memcpy(out + first, data_, k - first);
  tail_ += k;
  PublishTail();
}

int Ring::Read(void* buf, size_t len, size_t* got, std::chrono::milliseconds timeout,
               int liveness_fd) {
  auto* out = static_cast<uint8_t*>(buf);
  *got = 0;
  for (;;) {
    size_t n = 0;
    int r = ReadSome(out + *got, len - *got, &n);
    *got += n;
    if (r != EAGAIN) return r;
    uint64_t avail = 0;
    r = Wait([&] { return Available(&avail); }, h_.data_bell, &ctl_->reader_sleeping, timeout,
             liveness_fd);
    if (r != 0) return r;
  }
}

int Ring::ReadSome(void* buf, size_t len, size_t* got) {
  if (ctl_ == nullptr) return EBADF;
  if (peeked_ != 0) return EINVAL;  // bytes peeked in place come first
  auto* out = static_cast<uint8_t*>(buf);
  *got = 0;
  while (*got < len) {
    uint64_t avail = 0;
    const int r = Available(&avail);
    if (r == kNotYet) return EAGAIN;
    if (r != 0) return r;
    const uint64_t k = std::min({avail, static_cast<uint64_t>(len - *got), kPublishBytes});
    Take(out + *got, k);
    *got += k;
  }
  return 0;
}

bool Ring::SleepForData() {
  if (ctl_ == nullptr) return false;
  ctl_->reader_sleeping.store(1, std::memory_order_seq_cst);  // as in Wait: then look
  uint64_t avail = 0;
  if (Available(&avail) == kNotYet) return true;
  ctl_->reader_sleeping.store(0, std::memory_order_relaxed);
  return false;
}

bool Ring::PendingAnyThread() const {
  if (ctl_ == nullptr) return false;
  if (ctl_->closed.load(std::memory_order_acquire) != kOpen) return true;
  const uint64_t head = ctl_->head.load(std::memory_order_seq_cst);  // pairs with Publish
  return head != ctl_->tail.load(std::memory_order_acquire);
}

bool Ring::SleepForDataAnyThread() {
  if (ctl_ == nullptr) return true;
  ctl_->reader_sleeping.store(1, std::memory_order_seq_cst);  // as in Wait: then look
  return !PendingAnyThread();
}

bool Ring::SleepForRoom() {
  if (ctl_ == nullptr) return false;
  ctl_->writer_sleeping.store(1, std::memory_order_seq_cst);
  // Room, a corrupt index or a close: a write would not wait (it says which).
  uint64_t space = 0;
  if (Room(&space) == kNotYet) return true;
  ctl_->writer_sleeping.store(0, std::memory_order_relaxed);
  return false;
}

void Ring::AwakeForData() {
  // seq_cst: a watcher (io_pool.h) clears the flag, then looks at the head;
  // a writer that still saw it set rings a bell nobody needs, no more.
  if (ctl_ != nullptr) ctl_->reader_sleeping.store(0, std::memory_order_seq_cst);
}

void Ring::AwakeForRoom() {
  if (ctl_ != nullptr) ctl_->writer_sleeping.store(0, std::memory_order_relaxed);
}

int Ring::WaitReadable(std::chrono::milliseconds timeout, int liveness_fd) {
  if (ctl_ == nullptr) return EBADF;
  // From the published indices only: another thread may be reading (and
  // moving tail_) meanwhile. A hint, never an index: a lagging or corrupt
  // value only ends the wait early, and the next read decides.
  auto ready = [&]() -> int { return PendingAnyThread() ? 0 : kNotYet; };
  if (ready() == 0) return 0;
  return Wait(ready, h_.data_bell, &ctl_->reader_sleeping, timeout, liveness_fd);
}

void Ring::Close() {
  if (ctl_ == nullptr) return;
  uint32_t open = kOpen;
  ctl_->closed.compare_exchange_strong(open, kClosed, std::memory_order_acq_rel);
  RingBell(h_.data_bell);
  RingBell(h_.space_bell);
}

void Ring::Abort() {
  if (ctl_ == nullptr) return;
  ctl_->closed.store(kAborted, std::memory_order_release);
  RingBell(h_.data_bell);
  RingBell(h_.space_bell);
}

}  // namespace ferry_tcp::shm
