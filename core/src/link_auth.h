// SPDX-License-Identifier: Apache-2.0
// Access by descriptor: what each side of a connection between two engines
// proves, for the control plane and for plugins (host link_prove / link_check,
// ABI 1.4). A proof is two HMACs over one connection's transcript:
//   initiator: MAC for the target's secret | MAC for its own secret
//   target:    MAC for its own secret      | zeros
// (auth::link_mac: the cluster token is mixed into each key, the prover's role
// into each message, so a proof cannot be reflected as the other side's). The
// target checks the first half always, the second when it registered the
// initiator's key; the initiator checks the target's first half against the
// descriptor registered for it.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "auth.h"
#include "ferry/plugin.h"

namespace ferry {

class LinkAuth {
 public:
  static constexpr size_t kProofSize = FERRY_LINK_PROOF_SIZE;
  // The secret of the descriptor known under a key, and whether it was learned
  // from a hello (one-way registration) rather than registered; false: none.
  using PeerSecrets =
      std::function<bool(const std::string& key, auth::InstanceSecret* secret, bool* learned)>;

  LinkAuth(const auth::Credentials& creds, PeerSecrets peers)
      : creds_(creds), peers_(std::move(peers)) {}

  const auth::Credentials& credentials() const { return creds_; }
  bool has_token() const { return creds_.has_token(); }

  // FERRY_OK, FERRY_ERR_NOT_FOUND (initiator: the target is not registered),
  // FERRY_ERR_INVALID_ARGS (unknown role) or FERRY_ERR_INTERNAL (libcrypto).
  int prove(const std::string& peer, uint32_t role, const void* transcript, size_t len,
            uint8_t proof[kProofSize]) const;
  // FERRY_OK, or FERRY_ERR_REMOTE / FERRY_ERR_NOT_FOUND with *why in words.
  // As target, *unknown (may be null) is set when the initiator passed without
  // being known here (neither registered nor learned): it presents its
  // descriptor next. A known key must prove its own secret.
  int check(const std::string& peer, uint32_t role, const void* transcript, size_t len,
            const uint8_t proof[kProofSize], std::string* why, bool* unknown = nullptr) const;
  // A message only the registered peer `peer` can read (auth::seal under its
  // secret and this connection's transcript); false when it is not known.
  bool seal_for(const std::string& peer, const std::vector<uint8_t>& transcript,
                const std::vector<uint8_t>& plain, std::vector<uint8_t>* out) const;
  // Opens a message sealed for this engine; false when it does not verify.
  bool unseal_own(const std::vector<uint8_t>& transcript, const std::vector<uint8_t>& sealed,
                  std::vector<uint8_t>* plain) const;

 private:
  const auth::Credentials& creds_;
  const PeerSecrets peers_;
};

}  // namespace ferry
