// SPDX-License-Identifier: Apache-2.0
#include "connector.h"

#include <algorithm>

#include "thread_name.h"

namespace ferry_tcp {

bool Connector::Queue(Client* c) {
  std::lock_guard lk(mu_);
  if (stop_) return false;
  pending_.push_back(c);
  if (live_ >= kMaxThreads || live_ >= static_cast<int>(pending_.size() + running_.size()))
    return true;  // a thread takes it when it is done with the one it has
  JoinExitedLocked();
  try {
    threads_.push_back(ferry::named_thread("tcp-connect", [this] { Main(); }));
  } catch (...) {
    pending_.pop_back();
    throw;
  }
  ++live_;
  return true;
}

void Connector::JoinExitedLocked() {
  // A thread in exited_ touches nothing after recording itself there: joining
  // it under mu_ cannot wait on us.
  for (const std::thread::id id : exited_) {
    auto it = std::find_if(threads_.begin(), threads_.end(),
                           [&](const std::thread& t) { return t.get_id() == id; });
    if (it == threads_.end()) continue;
    it->join();
    threads_.erase(it);
  }
  exited_.clear();
}

void Connector::Main() {
  std::unique_lock lk(mu_);
  while (!stop_ && !pending_.empty()) {
    Client* c = pending_.front();
    pending_.pop_front();
    running_.push_back(c);
    lk.unlock();
    c->Connect();
    lk.lock();
    running_.erase(std::find(running_.begin(), running_.end(), c));
    cv_.notify_all();
  }
  --live_;
  exited_.push_back(std::this_thread::get_id());
}

void Connector::Forget(Client* c) {
  std::unique_lock lk(mu_);
  pending_.erase(std::remove(pending_.begin(), pending_.end(), c), pending_.end());
  cv_.wait(lk, [&] { return std::find(running_.begin(), running_.end(), c) == running_.end(); });
}

void Connector::Stop() {
  std::vector<std::thread> all;
  {
    std::lock_guard lk(mu_);
    stop_ = true;
    pending_.clear();
    all.swap(threads_);
    exited_.clear();
  }
  for (auto& t : all) t.join();
}

}  // namespace ferry_tcp
