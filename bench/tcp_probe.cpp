// SPDX-License-Identifier: Apache-2.0
// tcp_probe: raw loopback TCP between two processes, sending from and receiving
// into regions of a given size - iperf3's single stream, but with ferry-bench's
// memory footprint (iperf3 reuses one buffer of at most 1 MiB, which stays in
// cache; a 64 MiB block does not). The same-footprint ceiling for the tcp backend.
//   usage: tcp_probe [--block BYTES (1MiB)] [--region BYTES (=block)] [--streams N (1)]
//                    [--seconds S (3)] [--csv]
// Each stream sends `block`-byte writes at rolling offsets of its own region; the
// receiver reads them into rolling offsets of its own. Reports received GB/s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

size_t parse_size(const char* s) {
  char* end = nullptr;
  unsigned long long v = std::strtoull(s, &end, 10);
  std::string u = end ? end : "";
  if (u == "K" || u == "KiB") v <<= 10;
  else if (u == "M" || u == "MiB") v <<= 20;
  else if (u == "G" || u == "GiB") v <<= 30;
  else if (!u.empty() && u != "B") return 0;
  return static_cast<size_t>(v);
}

char* region(size_t n) {
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("tcp_probe: mmap");
    std::exit(1);
  }
  std::memset(p, 1, n);
  return static_cast<char*>(p);
}

}  // namespace

int main(int argc, char** argv) {
  size_t block = 1u << 20, reg = 0;
  int streams = 1;
  double seconds = 3;
  bool csv = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) std::exit(2);
      return argv[++i];
    };
    if (a == "--block") block = parse_size(next());
    else if (a == "--region") reg = parse_size(next());
    else if (a == "--streams") streams = std::atoi(next());
    else if (a == "--seconds") seconds = std::atof(next());
    else if (a == "--csv") csv = true;
    else {
      std::fprintf(stderr, "usage: tcp_probe [--block N] [--region N] [--streams N] [--seconds S] [--csv]\n");
      return 2;
    }
  }
  if (reg < block) reg = block;
  if (block == 0 || streams < 1) return 2;
  reg -= reg % block;

  int ls = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof addr;
  if (bind(ls, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(ls, 64) != 0 ||
      getsockname(ls, reinterpret_cast<sockaddr*>(&addr), &al) != 0) {
    std::perror("tcp_probe: listen");
    return 1;
  }
  int result_pipe[2];
  if (pipe(result_pipe) != 0) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    // Receiver process: one thread per stream, counting bytes until EOF.
    close(result_pipe[0]);
    std::vector<std::thread> th;
    std::atomic<unsigned long long> total{0};
    std::atomic<double> first{0}, last{0};
    for (int s = 0; s < streams; ++s) {
      int fd = accept(ls, nullptr, nullptr);
      th.emplace_back([&, fd] {
        char* r = region(reg);
        size_t off = 0;
        unsigned long long got = 0;
        auto t0 = std::chrono::steady_clock::now();
        for (;;) {
          ssize_t k = recv(fd, r + off, block - (off % block), 0);
          if (k <= 0) break;
          got += static_cast<size_t>(k);
          off = (off + static_cast<size_t>(k)) % reg;
        }
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        total += got;
        double prev = last.load();
        while (dt > prev && !last.compare_exchange_weak(prev, dt)) {
        }
        close(fd);
      });
    }
    for (auto& t : th) t.join();
    double gbs = static_cast<double>(total.load()) / last.load() / 1e9;
    dprintf(result_pipe[1], "%.3f\n", gbs);
    _exit(0);
  }
  close(result_pipe[1]);
  close(ls);
  std::vector<std::thread> th;
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (int s = 0; s < streams; ++s) {
    th.emplace_back([&] {
      int fd = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
        std::perror("tcp_probe: connect");
        std::exit(1);
      }
      char* r = region(reg);
      size_t off = 0;
      while (std::chrono::steady_clock::now() < end) {
        size_t left = block;
        while (left > 0) {
          ssize_t k = send(fd, r + off + (block - left), left, 0);
          if (k <= 0) std::exit(1);
          left -= static_cast<size_t>(k);
        }
        off = (off + block) % reg;
      }
      close(fd);
    });
  }
  for (auto& t : th) t.join();
  char buf[64] = {0};
  ssize_t n = read(result_pipe[0], buf, sizeof buf - 1);
  int st = 0;
  waitpid(pid, &st, 0);
  if (n <= 0) return 1;
  double gbs = std::atof(buf);
  if (csv) std::printf("block,region,streams,gbs\n%zu,%zu,%d,%.3f\n", block, reg, streams, gbs);
  else std::printf("raw tcp loopback: %d stream(s), %zu-byte writes over a %zu-byte region: %.3f GB/s\n",
                   streams, block, reg, gbs);
  return 0;
}
