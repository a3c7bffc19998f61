// SPDX-License-Identifier: Apache-2.0
// tcp_pingpong: raw loopback TCP round trips shaped like one ferry transfer at a
// time - the reference for the tcp backend's small-transfer latency (issue 20,
// bench/compare). Two processes, TCP_NODELAY, blocking sockets (each side's
// thread wakes up once per message, as ferry's lane threads do).
//   write: the client sends SIZE bytes, the server reads them all and answers
//          with an 8-byte acknowledgement (a ferry WRITE: data, then its ack)
//   read:  the client sends an 8-byte request, the server answers SIZE bytes
//          (a ferry READ)
//   usage: tcp_pingpong [--op write|read] [--size BYTES (8)] [--iters N (20000)]
//                       [--warmup N (1000)] [--unix]
// --unix: the same over a unix stream socket pair (what a same-host control
// connection could use instead of loopback TCP: on the gVisor GPU host the
// loopback TCP stack is the sandbox's own, and costlier).
// Prints one line: op, size, iterations, p50 / avg / p99 / min round trip in us.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool SendAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

bool RecvAll(int fd, char* p, size_t n) {
  while (n > 0) {
    const ssize_t k = recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void NoDelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// The server: answers round trips on fd until the client closes.
[[noreturn]] void Serve(int fd, bool write_op, size_t size) {
  if (fd < 0) _exit(1);
  std::vector<char> buf(std::max<size_t>(size, 8), 1);
  for (;;) {
    if (write_op) {
      if (!RecvAll(fd, buf.data(), size) || !SendAll(fd, buf.data(), 8)) break;
    } else {
      if (!RecvAll(fd, buf.data(), 8) || !SendAll(fd, buf.data(), size)) break;
    }
  }
  _exit(0);
}

}  // namespace

int main(int argc, char** argv) {
  std::string op = "write";
  size_t size = 8;
  long iters = 20000, warmup = 1000;
  bool unix_pair = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--unix") {
      unix_pair = true;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "tcp_pingpong: %s needs a value\n", a.c_str());
      return 2;
    }
    const char* v = argv[++i];
    if (a == "--op")
      op = v;
    else if (a == "--size")
      size = std::strtoull(v, nullptr, 10);
    else if (a == "--iters")
      iters = std::atol(v);
    else if (a == "--warmup")
      warmup = std::atol(v);
    else {
      std::fprintf(stderr,
                   "usage: tcp_pingpong [--op write|read] [--size BYTES] [--iters N] [--warmup N] "
                   "[--unix]\n");
      return 2;
    }
  }
  if ((op != "write" && op != "read") || size == 0 || iters <= 0 || warmup < 0) return 2;
  const bool write_op = op == "write";

  int fd = -1;
  pid_t pid = -1;
  if (unix_pair) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      std::perror("tcp_pingpong: socketpair");
      return 1;
    }
    pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      close(sv[0]);
      Serve(sv[1], write_op, size);
    }
    close(sv[1]);
    fd = sv[0];
  } else {
    const int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof addr;
    if (bind(ls, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, reinterpret_cast<sockaddr*>(&addr), &al) != 0) {
      std::perror("tcp_pingpong: listen");
      return 1;
    }
    pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      const int conn = accept(ls, nullptr, nullptr);
      if (conn >= 0) NoDelay(conn);
      Serve(conn, write_op, size);
    }
    close(ls);
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      std::perror("tcp_pingpong: connect");
      return 1;
    }
    NoDelay(fd);
  }
  std::vector<char> buf(std::max<size_t>(size, 8), 2);
  std::vector<double> us;
  us.reserve(static_cast<size_t>(iters));
  for (long i = 0; i < warmup + iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = write_op ? SendAll(fd, buf.data(), size) && RecvAll(fd, buf.data(), 8)
                             : SendAll(fd, buf.data(), 8) && RecvAll(fd, buf.data(), size);
    if (!ok) {
      std::fprintf(stderr, "tcp_pingpong: connection lost\n");
      return 1;
    }
    if (i >= warmup)
      us.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  close(fd);
  int st = 0;
  waitpid(pid, &st, 0);
  std::sort(us.begin(), us.end());
  double sum = 0;
  for (double v : us) sum += v;
  auto pct = [&](double p) {
    return us[std::min(us.size() - 1, static_cast<size_t>(p * us.size()))];
  };
  std::printf(
      "tcp_pingpong op=%s size=%zu iters=%ld socket=%s p50_us=%.2f avg_us=%.2f p99_us=%.2f "
      "min_us=%.2f\n",
      op.c_str(), size, iters, unix_pair ? "unix" : "tcp", pct(0.5),
      sum / static_cast<double>(us.size()), pct(0.99), us.front());
  return 0;
}
