// SPDX-License-Identifier: Apache-2.0
// The public Engine facade: argument checks and forwarding to the engine's
// parts (engine_impl.h), nothing else.
#include "engine_impl.h"
#include "hot_path.h"

namespace ferry {

// ---- the public facade ------------------------------------------------------------------

Engine::Engine(std::string key, EngineConfig config)
    : impl_(std::make_unique<EngineImpl>(std::move(key), std::move(config))) {}
Engine::~Engine() = default;
const std::string& Engine::key() const { return impl_->key_; }
Result Engine::add_backend(const std::string& name, const std::string& settings) {
  return impl_->add_backend(name, settings);
}
Result Engine::remove_backend(const std::string& name) { return impl_->remove_backend(name); }
std::vector<std::string> Engine::backends() const { return impl_->backend_names(); }
EngineDesc Engine::desc() const { return impl_->desc(); }
Result Engine::register_remote_engine(const EngineDesc& d) {
  return impl_->register_remote_engine(d);
}
Result Engine::deregister_remote_engine(const std::string& key) {
  return impl_->deregister_remote_engine(key);
}
MemoryDesc Engine::register_memory(void* addr, size_t size, int device, MemoryLocation loc) {
  return impl_->registry().register_memory(addr, size, device, loc);
}
Result Engine::deregister_memory(const MemoryDesc& m) {
  return impl_->registry().deregister_memory(m);
}
TransferUid Engine::allocate_transfer_uid() { return impl_->allocate_uid(); }
std::optional<TransferStatus> Engine::pop_inbound_transfer_status(const std::string& remote_key,
                                                                  TransferUid uid) {
  return impl_->inbound_table().pop(remote_key, uid);
}
std::optional<TransferStatus> Engine::wait_inbound_transfer_status(
    const std::string& remote_key, TransferUid uid, std::chrono::milliseconds timeout) {
  return impl_->inbound_table().wait_pop(remote_key, uid, timeout);
}
EngineStats Engine::stats() const { return impl_->stats(); }

TransferStatus Engine::send_notification(const std::string& remote_key,
                                         const std::string& message) {
  return impl_->send_notification(remote_key, message);
}
std::map<std::string, std::vector<std::string>> Engine::get_new_notifications() {
  return impl_->notif_inbox().drain();
}
std::map<std::string, std::vector<std::string>> Engine::wait_notifications(
    std::chrono::milliseconds timeout) {
  return impl_->notif_inbox().wait_drain(timeout);
}
int Engine::notification_fd() const { return impl_->notif_inbox().fd(); }
std::string Engine::policy_source() const { return impl_->policy().source; }

namespace {
TransferStatus failed_at_once(StatusCode code, std::string msg) {
  TransferStatus s;
  s.Finish(code, std::move(msg));
  return s;
}
}  // namespace

// ---- the public transfer calls (the lifecycle is transfer.cpp) -----------------

namespace {
FERRY_HOT TransferStatus submit(EngineImpl& e, Op op, const MemoryDesc& local,
                                const MemoryDesc& remote, const size_t* loffs, const size_t* roffs,
                                const size_t* sizes, size_t n, TransferUid uid,
                                std::optional<bool> notify, std::optional<std::string> message) {
  MemPair pair;
  std::string why;
  StatusCode c = e.registry().resolve(local, remote, pair, why);
  if (c != StatusCode::SUCCESS) return failed_at_once(c, why);
  return e.transfers().submit(pair, op, loffs, roffs, sizes, n, uid, notify, std::move(message));
}
}  // namespace

FERRY_HOT TransferStatus Engine::read(const MemoryDesc& local, size_t loff,
                                      const MemoryDesc& remote, size_t roff, size_t size,
                                      TransferUid uid, std::optional<bool> notify,
                                      std::optional<std::string> message) {
  return submit(*impl_, Op::READ, local, remote, &loff, &roff, &size, 1, uid, notify,
                std::move(message));
}

FERRY_HOT TransferStatus Engine::write(const MemoryDesc& local, size_t loff,
                                       const MemoryDesc& remote, size_t roff, size_t size,
                                       TransferUid uid, std::optional<bool> notify,
                                       std::optional<std::string> message) {
  return submit(*impl_, Op::WRITE, local, remote, &loff, &roff, &size, 1, uid, notify,
                std::move(message));
}

namespace {
bool same_lengths(const std::vector<size_t>& a, const std::vector<size_t>& b,
                  const std::vector<size_t>& c) {
  return a.size() == b.size() && b.size() == c.size();
}
}  // namespace

TransferStatus Engine::batch_read(const MemoryDesc& local, const std::vector<size_t>& loffs,
                                  const MemoryDesc& remote, const std::vector<size_t>& roffs,
                                  const std::vector<size_t>& sizes, TransferUid uid,
                                  std::optional<bool> notify, std::optional<std::string> message) {
  if (!same_lengths(loffs, roffs, sizes))
    return failed_at_once(StatusCode::ERR_INVALID_ARGS,
                          "batch: offsets and sizes differ in length");
  return submit(*impl_, Op::READ, local, remote, loffs.data(), roffs.data(), sizes.data(),
                sizes.size(), uid, notify, std::move(message));
}

TransferStatus Engine::batch_write(const MemoryDesc& local, const std::vector<size_t>& loffs,
                                   const MemoryDesc& remote, const std::vector<size_t>& roffs,
                                   const std::vector<size_t>& sizes, TransferUid uid,
                                   std::optional<bool> notify, std::optional<std::string> message) {
  if (!same_lengths(loffs, roffs, sizes))
    return failed_at_once(StatusCode::ERR_INVALID_ARGS,
                          "batch: offsets and sizes differ in length");
  return submit(*impl_, Op::WRITE, local, remote, loffs.data(), roffs.data(), sizes.data(),
                sizes.size(), uid, notify, std::move(message));
}

}  // namespace ferry
