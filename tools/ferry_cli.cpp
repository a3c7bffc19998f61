// ferry: the command-line tool.
//   ferry info [--json] [--plugin-dir DIR]...
//                                         plugins found, loaded or why not
//   ferry policy check FILE               validate a policy (errors name file:line:col)
//   ferry policy explain FILE [--peer P] [--host H] [--same-host|--remote-host]
//                [--local cpu|gpu] [--remote cpu|gpu] [--bytes N] [--op read|write]
//                                         the ranked backends and why each was kept or dropped
//   ferry stats PATH [--json] [--watch SECONDS [--count N]]
//                                         a running engine's stats (its stats socket)
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "plugin_loader.h"
#include "policy.h"
#include "router.h"
#include "stats_command.h"

using namespace ferry;

namespace {

int usage() {
  std::fprintf(
      stderr,
      "usage:\n"
      "  ferry info [--json] [--plugin-dir DIR]...\n"
      "  ferry policy check FILE\n"
      "  ferry policy explain FILE [--peer KEY] [--host HOST] [--same-host|--remote-host]\n"
      "                [--local cpu|gpu] [--remote cpu|gpu] [--bytes SIZE] [--op read|write]\n"
      "  ferry stats PATH [--json] [--watch SECONDS [--count N]]\n");
  return 2;
}

int cmd_info(int argc, char** argv) {
  std::vector<std::string> dirs;
  bool json = false;
  for (int i = 0; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--plugin-dir") && i + 1 < argc)
      dirs.push_back(argv[++i]);
    else if (!std::strcmp(argv[i], "--json"))
      json = true;
    else
      return usage();
  }
  if (json) {  // one object per plugin found, for scripts (scripts/ci_summary.py)
    nlohmann::json out = nlohmann::json::array();
    for (const auto& p : discover_plugins(dirs))
      out.push_back({{"name", p.name},
                     {"path", p.path},
                     {"loaded", p.loaded},
                     {"error", p.error},
                     {"version", p.version},
                     {"abi", std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor)},
                     {"caps", caps_to_string(p.caps)},
                     {"description", p.description}});
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("ferry %s, plugin ABI %d.%d\n", "0.1.0", FERRY_PLUGIN_ABI_MAJOR,
              FERRY_PLUGIN_ABI_MINOR);
  std::printf("search path:");
  for (const auto& d : plugin_search_dirs(dirs)) std::printf(" %s", d.c_str());
  auto infos = discover_plugins(dirs);
  std::printf("\n%s", infos.empty() ? "no plugin found (set FERRY_PLUGIN_PATH)\n" : "");
  for (const auto& p : infos) {
    if (p.loaded) {
      std::printf("  %-6s loaded   v%s abi %u.%u caps=%s\n         %s\n", p.name.c_str(),
                  p.version.c_str(), p.abi_major, p.abi_minor, caps_to_string(p.caps).c_str(),
                  p.path.c_str());
      if (!p.description.empty()) std::printf("         %s\n", p.description.c_str());
    } else {
      std::printf("  %-6s FAILED   %s\n         %s\n", p.name.c_str(), p.error.c_str(),
                  p.path.c_str());
    }
  }
  return 0;
}

std::optional<MemoryLocation> parse_loc(const std::string& s) {
  if (s == "cpu") return MemoryLocation::CPU;
  if (s == "gpu") return MemoryLocation::GPU;
  return std::nullopt;
}

int cmd_policy(int argc, char** argv) {
  if (argc < 2) return usage();
  std::string sub = argv[0], file = argv[1];
  Policy pol;
  try {
    pol = load_policy_file(file);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  if (sub == "check") {
    std::printf("%s: OK (%zu rules, max_attempts %u, timeout %lld ms)\n", file.c_str(),
                pol.rules.size(), pol.max_attempts, static_cast<long long>(pol.timeout.count()));
    return 0;
  }
  if (sub != "explain") return usage();
  RouteInputs in;
  in.query.peer_key = "peer";
  in.query.peer_host = "127.0.0.1";
  in.query.same_host = true;
  in.query.bytes = 1 << 20;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--peer")
      in.query.peer_key = next();
    else if (a == "--host")
      in.query.peer_host = next();
    else if (a == "--same-host")
      in.query.same_host = true;
    else if (a == "--remote-host")
      in.query.same_host = false;
    else if (a == "--local" || a == "--remote") {
      auto loc = parse_loc(next());
      if (!loc) return usage();
      (a == "--local" ? in.query.local : in.query.remote) = *loc;
    } else if (a == "--bytes") {
      auto n = parse_size(next());
      if (!n) return usage();
      in.query.bytes = *n;
    } else if (a == "--op") {
      std::string op = next();
      if (op != "read" && op != "write") return usage();
      in.query.op = op == "read" ? Op::READ : Op::WRITE;
    } else {
      return usage();
    }
  }
  // Explain against the plugins this host can load, assuming the peer offers the same.
  for (const auto& p : discover_plugins(pol.plugin_dirs))
    if (p.loaded) in.loaded.emplace_back(p.name, p.caps);
  RouteDecision d = route(pol, in);
  std::printf("transfer: %s %s -> %s, %llu bytes, peer '%s' (%s host)\n",
              in.query.op == Op::READ ? "READ" : "WRITE", to_string(in.query.local),
              to_string(in.query.remote), static_cast<unsigned long long>(in.query.bytes),
              in.query.peer_key.c_str(), in.query.same_host ? "same" : "other");
  if (d.rule < 0) {
    std::printf("no rule matches: the transfer would fail with ERR_BAD_STATE\n");
    return 0;
  }
  const auto& rule = pol.rules[static_cast<size_t>(d.rule)];
  std::printf("rule %d (%s line %d) matches\n", d.rule + 1, pol.source.c_str(), rule.line);
  int rank = 0;
  for (const auto& c : d.candidates) {
    if (c.kept)
      std::printf("  %d. %-6s kept\n", ++rank, c.backend.c_str());
    else
      std::printf("     %-6s dropped: %s\n", c.backend.c_str(), c.why.c_str());
  }
  if (rank == 0) std::printf("no backend left: the transfer would fail with ERR_BAD_STATE\n");
  std::printf("failover: up to %u attempts; timeout %lld ms per attempt\n", pol.max_attempts,
              static_cast<long long>(pol.timeout.count()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  std::string cmd = argv[1];
  if (cmd == "info") return cmd_info(argc - 2, argv + 2);
  if (cmd == "policy") return cmd_policy(argc - 2, argv + 2);
  if (cmd == "stats") return cli::cmd_stats(argc - 2, argv + 2);
  return usage();
}
