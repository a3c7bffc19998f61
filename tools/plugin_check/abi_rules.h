// SPDX-License-Identifier: Apache-2.0
// The rules ferry-plugin-check decides from the .so itself (dlopen, the ops
// table, init/fini against a host table of the oldest size), before any engine.
#pragma once
#include <cstdint>
#include <string>

#include "report.h"

namespace ferry::plugin_check {

struct PluginFacts {
  std::string name;
  uint64_t caps = 0;
  uint32_t abi_minor = 0;
  bool has_describe = false, has_fence = false, has_counters = false, has_progress = false;
};

// Loads `path`, checks the table, runs init/fini in a child process against a
// host table cut to ABI 1.0. False (and FAIL lines) when it is not a plugin at
// all; the facts feed the engine rules.
bool run_abi_rules(const std::string& path, const std::string& settings_json, Report& r,
                   PluginFacts* facts);

}  // namespace ferry::plugin_check
