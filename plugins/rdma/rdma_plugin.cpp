// The C ABI entry point of libferry-rdma.so. Nothing throws past this file:
// every entry catches and turns failures into FERRY_ERR_* codes.
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>

#include "ferry/plugin.h"
#include "instance.h"
#include "log.h"
#include "settings.h"

namespace ferry_rdma {
namespace {

Instance* Self(void* ctx) { return static_cast<Instance*>(ctx); }

template <typename Fn>
int Guard(void* ctx, const char* what, Fn&& fn) {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    if (ctx) Log(Self(ctx)->host(), FERRY_LOG_ERROR, "%s: out of memory", what);
    return FERRY_ERR_NO_MEMORY;
  } catch (const std::exception& e) {
    if (ctx) Log(Self(ctx)->host(), FERRY_LOG_ERROR, "%s: %s", what, e.what());
    return FERRY_ERR_INTERNAL;
  } catch (...) {
    if (ctx) Log(Self(ctx)->host(), FERRY_LOG_ERROR, "%s: unknown exception", what);
    return FERRY_ERR_INTERNAL;
  }
}

void SetErr(char* err, size_t errlen, const std::string& msg) {
  if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", msg.c_str());
}

int Init(const ferry_host_v1* host, const char* engine_key, const char* node_id,
         const char* settings_json, void** ctx, char* err, size_t errlen) {
  try {
    if (host == nullptr || ctx == nullptr || !FERRY_HAS_FIELD(ferry_host_v1, host, inbound) ||
        host->complete == nullptr || host->now_ns == nullptr || host->ctrl_send == nullptr ||
        host->inbound == nullptr) {
      SetErr(err, errlen, "rdma: host services table is missing or too old");
      return FERRY_ERR_INVALID_ARGS;
    }
    if (engine_key == nullptr || engine_key[0] == '\0') {
      SetErr(err, errlen, "rdma: empty engine key");
      return FERRY_ERR_INVALID_ARGS;
    }
    Settings settings;
    std::string why;
    if (!ParseSettings(settings_json, &settings, &why)) {
      SetErr(err, errlen, "rdma: " + why);
      return FERRY_ERR_INVALID_ARGS;
    }
    auto inst = std::make_unique<Instance>(host, engine_key, std::move(settings));
    int code = FERRY_ERR_INTERNAL;
    if (!inst->Start(&code, &why)) {
      SetErr(err, errlen, "rdma: " + why);
      return code;
    }
    *ctx = inst.release();
    return FERRY_OK;
  } catch (const std::bad_alloc&) {
    SetErr(err, errlen, "rdma: out of memory");
    return FERRY_ERR_NO_MEMORY;
  } catch (const std::exception& e) {
    SetErr(err, errlen, std::string("rdma: ") + e.what());
    return FERRY_ERR_INTERNAL;
  } catch (...) {
    SetErr(err, errlen, "rdma: unknown error during init");
    return FERRY_ERR_INTERNAL;
  }
}

void Fini(void* ctx) {
  Guard(ctx, "fini", [&] {
    delete Self(ctx);
    return FERRY_OK;
  });
}

int ConnInfo(void* ctx, void* buf, size_t* len) {
  return Guard(ctx, "conn_info", [&] { return Self(ctx)->ConnInfo(buf, len); });
}

int PeerAdd(void* ctx, const ferry_peer_v1* peer, void** handle) {
  return Guard(ctx, "peer_add", [&] { return Self(ctx)->PeerAdd(peer, handle); });
}

void PeerRemove(void* ctx, void* handle) {
  Guard(ctx, "peer_remove", [&] {
    Self(ctx)->PeerRemove(handle);
    return FERRY_OK;
  });
}

int MemRegister(void* ctx, const ferry_mem_v1* mem, void** handle, void* blob, size_t* blob_len) {
  return Guard(ctx, "mem_register",
               [&] { return Self(ctx)->MemRegister(mem, handle, blob, blob_len); });
}

void MemDeregister(void* ctx, void* handle) {
  Guard(ctx, "mem_deregister", [&] {
    Self(ctx)->MemDeregister(handle);
    return FERRY_OK;
  });
}

int MemImport(void* ctx, void* peer, uint64_t remote_id, uint64_t remote_size, const void* blob,
              size_t blob_len, void** handle) {
  return Guard(ctx, "mem_import", [&] {
    return Self(ctx)->MemImport(peer, remote_id, remote_size, blob, blob_len, handle);
  });
}

void MemRelease(void* ctx, void* handle) {
  Guard(ctx, "mem_release", [&] {
    Self(ctx)->MemRelease(handle);
    return FERRY_OK;
  });
}

int Post(void* ctx, const ferry_xfer_v1* xfer) {
  return Guard(ctx, "post", [&] { return Self(ctx)->Post(xfer); });
}

void OnCtrl(void* ctx, const char* peer_key, const void* msg, size_t len) {
  Guard(ctx, "on_ctrl", [&] {
    Self(ctx)->OnCtrl(peer_key, msg, len);
    return FERRY_OK;
  });
}

int Describe(void* ctx, char* buf, size_t len) {
  return Guard(ctx, "describe", [&] { return Self(ctx)->Describe(buf, len); });
}

int Fence(void* ctx, const char* peer_key, const uint64_t*, size_t n, uint64_t,
          ferry_fence_result_v1* out) {
  return Guard(ctx, "fence", [&] { return Self(ctx)->Fence(peer_key, n, out); });
}

}  // namespace
}  // namespace ferry_rdma

extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = {
    sizeof(ferry_plugin_ops_v1),
    FERRY_PLUGIN_ABI_MINOR,
    "rdma",
    "0.1.0",
    // FENCE: the target retires the QPs serving the fenced initiator (Fence()).
    FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE |
        FERRY_CAP_NATIVE_NOTIFY | FERRY_CAP_FENCE,
    ferry_rdma::Init,
    ferry_rdma::Fini,
    ferry_rdma::ConnInfo,
    ferry_rdma::PeerAdd,
    ferry_rdma::PeerRemove,
    ferry_rdma::MemRegister,
    ferry_rdma::MemDeregister,
    ferry_rdma::MemImport,
    ferry_rdma::MemRelease,
    ferry_rdma::Post,
    ferry_rdma::OnCtrl,
    ferry_rdma::Describe,
    ferry_rdma::Fence,
};
