// SPDX-License-Identifier: Apache-2.0
#include "gpu_stage.h"

#include <algorithm>

#include "endpoint.h"

namespace ferry_ofi {

StagePool::StagePool(const ferry_host_v1* host, uint64_t piece_bytes, uint64_t pinned_cap)
    : host_(host),
      gpu_(FERRY_HAS_FIELD(ferry_host_v1, host, gpu) ? host->gpu : nullptr),
      piece_(piece_bytes),
      cap_(pinned_cap) {}

StagePool::~StagePool() { Close(); }

void StagePool::SetEndpoints(std::vector<Endpoint*> eps, std::function<void()> on_return) {
  std::lock_guard lk(mu_);
  eps_ = std::move(eps);
  on_return_ = std::move(on_return);
}

uint64_t StagePool::pinned_bytes() const {
  std::lock_guard lk(mu_);
  return pinned_;
}

std::unique_ptr<Stage> StagePool::TryAcquire(int device) {
  std::lock_guard lk(mu_);
  if (closed_) return nullptr;
  auto it = std::find_if(idle_.begin(), idle_.end(),
                         [&](const std::unique_ptr<Stage>& s) { return s->device == device; });
  if (it == idle_.end() && !idle_.empty()) it = idle_.begin();
  if (it != idle_.end()) {
    std::unique_ptr<Stage> s = std::move(*it);
    idle_.erase(it);
    return s;
  }
  if (pinned_ + 2 * piece_ > cap_) return nullptr;
  pinned_ += 2 * piece_;
  return std::make_unique<Stage>();
}

void StagePool::Unbind(Stage* s) {
  if (s->device >= 0) gpu_->set_device(gpu_->gpu_ctx, s->device);
  for (void*& e : s->event) {
    if (e != nullptr) gpu_->event_destroy(gpu_->gpu_ctx, e);
    e = nullptr;
  }
  if (s->stream != nullptr) gpu_->stream_destroy(gpu_->gpu_ctx, s->stream);
  s->stream = nullptr;
  s->device = -1;
}

bool StagePool::Bind(Stage* s, int device, std::string* why) {
  auto gpu_fail = [&](const char* what) {
    const char* e = gpu_->last_error ? gpu_->last_error(gpu_->gpu_ctx) : nullptr;
    *why = std::string("GPU staging: ") + what + " failed" + (e ? std::string(": ") + e : "");
    return false;
  };
  if (s->device == device && s->stream != nullptr) return true;
  void* ctx = gpu_->gpu_ctx;
  if (gpu_->set_device(ctx, device) != FERRY_OK) return gpu_fail("selecting the device");
  if (s->buf == nullptr) {
    void* p = nullptr;
    if (gpu_->host_alloc(ctx, &p, 2 * piece_) != FERRY_OK || p == nullptr)
      return gpu_fail("pinning host memory");
    s->buf = static_cast<uint8_t*>(p);
    std::vector<Endpoint*> eps;
    {
      std::lock_guard lk(mu_);
      eps = eps_;
    }
    s->mrs.assign(eps.size(), nullptr);
    for (size_t i = 0; i < eps.size(); ++i) {
      if (eps[i]->RegisterLocal(s->buf, 2 * piece_, &s->mrs[i], why) != FERRY_OK) return false;
    }
  }
  Unbind(s);
  if (gpu_->set_device(ctx, device) != FERRY_OK) return gpu_fail("selecting the device");
  if (gpu_->stream_create(ctx, &s->stream) != FERRY_OK) return gpu_fail("creating a stream");
  for (void*& e : s->event) {
    if (gpu_->event_create(ctx, &e) != FERRY_OK) return gpu_fail("creating an event");
  }
  s->device = device;
  return true;
}

void StagePool::Free(Stage* s) {
  Unbind(s);
  for (fid_mr*& mr : s->mrs) {
    if (mr != nullptr) fi_close(&mr->fid);
    mr = nullptr;
  }
  if (s->buf != nullptr) gpu_->host_free(gpu_->gpu_ctx, s->buf);
  s->buf = nullptr;
}

void StagePool::Return(std::unique_ptr<Stage> s) {
  std::function<void()> wake;
  {
    std::lock_guard lk(mu_);
    // A stage whose binding failed half-way is not trusted again.
    const bool whole = s->buf != nullptr && s->stream != nullptr && !closed_;
    if (whole) {
      idle_.push_back(std::move(s));
    } else {
      pinned_ -= 2 * piece_;
    }
    wake = on_return_;
  }
  if (s) Free(s.get());
  if (wake) wake();
}

void StagePool::Close() {
  std::vector<std::unique_ptr<Stage>> idle;
  {
    std::lock_guard lk(mu_);
    closed_ = true;
    on_return_ = nullptr;
    idle.swap(idle_);
    pinned_ -= std::min<uint64_t>(pinned_, idle.size() * 2 * piece_);
  }
  for (auto& s : idle) Free(s.get());
}

}  // namespace ferry_ofi
