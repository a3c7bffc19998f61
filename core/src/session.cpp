// SPDX-License-Identifier: Apache-2.0
// Session: a (local, remote) pair resolved once, so each transfer skips the
// descriptor lookups and import checks of the engine-level calls.
#include "engine_impl.h"
#include "hot_path.h"

namespace ferry {

struct Session::Impl {
  EngineImpl* engine;
  MemPair pair;
};

Session::Session(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Session::~Session() = default;

TransferUid Session::allocate_transfer_uid() { return impl_->engine->allocate_uid(); }

namespace {
// The peer went with a reason (its metadata-store lease expired): say it,
// rather than the lifecycle's generic "deregistered or registered again".
std::optional<TransferStatus> gone_with_reason(const MemPair& pair) {
  if (!pair.peer->gone.load() || pair.peer->gone_why.empty()) return std::nullopt;
  TransferStatus s;
  s.Finish(StatusCode::ERR_NOT_FOUND, pair.peer->gone_why + "; create a new session");
  return s;
}
}  // namespace

FERRY_HOT TransferStatus Session::read(size_t loff, size_t roff, size_t size, TransferUid uid,
                                       std::optional<bool> notify,
                                       std::optional<std::string> message) {
  if (auto s = gone_with_reason(impl_->pair)) return *s;
  return impl_->engine->transfers().submit(impl_->pair, Op::READ, &loff, &roff, &size, 1, uid,
                                           notify, std::move(message));
}

FERRY_HOT TransferStatus Session::write(size_t loff, size_t roff, size_t size, TransferUid uid,
                                        std::optional<bool> notify,
                                        std::optional<std::string> message) {
  if (auto s = gone_with_reason(impl_->pair)) return *s;
  return impl_->engine->transfers().submit(impl_->pair, Op::WRITE, &loff, &roff, &size, 1, uid,
                                           notify, std::move(message));
}

namespace {
TransferStatus length_mismatch() {
  TransferStatus s;
  s.Finish(StatusCode::ERR_INVALID_ARGS, "batch: offsets and sizes differ in length");
  return s;
}
}  // namespace

TransferStatus Session::batch_read(const std::vector<size_t>& loffs,
                                   const std::vector<size_t>& roffs,
                                   const std::vector<size_t>& sizes, TransferUid uid,
                                   std::optional<bool> notify, std::optional<std::string> message) {
  if (loffs.size() != sizes.size() || roffs.size() != sizes.size()) return length_mismatch();
  if (auto s = gone_with_reason(impl_->pair)) return *s;
  return impl_->engine->transfers().submit(impl_->pair, Op::READ, loffs.data(), roffs.data(),
                                           sizes.data(), sizes.size(), uid, notify,
                                           std::move(message));
}

TransferStatus Session::batch_write(const std::vector<size_t>& loffs,
                                    const std::vector<size_t>& roffs,
                                    const std::vector<size_t>& sizes, TransferUid uid,
                                    std::optional<bool> notify,
                                    std::optional<std::string> message) {
  if (loffs.size() != sizes.size() || roffs.size() != sizes.size()) return length_mismatch();
  if (auto s = gone_with_reason(impl_->pair)) return *s;
  return impl_->engine->transfers().submit(impl_->pair, Op::WRITE, loffs.data(), roffs.data(),
                                           sizes.data(), sizes.size(), uid, notify,
                                           std::move(message));
}

bool Session::alive() const { return impl_->engine->registry().alive(impl_->pair); }

std::unique_ptr<Session> Engine::create_session(const MemoryDesc& local, const MemoryDesc& remote,
                                                Result* why) {
  MemPair pair;
  std::string reason;
  StatusCode c = impl_->registry().resolve(local, remote, pair, reason);
  if (c == StatusCode::SUCCESS) {
    // A session needs a backend for at least one direction.
    std::string w1, w2;
    if (impl_->transfers().route_for(pair, Op::WRITE, 1, w1)->empty() &&
        impl_->transfers().route_for(pair, Op::READ, 1, w2)->empty()) {
      c = StatusCode::ERR_BAD_STATE;
      reason = w1;
    }
  }
  if (c != StatusCode::SUCCESS) {
    if (why) *why = {c, reason};
    return nullptr;
  }
  if (why) *why = {};
  return std::make_unique<Session>(
      std::make_unique<Session::Impl>(Session::Impl{impl_.get(), pair}));
}

}  // namespace ferry
