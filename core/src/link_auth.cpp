// SPDX-License-Identifier: Apache-2.0
#include "link_auth.h"

#include <cstring>

namespace ferry {

namespace {
constexpr size_t kHalf = auth::kMacSize;
static_assert(LinkAuth::kProofSize == 2 * kHalf, "a proof is two MACs");
}  // namespace

int LinkAuth::prove(const std::string& peer, uint32_t role, const void* transcript, size_t len,
                    uint8_t proof[kProofSize]) const {
  std::memset(proof, 0, kProofSize);
  if (role == FERRY_LINK_TARGET)
    return creds_.prove(creds_.own(), auth::kTargetRole, transcript, len, proof)
               ? FERRY_OK
               : FERRY_ERR_INTERNAL;
  if (role != FERRY_LINK_INITIATOR) return FERRY_ERR_INVALID_ARGS;
  auth::InstanceSecret theirs;
  if (!peers_(peer, &theirs, nullptr)) return FERRY_ERR_NOT_FOUND;
  bool ok = creds_.prove(theirs, auth::kInitiatorRole, transcript, len, proof) &&
            creds_.prove(creds_.own(), auth::kInitiatorRole, transcript, len, proof + kHalf);
  return ok ? FERRY_OK : FERRY_ERR_INTERNAL;
}

int LinkAuth::check(const std::string& peer, uint32_t role, const void* transcript, size_t len,
                    const uint8_t proof[kProofSize], std::string* why, bool* unknown) const {
  const std::string token_hint =
      creds_.has_token() ? ", or a different auth token" : ", or an auth token set there only";
  auth::InstanceSecret theirs;
  bool learned = false;
  const bool registered = peers_(peer, &theirs, &learned);
  if (role == FERRY_LINK_INITIATOR) {
    if (!registered) {
      *why = "engine '" + peer + "' is not registered here";
      return FERRY_ERR_NOT_FOUND;
    }
    if (creds_.check(theirs, auth::kTargetRole, transcript, len, proof)) return FERRY_OK;
    *why = "engine '" + peer +
           "' did not prove the secret of the descriptor registered for it (it restarted and "
           "its new descriptor is not registered here, it is not the engine it claims to be" +
           token_hint + ")";
    return FERRY_ERR_REMOTE;
  }
  if (role != FERRY_LINK_TARGET) {
    *why = "unknown link role";
    return FERRY_ERR_REMOTE;
  }
  if (!creds_.check(creds_.own(), auth::kInitiatorRole, transcript, len, proof)) {
    *why = "engine '" + peer +
           "' does not hold this engine's current descriptor (none, one of an earlier instance" +
           token_hint + ")";
    return FERRY_ERR_REMOTE;
  }
  if (registered && creds_.check(theirs, auth::kInitiatorRole, transcript, len, proof + kHalf))
    return FERRY_OK;
  if (!registered) {
    // An initiator we never registered: it holds our descriptor, which is what
    // grants access; it presents its own descriptor next (one-way registration).
    if (unknown) *unknown = true;
    return FERRY_OK;
  }
  // A key we know - registered, or learned from an earlier hello - is pinned to
  // its secret: nobody else may speak for it, not even another holder of our
  // descriptor (it could receive what we send to that engine).
  *why = "a peer claims the key of " + std::string(learned ? "learned" : "registered") +
         " engine '" + peer +
         "' but cannot prove that engine's secret (an impostor, or the engine restarted: " +
         (learned ? "deregister the old life here, or register its new descriptor"
                  : "register its new descriptor") +
         ")";
  return FERRY_ERR_REMOTE;
}

bool LinkAuth::seal_for(const std::string& peer, const std::vector<uint8_t>& transcript,
                        const std::vector<uint8_t>& plain, std::vector<uint8_t>* out) const {
  auth::InstanceSecret theirs;
  return peers_(peer, &theirs, nullptr) &&
         auth::seal(theirs, creds_.token_text(), transcript, plain, out);
}

bool LinkAuth::unseal_own(const std::vector<uint8_t>& transcript,
                          const std::vector<uint8_t>& sealed, std::vector<uint8_t>* plain) const {
  return auth::unseal(creds_.own(), creds_.token_text(), transcript, sealed, plain);
}

}  // namespace ferry
