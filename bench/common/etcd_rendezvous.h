// SPDX-License-Identifier: Apache-2.0
// ferry-bench's ranks meeting through etcd, as nixlbench's do: the target
// rank publishes where its command channel listens under
// {ns}/rendezvous/target (with a lease it keeps alive while it waits, so a
// dead rank's address does not linger), and the initiator waits for that key
// and connects. The engines' descriptors themselves travel through the
// engines' metadata store (Engine::publish_memory / fetch_remote_engine).
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace ferry::bench {

struct EtcdRendezvous {
  std::vector<std::string> endpoints;
  std::string ns = "ferry-bench";
};

// Target rank: listens on host:0, publishes "host:port", waits for the
// initiator; returns the connected socket, or -1 with *why.
int rendezvous_accept(const EtcdRendezvous& r, const std::string& host,
                      std::chrono::milliseconds wait, std::string* why);
// Initiator rank: waits for the target's address and connects; -1 with *why.
int rendezvous_connect(const EtcdRendezvous& r, std::chrono::milliseconds wait, std::string* why);

}  // namespace ferry::bench
