// SPDX-License-Identifier: Apache-2.0
#include "stats_command.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <thread>

namespace ferry::cli {
namespace {

constexpr int kReadTimeoutMs = 5000;

// One document from the endpoint; false with *err when it cannot be had.
bool fetch(const std::string& path, std::string* doc, std::string* err) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(a.sun_path)) {
    *err = "bad socket path '" + path + "'";
    return false;
  }
  std::memcpy(a.sun_path, path.data(), path.size());
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    *err = "cannot connect to " + path + ": " + std::strerror(errno) +
           " (is the engine running with this stats socket?)";
    if (fd >= 0) ::close(fd);
    return false;
  }
  doc->clear();
  char buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, kReadTimeoutMs) <= 0) {
      *err = "no answer from " + path + " within " + std::to_string(kReadTimeoutMs) + " ms";
      ::close(fd);
      return false;
    }
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    doc->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return true;
}

unsigned long long num(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_unsigned() ? it->get<unsigned long long>() : 0;
}

bool print_table(const std::string& doc) {
  const auto j = nlohmann::json::parse(doc, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return false;
  std::printf(
      "engine %s (pid %lld): inbound notifications %llu (dropped unpopped %llu), control "
      "connections refused %llu, fences %llu (unanswered %llu), fenced peers %llu\n"
      "  notification messages received %llu (refused %llu, unread %llu)\n",
      j.value("engine", std::string("?")).c_str(), static_cast<long long>(j.value("pid", 0L)),
      num(j, "inbound_notifications"), num(j, "inbound_dropped"), num(j, "ctrl_rejected"),
      num(j, "fences"), num(j, "fence_unknown"), num(j, "fenced_peers"),
      num(j, "notifications_received"), num(j, "notifications_refused"),
      num(j, "notifications_unread"));
  std::printf("  %-10s %12s %16s %10s %10s %12s\n", "backend", "transfers", "bytes", "failures",
              "failovers", "quarantines");
  if (auto b = j.find("backends"); b != j.end() && b->is_object()) {
    for (const auto& [name, c] : b->items()) {
      std::printf("  %-10s %12llu %16llu %10llu %10llu %12llu\n", name.c_str(), num(c, "transfers"),
                  num(c, "bytes"), num(c, "failures"), num(c, "failovers"), num(c, "quarantines"));
      // The live instance's own counters (plugin ABI 1.5), when it has any.
      if (auto p = c.find("plugin"); p != c.end() && p->is_object() && !p->empty()) {
        std::string line;
        for (const auto& [k, v] : p->items())
          if (v.is_number_unsigned()) line += " " + k + "=" + std::to_string(v.get<uint64_t>());
        std::printf("  %-10s%s\n", "", line.c_str());
      }
    }
  }
  return true;
}

}  // namespace

CLI::App* add_stats_command(CLI::App& app, StatsArgs& args) {
  CLI::App* sub = app.add_subcommand("stats", "a running engine's stats (its stats socket)");
  sub->footer(
      "PATH: the engine's stats socket (EngineConfig::stats_socket or FERRY_STATS_SOCKET,\n"
      "e.g. ferry-bench --stats-socket PATH). A watch ends when the engine does (exit 0).");
  sub->add_option("PATH", args.path, "the engine's stats socket")->type_name("")->required();
  sub->add_flag("--json", args.json, "the stats document itself, not the table");
  sub->add_option_function<double>(
         "--watch",
         [&args](double v) {
           if (!(v > 0)) throw CLI::ValidationError("--watch", "wants SECONDS above 0");
           args.watch = v;
         },
         "a sample every SECONDS (fractions work), until the engine exits")
      ->type_name("SECONDS");
  sub->add_option_function<std::string>(
         "--count",
         [&args](const std::string& v) {
           // Decimal, as before CLI11 (whose own integers take 010 as octal).
           try {
             size_t used = 0;
             args.count = std::stol(v, &used);
             if (used != v.size()) throw std::invalid_argument(v);
           } catch (const std::exception&) {
             throw CLI::ValidationError("--count", "bad number '" + v + "'");
           }
           if (args.count < 1) throw CLI::ValidationError("--count", "wants N of at least 1");
         },
         "with --watch: stop after N samples")
      ->type_name("N");
  return sub;
}

int cmd_stats(const StatsArgs& args) {
  const std::string& path = args.path;
  const bool json = args.json;
  const double watch = args.watch;
  const long count = args.count;
  for (long shown = 0;;) {
    std::string doc, err;
    if (!fetch(path, &doc, &err)) {
      // Watching an engine that has finished is the normal end of a watch.
      if (shown > 0) return 0;
      std::fprintf(stderr, "ferry stats: %s\n", err.c_str());
      return 1;
    }
    if (json) {
      std::fputs(doc.c_str(), stdout);
    } else if (!print_table(doc)) {
      std::fprintf(stderr, "ferry stats: %s did not answer with stats JSON\n", path.c_str());
      return 1;
    }
    std::fflush(stdout);
    ++shown;
    if (watch <= 0 || (count > 0 && shown >= count)) return 0;
    // Pacing the samples, not ordering anything.
    std::this_thread::sleep_for(std::chrono::duration<double>(watch));
  }
}

}  // namespace ferry::cli
