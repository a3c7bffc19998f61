// SPDX-License-Identifier: Apache-2.0
// ferry: the command-line tool (`ferry --help`, `ferry SUBCOMMAND --help`).
//   ferry info [--json] [--plugin-dir DIR]...
//                                         plugins found, loaded or why not
//   ferry policy check FILE               validate a policy (errors name file:line:col)
//   ferry policy explain FILE [--peer P] [--host H] [--same-host|--remote-host]
//                [--local cpu|gpu] [--remote cpu|gpu] [--bytes N] [--op read|write]
//                                         the ranked backends and why each was kept or dropped
//   ferry stats PATH [--json] [--watch SECONDS [--count N]]
//                                         a running engine's stats (its stats socket)
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "plugin_loader.h"
#include "policy.h"
#include "router.h"
#include "stats_command.h"

using namespace ferry;

namespace {

struct InfoArgs {
  std::vector<std::string> dirs;
  bool json = false;
};

int cmd_info(const InfoArgs& args) {
  const auto& dirs = args.dirs;
  if (args.json) {  // one object per plugin found, for scripts (scripts/ci_summary.py)
    nlohmann::json out = nlohmann::json::array();
    for (const auto& p : discover_plugins(dirs, ProbeIn::CHILD_PROCESS))
      out.push_back({{"name", p.name},
                     {"path", p.path},
                     {"loaded", p.loaded},
                     {"error", p.error},
                     {"version", p.version},
                     {"abi", std::to_string(p.abi_major) + "." + std::to_string(p.abi_minor)},
                     {"caps", caps_to_string(p.caps)},
                     {"description", p.description},
                     {"warning", p.warning}});
    std::printf("%s\n", out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
    return 0;
  }
  std::printf("ferry %s, plugin ABI %d.%d\n", "0.1.0", FERRY_PLUGIN_ABI_MAJOR,
              FERRY_PLUGIN_ABI_MINOR);
  std::printf("search path:");
  for (const auto& d : plugin_search_dirs(dirs)) std::printf(" %s", d.c_str());
  // Each plugin starts in a child process: one that crashes or hangs there is
  // reported, and the listing goes on.
  auto infos = discover_plugins(dirs, ProbeIn::CHILD_PROCESS);
  std::printf("\n%s", infos.empty() ? "no plugin found (set FERRY_PLUGIN_PATH)\n" : "");
  for (const auto& p : infos) {
    if (p.loaded) {
      std::printf("  %-6s loaded   v%s abi %u.%u caps=%s\n         %s\n", p.name.c_str(),
                  p.version.c_str(), p.abi_major, p.abi_minor, caps_to_string(p.caps).c_str(),
                  p.path.c_str());
      if (!p.description.empty()) std::printf("         %s\n", p.description.c_str());
      if (!p.warning.empty()) std::printf("         warning: %s\n", p.warning.c_str());
    } else {
      std::printf("  %-6s FAILED   %s\n         %s\n", p.name.c_str(), p.error.c_str(),
                  p.path.c_str());
    }
  }
  return 0;
}

MemoryLocation parse_loc(const std::string& s) {
  return s == "gpu" ? MemoryLocation::GPU : MemoryLocation::CPU;
}

struct PolicyArgs {
  std::string file;
  bool explain = false;  // else check
  RouteInputs in;
};

int cmd_policy(PolicyArgs& args) {
  const std::string& file = args.file;
  Policy pol;
  try {
    pol = load_policy_file(file);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  if (!args.explain) {
    std::printf("%s: OK (%zu rules, max_attempts %u, timeout %lld ms)\n", file.c_str(),
                pol.rules.size(), pol.max_attempts, static_cast<long long>(pol.timeout.count()));
    return 0;
  }
  RouteInputs& in = args.in;
  // Explain against the plugins this host can load, assuming the peer offers the same.
  for (const auto& p : discover_plugins(pol.plugin_dirs, ProbeIn::CHILD_PROCESS))
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
  std::printf("failover: up to %u attempts; timeout %lld ms per transfer\n", pol.max_attempts,
              static_cast<long long>(pol.timeout.count()));
  return 0;
}

// The policy explain options, straight into the route query (defaults as shown).
void add_explain_options(CLI::App& explain, RouteInputs& in) {
  in.query.peer_key = "peer";
  in.query.peer_host = "127.0.0.1";
  in.query.same_host = true;
  in.query.bytes = 1 << 20;
  explain.add_option("--peer", in.query.peer_key, "the peer's engine key (rules match on it)")
      ->type_name("KEY")
      ->capture_default_str();
  explain.add_option("--host", in.query.peer_host, "the peer's host")
      ->type_name("HOST")
      ->capture_default_str();
  // On each occurrence, so the last of --same-host/--remote-host wins.
  explain
      .add_flag_callback(
          "--same-host", [&in] { in.query.same_host = true; },
          "the peer is on this host (the default)")
      ->trigger_on_parse();
  explain
      .add_flag_callback(
          "--remote-host", [&in] { in.query.same_host = false; }, "the peer is on another host")
      ->trigger_on_parse();
  auto add_loc = [&explain](const char* name, MemoryLocation* loc, const char* desc) {
    explain
        .add_option_function<std::string>(
            name, [loc](const std::string& v) { *loc = parse_loc(v); }, desc)
        ->check(CLI::IsMember({"cpu", "gpu"}).description(""))  // the type name lists them
        ->type_name("cpu|gpu")
        ->default_str(to_string(*loc));
  };
  add_loc("--local", &in.query.local, "this side's memory");
  add_loc("--remote", &in.query.remote, "the peer's memory");
  explain
      .add_option_function<std::string>(
          "--bytes",
          [&in](const std::string& v) {
            auto n = parse_size(v);
            if (!n) throw CLI::ValidationError("--bytes", "bad size '" + v + "'");
            in.query.bytes = *n;
          },
          "the transfer's size (K/KiB, M/MiB, G/GiB)")
      ->type_name("SIZE")
      ->default_str("1MiB");
  explain
      .add_option_function<std::string>(
          "--op", [&in](const std::string& v) { in.query.op = v == "read" ? Op::READ : Op::WRITE; },
          "the transfer's direction")
      ->check(CLI::IsMember({"read", "write"}).description(""))
      ->type_name("read|write")
      ->default_str(in.query.op == Op::READ ? "read" : "write");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry: the plugins this host loads, policies, a running engine's stats.", "ferry"};
  // The last of a repeated option wins, as it did before CLI11 (which would refuse it).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.require_subcommand(1);
  app.footer("`ferry SUBCOMMAND --help` lists that subcommand's options.");
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("ferry: ") + e.what() + "\nRun with --help for more information.\n";
  });

  InfoArgs info_args;
  CLI::App* info = app.add_subcommand("info", "plugins found, loaded or why not");
  info->add_flag("--json", info_args.json,
                 "a JSON array, one object per plugin found, for scripts");
  info->add_option("--plugin-dir", info_args.dirs,
                   "search DIR too, after FERRY_PLUGIN_PATH, before the default (repeatable)")
      ->type_name("DIR")
      ->take_all()
      ->allow_extra_args(false);  // one DIR per --plugin-dir

  PolicyArgs policy_args;
  CLI::App* policy = app.add_subcommand("policy", "validate or explain a policy file");
  policy->require_subcommand(1);
  CLI::App* check =
      policy->add_subcommand("check", "validate a policy (errors name file:line:col)");
  check->add_option("FILE", policy_args.file, "the policy YAML")->type_name("")->required();
  CLI::App* explain = policy->add_subcommand(
      "explain", "the ranked backends for one transfer, and why each was kept or dropped");
  explain->add_option("FILE", policy_args.file, "the policy YAML")->type_name("")->required();
  add_explain_options(*explain, policy_args.in);

  cli::StatsArgs stats_args;
  CLI::App* stats = cli::add_stats_command(app, stats_args);

  if (argc < 2) {  // a bare `ferry`: the whole usage, as an error
    std::fputs(app.help().c_str(), stderr);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Error& e) {  // ParseError, and whatever else CLI11 may throw while parsing
    // For `ferry bogus` CLI11 says only "A subcommand is required": name the word.
    const CLI::App* at = &app;
    while (!at->get_subcommands().empty()) at = at->get_subcommands().front();
    if (dynamic_cast<const CLI::RequiredError*>(&e) && at->get_require_subcommand_min() > 0 &&
        !at->remaining().empty()) {
      const std::string cmd = at == &app ? "ferry" : "ferry " + at->get_name();
      std::fprintf(stderr,
                   "ferry: unknown subcommand '%s'\nRun with %s --help for more information.\n",
                   at->remaining().front().c_str(), cmd.c_str());
      return 2;
    }
    // --help is a success (0); every other parse error keeps the tool's old code, 2.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (*info) return cmd_info(info_args);
  if (*policy) {
    policy_args.explain = explain->parsed();
    return cmd_policy(policy_args);
  }
  if (*stats) return cli::cmd_stats(stats_args);
  return 2;  // unreachable: require_subcommand(1)
}
