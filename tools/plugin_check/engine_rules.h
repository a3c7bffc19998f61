// SPDX-License-Identifier: Apache-2.0
// The rules ferry-plugin-check decides with two engines in two processes
// (this one the initiator; a target started with exec, driven over pipes):
// data at every size, batches, notification exactly once, revocation, bounds,
// peer removal with transfers in flight, live counters, idle CPU, and the
// deadline and fence against a stopped target.
#pragma once
#include <chrono>
#include <string>

#include "abi_rules.h"
#include "report.h"

namespace ferry::plugin_check {

struct EngineRuleOptions {
  std::string settings_json;                 // the plugin's settings in both engines
  bool gpu = false;                          // VRAM on device 0 instead of host memory
  bool quick = false;                        // leave out the 64 MiB + 1 transfers
  std::chrono::milliseconds timeout{20000};  // per transfer
  std::string self_exe;                      // how to start the target (this binary)
};

void run_engine_rules(const PluginFacts& facts, const EngineRuleOptions& o, Report& r);

// The target's side: what `ferry-plugin-check --serve-target` runs.
int serve_target(const std::string& plugin, const std::string& settings_json, bool gpu,
                 const std::string& policy_file);

}  // namespace ferry::plugin_check
