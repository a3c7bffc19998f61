// SPDX-License-Identifier: Apache-2.0
#include "stats_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "thread_name.h"

namespace ferry {
namespace {

// A client that connects and never reads must not hold the endpoint.
constexpr int kSendTimeoutMs = 1000;

std::string errno_text(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

sockaddr_un address_of(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(a.sun_path))
    throw Error(StatusCode::ERR_INVALID_ARGS, "stats socket path must be 1.." +
                                                  std::to_string(sizeof(a.sun_path) - 1) +
                                                  " bytes: '" + path + "'");
  std::memcpy(a.sun_path, path.data(), path.size());
  return a;
}

// True when something answers on the socket at `path` (a live engine).
bool answered(const sockaddr_un& a) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const bool live = ::connect(fd, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return live;
}

}  // namespace

std::string stats_to_json(const std::string& engine_key, const EngineStats& s) {
  nlohmann::json j;
  j["engine"] = engine_key;
  j["pid"] = static_cast<long>(::getpid());
  j["inbound_notifications"] = s.inbound_notifications;
  j["inbound_dropped"] = s.inbound_dropped;
  j["notifications_received"] = s.notifications_received;
  j["notifications_refused"] = s.notifications_refused;
  j["notifications_unread"] = s.notifications_unread;
  j["ctrl_rejected"] = s.ctrl_rejected;
  j["ctrl_unix_connections"] = s.ctrl_unix_connections;
  j["notifies_resent"] = s.notifies_resent;
  j["notifies_unanswered"] = s.notifies_unanswered;
  j["fences"] = s.fences;
  j["fence_unknown"] = s.fence_unknown;
  j["fenced_peers"] = s.fenced_peers;
  nlohmann::json b = nlohmann::json::object();
  for (const auto& [name, c] : s.backends) {
    b[name] = {{"bytes", c.bytes},
               {"transfers", c.transfers},
               {"failures", c.failures},
               {"failovers", c.failovers},
               {"quarantines", c.quarantines},
               {"stray_completions", c.stray_completions}};
    if (!c.detail.empty()) b[name]["detail"] = c.detail;
    if (!c.plugin.empty()) b[name]["plugin"] = c.plugin;
  }
  j["backends"] = std::move(b);
  // Engine keys are bytes; never let a non-UTF-8 one throw here.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string expand_stats_path(const std::string& pattern, const std::string& engine_key) {
  std::string out;
  for (size_t i = 0; i < pattern.size();) {
    if (pattern.compare(i, 5, "{key}") == 0) {
      for (char c : engine_key) out += (c == '/' || c == '\0') ? '_' : c;
      i += 5;
    } else if (pattern.compare(i, 5, "{pid}") == 0) {
      out += std::to_string(::getpid());
      i += 5;
    } else {
      out += pattern[i++];
    }
  }
  return out;
}

StatsServer::StatsServer(std::string path, std::function<std::string()> render)
    : path_(std::move(path)), render_(std::move(render)) {
  const sockaddr_un a = address_of(path_);
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "stats socket path '" + path_ + "' exists and is not a socket");
    if (answered(a))
      throw Error(StatusCode::ERR_BAD_STATE,
                  "stats socket '" + path_ + "' is in use by a running process");
    ::unlink(path_.c_str());  // stale: its owner died without removing it
  }
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0) throw Error(StatusCode::ERR_TRANSPORT, errno_text("stats socket", errno));
  // Owner only from the first moment: bind under a umask, not chmod after.
  const mode_t old = ::umask(0177);
  const int rc = ::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&a), sizeof(a));
  const int err = errno;
  ::umask(old);
  if (rc != 0 || ::listen(listen_fd_, 16) != 0) {
    const int e = rc != 0 ? err : errno;
    ::close(listen_fd_);
    if (rc == 0) ::unlink(path_.c_str());
    throw Error(StatusCode::ERR_TRANSPORT, errno_text("stats socket '" + path_ + "'", e));
  }
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    const int e = errno;
    ::close(listen_fd_);
    ::unlink(path_.c_str());
    throw Error(StatusCode::ERR_TRANSPORT, errno_text("eventfd", e));
  }
  thread_ = ferry::named_thread("ferry-stats", [this] { Serve(); });
}

StatsServer::~StatsServer() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
  ::close(listen_fd_);
  ::close(wake_fd_);
  ::unlink(path_.c_str());
}

void StatsServer::Serve() {
  for (;;) {
    pollfd p[2] = {{wake_fd_, POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[0].revents != 0) return;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      // Out of descriptors: wait 100 ms (or for the stop) instead of spinning
      // on a listener that stays readable.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
        ::poll(p, 1, 100);
      if (p[0].revents != 0) return;
      continue;
    }
    timeval tv{kSendTimeoutMs / 1000, (kSendTimeoutMs % 1000) * 1000};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    const std::string doc = render_();
    size_t off = 0;
    while (off < doc.size()) {
      const ssize_t n = ::send(fd, doc.data() + off, doc.size() - off, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      off += static_cast<size_t>(n);
    }
    ::close(fd);
  }
}

}  // namespace ferry
