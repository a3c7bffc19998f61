// SPDX-License-Identifier: Apache-2.0
#include "ring_handover.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "ferry/plugin.h"
#include "socket_util.h"
#include "wire.h"

namespace ferry_tcp {
namespace {

constexpr char kTag[8] = {'F', 'R', 'R', 'Y', 'R', 'I', 'N', 'G'};
constexpr uint32_t kHandoverVersion = 1;
constexpr size_t kMessageSize = 16;
constexpr size_t kFds = 6;

// The message's last word: offered (initiator) or agreed (target) options.
// A target before direct copies answers 0 whatever was offered.
constexpr uint32_t kOptDirect = 1;

void Encode(uint8_t out[kMessageSize], uint32_t options) {
  std::memcpy(out, kTag, sizeof kTag);
  const uint32_t v = kHandoverVersion;  // little-endian hosts only (wire.h)
  std::memcpy(out + 8, &v, 4);
  std::memcpy(out + 12, &options, 4);
}

uint32_t Options(const uint8_t m[kMessageSize]) {
  uint32_t o = 0;
  std::memcpy(&o, m + 12, 4);
  return o;
}

bool IsOurs(const uint8_t m[kMessageSize]) {
  uint32_t v = 0;
  std::memcpy(&v, m + 8, 4);
  return std::memcmp(m, kTag, sizeof kTag) == 0 && v == kHandoverVersion;
}

}  // namespace

int OfferRings(int fd, uint64_t capacity, int abort_fd, int timeout_ms, const std::string& label,
               bool offer_direct, shm::Ring* out, shm::Ring* in,
               std::unique_ptr<direct::Process>* target, std::shared_ptr<void>* spare,
               std::string* err) {
  std::string why;
  shm::Ring req = shm::Ring::Create(capacity, &why);
  shm::Ring resp = req.ok() ? shm::Ring::Create(capacity, &why) : shm::Ring();
  if (!req.ok() || !resp.ok()) {
    *err = why;
    return FERRY_ERR_NO_MEMORY;
  }
  // The target's process too: a push it began must be waited out, or its
  // exit; and the spare bytes mapped on their own, for the gate.
  std::unique_ptr<direct::Process> peer;
  std::shared_ptr<void> shared;
  if (offer_direct && (peer = direct::Process::OfPeer(fd, &why)) &&
      (!(shared = req.ShareSpare(&why)) || !direct::PublishProbe(req.spare())))
    peer.reset();
  uint8_t msg[kMessageSize];
  Encode(msg, peer ? kOptDirect : 0);
  const shm::Handover a = req.ForPeer();
  const shm::Handover b = resp.ForPeer();
  const int fds[kFds] = {a.memfd, a.data_bell, a.space_bell, b.memfd, b.data_bell, b.space_bell};
  int rc = SendWithFds(fd, msg, sizeof msg, fds, kFds);
  auto lost = [&](int e) {
    *err = "handing shared rings to " + label + ": " + IoErrorString(e);
    return FERRY_ERR_TRANSPORT;
  };
  if (rc != 0) return lost(rc);
  req.CloseSegmentFd();
  resp.CloseSegmentFd();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  uint8_t answer[wire::kHeaderSize];
  rc = RecvAllBy(fd, answer, kMessageSize, deadline, abort_fd);
  if (rc != 0) return lost(rc);
  if (IsOurs(answer)) {
    *out = std::move(req);
    *in = std::move(resp);
    if (peer && (Options(answer) & kOptDirect) != 0) {
      *target = std::move(peer);
      *spare = std::move(shared);
    }
    return FERRY_OK;
  }
  // Not the tag: an ERROR frame, whose head we have the start of.
  rc = RecvAllBy(fd, answer + kMessageSize, sizeof answer - kMessageSize, deadline, abort_fd);
  if (rc != 0) return lost(rc);
  wire::Header h;
  if (!wire::DecodeHeader(answer, &h, &why) || h.type != wire::Type::kError) {
    *err = "malformed answer to the shared rings from " + label;
    return FERRY_ERR_PROTOCOL;
  }
  std::string text(std::min<uint64_t>(h.payload_len, wire::kMaxErrorLen), '\0');
  rc = RecvAllBy(fd, text.data(), text.size(), deadline, abort_fd);
  if (rc != 0) return lost(rc);
  if (h.status == FERRY_ERR_UNSUPPORTED) {
    *err = label + " cannot take shared rings: " + text;
    return FERRY_ERR_UNSUPPORTED;
  }
  *err = label + " refused the connection: " + text;
  return FERRY_ERR_REMOTE;
}

bool AcceptRings(int fd, std::chrono::steady_clock::time_point deadline, bool allow_direct,
                 shm::Ring* out, shm::Ring* in, std::unique_ptr<direct::Process>* initiator,
                 std::string* why, std::string* no_direct) {
  uint8_t msg[kMessageSize];
  int fds[kFds];
  size_t n = 0;
  bool truncated = false;
  const int rc = RecvWithFds(fd, msg, sizeof msg, fds, kFds, &n, &truncated, deadline);
  auto refuse = [&](std::string text) {
    for (size_t i = 0; i < n; ++i) ::close(fds[i]);
    *why = std::move(text);
    return false;
  };
  if (rc != 0) return refuse("no shared rings: " + IoErrorString(rc));
  if (!IsOurs(msg)) return refuse("expected the shared rings, got something else");
  if (n != kFds || truncated) {
    return refuse("the shared rings came with " + std::to_string(n) + " descriptors, not " +
                  std::to_string(kFds));
  }
  // Attach owns (and on failure closes) each triple from here on.
  n = 0;
  std::string resp_why;
  shm::Ring req = shm::Ring::Attach({fds[0], fds[1], fds[2]}, why);
  shm::Ring resp = shm::Ring::Attach({fds[3], fds[4], fds[5]}, &resp_why);
  if (!req.ok()) return false;
  if (!resp.ok()) {
    *why = resp_why;
    return false;
  }
  if (req.capacity() > kMaxAcceptedRing || resp.capacity() > kMaxAcceptedRing) {
    *why = "shared rings larger than " + std::to_string(kMaxAcceptedRing >> 20) + " MiB";
    return false;
  }
  std::unique_ptr<direct::Process> peer;
  if ((Options(msg) & kOptDirect) == 0) {
    *no_direct = "not offered";
  } else if (!allow_direct) {
    *no_direct = "off here (same_host_direct)";
  } else if ((peer = direct::Process::OfPeer(fd, no_direct)) &&
             !direct::CheckProbe(*peer, req.spare(), no_direct)) {
    peer.reset();
  }
  uint8_t answer[kMessageSize];
  Encode(answer, peer ? kOptDirect : 0);
  const int sent = SendAll(fd, answer, sizeof answer);
  if (sent != 0) {
    *why = "cannot answer the shared rings: " + IoErrorString(sent);
    return false;
  }
  *in = std::move(req);
  *out = std::move(resp);
  *initiator = std::move(peer);
  return true;
}

}  // namespace ferry_tcp
