// SPDX-License-Identifier: Apache-2.0
#include "abi_rules.h"

#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>

#include "ferry/plugin.h"
#include "ferry/plugin_kit.hpp"

namespace ferry::plugin_check {
namespace {

// The host table as a core of ABI 1.0 passed it: log, now_ns, ctrl_send,
// complete, inbound, and nothing after.
ferry_host_v1 oldest_host() {
  ferry_host_v1 h{};
  h.struct_size = static_cast<uint32_t>(offsetof(ferry_host_v1, gpu));
  h.log = [](void*, int level, const char* msg) {
    std::fprintf(stderr, "  [plugin log %d] %s\n", level, msg ? msg : "");
  };
  h.now_ns = [](void*) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  };
  h.ctrl_send = [](void*, const char*, const void*, size_t) { return FERRY_ERR_UNSUPPORTED; };
  h.complete = [](void*, void*, int, const char*) {};
  h.inbound = [](void*, const char*, uint64_t, int) {};
  return h;
}

// In a child, so a crash is a verdict and not the end of the check: init with
// the 1.0 host table must succeed or refuse with a reason; fini must return.
// Exit 0: started and finished; 1: refused with a reason; 2: refused silently.
int init_with_oldest_host(const ferry_plugin_ops_v1* ops, const std::string& settings) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ferry_host_v1 h = oldest_host();
    void* ctx = nullptr;
    char err[512] = "";
    int rc =
        ops->init(&h, "plugin-check", "plugin-check-node", settings.c_str(), &ctx, err, sizeof err);
    if (rc == FERRY_OK) {
      ops->fini(ctx);
      ::_exit(0);
    }
    std::fprintf(stderr, "  init with the ABI 1.0 host table refused (%d): %s\n", rc, err);
    ::_exit(err[0] != '\0' ? 1 : 2);
  }
  int st = 0;
  if (pid < 0 || ::waitpid(pid, &st, 0) != pid) return -1;
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

}  // namespace

bool run_abi_rules(const std::string& path, const std::string& settings_json, Report& r,
                   PluginFacts* facts) {
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    r.fail("abi: loads", std::string("dlopen: ") + (e ? e : "?"));
    return false;
  }
  auto* ops = static_cast<const ferry_plugin_ops_v1*>(::dlsym(h, FERRY_PLUGIN_SYMBOL_V1));
  if (!r.check(ops != nullptr, "abi: entry symbol", ops ? FERRY_PLUGIN_SYMBOL_V1 : "missing")) {
    ::dlclose(h);
    return false;
  }
  // The 1.0 table ends with describe; a shorter one cannot be a plugin.
  const size_t v10 = plugin_kit::kOpsSizeV10;
  if (!r.check(ops->struct_size >= v10 && ops->struct_size % 8 == 0, "abi: struct_size",
               std::to_string(ops->struct_size) + " bytes (1.0 needs " + std::to_string(v10) +
                   ", this header " + std::to_string(sizeof(ferry_plugin_ops_v1)) + ")")) {
    ::dlclose(h);
    return false;
  }
  r.check(ops->abi_minor <= FERRY_PLUGIN_ABI_MINOR, "abi: abi_minor",
          "1." + std::to_string(ops->abi_minor) + " (this core serves 1." +
              std::to_string(FERRY_PLUGIN_ABI_MINOR) + ")");
  // A table longer or shorter than its minor says was not built from that header.
  const bool covers_fence = FERRY_HAS_FIELD(ferry_plugin_ops_v1, ops, fence);
  const bool covers_counters = FERRY_HAS_FIELD(ferry_plugin_ops_v1, ops, counters);
  const bool covers_progress = FERRY_HAS_FIELD(ferry_plugin_ops_v1, ops, progress);
  const std::string size_vs_minor = plugin_kit::OpsSizeVersusMinor(*ops);
  r.check(size_vs_minor.empty(), "abi: struct_size matches abi_minor",
          size_vs_minor.empty() ? "yes" : size_vs_minor);
  const std::string expected = plugin_kit::PluginNameFromFile(path);
  r.check(ops->name != nullptr && expected == ops->name, "abi: name matches the file",
          std::string("'") + (ops->name ? ops->name : "(null)") + "' in " + path);
  r.check(ops->version != nullptr && ops->version[0] != '\0', "abi: version",
          ops->version ? ops->version : "(null)");
  const char* missing = ferry::plugin_kit::MissingRequired(*ops);
  if (!r.check(missing == nullptr, "abi: required operations",
               missing == nullptr ? "all present" : std::string("NULL: ") + missing)) {
    ::dlclose(h);
    return false;
  }
  const uint64_t caps = ops->caps;
  std::string caps_why;
  if ((caps & (FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE)) == 0) caps_why = "neither READ nor WRITE";
  if ((caps & (FERRY_CAP_MEM_CPU | FERRY_CAP_MEM_GPU)) == 0)
    caps_why = "neither CPU nor GPU memory";
  if ((caps & FERRY_CAP_FENCE) && !(covers_fence && ops->fence != nullptr))
    caps_why = "FERRY_CAP_FENCE without fence()";
  if ((caps & FERRY_CAP_FENCE_SELECTIVE) && !(caps & FERRY_CAP_FENCE))
    caps_why = "FENCE_SELECTIVE without FENCE";
  if ((caps & FERRY_CAP_FENCE) && (caps & FERRY_CAP_INITIATOR_COPY))
    caps_why = "FENCE and INITIATOR_COPY both (one settles an unknown outcome)";
  r.check(caps_why.empty(), "abi: capabilities consistent",
          caps_why.empty()
              ? "caps=0x" +
                    [&] {
                      char b[24];
                      std::snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(caps));
                      return std::string(b);
                    }()
              : caps_why);
  facts->name = ops->name ? ops->name : "";
  facts->caps = caps;
  facts->abi_minor = ops->abi_minor;
  facts->has_describe = ops->describe != nullptr;
  facts->has_fence = covers_fence && ops->fence != nullptr;
  facts->has_counters = covers_counters && ops->counters != nullptr;
  facts->has_progress = covers_progress && ops->progress != nullptr;
  r.note("optional: describe " + std::string(facts->has_describe ? "yes" : "no") + ", fence " +
         (facts->has_fence ? "yes" : "no") + ", counters " + (facts->has_counters ? "yes" : "no") +
         ", progress " + (facts->has_progress ? "yes" : "no"));

  const int old = init_with_oldest_host(ops, settings_json);
  if (old == 0)
    r.pass("abi: init/fini with a 1.0 host table", "started and finished");
  else if (old == 1)
    r.pass("abi: init/fini with a 1.0 host table", "refused with a reason (stderr)");
  else
    r.fail("abi: init/fini with a 1.0 host table",
           old == 2 ? "refused without a reason in err"
                    : "the child died (status " + std::to_string(old) + ")");
  ::dlclose(h);
  // The engine rules run the plugin in this process: one that died in the
  // child, or whose table says less than it holds (its newer fields would be
  // called as what they are not), would take the checker down before the
  // verdict. Skipped; the FAILs above stand.
  if (old > 2 || !size_vs_minor.empty()) {
    r.note("engine rules skipped: the plugin is not safe to run in this process");
    return false;
  }
  return true;
}

}  // namespace ferry::plugin_check
