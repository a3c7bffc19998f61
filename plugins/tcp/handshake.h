// SPDX-License-Identifier: Apache-2.0
// The data-lane handshake: HELLO and the mutual proof of access by descriptor
// (wire.h, kFlagAuth) computed by the host's link_prove / link_check (ABI 1.4),
// so the secrets stay in the core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_tcp {

// True when the host offers link_prove and link_check (ABI >= 1.4, non-NULL).
bool LinkAuthAvailable(const ferry_host_v1* host);
// n random bytes (getrandom). False if the kernel gives none.
bool RandomBytes(void* out, size_t n);

struct InitiatorHello {
  const ferry_host_v1* host = nullptr;
  std::string my_key;
  std::string peer_key;
  std::string label;  // for messages
  int timeout_ms = 5000;
  int abort_fd = -1;  // an eventfd that cuts the wait short
};

// Initiator side, on a freshly connected socket: says HELLO and, when the host
// offers link auth, authenticates both ways before returning. Returns FERRY_OK, or a
// FERRY_ERR_* code with *err in words (FERRY_ERR_REMOTE: the target refused or
// could not prove its descriptor's secret; FERRY_ERR_TRANSPORT: the connection failed).
int InitiatorHandshake(int fd, const InitiatorHello& h, std::string* err);

}  // namespace ferry_tcp
