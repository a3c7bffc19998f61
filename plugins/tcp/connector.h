// SPDX-License-Identifier: Apache-2.0
// Connects lanes for the I/O pool (issue 20): a lane whose connection the
// pool will serve needs a thread only while it connects and says HELLO
// (blocking, bounded by connect_timeout_ms, abortable). Those connects run on
// at most kMaxThreads threads, started when a connect is queued and ended
// when none is left, so a burst of first transfers to 1,024 peers costs a
// bounded number of threads for its duration and an idle engine none.
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry_tcp {

class Connector {
 public:
  // As many connects at once as the target side admits handshakes (target.h).
  static constexpr int kMaxThreads = 64;

  class Client {
   public:
    virtual ~Client() = default;
    // Runs on a connector thread, with no lock of the connector held.
    virtual void Connect() = 0;
  };

  Connector() = default;
  ~Connector() { Stop(); }
  Connector(const Connector&) = delete;
  Connector& operator=(const Connector&) = delete;

  // Queues one Connect of c (it may call Queue again). Throws
  // std::system_error when no thread runs connects and none can be started;
  // false once stopping.
  bool Queue(Client* c);
  // Once it returns c is neither queued nor connecting. Not under c's lock.
  void Forget(Client* c);
  void Stop();

 private:
  void Main();
  void JoinExitedLocked();

  mutable std::mutex mu_;
  std::condition_variable cv_;  // a connect finished (Forget waits for it)
  bool stop_ = false;
  std::deque<Client*> pending_;
  std::vector<Client*> running_;
  int live_ = 0;  // threads in Main
  std::vector<std::thread> threads_;
  std::vector<std::thread::id> exited_;  // left Main; joined by the next Queue or Stop
};

}  // namespace ferry_tcp
