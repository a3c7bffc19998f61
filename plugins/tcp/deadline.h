// Ends transfers whose deadline passed. One thread sleeps on a condition
// variable until the earliest deadline, so an idle plugin costs no CPU.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "ferry/plugin.h"

namespace ferry_tcp {

class Xfer;

class DeadlineWatcher {
 public:
  using Expire = std::function<void(const std::shared_ptr<Xfer>&)>;
  DeadlineWatcher(const ferry_host_v1* host, Expire on_expire);
  ~DeadlineWatcher();
  void Start();
  void Stop();

  // Sets x->deadline_token; a no-op when x has no deadline.
  void Add(const std::shared_ptr<Xfer>& x);
  void Remove(const Xfer& x);

 private:
  void Main();

  const ferry_host_v1* host_;
  Expire on_expire_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  uint64_t next_token_ = 1;
  std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<Xfer>> by_deadline_;
  std::thread thread_;
};

}  // namespace ferry_tcp
