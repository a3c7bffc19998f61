// SPDX-License-Identifier: Apache-2.0
// The stats endpoint: a Unix socket on which the engine answers every
// connection with its current Engine::stats() as one JSON document, then closes
// it. `ferry stats PATH` reads it from outside the process (a running bench, a
// serving engine) without touching its control plane. Off unless
// EngineConfig::stats_socket or FERRY_STATS_SOCKET names a path.
//
// The socket is created with mode 0600 (owner only) and removed when the
// engine goes. A stale socket left by a crashed process is replaced; one that
// a live process still answers on is not (that is an error naming the path).
#pragma once

#include <functional>
#include <string>
#include <thread>

#include "ferry/ferry.hpp"

namespace ferry {

// The JSON document the endpoint serves (also what `ferry stats --json` prints).
std::string stats_to_json(const std::string& engine_key, const EngineStats& s);

// "{key}" and "{pid}" in a configured path become the engine key and the pid,
// so one setting serves several engines and processes.
std::string expand_stats_path(const std::string& pattern, const std::string& engine_key);

class StatsServer {
 public:
  // Binds and starts serving; throws ferry::Error (ERR_INVALID_ARGS for a bad
  // path, ERR_BAD_STATE when a live process owns it, ERR_TRANSPORT otherwise).
  StatsServer(std::string path, std::function<std::string()> render);
  ~StatsServer();  // stops the thread and removes the socket file
  StatsServer(const StatsServer&) = delete;
  StatsServer& operator=(const StatsServer&) = delete;
  const std::string& path() const { return path_; }

 private:
  void Serve();

  const std::string path_;
  const std::function<std::string()> render_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: tells Serve() to return
  std::thread thread_;
};

}  // namespace ferry
