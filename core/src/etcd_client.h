// SPDX-License-Identifier: Apache-2.0
// A small etcd v3 client over the JSON gateway (HTTP POST /v3/...) and
// libcurl: put / get / delete, leases, and a streaming watch. Why the gateway
// and not gRPC: Debian 12 ships libcurl, while etcd's gRPC C++ stubs need
// grpc++ and protobuf development packages and generated code; the gateway is
// part of every etcd v3 server (3.4 and later) and carries the same calls.
//
// Every call is bounded by the request timeout and returns a Result whose
// message names the endpoint and the call ("etcd http://h:2379 POST
// /v3/kv/range: Couldn't connect to server"); nothing throws. Endpoints are
// tried in order, starting with the last one that answered.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "etcd_json.h"
#include "ferry/ferry.hpp"

namespace ferry::etcd {

class Client {
 public:
  explicit Client(std::vector<std::string> endpoints,
                  std::chrono::milliseconds timeout = std::chrono::seconds(3));
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  Result grant(std::chrono::seconds ttl, int64_t& lease);
  // ttl = 0 afterwards: the lease no longer exists (expired or revoked).
  Result keepalive(int64_t lease, int64_t& ttl);
  Result revoke(int64_t lease);
  Result put(const std::string& key, const std::string& value, int64_t lease = 0);
  // One key: absent -> *kv stays nullopt. *revision: the store's revision then.
  Result get(const std::string& key, std::optional<KeyValue>& kv, int64_t* revision = nullptr);
  Result get_prefix(const std::string& prefix, std::vector<KeyValue>& kvs,
                    int64_t* revision = nullptr);
  Result remove(const std::string& key);
  // Puts `value` only when `key` does not exist (one transaction); *created
  // says whether this call created it (ferry-bench's rank claims).
  Result create_if_absent(const std::string& key, const std::string& value, int64_t lease,
                          bool& created);

  // Streams the watch of every key under `prefix` from `start_revision`,
  // calling on_message for each message, until on_message returns false, the
  // stream breaks (the Result says why), or interrupt() is called (SUCCESS).
  // A stream may stay silent for ever, and a frozen store (SIGSTOPped, hung)
  // keeps its TCP connection up: every `probe` the watch asks the same
  // endpoint a one-key range, and ends (ERR_TRANSPORT) when that gets no
  // answer within the request timeout. A watch that ended that way, or could
  // not start, makes the next one use the next endpoint.
  Result watch(const std::string& prefix, int64_t start_revision,
               const std::function<bool(const WatchMessage&)>& on_message,
               std::chrono::milliseconds probe = std::chrono::seconds(3));
  // Makes a watch() in progress return soon, and a request in progress fail
  // within about a second (ERR_TRANSPORT); later calls of both fail at once.
  // For shutdown.
  void interrupt();

  const std::vector<std::string>& endpoints() const { return endpoints_; }

 private:
  Result post(const std::string& path, const std::string& body, std::string& answer);

  const std::vector<std::string> endpoints_;
  const std::chrono::milliseconds timeout_;
  std::atomic<size_t> preferred_{0};  // index of the endpoint that last answered
  std::atomic<size_t> watch_ep_{0};   // the endpoint the next watch uses
  std::atomic<bool> interrupted_{false};
  std::mutex watch_mu_;
  void* watch_multi_ = nullptr;  // CURLM* of the watch in progress (watch_mu_)
};

// The end of a prefix range: the prefix with its last byte incremented.
std::string prefix_end(const std::string& prefix);

}  // namespace ferry::etcd
