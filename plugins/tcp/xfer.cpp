// SPDX-License-Identifier: Apache-2.0
#include "xfer.h"

#include <algorithm>

#include "deadline.h"
#include "hot_path.h"
#include "peer.h"

namespace ferry_tcp {

FERRY_HOT void Xfer::FrameDone(int status, const std::string& msg) {
  int final_status;
  std::string final_msg;
  {
    std::lock_guard lk(mu_);
    if (status != FERRY_OK && status_ == FERRY_OK) {
      status_ = status;
      msg_ = msg;
      failed_.store(true, std::memory_order_release);
    }
    if (frames_left_ == 0 || --frames_left_ != 0) return;
    final_status = status_;
    final_msg = msg_;
  }
  // Nothing ever reached a socket (no lane came up in time, connect refused):
  // the target can apply none of it, and the core may fail over without a fence.
  if ((final_status == FERRY_ERR_TRANSPORT || final_status == FERRY_ERR_TIMEOUT) &&
      !left_.load(std::memory_order_acquire))
    final_status = FERRY_ERR_NOT_SENT;
  // Bookkeeping first: complete() may post again, or free the caller's context.
  if (watcher != nullptr) watcher->Remove(*this);
  if (auto p = peer.lock()) p->Finished(*this);
  host->complete(host->host_ctx, ctx, final_status,
                 final_status == FERRY_OK ? nullptr : final_msg.c_str());
}

void Xfer::MarkError(int status, const std::string& msg) {
  std::lock_guard lk(mu_);
  if (status_ != FERRY_OK) return;
  status_ = status;
  msg_ = msg;
  failed_.store(true, std::memory_order_release);
}

void Xfer::Error(int* status, std::string* msg) const {
  std::lock_guard lk(mu_);
  *status = status_;
  *msg = msg_;
}

FERRY_HOT void Frame::Resolve(int status, const std::string& msg) {
  if (resolved.exchange(true)) return;
  // The last FrameDone may complete the transfer: count is read before any.
  for (uint32_t i = count; i > 0; --i) xfer->FrameDone(status, msg);
}

FERRY_HOT FramePtr MakeFrame(const std::shared_ptr<Xfer>& xfer, wire::Header head, uint64_t req_id,
                             const std::vector<wire::Item>& remote, std::vector<iovec> local,
                             uint64_t bytes) {
  auto f = std::make_shared<Frame>();
  f->xfer = xfer;
  f->req_id = req_id;
  f->is_write = head.type == wire::Type::kWrite;
  f->payload_bytes = bytes;
  head.req_id = req_id;
  head.n_items = static_cast<uint32_t>(remote.size());
  head.payload_len = f->is_write ? bytes : 0;
  f->head = wire::EncodeFrameHead(head, remote);
  f->local = std::move(local);
  return f;
}

FramePtr FrameRun::Build(uint64_t k) const {
  const uint64_t off = k * chunk;
  const uint64_t bytes = std::min(chunk, len - off);
  return MakeFrame(xfer, head, next_req->fetch_add(1), {{remote_off + off, bytes}},
                   {{local + off, static_cast<size_t>(bytes)}}, bytes);
}

FERRY_HOT void Frame::MakeDirect() {
  wire::MakeDirect(&head, local.data(), local.size());
  direct = true;
}

size_t Frame::WireIovCount() const { return 1 + (is_write && !direct ? local.size() : 0); }

void Frame::WireIov(iovec* out) {
  out[0] = {head.data(), head.size()};
  if (is_write && !direct) std::copy(local.begin(), local.end(), out + 1);
}

}  // namespace ferry_tcp
