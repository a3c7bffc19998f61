// SPDX-License-Identifier: Apache-2.0
// What an engine proves on its connections, and the HMAC-SHA256 primitives.
//
// Access is by descriptor (docs/security.md): every engine instance has a random
// secret of kInstanceSecretSize bytes that travels only inside its EngineDesc.
// A connection proves knowledge of the target's secret (so a peer that never
// received the descriptor cannot reach the engine) and the initiator's own
// (so nobody can claim the key of an engine the target registered). An optional
// cluster-wide token (EngineConfig::auth_token) is mixed into every proof key.
//
// Everything cryptographic comes from OpenSSL's libcrypto (HMAC, RAND_bytes,
// CRYPTO_memcmp); nothing here is hand-rolled. No secret leaves this process:
// peers exchange random challenges and MACs over them.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::auth {

constexpr size_t kMacSize = 32;    // HMAC-SHA256
constexpr size_t kNonceSize = 32;  // per-connection challenge
using Mac = std::array<uint8_t, kMacSize>;
using Nonce = std::array<uint8_t, kNonceSize>;

// HMAC-SHA256(key, data). False only if libcrypto fails.
bool hmac_sha256(std::string_view key, const void* data, size_t len, uint8_t out[kMacSize]);
// Constant-time comparison of two MACs.
bool mac_equal(const uint8_t a[kMacSize], const uint8_t b[kMacSize]);
// Cryptographically random bytes (RAND_bytes). False if the generator fails.
bool random_bytes(uint8_t* out, size_t n);

// The secret in force: EngineConfig::auth_token, else FERRY_AUTH_TOKEN, else none.
// Wipes itself on destruction.
class Secret {
 public:
  explicit Secret(std::string token) : token_(std::move(token)) {}
  ~Secret();
  Secret(const Secret&) = delete;
  Secret& operator=(const Secret&) = delete;

  bool enabled() const { return !token_.empty(); }
  bool sign(const void* data, size_t len, uint8_t out[kMacSize]) const;
  // Constant-time; false when disabled.
  bool verify(const void* data, size_t len, const uint8_t mac[kMacSize]) const;

 private:
  std::string token_;
};

constexpr size_t kInstanceSecretSize = 32;  // 256 bits, from RAND_bytes
using InstanceSecret = std::vector<uint8_t>;

// HMAC-SHA256 keyed by an instance secret followed by the token, over the
// prover's role (kTargetRole / kInitiatorRole) and the data: the MAC that proves
// knowledge of the descriptor carrying `secret`, and cannot be reflected back
// as the other role's. False for a secret of the wrong size.
constexpr char kTargetRole = 'T';
constexpr char kInitiatorRole = 'I';
bool link_mac(const InstanceSecret& secret, std::string_view token, char role, const void* data,
              size_t len, uint8_t out[kMacSize]);

// Authenticated encryption (ChaCha20-Poly1305) of `plain` under a key derived
// from `secret` (+ token) and a connection's transcript, so only the engine
// holding that secret reads it: out = 12-byte nonce | ciphertext | 16-byte tag.
bool seal(const InstanceSecret& secret, std::string_view token,
          const std::vector<uint8_t>& transcript, const std::vector<uint8_t>& plain,
          std::vector<uint8_t>* out);
// The reverse; false when the tag does not verify (wrong key, tampered bytes).
bool unseal(const InstanceSecret& secret, std::string_view token,
            const std::vector<uint8_t>& transcript, const std::vector<uint8_t>& sealed,
            std::vector<uint8_t>* plain);

// This engine's credentials: its instance secret and the cluster token. A proof
// "for" an engine is HMAC-SHA256 keyed by that engine's instance secret followed
// by the token, over a transcript that binds it to one connection.
class Credentials {
 public:
  // Draws a fresh instance secret; throws ferry::Error if RAND_bytes fails.
  explicit Credentials(std::string token);
  ~Credentials();
  Credentials(const Credentials&) = delete;
  Credentials& operator=(const Credentials&) = delete;

  const InstanceSecret& own() const { return own_; }
  bool has_token() const { return token_.enabled(); }
  const Secret& token() const { return token_; }  // ABI 1.1 auth_sign / auth_verify

  // The MAC for the engine whose descriptor carries `secret` (ours: own()).
  bool prove(const InstanceSecret& secret, char role, const void* data, size_t len,
             uint8_t out[kMacSize]) const;
  // Constant-time; false for a secret of the wrong size.
  bool check(const InstanceSecret& secret, char role, const void* data, size_t len,
             const uint8_t mac[kMacSize]) const;
  const std::string& token_text() const { return token_text_; }

 private:
  InstanceSecret own_;
  Secret token_;
  std::string token_text_;
};

// What the control plane's HELLO handshake MACs: a direction label, both
// nonces and both engine keys, so a proof is good for one connection, one
// direction and one pair of engines only.
std::vector<uint8_t> ctrl_transcript(std::string_view label, const Nonce& client_nonce,
                                     const Nonce& server_nonce, std::string_view client_key,
                                     std::string_view server_key);

}  // namespace ferry::auth
