// SPDX-License-Identifier: Apache-2.0
// ferry-bench's ranks meeting through etcd, as nixlbench's do: the target
// rank publishes where its command channel listens under
// {ns}/rendezvous/target (with a lease it keeps alive while it waits, so a
// dead rank's address does not linger), and the initiator waits for that key
// and connects. The engines' descriptors themselves travel through the
// engines' metadata store (Engine::publish_memory / fetch_remote_engine).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry::bench {

struct EtcdRendezvous {
  std::vector<std::string> endpoints;
  std::string ns = "ferry-bench";
  int64_t claim_lease = 0;  // claim_rank's lease: kept alive until the ranks met, then revoked
};

// nixlbench's numbering: the first process to create {ns}/rank/0 is rank 0,
// the next creates {ns}/rank/1. The claims hold a lease kept alive while the
// ranks meet and revoked after (a crashed rank's claim expires in 10 s).
// Returns 0 or 1, or -1 with *why (both ranks taken, store unreachable).
int claim_rank(EtcdRendezvous& r, std::string* why);

// Target rank: listens on host:0, publishes "host:port", waits for the
// initiator; returns the connected socket, or -1 with *why.
int rendezvous_accept(const EtcdRendezvous& r, const std::string& host,
                      std::chrono::milliseconds wait, std::string* why);
// Initiator rank: waits for the target's address and connects; -1 with *why.
int rendezvous_connect(const EtcdRendezvous& r, std::chrono::milliseconds wait, std::string* why);

}  // namespace ferry::bench
