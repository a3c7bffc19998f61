// SPDX-License-Identifier: Apache-2.0
#include "auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <cstring>
#include <stdexcept>

#include "ferry/ferry.hpp"

namespace ferry::auth {

bool hmac_sha256(std::string_view key, const void* data, size_t len, uint8_t out[kMacSize]) {
  if (key.empty() || key.size() > INT_MAX || (!data && len)) return false;
  static const uint8_t kEmpty = 0;
  unsigned int out_len = 0;
  const unsigned char* r =
      HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           data ? static_cast<const unsigned char*>(data) : &kEmpty, len, out, &out_len);
  return r != nullptr && out_len == kMacSize;
}

bool mac_equal(const uint8_t a[kMacSize], const uint8_t b[kMacSize]) {
  return CRYPTO_memcmp(a, b, kMacSize) == 0;
}

bool random_bytes(uint8_t* out, size_t n) {
  return n <= INT_MAX && RAND_bytes(out, static_cast<int>(n)) == 1;
}

Secret::~Secret() {
  if (!token_.empty()) OPENSSL_cleanse(token_.data(), token_.size());
}

bool Secret::sign(const void* data, size_t len, uint8_t out[kMacSize]) const {
  return enabled() && hmac_sha256(token_, data, len, out);
}

bool Secret::verify(const void* data, size_t len, const uint8_t mac[kMacSize]) const {
  uint8_t want[kMacSize];
  bool ok = sign(data, len, want) && mac_equal(want, mac);
  OPENSSL_cleanse(want, sizeof want);
  return ok;
}

Credentials::Credentials(std::string token)
    : own_(kInstanceSecretSize), token_(token), token_text_(std::move(token)) {
  if (!random_bytes(own_.data(), own_.size()))
    throw Error(StatusCode::ERR_BAD_STATE, "no random bytes for the engine's instance secret");
}

Credentials::~Credentials() {
  OPENSSL_cleanse(own_.data(), own_.size());
  if (!token_text_.empty()) OPENSSL_cleanse(token_text_.data(), token_text_.size());
}

bool link_mac(const InstanceSecret& secret, std::string_view token, char role, const void* data,
              size_t len, uint8_t out[kMacSize]) {
  if (secret.size() != kInstanceSecretSize || (!data && len)) return false;
  std::string key(reinterpret_cast<const char*>(secret.data()), secret.size());
  key += token;
  std::vector<uint8_t> msg(1 + len);
  msg[0] = static_cast<uint8_t>(role);
  if (len) std::memcpy(msg.data() + 1, data, len);
  bool ok = hmac_sha256(key, msg.data(), msg.size(), out);
  OPENSSL_cleanse(key.data(), key.size());
  return ok;
}

bool Credentials::prove(const InstanceSecret& secret, char role, const void* data, size_t len,
                        uint8_t out[kMacSize]) const {
  return link_mac(secret, token_text_, role, data, len, out);
}

bool Credentials::check(const InstanceSecret& secret, char role, const void* data, size_t len,
                        const uint8_t mac[kMacSize]) const {
  uint8_t want[kMacSize];
  bool ok = prove(secret, role, data, len, want) && mac_equal(want, mac);
  OPENSSL_cleanse(want, sizeof want);
  return ok;
}

namespace {
constexpr size_t kSealNonce = 12, kSealTag = 16;

// The sealing key: HMAC(secret | token, "ferry-seal-v1" | transcript).
bool seal_key(const InstanceSecret& secret, std::string_view token,
              const std::vector<uint8_t>& transcript, uint8_t key[kMacSize]) {
  static const char kLabel[] = "ferry-seal-v1";
  std::vector<uint8_t> msg(kLabel, kLabel + sizeof kLabel - 1);
  msg.insert(msg.end(), transcript.begin(), transcript.end());
  return link_mac(secret, token, kInitiatorRole, msg.data(), msg.size(), key);
}

// One ChaCha20-Poly1305 pass; `encrypt` picks the direction.
bool aead(bool encrypt, const uint8_t key[kMacSize], const uint8_t nonce[kSealNonce],
          const uint8_t* in, size_t n, uint8_t* out, uint8_t tag[kSealTag]) {
  if (n > INT_MAX) return false;
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (!ctx) return false;
  int len = 0;
  bool ok = EVP_CipherInit_ex(ctx, EVP_chacha20_poly1305(), nullptr, nullptr, nullptr,
                              encrypt ? 1 : 0) == 1 &&
            EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_IVLEN, kSealNonce, nullptr) == 1 &&
            EVP_CipherInit_ex(ctx, nullptr, nullptr, key, nonce, encrypt ? 1 : 0) == 1;
  if (ok && !encrypt) ok = EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_SET_TAG, kSealTag, tag) == 1;
  if (ok && n > 0) ok = EVP_CipherUpdate(ctx, out, &len, in, static_cast<int>(n)) == 1;
  if (ok) ok = EVP_CipherFinal_ex(ctx, out + len, &len) == 1;
  if (ok && encrypt) ok = EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_AEAD_GET_TAG, kSealTag, tag) == 1;
  EVP_CIPHER_CTX_free(ctx);
  return ok;
}
}  // namespace

bool seal(const InstanceSecret& secret, std::string_view token,
          const std::vector<uint8_t>& transcript, const std::vector<uint8_t>& plain,
          std::vector<uint8_t>* out) {
  uint8_t key[kMacSize];
  if (!seal_key(secret, token, transcript, key)) return false;
  out->assign(kSealNonce + plain.size() + kSealTag, 0);
  bool ok = random_bytes(out->data(), kSealNonce) &&
            aead(true, key, out->data(), plain.data(), plain.size(), out->data() + kSealNonce,
                 out->data() + kSealNonce + plain.size());
  OPENSSL_cleanse(key, sizeof key);
  return ok;
}

bool unseal(const InstanceSecret& secret, std::string_view token,
            const std::vector<uint8_t>& transcript, const std::vector<uint8_t>& sealed,
            std::vector<uint8_t>* plain) {
  if (sealed.size() < kSealNonce + kSealTag) return false;
  uint8_t key[kMacSize];
  if (!seal_key(secret, token, transcript, key)) return false;
  const size_t n = sealed.size() - kSealNonce - kSealTag;
  plain->assign(n, 0);
  uint8_t tag[kSealTag];
  std::memcpy(tag, sealed.data() + kSealNonce + n, kSealTag);
  bool ok = aead(false, key, sealed.data(), sealed.data() + kSealNonce, n, plain->data(), tag);
  OPENSSL_cleanse(key, sizeof key);
  if (!ok) plain->clear();
  return ok;
}

std::vector<uint8_t> ctrl_transcript(std::string_view label, const Nonce& client_nonce,
                                     const Nonce& server_nonce, std::string_view client_key,
                                     std::string_view server_key) {
  std::vector<uint8_t> t;
  auto put = [&](const void* p, size_t n) {
    auto* c = static_cast<const uint8_t*>(p);
    t.insert(t.end(), c, c + n);
  };
  auto put_str = [&](std::string_view s) {  // length-prefixed, so fields cannot run together
    uint8_t n = static_cast<uint8_t>(s.size() > 255 ? 255 : s.size());
    t.push_back(n);  // not put(&n, 1): g++ 12 at -O3 warns (-Wstringop-overflow) on that insert
    put(s.data(), n);
  };
  put_str(label);
  put(client_nonce.data(), client_nonce.size());
  put(server_nonce.data(), server_nonce.size());
  put_str(client_key);
  put_str(server_key);
  return t;
}

}  // namespace ferry::auth
