// SPDX-License-Identifier: Apache-2.0
// The Prometheus endpoint: GET /metrics over HTTP (cpp-httplib) on its own
// thread, answering with render() (metrics_text.h). Off unless
// EngineConfig::metrics_address or FERRY_METRICS_ADDR names "host:port";
// configured like the stats socket. Nothing but /metrics is served. A scrape
// runs render() on the server's one worker thread: scrapes never touch the
// transfer path beyond reading its atomics.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace ferry {

class MetricsServer {
 public:
  // Binds "host:port" (port 0: any free one) and starts serving; throws
  // ferry::Error (ERR_INVALID_ARGS for a malformed address, ERR_TRANSPORT when
  // it cannot bind).
  MetricsServer(const std::string& address, std::function<std::string()> render);
  ~MetricsServer();  // stops the server and joins its thread
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  // "host:port" actually bound.
  const std::string& address() const { return address_; }

 private:
  std::unique_ptr<httplib::Server> server_;
  std::string address_;
  std::thread thread_;
};

}  // namespace ferry
