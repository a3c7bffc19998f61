// SPDX-License-Identifier: Apache-2.0
// A plugin's probe for `ferry info` (load, init, describe, fini) run in a
// forked child, so a plugin that crashes or hangs there becomes its error
// line and not the end of the listing.
#pragma once
#include <chrono>
#include <functional>

#include "ferry/ferry.hpp"

namespace ferry {

// What a probe has learnt so far; a probe calls it after each stage, so what
// came before a crash is still shown.
using ProbeReport = std::function<void(const PluginInfo&)>;
using Probe = PluginInfo (*)(PluginInfo info, const ProbeReport& report);

// Runs probe(info) in a child process and returns its result; a child killed
// by a signal, or stopped after `limit`, yields the last report with the
// reason as error. Without a child (fork or pipe failed), probes here.
PluginInfo probe_in_child(const PluginInfo& info, Probe probe,
                          std::chrono::milliseconds limit = std::chrono::seconds(30));

}  // namespace ferry
