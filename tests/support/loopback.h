// SPDX-License-Identifier: Apache-2.0
// A TCP socket listening on 127.0.0.1 at a free port, for tests that stand
// in for an endpoint (a frozen etcd member, a proxy in front of an engine).
#pragma once
#include <cstdint>

namespace ferry::test {

// The listening fd (its port in *port), or -1.
int listen_loopback(uint16_t* port, int backlog = 64);
// A blocking connection to 127.0.0.1:port, or -1.
int dial_loopback(uint16_t port);

}  // namespace ferry::test
