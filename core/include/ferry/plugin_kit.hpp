// SPDX-License-Identifier: Apache-2.0
// ferry/plugin_kit.hpp - an optional, header-only C++ adapter for backend
// plugins. The ABI is ferry/plugin.h alone (C99); this header only saves a C++
// author from writing the same entry file every plugin needs:
//
//  - MakeOps<P>() builds the ferry_plugin_ops_v1 table (designated
//    initialisers, the current ABI minor) from a traits struct P that names the
//    plugin and its Instance class. Every entry point is guarded: an exception
//    never crosses the C ABI (std::bad_alloc -> FERRY_ERR_NO_MEMORY, anything
//    else -> FERRY_ERR_INTERNAL, logged with the entry's name), init checks the
//    host table and its arguments, and optional operations (on_ctrl, describe,
//    fence, counters, progress) are filled in only when Instance has them.
//  - Log(), TellRefusal(): the host's log and the ABI 1.3 refusal reason.
//  - ParseSize(), FormatBytes(): the one size grammar of ferry (the policy YAML
//    uses it too): 4096, 4096B, 64K / 64KiB, 1M / 1MiB, 1G / 1GiB, 1KB / 1MB / 1GB
//    (powers of ten).
//  - Settings helpers over nlohmann::json (the Debian package nlohmann-json3-dev):
//    ParseObject, GetInt, GetBytes, GetBool, GetString, with messages that name
//    the key.
//
// The traits struct, for a plugin "demo" (see docs/plugin-guide.md):
//
//   struct DemoPlugin {
//     using Instance = demo::Instance;
//     static constexpr const char* kName = "demo";       // libferry-demo.so
//     static constexpr const char* kVersion = "0.1.0";
//     static constexpr uint64_t kCaps = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_WRITE;
//   };
//   extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
//       ferry::plugin_kit::MakeOps<DemoPlugin>();
//
// or, the same in one statement (what the in-tree plugins write):
//   FERRY_PLUGIN_KIT_ENTRY(demo::Instance, "demo", "0.1.0", FERRY_CAP_MEM_CPU |
//   FERRY_CAP_OP_WRITE);
//
// Instance provides
//   static std::unique_ptr<Instance> Create(const ferry::plugin_kit::InitArgs&,
//                                           int* code, std::string* why);
//   const ferry_host_v1* host() const;
//   int ConnInfo(void* buf, size_t* len);
//   int PeerAdd(const ferry_peer_v1*, void** handle);      void PeerRemove(void* handle);
//   int MemRegister(const ferry_mem_v1*, void** handle, void* blob, size_t* blob_len);
//   void MemDeregister(void* handle);
//   int MemImport(void* peer, uint64_t id, uint64_t size, const void* blob, size_t len,
//                 void** handle);                           void MemRelease(void* handle);
//   int Post(const ferry_xfer_v1*);
// and, optionally,
//   void OnCtrl(const char* peer_key, const void* msg, size_t len);
//   int Describe(char* buf, size_t len);
//   int Fence(const char* peer_key, const uint64_t* ids, size_t n, uint64_t deadline_ns,
//             ferry_fence_result_v1* results);
//   int Counters(char* buf, size_t len);
//   int Progress();  // ABI 1.6: report finished transfers on the calling thread
#ifndef FERRY_PLUGIN_KIT_HPP
#define FERRY_PLUGIN_KIT_HPP

#include <concepts>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>

#include "ferry/plugin.h"

namespace ferry::plugin_kit {

// ---- logging and refusal reasons ---------------------------------------------

// A line through the host's log, so it lands wherever the core's own lines go.
// No "<plugin>:" prefix: the core names the backend in every line.
__attribute__((format(printf, 3, 4))) inline void Log(const ferry_host_v1* host, int level,
                                                      const char* fmt, ...) {
  if (host == nullptr || host->log == nullptr) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  host->log(host->host_ctx, level, buf);
}

// post() refusing: tell the core why (ABI 1.3), so the reason reaches the
// application's TransferStatus::Message(), not only the log. A core older than
// 1.3 passes a shorter struct: then nothing is written.
inline void TellRefusal(const ferry_xfer_v1* x, const char* why) {
  if (!FERRY_HAS_FIELD(ferry_xfer_v1, x, reason_len) || x->reason == nullptr ||
      x->reason_len == 0 || why == nullptr)
    return;
  std::snprintf(x->reason, x->reason_len, "%s", why);
}

// post() refusing with `code`: the reason, then the code, in one statement.
inline int Refuse(const ferry_xfer_v1* x, int code, const std::string& why) {
  TellRefusal(x, why.c_str());
  return code;
}

// ---- sizes: one grammar for the policy and every plugin's settings ------------

inline std::optional<uint64_t> ParseSize(const std::string& s) {
  size_t i = 0;
  uint64_t v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    const uint64_t d = static_cast<uint64_t>(s[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return std::nullopt;
    v = v * 10 + d;
    ++i;
  }
  if (i == 0) return std::nullopt;
  const std::string unit = s.substr(i);
  uint64_t mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  if (unit == "K" || unit == "KiB") mult = 1ull << 10;
  if (unit == "M" || unit == "MiB") mult = 1ull << 20;
  if (unit == "G" || unit == "GiB") mult = 1ull << 30;
  if (unit == "KB") mult = 1000;
  if (unit == "MB") mult = 1000ull * 1000;
  if (unit == "GB") mult = 1000ull * 1000 * 1000;
  if (mult == 0 || v > UINT64_MAX / mult) return std::nullopt;
  return v * mult;
}

// "1MiB", "64KiB", "4097B": as ParseSize reads them back.
inline std::string FormatBytes(uint64_t n) {
  if (n != 0 && n % (1ull << 30) == 0) return std::to_string(n >> 30) + "GiB";
  if (n != 0 && n % (1ull << 20) == 0) return std::to_string(n >> 20) + "MiB";
  if (n != 0 && n % (1ull << 10) == 0) return std::to_string(n >> 10) + "KiB";
  return std::to_string(n) + "B";
}

// ---- settings (the JSON object the core hands to init) -------------------------

// The settings text (NULL means "{}") as a JSON object; *err names the plugin.
inline bool ParseObject(const char* text, const char* plugin, nlohmann::json* out,
                        std::string* err) {
  *out = nlohmann::json::parse(text ? text : "{}", nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded()) {
    *err = std::string(plugin) + " settings are not valid JSON";
    return false;
  }
  if (!out->is_object()) {
    *err = std::string(plugin) + " settings must be a JSON object";
    return false;
  }
  return true;
}

// An integer in lo..hi.
inline bool GetInt(const nlohmann::json& v, const char* key, int64_t lo, int64_t hi, int64_t* out,
                   std::string* err) {
  if (!v.is_number_integer()) {
    *err = std::string("setting '") + key + "' must be an integer";
    return false;
  }
  int64_t val = 0;
  bool ok = true;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(hi);
    val = ok ? static_cast<int64_t>(u) : 0;
  } else {
    val = v.get<int64_t>();
  }
  if (!ok || val < lo || val > hi) {
    *err = std::string("setting '") + key + "' must be in " + std::to_string(lo) + ".." +
           std::to_string(hi);
    return false;
  }
  *out = val;
  return true;
}

// A byte count: 1048576, or a string in ParseSize's grammar ("1MiB", "64K").
inline bool GetBytes(const nlohmann::json& v, const char* key, uint64_t* out, std::string* err) {
  if (v.is_number_integer()) {
    int64_t n = 0;
    if (!GetInt(v, key, 0, INT64_MAX, &n, err)) return false;
    *out = static_cast<uint64_t>(n);
    return true;
  }
  if (!v.is_string()) {
    *err = std::string("setting '") + key + "' must be a byte count like 1048576 or \"1MiB\"";
    return false;
  }
  const std::string s = v.get<std::string>();
  const auto n = ParseSize(s);
  if (!n) {
    *err = std::string("setting '") + key + "': cannot read \"" + s +
           "\" as a size (a number with B, K/KiB, M/MiB, G/GiB, KB, MB or GB)";
    return false;
  }
  *out = *n;
  return true;
}

inline bool GetBool(const nlohmann::json& v, const char* key, bool* out, std::string* err) {
  if (!v.is_boolean()) {
    *err = std::string("setting '") + key + "' must be true or false";
    return false;
  }
  *out = v.get<bool>();
  return true;
}

// A string of 1..max_len printable ASCII characters.
inline bool GetString(const nlohmann::json& v, const char* key, size_t max_len, std::string* out,
                      std::string* err) {
  if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > max_len) {
    *err = std::string("setting '") + key + "' must be a string of 1.." + std::to_string(max_len) +
           " characters";
    return false;
  }
  for (char c : v.get<std::string>()) {
    if (c <= 0x20 || c >= 0x7f) {
      *err = std::string("setting '") + key + "' has a bad character";
      return false;
    }
  }
  *out = v.get<std::string>();
  return true;
}

// ---- files -----------------------------------------------------------------------

// "libferry-tcp.so" or "/dir/libferry-tcp.so" -> "tcp"; empty when the file name does
// not fit the pattern. The one rule the core's loader and ferry-plugin-check apply.
inline std::string PluginNameFromFile(const std::string& path) {
  const auto slash = path.rfind('/');
  const std::string file = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string pre = "libferry-", suf = ".so";
  if (file.size() <= pre.size() + suf.size() || file.compare(0, pre.size(), pre) != 0 ||
      file.compare(file.size() - suf.size(), suf.size(), suf) != 0)
    return {};
  return file.substr(pre.size(), file.size() - pre.size() - suf.size());
}

// ---- the table -------------------------------------------------------------------

// The smallest ops table of ABI 1.0: every 1.0 field, describe included (a
// table built from any plugin.h is at least this long).
inline constexpr size_t kOpsSizeV10 =
    offsetof(ferry_plugin_ops_v1, describe) + sizeof(ferry_plugin_ops_v1::describe);

// Whether the table's length agrees with the minor it states: "" when it does,
// else what is wrong. Readers stay safe either way (a field is used only where
// struct_size covers it); a mismatch means the table was not built from the
// header of that minor. The core's loader warns, ferry-plugin-check fails it.
inline std::string OpsSizeVersusMinor(const ferry_plugin_ops_v1& ops) {
  struct Added {
    uint32_t minor;
    size_t end;  // the table's length once this minor's last field is in
    const char* field;
  };
  static constexpr Added added[] = {
      {2, offsetof(ferry_plugin_ops_v1, fence) + sizeof(ferry_plugin_ops_v1::fence), "fence"},
      {5, offsetof(ferry_plugin_ops_v1, counters) + sizeof(ferry_plugin_ops_v1::counters),
       "counters"},
      {6, offsetof(ferry_plugin_ops_v1, progress) + sizeof(ferry_plugin_ops_v1::progress),
       "progress"}};
  const std::string says = "states ABI 1." + std::to_string(ops.abi_minor);
  for (const Added& a : added) {
    if (ops.abi_minor >= a.minor && ops.struct_size < a.end)
      return says + " but its " + std::to_string(ops.struct_size) + "-byte table ends before " +
             a.field + " (1." + std::to_string(a.minor) + ", " + std::to_string(a.end) + " bytes)";
    if (ops.abi_minor < a.minor && ops.struct_size >= a.end)
      return says + " but its " + std::to_string(ops.struct_size) + "-byte table covers " +
             a.field + ", added in 1." + std::to_string(a.minor);
  }
  return {};
}

// The first required function (ABI 1.0: init .. on_ctrl) that is NULL, or
// nullptr when all are there: what the core's loader and ferry-plugin-check refuse.
inline const char* MissingRequired(const ferry_plugin_ops_v1& ops) {
  const std::pair<const void*, const char*> required[] = {
      {reinterpret_cast<const void*>(ops.init), "init"},
      {reinterpret_cast<const void*>(ops.fini), "fini"},
      {reinterpret_cast<const void*>(ops.conn_info), "conn_info"},
      {reinterpret_cast<const void*>(ops.peer_add), "peer_add"},
      {reinterpret_cast<const void*>(ops.peer_remove), "peer_remove"},
      {reinterpret_cast<const void*>(ops.mem_register), "mem_register"},
      {reinterpret_cast<const void*>(ops.mem_deregister), "mem_deregister"},
      {reinterpret_cast<const void*>(ops.mem_import), "mem_import"},
      {reinterpret_cast<const void*>(ops.mem_release), "mem_release"},
      {reinterpret_cast<const void*>(ops.post), "post"},
      {reinterpret_cast<const void*>(ops.on_ctrl), "on_ctrl"}};
  for (const auto& [fn, name] : required)
    if (fn == nullptr) return name;
  return nullptr;
}

// ---- the entry points ------------------------------------------------------------

// What init() was given, checked: host has the 1.0 services, key non-empty.
struct InitArgs {
  const ferry_host_v1* host = nullptr;
  const char* engine_key = "";
  const char* node_id = "";
  const char* settings_json = "{}";
};

// The usual Instance::Create: parse the settings with
// parse(const char* json, Settings*, std::string* why) (a refusal is
// FERRY_ERR_INVALID_ARGS), construct Instance(host, engine_key, Settings&&) and
// Start it: bool Start(int* code, std::string* why), or bool Start(std::string*
// why), which fails with start_failure.
template <typename I, typename Settings, typename Parse>
std::unique_ptr<I> ParseAndStart(const InitArgs& a, Parse&& parse, int start_failure, int* code,
                                 std::string* why) {
  Settings settings;
  if (!parse(a.settings_json, &settings, why)) {
    *code = FERRY_ERR_INVALID_ARGS;
    return nullptr;
  }
  auto inst = std::make_unique<I>(a.host, a.engine_key, std::move(settings));
  *code = start_failure;
  bool started = false;
  if constexpr (requires(I & i) { i.Start(code, why); }) {
    started = inst->Start(code, why);
  } else {
    started = inst->Start(why);
  }
  if (!started) return nullptr;
  return inst;
}

namespace detail {

inline void SetErr(char* err, size_t errlen, const std::string& msg) {
  if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", msg.c_str());
}

template <typename I>
concept HasOnCtrl = requires(I& i, const char* k, const void* m, size_t n) {
  i.OnCtrl(k, m, n);
};
template <typename I>
concept HasDescribe = requires(I& i, char* b, size_t n) {
  { i.Describe(b, n) } -> std::same_as<int>;
};
template <typename I>
concept HasCounters = requires(I& i, char* b, size_t n) {
  { i.Counters(b, n) } -> std::same_as<int>;
};
template <typename I>
concept HasProgress = requires(I& i) {
  { i.Progress() } -> std::same_as<int>;
};
template <typename I>
concept HasFence = requires(I& i, const char* k, const uint64_t* ids, size_t n, uint64_t d,
                            ferry_fence_result_v1* r) {
  { i.Fence(k, ids, n, d, r) } -> std::same_as<int>;
};

template <typename P>
struct Entry {
  using I = typename P::Instance;
  static I* Self(void* ctx) { return static_cast<I*>(ctx); }

  // Runs fn, mapping exceptions to codes and logging which entry they came from.
  template <typename Fn>
  static int Guard(void* ctx, const char* what, Fn&& fn) noexcept {
    const ferry_host_v1* host = ctx ? Self(ctx)->host() : nullptr;
    try {
      return fn();
    } catch (const std::bad_alloc&) {
      Log(host, FERRY_LOG_ERROR, "%s: out of memory", what);
      return FERRY_ERR_NO_MEMORY;
    } catch (const std::exception& e) {
      Log(host, FERRY_LOG_ERROR, "%s: %s", what, e.what());
      return FERRY_ERR_INTERNAL;
    } catch (...) {
      Log(host, FERRY_LOG_ERROR, "%s: unknown exception", what);
      return FERRY_ERR_INTERNAL;
    }
  }
  template <typename Fn>
  static void GuardVoid(void* ctx, const char* what, Fn&& fn) noexcept {
    (void)Guard(ctx, what, [&] {
      fn();
      return FERRY_OK;
    });
  }

  static int Init(const ferry_host_v1* host, const char* engine_key, const char* node_id,
                  const char* settings_json, void** ctx, char* err, size_t errlen) noexcept {
    const std::string name = P::kName;
    try {
      if (host == nullptr || ctx == nullptr || !FERRY_HAS_FIELD(ferry_host_v1, host, inbound) ||
          host->complete == nullptr || host->now_ns == nullptr) {
        SetErr(err, errlen, name + ": host services table is missing or too old");
        return FERRY_ERR_INVALID_ARGS;
      }
      if (engine_key == nullptr || engine_key[0] == '\0') {
        SetErr(err, errlen, name + ": empty engine key");
        return FERRY_ERR_INVALID_ARGS;
      }
      InitArgs a{host, engine_key, node_id ? node_id : "", settings_json ? settings_json : "{}"};
      int code = FERRY_ERR_INTERNAL;
      std::string why;
      std::unique_ptr<I> inst = I::Create(a, &code, &why);
      if (!inst) {
        SetErr(err, errlen, name + ": " + (why.empty() ? "init failed" : why));
        return code < 0 ? code : FERRY_ERR_INTERNAL;
      }
      *ctx = inst.release();
      return FERRY_OK;
    } catch (const std::bad_alloc&) {
      SetErr(err, errlen, name + ": out of memory");
      return FERRY_ERR_NO_MEMORY;
    } catch (const std::exception& e) {
      SetErr(err, errlen, name + ": " + e.what());
      return FERRY_ERR_INTERNAL;
    } catch (...) {
      SetErr(err, errlen, name + ": unknown error during init");
      return FERRY_ERR_INTERNAL;
    }
  }
  static void Fini(void* ctx) noexcept {
    GuardVoid(ctx, "fini", [&] { delete Self(ctx); });
  }
  static int ConnInfo(void* ctx, void* buf, size_t* len) noexcept {
    if (buf == nullptr || len == nullptr) return FERRY_ERR_INVALID_ARGS;
    return Guard(ctx, "conn_info", [&] { return Self(ctx)->ConnInfo(buf, len); });
  }
  static int PeerAdd(void* ctx, const ferry_peer_v1* peer, void** handle) noexcept {
    if (peer == nullptr || handle == nullptr) return FERRY_ERR_INVALID_ARGS;
    return Guard(ctx, "peer_add", [&] { return Self(ctx)->PeerAdd(peer, handle); });
  }
  static void PeerRemove(void* ctx, void* handle) noexcept {
    GuardVoid(ctx, "peer_remove", [&] { Self(ctx)->PeerRemove(handle); });
  }
  static int MemRegister(void* ctx, const ferry_mem_v1* mem, void** handle, void* blob,
                         size_t* blob_len) noexcept {
    if (mem == nullptr || handle == nullptr || blob == nullptr || blob_len == nullptr)
      return FERRY_ERR_INVALID_ARGS;
    return Guard(ctx, "mem_register",
                 [&] { return Self(ctx)->MemRegister(mem, handle, blob, blob_len); });
  }
  static void MemDeregister(void* ctx, void* handle) noexcept {
    GuardVoid(ctx, "mem_deregister", [&] { Self(ctx)->MemDeregister(handle); });
  }
  static int MemImport(void* ctx, void* peer, uint64_t remote_id, uint64_t remote_size,
                       const void* blob, size_t blob_len, void** handle) noexcept {
    if (handle == nullptr || (blob == nullptr && blob_len != 0)) return FERRY_ERR_INVALID_ARGS;
    return Guard(ctx, "mem_import", [&] {
      return Self(ctx)->MemImport(peer, remote_id, remote_size, blob, blob_len, handle);
    });
  }
  static void MemRelease(void* ctx, void* handle) noexcept {
    GuardVoid(ctx, "mem_release", [&] { Self(ctx)->MemRelease(handle); });
  }
  static int Post(void* ctx, const ferry_xfer_v1* xfer) noexcept {
    if (xfer == nullptr) return FERRY_ERR_INVALID_ARGS;
    return Guard(ctx, "post", [&] { return Self(ctx)->Post(xfer); });
  }
  static void OnCtrl(void* ctx, const char* peer_key, const void* msg, size_t len) noexcept {
    if constexpr (HasOnCtrl<I>) {
      GuardVoid(ctx, "on_ctrl", [&] { Self(ctx)->OnCtrl(peer_key, msg, len); });
    } else {
      // This plugin never sends control messages; one that arrives is a peer's mistake.
      Log(Self(ctx)->host(), FERRY_LOG_DEBUG, "ignoring a %zu-byte control message from %s", len,
          peer_key ? peer_key : "?");
    }
  }
  // The optional entries compile for every Instance; MakeOps leaves out those
  // the Instance does not have.
  // describe() and counters(): text into a buffer of the core's.
  template <bool kHas, typename Fn>
  static int IntoBuffer(void* ctx, const char* what, char* buf, size_t len, Fn&& fn) noexcept {
    if (buf == nullptr || len == 0) return FERRY_ERR_INVALID_ARGS;
    if constexpr (kHas) {
      return Guard(ctx, what, [&] { return fn(Self(ctx)); });
    } else {
      return FERRY_ERR_UNSUPPORTED;
    }
  }
  static int Describe(void* ctx, char* buf, size_t len) noexcept {
    return IntoBuffer<HasDescribe<I>>(ctx, "describe", buf, len,
                                      [&](auto* self) { return self->Describe(buf, len); });
  }
  static int Counters(void* ctx, char* buf, size_t len) noexcept {
    return IntoBuffer<HasCounters<I>>(ctx, "counters", buf, len,
                                      [&](auto* self) { return self->Counters(buf, len); });
  }
  static int Progress(void* ctx) noexcept {
    if constexpr (HasProgress<I>) {
      return Guard(ctx, "progress", [&] { return Self(ctx)->Progress(); });
    } else {
      return FERRY_ERR_UNSUPPORTED;
    }
  }
  static int Fence(void* ctx, const char* peer_key, const uint64_t* ids, size_t n,
                   uint64_t deadline_ns, ferry_fence_result_v1* results) noexcept {
    if (peer_key == nullptr || (n > 0 && (ids == nullptr || results == nullptr)))
      return FERRY_ERR_INVALID_ARGS;
    if constexpr (HasFence<I>) {
      return Guard(ctx, "fence",
                   [&] { return Self(ctx)->Fence(peer_key, ids, n, deadline_ns, results); });
    } else {
      return FERRY_ERR_UNSUPPORTED;
    }
  }
};

}  // namespace detail

// The ops table for traits P (see the top of this file).
template <typename P>
constexpr ferry_plugin_ops_v1 MakeOps() {
  using E = detail::Entry<P>;
  using I = typename P::Instance;
  static_assert((P::kCaps & FERRY_CAP_FENCE) == 0 || detail::HasFence<I>,
                "FERRY_CAP_FENCE needs Instance::Fence");
  return ferry_plugin_ops_v1{
      .struct_size = sizeof(ferry_plugin_ops_v1),
      .abi_minor = FERRY_PLUGIN_ABI_MINOR,
      .name = P::kName,
      .version = P::kVersion,
      .caps = P::kCaps,
      .init = E::Init,
      .fini = E::Fini,
      .conn_info = E::ConnInfo,
      .peer_add = E::PeerAdd,
      .peer_remove = E::PeerRemove,
      .mem_register = E::MemRegister,
      .mem_deregister = E::MemDeregister,
      .mem_import = E::MemImport,
      .mem_release = E::MemRelease,
      .post = E::Post,
      .on_ctrl = E::OnCtrl,
      .describe = detail::HasDescribe<I> ? &E::Describe : nullptr,
      .fence = detail::HasFence<I> ? &E::Fence : nullptr,
      .counters = detail::HasCounters<I> ? &E::Counters : nullptr,
      .progress = detail::HasProgress<I> ? &E::Progress : nullptr,
  };
}

}  // namespace ferry::plugin_kit

// A whole entry file in one statement: the traits struct and the exported table.
//   FERRY_PLUGIN_KIT_ENTRY(demo::Instance, "demo", "0.1.0", FERRY_CAP_MEM_CPU | ...);
#define FERRY_PLUGIN_KIT_ENTRY(INSTANCE, NAME, VERSION, CAPS)                \
  namespace {                                                                \
  struct FerryPluginKitTraits {                                              \
    using Instance = INSTANCE;                                               \
    static constexpr const char* kName = NAME;                               \
    static constexpr const char* kVersion = VERSION;                         \
    static constexpr uint64_t kCaps = CAPS;                                  \
  };                                                                         \
  }                                                                          \
  extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = \
      ferry::plugin_kit::MakeOps<FerryPluginKitTraits>()

#endif  // FERRY_PLUGIN_KIT_HPP
