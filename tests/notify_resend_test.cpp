// SPDX-License-Identifier: Apache-2.0
// The core's NOTIFY (here: a tcp READ with notification, which the core tells
// its target) lost with its control connection: a proxy in front of the
// target's control port drops the NOTIFY frame and resets both connections,
// as a link fault or a target closing the connection with the frame unread
// does. The initiator had counted the transfer SUCCESS once its NOTIFY left;
// the target never heard of it. Now the target answers every NOTIFY and the
// initiator keeps each until answered: its next use of the connection - or
// the I/O thread's look at connections with NOTIFYs unanswered - finds it
// broken and sends the unanswered one again, first, on a new connection.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "control_frame.h"
#include "eventually.h"
#include "ferry/ferry.hpp"
#include "loopback.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

// Forwards TCP connections to 127.0.0.1:target. Armed, it drops the next
// NOTIFY frame from a client and resets both ends of that connection pair.
class LossyProxy {
 public:
  explicit LossyProxy(uint16_t target) : target_(target) {
    listen_ = test::listen_loopback(&port_, 16);
    if (listen_ < 0) throw std::runtime_error("proxy: cannot listen");
    if (::pipe(stop_) != 0) throw std::runtime_error("proxy: pipe");
    thread_ = std::thread([this] { run(); });
  }
  ~LossyProxy() {
    [[maybe_unused]] ssize_t k = ::write(stop_[1], "x", 1);
    thread_.join();
    for (auto& p : pairs_) {
      ::close(p.client);
      ::close(p.server);
    }
    ::close(listen_);
    ::close(stop_[0]);
    ::close(stop_[1]);
  }
  uint16_t port() const { return port_; }
  void lose_next_notify() { armed_ = true; }
  // The next NOTIFY passes; the target's answer to it is lost and both ends
  // of that connection pair are reset (counted as lost when it happens).
  void lose_next_answer() { answer_armed_ = true; }
  // While set, every new connection is reset at once.
  void refuse_connections(bool on) { refusing_ = on; }
  // Waits until a NOTIFY was dropped (true) or `limit` passed.
  bool wait_lost(std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, limit, [&] { return lost_ > 0; });
  }
  int accepted() const { return accepted_; }

 private:
  struct Pair {
    int client, server;
    std::vector<uint8_t> upstream;  // client bytes not yet a whole frame
    bool cut_at_answer = false;     // the server's next bytes are not passed on
  };
  void count_lost() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++lost_;
    }
    cv_.notify_all();
  }
  static void reset(int fd) {
    linger l{1, 0};  // an abortive close: RST, anything queued dropped
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd);
  }
  static bool send_all(int fd, const uint8_t* p, size_t n) {
    while (n > 0) {
      ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
      if (k <= 0) return false;
      p += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }
  // Client to server, whole frames only, so that a NOTIFY can be held back.
  bool upstream(Pair& p, const uint8_t* data, size_t n) {
    p.upstream.insert(p.upstream.end(), data, data + n);
    size_t off = 0;
    while (p.upstream.size() - off >= kCtrlHeaderSize) {
      const uint8_t* h = p.upstream.data() + off;
      uint32_t body = 0;
      std::memcpy(&body, h + 8, sizeof body);
      if (p.upstream.size() - off < kCtrlHeaderSize + body) break;
      if (armed_ && h[5] == static_cast<uint8_t>(CtrlType::NOTIFY)) {
        armed_ = false;
        count_lost();
        return false;  // dropped: the caller resets both ends
      }
      if (answer_armed_ && h[5] == static_cast<uint8_t>(CtrlType::NOTIFY)) {
        answer_armed_ = false;
        p.cut_at_answer = true;
      }
      if (!send_all(p.server, h, kCtrlHeaderSize + body)) return false;
      off += kCtrlHeaderSize + body;
    }
    p.upstream.erase(p.upstream.begin(), p.upstream.begin() + static_cast<std::ptrdiff_t>(off));
    return true;
  }
  void run() {
    for (;;) {
      std::vector<pollfd> fds{{stop_[0], POLLIN, 0}, {listen_, POLLIN, 0}};
      for (auto& p : pairs_) {
        fds.push_back({p.client, POLLIN, 0});
        fds.push_back({p.server, POLLIN, 0});
      }
      if (::poll(fds.data(), fds.size(), -1) < 0) continue;
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0 && refusing_) {
          reset(c);
          continue;
        }
        int s = c >= 0 ? test::dial_loopback(target_) : -1;
        if (c >= 0 && s >= 0) {
          pairs_.push_back({c, s, {}});
          ++accepted_;
        } else {
          if (c >= 0) ::close(c);
          if (s >= 0) ::close(s);
        }
        continue;  // the pair list changed: poll again
      }
      uint8_t buf[65536];
      for (size_t i = 0; i < pairs_.size(); ++i) {
        Pair& p = pairs_[i];
        bool ok = true;
        if (fds[2 + 2 * i].revents) {
          ssize_t k = ::recv(p.client, buf, sizeof buf, 0);
          ok = k > 0 && upstream(p, buf, static_cast<size_t>(k));
        }
        if (ok && fds[3 + 2 * i].revents) {
          ssize_t k = ::recv(p.server, buf, sizeof buf, 0);
          if (k > 0 && p.cut_at_answer) {  // the NOTIFY's answer: lost, both ends reset
            count_lost();
            ok = false;
          } else {
            ok = k > 0 && send_all(p.client, buf, static_cast<size_t>(k));
          }
        }
        if (!ok) {
          reset(p.client);
          reset(p.server);
          pairs_.erase(pairs_.begin() + static_cast<std::ptrdiff_t>(i));
          break;  // indices moved: poll again
        }
      }
    }
  }

  const uint16_t target_;
  uint16_t port_ = 0;
  int listen_ = -1;
  int stop_[2] = {-1, -1};
  std::atomic<bool> armed_{false}, answer_armed_{false}, refusing_{false};
  std::atomic<int> accepted_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  int lost_ = 0;
  std::vector<Pair> pairs_;  // the proxy's thread only
  std::thread thread_;
};

// Two engines, a reaching b's control plane through the proxy (over TCP, as
// another host), and a's READs of b's memory: a READ's target cannot know the
// data arrived, so the core tells it (NOTIFY).
struct Rig {
  Rig() : a("a", config()), b("b", config()), proxy(b.desc().port) {
    if (!a.add_backend("tcp") || !b.add_backend("tcp")) throw std::runtime_error("no tcp");
    EngineDesc via = b.desc();
    via.node_id = "another-host";
    via.control_unix.clear();
    via.port = proxy.port();
    a.register_remote_engine(via);
    b.register_remote_engine(a.desc());
    al = a.register_memory(am.data(), am.size());
    br = b.register_memory(bm.data(), bm.size());
  }
  static EngineConfig config() {
    setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
    EngineConfig cfg;
    cfg.timeout = 10s;
    return cfg;
  }
  void read(TransferUid uid) {
    TransferStatus st = a.read(al, 0, br, 0, 4096, uid, true);
    EXPECT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  }
  bool reached_b(TransferUid uid) {
    auto s = b.wait_inbound_transfer_status("a", uid, 5s);
    return s && s->Code() == StatusCode::SUCCESS;
  }
  // A READ whose NOTIFY the proxy drops, resetting the connection.
  void read_and_lose(TransferUid uid) {
    proxy.lose_next_notify();
    read(uid);  // SUCCESS once its NOTIFY left
    ASSERT_TRUE(proxy.wait_lost(5s)) << "the proxy never saw the NOTIFY";
    // (Not checked here that b lacks it: the I/O thread may already have
    // found the connection reset and sent it again. The callers check that
    // it arrived on a second connection, counted as resent.)
  }

  Engine a, b;
  LossyProxy proxy;
  std::vector<uint8_t> am = std::vector<uint8_t>(1 << 16), bm = std::vector<uint8_t>(1 << 16, 7);
  MemoryDesc al, br;
};

TEST(NotifyResend, ANotifyLostWithItsConnectionIsSentAgainFirstOnTheNext) {
  Rig r;
  r.read(1);
  ASSERT_TRUE(r.reached_b(1)) << "the first NOTIFY, through the proxy";
  ASSERT_EQ(r.proxy.accepted(), 1);
  ASSERT_NO_FATAL_FAILURE(r.read_and_lose(2));
  r.read(3);  // may find the connection reset: a new one, with 2's NOTIFY first
  EXPECT_TRUE(r.reached_b(2)) << "the lost NOTIFY was not sent again";
  EXPECT_TRUE(r.reached_b(3));
  EXPECT_EQ(r.proxy.accepted(), 2);
  // (The counters move just after the record the waits saw.)
  EXPECT_TRUE(test::eventually([&] { return r.a.stats().notifies_resent >= 1; }));
  EXPECT_EQ(r.a.stats().notifies_unanswered, 0u);
  EXPECT_TRUE(test::eventually([&] { return r.b.stats().inbound_notifications == 3; }));
  EXPECT_EQ(r.b.stats().inbound_notifications, 3u) << "each uid recorded once";
}

// The last transfer to a peer for a while: nothing else uses the connection,
// so the I/O thread's look at unanswered NOTIFYs (every 200 ms) finds it
// broken and sends the NOTIFY again on a new one.
TEST(NotifyResend, ALostLastNotifyIsSentAgainWithoutAnotherTransfer) {
  Rig r;
  r.read(1);
  ASSERT_TRUE(r.reached_b(1));
  ASSERT_NO_FATAL_FAILURE(r.read_and_lose(2));
  EXPECT_TRUE(r.reached_b(2)) << "the lost NOTIFY waited for another transfer";
  EXPECT_EQ(r.proxy.accepted(), 2);
  EXPECT_TRUE(test::eventually([&] { return r.a.stats().notifies_resent == 1; }));
  EXPECT_TRUE(test::eventually([&] { return r.b.stats().inbound_notifications == 2; }));
  EXPECT_EQ(r.a.stats().notifies_resent, 1u);
  EXPECT_EQ(r.b.stats().inbound_notifications, 2u);
}

// A NOTIFY that reached its target, whose answer was lost with the
// connection, is sent again once a connection can be made. Meanwhile more
// transfers than the target's uid window (65,536) landed from the same
// initiator with tcp's own notifications, on their own connections: only the
// NOTIFY's place in the sender's sequence still marks the resend a repeat.
// (Without it the target recorded uid 2 a second time.)
TEST(NotifyResend, AResendAfterMoreLandingsThanTheUidWindowIsTakenOnce) {
  Rig r;
  r.read(1);
  ASSERT_TRUE(r.reached_b(1));
  r.proxy.lose_next_answer();
  r.proxy.refuse_connections(true);  // the resends fail until the flood is over
  r.read(2);                         // SUCCESS once its NOTIFY left
  ASSERT_TRUE(r.proxy.wait_lost(5s)) << "the proxy never saw the answer";
  ASSERT_TRUE(r.reached_b(2)) << "b never took the NOTIFY whose answer was lost";
  // tcp WRITEs notify their target themselves (not through the proxy), many at a time.
  const uint64_t flood = 65536 + 64, first = 1000;
  std::vector<TransferStatus> out;
  for (uint64_t u = first; u < first + flood; ++u) {
    out.push_back(r.a.write(r.al, 0, r.br, (u % 64) * 8, 8, u, true));
    if (out.size() == 256 || u + 1 == first + flood) {
      for (auto& st : out) ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
      out.clear();
    }
  }
  EXPECT_EQ(r.a.stats().notifies_resent, 0u) << "resent before the flood was over";
  r.proxy.refuse_connections(false);
  EXPECT_TRUE(test::eventually([&] { return r.a.stats().notifies_resent >= 1; }, 20s));
  r.read(3);  // on the connection the resend went on, after it
  ASSERT_TRUE(r.reached_b(3));
  EXPECT_FALSE(r.b.pop_inbound_transfer_status("a", 2)) << "the resend was recorded again";
  // (The count moves just after the record the waits saw.)
  EXPECT_TRUE(test::eventually([&] { return r.b.stats().inbound_notifications == flood + 3; }));
  EXPECT_EQ(r.b.stats().inbound_notifications, flood + 3) << "each uid recorded once";
}

}  // namespace
