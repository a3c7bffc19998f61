// SPDX-License-Identifier: Apache-2.0
// Blocking socket helpers: whole-buffer send/recv loops that survive EINTR and
// short transfers, connect with a timeout that another thread can abort, and
// listening sockets.
//
// Errors are returned as an int: 0 = done, kEof = orderly close by the peer,
// otherwise an errno value. IoErrorString() turns either into words.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry_tcp {

inline constexpr int kEof = -1;

std::string IoErrorString(int err);

// Sends iov[0..n) starting `*progress` bytes in, advancing *progress as bytes
// leave. With MSG_DONTWAIT in extra_flags it may return EAGAIN part-way.
int SendIov(int fd, const iovec* iov, size_t n, size_t* progress, int extra_flags = 0);
int SendAll(int fd, const void* buf, size_t len);

// Receives exactly the bytes described by iov. With idle_ok, a receive timeout
// (SO_RCVTIMEO) before the first byte is not an error: an idle connection is
// fine, a stalled frame is not.
int RecvIov(int fd, const iovec* iov, size_t n, bool idle_ok = false);
int RecvAll(int fd, void* buf, size_t len, bool idle_ok = false);
// RecvAll with one deadline for the whole read, however the bytes trickle in
// (a handshake sent a byte at a time must still end by its deadline); gives up
// with ECANCELED once abort_fd (an eventfd) fires. RecvWithFds taking none.
int RecvAllBy(int fd, void* buf, size_t len, std::chrono::steady_clock::time_point deadline,
              int abort_fd = -1);
// Reads and discards len bytes, keeping the stream in step after a refused frame.
int Discard(int fd, uint64_t len);

// The receiving side of a lane's byte stream (channel.h: a socket or a ring).
// Same error convention and idle_ok meaning as RecvIov: with idle_ok, a stall
// before the first byte is not an error (an idle lane is fine, a stalled frame
// is not).
class ByteReader {
 public:
  virtual ~ByteReader() = default;
  virtual int ReadIov(const iovec* iov, size_t n, bool idle_ok = false) = 0;
  int Read(void* buf, size_t len, bool idle_ok = false) {
    iovec iov{buf, len};
    return ReadIov(&iov, 1, idle_ok);
  }
  // Reads and discards len bytes, keeping the stream in step after a refused frame.
  virtual int Discard(uint64_t len) = 0;
  // What has arrived, for a reader driven by readiness (io_pool.h): moves it
  // into v[*first..], advancing both; 0 once v is complete, EAGAIN when nothing
  // more has arrived, else kEof or an errno value; *moved counts the bytes
  // taken. A reader that can only block (a ring) reads all of v here.
  virtual int ReadSome(std::vector<iovec>& v, size_t* first, size_t* moved);
  // Drops up to *left bytes that have arrived, counting *left down; 0 at 0.
  virtual int DiscardSome(uint64_t* left, size_t* moved);
  // Bytes read ahead and not consumed yet: they will raise no epoll event.
  virtual bool buffered() const { return false; }
};

// The receiving side of a socket, with a small read-ahead buffer: one
// recv() takes a whole small frame (header, items and payload, or a response
// and the next one) instead of one call per piece. Large payloads still go
// straight from the socket into their destination (only a tail shorter than the
// buffer passes through it), so there is no staging copy of bulk data.
class SocketReader final : public ByteReader {
 public:
  explicit SocketReader(int fd, size_t buffer_bytes = 16 * 1024);
  int ReadIov(const iovec* iov, size_t n, bool idle_ok = false) override;
  int Discard(uint64_t len) override;

  // Never waits (MSG_DONTWAIT), whatever the descriptor's O_NONBLOCK: a lane's
  // sender may block on the same socket while the pool reads it.
  int ReadSome(std::vector<iovec>& v, size_t* first, size_t* moved) override;
  int DiscardSome(uint64_t* left, size_t* moved) override;
  bool buffered() const override { return pos_ < end_; }

 private:
  // Copies buffered bytes into v from *first on; true when v is complete.
  bool Drain(std::vector<iovec>& v, size_t* first);
  const int fd_;
  std::vector<uint8_t> buf_;
  size_t pos_ = 0, end_ = 0;  // buffered bytes are buf_[pos_, end_)
};

// Resolves host, connects within timeout_ms; gives up early when abort_fd (an
// eventfd) becomes readable. Returns 0 and *out_fd (blocking, CLOEXEC) or an error
// with *err saying what failed.
int ConnectTcp(const std::string& host, uint16_t port, int timeout_ms, int abort_fd, int* out_fd,
               std::string* err);
int ListenTcp(const std::string& host, uint16_t port, int* out_fd, uint16_t* bound_port,
              std::string* err);

// Same-host lanes (channel.h): a unix stream socket in the abstract namespace
// (no file to clean up; reachable only from this network namespace). ListenUnix
// binds a fresh random name ("ferry-tcp-" and 16 hex digits) and says it.
int ListenUnix(int* out_fd, std::string* name, std::string* err);
// Connects within timeout_ms. ECONNREFUSED: nobody listens under that name
// here (the target is in another network namespace, or gone).
int ConnectUnix(const std::string& name, int timeout_ms, int* out_fd, std::string* err);
// One message of len bytes with descriptors attached (SCM_RIGHTS).
int SendWithFds(int fd, const void* buf, size_t len, const int* fds, size_t n_fds);
// Exactly len bytes by `deadline` (or ECANCELED once abort_fd fires), and the
// descriptors that came with them: at most max_fds, the rest closed and
// *truncated set. Received descriptors are CLOEXEC and owned by the caller.
int RecvWithFds(int fd, void* buf, size_t len, int* fds, size_t max_fds, size_t* n_fds,
                bool* truncated, std::chrono::steady_clock::time_point deadline, int abort_fd = -1);

void SetNoDelay(int fd);
// O_NONBLOCK on or off; false with errno on failure.
bool SetNonBlocking(int fd, bool on);
// SO_RCVTIMEO and SO_SNDTIMEO; 0 = block forever.
void SetIoTimeout(int fd, int timeout_ms);
// Probes an idle connection after idle_s seconds (then every idle_s / 5, three
// times): a peer whose RST was lost (link down, host gone) is noticed and the
// lane's thread and descriptor freed, instead of an idle read waiting forever.
// 0: off.
void SetKeepAlive(int fd, int idle_s);
std::string PeerAddress(int fd);

// An eventfd that wakes a poll() in another thread.
class Waker {
 public:
  Waker();
  ~Waker();
  Waker(const Waker&) = delete;
  Waker& operator=(const Waker&) = delete;
  bool ok() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  void Signal();
  void Clear();

 private:
  int fd_ = -1;
};

}  // namespace ferry_tcp
