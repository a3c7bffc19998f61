// SPDX-License-Identifier: Apache-2.0
#include "metrics_server.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <charconv>
#include <memory>

#include "ferry/ferry.hpp"
#include "thread_name.h"

namespace ferry {

namespace {

// "host:port" or "[v6]:port"; port 0..65535.
void split_address(const std::string& a, std::string& host, int& port) {
  const size_t c = a.rfind(':');
  auto bad = [&] {
    return Error(StatusCode::ERR_INVALID_ARGS,
                 "metrics address must be HOST:PORT (port 0: any free one), got '" + a + "'");
  };
  if (c == std::string::npos || c == 0 || c + 1 == a.size()) throw bad();
  host = a.substr(0, c);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  const char* b = a.data() + c + 1;
  const char* e = a.data() + a.size();
  auto [end, ec] = std::from_chars(b, e, port);
  if (ec != std::errc() || end != e || port < 0 || port > 65535) throw bad();
}

}  // namespace

MetricsServer::MetricsServer(const std::string& address, std::function<std::string()> render)
    : server_(std::make_unique<httplib::Server>()) {
  std::string host;
  int port = 0;
  split_address(address, host, port);
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which would let a
  // second engine bind the same port and answer half of the scrapes.
  server_->set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  // One worker: scrapes come every few seconds; more threads would only idle.
  server_->new_task_queue = [] { return new httplib::ThreadPool(1); };
  // A scraper that stalls must not hold the only worker for long.
  server_->set_read_timeout(std::chrono::seconds(5));
  server_->set_write_timeout(std::chrono::seconds(5));
  server_->Get("/metrics",
               [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
                 res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
               });
  const int bound =
      port == 0 ? server_->bind_to_any_port(host) : (server_->bind_to_port(host, port) ? port : -1);
  if (bound <= 0)
    throw Error(StatusCode::ERR_TRANSPORT, "metrics endpoint: cannot listen on '" + address +
                                               "' (in use, or not an address here)");
  address_ =
      (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(bound);
  auto ended = std::make_shared<std::atomic<bool>>(false);
  thread_ = ferry::named_thread("ferry-metrics", [this, ended] {
    server_->listen_after_bind();
    ended->store(true);
  });
  // stop() only closes the socket of a server that runs: wait until it does,
  // so a destructor right after this cannot leave accept() blocked forever.
  while (!server_->is_running() && !ended->load()) std::this_thread::yield();
}

MetricsServer::~MetricsServer() {
  // stop() closes the listening socket, which ends the blocking accept().
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace ferry
