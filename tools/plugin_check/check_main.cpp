// SPDX-License-Identifier: Apache-2.0
// ferry-plugin-check: runs the plugin contract (docs/plugin-guide.md, "The
// contract") against one plugin and prints PASS / FAIL / SKIP per rule. Exit
// status 0 when nothing failed, 1 when a rule failed, 2 when it could not run.
//
//   ferry-plugin-check [--settings JSON] [--gpu] [--quick] PLUGIN
//
// PLUGIN is a path to libferry-<name>.so or a name found where the core
// looks: FERRY_PLUGIN_PATH, then <folder of libferry.so>/ferry/plugins.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "abi_rules.h"
#include "engine_rules.h"
#include "ferry/plugin.h"
#include "plugin_loader.h"

namespace {

std::string self_exe() {
  char buf[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

bool is_file(const std::string& p) { return ::access(p.c_str(), R_OK) == 0; }

// A name: where the core itself looks (FERRY_PLUGIN_PATH, then the plugin
// folder beside the libferry.so this program runs with), so an installed copy
// finds its own prefix's plugins and a build tree's copy the build's.
std::string find_plugin(const std::string& arg, std::string* searched) {
  if (arg.find('/') != std::string::npos) return is_file(arg) ? arg : std::string();
  for (const auto& d : ferry::plugin_search_dirs({})) {
    if (std::string p = d + "/libferry-" + arg + ".so"; is_file(p)) return p;
    *searched += (searched->empty() ? "" : ", ") + d;
  }
  return {};
}

std::string dir_of(const std::string& path) {
  char buf[PATH_MAX];
  const std::string real = ::realpath(path.c_str(), buf) ? std::string(buf) : path;
  const auto slash = real.rfind('/');
  return slash == std::string::npos ? "." : real.substr(0, slash);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ferry-plugin-check: runs the ferry plugin contract against one plugin"};
  std::string plugin, settings = "{}", serve, policy;
  bool gpu = false, quick = false;
  long timeout_ms = 20000;
  app.add_option("plugin", plugin, "libferry-<name>.so, or a plugin name on FERRY_PLUGIN_PATH");
  app.add_option("--settings", settings, "the plugin's settings (JSON object) in both engines");
  app.add_flag("--gpu", gpu, "move GPU memory (device 0); implied when the plugin has no CPU cap");
  app.add_flag("--quick", quick, "leave out the 64 MiB + 1 transfers");
  app.add_option("--timeout-ms", timeout_ms, "per-transfer deadline")
      ->check(CLI::Range(100, 600000));
  // The target process this binary starts of itself (not for users).
  app.add_option("--serve-target", serve)->group("");
  app.add_option("--policy", policy)->group("");
  CLI11_PARSE(app, argc, argv);

  if (!serve.empty()) return ferry::plugin_check::serve_target(serve, settings, gpu, policy);
  if (plugin.empty()) {
    std::fprintf(stderr, "ferry-plugin-check: name a plugin (--help)\n");
    return 2;
  }
  std::string searched;
  const std::string path = find_plugin(plugin, &searched);
  if (path.empty()) {
    std::fprintf(
        stderr, "ferry-plugin-check: no plugin '%s': not a file, and no libferry-%s.so in %s\n",
        plugin.c_str(), plugin.c_str(), searched.empty() ? "any folder" : searched.c_str());
    return 2;
  }
  std::printf("ferry-plugin-check: %s (plugin ABI %d.%d)\n", path.c_str(), FERRY_PLUGIN_ABI_MAJOR,
              FERRY_PLUGIN_ABI_MINOR);
  ferry::plugin_check::Report report;
  ferry::plugin_check::PluginFacts facts;
  if (ferry::plugin_check::run_abi_rules(path, settings, report, &facts)) {
    ferry::plugin_check::EngineRuleOptions o;
    // Both engines load this file: its folder first on the search path.
    const char* old = std::getenv("FERRY_PLUGIN_PATH");
    const std::string search = dir_of(path) + (old && *old ? ":" + std::string(old) : "");
    ::setenv("FERRY_PLUGIN_PATH", search.c_str(), 1);
    o.settings_json = settings;
    o.gpu = gpu || !(facts.caps & FERRY_CAP_MEM_CPU);
    o.quick = quick;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    o.self_exe = self_exe();
    ferry::plugin_check::run_engine_rules(facts, o, report);
  }
  std::printf("%s: %d rule(s) failed\n", report.failed() ? "FAIL" : "PASS", report.failed());
  return report.failed() ? 1 : 0;
}
