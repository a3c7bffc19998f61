// SPDX-License-Identifier: Apache-2.0
#include "node_id.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>

namespace ferry {
std::string default_node_id() {
  if (const char* v = std::getenv("FERRY_NODE_ID"); v && *v) return v;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return id;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0 && host[0]) return host;
  return "unknown-node";
}
}  // namespace ferry
