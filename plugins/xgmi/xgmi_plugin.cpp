// libferry-xgmi.so: GPU-to-GPU copies between engines on one host, over XGMI
// (AMD, through HIP) or NVLink/PCIe peer access (NVIDIA, through CUDA). It uses
// only the core's GPU runtime shim (host->gpu, plugin ABI 1.1), so it needs no
// GPU SDK to build and one .so serves both vendors.
//
// Memory is exported as an IPC handle of its allocation plus the region's offset
// inside it; the importer opens each handle once per local device and caches it.
// A transfer's pieces are merged where contiguous and enqueued on one stream of
// the local device (one batched copy call where the runtime has one, so 1024
// small blocks are not 1024 launches), then an event; a completion thread waits
// on the events in order (blocking sync, no spinning) and reports completion.
// No native notification: the core tells the target over its control plane.
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ferry/plugin.h"
#include "host_log.h"
#include "xgmi_blob.h"

namespace ferry_xgmi {
namespace {

struct Local {
  char* addr;
  uint64_t size;
  int device;
};

struct Remote {
  MemBlob blob;
  bool same_process;
};

struct Peer {
  std::string key;
  int inflight = 0;  // guarded by Instance::mu
};

struct Pending {
  void* event;
  int device;
  void* xfer_ctx;
  Peer* peer;
  uint64_t bytes;
};

struct Opened {
  char* base = nullptr;
  int refs = 0;
};

struct Instance {
  const ferry_host_v1* host = nullptr;
  const ferry_gpu_v1* gpu = nullptr;
  int streams_per_device = 4;
  bool batch_copy = true;
  std::chrono::microseconds spin{200};  // poll a finishing copy this long before blocking

  std::mutex mu;
  std::condition_variable cv;               // pending work for the completion thread
  std::condition_variable drained;          // a transfer finished (peer_remove waits on it)
  std::vector<std::vector<void*>> streams;  // per device
  std::vector<size_t> next_stream;
  std::vector<std::vector<void*>> free_events;           // per device
  std::map<std::pair<std::string, int>, Opened> opened;  // (handle bytes, device)
  std::deque<Pending> pending;
  bool stop = false;
  std::thread completer;

  void log(int level, const std::string& m) { host->log(host->host_ctx, level, m.c_str()); }
  std::string gpu_error() { return gpu->last_error(gpu->gpu_ctx); }
};

void complete_loop(Instance* in) {
  std::unique_lock<std::mutex> lk(in->mu);
  for (;;) {
    in->cv.wait(lk, [&] { return in->stop || !in->pending.empty(); });
    if (in->pending.empty()) return;  // stop requested and nothing left
    Pending p = in->pending.front();
    lk.unlock();
    // Poll briefly (a copy of a few MiB ends within microseconds and a sleeping
    // thread's wake-up costs tens of them), then block: events are created with
    // blocking sync, so an idle or slow wait does not burn a core.
    int rc = 1;
    // Spin for the copy's expected duration (at ~300 GB/s) plus spin_us, so a
    // large copy is not waited for through a sleep/wake-up cycle.
    auto expected = std::chrono::nanoseconds(p.bytes / 300);
    auto spin_until = std::chrono::steady_clock::now() + in->spin + expected;
    while (rc == 1 && std::chrono::steady_clock::now() < spin_until) {
      rc = in->gpu->event_query(in->gpu->gpu_ctx, p.event);
      if (rc == 1) std::this_thread::yield();
    }
    if (rc == 1) rc = in->gpu->event_sync(in->gpu->gpu_ctx, p.event);
    std::string why = rc == FERRY_OK ? std::string() : "GPU copy failed: " + in->gpu_error();
    lk.lock();
    in->pending.pop_front();
    in->free_events[static_cast<size_t>(p.device)].push_back(p.event);
    --p.peer->inflight;
    lk.unlock();
    in->host->complete(in->host->host_ctx, p.xfer_ctx, rc == FERRY_OK ? FERRY_OK : FERRY_ERR_GPU,
                       why.empty() ? nullptr : why.c_str());
    lk.lock();
    in->drained.notify_all();
  }
}

void set_err(char* err, size_t n, const std::string& m) {
  if (err != nullptr && n > 0) std::snprintf(err, n, "%s", m.c_str());
}

// Nothing unwinds into the core's C frames: every entry point runs its body
// through one of these (an allocation failure becomes FERRY_ERR_NO_MEMORY,
// anything else FERRY_ERR_INTERNAL; a void entry point logs and returns).
template <class F>
int guarded(F&& body) noexcept {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return FERRY_ERR_NO_MEMORY;
  } catch (...) {
    return FERRY_ERR_INTERNAL;
  }
}
template <class F>
void guarded_void(const ferry_host_v1* host, const char* what, F&& body) noexcept {
  try {
    body();
  } catch (...) {
    if (host != nullptr && host->log != nullptr) host->log(host->host_ctx, FERRY_LOG_ERROR, what);
  }
}

int init_body(const ferry_host_v1* host, const char* settings, void** ctx, char* err,
              size_t errlen) {
  if (ctx == nullptr) return FERRY_ERR_INVALID_ARGS;
  if (!FERRY_HAS_FIELD(ferry_host_v1, host, gpu) || !host->gpu) {
    set_err(err, errlen, "no GPU runtime (libcudart / libamdhip64) or no GPU device");
    return FERRY_ERR_NO_DEVICE;
  }
  auto j = nlohmann::json::parse(settings ? settings : "{}", nullptr, false);
  if (!j.is_object()) {
    set_err(err, errlen, "xgmi settings must be a JSON object");
    return FERRY_ERR_INVALID_ARGS;
  }
  auto in = std::make_unique<Instance>();
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "num_streams" && it->is_number_integer() && it->get<int>() >= 1 &&
        it->get<int>() <= 64) {
      in->streams_per_device = it->get<int>();
    } else if (it.key() == "batch_copy" && it->is_boolean()) {
      in->batch_copy = it->get<bool>();
    } else if (it.key() == "spin_us" && it->is_number_integer() && it->get<int>() >= 0 &&
               it->get<int>() <= 100000) {
      in->spin = std::chrono::microseconds(it->get<int>());
    } else {
      set_err(err, errlen,
              "xgmi: bad or unknown setting '" + it.key() +
                  "' (known: num_streams 1..64, batch_copy true|false, spin_us 0..100000)");
      return FERRY_ERR_INVALID_ARGS;
    }
  }
  in->host = host;
  in->gpu = host->gpu;
  size_t n = static_cast<size_t>(in->gpu->device_count);
  in->streams.resize(n);
  in->next_stream.resize(n);
  in->free_events.resize(n);
  Instance* raw = in.get();
  in->completer = std::thread([raw] { complete_loop(raw); });
  *ctx = in.release();
  return FERRY_OK;
}

int x_init(const ferry_host_v1* host, const char*, const char*, const char* settings, void** ctx,
           char* err, size_t errlen) {
  return guarded([&] { return init_body(host, settings, ctx, err, errlen); });
}

void fini_body(void* ctx) {
  auto* in = static_cast<Instance*>(ctx);
  if (in == nullptr) return;
  {
    std::lock_guard<std::mutex> lk(in->mu);
    in->stop = true;  // the completion thread drains what is pending, then exits
  }
  in->cv.notify_all();
  in->completer.join();
  const ferry_gpu_v1* g = in->gpu;
  for (auto& [k, o] : in->opened) g->ipc_close(g->gpu_ctx, o.base);
  for (size_t d = 0; d < in->streams.size(); ++d) {
    for (void* s : in->streams[d]) g->stream_destroy(g->gpu_ctx, s);
    for (void* e : in->free_events[d]) g->event_destroy(g->gpu_ctx, e);
  }
  delete in;
}

void x_fini(void* ctx) {
  const ferry_host_v1* host = ctx ? static_cast<Instance*>(ctx)->host : nullptr;
  guarded_void(host, "xgmi: fini failed", [&] { fini_body(ctx); });
}

int x_conn_info(void*, void* buf, size_t* len) {
  if (buf == nullptr || len == nullptr || *len < 1) return FERRY_ERR_INVALID_ARGS;
  static_cast<uint8_t*>(buf)[0] = kBlobVersion;
  *len = 1;
  return FERRY_OK;
}

int x_peer_add(void*, const ferry_peer_v1* p, void** h) {
  if (!FERRY_HAS_FIELD(ferry_peer_v1, p, conn_blob_len) || h == nullptr || p->key == nullptr)
    return FERRY_ERR_INVALID_ARGS;
  if (!p->same_host) return FERRY_ERR_UNSUPPORTED;  // IPC handles only open on the same host
  if (p->conn_blob_len != 1 || p->conn_blob == nullptr ||
      static_cast<const uint8_t*>(p->conn_blob)[0] != kBlobVersion)
    return FERRY_ERR_INVALID_ARGS;
  return guarded([&] {
    *h = new Peer{p->key};
    return FERRY_OK;
  });
}

void x_peer_remove(void* ctx, void* h) {
  auto* in = static_cast<Instance*>(ctx);
  auto* peer = static_cast<Peer*>(h);
  if (in == nullptr || peer == nullptr) return;
  guarded_void(in->host, "xgmi: peer_remove failed", [&] {
    std::unique_lock<std::mutex> lk(in->mu);
    in->drained.wait(lk, [&] { return peer->inflight == 0; });  // GPU copies always finish
  });
  delete peer;
}

int mem_register_body(void* ctx, const ferry_mem_v1* m, void** h, void* blob, size_t* len) {
  auto* in = static_cast<Instance*>(ctx);
  if (in == nullptr || !FERRY_HAS_FIELD(ferry_mem_v1, m, device) || h == nullptr ||
      blob == nullptr || len == nullptr)
    return FERRY_ERR_INVALID_ARGS;
  if (m->location != FERRY_MEM_GPU) return FERRY_ERR_UNSUPPORTED;
  const ferry_gpu_v1* g = in->gpu;
  void* base = nullptr;
  size_t alloc_size = 0;
  MemBlob b;
  if (g->mem_range(g->gpu_ctx, m->addr, &base, &alloc_size) != FERRY_OK ||
      g->ipc_get_handle(g->gpu_ctx, base, b.handle) != FERRY_OK) {
    in->log(FERRY_LOG_WARN, "cannot export memory: " + in->gpu_error());
    return FERRY_ERR_GPU;
  }
  b.device = m->device;
  b.pid = static_cast<uint64_t>(getpid());
  b.region_id = m->id;
  b.addr = reinterpret_cast<uint64_t>(m->addr);
  b.size = m->size;
  b.offset = b.addr - reinterpret_cast<uint64_t>(base);
  if (*len < sizeof b) return FERRY_ERR_NO_MEMORY;
  std::memcpy(blob, &b, sizeof b);
  *len = sizeof b;
  *h = new Local{static_cast<char*>(m->addr), m->size, m->device};
  return FERRY_OK;
}

int x_mem_register(void* ctx, const ferry_mem_v1* m, void** h, void* blob, size_t* len) {
  return guarded([&] { return mem_register_body(ctx, m, h, blob, len); });
}

void x_mem_deregister(void*, void* h) { delete static_cast<Local*>(h); }

int x_mem_import(void*, void*, uint64_t id, uint64_t size, const void* blob, size_t len, void** h) {
  if (blob == nullptr || h == nullptr) return FERRY_ERR_INVALID_ARGS;
  MemBlob b;
  if (!decode(blob, len, &b) || b.region_id != id || b.size != size) return FERRY_ERR_INVALID_ARGS;
  return guarded([&] {
    *h = new Remote{b, b.pid == static_cast<uint64_t>(getpid())};
    return FERRY_OK;
  });
}

void x_mem_release(void*, void* h) { delete static_cast<Remote*>(h); }

// The remote region's address as seen from `device` in this process.
char* remote_base(Instance* in, const Remote& r, int device, std::string* why) {
  if (r.same_process) return reinterpret_cast<char*>(r.blob.addr);
  std::pair<std::string, int> key(std::string(reinterpret_cast<const char*>(r.blob.handle), 64),
                                  device);
  auto it = in->opened.find(key);
  if (it == in->opened.end()) {
    void* p = nullptr;
    if (in->gpu->ipc_open(in->gpu->gpu_ctx, r.blob.handle, device, &p) != FERRY_OK) {
      *why = "cannot open the peer's IPC handle on device " + std::to_string(device) + ": " +
             in->gpu_error();
      return nullptr;
    }
    it = in->opened.emplace(key, Opened{static_cast<char*>(p), 0}).first;
  }
  ++it->second.refs;
  return it->second.base + r.blob.offset;
}

int post_body(Instance* in, const ferry_xfer_v1* x) {
  auto* local = static_cast<Local*>(x->local_mem);
  auto* remote = static_cast<Remote*>(x->remote_mem);
  auto* peer = static_cast<Peer*>(x->peer);
  if (local == nullptr || remote == nullptr || peer == nullptr || x->iov == nullptr ||
      x->n_iov == 0 || (x->op != FERRY_OP_READ && x->op != FERRY_OP_WRITE)) {
    ferry_plugin_kit::TellRefusal(x, "missing handle, no pieces or unknown op");
    return FERRY_ERR_INVALID_ARGS;
  }
  for (uint32_t i = 0; i < x->n_iov; ++i) {
    const ferry_iov_v1& v = x->iov[i];
    if (v.len == 0 || v.local_off > local->size || v.len > local->size - v.local_off ||
        v.remote_off > remote->blob.size || v.len > remote->blob.size - v.remote_off) {
      ferry_plugin_kit::TellRefusal(x, "a piece is outside a region");
      return FERRY_ERR_INVALID_ARGS;
    }
  }
  const ferry_gpu_v1* g = in->gpu;
  const int dev = local->device;
  std::unique_lock<std::mutex> lk(in->mu);
  std::string why;
  char* rbase = remote_base(in, *remote, dev, &why);
  if (!rbase) {
    lk.unlock();
    in->log(FERRY_LOG_WARN, why);
    ferry_plugin_kit::TellRefusal(x, why.c_str());
    return FERRY_ERR_GPU;
  }
  auto& pool = in->streams[static_cast<size_t>(dev)];
  if (g->set_device(g->gpu_ctx, dev) != FERRY_OK) return FERRY_ERR_GPU;
  if (pool.size() < static_cast<size_t>(in->streams_per_device)) {
    void* s = nullptr;
    if (g->stream_create(g->gpu_ctx, &s) != FERRY_OK) return FERRY_ERR_GPU;
    pool.push_back(s);
  }
  void* stream = pool[in->next_stream[static_cast<size_t>(dev)]++ % pool.size()];
  void* event = nullptr;
  auto& evs = in->free_events[static_cast<size_t>(dev)];
  if (!evs.empty()) {
    event = evs.back();
    evs.pop_back();
  } else if (g->event_create(g->gpu_ctx, &event) != FERRY_OK) {
    return FERRY_ERR_GPU;
  }
  lk.unlock();

  // Merge pieces contiguous on both sides, then one batched call (or a loop).
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  dsts.reserve(x->n_iov);
  srcs.reserve(x->n_iov);
  sizes.reserve(x->n_iov);
  const bool write = x->op == FERRY_OP_WRITE;
  for (uint32_t i = 0; i < x->n_iov; ++i) {
    const ferry_iov_v1& v = x->iov[i];
    char* l = local->addr + v.local_off;
    char* r = rbase + v.remote_off;
    char* dst = write ? r : l;
    const char* src = write ? l : r;
    if (!sizes.empty() && static_cast<char*>(dsts.back()) + sizes.back() == dst &&
        static_cast<const char*>(srcs.back()) + sizes.back() == src) {
      sizes.back() += v.len;
      continue;
    }
    dsts.push_back(dst);
    srcs.push_back(src);
    sizes.push_back(v.len);
  }
  int rc = FERRY_ERR_UNSUPPORTED;
  if (sizes.size() > 1 && in->batch_copy)
    rc = g->memcpy_batch_async(g->gpu_ctx, dsts.data(), srcs.data(), sizes.data(), sizes.size(),
                               stream);
  if (rc == FERRY_ERR_UNSUPPORTED) {
    rc = FERRY_OK;
    for (size_t i = 0; i < sizes.size() && rc == FERRY_OK; ++i)
      rc = g->memcpy_async(g->gpu_ctx, dsts[i], srcs[i], sizes[i], stream);
  }
  if (rc == FERRY_OK) rc = g->event_record(g->gpu_ctx, event, stream);
  lk.lock();
  if (rc != FERRY_OK) {
    evs.push_back(event);
    lk.unlock();
    in->log(FERRY_LOG_WARN, "enqueueing the copy failed: " + in->gpu_error());
    return FERRY_ERR_GPU;
  }
  ++peer->inflight;
  in->pending.push_back({event, dev, x->xfer_ctx, peer, x->total_bytes});
  lk.unlock();
  in->cv.notify_one();
  return FERRY_OK;
}

int x_post(void* ctx, const ferry_xfer_v1* x) {
  auto* in = static_cast<Instance*>(ctx);
  if (in == nullptr || !FERRY_HAS_FIELD(ferry_xfer_v1, x, total_bytes))
    return FERRY_ERR_INVALID_ARGS;
  return guarded([&] { return post_body(in, x); });
}

void x_on_ctrl(void*, const char*, const void*, size_t) {}

int x_describe(void* ctx, char* buf, size_t len) {
  auto* in = static_cast<Instance*>(ctx);
  if (in == nullptr || buf == nullptr || len == 0) return FERRY_ERR_INVALID_ARGS;
  std::snprintf(buf, len, "%s runtime, %d device(s), %d streams/device, batched copies %s",
                in->gpu->vendor == FERRY_GPU_CUDA ? "CUDA" : "HIP", in->gpu->device_count,
                in->streams_per_device, in->batch_copy ? "on (when the runtime has them)" : "off");
  return FERRY_OK;
}

}  // namespace
}  // namespace ferry_xgmi

using namespace ferry_xgmi;

// Designated initialisers: a field named wrongly does not compile (peer_remove,
// mem_deregister and mem_release share one signature).
extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = {
    .struct_size = sizeof(ferry_plugin_ops_v1),
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .name = "xgmi",
    .version = "0.1.0",
    // INITIATOR_COPY: the initiator's peer copy is the whole transfer; complete()
    // comes after its stream finished, so nothing lands later.
    .caps = FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE | FERRY_CAP_SAME_HOST_ONLY |
            FERRY_CAP_INITIATOR_COPY,
    .init = x_init,
    .fini = x_fini,
    .conn_info = x_conn_info,
    .peer_add = x_peer_add,
    .peer_remove = x_peer_remove,
    .mem_register = x_mem_register,
    .mem_deregister = x_mem_deregister,
    .mem_import = x_mem_import,
    .mem_release = x_mem_release,
    .post = x_post,
    .on_ctrl = x_on_ctrl,
    .describe = x_describe,
    .fence = nullptr,  // the initiator's own copy is the whole transfer (INITIATOR_COPY)
};
