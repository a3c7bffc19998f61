// `ferry stats`: reads a running engine's stats endpoint (core/src/stats_server.h).
#pragma once

namespace ferry::cli {

// argv after "stats": PATH [--json] [--watch SECONDS [--count N]]. Returns the exit code.
int cmd_stats(int argc, char** argv);

}  // namespace ferry::cli
