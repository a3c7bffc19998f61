// SPDX-License-Identifier: Apache-2.0
// The services the core offers plugins (ferry_host_v1) and the plugin error
// codes' names. Every callback is noexcept with a catch-all: nothing unwinds
// into a plugin's C frames.
#include <algorithm>
#include <chrono>
#include <cstring>

#include "engine_impl.h"
#include "gpu_runtime.h"
#include "host_link.h"
#include "hot_path.h"
#include "log.h"

namespace ferry {

namespace {

// An allocation failure inside a callback is logged and the call dropped.
void host_failed(const char* what) noexcept {
  try {
    log_line(LogLevel::ERROR, "core", std::string("host callback ") + what + " failed");
  } catch (...) {
  }
}

void host_log(void* hctx, int level, const char* msg) noexcept {
  HostLink::Use use(hctx, "log");
  try {
    Backend* b = use.backend();
    LogLevel l = level <= FERRY_LOG_ERROR  ? LogLevel::ERROR
                 : level == FERRY_LOG_WARN ? LogLevel::WARN
                 : level == FERRY_LOG_INFO ? LogLevel::INFO
                                           : LogLevel::DEBUG;
    // After fini the name is gone with the backend; the line is still worth showing.
    if (log_enabled(l)) log_line(l, b ? b->name : "plugin after fini", msg ? msg : "");
  } catch (...) {
  }
}

uint64_t host_now_ns(void*) noexcept {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

int host_ctrl_send(void* hctx, const char* peer, const void* msg, size_t len) noexcept {
  HostLink::Use use(hctx, "ctrl_send");
  try {
    Backend* b = use.backend();
    if (!b) return FERRY_ERR_BAD_STATE;
    if (!peer || (!msg && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->ctrl_send(*b, peer, msg, len);
  } catch (...) {
    host_failed("ctrl_send");
    return FERRY_ERR_NO_MEMORY;
  }
}

int host_ctrl_try_send(void* hctx, const char* peer, const void* msg, size_t len) noexcept {
  HostLink::Use use(hctx, "ctrl_try_send");
  try {
    Backend* b = use.backend();
    if (!b) return FERRY_ERR_BAD_STATE;
    if (!peer || (!msg && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->ctrl_try_send(*b, peer, msg, len);
  } catch (...) {
    host_failed("ctrl_try_send");
    return FERRY_ERR_NOT_SENT;  // allocating the frame failed before anything left
  }
}

FERRY_HOT void host_complete(void* hctx, void* xfer_ctx, int status, const char* message) noexcept {
  HostLink::Use use(hctx, "complete");
  Backend* b = use.backend();
  if (!b) return;  // after fini: what it held was completed when it was removed
  std::shared_ptr<Attempt> a;
  try {
    a = b->attempts.take(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(xfer_ctx)));
  } catch (...) {
  }
  if (!a) {  // not held: a second complete() of one transfer, or a bad context (an ABI breach)
    ++b->counters->stray_completions;
    try {
      log_line(LogLevel::ERROR, "core",
               "plugin '" + b->name +
                   "' completed a transfer it did not hold (a second completion, or a context "
                   "it was never given); ignored");
    } catch (...) {
    }
    return;
  }
  try {
    b->engine->transfers().complete(a, status, message);
  } catch (...) {
    host_failed("complete");
    // Still end the transfer: its application must not wait forever - nor
    // the multi-region call it is a part of (on_end counts the part).
    try {
      const std::string why = "internal error completing the transfer";
      Transfer& t = *a->transfer;
      if (t.status.Finish(StatusCode::ERR_BAD_STATE, why) && t.on_end)
        t.on_end(StatusCode::ERR_BAD_STATE, why);
    } catch (...) {
      host_failed("complete (ending the transfer)");
    }
  }
}

void host_inbound(void* hctx, const char* peer, uint64_t uid, int status) noexcept {
  HostLink::Use use(hctx, "inbound");
  try {
    Backend* b = use.backend();
    if (b && peer) b->engine->inbound(peer, uid, status);
  } catch (...) {
    host_failed("inbound");
  }
}

int host_auth_sign(void* hctx, const void* challenge, size_t len, uint8_t mac[32]) noexcept {
  HostLink::Use use(hctx, "auth_sign");
  try {
    Backend* b = use.backend();
    if (!b) return FERRY_ERR_BAD_STATE;
    if (!mac || (!challenge && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->auth_sign(challenge, len, mac);
  } catch (...) {
    host_failed("auth_sign");
    return FERRY_ERR_INTERNAL;
  }
}

int host_auth_verify(void* hctx, const void* challenge, size_t len,
                     const uint8_t mac[32]) noexcept {
  HostLink::Use use(hctx, "auth_verify");
  try {
    Backend* b = use.backend();
    if (!b) return FERRY_ERR_BAD_STATE;
    if (!mac || (!challenge && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->auth_verify(challenge, len, mac);
  } catch (...) {
    host_failed("auth_verify");
    return FERRY_ERR_INTERNAL;
  }
}

int host_link_prove(void* hctx, const char* peer, uint32_t role, const void* transcript, size_t len,
                    uint8_t* proof) noexcept {
  HostLink::Use use(hctx, "link_prove");
  try {
    Backend* b = use.backend();
    if (!b) return FERRY_ERR_BAD_STATE;
    if (!peer || !proof || (!transcript && len)) return FERRY_ERR_INVALID_ARGS;
    return b->engine->link_auth().prove(peer, role, transcript, len, proof);
  } catch (...) {
    host_failed("link_prove");
    return FERRY_ERR_INTERNAL;
  }
}

int host_link_check(void* hctx, const char* peer, uint32_t role, const void* transcript, size_t len,
                    const uint8_t* proof, char* why, size_t why_len) noexcept {
  HostLink::Use use(hctx, "link_check");
  try {
    Backend* b = use.backend();
    if (!b) return FERRY_ERR_BAD_STATE;
    if (!peer || !proof || (!transcript && len)) return FERRY_ERR_INVALID_ARGS;
    std::string reason;
    int rc = b->engine->link_auth().check(peer, role, transcript, len, proof, &reason);
    if (rc != FERRY_OK && why && why_len > 0) {
      size_t n = std::min(reason.size(), why_len - 1);
      std::memcpy(why, reason.data(), n);
      why[n] = '\0';
    }
    return rc;
  } catch (...) {
    host_failed("link_check");
    return FERRY_ERR_INTERNAL;
  }
}

}  // namespace

void attach_host_link(Backend& b) {
  // The same functions for every link: a reused link's table is never rewritten.
  static const ferry_host_v1 functions = [] {
    ferry_host_v1 h{};
    h.struct_size = sizeof(ferry_host_v1);
    h.log = host_log;
    h.now_ns = host_now_ns;
    h.ctrl_send = host_ctrl_send;
    h.complete = host_complete;
    h.inbound = host_inbound;
    h.auth_sign = host_auth_sign;
    h.auth_verify = host_auth_verify;
    h.link_prove = host_link_prove;
    h.link_check = host_link_check;
    h.gpu = gpu_runtime();
    h.ctrl_try_send = host_ctrl_try_send;
    return h;
  }();
  b.link = HostLink::acquire(&b, functions);
}

StatusCode status_from_plugin(int rc) {
  switch (rc) {
    case FERRY_OK:
      return StatusCode::SUCCESS;
    case FERRY_ERR_INVALID_ARGS:
      return StatusCode::ERR_INVALID_ARGS;
    case FERRY_ERR_NOT_FOUND:
      return StatusCode::ERR_NOT_FOUND;
    case FERRY_ERR_BAD_STATE:
      return StatusCode::ERR_BAD_STATE;
    case FERRY_ERR_TIMEOUT:
      return StatusCode::ERR_TIMEOUT;
    case FERRY_ERR_GPU:
      return StatusCode::ERR_GPU_OP;
    default:
      return StatusCode::ERR_TRANSPORT;
  }
}

std::string plugin_error_name(int rc) {
  switch (rc) {
    case FERRY_ERR_INVALID_ARGS:
      return "invalid arguments";
    case FERRY_ERR_NOT_FOUND:
      return "not found";
    case FERRY_ERR_BAD_STATE:
      return "bad state";
    case FERRY_ERR_NO_MEMORY:
      return "out of memory";
    case FERRY_ERR_UNSUPPORTED:
      return "unsupported";
    case FERRY_ERR_TRANSPORT:
      return "transport error";
    case FERRY_ERR_TIMEOUT:
      return "timed out";
    case FERRY_ERR_REMOTE:
      return "refused by the target";
    case FERRY_ERR_GPU:
      return "GPU error";
    case FERRY_ERR_NO_DEVICE:
      return "no device";
    case FERRY_ERR_PROTOCOL:
      return "protocol error";
    case FERRY_ERR_NOT_SENT:
      return "not sent (the target was not reached)";
    default:
      return "error " + std::to_string(rc);
  }
}

// ---- host services ------------------------------------------------------------------

int EngineImpl::ctrl_send(Backend& b, const char* peer_key, const void* msg, size_t len) {
  std::string host;
  uint16_t port = 0;
  if (!registry_.peer_address(peer_key, host, port)) return FERRY_ERR_NOT_FOUND;
  std::string err;
  // Bounded: a plugin's thread must not wait for a peer that stopped reading.
  constexpr auto kPluginSendWait = std::chrono::seconds(5);
  int rc = control_->send(peer_key, host, port, CtrlType::PLUGIN, plugin_body(b.name, msg, len),
                          &err, ControlPlane::Clock::now() + kPluginSendWait);
  if (rc != FERRY_OK)
    FERRY_LOG(WARN, b.name, "control message to " + std::string(peer_key) + " failed: " + err);
  return rc;
}

int EngineImpl::ctrl_try_send(Backend& b, const char* peer_key, const void* msg, size_t len) {
  int rc = FERRY_ERR_NOT_SENT;
  std::string err;
  if (!control_->try_send(peer_key, CtrlType::PLUGIN, plugin_body(b.name, msg, len), &rc, &err))
    return FERRY_ERR_NOT_SENT;
  if (rc != FERRY_OK)
    FERRY_LOG(WARN, b.name, "control message to " + std::string(peer_key) + " failed: " + err);
  return rc;
}

void EngineImpl::inbound(const char* peer_key, uint64_t uid, int status, const NotifySeq* seq) {
  if (status != FERRY_OK) {
    // Only landings are recorded: a failed attempt may be retried elsewhere.
    FERRY_LOG(DEBUG, key_,
              "inbound transfer " + std::to_string(uid) + " from " + peer_key +
                  " failed on the target: " + plugin_error_name(status));
    return;
  }
  const uint64_t dropped_before = inbound_.dropped();
  if (inbound_.land(peer_key, uid, StatusCode::SUCCESS, seq)) ++inbound_count_;
  uint64_t held = 0;
  if (inbound_.dropped() != dropped_before && log_enabled(LogLevel::WARN) &&
      log_limiter_.Allow("inbound-dropped " + std::string(peer_key), &held))
    log_line(LogLevel::WARN, key_,
             "inbound statuses from '" + std::string(peer_key) +
                 "' are not being popped: the oldest are dropped (at most " +
                 std::to_string(inbound_.limits().max_per_peer) + " per peer, " +
                 std::to_string(inbound_.limits().max_age.count()) + " ms; " +
                 std::to_string(inbound_.dropped()) + " dropped so far)");
}

int EngineImpl::auth_sign(const void* challenge, size_t len, uint8_t mac[32]) const {
  if (!creds_.token().enabled()) return FERRY_ERR_UNSUPPORTED;
  return creds_.token().sign(challenge, len, mac) ? FERRY_OK : FERRY_ERR_INTERNAL;
}

int EngineImpl::auth_verify(const void* challenge, size_t len, const uint8_t mac[32]) const {
  if (!creds_.token().enabled()) return FERRY_ERR_UNSUPPORTED;
  return creds_.token().verify(challenge, len, mac) ? FERRY_OK : FERRY_ERR_REMOTE;
}

}  // namespace ferry
