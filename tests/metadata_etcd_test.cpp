// SPDX-License-Identifier: Apache-2.0
// The metadata store (issue 21) against a real etcd on 127.0.0.1 (Debian's
// etcd-server, started and stopped here): publish / fetch / watch, a peer
// killed with SIGKILL deregistered within lease + 1 s and its restarted
// instance picked up, and etcd down: clear errors while engines that know
// each other keep transferring.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sstream>
#include <stdexcept>
#include <thread>

#include "child_process.h"
#include "etcd_client.h"
#include "etcd_server.h"
#include "ferry/ferry.hpp"
#include "loopback.h"
#include "metadata_sync.h"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr size_t kRegion = 1u << 20;

// An endpoint that is frozen (a SIGSTOPped etcd member, a hung host): the
// kernel completes the TCP handshake on its listening socket, and nothing
// ever reads the request or answers.
class FrozenEndpoint {
 public:
  FrozenEndpoint() {
    uint16_t port = 0;
    fd_ = test::listen_loopback(&port);
    if (fd_ < 0) throw std::runtime_error("cannot listen on 127.0.0.1");
    url_ = "http://127.0.0.1:" + std::to_string(port);
  }
  ~FrozenEndpoint() { ::close(fd_); }
  const std::string& url() const { return url_; }

 private:
  int fd_ = -1;
  std::string url_;
};

class MetadataEtcd : public ::testing::Test {
 protected:
  void SetUp() override {
    if (test::etcd_binary().empty()) {
      if (test::tool_required("FERRY_REQUIRE_ETCD"))
        FAIL() << "etcd is not installed (apt-get install etcd-server); FERRY_ALLOW_SKIP=etcd "
                  "allows skipping";
      GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server)";
    }
    etcd = std::make_unique<test::EtcdServer>();
    wait_ready();
    // A namespace per test: nothing seen here was left by another.
    ns = std::string("t-") + ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }

  // The store serves requests (it listens a moment before it has a leader).
  void wait_ready() {
    etcd::Client c({etcd->endpoint()}, 1s);
    const auto deadline = Clock::now() + 20s;
    std::optional<etcd::KeyValue> kv;
    while (!c.get("ready?", kv).ok()) {
      ASSERT_LT(Clock::now(), deadline) << "etcd at " << etcd->endpoint() << " never served";
      std::this_thread::sleep_for(20ms);  // polling a condition with a deadline
    }
  }

  EngineConfig config(std::chrono::milliseconds lease = 2s) {
    EngineConfig c;
    c.timeout = 5s;
    c.metadata.etcd = {etcd->endpoint()};
    c.metadata.ns = ns;
    c.metadata.lease = lease;
    return c;
  }

  std::unique_ptr<Engine> engine(const std::string& key, std::chrono::milliseconds lease = 2s) {
    auto e = std::make_unique<Engine>(key, config(lease));
    EXPECT_TRUE(e->add_backend("tcp").ok());
    return e;
  }

  std::unique_ptr<test::EtcdServer> etcd;
  std::string ns;
};

// Polls `done` until it holds or `deadline` passes.
template <class F>
bool eventually(Clock::time_point deadline, F done) {
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);  // polling a condition with a deadline
  }
  return true;
}

TEST_F(MetadataEtcd, PublishFetchTransferAndFollow) {
  auto target = engine("target");
  auto ini = engine("initiator");
  std::vector<uint8_t> dst(kRegion, 0), src(kRegion);
  test::fill_pattern(src.data(), 0, src.size(), 7);
  MemoryDesc tm = target->register_memory(dst.data(), dst.size());
  MemoryDesc im = ini->register_memory(src.data(), src.size());
  ASSERT_TRUE(target->publish_memory("kv", tm).ok());

  // Absent keys: a clear NOT_FOUND, after the wait.
  Result r = ini->fetch_remote_engine("nobody", 50ms);
  EXPECT_EQ(r.code, StatusCode::ERR_NOT_FOUND) << r.message;
  Result why;
  EXPECT_FALSE(ini->fetch_memory("target", "nothing", 0ms, &why));
  EXPECT_EQ(why.code, StatusCode::ERR_NOT_FOUND);

  ASSERT_TRUE(ini->fetch_remote_engine("target", 5s).ok());
  auto fetched = ini->fetch_memory("target", "kv", 5s, &why);
  ASSERT_TRUE(fetched) << why.message;
  EXPECT_EQ(*fetched, tm);
  TransferStatus s = ini->write(im, 0, *fetched, 0, kRegion, ini->allocate_transfer_uid());
  ASSERT_EQ(s.Wait(), StatusCode::SUCCESS) << s.Message();
  EXPECT_EQ(dst, src);

  // The target closes: it revokes its lease, and the initiator deregisters it.
  const uint64_t old_instance = target->desc().instance;
  target.reset();
  Result gone;
  ASSERT_TRUE(eventually(Clock::now() + 3s, [&] {
    return !ini->create_session(im, tm, &gone) && gone.code == StatusCode::ERR_NOT_FOUND;
  })) << gone.message;
  EXPECT_NE(gone.message.find("etcd lease"), std::string::npos) << gone.message;
  TransferStatus last = ini->write(im, 0, tm, 0, 4096, ini->allocate_transfer_uid());
  EXPECT_EQ(last.Code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_NE(last.Message().find("etcd lease"), std::string::npos) << last.Message();

  // A new instance under the key is followed without asking.
  std::vector<uint8_t> dst2(kRegion, 0);
  auto target2 = engine("target");
  ASSERT_NE(target2->desc().instance, old_instance);
  MemoryDesc tm2 = target2->register_memory(dst2.data(), dst2.size());
  ASSERT_TRUE(eventually(Clock::now() + 5s, [&] {
    TransferStatus t = ini->write(im, 0, tm2, 0, kRegion, ini->allocate_transfer_uid());
    return t.Wait() == StatusCode::SUCCESS;
  }));
  EXPECT_EQ(dst2, src);
}

TEST_F(MetadataEtcd, KilledPeerDeregisteredWithinLeasePlusOneSecond) {
  constexpr auto kLease = 2s;
  // The child engine reads the store from the environment (FERRY_ETCD_*).
  ::setenv("FERRY_ETCD_ENDPOINTS", etcd->endpoint().c_str(), 1);
  ::setenv("FERRY_ETCD_NAMESPACE", ns.c_str(), 1);
  ::setenv("FERRY_ETCD_LEASE", "2s", 1);
  auto start_child = [&] {
    auto c = std::make_unique<test::ChildProcess>(
        std::vector<std::string>{FERRY_TEST_PEER, "peer", "tcp", std::to_string(kRegion), "5000"});
    std::istringstream in(c->read_line(60000));
    std::string word;
    in >> word;
    EXPECT_EQ(word, "READY");
    EXPECT_EQ(c->ask("publish buf"), "OK");
    return c;
  };
  auto child = start_child();
  ::unsetenv("FERRY_ETCD_ENDPOINTS");
  ::unsetenv("FERRY_ETCD_NAMESPACE");
  ::unsetenv("FERRY_ETCD_LEASE");

  auto ini = engine("initiator", kLease);
  std::vector<uint8_t> src(kRegion);
  test::fill_pattern(src.data(), 0, src.size(), 3);
  MemoryDesc im = ini->register_memory(src.data(), src.size());
  ASSERT_TRUE(ini->fetch_remote_engine("peer", 5s).ok());
  Result why;
  auto remote = ini->fetch_memory("peer", "buf", 5s, &why);
  ASSERT_TRUE(remote) << why.message;
  auto session = ini->create_session(im, *remote, &why);
  ASSERT_TRUE(session) << why.message;
  ASSERT_EQ(session->write(0, 0, kRegion, session->allocate_transfer_uid()).Wait(),
            StatusCode::SUCCESS);

  const auto killed = Clock::now();
  child->kill_now();
  // A transfer posted after the kill ends once the peer is deregistered at
  // the latest, never by the 5 s transfer deadline.
  TransferStatus queued = session->write(0, 0, kRegion, session->allocate_transfer_uid());
  ASSERT_TRUE(eventually(killed + kLease + 1s, [&] { return !session->alive(); }))
      << "the killed peer was not deregistered within lease + 1 s";
  const auto took = Clock::now() - killed;
  EXPECT_TRUE(queued.WaitFor(100ms)) << "a transfer to the dead peer outlived its deregistration";
  EXPECT_TRUE(queued.Failed());
  std::printf("the transfer posted after the kill ended: %s: %s\n", to_string(queued.Code()),
              queued.Message().c_str());
  TransferStatus after = session->write(0, 0, 4096, session->allocate_transfer_uid());
  EXPECT_EQ(after.Code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_NE(after.Message().find("etcd lease"), std::string::npos) << after.Message();
  TransferStatus direct = ini->write(im, 0, *remote, 0, 4096, ini->allocate_transfer_uid());
  EXPECT_EQ(direct.Code(), StatusCode::ERR_NOT_FOUND);
  EXPECT_NE(direct.Message().find("etcd lease"), std::string::npos) << direct.Message();
  std::printf(
      "deregistered %lld ms after SIGKILL (lease %lld ms)\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()),
      static_cast<long long>(std::chrono::milliseconds(kLease).count()));

  // Restarted under the same key: the new instance is registered by the watch.
  ::setenv("FERRY_ETCD_ENDPOINTS", etcd->endpoint().c_str(), 1);
  ::setenv("FERRY_ETCD_NAMESPACE", ns.c_str(), 1);
  ::setenv("FERRY_ETCD_LEASE", "2s", 1);
  child = start_child();
  ::unsetenv("FERRY_ETCD_ENDPOINTS");
  ::unsetenv("FERRY_ETCD_NAMESPACE");
  ::unsetenv("FERRY_ETCD_LEASE");
  auto fresh = ini->fetch_memory("peer", "buf", 5s, &why);
  ASSERT_TRUE(fresh) << why.message;
  ASSERT_NE(fresh->engine_instance, remote->engine_instance);
  ASSERT_TRUE(eventually(Clock::now() + 5s, [&] {
    return ini->write(im, 0, *fresh, 0, kRegion, ini->allocate_transfer_uid()).Wait() ==
           StatusCode::SUCCESS;
  }));
  std::istringstream h(child->ask("hash 1 0 " + std::to_string(kRegion)));
  std::string word, hash;
  h >> word >> hash;
  EXPECT_EQ(word, "HASH");
  std::ostringstream want;
  want << test::fnv1a(src.data(), src.size());
  EXPECT_EQ(hash, want.str());
}

TEST_F(MetadataEtcd, StoreDownKnownPeersGoOn) {
  auto target = engine("target");
  auto ini = engine("initiator");
  std::vector<uint8_t> dst(kRegion, 0), src(kRegion, 5);
  MemoryDesc tm = target->register_memory(dst.data(), dst.size());
  MemoryDesc im = ini->register_memory(src.data(), src.size());
  ASSERT_TRUE(target->publish_memory("kv", tm).ok());
  ASSERT_TRUE(ini->fetch_remote_engine("target", 5s).ok());

  etcd->kill_now();
  // Clear errors: the endpoint and that the store is unreachable.
  Result r = ini->fetch_remote_engine("someone");
  EXPECT_EQ(r.code, StatusCode::ERR_TRANSPORT);
  EXPECT_NE(r.message.find(etcd->endpoint()), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("unreachable"), std::string::npos) << r.message;
  r = target->publish_memory("kv2", tm);
  EXPECT_EQ(r.code, StatusCode::ERR_TRANSPORT) << r.message;

  // Longer than the lease with the store down: the peers still know each other.
  const auto until = Clock::now() + 3s;
  int n = 0;
  while (Clock::now() < until) {
    TransferStatus s = ini->write(im, 0, tm, 0, 64 * 1024, ini->allocate_transfer_uid());
    ASSERT_EQ(s.Wait(), StatusCode::SUCCESS) << s.Message();
    ++n;
  }
  EXPECT_GT(n, 0);

  // Back: publishing works again (the keep-alive resumed or re-published).
  etcd->start();
  wait_ready();
  ASSERT_TRUE(
      eventually(Clock::now() + 10s, [&] { return target->publish_memory("kv2", tm).ok(); }));
  auto again = ini->fetch_memory("target", "kv2", 5s);
  ASSERT_TRUE(again);
  TransferStatus s = ini->write(im, 0, *again, 0, 4096, ini->allocate_transfer_uid());
  EXPECT_EQ(s.Wait(), StatusCode::SUCCESS) << s.Message();
}

// Partitioned rather than dead: a SIGSTOPped peer keeps its sockets but stops
// answering (and keeping its lease alive). A transfer in flight to it would
// wait for its 20 s deadline; the lease expiring ends it instead.
TEST_F(MetadataEtcd, StoppedPeerInFlightTransferEndsWhenLeaseExpires) {
  ::setenv("FERRY_ETCD_ENDPOINTS", etcd->endpoint().c_str(), 1);
  ::setenv("FERRY_ETCD_NAMESPACE", ns.c_str(), 1);
  ::setenv("FERRY_ETCD_LEASE", "2s", 1);
  test::ChildProcess child({FERRY_TEST_PEER, "peer", "tcp", std::to_string(kRegion), "20000"});
  ::unsetenv("FERRY_ETCD_ENDPOINTS");
  ::unsetenv("FERRY_ETCD_NAMESPACE");
  ::unsetenv("FERRY_ETCD_LEASE");
  std::istringstream in(child.read_line(60000));
  std::string word;
  in >> word;
  ASSERT_EQ(word, "READY");
  ASSERT_EQ(child.ask("publish buf"), "OK");
  EngineConfig c = config();
  c.timeout = 20s;
  Engine ini("initiator", c);
  ASSERT_TRUE(ini.add_backend("tcp").ok());
  std::vector<uint8_t> src(kRegion, 4);
  MemoryDesc im = ini.register_memory(src.data(), src.size());
  ASSERT_TRUE(ini.fetch_remote_engine("peer", 5s).ok());
  Result why;
  auto remote = ini.fetch_memory("peer", "buf", 5s, &why);
  ASSERT_TRUE(remote) << why.message;
  ASSERT_EQ(ini.write(im, 0, *remote, 0, kRegion, ini.allocate_transfer_uid()).Wait(),
            StatusCode::SUCCESS);

  const auto stopped = Clock::now();
  ASSERT_EQ(::kill(child.pid(), SIGSTOP), 0);
  // kill() only queues the stop: a thread of the peer woken by our WRITE could
  // still serve it. Wait until every thread of it has stopped.
  int wst = 0;
  ASSERT_EQ(::waitpid(child.pid(), &wst, WUNTRACED), child.pid());
  ASSERT_TRUE(WIFSTOPPED(wst));
  TransferStatus inflight = ini.write(im, 0, *remote, 0, kRegion, ini.allocate_transfer_uid());
  Result gone;
  ASSERT_TRUE(eventually(stopped + 2s + 1s, [&] {
    return !ini.create_session(im, *remote, &gone) && gone.code == StatusCode::ERR_NOT_FOUND;
  })) << "the stopped peer was not deregistered within lease + 1 s";
  const auto deregistered = Clock::now();
  EXPECT_TRUE(inflight.WaitFor(1s)) << "the transfer in flight outlived the deregistration";
  const auto ended = Clock::now();
  EXPECT_TRUE(inflight.Failed());
  // It says why: the lease, not only that the peer went.
  EXPECT_NE(inflight.Message().find("etcd lease"), std::string::npos) << inflight.Message();
  std::printf(
      "in flight to the stopped peer: ended %lld ms after its deregistration: %s: %s\n",
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(ended - deregistered).count()),
      to_string(inflight.Code()), inflight.Message().c_str());
  ::kill(child.pid(), SIGCONT);
}

// The peer dies while the store is down: nothing is deregistered while etcd
// cannot say; once it is back and the dead engine's lease has run out there,
// the peer is deregistered (the watch re-reads what it follows on reconnecting).
TEST_F(MetadataEtcd, PeerDiedWhileStoreDownGoesWhenStoreSaysSo) {
  auto target = engine("target");
  auto ini = engine("initiator");
  std::vector<uint8_t> dst(kRegion, 0), src(kRegion, 9);
  MemoryDesc tm = target->register_memory(dst.data(), dst.size());
  MemoryDesc im = ini->register_memory(src.data(), src.size());
  ASSERT_TRUE(ini->fetch_remote_engine("target", 5s).ok());
  ASSERT_EQ(ini->write(im, 0, tm, 0, 4096, ini->allocate_transfer_uid()).Wait(),
            StatusCode::SUCCESS);

  etcd->kill_now();
  target.reset();  // cannot revoke its lease: the store is down
  // Longer than the lease: still registered here (create_session resolves it).
  const auto until = Clock::now() + 3s;
  while (Clock::now() < until) {
    Result why;
    ASSERT_TRUE(ini->create_session(im, tm, &why)) << why.message;
    std::this_thread::sleep_for(50ms);  // sampling a state that must not change
  }
  etcd->start();
  wait_ready();
  // etcd restores the lease with a fresh TTL (2 s); nobody keeps it alive now.
  Result gone;
  ASSERT_TRUE(eventually(Clock::now() + 10s, [&] {
    return !ini->create_session(im, tm, &gone) && gone.code == StatusCode::ERR_NOT_FOUND;
  })) << "the dead peer was never deregistered after the store came back";
  EXPECT_NE(gone.message.find("etcd lease"), std::string::npos) << gone.message;
}

// The first endpoint is frozen. The watch must move to the next one, so a
// peer that closes is deregistered (it stayed registered for good when the
// watch kept to the first endpoint), and the engine's own lease must outlive
// the frozen member (one keep-alive waited out the whole 3 s request timeout
// there, longer than a 2 s lease).
TEST_F(MetadataEtcd, AFrozenFirstEndpointIsLeftByTheWatchAndTheKeepAlives) {
  FrozenEndpoint frozen;
  EngineConfig c = config(2s);
  c.metadata.etcd = {frozen.url(), etcd->endpoint()};
  auto ini = std::make_unique<Engine>("initiator", c);
  ASSERT_TRUE(ini->add_backend("tcp").ok());
  auto target = engine("target");
  std::vector<uint8_t> dst(kRegion, 0), src(kRegion, 1);
  MemoryDesc tm = target->register_memory(dst.data(), dst.size());
  MemoryDesc im = ini->register_memory(src.data(), src.size());
  ASSERT_TRUE(ini->fetch_remote_engine("target", 10s).ok());
  ASSERT_EQ(ini->write(im, 0, tm, 0, 4096, ini->allocate_transfer_uid()).Wait(),
            StatusCode::SUCCESS);

  // The initiator's key stays in the store the whole time: its keep-alives
  // leave the frozen member within their share of a keep-alive period.
  etcd::Client direct({etcd->endpoint()}, 1s);
  const std::string own = ns + "/initiator/engine";
  const auto watch_until = Clock::now() + 5s;
  int absent = 0, looked = 0;
  while (Clock::now() < watch_until) {
    std::optional<etcd::KeyValue> kv;
    if (direct.get(own, kv).ok()) {
      ++looked;
      absent += kv ? 0 : 1;
    }
    std::this_thread::sleep_for(50ms);  // sampling the store, not synchronisation
  }
  EXPECT_GT(looked, 20);
  EXPECT_EQ(absent, 0) << "the initiator's lease lapsed while one endpoint was frozen";

  // The target closes (its lease is revoked): the initiator deregisters it.
  const auto closed = Clock::now();
  target.reset();
  Result gone;
  EXPECT_TRUE(eventually(closed + 15s, [&] {
    return !ini->create_session(im, tm, &gone) && gone.code == StatusCode::ERR_NOT_FOUND;
  })) << "the closed target is still registered: the watch never left the frozen endpoint";
  EXPECT_NE(gone.message.find("etcd lease"), std::string::npos) << gone.message;
  std::printf(
      "deregistered %lld ms after the target closed\n",
      static_cast<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - closed).count()));
}

TEST_F(MetadataEtcd, ConfigFromPolicyFile) {
  char path[] = "/tmp/ferry-policy-XXXXXX";
  const int fd = ::mkstemp(path);
  ASSERT_GE(fd, 0);
  const std::string yaml =
      "metadata: {etcd: [" + etcd->endpoint() + "], namespace: " + ns + ", lease: 3s}\n";
  ASSERT_EQ(::write(fd, yaml.data(), yaml.size()), static_cast<ssize_t>(yaml.size()));
  ::close(fd);
  EngineConfig c;
  c.policy_file = path;
  auto a = std::make_unique<Engine>("from-policy", c);
  ::unlink(path);
  ASSERT_TRUE(a->has_metadata_store());
  etcd::Client client({etcd->endpoint()});
  std::optional<etcd::KeyValue> kv;
  ASSERT_TRUE(client.get(ns + "/from-policy/engine", kv).ok());
  ASSERT_TRUE(kv);
  EXPECT_EQ(EngineDesc::unpack(std::vector<uint8_t>(kv->value.begin(), kv->value.end())),
            a->desc());
  EXPECT_NE(kv->lease, 0);
  // A bad endpoint is refused at construction, naming it.
  EngineConfig bad;
  bad.metadata.etcd = {"127.0.0.1:2379"};
  EXPECT_THROW(Engine("x", bad), Error);
}

}  // namespace

namespace {

// No etcd at all (a port nothing listens on): the engine still starts, and
// every metadata call says plainly that the store is unreachable.
TEST(MetadataNoStore, EngineStartsAndCallsSayTheStoreIsUnreachable) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  ::close(fd);  // bound once, never listened on: connections are refused
  const std::string ep = "http://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  EngineConfig c;
  c.metadata.etcd = {ep};
  c.metadata.lease = 2s;
  c.metrics_address = "127.0.0.1:0";
  const auto t0 = Clock::now();
  Engine e("lonely", c);
  EXPECT_LT(Clock::now() - t0, 2s) << "an unreachable store must not hold up the engine";
  ASSERT_TRUE(e.has_metadata_store());
  std::vector<uint8_t> buf(4096);
  Result r = e.publish_memory("buf", e.register_memory(buf.data(), buf.size()));
  EXPECT_EQ(r.code, StatusCode::ERR_TRANSPORT);
  EXPECT_NE(r.message.find(ep), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("unreachable"), std::string::npos) << r.message;
  r = e.fetch_remote_engine("other", 1s);
  EXPECT_EQ(r.code, StatusCode::ERR_TRANSPORT) << r.message;
  Result why;
  EXPECT_FALSE(e.fetch_memory("other", "x", 0ms, &why));
  EXPECT_EQ(why.code, StatusCode::ERR_TRANSPORT) << why.message;
  // Without a store the calls say so, differently.
  Engine plain("plain");
  EXPECT_FALSE(plain.has_metadata_store());
  EXPECT_EQ(plain.fetch_remote_engine("x").code, StatusCode::ERR_BAD_STATE);
}

// A frozen store holds no engine's destructor for its request timeout (3 s)
// per pending request: the metadata threads' requests are cut at shutdown.
TEST(MetadataNoStore, AFrozenStoreDoesNotHoldUpTheDestructor) {
  FrozenEndpoint frozen;
  EngineConfig c;
  c.metadata.etcd = {frozen.url()};
  c.metadata.lease = 2s;
  auto e = std::make_unique<Engine>("frozen-store", c);
  // The watcher's and keeper's requests are now waiting on the frozen store.
  Result r = e->fetch_remote_engine("other", 0ms);
  EXPECT_EQ(r.code, StatusCode::ERR_TRANSPORT) << r.message;
  const auto t0 = Clock::now();
  e.reset();
  const auto took = Clock::now() - t0;
  EXPECT_LT(took, 2500ms) << "~Engine waited out the store's request timeouts";
  std::printf(
      "~Engine took %lld ms with a frozen store\n",
      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
}

}  // namespace
