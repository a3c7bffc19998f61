// SPDX-License-Identifier: Apache-2.0
#include "handshake.h"

#include <sys/random.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "socket_util.h"
#include "wire.h"

namespace ferry_tcp {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> Frame(wire::Type type, uint16_t flags, const void* payload, size_t n,
                           uint64_t clock_ns = 0) {
  wire::Header h;
  h.type = type;
  h.flags = flags;
  h.payload_len = n;
  h.expires_ns = clock_ns;
  std::vector<uint8_t> out = wire::EncodeFrameHead(h, {});
  const auto* p = static_cast<const uint8_t*>(payload);
  out.insert(out.end(), p, p + n);
  return out;
}

}  // namespace

bool LinkAuthAvailable(const ferry_host_v1* host) {
  return FERRY_HAS_FIELD(ferry_host_v1, host, link_prove) && host->link_prove != nullptr &&
         FERRY_HAS_FIELD(ferry_host_v1, host, link_check) && host->link_check != nullptr;
}

bool RandomBytes(void* out, size_t n) {
  auto* p = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<size_t>(r);
  }
  return true;
}

int InitiatorHandshake(int fd, const InitiatorHello& h, std::string* err) {
  const bool auth = LinkAuthAvailable(h.host);
  // The HELLO carries our clock: the target maps request expiries onto its own.
  std::vector<uint8_t> out = Frame(wire::Type::kHello, auth ? wire::kFlagAuth : 0, h.my_key.data(),
                                   h.my_key.size(), h.host->now_ns(h.host->host_ctx));
  uint8_t ni[wire::kAuthNonceSize];
  if (auth) {
    if (!RandomBytes(ni, sizeof ni)) {
      *err = "no random bytes for an auth challenge";
      return FERRY_ERR_INTERNAL;
    }
    std::vector<uint8_t> a = Frame(wire::Type::kAuth, 0, ni, sizeof(ni));
    out.insert(out.end(), a.begin(), a.end());
  }
  int rc = SendAll(fd, out.data(), out.size());
  if (rc != 0) {
    *err = "connection to " + h.label + " lost: " + IoErrorString(rc);
    return FERRY_ERR_TRANSPORT;
  }
  if (!auth) return FERRY_OK;  // a host without link auth (tests): requests follow at once

  const auto deadline = Clock::now() + std::chrono::milliseconds(h.timeout_ms);
  auto lost = [&](int e) {
    *err = "auth handshake with " + h.label + ": " +
           (e == ETIMEDOUT ? std::string("no answer within ") + std::to_string(h.timeout_ms) + " ms"
                           : IoErrorString(e));
    return FERRY_ERR_TRANSPORT;
  };
  uint8_t hb[wire::kHeaderSize];
  if ((rc = RecvAllBy(fd, hb, sizeof(hb), deadline, h.abort_fd)) != 0) return lost(rc);
  wire::Header resp;
  std::string why;
  if (!wire::DecodeHeader(hb, &resp, &why)) {
    *err = "malformed answer to HELLO from " + h.label + ": " + why;
    return FERRY_ERR_PROTOCOL;
  }
  if (resp.type == wire::Type::kError) {
    std::string text(std::min<uint64_t>(resp.payload_len, wire::kMaxErrorLen), '\0');
    if ((rc = RecvAllBy(fd, text.data(), text.size(), deadline, h.abort_fd)) != 0) return lost(rc);
    *err = h.label + " refused the connection: " + text;
    return FERRY_ERR_REMOTE;
  }
  if (resp.type != wire::Type::kAuth ||
      resp.payload_len != wire::kAuthNonceSize + wire::kAuthProofSize) {
    *err =
        std::string("unexpected ") + wire::TypeName(resp.type) + " answer to HELLO from " + h.label;
    return FERRY_ERR_PROTOCOL;
  }
  uint8_t nt_proof[wire::kAuthNonceSize + wire::kAuthProofSize];
  if ((rc = RecvAllBy(fd, nt_proof, sizeof(nt_proof), deadline, h.abort_fd)) != 0) return lost(rc);
  const uint8_t* nt = nt_proof;
  std::vector<uint8_t> t =
      wire::AuthTranscript(wire::kAuthTargetLabel, ni, nt, h.my_key, h.peer_key);
  char reason[512] = "";
  if (h.host->link_check(h.host->host_ctx, h.peer_key.c_str(), FERRY_LINK_INITIATOR, t.data(),
                         t.size(), nt_proof + wire::kAuthNonceSize, reason,
                         sizeof reason) != FERRY_OK) {
    *err = "lane to " + h.label + ": " + reason;
    return FERRY_ERR_REMOTE;
  }
  t = wire::AuthTranscript(wire::kAuthInitiatorLabel, ni, nt, h.my_key, h.peer_key);
  uint8_t proof[wire::kAuthProofSize];
  if (h.host->link_prove(h.host->host_ctx, h.peer_key.c_str(), FERRY_LINK_INITIATOR, t.data(),
                         t.size(), proof) != FERRY_OK) {
    *err = "cannot prove access to " + h.label + " (is it still registered?)";
    return FERRY_ERR_INTERNAL;
  }
  out = Frame(wire::Type::kAuth, 0, proof, sizeof(proof));
  rc = SendAll(fd, out.data(), out.size());
  if (rc != 0) return lost(rc);
  return FERRY_OK;
}

}  // namespace ferry_tcp
