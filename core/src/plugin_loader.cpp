// SPDX-License-Identifier: Apache-2.0
#include "plugin_loader.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <climits>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <set>
#include <sstream>

#include "ferry/plugin_kit.hpp"
#include "guarded_buffer.h"
#include "log.h"

namespace ferry {
namespace {

// Smallest ops table of ABI 1.0: every 1.0 field, describe included (what
// plugin.h and ferry-plugin-check say; the loader once took 8 bytes less).
constexpr size_t kMinOpsSize = plugin_kit::kOpsSizeV10;

std::string dir_of_this_library() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&plugin_search_dirs), &info) == 0 || !info.dli_fname)
    return {};
  std::string p = info.dli_fname;
  auto slash = p.rfind('/');
  return slash == std::string::npos ? std::string(".") : p.substr(0, slash);
}

bool file_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string check_ops(const ferry_plugin_ops_v1* ops, const std::string& expected) {
  if (ops->struct_size < kMinOpsSize) {
    std::ostringstream o;
    o << "ops table is " << ops->struct_size << " bytes, ABI 1.0 needs at least " << kMinOpsSize;
    return o.str();
  }
  if (!ops->name || !*ops->name) return "plugin has no name";
  if (!expected.empty() && expected != ops->name)
    return std::string("file is named for '") + expected + "' but the plugin calls itself '" +
           ops->name + "'";
  if (const char* missing = plugin_kit::MissingRequired(*ops))
    return std::string("required function '") + missing + "' is NULL";
  return {};
}

}  // namespace

PluginLibrary::~PluginLibrary() {
  if (handle) dlclose(handle);
}

std::vector<std::string> plugin_search_dirs(const std::vector<std::string>& configured) {
  std::vector<std::string> dirs;
  if (const char* env = std::getenv("FERRY_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string d;
    while (std::getline(ss, d, ':'))
      if (!d.empty()) dirs.push_back(d);
  }
  dirs.insert(dirs.end(), configured.begin(), configured.end());
  if (auto self = dir_of_this_library(); !self.empty()) dirs.push_back(self + "/ferry/plugins");
  // The same folder named twice (e.g. FERRY_PLUGIN_PATH = the install dir) is searched once.
  std::vector<std::string> unique;
  std::set<std::string> seen;
  for (const auto& d : dirs) {
    char real[PATH_MAX];
    std::string key = ::realpath(d.c_str(), real) ? std::string(real) : d;
    if (seen.insert(key).second) unique.push_back(d);
  }
  return unique;
}

std::string plugin_name_from_file(const std::string& filename) {
  return plugin_kit::PluginNameFromFile(filename);
}

PluginLoad load_plugin_file(const std::string& path, const std::string& expected_name) {
  PluginLoad out;
  std::string expected = expected_name;
  if (expected.empty()) {
    expected = plugin_kit::PluginNameFromFile(path);
  }
  // dlerror() is process-global state; keep concurrent loads from mixing messages.
  static std::mutex dl_mu;
  std::lock_guard<std::mutex> lk(dl_mu);
  dlerror();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    out.error = std::string("dlopen failed: ") + (e ? e : "unknown error");
    return out;
  }
  auto ops = static_cast<const ferry_plugin_ops_v1*>(dlsym(h, FERRY_PLUGIN_SYMBOL_V1));
  if (!ops) {
    // Say which ABI it was built for when it exports a newer entry point.
    std::string newer;
    for (int major = 2; major <= 9 && newer.empty(); ++major) {
      std::string sym = "ferry_plugin_v" + std::to_string(major);
      if (dlsym(h, sym.c_str())) newer = std::to_string(major);
    }
    out.error = newer.empty() ? std::string("no entry symbol '") + FERRY_PLUGIN_SYMBOL_V1 +
                                    "': not a ferry plugin"
                              : "built for plugin ABI " + newer + ", this core serves ABI " +
                                    std::to_string(FERRY_PLUGIN_ABI_MAJOR);
    dlclose(h);
    return out;
  }
  if (auto why = check_ops(ops, expected); !why.empty()) {
    out.error = why;
    dlclose(h);
    return out;
  }
  // Safe to use (nothing past struct_size is read) but not built as it says.
  out.warning = plugin_kit::OpsSizeVersusMinor(*ops);
  if (!out.warning.empty()) FERRY_LOG(WARN, "plugin", path + ": " + out.warning);
  auto lib = std::make_shared<PluginLibrary>();
  lib->name = ops->name;
  lib->path = path;
  lib->handle = h;
  lib->ops = ops;
  out.lib = std::move(lib);
  return out;
}

PluginLoad load_plugin(const std::string& name, const std::vector<std::string>& dirs) {
  PluginLoad out;
  if (name.empty() || name.find('/') != std::string::npos) {
    out.error = "bad plugin name '" + name + "'";
    return out;
  }
  const std::string file = "libferry-" + name + ".so";
  for (const auto& d : dirs) {
    std::string p = d + "/" + file;
    if (file_exists(p)) return load_plugin_file(p, name);
  }
  std::string searched;
  for (const auto& d : dirs) searched += (searched.empty() ? "" : ":") + d;
  out.error = file + " not found (searched " + (searched.empty() ? "nothing" : searched) +
              "; set FERRY_PLUGIN_PATH)";
  return out;
}

int init_plugin(const ferry_plugin_ops_v1* ops, const ferry_host_v1* host, const char* key,
                const char* node_id, const char* settings, void** ctx, std::string* why) {
  GuardedBuffer err(512);
  int rc = FERRY_ERR_BAD_STATE;
  try {
    rc = ops->init(host, key, node_id, settings, ctx, err.data(), err.size());
  } catch (...) {
    *why = "its init threw an exception (nothing may throw across the plugin ABI)";
    return FERRY_ERR_BAD_STATE;
  }
  if (!err.intact()) {
    // It broke the ABI's one rule about buffers: it is not used.
    *why = "its init wrote past the " + std::to_string(err.size()) +
           "-byte error buffer it was given (plugin.h)";
    if (rc == FERRY_OK && *ctx != nullptr) {
      try {
        ops->fini(*ctx);
      } catch (...) {
      }
      *ctx = nullptr;
    }
    return FERRY_ERR_BAD_STATE;
  }
  // A plugin that filled it without a terminator: text() stops at its end.
  const std::string text = err.text();
  *why = text.empty() ? std::string() : printable(text, err.size() - 1);
  return rc;
}

}  // namespace ferry
