// SPDX-License-Identifier: Apache-2.0
#include "etcd_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>
#include <vector>

namespace ferry::test {

namespace {

// A port free now on 127.0.0.1 (bound to 0, read back, closed).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    throw std::runtime_error("no free port");
  ::close(fd);
  return ntohs(a.sin_port);
}

// The client port accepts a TCP connection (etcd serves once it listens).
bool accepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

}  // namespace

std::string etcd_binary() {
  const char* env = std::getenv("FERRY_ETCD_BIN");
  std::string p = env && *env ? env : "/usr/bin/etcd";
  return ::access(p.c_str(), X_OK) == 0 ? p : std::string();
}

bool tool_required(const char* env_name) {
  const char* v = std::getenv(env_name);
  return v && std::string(v) == "1";
}

EtcdServer::EtcdServer() {
  char tmpl[] = "/tmp/ferry-etcd-XXXXXX";
  if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  dir_ = tmpl;
  endpoint_ = "http://127.0.0.1:" + std::to_string(free_port());
  peer_url_ = "http://127.0.0.1:" + std::to_string(free_port());
  start();
}

EtcdServer::~EtcdServer() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    int st;
    ::waitpid(pid_, &st, 0);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void EtcdServer::kill_now() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int st;
  ::waitpid(pid_, &st, 0);
  pid_ = -1;
}

void EtcdServer::start() {
  const std::string bin = etcd_binary();
  if (bin.empty()) throw std::runtime_error("etcd is not installed (apt-get install etcd-server)");
  std::vector<std::string> argv = {bin,
                                   "--name=ferry-test",
                                   "--data-dir=" + dir_ + "/data",
                                   "--listen-client-urls=" + endpoint_,
                                   "--advertise-client-urls=" + endpoint_,
                                   "--listen-peer-urls=" + peer_url_,
                                   "--initial-advertise-peer-urls=" + peer_url_,
                                   "--initial-cluster=ferry-test=" + peer_url_,
                                   "--log-level=warn",
                                   "--logger=zap"};
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const std::string log = dir_ + "/etcd.log";
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  const int port = std::stoi(endpoint_.substr(endpoint_.rfind(':') + 1));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!accepts(port)) {
    int st;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      pid_ = -1;
      throw std::runtime_error("etcd exited at start (log: " + log + ")");
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("etcd did not listen within 20 s (log: " + log + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a condition
  }
}

}  // namespace ferry::test
