// SPDX-License-Identifier: Apache-2.0
// `ferry stats`: reads a running engine's stats endpoint (core/src/stats_server.h).
#pragma once
#include <string>

namespace CLI {
class App;
}  // namespace CLI

namespace ferry::cli {

struct StatsArgs {
  std::string path;  // the engine's stats socket
  bool json = false;
  double watch = 0;  // seconds between samples; 0: one sample
  long count = 0;    // samples when watching; 0: until the engine goes away
};

// Adds the `stats` subcommand to `app`; parsing it fills *args (which must outlive app).
CLI::App* add_stats_command(CLI::App& app, StatsArgs& args);

// Runs a parsed `ferry stats`. Returns the exit code.
int cmd_stats(const StatsArgs& args);

}  // namespace ferry::cli
