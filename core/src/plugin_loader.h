// SPDX-License-Identifier: Apache-2.0
// Finds and opens backend plugins (libferry-<name>.so) and checks their ABI.
// A plugin that cannot be used yields a reason, never a crash.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "ferry/plugin.h"

namespace ferry {

// One dlopen'd plugin library. Engines share it; the last owner closes it.
struct PluginLibrary {
  std::string name;
  std::string path;
  void* handle = nullptr;
  const ferry_plugin_ops_v1* ops = nullptr;
  ~PluginLibrary();
};

struct PluginLoad {
  std::shared_ptr<PluginLibrary> lib;  // null on failure
  std::string error;                   // why it could not be used
  std::string warning;                 // loaded, but its table disagrees with its abi_minor
};

// FERRY_PLUGIN_PATH (colon list), then `configured`, then <dir of libferry.so>/ferry/plugins.
std::vector<std::string> plugin_search_dirs(const std::vector<std::string>& configured);

// The first libferry-<name>.so found in dirs, opened and validated.
PluginLoad load_plugin(const std::string& name, const std::vector<std::string>& dirs);

// Open one file; expected_name empty = take the name from the file name.
PluginLoad load_plugin_file(const std::string& path, const std::string& expected_name);

// "libferry-tcp.so" -> "tcp"; empty when the file name does not fit the pattern.
std::string plugin_name_from_file(const std::string& filename);

// ops->init, as every caller must make it: nothing the plugin throws comes
// out (nothing may cross the ABI), and its err is read only up to its last
// byte and made printable. The plugin's code (FERRY_ERR_BAD_STATE when it
// threw); *why the plugin's reason, or "" when it gave none.
int init_plugin(const ferry_plugin_ops_v1* ops, const ferry_host_v1* host, const char* key,
                const char* node_id, const char* settings, void** ctx, std::string* why);

}  // namespace ferry
