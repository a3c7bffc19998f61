// The engine's shared secret and the HMAC-SHA256 primitives that prove it.
//
// Everything cryptographic comes from OpenSSL's libcrypto (HMAC, RAND_bytes,
// CRYPTO_memcmp); nothing here is hand-rolled. The secret never leaves this
// process: peers exchange random challenges and MACs over them.
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

// What the control plane's HELLO handshake MACs: a direction label, both
// nonces and both engine keys, so a proof is good for one connection, one
// direction and one pair of engines only.
std::vector<uint8_t> ctrl_transcript(std::string_view label, const Nonce& client_nonce,
                                     const Nonce& server_nonce, std::string_view client_key,
                                     std::string_view server_key);

}  // namespace ferry::auth
