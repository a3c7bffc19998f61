// SPDX-License-Identifier: Apache-2.0
// Ends transfers whose deadline passed. One thread sleeps on a condition
// variable until the earliest deadline, so an idle plugin costs no CPU.
// Add() wakes it only for a deadline earlier than the time it wakes by itself;
// after the last transfer it lingers a second before sleeping for good, so
// back-to-back transfers cost no thread wake-up each.
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
  uint64_t wake_at_ns_ = UINT64_MAX;  // when the thread wakes by itself (now_ns clock)
  std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<Xfer>> by_deadline_;
  std::thread thread_;
};

}  // namespace ferry_tcp
