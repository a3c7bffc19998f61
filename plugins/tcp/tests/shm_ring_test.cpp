// SPDX-License-Identifier: Apache-2.0
// The same-host byte ring (shm_ring.h) between real processes: data through
// many wrap-arounds both ways, sleeping and waking, and what a hostile or dead
// peer can do to it.
#include "shm_ring.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "socket_util.h"

namespace ferry_tcp::shm {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kCap = kMinCapacity;  // 64 KiB: a few MiB wrap it many times

uint8_t PatternByte(uint64_t i) { return static_cast<uint8_t>((i * 2654435761u) >> 13); }

// Deterministic sizes in [1, max] so both processes cut the stream differently.
struct Sizes {
  uint64_t s;
  size_t Next(size_t max) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return 1 + static_cast<size_t>((s >> 33) % max);
  }
};

Ring MustCreate(uint64_t cap = kCap) {
  std::string why;
  Ring r = Ring::Create(cap, &why);
  EXPECT_TRUE(r.ok()) << why;
  return r;
}

void Poke(int fd, size_t offset, uint64_t value);

Ring MustAttach(const Ring& r) {
  std::string why;
  Ring a = Ring::Attach(r.Duplicate(), &why);
  EXPECT_TRUE(a.ok()) << why;
  return a;
}

// The child's half of StreamsAcrossProcesses: reads `total` bytes from `in`,
// checks them and echoes them to `out`. Exit status 0 = every byte right.
[[noreturn]] void EchoChild(Handover in_h, Handover out_h, uint64_t total,
                            std::chrono::microseconds spin) {
  std::string why;
  Ring in = Ring::Attach(in_h, &why), out = Ring::Attach(out_h, &why);
  if (!in.ok() || !out.ok()) _exit(10);
  in.waiting.spin = out.waiting.spin = spin;
  Sizes sz{7};
  std::vector<uint8_t> buf(300000);
  for (uint64_t at = 0; at < total;) {
    const size_t n = std::min<uint64_t>(sz.Next(buf.size()), total - at);
    size_t got = 0;
    if (in.Read(buf.data(), n, &got, 10s, -1) != 0 || got != n) _exit(11);
    for (size_t i = 0; i < n; ++i) {
      if (buf[i] != PatternByte(at + i)) _exit(12);
    }
    // Echo as two iovecs split at an odd point.
    const size_t cut = n / 3;
    iovec v[2] = {{buf.data(), cut}, {buf.data() + cut, n - cut}};
    size_t progress = 0;
    if (out.Write(v, 2, &progress, 10s, -1) != 0 || progress != n) _exit(13);
    at += n;
  }
  _exit(0);
}

void StreamBothWays(std::chrono::microseconds spin) {
  const uint64_t total = (8u << 20) + 13;
  Ring a2b = MustCreate(), b2a = MustCreate();
  ASSERT_TRUE(a2b.ok() && b2a.ok());
  a2b.waiting.spin = b2a.waiting.spin = spin;
  Handover in_h = a2b.Duplicate(), out_h = b2a.Duplicate();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) EchoChild(in_h, out_h, total, spin);
  in_h.Close();
  out_h.Close();
  std::atomic<bool> echo_ok{false};
  std::thread reader([&] {
    Sizes sz{11};
    std::vector<uint8_t> buf(200000);
    for (uint64_t at = 0; at < total;) {
      const size_t n = std::min<uint64_t>(sz.Next(buf.size()), total - at);
      size_t got = 0;
      if (b2a.Read(buf.data(), n, &got, 10s, -1) != 0 || got != n) return;
      for (size_t i = 0; i < n; ++i) {
        if (buf[i] != PatternByte(at + i)) return;
      }
      at += n;
    }
    echo_ok = true;
  });
  Sizes sz{3};
  std::vector<uint8_t> src(total);
  for (uint64_t i = 0; i < total; ++i) src[i] = PatternByte(i);
  int write_err = 0;
  for (uint64_t at = 0; at < total;) {
    // Up to four iovecs per write, some larger than the ring.
    iovec v[4];
    size_t nv = 0, bytes = 0;
    while (nv < 4 && at + bytes < total) {
      const size_t n = std::min<uint64_t>(sz.Next(100000), total - at - bytes);
      v[nv++] = {src.data() + at + bytes, n};
      bytes += n;
    }
    size_t progress = 0;
    write_err = a2b.Write(v, nv, &progress, 10s, -1);
    if (write_err != 0 || progress != bytes) break;
    at += bytes;
  }
  if (write_err != 0) {
    // Closing wakes the echo reader and the child, so a failure ends here.
    a2b.Close();
    b2a.Close();
  }
  reader.join();
  EXPECT_EQ(write_err, 0) << IoErrorString(write_err);
  int st = 0;
  ASSERT_EQ(waitpid(child, &st, 0), child);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "the child saw wrong bytes or an error (exit code says where)";
  EXPECT_TRUE(echo_ok) << "the echo came back wrong";
}

TEST(ShmRing, StreamsAcrossProcessesBothWaysPolling) { StreamBothWays(50us); }

// No polling at all: every wait sleeps on its bell, so every wake-up path runs.
TEST(ShmRing, StreamsAcrossProcessesBothWaysSleeping) { StreamBothWays(0us); }

// The in-place ends (Reserve / Commit, Peek / Consume) as a GPU stager uses
// them: the child peeks up to three pieces before it consumes the oldest,
// copies each into up to three reservations of the other ring and commits
// them oldest first, so pieces stop at the ring's end and the indices wrap
// many times. The parent writes and reads with Write / Read and checks every
// byte that comes back. Exit codes as EchoChild's.
[[noreturn]] void InPlaceEchoChild(Handover in_h, Handover out_h, uint64_t total) {
  std::string why;
  Ring in = Ring::Attach(in_h, &why), out = Ring::Attach(out_h, &why);
  if (!in.ok() || !out.ok()) _exit(10);
  Sizes sz{5};
  struct Piece {
    const uint8_t* at;
    uint64_t len;
  };
  std::vector<Piece> peeked;
  std::vector<uint64_t> reserved;
  uint64_t read = 0, checked = 0;
  while (checked < total) {
    if (read < total && peeked.size() < 3) {
      const uint8_t* at = nullptr;
      uint64_t len = 0;
      const int err = in.Peek(std::min<uint64_t>(sz.Next(40000), total - read), &at, &len,
                              peeked.empty() ? 10s : 0ms, -1);
      if (err == 0) {
        peeked.push_back({at, len});
        read += len;
        continue;
      }
      if (err != EAGAIN) _exit(11);
    }
    // The oldest peeked piece: check it, copy it into reservations, consume it.
    const Piece p = peeked.front();
    peeked.erase(peeked.begin());
    for (uint64_t i = 0; i < p.len; ++i) {
      if (p.at[i] != PatternByte(checked + i)) _exit(12);
    }
    for (uint64_t done = 0; done < p.len;) {
      uint8_t* at = nullptr;
      uint64_t len = 0;
      int err = out.Reserve(p.len - done, &at, &len, 0ms, -1);
      if (err == EAGAIN && !reserved.empty()) {
        out.Commit(reserved.front());
        reserved.erase(reserved.begin());
        continue;
      }
      if (err == EAGAIN) err = out.Reserve(p.len - done, &at, &len, 10s, -1);
      if (err != 0) _exit(13);
      std::memcpy(at, p.at + done, len);
      reserved.push_back(len);
      done += len;
      if (reserved.size() == 3) {
        out.Commit(reserved.front());
        reserved.erase(reserved.begin());
      }
    }
    in.Consume(p.len);
    checked += p.len;
  }
  for (uint64_t len : reserved) out.Commit(len);
  _exit(0);
}

TEST(ShmRing, InPlaceEndsStreamAcrossProcesses) {
  const uint64_t total = (6u << 20) + 7;
  Ring a2b = MustCreate(), b2a = MustCreate();
  ASSERT_TRUE(a2b.ok() && b2a.ok());
  Handover in_h = a2b.Duplicate(), out_h = b2a.Duplicate();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) InPlaceEchoChild(in_h, out_h, total);
  in_h.Close();
  out_h.Close();
  std::atomic<bool> echo_ok{false};
  std::thread reader([&] {
    std::vector<uint8_t> buf(100000);
    Sizes sz{9};
    for (uint64_t at = 0; at < total;) {
      const size_t n = std::min<uint64_t>(sz.Next(buf.size()), total - at);
      size_t got = 0;
      if (b2a.Read(buf.data(), n, &got, 10s, -1) != 0) return;
      for (size_t i = 0; i < n; ++i) {
        if (buf[i] != PatternByte(at + i)) return;
      }
      at += n;
    }
    echo_ok = true;
  });
  std::vector<uint8_t> src(total);
  for (uint64_t i = 0; i < total; ++i) src[i] = PatternByte(i);
  Sizes sz{13};
  int write_err = 0;
  for (uint64_t at = 0; at < total && write_err == 0;) {
    const size_t n = std::min<uint64_t>(sz.Next(90000), total - at);
    iovec v{src.data() + at, n};
    size_t progress = 0;
    write_err = a2b.Write(&v, 1, &progress, 10s, -1);
    at += n;
  }
  if (write_err != 0) {
    a2b.Close();
    b2a.Close();
  }
  reader.join();
  EXPECT_EQ(write_err, 0) << IoErrorString(write_err);
  int st = 0;
  ASSERT_EQ(waitpid(child, &st, 0), child);
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 0) << "the child saw wrong bytes or an error (exit code says where)";
  EXPECT_TRUE(echo_ok) << "the echo came back wrong";
}

// Peeked bytes stay the consumer's until consumed: the producer finds no room
// in them. A reservation is invisible until committed, and Unreserve drops it.
// Write and ReadSome refuse to run past in-place bytes. A head the peer moves
// back below what was peeked is EPROTO.
TEST(ShmRing, InPlaceEndsKeepTheirBytesUntilHandedOn) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  uint8_t* at = nullptr;
  uint64_t len = 0;
  ASSERT_EQ(w.Reserve(kCap, &at, &len, 0ms, -1), 0);
  EXPECT_EQ(len, kCap);
  std::memset(at, 0x11, len);
  const uint8_t* got_at = nullptr;
  uint64_t got = 0;
  EXPECT_EQ(r.Peek(16, &got_at, &got, 0ms, -1), EAGAIN);  // reserved, not committed
  EXPECT_EQ(w.Reserve(1, &at, &len, 0ms, -1), EAGAIN);    // the whole ring is reserved
  uint8_t b = 0;
  iovec v{&b, 1};
  size_t progress = 0;
  EXPECT_EQ(w.Write(&v, 1, &progress, 0ms, -1), EINVAL);
  w.Commit(1000);
  w.Unreserve();
  EXPECT_EQ(r.Readable(), 1000u);
  ASSERT_EQ(r.Peek(600, &got_at, &got, 0ms, -1), 0);
  EXPECT_EQ(got, 600u);
  ASSERT_EQ(r.Peek(kCap, &got_at, &got, 0ms, -1), 0);
  EXPECT_EQ(got, 400u);
  EXPECT_EQ(r.Peek(kCap, &got_at, &got, 0ms, -1), EAGAIN);
  size_t n = 0;
  EXPECT_EQ(r.ReadSome(&b, 1, &n), EINVAL);
  // Room for exactly the bytes never written: the 1000 peeked ones are held.
  ASSERT_EQ(w.Reserve(kCap, &at, &len, 0ms, -1), 0);
  EXPECT_EQ(len, kCap - 1000);
  EXPECT_EQ(w.Reserve(1, &at, &len, 0ms, -1), EAGAIN);
  w.Unreserve();
  r.Consume(600);
  ASSERT_EQ(w.Reserve(kCap, &at, &len, 0ms, -1), 0);
  EXPECT_EQ(len, kCap - 1000);  // stops at the ring's end
  ASSERT_EQ(w.Reserve(kCap, &at, &len, 0ms, -1), 0);
  EXPECT_EQ(len, 600u);  // then goes on at its start
  w.Unreserve();
  r.Unpeek();  // the other 400 are read again
  ASSERT_EQ(r.Peek(kCap, &got_at, &got, 0ms, -1), 0);
  EXPECT_EQ(got, 400u);
  EXPECT_EQ(got_at[0], 0x11);
  Poke(w.fd(), 64, 700);  // the peer's head back below the 1000 peeked
  EXPECT_EQ(r.Peek(kCap, &got_at, &got, 0ms, -1), EPROTO);
}

TEST(ShmRing, IdleReaderTimesOutAsleepNotSpinning) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  timespec t0{}, t1{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  uint8_t b = 0;
  size_t got = 7;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(r.Read(&b, 1, &got, 300ms, -1), ETIMEDOUT);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  EXPECT_EQ(got, 0u);
  const double cpu = static_cast<double>(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
  // 300 ms of waiting: a spinning reader would burn ~0.3 s of CPU.
  EXPECT_LT(cpu, 0.05) << "the idle reader used " << cpu << " s of CPU";
}

TEST(ShmRing, CloseDrainsThenEofAndWriterGetsEpipe) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  std::vector<uint8_t> data(1000, 0x5a), back(1000);
  iovec v{data.data(), data.size()};
  size_t progress = 0, got = 0;
  ASSERT_EQ(w.Write(&v, 1, &progress, 1s, -1), 0);
  w.Close();
  ASSERT_EQ(r.Read(back.data(), back.size(), &got, 1s, -1), 0);
  EXPECT_EQ(back, data);
  uint8_t b = 0;
  EXPECT_EQ(r.Read(&b, 1, &got, 1s, -1), kEof);
  progress = 0;
  EXPECT_EQ(w.Write(&v, 1, &progress, 1s, -1), EPIPE);
  EXPECT_EQ(progress, 0u);
}

TEST(ShmRing, FullRingWithoutWaitingIsEagainThenResumes) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  std::vector<uint8_t> data(kCap + kCap / 2);
  for (size_t i = 0; i < data.size(); ++i) data[i] = PatternByte(i);
  iovec v{data.data(), data.size()};
  size_t progress = 0;
  EXPECT_EQ(w.Write(&v, 1, &progress, 0ms, -1), EAGAIN);
  EXPECT_EQ(progress, kCap);
  EXPECT_EQ(r.Readable(), kCap);
  std::vector<uint8_t> back(data.size());
  size_t got = 0;
  ASSERT_EQ(r.Read(back.data(), kCap, &got, 1s, -1), 0);
  ASSERT_EQ(w.Write(&v, 1, &progress, 0ms, -1), 0);
  EXPECT_EQ(progress, data.size());
  ASSERT_EQ(r.Read(back.data() + kCap, kCap / 2, &got, 1s, -1), 0);
  EXPECT_EQ(back, data);
}

// ReadSome never waits: EAGAIN with what was there, the rest once written,
// then end of stream after the writer's close. WaitReadable returns once
// bytes are there (whenever the writer's thread gets to write them), and
// EPIPE when the liveness socket is shut down on an empty ring.
TEST(ShmRing, ReadSomeNeverWaitsAndWaitReadableWakesForBytes) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  std::vector<uint8_t> data(3000), back(3000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = PatternByte(i);
  size_t got = 0;
  EXPECT_EQ(r.ReadSome(back.data(), back.size(), &got), EAGAIN);
  EXPECT_EQ(got, 0u);
  iovec first{data.data(), 1000};
  size_t progress = 0;
  ASSERT_EQ(w.Write(&first, 1, &progress, 0ms, -1), 0);
  EXPECT_EQ(r.ReadSome(back.data(), back.size(), &got), EAGAIN);
  EXPECT_EQ(got, 1000u);
  std::thread writer([&] {
    iovec rest{data.data() + 1000, 2000};
    size_t p = 0;
    EXPECT_EQ(w.Write(&rest, 1, &p, 1s, -1), 0);
    w.Close();
  });
  ASSERT_EQ(r.WaitReadable(10s, -1), 0);
  size_t at = 1000;
  while (at < back.size()) {
    ASSERT_EQ(r.WaitReadable(10s, -1), 0);
    const int err = r.ReadSome(back.data() + at, back.size() - at, &got);
    ASSERT_TRUE(err == 0 || err == EAGAIN) << err;
    at += got;
  }
  writer.join();
  EXPECT_EQ(back, data);
  ASSERT_EQ(r.WaitReadable(10s, -1), 0);  // closed: a read would not wait
  uint8_t b = 0;
  EXPECT_EQ(r.ReadSome(&b, 1, &got), kEof);

  Ring w2 = MustCreate();
  Ring r2 = MustAttach(w2);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ::shutdown(sv[0], SHUT_RDWR);
  EXPECT_EQ(r2.WaitReadable(0ms, sv[0]), EPIPE);  // no timeout: the socket ends it
  ::close(sv[0]);
  ::close(sv[1]);
}

// The control block's layout (shm_ring.cpp): head at 64, tail at 128.
void Poke(int fd, size_t offset, uint64_t value) {
  void* m = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  std::memcpy(static_cast<uint8_t*>(m) + offset, &value, sizeof(value));
  munmap(m, 4096);
}

TEST(ShmRing, CorruptIndicesFromThePeerAreEprotoNotAnOutOfBoundsAccess) {
  {
    Ring w = MustCreate();
    Ring r = MustAttach(w);
    Poke(w.fd(), 64, kCap + 1);  // "head": more bytes than the ring holds
    uint8_t b[16];
    size_t got = 0;
    EXPECT_EQ(r.Read(b, sizeof(b), &got, 1s, -1), EPROTO);
    EXPECT_EQ(r.Readable(), 0u);
    Poke(w.fd(), 64, ~0ull);  // and a head far beyond the tail
    EXPECT_EQ(r.Read(b, sizeof(b), &got, 1s, -1), EPROTO);
  }
  {
    Ring w = MustCreate();
    Ring r = MustAttach(w);
    Poke(w.fd(), 128, 5);  // "tail": ahead of anything written
    uint8_t b[16] = {};
    iovec v{b, sizeof(b)};
    size_t progress = 0;
    EXPECT_EQ(w.Write(&v, 1, &progress, 1s, -1), EPROTO);
    EXPECT_EQ(progress, 0u);
  }
}

// A segment with good bells (the peer's ends of two socket pairs; ours are
// closed, which only matters once the ring is used): only the memfd is under test.
Handover WithBells(int memfd) {
  int a[2], b[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, a), 0);
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, b), 0);
  ::close(a[0]);
  ::close(b[0]);
  return {memfd, a[1], b[1]};
}

TEST(ShmRing, AttachRefusesWhatAHostilePeerCouldHandOver) {
  std::string why;
  // Not sealed: the peer could shrink it under our mapping (SIGBUS).
  int fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(fd, 4096 + kCap), 0);
  EXPECT_FALSE(Ring::Attach(WithBells(fd), &why).ok());
  EXPECT_NE(why.find("sealed"), std::string::npos) << why;
  // Sealed, but not a control block plus a power-of-two ring.
  fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(fd, 4096 + kCap + 1), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_FALSE(Ring::Attach(WithBells(fd), &why).ok());
  EXPECT_NE(why.find("size"), std::string::npos) << why;
  // Right shape, no control block in it.
  fd = memfd_create("t", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(fd, 4096 + kCap), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  EXPECT_FALSE(Ring::Attach(WithBells(fd), &why).ok());
  EXPECT_NE(why.find("magic"), std::string::npos) << why;
  // Not memory at all.
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  EXPECT_FALSE(Ring::Attach(WithBells(p[0]), &why).ok());
  EXPECT_NE(why.find("sealable"), std::string::npos) << why;
  // A good segment whose bells are not what they claim: a pipe (a write to it
  // could block), and an eventfd (both ends would share its flags).
  Ring good = MustCreate();
  Handover h = good.Duplicate();
  ::close(h.data_bell);
  h.data_bell = p[1];
  EXPECT_FALSE(Ring::Attach(h, &why).ok());
  EXPECT_NE(why.find("bells"), std::string::npos) << why;
  h = good.Duplicate();
  ::close(h.space_bell);
  h.space_bell = eventfd(0, EFD_CLOEXEC);
  EXPECT_FALSE(Ring::Attach(h, &why).ok());
  EXPECT_NE(why.find("bells"), std::string::npos) << why;
  // And bad capacities at creation.
  EXPECT_FALSE(Ring::Create(kCap + 1, &why).ok());
  EXPECT_FALSE(Ring::Create(kMaxCapacity * 2, &why).ok());
}

TEST(ShmRing, AReaderNoticesAPeerThatDiedWithoutClosing) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The producer writes 100 bytes, then dies without Close().
    ::close(sv[0]);
    uint8_t data[100] = {};
    iovec v{data, sizeof(data)};
    size_t progress = 0;
    if (w.Write(&v, 1, &progress, 1s, -1) != 0) _exit(1);
    raise(SIGKILL);
  }
  ::close(sv[1]);
  uint8_t back[200];
  size_t got = 0;
  // No timeout: without the liveness check this read would never return.
  EXPECT_EQ(r.Read(back, sizeof(back), &got, 0ms, sv[0]), EPIPE);
  EXPECT_EQ(got, 100u);
  int st = 0;
  ASSERT_EQ(waitpid(child, &st, 0), child);
  EXPECT_TRUE(WIFSIGNALED(st));
  ::close(sv[0]);
}

TEST(ShmRing, AbortDropsWhatTheReaderHasNotReadYet) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  uint8_t data[100] = {}, back[100];
  iovec v{data, sizeof(data)};
  size_t progress = 0, got = 0;
  ASSERT_EQ(w.Write(&v, 1, &progress, 1s, -1), 0);
  w.Abort();
  EXPECT_EQ(r.Read(back, 10, &got, 1s, -1), ECONNRESET);
  EXPECT_EQ(got, 0u);
  progress = 0;
  EXPECT_EQ(w.Write(&v, 1, &progress, 1s, -1), EPIPE);
}

// A fence or a revocation cuts a lane by shutting its socket down: a reader
// asleep on the ring must end at once, not when its timeout passes.
TEST(ShmRing, ShuttingTheLivenessSocketDownEndsAWaitAtOnce) {
  Ring w = MustCreate();
  Ring r = MustAttach(w);
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  int err = 0;
  size_t got = 0;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    uint8_t b[8];
    err = r.Read(b, sizeof(b), &got, 0ms, sv[0]);  // no timeout at all
    done = true;
  });
  // The reader is asleep once it announced it (the flag lives in the segment).
  for (int i = 0; i < 5000 && !done; ++i) {
    uint32_t sleeping = 0;
    void* m = mmap(nullptr, 4096, PROT_READ, MAP_SHARED, w.fd(), 0);
    ASSERT_NE(m, MAP_FAILED);
    std::memcpy(&sleeping, static_cast<uint8_t*>(m) + 72, sizeof sleeping);
    munmap(m, 4096);
    if (sleeping != 0) break;
    std::this_thread::sleep_for(1ms);
  }
  const auto cut = std::chrono::steady_clock::now();
  ::shutdown(sv[0], SHUT_RDWR);
  reader.join();
  EXPECT_EQ(err, EPIPE);
  EXPECT_LT(std::chrono::steady_clock::now() - cut, 1s);
  ::close(sv[0]);
  ::close(sv[1]);
}

}  // namespace
}  // namespace ferry_tcp::shm
