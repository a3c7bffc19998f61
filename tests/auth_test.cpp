// Authentication: the HMAC-SHA256 challenge/response of the control plane and of
// the tcp data lanes. Same token: transfers work. Different token, or a token on
// one side only: the connection is refused with a message that says why, the
// refusal is counted, and no byte of the target's memory changes.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "auth.h"
#include "control_plane.h"
#include "engine_impl.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kBytes = 256 * 1024;

// A condition that another thread makes true, checked until a deadline.
bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds limit = 10s) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (!cond()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// Two engines in this process, registered both ways, one backend each.
struct Pair {
  Pair(const std::string& ini_token, const std::string& tgt_token,
       const std::string& backend = "tcp") {
    setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
    EngineConfig a, b;
    a.auth_token = ini_token;
    b.auth_token = tgt_token;
    a.timeout = b.timeout = 5s;
    ini = std::make_unique<Engine>("auth-ini", a);
    tgt = std::make_unique<Engine>("auth-tgt", b);
    for (Engine* e : {ini.get(), tgt.get()}) {
      Result r = e->add_backend(backend);
      if (!r) throw std::runtime_error(r.message);
    }
    ini->register_remote_engine(tgt->desc());
    tgt->register_remote_engine(ini->desc());
    src.resize(kBytes);
    dst.resize(kBytes);
    lmem = ini->register_memory(src.data(), src.size());
    rmem = tgt->register_memory(dst.data(), dst.size());
  }

  TransferStatus write(uint64_t seed, TransferUid uid) {
    test::fill_pattern(src.data(), 0, kBytes, seed);
    TransferStatus st = ini->write(lmem, 0, rmem, 0, kBytes, uid);
    EXPECT_TRUE(st.WaitFor(30s));
    return st;
  }

  std::vector<uint8_t> src, dst;  // before the engines: it outlives their threads
  std::unique_ptr<Engine> ini, tgt;
  MemoryDesc lmem, rmem;
};

TEST(Auth, SameTokenMovesDataOverTcp) {
  Pair p("s3cret-token-0123456789", "s3cret-token-0123456789");
  TransferUid uid = p.ini->allocate_transfer_uid();
  TransferStatus st = p.write(7, uid);
  ASSERT_TRUE(st.Succeeded()) << st.Message();
  EXPECT_EQ(test::find_mismatch(p.dst.data(), 0, kBytes, 7, 0), -1);
  EXPECT_TRUE(p.tgt->wait_inbound_transfer_status("auth-ini", uid, 5s).has_value());
  std::fill(p.src.begin(), p.src.end(), 0);
  TransferStatus rd = p.ini->read(p.lmem, 0, p.rmem, 0, kBytes, p.ini->allocate_transfer_uid());
  ASSERT_TRUE(rd.WaitFor(30s));
  ASSERT_TRUE(rd.Succeeded()) << rd.Message();
  EXPECT_EQ(test::find_mismatch(p.src.data(), 0, kBytes, 7, 0), -1);
  EXPECT_EQ(p.ini->stats().ctrl_rejected, 0u);
  EXPECT_EQ(p.tgt->stats().ctrl_rejected, 0u);
}

TEST(Auth, SameTokenNotifiesOverTheControlPlane) {
  // cma has no native notification: the core sends NOTIFY on the control plane.
  Pair p("another-shared-secret", "another-shared-secret", "cma");
  TransferUid uid = p.ini->allocate_transfer_uid();
  TransferStatus st = p.write(8, uid);
  ASSERT_TRUE(st.Succeeded()) << st.Message();
  EXPECT_TRUE(p.tgt->wait_inbound_transfer_status("auth-ini", uid, 5s).has_value());
  EXPECT_EQ(p.tgt->stats().ctrl_rejected, 0u);
}

TEST(Auth, DifferentTokensAreRefusedOnTheDataLane) {
  Pair p("token-one-aaaaaaaaaaaa", "token-two-bbbbbbbbbbbb");
  TransferStatus st = p.write(9, p.ini->allocate_transfer_uid());
  ASSERT_TRUE(st.Failed());
  EXPECT_NE(st.Message().find("failed to prove the auth token"), std::string::npos)
      << st.Message();
  EXPECT_EQ(std::count(p.dst.begin(), p.dst.end(), 0), static_cast<long>(kBytes))
      << "an unauthenticated peer changed memory";
}

TEST(Auth, DifferentTokensAreRefusedOnTheControlPlane) {
  Pair p("token-one-aaaaaaaaaaaa", "token-two-bbbbbbbbbbbb", "cma");
  TransferStatus st = p.write(10, p.ini->allocate_transfer_uid());
  ASSERT_TRUE(st.Failed());
  EXPECT_NE(st.Message().find("failed to prove the auth token"), std::string::npos)
      << st.Message();
  EXPECT_GE(p.ini->stats().ctrl_rejected, 1u);
  EXPECT_TRUE(eventually([&] { return p.tgt->stats().ctrl_rejected >= 1; }));
}

TEST(Auth, InitiatorWithoutTokenGetsAClearMessage) {
  {
    Pair p("", "the-targets-token-xyz");
    TransferStatus st = p.write(11, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("requires authentication"), std::string::npos) << st.Message();
    EXPECT_NE(st.Message().find("FERRY_AUTH_TOKEN"), std::string::npos) << st.Message();
  }
  {
    Pair p("", "the-targets-token-xyz", "cma");
    TransferStatus st = p.write(12, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("requires authentication"), std::string::npos) << st.Message();
    EXPECT_TRUE(eventually([&] { return p.tgt->stats().ctrl_rejected >= 1; }));
  }
}

TEST(Auth, TargetWithoutTokenGetsAClearMessage) {
  {
    Pair p("the-initiators-token", "");
    TransferStatus st = p.write(13, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("uses an auth token but engine 'auth-tgt' has none"),
              std::string::npos)
        << st.Message();
  }
  {
    Pair p("the-initiators-token", "", "cma");
    TransferStatus st = p.write(14, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("has none"), std::string::npos) << st.Message();
  }
}

TEST(Auth, TokenFromTheEnvironment) {
  setenv("FERRY_AUTH_TOKEN", "from-the-environment-42", 1);
  {
    Pair p("", "");  // both take the environment's token
    TransferStatus st = p.write(15, p.ini->allocate_transfer_uid());
    EXPECT_TRUE(st.Succeeded()) << st.Message();
  }
  {
    Pair p("", "a-different-config-token");  // the config wins over the environment
    TransferStatus st = p.write(16, p.ini->allocate_transfer_uid());
    EXPECT_TRUE(st.Failed());
  }
  unsetenv("FERRY_AUTH_TOKEN");
}

TEST(Auth, HostServicesSignAndVerify) {
  EngineImpl with("auth-host-a", [] {
    EngineConfig c;
    c.auth_token = "k";
    return c;
  }());
  EngineImpl without("auth-host-b", EngineConfig{});
  const char msg[] = "challenge";
  uint8_t mac[32];
  EXPECT_EQ(without.auth_sign(msg, sizeof msg, mac), FERRY_ERR_UNSUPPORTED);
  EXPECT_EQ(without.auth_verify(msg, sizeof msg, mac), FERRY_ERR_UNSUPPORTED);
  ASSERT_EQ(with.auth_sign(msg, sizeof msg, mac), FERRY_OK);
  EXPECT_EQ(with.auth_verify(msg, sizeof msg, mac), FERRY_OK);
  mac[31] ^= 1;
  EXPECT_EQ(with.auth_verify(msg, sizeof msg, mac), FERRY_ERR_REMOTE);
  // RFC 4231 test case 2: the primitive is HMAC-SHA256 itself.
  const std::string data = "what do ya want for nothing?";
  uint8_t out[32];
  ASSERT_TRUE(auth::hmac_sha256("Jefe", data.data(), data.size(), out));
  const uint8_t want[32] = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
                            0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
                            0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  EXPECT_TRUE(auth::mac_equal(out, want));
}

// ---- the control plane on its own ------------------------------------------------

struct Plane {
  Plane(const std::string& key, const std::string& token, std::vector<std::string> known)
      : secret(token) {
    ControlPlane::Handlers h;
    h.is_known_peer = [known](const std::string& k) {
      return std::find(known.begin(), known.end(), k) != known.end();
    };
    h.on_plugin = [this](const std::string& peer, const std::string&, const uint8_t* m, size_t n) {
      std::lock_guard lk(mu);
      got.push_back(peer + ":" + std::string(reinterpret_cast<const char*>(m), n));
      cv.notify_all();
    };
    h.on_notify = [](const std::string&, uint64_t, int32_t) {};
    cp = std::make_unique<ControlPlane>(key, "127.0.0.1", 0, std::move(h), &secret);
  }
  bool wait_for(size_t n) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, 10s, [&] { return got.size() >= n; });
  }
  int send(Plane& to, const std::string& to_key, const std::string& text, std::string* err) {
    return cp->send(to_key, "127.0.0.1", to.cp->port(), CtrlType::PLUGIN,
                    plugin_body("x", text.data(), text.size()), err);
  }
  auth::Secret secret;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> got;
  std::unique_ptr<ControlPlane> cp;
};

TEST(AuthControlPlane, MutualProofThenFrames) {
  Plane a("a", "tok", {"b"}), b("b", "tok", {"a"});
  std::string err;
  ASSERT_EQ(a.send(b, "b", "hi", &err), FERRY_OK) << err;
  ASSERT_EQ(a.send(b, "b", "again", &err), FERRY_OK) << err;
  ASSERT_TRUE(b.wait_for(2));
  EXPECT_EQ(b.got[0], "a:hi");
  EXPECT_EQ(b.got[1], "a:again");
  EXPECT_EQ(a.cp->rejected() + b.cp->rejected(), 0u);
}

TEST(AuthControlPlane, ServerThatCannotProveIsNotTrusted) {
  // The client checks the server's MAC before it sends anything: NOT_SENT.
  Plane a("a", "tok", {"b"}), b("b", "other", {"a"});
  std::string err;
  EXPECT_EQ(a.send(b, "b", "secret data", &err), FERRY_ERR_NOT_SENT);
  EXPECT_NE(err.find("failed to prove the auth token"), std::string::npos) << err;
  EXPECT_EQ(a.cp->rejected(), 1u);
  EXPECT_TRUE(eventually([&] { return b.cp->rejected() == 1; }));
  std::lock_guard lk(b.mu);
  EXPECT_TRUE(b.got.empty());
}

TEST(AuthControlPlane, PeerClaimingAnotherKeyFails) {
  // "c" knows the token only for its own name: the MAC binds both keys, so a
  // proof made for the pair (c, b) does not pass for (a, b).
  Plane b("b", "tok", {"a", "c"}), c("c", "tok", {"b"});
  std::string err;
  // c connects to b correctly ...
  ASSERT_EQ(c.send(b, "b", "ok", &err), FERRY_OK) << err;
  // ... but dialing b while b is expected to be someone else fails on c's side.
  EXPECT_EQ(c.send(b, "not-b", "x", &err), FERRY_ERR_NOT_SENT);
  EXPECT_NE(err.find("failed to prove"), std::string::npos) << err;
}

}  // namespace
