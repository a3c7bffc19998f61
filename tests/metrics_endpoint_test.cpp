// SPDX-License-Identifier: Apache-2.0
// The Prometheus endpoint (issue 21): scraped over HTTP while transfers run,
// its counters moving, and every scrape accepted by `promtool check metrics`
// (Debian's prometheus package).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "ferry/ferry.hpp"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

std::string promtool() {
  const char* env = std::getenv("FERRY_PROMTOOL");
  std::string p = env && *env ? env : "/usr/bin/promtool";
  return ::access(p.c_str(), X_OK) == 0 ? p : std::string();
}

// GET http://address/path (HTTP/1.0: the server closes after the answer).
// Returns the status line and body; empty on a connection failure.
std::string http_get(const std::string& address, const std::string& path, std::string* status) {
  const size_t c = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(c + 1))));
  ::inet_pton(AF_INET, address.substr(0, c).c_str(), &a.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return {};
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: " + address + "\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return {};
  }
  std::string all;
  char buf[8192];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) all.append(buf, n);
  ::close(fd);
  const size_t eol = all.find("\r\n");
  if (status) *status = all.substr(0, eol);
  const size_t body = all.find("\r\n\r\n");
  return body == std::string::npos ? std::string() : all.substr(body + 4);
}

// `promtool check metrics` on `text`; returns its exit status and output.
int promtool_check(const std::string& text, std::string* output) {
  char path[] = "/tmp/ferry-metrics-XXXXXX";
  const int fd = ::mkstemp(path);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::write(fd, text.data(), text.size()), static_cast<ssize_t>(text.size()));
  ::close(fd);
  const std::string cmd = promtool() + " check metrics < " + path + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) output->append(buf, n);
  const int st = ::pclose(p);
  ::unlink(path);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

uint64_t sample(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series + " ");
  if (at == std::string::npos) return 0;
  return std::stoull(text.substr(at + series.size() + 2));
}

TEST(MetricsEndpoint, ScrapedDuringTransfersPassesPromtool) {
  if (promtool().empty()) {
    if (const char* r = std::getenv("FERRY_REQUIRE_PROMTOOL"); r && std::string(r) == "1")
      FAIL() << "promtool is not installed (apt-get install prometheus); FERRY_ALLOW_SKIP=promtool "
                "allows skipping";
    GTEST_SKIP() << "promtool is not installed (apt-get install prometheus)";
  }
  EngineConfig ic;
  ic.metrics_address = "127.0.0.1:0";
  Engine ini("initiator", ic);
  Engine target("target");
  ASSERT_TRUE(ini.add_backend("tcp").ok());
  ASSERT_TRUE(target.add_backend("tcp").ok());
  ASSERT_TRUE(ini.register_remote_engine(target.desc()).ok());
  const std::string addr = ini.metrics_address();
  ASSERT_FALSE(addr.empty());
  EXPECT_TRUE(target.metrics_address().empty());  // off unless configured

  std::vector<uint8_t> src(1 << 20, 1), dst(1 << 20, 0);
  MemoryDesc lm = ini.register_memory(src.data(), src.size());
  MemoryDesc rm = target.register_memory(dst.data(), dst.size());
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> done{0};
  std::thread mover([&] {
    const size_t sizes[] = {512, 8192, 1 << 20};
    for (size_t i = 0; !stop; ++i) {
      const size_t n = sizes[i % 3];
      TransferStatus s = (i % 2) ? ini.read(lm, 0, rm, 0, n, ini.allocate_transfer_uid())
                                 : ini.write(lm, 0, rm, 0, n, ini.allocate_transfer_uid());
      if (s.Wait() == StatusCode::SUCCESS) ++done;
    }
  });
  std::string last;
  for (int i = 0; i < 5; ++i) {
    // Each scrape after more transfers have landed (a condition, not a sleep).
    const uint64_t want = done + 20;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (done < want && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    std::string status;
    last = http_get(addr, "/metrics", &status);
    ASSERT_NE(status.find("200"), std::string::npos) << status;
    std::string out;
    EXPECT_EQ(promtool_check(last, &out), 0) << out << "\n--- scraped:\n" << last;
  }
  stop = true;
  mover.join();
  EXPECT_GT(sample(last, "ferry_transfer_bytes_total{backend=\"tcp\",op=\"write\"}"), 0u) << last;
  EXPECT_GT(sample(last, "ferry_transfers_total{backend=\"tcp\",op=\"read\"}"), 0u) << last;
  EXPECT_NE(last.find("ferry_transfer_duration_seconds_bucket{backend=\"tcp\",op=\"write\","
                      "size_class=\"le1MiB\",le=\"+Inf\"}"),
            std::string::npos);
  EXPECT_NE(last.find("ferry_inbound_table_size"), std::string::npos);
  EXPECT_NE(last.find("ferry_notifications_dropped_total"), std::string::npos);
  // The target's inbound table holds the notified transfers' statuses.
  std::string status;
  EXPECT_TRUE(http_get(addr, "/nothing", &status).size() < 1000);
  EXPECT_NE(status.find("404"), std::string::npos) << status;
}

TEST(MetricsEndpoint, ConfiguredByEnvironmentAndBadAddressesRefused) {
  ::setenv("FERRY_METRICS_ADDR", "127.0.0.1:0", 1);
  Engine e("env");
  ::unsetenv("FERRY_METRICS_ADDR");
  std::string status;
  http_get(e.metrics_address(), "/metrics", &status);
  EXPECT_NE(status.find("200"), std::string::npos) << status;
  for (const char* bad : {"nohost", "127.0.0.1:", "127.0.0.1:99999", ":80"}) {
    EngineConfig c;
    c.metrics_address = bad;
    try {
      Engine x("bad", c);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), StatusCode::ERR_INVALID_ARGS) << err.what();
    }
  }
  // In use: a clear transport error naming the address.
  EngineConfig c;
  c.metrics_address = e.metrics_address();
  try {
    Engine x("dup", c);
    ADD_FAILURE() << "a second endpoint on " << c.metrics_address << " was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), StatusCode::ERR_TRANSPORT);
    EXPECT_NE(std::string(err.what()).find(c.metrics_address), std::string::npos);
  }
}

}  // namespace
