// One TCP listener per engine: plugin handshakes, notifications a backend cannot
// send itself. Inbound connections must open with HELLO naming a registered
// remote engine and, when the engine has an auth token, complete the HMAC
// challenge/response of control_frame.h within kHandshakeTimeout; otherwise they
// are refused, logged with the reason and counted. At most kMaxPendingInbound
// connections may be in the handshake at once (the oldest is dropped), so a
// flood of idle sockets cannot pin memory or lock out a good peer. Outbound
// connections are made lazily, one per peer, re-made when the peer went away,
// and check the server's proof before sending anything.
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

#include "auth.h"
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

  static constexpr int kHandshakeTimeoutMs = 5000;
  static constexpr size_t kMaxPendingInbound = 64;

  // Binds host:port (0 = any free port) and starts the I/O thread. Throws
  // ferry::Error. `secret` (borrowed, outlives this) decides whether peers must
  // authenticate.
  ControlPlane(std::string self_key, const std::string& host, uint16_t port, Handlers handlers,
               const auth::Secret* secret);
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
  bool handle_hello(Inbound& c, CtrlFrame& f);
  bool handle_proof(Inbound& c, CtrlFrame& f);
  bool reject(Inbound& c, const std::string& why, bool answer);
  int expire_handshakes();  // closes overdue handshakes; ms until the next is due, or -1
  void evict_oldest_pending();
  int connect_and_hello(const std::string& peer_key, const std::string& host, uint16_t port,
                        std::string* err);

  std::string self_key_;
  Handlers handlers_;
  const auth::Secret* secret_;
  uint64_t accept_seq_ = 0;  // I/O thread only
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
