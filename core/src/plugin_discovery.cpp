// SPDX-License-Identifier: Apache-2.0
// `ferry info`: every plugin file found, whether it loads, and what it offers.
// Each loadable plugin is started once with empty settings, so a plugin whose
// hardware or library is missing reports why (e.g. "no RDMA device").
#include <dirent.h>

#include <algorithm>
#include <set>

#include "ferry/ferry.hpp"
#include "gpu_runtime.h"
#include "guarded_buffer.h"
#include "log.h"
#include "plugin_loader.h"
#include "plugin_probe_child.h"

namespace ferry {

namespace {
void probe_log(void*, int, const char*) {}
uint64_t probe_now(void*) { return 0; }
int probe_ctrl(void*, const char*, const void*, size_t) { return FERRY_ERR_BAD_STATE; }
void probe_complete(void*, void*, int, const char*) {}
void probe_inbound(void*, const char*, uint64_t, int) {}
// A probe instance never connects; offering the link proofs (which refuse) makes
// it describe itself as an engine's instance would (tcp: auth=descriptor).
int probe_link_prove(void*, const char*, uint32_t, const void*, size_t, uint8_t*) {
  return FERRY_ERR_UNSUPPORTED;
}
int probe_link_check(void*, const char*, uint32_t, const void*, size_t, const uint8_t*, char*,
                     size_t) {
  return FERRY_ERR_UNSUPPORTED;
}

// One table for every probe, never freed: a plugin thread that outlives its
// fini (a breach) still calls through valid memory, into functions that touch
// nothing. It used to be on the probing thread's stack.
const ferry_host_v1* probe_host() {
  static const ferry_host_v1 host = [] {
    ferry_host_v1 h{};
    h.struct_size = sizeof h;
    h.log = probe_log;
    h.now_ns = probe_now;
    h.ctrl_send = probe_ctrl;
    h.ctrl_try_send = probe_ctrl;
    h.complete = probe_complete;
    h.inbound = probe_inbound;
    h.link_prove = probe_link_prove;
    h.link_check = probe_link_check;
    h.gpu = gpu_runtime();  // so a GPU plugin can tell whether it would work here
    return h;
  }();
  return &host;
}
}  // namespace

std::string caps_to_string(uint64_t caps) {
  static const std::pair<uint64_t, const char*> names[] = {
      {FERRY_CAP_MEM_CPU, "cpu"},
      {FERRY_CAP_MEM_GPU, "gpu"},
      {FERRY_CAP_OP_READ, "read"},
      {FERRY_CAP_OP_WRITE, "write"},
      {FERRY_CAP_NATIVE_NOTIFY, "notify"},
      {FERRY_CAP_SAME_HOST_ONLY, "same-host-only"},
      {FERRY_CAP_TARGET_PROGRESS, "target-progress"},
      {FERRY_CAP_FENCE, "fence"},
      {FERRY_CAP_INITIATOR_COPY, "initiator-copy"},
      {FERRY_CAP_NO_TARGET_CHECK, "no-target-check"},
      {FERRY_CAP_POST_MORE, "post-more"},
      {FERRY_CAP_MULTI_PAIR, "multi-pair"},
      {FERRY_CAP_FENCE_SELECTIVE, "fence-selective"},
      {FERRY_CAP_NATIVE_NOTIFY_READ, "notify-read"}};
  std::string s;
  for (const auto& [bit, name] : names)
    if (caps & bit) {
      // Two appends, not "a + b": g++ 12 at -O3 warns (-Wrestrict) on the temporary.
      if (!s.empty()) s += ',';
      s += name;
    }
  return s;
}

namespace {

// Loads one plugin file and starts it once with empty settings, in this process.
PluginInfo probe_here(PluginInfo info, const ProbeReport& report) {
  PluginLoad load = load_plugin_file(info.path, info.name);
  if (!load.lib) {
    info.error = load.error;
    return info;
  }
  const ferry_plugin_ops_v1* ops = load.lib->ops;
  info.abi_major = FERRY_PLUGIN_ABI_MAJOR;
  info.abi_minor = ops->abi_minor;
  info.version = ops->version ? ops->version : "";
  info.caps = ops->caps;
  info.warning = load.warning;
  report(info);  // what the table says, should init, describe or fini crash
  const ferry_host_v1* host = probe_host();
  void* ctx = nullptr;
  std::string why;
  const int rc = init_plugin(ops, host, "ferry-info", "ferry-info", "{}", &ctx, &why);
  if (rc != FERRY_OK) {
    info.error = "init failed: " + (why.empty() ? "error " + std::to_string(rc) : why);
    return info;
  }
  info.loaded = true;
  report(info);
  try {
    if (FERRY_HAS_FIELD(ferry_plugin_ops_v1, ops, describe) && ops->describe) {
      GuardedBuffer desc(1024);
      if (ops->describe(ctx, desc.data(), desc.size()) == FERRY_OK)
        info.description = desc.intact()
                               ? printable(desc.text(), 1023)
                               : "describe() wrote past the 1024-byte buffer it was given: ignored";
    }
    ops->fini(ctx);
  } catch (...) {
    info.loaded = false;
    info.error = "describe or fini threw an exception (nothing may throw across the plugin ABI)";
  }
  return info;
}

}  // namespace

std::vector<PluginInfo> discover_plugins(const std::vector<std::string>& extra_dirs,
                                         ProbeIn where) {
  std::vector<PluginInfo> out;
  std::set<std::string> seen;
  for (const auto& dir : plugin_search_dirs(extra_dirs)) {
    DIR* d = opendir(dir.c_str());
    if (!d) continue;
    std::vector<std::string> files;
    while (dirent* e = readdir(d))
      if (!plugin_name_from_file(e->d_name).empty()) files.push_back(e->d_name);
    closedir(d);
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      PluginInfo info;
      info.name = plugin_name_from_file(f);
      info.path = dir + "/" + f;
      if (!seen.insert(info.name).second) {
        info.error = "shadowed by an earlier " + f + " in the search path";
        out.push_back(info);
        continue;
      }
      out.push_back(where == ProbeIn::CHILD_PROCESS ? probe_in_child(info, probe_here)
                                                    : probe_here(info, [](const PluginInfo&) {}));
    }
  }
  return out;
}

}  // namespace ferry
