// SPDX-License-Identifier: Apache-2.0
#include "plugin_probe_child.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

namespace ferry {
namespace {

using Json = nlohmann::json;

// One line per report: the whole PluginInfo, so the last line is all there is.
std::string to_line(const PluginInfo& p, bool final) {
  Json j = {{"final", final},           {"name", p.name},
            {"path", p.path},           {"loaded", p.loaded},
            {"error", p.error},         {"version", p.version},
            {"abi_major", p.abi_major}, {"abi_minor", p.abi_minor},
            {"caps", p.caps},           {"description", p.description},
            {"warning", p.warning}};
  return j.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

bool from_line(const std::string& line, PluginInfo* p, bool* final) {
  const Json j = Json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return false;
  try {
    *final = j.at("final").get<bool>();
    p->name = j.at("name").get<std::string>();
    p->path = j.at("path").get<std::string>();
    p->loaded = j.at("loaded").get<bool>();
    p->error = j.at("error").get<std::string>();
    p->version = j.at("version").get<std::string>();
    p->abi_major = j.at("abi_major").get<uint32_t>();
    p->abi_minor = j.at("abi_minor").get<uint32_t>();
    p->caps = j.at("caps").get<uint64_t>();
    p->description = j.at("description").get<std::string>();
    p->warning = j.at("warning").get<std::string>();
  } catch (...) {
    return false;
  }
  return true;
}

void write_all(int fd, const std::string& s) {
  size_t off = 0;
  while (off < s.size()) {
    const ssize_t n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// The child's lines until it closes its end, or false when `limit` passed first.
bool read_until_closed(int fd, std::chrono::milliseconds limit, std::string* got) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return false;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return true;
    if (got->size() < (1u << 20)) got->append(buf, static_cast<size_t>(n));
  }
}

}  // namespace

PluginInfo probe_in_child(const PluginInfo& info, Probe probe, std::chrono::milliseconds limit) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return probe(info, [](const PluginInfo&) {});
  // A plugin that calls exit() in the child would flush copies of our buffers.
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    return probe(info, [](const PluginInfo&) {});
  }
  if (pid == 0) {
    ::close(fds[0]);
    const int out = fds[1];
    const PluginInfo last =
        probe(info, [out](const PluginInfo& p) { write_all(out, to_line(p, false)); });
    write_all(out, to_line(last, true));
    ::_exit(0);  // no atexit handlers or static destructors of the plugin's
  }
  ::close(fds[1]);
  std::string got;
  const bool ended = read_until_closed(fds[0], limit, &got);
  ::close(fds[0]);
  if (!ended) ::kill(pid, SIGKILL);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  // The last whole line the child wrote.
  PluginInfo result = info;
  bool final = false;
  const size_t end = got.rfind('\n');
  if (end != std::string::npos) {
    const size_t begin = end == 0 ? std::string::npos : got.rfind('\n', end - 1);
    const size_t from = begin == std::string::npos ? 0 : begin + 1;
    if (!from_line(got.substr(from, end - from), &result, &final)) {
      result = info;
      final = false;
    }
  }
  const std::string where = "while started once with empty settings (init, describe or fini)";
  if (!ended) {
    result.loaded = false;
    result.error = "did not finish " + where + " within " + std::to_string(limit.count()) +
                   " ms; its probe process was stopped";
  } else if (WIFSIGNALED(st)) {
    const int sig = WTERMSIG(st);
    const char* name = ::sigdescr_np(sig);
    result.loaded = false;
    result.error = "crashed " + where + ": signal " + std::to_string(sig) + " (" +
                   (name ? name : "unknown") + ")";
  } else if (!final) {
    result.loaded = false;
    result.error = "ended its probe process (exit status " +
                   std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : -1) + ") " + where;
  }
  return result;
}

}  // namespace ferry
