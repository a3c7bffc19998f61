// One TCP listener per engine: plugin handshakes, notifications a backend cannot
// send itself. Inbound connections must open with HELLO naming a registered
// remote engine, or they are refused and counted. Outbound connections are made
// lazily, one per peer, and re-made when the peer went away.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "control_frame.h"

namespace ferry {

class ControlPlane {
 public:
  struct Handlers {
    std::function<bool(const std::string& key)> is_known_peer;
    std::function<void(const std::string& peer, const std::string& plugin, const uint8_t* msg,
                       size_t len)>
        on_plugin;
    std::function<void(const std::string& peer, uint64_t uid, int32_t status)> on_notify;
  };

  // Binds host:port (0 = any free port) and starts the I/O thread. Throws ferry::Error.
  ControlPlane(std::string self_key, const std::string& host, uint16_t port, Handlers handlers);
  ~ControlPlane();

  uint16_t port() const { return port_; }
  uint64_t rejected() const { return rejected_.load(); }

  // Send one frame to the peer's control plane; connects (and says HELLO) on
  // first use. Returns 0 or a FERRY_ERR_* code with *err set.
  int send(const std::string& peer_key, const std::string& host, uint16_t port, CtrlType type,
           const std::vector<uint8_t>& body, std::string* err);

  // Drop connections to and from this peer.
  void forget_peer(const std::string& key);

 private:
  struct Inbound;
  struct Outbound {
    std::mutex mu;
    int fd = -1;
  };
  void io_loop();
  void accept_all();
  void read_from(int fd);
  void close_inbound(int fd);
  bool handle_frame(Inbound& c, CtrlFrame& f);
  int connect_and_hello(const std::string& host, uint16_t port, std::string* err);

  std::string self_key_;
  Handlers handlers_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> rejected_{0};
  std::mutex in_mu_;
  std::map<int, std::unique_ptr<Inbound>> inbound_;  // by fd; touched by the I/O thread
  std::mutex out_mu_;
  std::map<std::string, std::shared_ptr<Outbound>> outbound_;
  std::thread thread_;
};

}  // namespace ferry
