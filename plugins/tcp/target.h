// The target side: the data-lane listener and one thread per accepted lane that
// serves READ and WRITE requests against registered memory.
//
// Every request is checked before memory is touched: the lane's peer is still
// added, the region exists, every item lies inside it. A refused request gets an
// ERROR response and the lane carries on; a malformed frame closes the lane.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"
#include "region.h"
#include "settings.h"
#include "target_peer.h"
#include "wire.h"

namespace ferry_tcp {

class TargetServer {
 public:
  TargetServer(const ferry_host_v1* host, const Settings& settings, RegionTable* regions);
  ~TargetServer();

  bool Start(std::string* err);
  uint16_t port() const { return port_; }
  // False when the key is already added.
  bool AddPeer(const std::string& key);
  void RemovePeer(const std::string& key);
  void Stop();

 private:
  struct Conn {
    int fd = -1;  // guarded by mu_, so Stop's shutdown never hits a reused number
    std::thread thread;
    bool done = false;
  };
  // What serving one request frame decided.
  enum class Outcome { kServed, kRefused, kCloseLane };

  void AcceptMain();
  void Serve(Conn* c);
  void ServeLane(int fd, const std::string& from);
  Outcome ServeRequest(int fd, TargetPeer& tp, const wire::Header& h,
                       const std::vector<wire::Item>& items, const std::function<bool(int)>& count,
                       int* status, std::string* reason, std::string* close_why);
  int SendError(int fd, uint64_t req_id, int status, const std::string& msg);
  void ReapLocked();

  const ferry_host_v1* host_;
  const Settings settings_;
  RegionTable* regions_;
  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::thread accept_thread_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, std::shared_ptr<TargetPeer>> peers_;
  std::list<std::unique_ptr<Conn>> conns_;
};

}  // namespace ferry_tcp
