// SPDX-License-Identifier: Apache-2.0
// What a live plugin instance says about itself (ABI 1.5): its describe() line
// and its counters() object, read into BackendStats for Engine::stats().
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "backend_set.h"

namespace ferry {

// The counters() JSON of a plugin, kept only where it follows plugin.h's rules
// (keys [a-z0-9_]{1,32}, non-negative integer values, at most 32 keys).
std::map<std::string, uint64_t> parse_plugin_counters(const char* json_text);

// Fills s.detail and s.plugin from the instance, unless it was removed.
void read_live_info(Backend& b, BackendStats& s);

}  // namespace ferry
