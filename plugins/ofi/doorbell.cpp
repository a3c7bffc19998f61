// SPDX-License-Identifier: Apache-2.0
#include "doorbell.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <random>

namespace ferry_ofi {

struct Doorbell::Page {
  uint64_t magic;
  uint64_t token;
  std::atomic<uint32_t> seq;       // bumped by every ring
  std::atomic<uint32_t> sleeping;  // the owner sleeps (or is about to)
  // Robust and process-shared; held by the owner's progress thread. All
  // zeroes in a page of a ferry before 2026-12-03 (and in a new page: the
  // owner initialises it before it publishes kMagic).
  pthread_mutex_t life;
};

namespace {

constexpr uint64_t kMagic = 0x4c4c4542524f4631ull;  // "1FORBELL"
constexpr size_t kPageSize = 4096;
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* ts) {
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, ts, nullptr, 0);
}

}  // namespace

std::unique_ptr<Doorbell> Doorbell::Create(std::string* why) {
  std::random_device rd;
  const uint64_t token =
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  char name[64];
  std::snprintf(name, sizeof(name), "/ferry-ofi-%d-%016llx", static_cast<int>(getpid()),
                static_cast<unsigned long long>(token));
  const int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    *why = std::string("shm_open(") + name + "): " + std::strerror(errno);
    return nullptr;
  }
  void* p = MAP_FAILED;
  if (ftruncate(fd, kPageSize) == 0)
    p = mmap(nullptr, kPageSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name);
    *why = std::string("doorbell page: ") + std::strerror(err);
    return nullptr;
  }
  std::unique_ptr<Doorbell> d(new Doorbell());
  d->page_ = static_cast<Page*>(p);
  d->name_ = name;
  d->owner_ = true;  // from here on d's destructor unmaps and unlinks the page
  d->page_->token = token;
  d->page_->seq.store(0);
  d->page_->sleeping.store(0);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int rc = pthread_mutex_init(&d->page_->life, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) {
    *why = std::string("doorbell life mark: ") + std::strerror(rc);
    return nullptr;
  }
  __atomic_store_n(&d->page_->magic, kMagic, __ATOMIC_RELEASE);
  return d;
}

std::unique_ptr<Doorbell> Doorbell::Open(const std::string& name, std::string* why) {
  // The name must be one Create makes: "/ferry-ofi-<pid>-<16 hex digits>".
  unsigned long long token = 0;
  int pid = 0, used = 0;
  if (name.size() > 60 ||
      std::sscanf(name.c_str(), "/ferry-ofi-%d-%16llx%n", &pid, &token, &used) != 2 ||
      static_cast<size_t>(used) != name.size() || pid <= 0) {
    *why = "malformed doorbell name";
    return nullptr;
  }
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    *why = "cannot open the peer's doorbell " + name + ": " + std::strerror(errno) +
           " (another IPC namespace or user?)";
    return nullptr;
  }
  struct stat st {};
  uint64_t head[2] = {0, 0};  // magic, token
  const bool ok = fstat(fd, &st) == 0 && st.st_size == static_cast<off_t>(kPageSize) &&
                  pread(fd, head, sizeof(head), 0) == static_cast<ssize_t>(sizeof(head)) &&
                  head[0] == kMagic && head[1] == token;
  void* p = ok ? mmap(nullptr, kPageSize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  if (p == MAP_FAILED) {
    *why = "the peer's doorbell " + name + " is not a ferry doorbell page";
    return nullptr;
  }
  std::unique_ptr<Doorbell> d(new Doorbell());
  d->page_ = static_cast<Page*>(p);
  d->name_ = name;
  return d;
}

Doorbell::~Doorbell() {
  if (page_ != nullptr) munmap(page_, kPageSize);
  if (owner_) shm_unlink(name_.c_str());
}

void Doorbell::HoldLife() {
  if (owner_) pthread_mutex_lock(&page_->life);
}

void Doorbell::ReleaseLife() {
  if (owner_) pthread_mutex_unlock(&page_->life);
}

bool Doorbell::OwnerDied() const {
  // glibc keeps a robust mutex's futex word in __data.__lock: the holder's
  // thread id, with FUTEX_OWNER_DIED set by the kernel when the holder died.
  // A load, no system call: it runs before every RMA to this peer.
  const int word = __atomic_load_n(&page_->life.__data.__lock, __ATOMIC_ACQUIRE);
  return (word & FUTEX_OWNER_DIED) != 0;
}

void Doorbell::Ring() {
  page_->seq.fetch_add(1);
  if (page_->sleeping.load() != 0) Futex(&page_->seq, FUTEX_WAKE, INT_MAX, nullptr);
}

void Doorbell::RingIfSleeping() {
  if (page_->sleeping.load(std::memory_order_relaxed) != 0) Ring();
}

uint32_t Doorbell::Arm() {
  page_->sleeping.store(1);
  return page_->seq.load();
}

bool Doorbell::Sleep(uint32_t armed, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000),
              static_cast<long>(timeout_ns % 1'000'000'000)};
  const long rc = Futex(&page_->seq, FUTEX_WAIT, armed, timeout_ns < 0 ? nullptr : &ts);
  const bool timed_out = rc != 0 && errno == ETIMEDOUT;
  page_->sleeping.store(0);
  return !timed_out;
}

void Doorbell::Disarm() { page_->sleeping.store(0); }

}  // namespace ferry_ofi
