// SPDX-License-Identifier: Apache-2.0
// libFuzzer: the YAML policy parser. Any text must give a Policy or a
// ferry::Error naming file:line - never another exception, a crash or a hang.
#include <cstddef>
#include <cstdint>
#include <string>

#include "policy.h"

using namespace ferry;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64 * 1024) return 0;  // the loader refuses files over 1 MiB; keep runs fast
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    Policy p = parse_policy(text, "fuzz.yaml");
    RouteQuery q;
    (void)p.match(q);
    for (const auto& [name, json] : p.backend_settings) (void)p.settings_for(name);
  } catch (const Error& e) {
    if (std::string(e.what()).rfind("fuzz.yaml:", 0) != 0) __builtin_trap();
  }
  return 0;
}
