// SPDX-License-Identifier: Apache-2.0
#include "gpu_stage.h"

#include <algorithm>
#include <chrono>
#include <new>

#include "channel.h"
#include "log.h"
#include "socket_util.h"

namespace ferry_tcp {
namespace {

// The runtime's events block in the kernel (BlockingSync), and waking from that
// costs tens of microseconds - as much as copying a whole piece. A piece's copy
// is short, so poll it for up to this long before blocking.
constexpr std::chrono::microseconds kSpin{300};

using Clock = std::chrono::steady_clock;
uint64_t ns_since(Clock::time_point t) {
  return static_cast<uint64_t>(std::chrono::nanoseconds(Clock::now() - t).count());
}

}  // namespace

// A ring's bytes pinned for the runtime (Stage::InRing), unpinned when the
// channel lets go of it, before it unmaps the ring.
struct RingPin {
  const ferry_gpu_v1* gpu = nullptr;
  void* at = nullptr;  // null: the runtime could not pin them; the buffers are used
  int device = -1;     // current while pinning: so while unpinning, on whatever thread
  RingPin() = default;
  RingPin(const RingPin&) = delete;
  RingPin& operator=(const RingPin&) = delete;
  ~RingPin() {
    if (at == nullptr) return;
    // Without a current device the runtime would make device 0's context for this.
    gpu->set_device(gpu->gpu_ctx, device);
    gpu->host_unregister(gpu->gpu_ctx, at);
  }
};

Stage::Stage(const ferry_gpu_v1* gpu, uint64_t piece_bytes, bool pinned, bool in_ring,
             StageTimes* times)
    : gpu_(gpu), piece_(piece_bytes), pinned_(pinned), in_ring_(in_ring), times_(times) {}

Stage::~Stage() {
  Release();
  if (buf_ == nullptr) return;
  if (pinned_) {
    gpu_->host_free(gpu_->gpu_ctx, buf_);
  } else {
    delete[] buf_;
  }
}

bool Stage::Fail(const char* what) {
  const char* why = gpu_->last_error ? gpu_->last_error(gpu_->gpu_ctx) : nullptr;
  error_ = std::string("GPU staging: ") + what + " failed" + (why ? std::string(": ") + why : "");
  return false;
}

void Stage::Release() {
  if (device_ >= 0) gpu_->set_device(gpu_->gpu_ctx, device_);
  for (void*& e : event_) {
    if (e != nullptr) gpu_->event_destroy(gpu_->gpu_ctx, e);
    e = nullptr;
  }
  if (stream_ != nullptr) gpu_->stream_destroy(gpu_->gpu_ctx, stream_);
  stream_ = nullptr;
  device_ = -1;
}

bool Stage::Bind(int device) {
  if (device == device_ && stream_ != nullptr) return true;
  Release();
  void* ctx = gpu_->gpu_ctx;
  if (gpu_->set_device(ctx, device) != FERRY_OK) return Fail("selecting the device");
  if (buf_ == nullptr) {
    if (pinned_) {
      void* p = nullptr;
      if (gpu_->host_alloc(ctx, &p, 2 * piece_) != FERRY_OK) return Fail("pinning host memory");
      buf_ = static_cast<uint8_t*>(p);
    } else {
      buf_ = new (std::nothrow) uint8_t[2 * piece_];
      if (buf_ == nullptr) {
        error_ = "GPU staging: out of host memory";
        return false;
      }
    }
  }
  if (gpu_->stream_create(ctx, &stream_) != FERRY_OK) return Fail("creating a stream");
  for (void*& e : event_) {
    if (gpu_->event_create(ctx, &e) != FERRY_OK) return Fail("creating an event");
  }
  device_ = device;
  return true;
}

void Stage::NextPiece(const iovec* iov, size_t n, size_t* idx, size_t* off, uint8_t* host,
                      uint64_t room, Piece* p) {
  p->dev.clear();
  p->host.clear();
  p->len.clear();
  p->bytes = 0;
  while (*idx < n && p->bytes < room) {
    const size_t take = std::min<uint64_t>(iov[*idx].iov_len - *off, room - p->bytes);
    p->dev.push_back(static_cast<uint8_t*>(iov[*idx].iov_base) + *off);
    p->host.push_back(host + p->bytes);
    p->len.push_back(take);
    p->bytes += take;
    *off += take;
    if (*off == iov[*idx].iov_len) {
      ++*idx;
      *off = 0;
    }
  }
}

bool Stage::Wait(int slot, const char* what) {
  void* ctx = gpu_->gpu_ctx;
  const auto until = std::chrono::steady_clock::now() + kSpin;
  do {
    const int rc = gpu_->event_query(ctx, event_[slot]);
    if (rc == FERRY_OK) return true;
    if (rc != 1) return Fail(what);
  } while (std::chrono::steady_clock::now() < until);
  return gpu_->event_sync(ctx, event_[slot]) == FERRY_OK || Fail(what);
}

bool Stage::Copy(const Piece& p, bool to_device, int slot, bool host_pinned) {
  void* ctx = gpu_->gpu_ctx;
  const std::vector<void*>& dst = to_device ? p.dev : p.host;
  const std::vector<void*>& src = to_device ? p.host : p.dev;
  // Many small blocks (a KV layout) in one call where the runtime batches them.
  // Only into or out of pinned memory: a batched copy may be a kernel, which
  // cannot reach pageable host memory.
  int rc = FERRY_ERR_UNSUPPORTED;
  if (p.len.size() > 1 && host_pinned && gpu_->memcpy_batch_async != nullptr) {
    rc = gpu_->memcpy_batch_async(ctx, dst.data(), src.data(), p.len.data(), p.len.size(), stream_);
  }
  if (rc == FERRY_ERR_UNSUPPORTED) {
    rc = FERRY_OK;
    for (size_t i = 0; i < p.len.size() && rc == FERRY_OK; ++i) {
      rc = gpu_->memcpy_async(ctx, dst[i], src[i], p.len[i], stream_);
    }
  }
  if (rc != FERRY_OK) return Fail(to_device ? "host-to-device copy" : "device-to-host copy");
  if (gpu_->event_record(ctx, event_[slot], stream_) != FERRY_OK) return Fail("recording an event");
  return true;
}

bool RuntimePins(const ferry_host_v1* host) {
  const ferry_gpu_v1* gpu = FERRY_HAS_FIELD(ferry_host_v1, host, gpu) ? host->gpu : nullptr;
  return FERRY_HAS_FIELD(ferry_gpu_v1, gpu, host_unregister) && gpu->host_register != nullptr &&
         gpu->host_unregister != nullptr;
}

bool Stage::InRing(Channel& ch, bool out) {
  // in_ring_ says the runtime pins (StagePool's in_ring).
  if (!in_ring_ || !ch.on_rings()) return false;
  std::shared_ptr<void>& slot = ch.ring_pin(out ? Channel::Side::kOut : Channel::Side::kIn);
  if (!slot) {
    // Once per ring: pinning costs a system call per page range, and a ring the
    // runtime refused is not asked again.
    shm::Ring* ring = out ? ch.out_ring() : ch.in_ring();
    auto pin = std::make_shared<RingPin>();
    pin->gpu = gpu_;
    pin->device = device_;
    if (gpu_->host_register(gpu_->gpu_ctx, ring->data(), ring->capacity()) == FERRY_OK) {
      pin->at = ring->data();
      ++times_->ring_pins;
    } else {
      ++times_->ring_pin_fails;
    }
    slot = std::move(pin);
  }
  return static_cast<const RingPin*>(slot.get())->at != nullptr;
}

template <typename Take, typename Give>
int Stage::ThroughRing(const iovec* iov, size_t n, uint64_t room, bool to_device, Take take,
                       Give give, uint64_t* take_ns, uint64_t* wait_ns) {
  uint64_t left = 0;
  for (size_t i = 0; i < n; ++i) left += iov[i].iov_len;
  const char* what = to_device ? "host-to-device copy" : "device-to-host copy";
  RingPiece flight[kSlots];
  int first = 0, count = 0;
  size_t idx = 0, off = 0;
  Piece piece;
  int err = 0;
  while (left > 0 || count > 0) {
    if (left > 0 && count < kSlots) {
      RingPiece p;
      const auto taking = Clock::now();
      // With copies in flight, never wait for ring space: finishing them is
      // what frees it (ours, or the peer's to read).
      const int r = take(std::min(room, left), count == 0, &p);
      *take_ns += ns_since(taking);
      if (r == 0) {
        const int slot = (first + count) % kSlots;
        NextPiece(iov, n, &idx, &off, p.at, p.len, &piece);
        if (!Copy(piece, to_device, slot, true)) {
          err = kGpuError;
          break;
        }
        flight[slot] = p;
        ++count;
        left -= p.len;
        continue;
      }
      if (r != EAGAIN) {
        err = r;
        break;
      }
    }
    // The oldest copy: once it is done its ring bytes are handed on, in order.
    const auto waiting = Clock::now();
    const bool copied = Wait(first, what);
    *wait_ns += ns_since(waiting);
    if (!copied) {
      err = kGpuError;
      break;
    }
    give(flight[first], left == 0 && count == 1);
    first = (first + 1) % kSlots;
    --count;
  }
  // Nothing may still write into the ring or the region once we return: a
  // failed queueing may have left copies of its own running, counted or not.
  if (err != 0 && gpu_->stream_sync(gpu_->gpu_ctx, stream_) != FERRY_OK) Fail(what);
  return err;
}

int Stage::SendInRing(Channel& ch, const iovec* iov, size_t n, uint8_t* held_last) {
  shm::Ring& ring = *ch.out_ring();
  const auto started = Clock::now();
  uint64_t reserve_ns = 0, wait_ns = 0;
  // kSlots pieces fit in the ring at once, so the reader copies out of some while we copy in.
  const uint64_t room = std::max<uint64_t>(1, std::min(piece_, ring.capacity() / kSlots));
  auto reserve = [&](uint64_t max, bool wait, RingPiece* p) {
    return ring.Reserve(max, &p->at, &p->len, wait ? ch.ring_wait() : std::chrono::milliseconds(0),
                        ch.fd());
  };
  auto publish = [&](const RingPiece& p, bool last) {
    if (last && held_last != nullptr) {
      // Held back: the caller sends it once the READ is counted.
      *held_last = p.at[p.len - 1];
      ring.Commit(p.len - 1);
    } else {
      ring.Commit(p.len);
    }
  };
  const int err = ThroughRing(iov, n, room, false, reserve, publish, &reserve_ns, &wait_ns);
  ring.Unreserve();
  ++times_->frames_sent;
  ++times_->ring_frames;
  times_->send_ns += ns_since(started);
  times_->send_wait_ns += wait_ns;
  return err;
}

int Stage::RecvInRing(Channel& ch, const iovec* iov, size_t n) {
  shm::Ring& ring = *ch.in_ring();
  const auto started = Clock::now();
  uint64_t read_ns = 0, wait_ns = 0;
  const uint64_t room = std::max<uint64_t>(1, std::min(piece_, ring.capacity() / kSlots));
  auto peek = [&](uint64_t max, bool wait, RingPiece* p) {
    const uint8_t* at = nullptr;
    const int r =
        ring.Peek(max, &at, &p->len, wait ? ch.ring_wait() : std::chrono::milliseconds(0), ch.fd());
    p->at = const_cast<uint8_t*>(at);  // only read: the host side of host-to-device copies
    // The socket's end reads as end of stream, as RingReader's does.
    return r == EPIPE ? kEof : r;
  };
  auto hand_back = [&](const RingPiece& p, bool) { ring.Consume(p.len); };
  const int err = ThroughRing(iov, n, room, true, peek, hand_back, &read_ns, &wait_ns);
  // The bytes are in the region (or the lane is lost) before the caller acks or lets go.
  ring.Unpeek();
  ++times_->frames_received;
  ++times_->ring_frames;
  times_->recv_ns += ns_since(started);
  times_->recv_read_ns += read_ns;
  times_->recv_wait_ns += wait_ns;
  return err;
}

int Stage::Send(Channel& out, const iovec* iov, size_t n, int last_flags, uint8_t* held_last) {
  void* ctx = gpu_->gpu_ctx;
  if (gpu_->set_device(ctx, device_) != FERRY_OK) {
    Fail("selecting the device");
    return kGpuError;
  }
  if (InRing(out, true)) return SendInRing(out, iov, n, held_last);
  const auto started = Clock::now();
  uint64_t wait_ns = 0;
  size_t idx = 0, off = 0;
  Piece piece[2];
  int err = 0;
  auto next = [&](int slot) {
    NextPiece(iov, n, &idx, &off, buf_ + static_cast<size_t>(slot) * piece_, piece_, &piece[slot]);
  };
  next(0);
  if (piece[0].bytes > 0 && !Copy(piece[0], false, 0, pinned_)) err = kGpuError;
  for (int s = 0; err == 0 && piece[s].bytes > 0; s ^= 1) {
    // The other slot's bytes are on the socket already, so it is free for the next piece.
    next(s ^ 1);
    if (piece[s ^ 1].bytes > 0 && !Copy(piece[s ^ 1], false, s ^ 1, pinned_)) {
      err = kGpuError;
      break;
    }
    const auto waited = Clock::now();
    const bool copied = Wait(s, "device-to-host copy");
    wait_ns += ns_since(waited);
    if (!copied) {
      err = kGpuError;
      break;
    }
    const bool last = piece[s ^ 1].bytes == 0;
    const uint8_t* data = buf_ + static_cast<size_t>(s) * piece_;
    size_t len = piece[s].bytes;
    if (last && held_last != nullptr) *held_last = data[--len];
    iovec v{const_cast<uint8_t*>(data), len};
    size_t sent = 0;
    err = len == 0 ? 0 : out.Send(&v, 1, &sent, last ? last_flags : 0);
  }
  // Nothing may still read the region once the caller lets go of it. Done
  // already when every piece went out; after an error, a copy may be queued.
  if (err != 0 && gpu_->stream_sync(ctx, stream_) != FERRY_OK) Fail("device-to-host copy");
  ++times_->frames_sent;
  times_->send_ns += ns_since(started);
  times_->send_wait_ns += wait_ns;
  return err;
}

int Stage::Recv(Channel& ch, ByteReader& in, const iovec* iov, size_t n) {
  void* ctx = gpu_->gpu_ctx;
  if (gpu_->set_device(ctx, device_) != FERRY_OK) {
    Fail("selecting the device");
    return kGpuError;
  }
  // Straight from the ring's bytes, not through `in`: a ring's reader keeps
  // nothing read ahead (channel.cpp RingReader), so the frame's bytes are all there.
  if (InRing(ch, false)) return RecvInRing(ch, iov, n);
  const auto started = Clock::now();
  uint64_t read_ns = 0, wait_ns = 0;
  // Accounts the frame's times when Recv returns, whichever way.
  struct Account {
    StageTimes* t;
    Clock::time_point started;
    uint64_t *read_ns, *wait_ns;
    ~Account() {
      ++t->frames_received;
      t->recv_ns += ns_since(started);
      t->recv_read_ns += *read_ns;
      t->recv_wait_ns += *wait_ns;
    }
  } account{times_, started, &read_ns, &wait_ns};
  auto wait = [&](int slot) {
    const auto t = Clock::now();
    const bool ok = Wait(slot, "host-to-device copy");
    wait_ns += ns_since(t);
    return ok;
  };
  size_t idx = 0, off = 0;
  Piece piece;
  bool busy[2] = {false, false};
  int err = 0;
  for (int s = 0;; s ^= 1) {
    NextPiece(iov, n, &idx, &off, buf_ + static_cast<size_t>(s) * piece_, piece_, &piece);
    if (piece.bytes == 0) break;
    // The slot's previous piece must have reached the device before it is reused.
    if (busy[s] && !wait(s)) {
      err = kGpuError;
      break;
    }
    busy[s] = false;
    const auto reading = Clock::now();
    err = in.Read(buf_ + static_cast<size_t>(s) * piece_, piece.bytes);
    read_ns += ns_since(reading);
    if (err != 0) break;
    if (!Copy(piece, true, s, pinned_)) {
      err = kGpuError;
      break;
    }
    busy[s] = true;
  }
  // The bytes are in the region (or the lane is lost) before the caller acks or lets go.
  if (err != 0) {
    if (gpu_->stream_sync(ctx, stream_) != FERRY_OK) Fail("host-to-device copy");
    return err;
  }
  for (int s = 0; s < 2; ++s) {
    if (busy[s] && !wait(s)) return kGpuError;
  }
  return 0;
}

StagePool::StagePool(const ferry_host_v1* host, uint64_t piece_bytes, uint64_t pinned_cap,
                     bool in_ring)
    : host_(host), piece_(piece_bytes), cap_(pinned_cap), in_ring_(in_ring) {}

StagePool::~StagePool() = default;

StagePool::Lease StagePool::Acquire(int device, std::string* why) {
  const ferry_gpu_v1* gpu =
      FERRY_HAS_FIELD(ferry_host_v1, host_, gpu) ? host_->gpu : static_cast<ferry_gpu_v1*>(nullptr);
  if (gpu == nullptr) {
    *why = "no GPU runtime is loaded in this process";
    return {};
  }
  const auto started = Clock::now();
  std::unique_ptr<Stage> s;
  bool warn = false;
  {
    std::lock_guard lk(mu_);
    // Prefer a stage already bound to the device: rebinding costs a stream.
    auto it = std::find_if(idle_.begin(), idle_.end(), [&](const std::unique_ptr<Stage>& st) {
      return st->device() == device;
    });
    if (it == idle_.end() && !idle_.empty()) it = idle_.begin();
    if (it != idle_.end()) {
      s = std::move(*it);
      idle_.erase(it);
    } else if (pinned_ + 2 * piece_ <= cap_) {
      s = std::make_unique<Stage>(gpu, piece_, true, in_ring_, &times_);
      pinned_ += 2 * piece_;
    } else {
      s = std::make_unique<Stage>(gpu, piece_, false, in_ring_, &times_);
      warn = !warned_;
      warned_ = true;
    }
  }
  if (warn) {
    Log(host_, FERRY_LOG_WARN,
        "GPU staging: %llu pinned bytes in use (gpu_pinned_bytes); more frames are staged "
        "through unpinned memory, which is slower",
        static_cast<unsigned long long>(cap_));
  }
  if (!s->Bind(device)) {
    *why = s->error();
    Return(std::move(s));
    return {};
  }
  ++times_.acquires;
  times_.acquire_ns += ns_since(started);
  return Lease(this, std::move(s));
}

void StagePool::Return(std::unique_ptr<Stage> s) {
  std::lock_guard lk(mu_);
  if (s->pinned()) {
    idle_.push_back(std::move(s));  // kept: pinning is slow, and counted against the cap
  }
}

uint64_t StagePool::pinned_bytes() const {
  std::lock_guard lk(mu_);
  return pinned_;
}

}  // namespace ferry_tcp
