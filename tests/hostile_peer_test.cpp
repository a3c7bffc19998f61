// SPDX-License-Identifier: Apache-2.0
// Hostile peers: a raw-socket client that speaks the control-plane protocol
// (core/src/control_frame.h) and the tcp data-lane protocol (plugins/tcp/wire.h)
// and sends what a broken or malicious peer would: truncated frames, huge
// lengths, unknown types, unregistered keys, forged and replayed auth proofs,
// out-of-range and foreign memory ids, and a flood of connections. Each must be
// refused with a logged reason and counted, the engine must stay up, and a good
// peer must be served meanwhile (a real transfer, data verified).
// Every wait is on a socket (with a receive timeout) or a bounded condition.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "auth.h"
#include "control_frame.h"
#include "eventually.h"
#include "ferry/ferry.hpp"
#include "notif_inbox.h"
#include "pattern.h"
#include "proc_self.h"
#include "wire.h"

using namespace ferry;
using namespace std::chrono_literals;
namespace tw = ferry_tcp::wire;
using Bytes = std::vector<uint8_t>;

namespace {

constexpr size_t kRegion = 1 << 20;
const std::string kToken = "hostile-test-shared-secret-0001";

// This suite's bound: 15 s.
bool eventually(const std::function<bool()>& cond, std::chrono::milliseconds limit = 15s) {
  return ferry::test::eventually(cond, limit);
}

size_t open_fds() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n;
}

// This process out of descriptors: the soft RLIMIT_NOFILE lowered to what is
// open plus `headroom`, then Fill() takes the rest (dup). Release() (or the
// destructor) gives them back and restores the limit.
class DescriptorsExhausted {
 public:
  explicit DescriptorsExhausted(size_t headroom) {
    ok_ = getrlimit(RLIMIT_NOFILE, &old_) == 0;
    rlimit tight = old_;
    tight.rlim_cur = open_fds() + headroom;
    ok_ = ok_ && setrlimit(RLIMIT_NOFILE, &tight) == 0;
  }
  ~DescriptorsExhausted() { Release(); }
  bool ok() const { return ok_; }
  // True when the table is full (the last dup failed with EMFILE).
  bool Fill() {
    for (int fd; (fd = dup(0)) >= 0;) hogs_.push_back(fd);
    return errno == EMFILE;
  }
  // True when the limit is back.
  bool Release() {
    for (int fd : hogs_) close(fd);
    hogs_.clear();
    if (!ok_) return true;
    ok_ = false;
    return setrlimit(RLIMIT_NOFILE, &old_) == 0;
  }

 private:
  rlimit old_{};
  bool ok_ = false;
  std::vector<int> hogs_;
};

// Redirects this process's stderr (where ferry logs) into a file, to check that
// each refusal was logged with its reason.
class LogCapture {
 public:
  LogCapture() {
    std::fflush(stderr);
    saved_ = dup(2);
    char path[] = "/tmp/ferry-hostile-log-XXXXXX";
    fd_ = mkstemp(path);
    path_ = path;  // kept until restore(): a sanitizer report that ends the process stays there
    dup2(fd_, 2);
  }
  ~LogCapture() { restore(); }
  std::string text() {
    std::fflush(stderr);
    std::string out;
    char buf[4096];
    for (off_t off = 0;;) {
      ssize_t r = pread(fd_, buf, sizeof buf, off);
      if (r <= 0) break;
      out.append(buf, static_cast<size_t>(r));
      off += r;
    }
    return out;
  }
  size_t count(const std::string& needle) {
    std::string t = text();
    size_t n = 0;
    for (size_t p = t.find(needle); p != std::string::npos; p = t.find(needle, p + 1)) ++n;
    return n;
  }
  bool has(const std::string& needle) { return count(needle) > 0; }
  void restore() {
    if (saved_ < 0) return;
    std::string t = text();
    dup2(saved_, 2);
    close(saved_);
    saved_ = -1;
    if (HasFailure()) std::fprintf(stderr, "---- captured log ----\n%s----\n", t.c_str());
    close(fd_);
    unlink(path_.c_str());
  }

 private:
  static bool HasFailure() { return ::testing::Test::HasFailure(); }
  int saved_ = -1;
  int fd_ = -1;
  std::string path_;
};

// ---- raw sockets ------------------------------------------------------------

int dial(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{10, 0};  // no test can hang on a socket
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  int one = 1;  // handshakes are several small writes: no 40 ms Nagle/delayed-ACK stall each
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

void send_raw(int fd, const Bytes& b) {
  // The engine may already have closed the socket; some tests want exactly that.
  [[maybe_unused]] ssize_t r = send(fd, b.data(), b.size(), MSG_NOSIGNAL);
}

bool recv_exact(int fd, void* p, size_t n) {
  auto* c = static_cast<uint8_t*>(p);
  while (n > 0) {
    ssize_t r = recv(fd, c, n, 0);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Reads until the engine closes the connection; false on timeout.
bool closed_by_peer(int fd) {
  char buf[4096];
  for (;;) {
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r == 0) return true;
    if (r < 0) return errno == ECONNRESET;
  }
}

// Reads and drops what the engine sends on fd (the answers to a flood of
// NOTIFYs, which a sender must read) until the connection ends.
class AnswerDrain {
 public:
  explicit AnswerDrain(int fd)
      : t_([fd, this] {
          char buf[65536];
          for (;;) {
            ssize_t r = recv(fd, buf, sizeof buf, 0);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return;
            if (r > 0) bytes_ += static_cast<size_t>(r);
          }
        }) {}
  // The owner shuts the socket down first (that ends the reads).
  ~AnswerDrain() { t_.join(); }
  size_t bytes() const { return bytes_; }

 private:
  std::atomic<size_t> bytes_{0};
  std::thread t_;
};

Bytes cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// ---- control plane ----------------------------------------------------------

bool read_ctrl(int fd, CtrlFrame& f) {
  uint8_t hdr[kCtrlHeaderSize];
  if (!recv_exact(fd, hdr, sizeof hdr)) return false;
  CtrlFrameReader r;
  std::vector<CtrlFrame> out;
  if (!r.feed(hdr, sizeof hdr, out)) return false;
  if (out.empty()) {
    uint32_t len = hdr[8] | hdr[9] << 8 | hdr[10] << 16 | static_cast<uint32_t>(hdr[11]) << 24;
    Bytes body(len);
    if (!recv_exact(fd, body.data(), len) || !r.feed(body.data(), len, out) || out.empty())
      return false;
  }
  f = std::move(out[0]);
  return true;
}

std::string refusal(int fd) {
  CtrlFrame f;
  std::string why;
  if (!read_ctrl(fd, f) || f.type != CtrlType::HELLO_REFUSED || !decode_refused(f.body, why))
    return "<no HELLO_REFUSED>";
  return why;
}

Bytes ctrl_header(uint8_t type, uint32_t len, uint32_t magic = kCtrlMagic) {
  Bytes h(kCtrlHeaderSize, 0);
  for (int i = 0; i < 4; ++i) h[i] = static_cast<uint8_t>(magic >> (8 * i));
  h[4] = kCtrlVersion;
  h[5] = type;
  for (int i = 0; i < 4; ++i) h[8 + i] = static_cast<uint8_t>(len >> (8 * i));
  return h;
}

// What an honest client with the token sends; returns the proof frame too.
struct CtrlHandshake {
  auth::Nonce nc{}, ns{};
  Bytes hello, proof;
};

// A link proof (link_auth.h): MACs for two instance secrets over one transcript,
// as `role` proves it (the target's own is its first half).
Bytes link_proof(const auth::InstanceSecret& first, const auth::InstanceSecret& second,
                 const std::vector<uint8_t>& transcript, const std::string& token = kToken,
                 char role = auth::kInitiatorRole) {
  Bytes p(64, 0);
  auth::link_mac(first, token, role, transcript.data(), transcript.size(), p.data());
  auth::link_mac(second, token, role, transcript.data(), transcript.size(), p.data() + 32);
  return p;
}

auth::InstanceSecret random_secret() {
  auth::InstanceSecret s(auth::kInstanceSecretSize);
  auth::random_bytes(s.data(), s.size());
  return s;
}

// ---- the engines ------------------------------------------------------------

// A target engine and a good initiator, registered both ways, with memory.
struct Rig {
  explicit Rig(const std::string& backend, const std::string& token = kToken,
               const std::string& settings = "{}") {
    setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
    EngineConfig c;
    c.auth_token = token;
    c.timeout = 10s;
    tgt = std::make_unique<Engine>("hostile-tgt", c);
    good = std::make_unique<Engine>("good", c);
    for (Engine* e : {tgt.get(), good.get()}) {
      Result r = e->add_backend(backend, settings);
      if (!r) throw std::runtime_error(r.message);
    }
    tgt->register_remote_engine(good->desc());
    good->register_remote_engine(tgt->desc());
    tmem.resize(kRegion);
    gmem.resize(kRegion);
    tdesc = tgt->register_memory(tmem.data(), tmem.size());
    gdesc = good->register_memory(gmem.data(), gmem.size());
    const EngineDesc d = tgt->desc();
    tgt_secret = d.secret;
    good_secret = good->desc().secret;
    ctrl_port = d.port;
    if (auto it = tdesc.backends.find("tcp"); it != tdesc.backends.end()) {
      tw::MemInfo mi;
      std::string why;
      if (!tw::DecodeMemBlob(it->second.data(), it->second.size(), &mi, &why))
        throw std::runtime_error(why);
      tkey = mi.key;
    }
    if (auto it = d.backends.find("tcp"); it != d.backends.end()) {
      tw::ConnInfo ci;
      std::string why;
      if (!tw::DecodeConnBlob(it->second.data(), it->second.size(), &ci, &why))
        throw std::runtime_error(why);
      tcp_port = ci.port;
    }
  }

  // A WRITE then a READ back by the good peer, both verified, with notification.
  ::testing::AssertionResult good_transfer(uint64_t seed) {
    const size_t n = 128 * 1024, off = 4096;
    test::fill_pattern(gmem.data(), 0, n, seed);
    TransferUid uid = good->allocate_transfer_uid();
    TransferStatus w = good->write(gdesc, 0, tdesc, off, n, uid, true);
    if (!w.WaitFor(30s) || !w.Succeeded())
      return ::testing::AssertionFailure() << "good WRITE failed: " << w.Message();
    if (test::find_mismatch(tmem.data(), off, n, seed, 0) != -1)
      return ::testing::AssertionFailure() << "good WRITE landed wrong bytes";
    if (!tgt->wait_inbound_transfer_status("good", uid, 10s))
      return ::testing::AssertionFailure() << "target was not notified";
    std::fill(gmem.begin(), gmem.begin() + n, 0);
    TransferStatus r = good->read(gdesc, 0, tdesc, off, n, good->allocate_transfer_uid(), false);
    if (!r.WaitFor(30s) || !r.Succeeded())
      return ::testing::AssertionFailure() << "good READ failed: " << r.Message();
    if (test::find_mismatch(gmem.data(), 0, n, seed, 0) != -1)
      return ::testing::AssertionFailure() << "good READ returned wrong bytes";
    return ::testing::AssertionSuccess();
  }

  uint64_t rejected() const { return tgt->stats().ctrl_rejected; }

  // The honest control-plane handshake as "good", over a raw socket: it holds
  // the target's descriptor (tgt_secret) and its own (good_secret).
  bool ctrl_login(int fd, CtrlHandshake& hs, const std::string& key = "good",
                  const std::string& server_key = "hostile-tgt", bool check_server = true) {
    auth::random_bytes(hs.nc.data(), hs.nc.size());
    hs.hello = encode_ctrl_frame(CtrlType::HELLO, hello_body(key, hs.nc.data(), kHelloHasToken));
    send_raw(fd, hs.hello);
    CtrlFrame f;
    uint8_t server[kCtrlProofSize];
    if (!read_ctrl(fd, f) || !decode_challenge(f.body, hs.ns.data(), server)) return false;
    auto ts = auth::ctrl_transcript("ferry-ctrl-v2 server", hs.nc, hs.ns, key, server_key);
    if (check_server &&
        std::memcmp(link_proof(tgt_secret, tgt_secret, ts, kToken, auth::kTargetRole).data(),
                    server, 32) != 0)
      return false;  // the target did not prove its descriptor
    auto tc = auth::ctrl_transcript("ferry-ctrl-v2 client", hs.nc, hs.ns, key, server_key);
    hs.proof = encode_ctrl_frame(CtrlType::AUTH_PROOF,
                                 proof_body(link_proof(tgt_secret, good_secret, tc).data()));
    send_raw(fd, hs.proof);
    return read_ctrl(fd, f) && f.type == CtrlType::HELLO_OK;
  }

  // The memory is declared before the engines, so it outlives them: a target
  // lane thread may still be inside the sendmsg() of a READ's answer when the
  // test ends (ASan saw that as a use after free in the CI run of f3ed9d1).
  std::vector<uint8_t> tmem, gmem;
  std::unique_ptr<Engine> tgt, good;
  MemoryDesc tdesc, gdesc;
  auth::InstanceSecret tgt_secret, good_secret;  // from the two descriptors
  uint64_t tkey = 0;                             // tdesc's tcp region key
  uint16_t ctrl_port = 0, tcp_port = 0;
};

// ---- control plane ------------------------------------------------------------

struct CtrlCase {
  const char* name;
  std::function<void(int fd)> attack;
  const char* logged;  // the reason the engine must log
};

TEST(HostileControlPlane, MalformedAndUnauthenticatedConnectionsAreRefused) {
  Rig rig("tcp");
  ASSERT_TRUE(rig.good_transfer(1));
  auto nonce = [] {
    auth::Nonce n;
    auth::random_bytes(n.data(), n.size());
    return n;
  }();
  Bytes hello_good =
      encode_ctrl_frame(CtrlType::HELLO, hello_body("good", nonce.data(), kHelloHasToken));
  // Answers a challenge with MACs for the given secrets over the right transcript.
  auto answer = [&](int fd, const std::string& key, const auth::InstanceSecret& first,
                    const auth::InstanceSecret& second) {
    CtrlFrame f;
    ASSERT_TRUE(read_ctrl(fd, f));
    ASSERT_EQ(f.type, CtrlType::AUTH_CHALLENGE);
    auth::Nonce ns;
    uint8_t server[kCtrlProofSize];
    ASSERT_TRUE(decode_challenge(f.body, ns.data(), server));
    auto tc = auth::ctrl_transcript("ferry-ctrl-v2 client", nonce, ns, key, "hostile-tgt");
    send_raw(fd, encode_ctrl_frame(CtrlType::AUTH_PROOF,
                                   proof_body(link_proof(first, second, tc).data())));
  };
  std::vector<CtrlCase> cases = {
      {"header without its body",
       [](int fd) {
         send_raw(fd, ctrl_header(1, 10));
         shutdown(fd, SHUT_WR);
       },
       "closed during the handshake"},
      {"truncated header bytes",
       [](int fd) {
         Bytes h = ctrl_header(1, 10);
         h.resize(5);
         send_raw(fd, h);
         shutdown(fd, SHUT_WR);
       },
       "closed during the handshake"},
      {"truncated body",
       [](int fd) {
         send_raw(fd, cat({ctrl_header(1, 40), Bytes(10, 'a')}));
         shutdown(fd, SHUT_WR);
       },
       "closed during the handshake"},
      {"huge length", [](int fd) { send_raw(fd, ctrl_header(1, 0xfffffff0u)); }, "exceeds limit"},
      {"body over the handshake limit",
       [](int fd) { send_raw(fd, ctrl_header(1, kMaxHandshakeBody + 1)); }, "exceeds limit"},
      {"unknown type", [](int fd) { send_raw(fd, ctrl_header(42, 0)); }, "unknown frame type 42"},
      {"bad magic", [](int fd) { send_raw(fd, ctrl_header(1, 0, 0xdeadbeef)); }, "bad magic"},
      {"bad version",
       [](int fd) {
         Bytes h = ctrl_header(1, 0);
         h[4] = 99;
         send_raw(fd, h);
       },
       "unsupported version"},
      {"notify before hello",
       [](int fd) { send_raw(fd, encode_ctrl_frame(CtrlType::NOTIFY, notify_body(1, 0, 0))); },
       "first frame is not a valid HELLO"},
      {"hello with a bad body",
       [](int fd) {
         send_raw(fd, encode_ctrl_frame(CtrlType::HELLO, {200, 'x'}));
       },
       "first frame is not a valid HELLO"},
      {"a version-1 HELLO (no nonce)",
       [](int fd) {
         send_raw(fd, encode_ctrl_frame(CtrlType::HELLO, {4, 'g', 'o', 'o', 'd'}));
       },
       "first frame is not a valid HELLO"},
      {"an engine without the descriptor",
       [&](int fd) {
         // It knows the key, the address and the token, not the secret.
         send_raw(fd, encode_ctrl_frame(CtrlType::HELLO,
                                        hello_body("mallory", nonce.data(), kHelloHasToken)));
         answer(fd, "mallory", random_secret(), random_secret());
         EXPECT_NE(refusal(fd).find("does not hold this engine's current descriptor"),
                   std::string::npos);
       },
       "'mallory' does not hold this engine's current descriptor"},
      {"no token",
       [&](int fd) {
         send_raw(fd, encode_ctrl_frame(CtrlType::HELLO, hello_body("good", nonce.data(), 0)));
         EXPECT_NE(refusal(fd).find("requires an auth token"), std::string::npos);
       },
       "requires an auth token"},
      {"forged proof",
       [&](int fd) {
         send_raw(fd, hello_good);
         answer(fd, "good", random_secret(), rig.good_secret);
         EXPECT_NE(refusal(fd).find("does not hold"), std::string::npos);
       },
       "'good' does not hold this engine's current descriptor"},
      {"a registered key claimed without its secret",
       [&](int fd) {
         // The target's descriptor leaked: the first half is right, but "good"
         // is registered here and the claimant cannot prove good's secret.
         send_raw(fd, hello_good);
         answer(fd, "good", rig.tgt_secret, random_secret());
         EXPECT_NE(refusal(fd).find("claims the key of registered engine 'good'"),
                   std::string::npos);
       },
       "claims the key of registered engine 'good'"},
      {"an unknown initiator that speaks before presenting its descriptor",
       [&](int fd) {
         send_raw(fd, encode_ctrl_frame(CtrlType::HELLO,
                                        hello_body("stranger", nonce.data(), kHelloHasToken)));
         answer(fd, "stranger", rig.tgt_secret, random_secret());  // it holds the descriptor
         CtrlFrame f;
         ASSERT_TRUE(read_ctrl(fd, f));
         ASSERT_EQ(f.type, CtrlType::HELLO_OK);
         ASSERT_EQ(f.body, Bytes{kHelloOkSendDesc}) << "the target must ask for its descriptor";
         send_raw(fd, encode_ctrl_frame(CtrlType::NOTIFY, notify_body(7, 0, 0)));
       },
       "'stranger' sent a 5 frame before its descriptor"},
      {"a descriptor sent in clear (not sealed for the target)",
       [&](int fd) {
         send_raw(fd, encode_ctrl_frame(CtrlType::HELLO,
                                        hello_body("stranger", nonce.data(), kHelloHasToken)));
         answer(fd, "stranger", rig.tgt_secret, random_secret());
         CtrlFrame f;
         ASSERT_TRUE(read_ctrl(fd, f));
         ASSERT_EQ(f.type, CtrlType::HELLO_OK);
         send_raw(fd, encode_ctrl_frame(CtrlType::PEER_DESC, rig.good->desc().pack()));
       },
       "'stranger' sent a descriptor not sealed for this engine"},
      {"proof under another token",
       [&](int fd) {
         send_raw(fd, hello_good);
         CtrlFrame f;
         ASSERT_TRUE(read_ctrl(fd, f));
         auth::Nonce ns;
         uint8_t server[kCtrlProofSize];
         ASSERT_TRUE(decode_challenge(f.body, ns.data(), server));
         auto tc = auth::ctrl_transcript("ferry-ctrl-v2 client", nonce, ns, "good", "hostile-tgt");
         Bytes p = link_proof(rig.tgt_secret, rig.good_secret, tc, "another-token");
         send_raw(fd, encode_ctrl_frame(CtrlType::AUTH_PROOF, proof_body(p.data())));
         EXPECT_NE(refusal(fd).find("a different auth token"), std::string::npos);
       },
       "'good' does not hold"},
      {"frame instead of proof",
       [&](int fd) {
         send_raw(fd, hello_good);
         CtrlFrame f;
         ASSERT_TRUE(read_ctrl(fd, f));
         send_raw(fd, encode_ctrl_frame(CtrlType::NOTIFY, notify_body(5, 0, 0)));
       },
       "did not answer the auth challenge"},
      {"proof of the wrong size",
       [&](int fd) {
         send_raw(fd, hello_good);
         CtrlFrame f;
         ASSERT_TRUE(read_ctrl(fd, f));
         send_raw(fd, encode_ctrl_frame(CtrlType::AUTH_PROOF, Bytes(63, 0)));
       },
       "did not answer the auth challenge"},
      {"garbage", [](int fd) { send_raw(fd, Bytes(300, 0xa5)); }, "bad magic"},
  };
  LogCapture log;
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].name);
    const uint64_t before = rig.rejected();
    const size_t logged = log.count(cases[i].logged);
    int fd = dial(rig.ctrl_port);
    ASSERT_GE(fd, 0);
    cases[i].attack(fd);
    EXPECT_TRUE(closed_by_peer(fd));
    close(fd);
    EXPECT_TRUE(eventually([&] { return rig.rejected() == before + 1; }))
        << "rejected " << rig.rejected() << ", expected " << before + 1;
    EXPECT_TRUE(eventually([&] { return log.count(cases[i].logged) > logged; }))
        << "no log line with '" << cases[i].logged << "'";
  }
  log.restore();
  EXPECT_TRUE(rig.good_transfer(2));
}

TEST(HostileControlPlane, ReplayedProofsAreRefused) {
  Rig rig("tcp");
  CtrlHandshake first;
  int fd = dial(rig.ctrl_port);
  ASSERT_TRUE(rig.ctrl_login(fd, first)) << "the honest raw handshake must pass";
  close(fd);  // an authenticated connection closing is not a refusal
  const uint64_t before = rig.rejected();

  LogCapture log;
  // Replay the recorded HELLO and proof blindly: the server's nonce is new, so
  // the old proof does not match.
  fd = dial(rig.ctrl_port);
  send_raw(fd, cat({first.hello, first.proof}));
  CtrlFrame f;
  ASSERT_TRUE(read_ctrl(fd, f));
  ASSERT_EQ(f.type, CtrlType::AUTH_CHALLENGE);
  auth::Nonce ns2;
  uint8_t server[kCtrlProofSize];
  ASSERT_TRUE(decode_challenge(f.body, ns2.data(), server));
  EXPECT_NE(ns2, first.ns) << "server nonces must not repeat";
  EXPECT_NE(refusal(fd).find("does not hold"), std::string::npos);
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  // A proof made for another target does not pass here (relayed from elsewhere).
  fd = dial(rig.ctrl_port);
  CtrlHandshake other;
  EXPECT_FALSE(rig.ctrl_login(fd, other, "good", "some-other-target", /*check_server=*/false));
  close(fd);
  EXPECT_TRUE(eventually([&] { return rig.rejected() == before + 2; })) << rig.rejected();
  EXPECT_TRUE(eventually([&] { return log.count("'good' does not hold") == 2; }));
  log.restore();
  EXPECT_TRUE(rig.good_transfer(3));
}

TEST(HostileControlPlane, ForgedNotificationFloodStaysAtTheCap) {
  // An authenticated peer (or one that learned the token) sends NOTIFYs with
  // random uids that no application will ever pop: the target keeps at most
  // inbound_max_per_peer of them (the newest), counts the rest as dropped, and
  // its memory stays within 32 MiB of where it started.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' runs: fewer frames, and no RSS bound (their shadow memory
  // and allocator make RSS several times the program's own).
  constexpr uint64_t kFlood = 200000;
  constexpr bool kCheckRss = false;
#else
  constexpr uint64_t kFlood = 1000000;
  constexpr bool kCheckRss = true;
#endif
  Rig rig("tcp");
  const uint64_t cap = EngineConfig{}.inbound_max_per_peer;
  ASSERT_GT(kFlood, cap);
  const long rss_before = test::rss_kib();
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  CtrlHandshake hs;
  ASSERT_TRUE(rig.ctrl_login(fd, hs));
  const uint64_t life = rig.tgt->desc().instance;
  // Each NOTIFY is answered; a sender that reads no answers is cut (below).
  auto drain = std::make_unique<AnswerDrain>(fd);
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t x = 0x9E3779B97F4A7C15ull, first = 0, last = 0;
  Bytes batch;
  for (uint64_t i = 0; i < kFlood; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64: no repeats within the flood
    if (i == 0) first = x;
    last = x;
    Bytes f = encode_ctrl_frame(CtrlType::NOTIFY, notify_body(x, 0, life));
    batch.insert(batch.end(), f.begin(), f.end());
    if (batch.size() >= 64 * 1024 || i + 1 == kFlood) {
      send_raw(fd, batch);
      batch.clear();
    }
  }
  ASSERT_TRUE(eventually([&] { return rig.tgt->stats().inbound_notifications >= kFlood; }, 120s))
      << "landed " << rig.tgt->stats().inbound_notifications << " of " << kFlood;
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const EngineStats st = rig.tgt->stats();
  const long rss_after = test::rss_kib();
  std::printf("RESULT notify_flood frames=%llu seconds=%.2f dropped=%llu rss_kib %ld -> %ld\n",
              static_cast<unsigned long long>(kFlood), took,
              static_cast<unsigned long long>(st.inbound_dropped), rss_before, rss_after);
  EXPECT_EQ(st.inbound_dropped, kFlood - cap);
  EXPECT_FALSE(rig.tgt->pop_inbound_transfer_status("good", first)) << "the oldest was kept";
  EXPECT_TRUE(rig.tgt->pop_inbound_transfer_status("good", last)) << "the newest was dropped";
  if (kCheckRss) {
    EXPECT_LE(rss_after - rss_before, 32 * 1024)
        << "RSS grew by " << (rss_after - rss_before) << " KiB";
  }
  shutdown(fd, SHUT_RDWR);
  drain.reset();
  close(fd);
  EXPECT_TRUE(rig.good_transfer(7));
}

TEST(HostileControlPlane, MessageFloodThatNeverReadsItsAnswersStaysBounded) {
  // An authenticated peer sends 64 KiB notification messages with fresh ids as
  // fast as the target reads them and never reads a MSG_ACK: the inbox refuses
  // past its bound (16 MiB unread per sender), the target's I/O thread never
  // blocks on the answers (written only when they fit at once; a peer whose
  // answers do not fit is cut), and the good peer is served meanwhile.
  Rig rig("tcp");
  const long rss_before = test::rss_kib();
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  CtrlHandshake hs;
  ASSERT_TRUE(rig.ctrl_login(fd, hs));
  const std::string payload(kMaxNotificationBytes, 'f');
  const uint64_t life = rig.good->desc().instance;  // the life the target knows under "good"
  const uint64_t kFrames = 2000;                    // 128 MiB offered
  uint64_t sent = 0;
  const auto until = std::chrono::steady_clock::now() + 30s;
  for (uint64_t id = 1; id <= kFrames && std::chrono::steady_clock::now() < until; ++id) {
    Bytes f = encode_ctrl_frame(CtrlType::MSG, msg_body(life, id, payload.data(), payload.size()));
    size_t off = 0;
    while (off < f.size() && std::chrono::steady_clock::now() < until) {
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, 100) != 1) continue;
      ssize_t k = ::send(fd, f.data() + off, f.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k <= 0) break;
      off += static_cast<size_t>(k);
    }
    if (off < f.size()) break;
    ++sent;
  }
  ASSERT_TRUE(eventually([&] {
    auto st = rig.tgt->stats();
    return st.notifications_received + st.notifications_refused >= sent || closed_by_peer(fd);
  })) << "sent "
      << sent;
  const EngineStats st = rig.tgt->stats();
  std::printf("RESULT msg_flood offered=%llu taken=%llu refused=%llu rss_kib %ld -> %ld\n",
              static_cast<unsigned long long>(sent),
              static_cast<unsigned long long>(st.notifications_received),
              static_cast<unsigned long long>(st.notifications_refused), rss_before,
              test::rss_kib());
  EXPECT_GE(sent, 300u) << "the target stopped reading";
  const size_t fit =
      NotifLimits{}.max_bytes / (kMaxNotificationBytes + NotifInbox::kPerMessageCost);
  EXPECT_EQ(st.notifications_received, fit) << "16 MiB of 64 KiB messages";
  EXPECT_LE(st.notifications_unread * kMaxNotificationBytes, 16u << 20);
  EXPECT_TRUE(rig.good_transfer(8)) << "the I/O thread is not stuck";
  close(fd);
  EXPECT_EQ(rig.tgt->get_new_notifications()["good"].size(), fit);
}

TEST(HostileControlPlane, MessagesNamingAnotherLifeAreNotTaken) {
  // Exactly once rests on one numbering per sender life: a peer that names a
  // life other than the one its connection proved gets STALE, nothing stored.
  Rig rig("tcp");
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  CtrlHandshake hs;
  ASSERT_TRUE(rig.ctrl_login(fd, hs));
  const uint64_t life = rig.good->desc().instance;
  // One MSG and the target's answer to it.
  auto ask = [&](uint64_t sender_life, const std::string& payload, uint64_t* id, MsgAck* ack) {
    send_raw(fd, encode_ctrl_frame(CtrlType::MSG,
                                   msg_body(sender_life, 1, payload.data(), payload.size())));
    CtrlFrame f;
    return read_ctrl(fd, f) && decode_msg_ack(f.body, *id, *ack);
  };
  uint64_t id = 0;
  MsgAck ack;
  for (uint64_t other : {life + 1, uint64_t{0}}) {
    ASSERT_TRUE(ask(other, "x", &id, &ack));
    EXPECT_EQ(ack, MsgAck::STALE);
  }
  ASSERT_TRUE(ask(life, "mine", &id, &ack));
  EXPECT_EQ(ack, MsgAck::TAKEN);
  EXPECT_EQ(id, 1u);
  close(fd);
  EXPECT_EQ(rig.tgt->wait_notifications(5s)["good"], std::vector<std::string>{"mine"});
}

TEST(HostileControlPlane, MalformedMessagesCloseTheConnection) {
  Rig rig("tcp");
  const std::string too_big(kMaxNotificationBytes + 1, 'x');
  const Bytes cases[] = {
      encode_ctrl_frame(CtrlType::MSG, {1, 2, 3}),               // short
      encode_ctrl_frame(CtrlType::MSG, msg_body(1, 0, "x", 1)),  // id 0
      encode_ctrl_frame(CtrlType::MSG, msg_body(1, 5, too_big.data(), too_big.size())),
      encode_ctrl_frame(CtrlType::MSG_ACK, msg_ack_body(1, MsgAck::TAKEN)),  // not ours to send
  };
  for (const Bytes& c : cases) {
    int fd = dial(rig.ctrl_port);
    ASSERT_GE(fd, 0);
    CtrlHandshake hs;
    ASSERT_TRUE(rig.ctrl_login(fd, hs));
    const uint64_t before = rig.rejected();
    send_raw(fd, c);
    EXPECT_TRUE(eventually([&] { return closed_by_peer(fd); })) << c.size();
    EXPECT_GT(rig.rejected(), before);
    close(fd);
  }
  EXPECT_EQ(rig.tgt->stats().notifications_received, 0u);
  EXPECT_TRUE(rig.good_transfer(9));
}

TEST(HostileControlPlane, NotifyFloodThatNeverReadsItsAnswersIsCut) {
  // Every NOTIFY is answered (NOTIFY_ACK). A peer that sends them as fast as
  // the target reads and never reads an answer must not block the target's
  // I/O thread on a full socket, nor make it keep the answers: once one does
  // not fit, the connection is closed. The good peer is served meanwhile.
  Rig rig("tcp");
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  int small = 4096;  // our receive buffer: the answers fill it soon
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  CtrlHandshake hs;
  ASSERT_TRUE(rig.ctrl_login(fd, hs));
  const uint64_t before = rig.rejected();
  const uint64_t life = rig.tgt->desc().instance;
  bool cut = false;
  for (uint64_t uid = 1; uid <= 2000000 && !cut; uid += 4096) {
    Bytes batch;
    for (uint64_t i = 0; i < 4096; ++i) {
      Bytes f = encode_ctrl_frame(CtrlType::NOTIFY, notify_body(uid + i, 0, life));
      batch.insert(batch.end(), f.begin(), f.end());
    }
    cut = send(fd, batch.data(), batch.size(), MSG_NOSIGNAL) < 0;
  }
  EXPECT_TRUE(cut || closed_by_peer(fd)) << "a sender that reads no answers must be cut";
  EXPECT_GT(rig.rejected(), before);
  close(fd);
  EXPECT_TRUE(rig.good_transfer(12)) << "the I/O thread is not stuck";
}

TEST(HostileControlPlane, NotifiesNamingAnotherLifeAreNotTaken) {
  // A NOTIFY says which life of the target the transfer went to: a resend
  // that reaches a new life of the engine (the data went to the one before)
  // is answered OTHER_LIFE and not recorded.
  Rig rig("tcp");
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  CtrlHandshake hs;
  ASSERT_TRUE(rig.ctrl_login(fd, hs));
  const uint64_t life = rig.tgt->desc().instance;
  auto ask = [&](uint64_t uid, uint64_t target_life, NotifyAck* ack) {
    send_raw(fd, encode_ctrl_frame(CtrlType::NOTIFY, notify_body(uid, 0, target_life)));
    CtrlFrame f;
    uint64_t got = 0;
    return read_ctrl(fd, f) && f.type == CtrlType::NOTIFY_ACK &&
           decode_notify_ack(f.body, got, *ack) && got == uid;
  };
  NotifyAck ack;
  for (uint64_t other : {life + 1, uint64_t{0}}) {
    ASSERT_TRUE(ask(31, other, &ack));
    EXPECT_EQ(ack, NotifyAck::OTHER_LIFE);
  }
  EXPECT_FALSE(rig.tgt->pop_inbound_transfer_status("good", 31)) << "recorded for another life";
  ASSERT_TRUE(ask(32, life, &ack));
  EXPECT_EQ(ack, NotifyAck::TAKEN);
  ASSERT_TRUE(ask(32, life, &ack)) << "a resend";
  EXPECT_EQ(ack, NotifyAck::TAKEN);
  close(fd);
  EXPECT_TRUE(rig.tgt->pop_inbound_transfer_status("good", 32));
  EXPECT_FALSE(rig.tgt->pop_inbound_transfer_status("good", 32)) << "a resend is taken once";
  EXPECT_EQ(rig.tgt->stats().inbound_notifications, 1u);
}

TEST(HostileControlPlane, OutOfDescriptorsTheEngineIdlesAndRecovers) {
  // Connections waiting in the backlogs of the control plane and of a tcp
  // listener while this process has no descriptor left: accept() fails with
  // EMFILE until one is freed. The engine must not spin on it (it did: 100% of a
  // core, ~5,900 failing accept4 per second), and must serve again once
  // descriptors are back.
  Rig rig("tcp");
  ASSERT_TRUE(rig.good_transfer(9));
  DescriptorsExhausted out(64);
  ASSERT_TRUE(out.ok());
  std::vector<int> clients;
  for (int i = 0; i < 8; ++i) clients.push_back(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(out.Fill());
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (size_t i = 0; i < clients.size(); ++i) {
    a.sin_port = htons(i % 2 ? rig.tcp_port : rig.ctrl_port);
    ASSERT_EQ(connect(clients[i], reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << i;
  }
  rusage r0{}, r1{};
  getrusage(RUSAGE_SELF, &r0);
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(2s);  // the measured interval, not an ordering
  getrusage(RUSAGE_SELF, &r1);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  const double cpu = secs(r1.ru_utime) - secs(r0.ru_utime) + secs(r1.ru_stime) - secs(r0.ru_stime);
  ASSERT_TRUE(out.Release());
  std::printf("RESULT emfile cpu=%.3f s over %.2f s (%.1f%%)\n", cpu, wall, 100 * cpu / wall);
  EXPECT_LT(cpu, 0.10 * wall) << "the engine spun while out of descriptors";
  for (int fd : clients) close(fd);
  EXPECT_TRUE(rig.good_transfer(10)) << "no recovery once descriptors were free";
}

TEST(HostileCma, APeerWhoseProcessCannotBeHeldIsNotUsed) {
  // cma holds a peer's process by a pidfd, so a later process with the same
  // pid is never taken for it. When pidfd_open failed (here: no descriptor
  // left) the peer was added all the same, every liveness check then said
  // "alive", and a reused pid took our WRITEs. Now it is not added for cma,
  // saying why, and a transfer to it does not go over cma.
  Rig rig("cma");
  EngineConfig c;
  c.auth_token = kToken;
  Engine late("late", c);
  ASSERT_TRUE(late.add_backend("cma"));
  std::vector<uint8_t> mem(kRegion);
  const MemoryDesc lm = late.register_memory(mem.data(), mem.size());
  DescriptorsExhausted out(16);
  ASSERT_TRUE(out.ok());
  ASSERT_TRUE(out.Fill());
  const Result r = late.register_remote_engine(rig.tgt->desc());
  ASSERT_TRUE(out.Release());
  ASSERT_TRUE(r) << r.message;
  ASSERT_TRUE(rig.tgt->register_remote_engine(late.desc()));
  TransferStatus w = late.write(lm, 0, rig.tdesc, 0, 4096, late.allocate_transfer_uid(), false);
  ASSERT_TRUE(w.WaitFor(20s));
  EXPECT_FALSE(w.Succeeded()) << "went over cma without a hold on the target's process";
  EXPECT_NE(w.Message().find("cma"), std::string::npos) << w.Message();
}

TEST(HostileControlPlane, AFloodOfBadConnectionsIsNotAFloodOfLogLines) {
  // 500 connections of garbage from one address: each is refused and counted,
  // but at most 20 refusals per 10 s per address reach the log (84 MB of log
  // for 1M bad frames before).
  Rig rig("tcp");
  LogCapture log;
  const uint64_t before = rig.rejected();
  constexpr int kBad = 500;
  for (int i = 0; i < kBad; ++i) {
    int fd = dial(rig.ctrl_port);
    ASSERT_GE(fd, 0) << i;
    send_raw(fd, Bytes(64, 0xa5));
    EXPECT_TRUE(closed_by_peer(fd));
    close(fd);
  }
  EXPECT_TRUE(eventually([&] { return rig.rejected() >= before + kBad; }))
      << "rejected " << rig.rejected() - before << " of " << kBad;
  const size_t lines = log.count("bad magic");
  std::printf("RESULT refusal_log connections=%d logged=%zu\n", kBad, lines);
  EXPECT_GE(lines, 1u) << "refusals must still be logged";
  EXPECT_LE(lines, 20u) << log.text().substr(0, 2000);
  log.restore();
  EXPECT_TRUE(rig.good_transfer(13));
}

TEST(HostileControlPlane, FloodOfConnectionsWhileAGoodPeerIsServed) {
  // cma notifies over the control plane, so the good peer's first transfer has
  // to complete a control-plane handshake in the middle of the flood.
  Rig rig("cma");
  const size_t fds_before = open_fds();
  constexpr int kFlood = 200;
  LogCapture log;
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    int fd = dial(rig.ctrl_port);
    ASSERT_GE(fd, 0) << "connection " << i;
    if (i % 4 == 1) send_raw(fd, ctrl_header(1, 200));                 // a header, body never sent
    if (i % 4 == 2) send_raw(fd, Bytes(64, static_cast<uint8_t>(i)));  // junk
    if (i % 4 == 3) {
      const uint8_t nc[kCtrlNonceSize] = {};
      send_raw(fd, encode_ctrl_frame(CtrlType::HELLO, hello_body("good", nc, kHelloHasToken)));
    }
    flood.push_back(fd);
    if (i == kFlood / 2) {
      EXPECT_TRUE(rig.good_transfer(10));  // served during the flood
    }
  }
  EXPECT_TRUE(rig.good_transfer(11));
  for (int fd : flood) close(fd);
  // Each flood connection is refused exactly once: evicted, rejected, or closed unadmitted.
  EXPECT_TRUE(eventually([&] { return rig.rejected() >= kFlood; })) << rig.rejected();
  EXPECT_TRUE(log.has("connections are in the handshake"));
  log.restore();
  EXPECT_TRUE(rig.good_transfer(12));
  EXPECT_TRUE(eventually([&] { return open_fds() <= fds_before + 2; }))
      << open_fds() << " fds open, " << fds_before << " before the flood";
}

// ---- tcp data lanes ---------------------------------------------------------------

// ---- holders of the target's descriptor claiming keys ----------------------

// A holder of the target's descriptor (its secret) logging in as `key` with a
// secret of its own that the target does not know: admitted only to present
// its descriptor (HELLO_OK asks for it), sealed over `tc`.
struct Claim {
  std::vector<uint8_t> tc;  // the client transcript its proof covered
  uint8_t flags = 0;        // HELLO_OK's
};

bool claim_key(const Rig& rig, int fd, const std::string& key, const auth::InstanceSecret& own,
               Claim* out) {
  auth::Nonce nc{}, ns{};
  auth::random_bytes(nc.data(), nc.size());
  send_raw(fd, encode_ctrl_frame(CtrlType::HELLO, hello_body(key, nc.data(), kHelloHasToken)));
  CtrlFrame f;
  uint8_t server[kCtrlProofSize];
  if (!read_ctrl(fd, f) || !decode_challenge(f.body, ns.data(), server)) return false;
  out->tc = auth::ctrl_transcript("ferry-ctrl-v2 client", nc, ns, key, "hostile-tgt");
  send_raw(fd, encode_ctrl_frame(CtrlType::AUTH_PROOF,
                                 proof_body(link_proof(rig.tgt_secret, own, out->tc).data())));
  return read_ctrl(fd, f) && f.type == CtrlType::HELLO_OK && decode_hello_ok(f.body, &out->flags);
}

Bytes peer_desc_frame(const Rig& rig, const Claim& c, const std::string& key,
                      const auth::InstanceSecret& own) {
  EngineDesc d;
  d.key = key;
  d.host = "127.0.0.1";
  d.port = 9;
  d.node_id = "elsewhere";
  d.pid = 1;
  d.instance = 77;
  d.secret = own;
  Bytes sealed;
  auth::seal(rig.tgt_secret, kToken, c.tc, d.pack(), &sealed);
  return encode_ctrl_frame(CtrlType::PEER_DESC, sealed);
}

// Claims `key` and presents its descriptor: learned by the target (one-way
// registration), as any holder of the descriptor may be.
bool learned_as(const Rig& rig, int fd, const std::string& key) {
  const auth::InstanceSecret own = random_secret();
  Claim c;
  if (!claim_key(rig, fd, key, own, &c) || !(c.flags & kHelloOkSendDesc)) return false;
  // The descriptor, then a message of that life: its answer (TAKEN) says
  // the key was learned and the connection is open.
  send_raw(fd, cat({peer_desc_frame(rig, c, key, own),
                    encode_ctrl_frame(CtrlType::MSG, msg_body(77, 1, "hi", 2))}));
  CtrlFrame f;
  uint64_t id = 0;
  MsgAck ack = MsgAck::STALE;
  return read_ctrl(fd, f) && decode_msg_ack(f.body, id, ack) && ack == MsgAck::TAKEN;
}

TEST(HostileControlPlane, AHolderOfOurDescriptorCannotSpeakForAKeyRegisteredMeanwhile) {
  // Mallory holds the target's descriptor, claims "p" while "p" is unknown,
  // and holds back her descriptor until the application registered the real
  // "p"; then presents her own under that key. She was kept as "p": her
  // NOTIFYs landed as p's, and a FENCE of p's message ids broke p's messages.
  Rig rig("tcp");
  EngineConfig c;
  c.auth_token = kToken;
  c.timeout = 10s;
  Engine p("p", c);
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  const auth::InstanceSecret mine = random_secret();
  Claim claim;
  ASSERT_TRUE(claim_key(rig, fd, "p", mine, &claim));
  ASSERT_TRUE(claim.flags & kHelloOkSendDesc);
  ASSERT_TRUE(rig.tgt->register_remote_engine(p.desc()));
  ASSERT_TRUE(p.register_remote_engine(rig.tgt->desc()));
  send_raw(
      fd,
      cat({peer_desc_frame(rig, claim, "p", mine),
           encode_ctrl_frame(CtrlType::NOTIFY, notify_body(4242, 0, rig.tgt->desc().instance))}));
  EXPECT_TRUE(closed_by_peer(fd)) << "a connection claiming a registered key under another secret";
  close(fd);
  EXPECT_FALSE(rig.tgt->pop_inbound_transfer_status("p", 4242)) << "taken as p's";
  TransferStatus m = p.send_notification("hostile-tgt", "the real p");
  ASSERT_TRUE(m.WaitFor(10s));
  EXPECT_TRUE(m.Succeeded()) << m.Message();
  EXPECT_TRUE(rig.good_transfer(11));
}

TEST(HostileControlPlane, AConnectionWhoseKeyCannotBeLearnedIsClosed) {
  // The target's own key: never learned; nothing sent under it is taken.
  Rig rig("tcp");
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  const auth::InstanceSecret mine = random_secret();
  Claim claim;
  ASSERT_TRUE(claim_key(rig, fd, "hostile-tgt", mine, &claim));
  send_raw(
      fd, cat({peer_desc_frame(rig, claim, "hostile-tgt", mine),
               encode_ctrl_frame(CtrlType::NOTIFY, notify_body(31, 0, rig.tgt->desc().instance))}));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  EXPECT_EQ(rig.tgt->stats().inbound_notifications, 0u);
}

TEST(HostileControlPlane, AnUndescribedConnectionIsStillInTheHandshake) {
  // Admitted only to present its descriptor, a connection is still in the
  // handshake: a frame larger than a descriptor is refused at once, and one
  // that sends nothing is closed at the handshake's deadline (5 s). They
  // stayed open, each allowed 1 MiB frames (150 held 152 MiB).
  Rig rig("tcp");
  int big = dial(rig.ctrl_port), idle = dial(rig.ctrl_port);
  ASSERT_GE(big, 0);
  ASSERT_GE(idle, 0);
  Claim a, b;
  ASSERT_TRUE(claim_key(rig, big, "k0", random_secret(), &a));
  ASSERT_TRUE(claim_key(rig, idle, "k1", random_secret(), &b));
  const auto t0 = std::chrono::steady_clock::now();
  send_raw(big, ctrl_header(static_cast<uint8_t>(CtrlType::PLUGIN), kMaxCtrlBody));
  EXPECT_TRUE(closed_by_peer(big)) << "a 1 MiB frame before the descriptor";
  close(big);
  timeval tv{12, 0};
  setsockopt(idle, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  EXPECT_TRUE(closed_by_peer(idle)) << "an undescribed connection outlived the handshake";
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  close(idle);
  std::printf("RESULT undescribed closed after %lld ms\n", static_cast<long long>(took.count()));
  EXPECT_LT(took, 8s);
}

TEST(HostileControlPlane, OnePeersStreamOfFramesDoesNotStarveTheOthers) {
  // A learned peer streams NOTIFYs faster than the target handles them. The
  // control plane's one I/O thread read it until its socket ran dry - never:
  // the good peer's messages got no answer to their HELLO (10 of 10 failed).
  Rig rig("tcp");
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(learned_as(rig, fd, "streamer"));
  AnswerDrain drain(fd);  // it reads its answers (one that does not is cut)
  std::atomic<bool> stop{false};
  std::thread flood([&] {
    // One batch made once; each round only renumbers its uids (as fast as
    // the socket takes them).
    const Bytes one =
        encode_ctrl_frame(CtrlType::NOTIFY, notify_body(1, 0, rig.tgt->desc().instance));
    const size_t uid_at = kCtrlHeaderSize;  // the body starts with the uid
    Bytes batch;
    for (int i = 0; i < 4096; ++i) batch.insert(batch.end(), one.begin(), one.end());
    uint64_t uid = 1;
    while (!stop) {
      for (size_t off = 0; off < batch.size(); off += one.size(), ++uid)
        std::memcpy(batch.data() + off + uid_at, &uid, sizeof uid);
      if (send(fd, batch.data(), batch.size(), MSG_NOSIGNAL) < 0) break;
    }
  });
  EXPECT_TRUE(eventually([&] { return rig.tgt->stats().inbound_notifications > 100000; }, 30s));
  int failed = 0;
  for (int i = 0; i < 5; ++i) {
    TransferStatus m = rig.good->send_notification("hostile-tgt", "m" + std::to_string(i));
    if (!m.WaitFor(20s) || !m.Succeeded()) ++failed;
  }
  stop = true;
  shutdown(fd, SHUT_RDWR);
  flood.join();
  close(fd);
  EXPECT_EQ(failed, 0) << "the good peer's messages while another streamed";
}

TEST(HostileControlPlane, AFenceFloodDoesNotHoldUpAnotherPeersFence) {
  // A learned peer with a 4 KiB receive buffer sends 70 FENCEs of 4,096
  // entries and never reads the replies. Another peer's one FENCE waited
  // behind them all (not answered within 40 s): the queue was shared and a
  // reply could wait 5 s to be written. Now each peer has at most 4 queued,
  // they are served in turn, and a reply waits at most 1 s.
  Rig rig("tcp");
  int flooder = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int small = 4096;
  setsockopt(flooder, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(rig.ctrl_port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(flooder, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  timeval tv{10, 0};
  setsockopt(flooder, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ASSERT_TRUE(learned_as(rig, flooder, "fencer"));
  std::vector<FenceEntry> many;
  for (uint64_t i = 1; i <= 4096; ++i) many.push_back({"zz", i});
  const uint64_t instance = rig.tgt->desc().instance;
  const Bytes one = encode_ctrl_frame(CtrlType::FENCE, fence_body(1, instance, many));
  for (int i = 0; i < 70; ++i) send_raw(flooder, one);
  int other = dial(rig.ctrl_port);
  ASSERT_GE(other, 0);
  ASSERT_TRUE(learned_as(rig, other, "asker"));
  const auto t0 = std::chrono::steady_clock::now();
  send_raw(other, encode_ctrl_frame(CtrlType::FENCE, fence_body(2, instance, {{"zz", 1}})));
  CtrlFrame f;
  const bool answered = read_ctrl(other, f) && f.type == CtrlType::FENCE_REPLY;
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  std::printf("RESULT fence_flood other peer answered=%d after %lld ms\n", answered ? 1 : 0,
              static_cast<long long>(took.count()));
  EXPECT_TRUE(answered) << "another peer's FENCE behind a flood";
  EXPECT_LT(took, 8s);
  close(flooder);
  close(other);
}

TEST(HostileControlPlane, AFenceMeantForAnotherLifeAppliesNothing) {
  // A FENCE names the life of the target it means; one for another (an
  // earlier life) is answered with this life's instance and fences nothing
  // here (the initiator reads that as "gone"). It was applied all the same.
  Rig rig("tcp");
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(learned_as(rig, fd, "old-life-asker"));
  const uint64_t instance = rig.tgt->desc().instance;
  send_raw(fd, encode_ctrl_frame(CtrlType::FENCE, fence_body(5, instance + 1, {{"tcp", 1}})));
  CtrlFrame f;
  ASSERT_TRUE(read_ctrl(fd, f));
  ASSERT_EQ(f.type, CtrlType::FENCE_REPLY);
  uint64_t req = 0, inst = 0;
  std::vector<FenceResult> results;
  ASSERT_TRUE(decode_fence_reply(f.body, req, inst, results));
  EXPECT_EQ(req, 5u);
  EXPECT_EQ(inst, instance);
  EXPECT_TRUE(results.empty()) << "fenced for another life";
  close(fd);
}

TEST(HostileControlPlane, MalformedFencesCloseTheConnection) {
  Rig rig("tcp");
  LogCapture log;
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(learned_as(rig, fd, "bad-fencer"));
  const Bytes bad = encode_ctrl_frame(CtrlType::FENCE, Bytes(20, 0));  // no entry
  Bytes batch;
  for (int i = 0; i < 1000; ++i) batch.insert(batch.end(), bad.begin(), bad.end());
  send_raw(fd, batch);
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  EXPECT_LE(log.count("FENCE"), 1u) << "a line per malformed FENCE";
  EXPECT_TRUE(rig.good_transfer(13));
}

TEST(HostileControlPlane, AnAnswerTrickledAByteAtATimeEndsAtTheDeadline) {
  // Something at a registered peer's address answers the HELLO one byte
  // every 300 ms. Each recv waited the whole timeout anew, so a message
  // with a 2 s deadline was still waiting after 40 s.
  int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(ls, 4), 0);
  socklen_t al = sizeof a;
  getsockname(ls, reinterpret_cast<sockaddr*>(&a), &al);
  EngineConfig c;
  c.timeout = 2s;
  Engine e("trickled", c);
  EngineDesc slow;
  slow.key = "slow";
  slow.host = "127.0.0.1";
  slow.port = ntohs(a.sin_port);
  slow.node_id = "elsewhere";
  slow.pid = 1;
  slow.instance = 5;
  slow.secret = random_secret();
  ASSERT_TRUE(e.register_remote_engine(slow));
  std::atomic<bool> stop{false};
  std::thread server([&] {
    pollfd pf{ls, POLLIN, 0};
    if (poll(&pf, 1, 10000) <= 0) return;
    int conn = accept(ls, nullptr, nullptr);
    const Bytes frame = encode_ctrl_frame(CtrlType::AUTH_CHALLENGE, Bytes(96, 1));
    for (size_t i = 0; i < frame.size() && !stop; ++i) {
      if (send(conn, &frame[i], 1, MSG_NOSIGNAL) != 1) break;
      pollfd q{conn, POLLIN, 0};
      poll(&q, 1, 300);  // the pace; a close by the engine ends it sooner
      char ch;
      if ((q.revents & POLLIN) && recv(conn, &ch, 1, MSG_DONTWAIT) == 0) break;
    }
    close(conn);
  });
  const auto t0 = std::chrono::steady_clock::now();
  TransferStatus m = e.send_notification("slow", "x");
  const bool ended = m.WaitFor(30s);
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  stop = true;
  server.join();
  close(ls);
  std::printf("RESULT trickled answer: ended=%d after %lld ms\n", ended ? 1 : 0,
              static_cast<long long>(took.count()));
  EXPECT_TRUE(ended);
  EXPECT_FALSE(m.Succeeded());
  EXPECT_LT(took, 10s);
}

Bytes lane_frame(const tw::Header& h, const std::vector<tw::Item>& items, const Bytes& payload) {
  return cat({tw::EncodeFrameHead(h, items), payload});
}

Bytes lane_hello(const std::string& key, bool auth) {
  tw::Header h;
  h.type = tw::Type::kHello;
  h.flags = auth ? tw::kFlagAuth : 0;
  h.payload_len = key.size();
  return lane_frame(h, {}, Bytes(key.begin(), key.end()));
}

Bytes lane_auth(const uint8_t* p, size_t n) {
  tw::Header h;
  h.type = tw::Type::kAuth;
  h.payload_len = n;
  return lane_frame(h, {}, Bytes(p, p + n));
}

// Reads one response frame; payload into *payload.
bool read_lane(int fd, tw::Header* h, Bytes* payload) {
  uint8_t hb[tw::kHeaderSize];
  std::string why;
  if (!recv_exact(fd, hb, sizeof hb) || !tw::DecodeHeader(hb, h, &why)) return false;
  payload->resize(h->payload_len);
  return recv_exact(fd, payload->data(), payload->size());
}

std::string lane_refusal(int fd) {
  tw::Header h;
  Bytes text;
  if (!read_lane(fd, &h, &text) || h.type != tw::Type::kError) return "<no ERROR>";
  return std::string(text.begin(), text.end());
}

// The honest lane handshake as `key` with `token`; false if the target refused.
struct LaneLogin {
  uint8_t ni[32], nt[32];
  Bytes sent;  // everything the client sent, for replays
};
// `tgt` and `self`: the instance secrets the client holds (the target's
// descriptor and its own).
bool lane_login(int fd, LaneLogin& l, const auth::InstanceSecret& tgt,
                const auth::InstanceSecret& self, const std::string& key = "good",
                const std::string& token = kToken) {
  auth::random_bytes(l.ni, sizeof l.ni);
  l.sent = cat({lane_hello(key, true), lane_auth(l.ni, sizeof l.ni)});
  send_raw(fd, l.sent);
  tw::Header h;
  Bytes p;
  if (!read_lane(fd, &h, &p) || h.type != tw::Type::kAuth || p.size() != 96) return false;
  std::memcpy(l.nt, p.data(), 32);
  auto t = tw::AuthTranscript(tw::kAuthTargetLabel, l.ni, l.nt, key, "hostile-tgt");
  if (std::memcmp(link_proof(tgt, tgt, t, token, auth::kTargetRole).data(), p.data() + 32, 32) != 0)
    return false;  // the target did not prove its descriptor
  t = tw::AuthTranscript(tw::kAuthInitiatorLabel, l.ni, l.nt, key, "hostile-tgt");
  Bytes proof = lane_auth(link_proof(tgt, self, t, token).data(), 64);
  send_raw(fd, proof);
  l.sent.insert(l.sent.end(), proof.begin(), proof.end());
  return true;
}

tw::Header request(tw::Type type, uint64_t req, uint64_t region, uint64_t key, uint64_t payload,
                   uint32_t items = 1) {
  tw::Header h;
  h.type = type;
  h.n_items = items;
  h.frame_count = 1;
  h.req_id = req;
  h.region_id = region;
  h.region_key = key;
  h.payload_len = payload;
  h.xfer_seq = req;
  h.low_seq = req;
  return h;
}

TEST(HostileDataLane, MalformedAndUnauthenticatedLanesAreRefused) {
  Rig rig("tcp");
  ASSERT_GT(rig.tcp_port, 0);
  LogCapture log;
  struct Case {
    const char* name;
    std::function<void(int)> attack;
    const char* logged;
  } cases[] = {
      {"truncated header",
       [](int fd) {
         Bytes h = lane_hello("good", true);
         h.resize(30);
         send_raw(fd, h);
         shutdown(fd, SHUT_WR);
       },
       "before HELLO"},
      {"huge key length",
       [](int fd) {
         tw::Header h;
         h.type = tw::Type::kHello;
         h.payload_len = 1ull << 40;
         send_raw(fd, tw::EncodeFrameHead(h, {}));
       },
       "key length"},
      {"unknown type",
       [](int fd) {
         Bytes h = lane_hello("good", true);
         h[5] = 99;
         send_raw(fd, h);
       },
       "unknown frame type 99"},
      {"request before hello",
       [](int fd) {
         send_raw(fd, lane_frame(request(tw::Type::kRead, 1, 1, 0, 0), {{0, 16}}, {}));
       },
       "before HELLO"},
      {"an engine without the descriptor",
       [&](int fd) {
         LaneLogin l;
         // It cannot check the target's proof either; it answers anyway.
         l.sent.clear();
         uint8_t ni[32] = {3};
         send_raw(fd, cat({lane_hello("mallory", true), lane_auth(ni, 32)}));
         tw::Header h;
         Bytes p;
         ASSERT_TRUE(read_lane(fd, &h, &p));
         send_raw(fd, lane_auth(link_proof(random_secret(), random_secret(), {1}).data(), 64));
         EXPECT_NE(lane_refusal(fd).find("does not hold this engine's current descriptor"),
                   std::string::npos);
       },
       "'mallory' does not hold this engine's current descriptor"},
      {"no proof (an old peer)",
       [](int fd) {
         send_raw(fd,
                  cat({lane_hello("good", false), lane_frame(request(tw::Type::kWrite, 1, 1, 0, 8),
                                                             {{0, 8}}, Bytes(8, 0xee))}));
         EXPECT_NE(lane_refusal(fd).find("did not prove access by descriptor"), std::string::npos);
       },
       "did not prove access by descriptor"},
      {"wrong token",
       [&](int fd) {
         LaneLogin l;
         // The target cannot prove it under this token, so the client gives up.
         EXPECT_FALSE(lane_login(fd, l, rig.tgt_secret, rig.good_secret, "good", "not-the-token"));
         shutdown(fd, SHUT_WR);
       },
       "auth handshake"},
      {"forged proof",
       [&](int fd) {
         uint8_t ni[32] = {1};
         send_raw(fd, cat({lane_hello("good", true), lane_auth(ni, 32)}));
         tw::Header h;
         Bytes p;
         ASSERT_TRUE(read_lane(fd, &h, &p));
         uint8_t forged[64] = {2};
         send_raw(fd, lane_auth(forged, 64));
         EXPECT_NE(lane_refusal(fd).find("does not hold"), std::string::npos);
       },
       "'good' does not hold this engine's current descriptor"},
      {"a registered key claimed without its secret",
       [&](int fd) {
         LaneLogin l;
         // The target's descriptor, but not good's: the second half fails.
         EXPECT_TRUE(lane_login(fd, l, rig.tgt_secret, random_secret()));
         EXPECT_NE(lane_refusal(fd).find("claims the key of registered engine 'good'"),
                   std::string::npos);
       },
       "claims the key of registered engine 'good'"},
  };
  for (auto& c : cases) {
    SCOPED_TRACE(c.name);
    const size_t logged = log.count(c.logged);
    int fd = dial(rig.tcp_port);
    ASSERT_GE(fd, 0);
    c.attack(fd);
    EXPECT_TRUE(closed_by_peer(fd));
    close(fd);
    EXPECT_TRUE(eventually([&] { return log.count(c.logged) > logged; }))
        << "no log line with '" << c.logged << "'";
  }
  log.restore();
  EXPECT_TRUE(rig.good_transfer(20));
}

TEST(HostileControlPlane, ClaimedKeysCannotForgeLogLinesOrEscapes) {
  // A key with a newline, a forged log line after it and a terminal escape, on
  // the control plane and on a tcp lane: the engine logs it escaped, on one line.
  Rig rig("tcp");
  const std::string evil = "mallory\nferry[error] core: forged line\x1b[2J";
  LogCapture log;
  int fd = dial(rig.ctrl_port);
  ASSERT_GE(fd, 0);
  const uint8_t nc[kCtrlNonceSize] = {};
  // HELLO, then a proof that fails: the refusal names the claimed key.
  send_raw(fd, encode_ctrl_frame(CtrlType::HELLO, hello_body(evil, nc, kHelloHasToken)));
  CtrlFrame f;
  ASSERT_TRUE(read_ctrl(fd, f));
  send_raw(fd, encode_ctrl_frame(CtrlType::AUTH_PROOF, proof_body(Bytes(64, 1).data())));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  fd = dial(rig.tcp_port);
  ASSERT_GE(fd, 0);
  const uint8_t ni[32] = {};
  send_raw(fd, cat({lane_hello(evil, true), lane_auth(ni, 32)}));
  tw::Header h;
  Bytes p;
  ASSERT_TRUE(read_lane(fd, &h, &p));
  send_raw(fd, lane_auth(Bytes(64, 1).data(), 64));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  EXPECT_TRUE(eventually([&] {
    return log.has("mallory\\nferry[error] core: forged line\\x1b[2J");
  })) << log.text();
  const std::string text = log.text();
  EXPECT_EQ(text.find("\nferry[error] core: forged line"), std::string::npos) << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << "a raw escape reached the log";
  log.restore();
  EXPECT_TRUE(rig.good_transfer(8));
}

TEST(HostileDataLane, SlowlorisHandshakeIsClosedByItsDeadline) {
  // A lane HELLO sent one byte every 200 ms: each recv sees progress, but the
  // handshake as a whole must end by connect_timeout_ms (1 s here; it used to
  // stay open as long as the bytes kept coming).
  setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
  Engine tgt("slow-tgt");
  ASSERT_TRUE(tgt.add_backend("tcp", R"({"connect_timeout_ms": 1000})"));
  const EngineDesc d = tgt.desc();
  tw::ConnInfo ci;
  std::string why;
  ASSERT_TRUE(
      tw::DecodeConnBlob(d.backends.at("tcp").data(), d.backends.at("tcp").size(), &ci, &why));
  int fd = dial(ci.port);
  ASSERT_GE(fd, 0);
  const Bytes hello = lane_hello("good", false);
  const auto t0 = std::chrono::steady_clock::now();
  bool closed = false;
  for (size_t i = 0; i < hello.size() && !closed; ++i) {
    if (send(fd, &hello[i], 1, MSG_NOSIGNAL) != 1) closed = true;
    pollfd p{fd, POLLIN, 0};
    // The attacker's pace; the target's close shows as readable (EOF or RST).
    if (!closed && poll(&p, 1, 200) > 0) {
      char c;
      closed = recv(fd, &c, 1, MSG_DONTWAIT) <= 0;
    }
    if (std::chrono::steady_clock::now() - t0 > 10s) break;
  }
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  close(fd);
  std::printf("RESULT slowloris closed=%d after %lld ms\n", closed ? 1 : 0,
              static_cast<long long>(took.count()));
  EXPECT_TRUE(closed) << "the trickled handshake was still open after " << took.count() << " ms";
  EXPECT_LT(took, 1600ms);
}

TEST(HostileDataLane, StalledAdmittedLanesDoNotHoldTheIoThreads) {
  // The target serves admitted TCP lanes from a pool of I/O threads - one here.
  // Authenticated lanes that stop mid-frame (half a header, half a WRITE's
  // payload) or never read their READ data must not keep it from the good
  // peer, and the stalled ones are cut after io_timeout_ms.
  Rig rig("tcp", kToken, R"({"io_threads": 1, "io_timeout_ms": 1000, "same_host_rings": false})");
  const uint64_t id = rig.tdesc.id, key = rig.tkey;
  LogCapture log;
  int half_header = dial(rig.tcp_port), half_write = dial(rig.tcp_port),
      no_reader = dial(rig.tcp_port);
  // Initiators of their own (they hold the target's descriptor), so the good
  // peer's notification counts are not theirs to disturb.
  int n = 0;
  for (int fd : {half_header, half_write, no_reader}) {
    LaneLogin l;
    ASSERT_TRUE(
        lane_login(fd, l, rig.tgt_secret, random_secret(), "staller-" + std::to_string(n++)));
  }
  const auto t0 = std::chrono::steady_clock::now();
  Bytes w =
      lane_frame(request(tw::Type::kWrite, 1, id, key, 65536), {{0, 65536}}, Bytes(65536, 0x77));
  send_raw(half_header, Bytes(w.begin(), w.begin() + 10));
  send_raw(half_write, Bytes(w.begin(), w.begin() + static_cast<long>(w.size() / 2)));
  // READ requests for 64 MiB in all, never read: the target's sends stop once
  // the socket buffers are full.
  Bytes reads;
  for (uint64_t r = 0; r < 64; ++r) {
    Bytes f = lane_frame(request(tw::Type::kRead, 100 + r, id, key, 0), {{0, kRegion}}, {});
    reads.insert(reads.end(), f.begin(), f.end());
  }
  send_raw(no_reader, reads);
  EXPECT_TRUE(rig.good_transfer(31)) << "a stalled lane held the only I/O thread";
  EXPECT_TRUE(rig.good_transfer(32));
  EXPECT_TRUE(closed_by_peer(half_header));
  EXPECT_TRUE(closed_by_peer(half_write));
  const auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  std::printf("RESULT stalled lanes cut after %lld ms (io_timeout_ms 1000)\n",
              static_cast<long long>(took.count()));
  EXPECT_GE(took, 900ms) << "cut before its io_timeout";
  EXPECT_LT(took, 5000ms);
  EXPECT_TRUE(eventually([&] { return log.has("no progress within the I/O timeout"); }));
  // The lane that never reads is cut too, once its sends stop moving.
  EXPECT_TRUE(eventually([&] { return log.count("no progress within the I/O timeout") >= 3; }))
      << "the lane whose READ data was never read is still open";
  log.restore();
  for (int fd : {half_header, half_write, no_reader}) close(fd);
  EXPECT_TRUE(rig.good_transfer(33));
}

TEST(HostileDataLane, AdmittedLanesPerPeerAreCapped) {
  // 200 fully authenticated lanes claiming one peer: the target keeps at most
  // TargetPeer::kMaxLanesPerPeer (64) of them, shutting the oldest down, so the
  // threads and descriptors a peer can pin are bounded (it was one thread per
  // lane, without limit: 2,000 lanes were 2,009 threads).
  Rig rig("tcp");
  ASSERT_TRUE(rig.good_transfer(11));
  const size_t threads_before = test::thread_count();
  constexpr int kLanes = 200;
  constexpr size_t kCap = 64;
  std::vector<int> lanes;
  for (int i = 0; i < kLanes; ++i) {
    int fd = dial(rig.tcp_port);
    ASSERT_GE(fd, 0) << i;
    LaneLogin l;
    ASSERT_TRUE(lane_login(fd, l, rig.tgt_secret, rig.good_secret)) << i;
    lanes.push_back(fd);
  }
  auto shut = [&] {
    size_t n = 0;
    for (int fd : lanes) {
      pollfd p{fd, POLLIN, 0};
      char c;
      if (poll(&p, 1, 0) > 0 && recv(fd, &c, 1, MSG_DONTWAIT) == 0) ++n;
    }
    return n;
  };
  // The good engine's own lanes count too: at least kLanes - kCap of ours go.
  EXPECT_TRUE(eventually([&] { return shut() >= kLanes - kCap; }))
      << shut() << " of " << kLanes << " lanes were shut down";
  EXPECT_TRUE(eventually([&] { return test::thread_count() <= threads_before + kCap + 4; }))
      << "threads " << threads_before << " -> " << test::thread_count();
  std::printf("RESULT lanes_per_peer opened=%d shut=%zu threads %zu -> %zu\n", kLanes, shut(),
              threads_before, test::thread_count());
  for (int fd : lanes) close(fd);
  EXPECT_TRUE(rig.good_transfer(12)) << "the real peer could not work after the flood";
}

TEST(HostileDataLane, ReplayedHandshakeIsRefused) {
  Rig rig("tcp");
  LaneLogin l;
  int fd = dial(rig.tcp_port);
  ASSERT_TRUE(lane_login(fd, l, rig.tgt_secret, rig.good_secret));
  close(fd);
  LogCapture log;
  fd = dial(rig.tcp_port);
  send_raw(fd, l.sent);  // the old nonce and proof, blindly
  tw::Header h;
  Bytes p;
  ASSERT_TRUE(read_lane(fd, &h, &p));
  ASSERT_EQ(h.type, tw::Type::kAuth);
  EXPECT_NE(std::memcmp(p.data(), l.nt, 32), 0) << "target nonces must not repeat";
  EXPECT_NE(lane_refusal(fd).find("does not hold"), std::string::npos);
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  EXPECT_TRUE(eventually([&] { return log.has("'good' does not hold"); }));
  log.restore();
  EXPECT_TRUE(rig.good_transfer(21));
}

TEST(HostileDataLane, OutOfRangeAndForeignMemoryAreRefusedOnAnAuthenticatedLane) {
  Rig rig("tcp");
  // A second region, deregistered: its id is no longer served.
  std::vector<uint8_t> gone(4096);
  MemoryDesc gone_desc = rig.tgt->register_memory(gone.data(), gone.size());
  ASSERT_TRUE(rig.tgt->deregister_memory(gone_desc));
  const uint64_t id = rig.tdesc.id, key = rig.tkey;
  std::fill(rig.tmem.begin(), rig.tmem.end(), 0);
  uint64_t guess = 0;
  auth::random_bytes(reinterpret_cast<uint8_t*>(&guess), sizeof guess);

  int fd = dial(rig.tcp_port);
  LaneLogin l;
  ASSERT_TRUE(lane_login(fd, l, rig.tgt_secret, rig.good_secret));
  LogCapture log;
  struct Req {
    const char* name;
    tw::Header h;
    std::vector<tw::Item> items;
    Bytes payload;
    const char* refused;  // nullptr: must succeed
  } reqs[] = {
      {"write past the end",
       request(tw::Type::kWrite, 1, id, key, 16),
       {{kRegion - 8, 16}},
       Bytes(16, 0x11),
       "outside memory"},
      {"offset that wraps",
       request(tw::Type::kRead, 2, id, key, 0),
       {{~0ull - 7, 16}},
       {},
       "outside memory"},
      {"read of unregistered id",
       request(tw::Type::kRead, 3, 9999, key, 0),
       {{0, 16}},
       {},
       "is not registered"},
      {"write to deregistered id",
       request(tw::Type::kWrite, 4, gone_desc.id, key, 8),
       {{0, 8}},
       Bytes(8, 0x22),
       "is not registered"},
      {"read of an id this target never exported",
       request(tw::Type::kRead, 5, id + 100, key, 0),
       {{0, 8}},
       {},
       "is not registered"},
      {"write with the region's id and a guessed key",
       request(tw::Type::kWrite, 8, id, guess, 8),
       {{0, 8}},
       Bytes(8, 0x33),
       "is not registered"},
      {"read with the region's id and no key",
       request(tw::Type::kRead, 9, id, 0, 0),
       {{0, 8}},
       {},
       "is not registered"},
      {"write with the key and a guessed id",
       request(tw::Type::kWrite, 10, guess, key, 8),
       {{0, 8}},
       Bytes(8, 0x44),
       "is not registered"},
      {"good write", request(tw::Type::kWrite, 6, id, key, 8), {{64, 8}}, Bytes(8, 0x5c), nullptr},
  };
  for (auto& r : reqs) {
    SCOPED_TRACE(r.name);
    send_raw(fd, lane_frame(r.h, r.items, r.payload));
    tw::Header resp;
    Bytes p;
    ASSERT_TRUE(read_lane(fd, &resp, &p)) << "the lane must stay open after a refused request";
    EXPECT_EQ(resp.req_id, r.h.req_id);
    if (r.refused) {
      ASSERT_EQ(resp.type, tw::Type::kError);
      EXPECT_NE(std::string(p.begin(), p.end()).find(r.refused), std::string::npos)
          << std::string(p.begin(), p.end());
    } else {
      EXPECT_EQ(resp.type, tw::Type::kWriteAck);
    }
  }
  EXPECT_EQ(std::count(rig.tmem.begin(), rig.tmem.end(), 0), static_cast<long>(kRegion - 8))
      << "only the good write may have changed the target's memory";
  EXPECT_EQ(rig.tmem[64], 0x5c);
  EXPECT_TRUE(std::all_of(gone.begin(), gone.end(), [](uint8_t b) { return b == 0; }));

  // Malformed after authentication: the lane is closed, the engine carries on.
  send_raw(fd, lane_frame(request(tw::Type::kWrite, 7, id, key, 1ull << 60), {{0, 8}}, {}));
  EXPECT_TRUE(closed_by_peer(fd));
  close(fd);
  EXPECT_TRUE(eventually([&] { return log.has("malformed frame"); }));
  log.restore();
  EXPECT_TRUE(rig.good_transfer(22));
}

TEST(HostileDataLane, UnregisteredInitiatorsAreServedUpToABound) {
  // Whoever holds the target's descriptor may connect without being registered
  // (one-way registration), each under a key of its own; the target keeps a
  // fence record per such initiator, so at most
  // TargetServer::kMaxUnregisteredPeers (1,024) are served, then refused.
  Rig rig("tcp");
  constexpr int kCap = 1024;
  auto read_back = [&](int fd, uint64_t req) {
    send_raw(fd,
             lane_frame(request(tw::Type::kRead, req, rig.tdesc.id, rig.tkey, 0), {{0, 8}}, {}));
    tw::Header h;
    Bytes p;
    if (!read_lane(fd, &h, &p)) return std::string("<closed>");
    if (h.type == tw::Type::kError) return std::string(p.begin(), p.end());
    return std::string(h.type == tw::Type::kReadData && p.size() == 8 ? "DATA" : "<bad answer>");
  };
  const size_t rss_before = test::rss_kib();
  for (int i = 0; i < kCap; ++i) {
    int fd = dial(rig.tcp_port);
    ASSERT_GE(fd, 0) << i;
    LaneLogin l;
    ASSERT_TRUE(lane_login(fd, l, rig.tgt_secret, random_secret(), "stranger-" + std::to_string(i)))
        << i;
    ASSERT_EQ(read_back(fd, 1), "DATA") << "unregistered initiator " << i << " was not served";
    close(fd);
  }
  const size_t rss_after = test::rss_kib();
  int fd = dial(rig.tcp_port);
  LaneLogin l;
  ASSERT_TRUE(lane_login(fd, l, rig.tgt_secret, random_secret(), "one-too-many"));
  EXPECT_NE(read_back(fd, 1).find("1024 unregistered initiators already are"), std::string::npos);
  close(fd);
  std::printf("RESULT unregistered_initiators served=%d then refused, rss_kib %zu -> %zu\n", kCap,
              rss_before, rss_after);
  // Registered peers are not affected by the bound.
  EXPECT_TRUE(rig.good_transfer(40));
}

TEST(HostileDataLane, FloodOfLanesWhileAGoodPeerIsServed) {
  Rig rig("tcp");
  // The good peer's lanes open first (lanes are taken in turn: four transfers
  // open all four): both engines live in this process, and a same-host lane
  // holds its socket and its rings' four bells on each side.
  for (uint64_t seed = 26; seed < 30; ++seed) EXPECT_TRUE(rig.good_transfer(seed));
  const size_t fds_before = open_fds();
  constexpr int kFlood = 200;
  LogCapture log;
  std::vector<int> flood;
  for (int i = 0; i < kFlood; ++i) {
    int fd = dial(rig.tcp_port);
    ASSERT_GE(fd, 0) << "connection " << i;
    if (i % 3 == 1) send_raw(fd, lane_hello("good", true));  // hello, then silence
    if (i % 3 == 2) send_raw(fd, Bytes(40, 0x33));           // half a header of junk
    flood.push_back(fd);
    if (i == kFlood / 2) {
      EXPECT_TRUE(rig.good_transfer(30));
    }
  }
  EXPECT_TRUE(rig.good_transfer(31));
  for (int fd : flood) close(fd);
  EXPECT_TRUE(eventually([&] { return log.has("still in its handshake"); }));
  log.restore();
  EXPECT_TRUE(rig.good_transfer(32));
  // Every lane thread of the flood ends and closes its socket.
  EXPECT_TRUE(eventually([&] { return open_fds() <= fds_before + 8; }))
      << open_fds() << " fds open, " << fds_before << " before the flood";
}

}  // namespace
