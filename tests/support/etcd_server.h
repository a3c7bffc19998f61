// SPDX-License-Identifier: Apache-2.0
// A real etcd server for the metadata tests: Debian's etcd-server binary
// started on 127.0.0.1 with free ports and a fresh data folder, stopped (or
// killed, and started again on the same ports and data) by the test.
#pragma once
#include <string>

namespace ferry::test {

// The etcd binary (FERRY_ETCD_BIN, else /usr/bin/etcd); empty when missing.
std::string etcd_binary();
// Whether a missing tool must fail the test rather than skip it
// (scripts/run.sh sets FERRY_REQUIRE_<NAME>=1 unless FERRY_ALLOW_SKIP names it).
bool tool_required(const char* env_name);

class EtcdServer {
 public:
  EtcdServer();   // starts it; throws std::runtime_error if it does not answer in 20 s
  ~EtcdServer();  // SIGTERM, reap, remove the data folder
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  const std::string& endpoint() const { return endpoint_; }  // http://127.0.0.1:PORT
  void kill_now();                                           // SIGKILL and reap: the store is down
  void start();                                              // again, same ports and data
  bool running() const { return pid_ > 0; }

 private:
  std::string dir_, endpoint_, peer_url_;
  int pid_ = -1;
};

}  // namespace ferry::test
