// SPDX-License-Identifier: Apache-2.0
// Line-oriented request/response over two file descriptors (pipes or a socket).
#pragma once
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace ferry::bench {

class LineChannel {
 public:
  LineChannel(int in_fd, int out_fd) : in_(in_fd), out_(out_fd) {}

  bool send(const std::string& line) {
    std::string l = line + "\n";
    const char* p = l.data();
    size_t n = l.size();
    while (n > 0) {
      ssize_t k = ::write(out_, p, n);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return false;
      p += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }

  // Next line; false on EOF, error or timeout (timeout_ms < 0 waits forever;
  // 0 takes only what has already arrived, for a caller that polls in_fd()).
  bool recv(std::string& line, int timeout_ms = -1) {
    for (;;) {
      auto nl = buf_.find('\n');
      if (nl != std::string::npos) {
        line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return true;
      }
      pollfd pfd{in_, POLLIN, 0};
      int r = ::poll(&pfd, 1, timeout_ms);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) return false;
      char tmp[65536];
      ssize_t k = ::read(in_, tmp, sizeof tmp);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) {
        closed_ = true;
        return false;
      }
      buf_.append(tmp, static_cast<size_t>(k));
    }
  }

  int in_fd() const { return in_; }
  // The other side is gone (EOF or a read error): no more lines will come.
  bool closed() const { return closed_; }

  std::string ask(const std::string& line, int timeout_ms = 120000) {
    std::string ans;
    if (!send(line) || !recv(ans, timeout_ms)) return "ERR channel closed";
    return ans;
  }

 private:
  int in_, out_;
  bool closed_ = false;
  std::string buf_;
};

}  // namespace ferry::bench
