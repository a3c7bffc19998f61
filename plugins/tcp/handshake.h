// The data-lane handshake: HELLO, and with an auth token a mutual HMAC
// challenge/response (wire.h, kFlagAuth) computed by the host's auth_sign /
// auth_verify (ABI 1.1), so the secret stays in the core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/plugin.h"

namespace ferry_tcp {

// True when the host offers auth_sign (ABI >= 1.1, non-NULL) and has a secret.
bool AuthEnabled(const ferry_host_v1* host);
// 32 random bytes (getrandom). False if the kernel gives none.
bool RandomNonce(uint8_t* out);

struct InitiatorHello {
  const ferry_host_v1* host = nullptr;
  std::string my_key;
  std::string peer_key;
  std::string label;  // for messages
  int timeout_ms = 5000;
  int abort_fd = -1;  // an eventfd that cuts the wait short
};

// Initiator side, on a freshly connected socket: says HELLO and, when the host
// has a secret, authenticates both ways before returning. Returns FERRY_OK, or a
// FERRY_ERR_* code with *err in words (FERRY_ERR_REMOTE: the target refused or
// could not prove the token; FERRY_ERR_TRANSPORT: the connection failed).
int InitiatorHandshake(int fd, const InitiatorHello& h, std::string* err);

}  // namespace ferry_tcp
