// SPDX-License-Identifier: Apache-2.0
// Control connections between engines of one host go over the control plane's
// abstract unix socket (its name travels in the engine descriptor), not
// loopback TCP; to another host, to a name nobody listens on (another network
// namespace) or to one that does not answer like a ferry engine, they go over
// TCP as before. EngineStats::ctrl_unix_connections counts the unix ones.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "ferry/ferry.hpp"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

std::string Received(Engine& e) {
  auto got = e.wait_notifications(5s);
  return got.count("a") && !got["a"].empty() ? got["a"].front() : "";
}

// Registers `desc` (as changed by the caller) with a, sends b a message and
// checks it arrived; returns a's unix control connections.
uint64_t SendOver(Engine& a, Engine& b, const EngineDesc& desc) {
  EXPECT_TRUE(a.register_remote_engine(desc));
  TransferStatus st = a.send_notification("b", "hello");
  EXPECT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  EXPECT_EQ(Received(b), "hello");
  return a.stats().ctrl_unix_connections;
}

TEST(ControlRoute, EnginesOfOneHostUseTheUnixSocket) {
  Engine a("a"), b("b");
  EngineDesc d = b.desc();
  ASSERT_FALSE(d.control_unix.empty()) << "no unix control socket on this machine";
  EXPECT_EQ(SendOver(a, b, d), 1u);
  // Both ways, and b learned a's name from a's descriptor.
  ASSERT_TRUE(b.register_remote_engine(a.desc()));
  ASSERT_EQ(b.send_notification("a", "back").Wait(), StatusCode::SUCCESS);
  EXPECT_EQ(b.stats().ctrl_unix_connections, 1u);
}

TEST(ControlRoute, AnotherHostIsReachedOverTcp) {
  Engine a("a"), b("b");
  EngineDesc d = b.desc();
  d.node_id = "some-other-host";
  EXPECT_EQ(SendOver(a, b, d), 0u);
}

TEST(ControlRoute, ANameNobodyListensOnFallsBackToTcp) {
  Engine a("a"), b("b");
  EngineDesc d = b.desc();
  d.control_unix = "ferry-ctrl-nobody-listens-here";
  EXPECT_EQ(SendOver(a, b, d), 0u);
}

// Someone else holds the name (it was in a descriptor): the HELLO fails there,
// and the connection is made over TCP instead.
TEST(ControlRoute, AnImpostorOnTheNameFallsBackToTcp) {
  const std::string name = "ferry-ctrl-impostor-" + std::to_string(getpid());
  const int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(ls, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  ASSERT_EQ(bind(ls, reinterpret_cast<sockaddr*>(&addr), len), 0) << std::strerror(errno);
  ASSERT_EQ(listen(ls, 4), 0);
  // Takes one connection and hangs up on it without a word (waiting for it at
  // most 10 s: then the engine never tried the name).
  bool tried = false;
  std::thread impostor([ls, &tried] {
    pollfd p{ls, POLLIN, 0};
    if (poll(&p, 1, 10000) != 1) return;
    const int c = accept(ls, nullptr, nullptr);
    tried = c >= 0;
    if (c >= 0) close(c);
  });
  Engine a("a"), b("b");
  EngineDesc d = b.desc();
  d.control_unix = name;
  EXPECT_EQ(SendOver(a, b, d), 0u);
  impostor.join();
  EXPECT_TRUE(tried) << "the engine never connected to the name in the descriptor";
  close(ls);
}

}  // namespace
