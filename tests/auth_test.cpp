// SPDX-License-Identifier: Apache-2.0
// Authentication: access by descriptor (per-instance secrets, link_auth.h) and the
// optional cluster token, on the control plane and on the tcp data lanes. A peer
// with the target's descriptor (and the same token) moves data, also one the
// target never registered; one without it, one claiming a registered key, one
// with another token: refused with a message that says why, counted, and no
// byte of the target's memory changes.
#include "auth.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "control_plane.h"
#include "engine_impl.h"
#include "eventually.h"
#include "ferry/ferry.hpp"
#include "link_auth.h"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

constexpr size_t kBytes = 256 * 1024;

using test::eventually;

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
  EXPECT_NE(st.Message().find("did not prove the secret"), std::string::npos) << st.Message();
  EXPECT_NE(st.Message().find("a different auth token"), std::string::npos) << st.Message();
  EXPECT_EQ(std::count(p.dst.begin(), p.dst.end(), 0), static_cast<long>(kBytes))
      << "an unauthenticated peer changed memory";
}

TEST(Auth, DifferentTokensAreRefusedOnTheControlPlane) {
  Pair p("token-one-aaaaaaaaaaaa", "token-two-bbbbbbbbbbbb", "cma");
  TransferStatus st = p.write(10, p.ini->allocate_transfer_uid());
  ASSERT_TRUE(st.Failed());
  EXPECT_NE(st.Message().find("did not prove the secret"), std::string::npos) << st.Message();
  EXPECT_GE(p.ini->stats().ctrl_rejected, 1u);
  EXPECT_TRUE(eventually([&] { return p.tgt->stats().ctrl_rejected >= 1; }));
}

TEST(Auth, InitiatorWithoutTokenGetsAClearMessage) {
  {
    // tcp lanes: the token is mixed into the target's proof, which fails here.
    Pair p("", "the-targets-token-xyz");
    TransferStatus st = p.write(11, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("an auth token set there only"), std::string::npos) << st.Message();
  }
  {
    Pair p("", "the-targets-token-xyz", "cma");
    TransferStatus st = p.write(12, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("requires an auth token"), std::string::npos) << st.Message();
    EXPECT_NE(st.Message().find("FERRY_AUTH_TOKEN"), std::string::npos) << st.Message();
    EXPECT_TRUE(eventually([&] { return p.tgt->stats().ctrl_rejected >= 1; }));
  }
}

TEST(Auth, TargetWithoutTokenGetsAClearMessage) {
  {
    Pair p("the-initiators-token", "");
    TransferStatus st = p.write(13, p.ini->allocate_transfer_uid());
    ASSERT_TRUE(st.Failed());
    EXPECT_NE(st.Message().find("a different auth token"), std::string::npos) << st.Message();
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

// ---- access by descriptor ---------------------------------------------------------

// A target with memory, and what an initiator needs to write into it.
struct Target {
  explicit Target(const std::string& backend = "tcp") {
    setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
    EngineConfig c;
    c.timeout = 5s;
    eng = std::make_unique<Engine>("desc-tgt", c);
    Result r = eng->add_backend(backend);
    if (!r) throw std::runtime_error(r.message);
    mem.assign(kBytes, 0);
    desc = eng->register_memory(mem.data(), mem.size());
  }
  bool untouched() const {
    return std::count(mem.begin(), mem.end(), 0) == static_cast<long>(kBytes);
  }
  std::vector<uint8_t> mem;
  std::unique_ptr<Engine> eng;
  MemoryDesc desc;
};

struct Initiator {
  explicit Initiator(const std::string& key, const std::string& backend = "tcp",
                     const std::string& settings = {}) {
    EngineConfig c;
    c.timeout = 5s;
    eng = std::make_unique<Engine>(key, c);
    Result r = eng->add_backend(backend, settings);
    if (!r) throw std::runtime_error(r.message);
    mem.resize(kBytes);
    desc = eng->register_memory(mem.data(), mem.size());
  }
  TransferStatus write(const MemoryDesc& to, uint64_t seed, bool notify = false) {
    test::fill_pattern(mem.data(), 0, kBytes, seed);
    uid = eng->allocate_transfer_uid();
    TransferStatus st = eng->write(desc, 0, to, 0, kBytes, uid, notify);
    EXPECT_TRUE(st.WaitFor(30s));
    return st;
  }
  std::vector<uint8_t> mem;
  std::unique_ptr<Engine> eng;
  MemoryDesc desc;
  TransferUid uid = 0;  // of the last write
};

TEST(AccessByDescriptor, RegisteringAnInitiatorMidTransferDoesNotCutItsLanes) {
  // One-way registration, as vLLM's and SGLang's connectors do it: the target
  // registers (or learns, from the initiator's first control connection) the
  // initiator while that initiator's first transfer is already on the lanes.
  // Those lanes were admitted by descriptor; they check their proof again and
  // carry on, so the transfer succeeds (it failed ERR_TRANSPORT when they were cut).
  constexpr size_t kBig = 256 << 20;
  setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
  bool registered_mid_flight = false;
  for (int attempt = 0; attempt < 5 && !registered_mid_flight; ++attempt) {
    EngineConfig c;
    c.timeout = 30s;
    Engine tgt("mid-tgt", c), ini("mid-ini", c);
    ASSERT_TRUE(tgt.add_backend("tcp"));
    ASSERT_TRUE(ini.add_backend("tcp"));
    std::vector<uint8_t> dst(kBig, 0), src(kBig);
    test::fill_pattern(src.data(), 0, kBig, 41 + attempt);
    MemoryDesc d = tgt.register_memory(dst.data(), kBig), s = ini.register_memory(src.data(), kBig);
    ASSERT_TRUE(ini.register_remote_engine(tgt.desc()));
    // A first small WRITE opens the lanes (admitted by descriptor); its status
    // ending orders it before what follows, with no look at the target's memory.
    TransferStatus first = ini.write(s, 0, d, 0, 4096, ini.allocate_transfer_uid(), false);
    ASSERT_TRUE(first.WaitFor(30s));
    ASSERT_EQ(first.Code(), StatusCode::SUCCESS) << first.Message();
    TransferStatus st = ini.write(s, 0, d, 0, kBig, ini.allocate_transfer_uid(), false);
    ASSERT_TRUE(tgt.register_remote_engine(ini.desc()));
    registered_mid_flight = st.InProgress();
    ASSERT_TRUE(st.WaitFor(60s));
    ASSERT_EQ(st.Code(), StatusCode::SUCCESS) << st.Message();
    EXPECT_EQ(test::find_mismatch(dst.data(), 0, kBig, 41 + attempt, 0), -1);
  }
  EXPECT_TRUE(registered_mid_flight) << "every WRITE ended before the registration: nothing shown";
}

TEST(AccessByDescriptor, AnImpostorsLanesCloseOnceTheRealKeyIsRegistered) {
  // Lanes admitted by descriptor under an unregistered key keep serving only
  // while their proof holds: when the real engine of that key is registered at
  // the target, a holder of the target's descriptor speaking for it is cut off.
  Target t;
  Initiator impostor("desc-real", "tcp", R"({"lanes": 1})");  // its second WRITE: the same lane
  ASSERT_TRUE(impostor.eng->register_remote_engine(t.eng->desc()));
  TransferStatus first = impostor.write(t.desc, 51);
  ASSERT_TRUE(first.Succeeded()) << first.Message();  // served by descriptor
  Initiator real("desc-real");
  ASSERT_TRUE(t.eng->register_remote_engine(real.eng->desc()));
  TransferStatus second = impostor.write(t.desc, 52);  // on its open lanes
  ASSERT_TRUE(second.Failed()) << "an engine spoke for a key registered to another";
  EXPECT_NE(second.Message().find("lost"), std::string::npos) << second.Message();
  EXPECT_EQ(test::find_mismatch(t.mem.data(), 0, kBytes, 51, 0), -1) << "the refused WRITE landed";
  ASSERT_TRUE(real.eng->register_remote_engine(t.eng->desc()));
  TransferStatus ok = real.write(t.desc, 53);
  ASSERT_TRUE(ok.Succeeded()) << ok.Message();
  EXPECT_EQ(test::find_mismatch(t.mem.data(), 0, kBytes, 53, 0), -1);
}

TEST(AccessByDescriptor, AnInitiatorTheTargetNeverRegisteredIsServed) {
  // Real connectors register one way: only the target at the initiator.
  Target t;
  Initiator i("desc-ini");
  ASSERT_TRUE(i.eng->register_remote_engine(t.eng->desc()));
  TransferStatus st = i.write(t.desc, 21, /*notify=*/true);
  ASSERT_TRUE(st.Succeeded()) << st.Message();
  EXPECT_EQ(test::find_mismatch(t.mem.data(), 0, kBytes, 21, 0), -1);
  EXPECT_TRUE(t.eng->wait_inbound_transfer_status("desc-ini", i.uid, 5s).has_value());
  std::fill(i.mem.begin(), i.mem.end(), 0);
  TransferStatus rd = i.eng->read(i.desc, 0, t.desc, 0, kBytes, i.eng->allocate_transfer_uid());
  ASSERT_TRUE(rd.WaitFor(30s));
  ASSERT_TRUE(rd.Succeeded()) << rd.Message();
  EXPECT_EQ(test::find_mismatch(i.mem.data(), 0, kBytes, 21, 0), -1);
}

TEST(AccessByDescriptor, TheTargetLearnsAnInitiatorFromItsHelloAndCanReachItBack) {
  // cma notifies over the control plane: the initiator's first control
  // connection presents its descriptor, so the target - which never registered
  // it - learns it, records the notification under its key, and can itself
  // write into the initiator's memory (given a MemoryDesc out of band).
  const auto policy = std::filesystem::temp_directory_path() /
                      ("ferry-auth-cma-" + std::to_string(getpid()) + ".yaml");
  std::ofstream(policy) << "backends:\n  cma: {}\nrules:\n  - prefer: [cma]\n"
                           "    trust_descriptors: true\n";
  const char* prev = std::getenv("FERRY_POLICY");  // ctest sets one for the whole binary
  const std::string saved = prev ? prev : "";
  setenv("FERRY_POLICY", policy.c_str(), 1);
  {
    Target t("cma");
    Initiator i("desc-learned", "cma");
    ASSERT_TRUE(i.eng->register_remote_engine(t.eng->desc()));
    TransferStatus st = i.write(t.desc, 31, /*notify=*/true);
    ASSERT_TRUE(st.Succeeded()) << st.Message();
    EXPECT_TRUE(t.eng->wait_inbound_transfer_status("desc-learned", i.uid, 5s).has_value());
    // Back the other way, without any registration at the target.
    test::fill_pattern(t.mem.data(), 0, kBytes, 32);
    TransferStatus back =
        t.eng->write(t.desc, 0, i.desc, 0, kBytes, t.eng->allocate_transfer_uid(), /*notify=*/true);
    ASSERT_TRUE(back.WaitFor(30s));
    ASSERT_TRUE(back.Succeeded()) << back.Message();
    EXPECT_EQ(test::find_mismatch(i.mem.data(), 0, kBytes, 32, 0), -1);
    // The learned key is pinned to its secret: another holder of the target's
    // descriptor cannot speak for it (it would receive what the target sends).
    Initiator squatter("desc-learned", "cma");
    ASSERT_TRUE(squatter.eng->register_remote_engine(t.eng->desc()));
    TransferStatus sq = squatter.write(t.desc, 35, /*notify=*/true);
    ASSERT_TRUE(sq.Failed()) << "a second engine spoke for a learned key";
    EXPECT_NE(sq.Message().find("claims the key of learned engine 'desc-learned'"),
              std::string::npos)
        << sq.Message();
  }
  if (prev)
    setenv("FERRY_POLICY", saved.c_str(), 1);
  else
    unsetenv("FERRY_POLICY");
  std::filesystem::remove(policy);
}

TEST(AccessByDescriptor, RegisteringTheSameDescriptorAgainKeepsSessions) {
  // Connectors repeat their handshakes; a repeated registration of the same
  // descriptor must not tear the peer's sessions down.
  Target t;
  Initiator i("desc-again");
  ASSERT_TRUE(i.eng->register_remote_engine(t.eng->desc()));
  ASSERT_TRUE(t.eng->register_remote_engine(i.eng->desc()));
  auto session = i.eng->create_session(i.desc, t.desc);
  ASSERT_TRUE(session);
  test::fill_pattern(i.mem.data(), 0, kBytes, 33);
  TransferStatus a = session->write(0, 0, kBytes, i.eng->allocate_transfer_uid());
  ASSERT_EQ(a.Wait(), StatusCode::SUCCESS) << a.Message();
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(i.eng->register_remote_engine(t.eng->desc()));
    ASSERT_TRUE(t.eng->register_remote_engine(i.eng->desc()));
  }
  test::fill_pattern(i.mem.data(), 0, kBytes, 34);
  TransferStatus b = session->write(0, 0, kBytes, i.eng->allocate_transfer_uid());
  ASSERT_EQ(b.Wait(), StatusCode::SUCCESS)
      << "a re-registration killed the session: " << b.Message();
  EXPECT_EQ(test::find_mismatch(t.mem.data(), 0, kBytes, 34, 0), -1);
}

TEST(ConnectorHabits, NotifyDefaultIsAnEngineSetting) {
  // MoRIIOConnector never pops inbound statuses: it turns notification off
  // once for the engine instead of on every call.
  Target t;
  EngineConfig c;
  c.timeout = 5s;
  c.notify = false;
  Engine quiet("desc-quiet", c);
  ASSERT_TRUE(quiet.add_backend("tcp"));
  std::vector<uint8_t> src(kBytes, 0x42);
  MemoryDesc local = quiet.register_memory(src.data(), src.size());
  ASSERT_TRUE(quiet.register_remote_engine(t.eng->desc()));
  TransferUid silent = quiet.allocate_transfer_uid();
  ASSERT_EQ(quiet.write(local, 0, t.desc, 0, kBytes, silent).Wait(), StatusCode::SUCCESS);
  TransferUid asked = quiet.allocate_transfer_uid();
  ASSERT_EQ(quiet.write(local, 0, t.desc, 0, 4096, asked, /*notify=*/true).Wait(),
            StatusCode::SUCCESS);
  EXPECT_TRUE(t.eng->wait_inbound_transfer_status("desc-quiet", asked, 5s).has_value());
  EXPECT_FALSE(t.eng->pop_inbound_transfer_status("desc-quiet", silent).has_value())
      << "a transfer of an engine with notify off notified its target";
  EXPECT_EQ(t.mem[kBytes - 1], 0x42);
}

TEST(AccessByDescriptor, KnowingTheNameAndAddressIsNotEnough) {
  // Everything of the target's descriptor but its secret: what anyone who can
  // read the open source and scan the network learns.
  for (const char* backend : {"tcp", "cma"}) {
    SCOPED_TRACE(backend);
    Target t(backend);
    Initiator i("desc-guesser", backend);
    EngineDesc forged = t.eng->desc();
    ASSERT_TRUE(auth::random_bytes(forged.secret.data(), forged.secret.size()));
    ASSERT_TRUE(i.eng->register_remote_engine(forged));
    // cma moves bytes itself (no target check): the control plane's NOTIFY is
    // what must be refused; tcp lanes must refuse the WRITE itself.
    TransferStatus st = i.write(t.desc, 22, /*notify=*/true);
    ASSERT_TRUE(st.Failed()) << "a peer without the descriptor's secret was served";
    EXPECT_NE(st.Message().find("did not prove the secret"), std::string::npos) << st.Message();
    if (std::string(backend) == "tcp") {
      EXPECT_TRUE(t.untouched());
    }
    EXPECT_FALSE(t.eng->wait_inbound_transfer_status("desc-guesser", i.uid, 0ms).has_value());
  }
}

TEST(AccessByDescriptor, ClaimingARegisteredPeersKeyFails) {
  Target t;
  Initiator real("desc-victim");
  ASSERT_TRUE(t.eng->register_remote_engine(real.eng->desc()));
  ASSERT_TRUE(real.eng->register_remote_engine(t.eng->desc()));
  ASSERT_TRUE(real.write(t.desc, 23).Succeeded());
  // An impostor that holds the target's descriptor (so it passes the first
  // proof) claims the registered peer's key without that peer's secret.
  std::fill(t.mem.begin(), t.mem.end(), 0);
  Initiator impostor("desc-victim");
  ASSERT_TRUE(impostor.eng->register_remote_engine(t.eng->desc()));
  TransferStatus st = impostor.write(t.desc, 24);
  ASSERT_TRUE(st.Failed()) << "an impostor was served under a registered key";
  EXPECT_NE(st.Message().find("claims the key of registered engine 'desc-victim'"),
            std::string::npos)
      << st.Message();
  EXPECT_TRUE(t.untouched());
  // The real peer is not disturbed.
  ASSERT_TRUE(real.write(t.desc, 25).Succeeded());
}

TEST(AccessByDescriptor, ADescriptorOfAnEarlierLifeIsRefused) {
  // The target's descriptor, then the engine behind its address restarts (a
  // new instance, a new secret): the old descriptor no longer opens it.
  Target t;
  Initiator i("desc-stale");
  EngineDesc old = t.eng->desc();
  ASSERT_TRUE(i.eng->register_remote_engine(old));
  ASSERT_TRUE(i.write(t.desc, 26).Succeeded());
  EngineDesc again = old;
  ASSERT_TRUE(auth::random_bytes(again.secret.data(), again.secret.size()));
  ASSERT_TRUE(i.eng->register_remote_engine(again));  // as if registered from a stale copy
  TransferStatus st = i.write(t.desc, 27);
  ASSERT_TRUE(st.Failed());
  EXPECT_NE(st.Message().find("did not prove the secret"), std::string::npos) << st.Message();
}

TEST(AccessByDescriptor, HostLinkProofsAreBoundToTheirRoleAndPeer) {
  EngineImpl a("link-a", EngineConfig{}), b("link-b", EngineConfig{});
  ASSERT_TRUE(a.register_remote_engine(b.desc()));
  const char t[] = "transcript";
  uint8_t p[FERRY_LINK_PROOF_SIZE];
  std::string why;
  // a -> b: a proves as initiator; b (which never registered a) accepts.
  ASSERT_EQ(a.link_auth().prove("link-b", FERRY_LINK_INITIATOR, t, sizeof t, p), FERRY_OK);
  EXPECT_EQ(b.link_auth().check("link-a", FERRY_LINK_TARGET, t, sizeof t, p, &why), FERRY_OK)
      << why;
  // ... but not for another transcript, nor as the other role.
  EXPECT_EQ(b.link_auth().check("link-a", FERRY_LINK_TARGET, "other", 5, p, &why),
            FERRY_ERR_REMOTE);
  EXPECT_EQ(a.link_auth().check("link-b", FERRY_LINK_INITIATOR, t, sizeof t, p, &why),
            FERRY_ERR_REMOTE);
  // b's answer as target passes at a; a proof for an unregistered peer is refused.
  ASSERT_EQ(b.link_auth().prove("link-a", FERRY_LINK_TARGET, t, sizeof t, p), FERRY_OK);
  EXPECT_EQ(a.link_auth().check("link-b", FERRY_LINK_INITIATOR, t, sizeof t, p, &why), FERRY_OK)
      << why;
  EXPECT_EQ(b.link_auth().prove("link-a", FERRY_LINK_INITIATOR, t, sizeof t, p),
            FERRY_ERR_NOT_FOUND);
  // Once b registers a, a's second half must prove a's own secret.
  ASSERT_TRUE(b.register_remote_engine(a.desc()));
  ASSERT_EQ(a.link_auth().prove("link-b", FERRY_LINK_INITIATOR, t, sizeof t, p), FERRY_OK);
  EXPECT_EQ(b.link_auth().check("link-a", FERRY_LINK_TARGET, t, sizeof t, p, &why), FERRY_OK);
  p[FERRY_LINK_PROOF_SIZE - 1] ^= 1;
  EXPECT_EQ(b.link_auth().check("link-a", FERRY_LINK_TARGET, t, sizeof t, p, &why),
            FERRY_ERR_REMOTE);
  EXPECT_NE(why.find("claims the key"), std::string::npos) << why;
}

// ---- the control plane on its own ------------------------------------------------

// One control plane with its own credentials; `trust` registers another's secret.
struct Plane {
  Plane(const std::string& key, const std::string& token)
      : creds(token),
        link(creds, [this](const std::string& k, auth::InstanceSecret* s, bool* learned) {
          std::lock_guard lk(mu);
          auto it = known.find(k);
          if (it == known.end()) return false;
          *s = it->second;
          if (learned) *learned = false;
          return true;
        }) {
    ControlPlane::Handlers h;
    h.on_plugin = [this](const std::string& peer, const std::string&, const uint8_t* m, size_t n) {
      std::lock_guard lk(mu);
      got.push_back(peer + ":" + std::string(reinterpret_cast<const char*>(m), n));
      cv.notify_all();
    };
    h.on_notify = [](const std::string&, uint64_t, int32_t, uint64_t, const NotifySeq&) {
      return NotifyAck::TAKEN;
    };
    h.on_fence = [this](const std::string& peer, uint64_t, const std::vector<FenceEntry>& entries,
                        uint64_t* instance) { return fence(peer, entries, instance); };
    cp = std::make_unique<ControlPlane>(key, "127.0.0.1", 0, std::move(h), &link);
  }
  void trust(const std::string& key, const Plane& other) {
    std::lock_guard lk(mu);
    known[key] = other.creds.own();
  }
  bool wait_for(size_t n) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, 10s, [&] { return got.size() >= n; });
  }
  int send(Plane& to, const std::string& to_key, const std::string& text, std::string* err) {
    return cp->send(to_key, "127.0.0.1", to.cp->port(), CtrlType::PLUGIN,
                    plugin_body("x", text.data(), text.size()), err);
  }
  auth::Credentials creds;
  std::mutex mu;
  std::map<std::string, auth::InstanceSecret> known;
  LinkAuth link;
  std::condition_variable cv;
  std::vector<std::string> got;
  // FENCE served here (set before one can arrive; runs on the fence thread).
  std::function<std::vector<FenceResult>(const std::string&, const std::vector<FenceEntry>&,
                                         uint64_t*)>
      fence = [](const std::string&, const std::vector<FenceEntry>& e, uint64_t*) {
        return std::vector<FenceResult>(e.size());
      };
  std::unique_ptr<ControlPlane> cp;
};

TEST(AuthControlPlane, MutualProofThenFrames) {
  Plane a("a", "tok"), b("b", "tok");
  a.trust("b", b);
  b.trust("a", a);
  std::string err;
  ASSERT_EQ(a.send(b, "b", "hi", &err), FERRY_OK) << err;
  ASSERT_EQ(a.send(b, "b", "again", &err), FERRY_OK) << err;
  ASSERT_TRUE(b.wait_for(2));
  EXPECT_EQ(b.got[0], "a:hi");
  EXPECT_EQ(b.got[1], "a:again");
  EXPECT_EQ(a.cp->rejected() + b.cp->rejected(), 0u);
}

TEST(AuthControlPlane, ServerThatCannotProveIsNotTrusted) {
  // The client checks the server's proof before it sends anything: NOT_SENT.
  Plane a("a", "tok"), b("b", "tok"), c("c", "tok");
  a.trust("b", c);  // a holds a descriptor for "b" whose secret b does not have
  std::string err;
  EXPECT_EQ(a.send(b, "b", "secret data", &err), FERRY_ERR_NOT_SENT);
  EXPECT_NE(err.find("did not prove the secret"), std::string::npos) << err;
  EXPECT_EQ(a.cp->rejected(), 1u);
  std::lock_guard lk(b.mu);
  EXPECT_TRUE(b.got.empty());
}

TEST(AuthControlPlane, PeerDialingTheWrongKeyFails) {
  // The proofs bind both keys: b's answer for the pair (c, b) does not pass
  // for (c, not-b), even though c holds a secret under that name.
  Plane b("b", "tok"), c("c", "tok");
  c.trust("b", b);
  c.trust("not-b", b);
  std::string err;
  ASSERT_EQ(c.send(b, "b", "ok", &err), FERRY_OK) << err;
  EXPECT_EQ(c.send(b, "not-b", "x", &err), FERRY_ERR_NOT_SENT);
  EXPECT_NE(err.find("did not prove"), std::string::npos) << err;
}

// A FENCE whose sender gave up waiting (its request timed out, it closed the
// connection) before the target's fence thread got to it is not applied: the
// sender counts it unanswered, and applied late it could retire lanes made since.
TEST(AuthControlPlane, AFenceItsSenderGaveUpOnIsNotApplied) {
  Plane a("a", "tok"), b("b", "tok");
  a.trust("b", b);
  b.trust("a", a);
  std::mutex m;
  std::condition_variable cv;
  std::vector<uint64_t> applied;
  bool release = false;
  b.fence = [&](const std::string&, const std::vector<FenceEntry>& e, uint64_t* instance) {
    std::unique_lock lk(m);
    applied.push_back(e.at(0).attempt);
    cv.notify_all();
    // The first one holds b's fence thread (it serves one FENCE at a time).
    if (e.at(0).attempt == 1) cv.wait(lk, [&] { return release; });
    *instance = 7;
    return std::vector<FenceResult>{{e.at(0).attempt, FenceState::NONE, 0}};
  };
  auto ask = [&](uint64_t attempt, std::chrono::milliseconds wait, CtrlFrame* reply) {
    std::string err;
    const std::vector<FenceEntry> entries{{"tcp", attempt}};
    return a.cp->request("b", "127.0.0.1", b.cp->port(), CtrlType::FENCE,
                         fence_body(attempt, 7, entries), CtrlType::FENCE_REPLY,
                         ControlPlane::Clock::now() + wait, reply, &err);
  };
  CtrlFrame r1, r2, r3;
  int rc1 = -1;
  std::thread first([&] { rc1 = ask(1, 20s, &r1); });
  {
    std::unique_lock lk(m);
    ASSERT_TRUE(cv.wait_for(lk, 10s, [&] { return !applied.empty(); }));
  }
  // Queued behind the first: its sender waits 300 ms, then closes.
  EXPECT_EQ(ask(2, 300ms, &r2), FERRY_ERR_TIMEOUT);
  {
    std::lock_guard lk(m);
    release = true;
    cv.notify_all();
  }
  first.join();
  EXPECT_EQ(rc1, FERRY_OK);
  // Served after the second (one fence thread): once it is answered, the
  // second has been dealt with.
  EXPECT_EQ(ask(3, 20s, &r3), FERRY_OK);
  std::lock_guard lk(m);
  EXPECT_EQ(applied, (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(b.cp->abandoned_fences(), 1u);
}

}  // namespace
