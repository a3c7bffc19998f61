// SPDX-License-Identifier: Apache-2.0
#include "settings.h"

#include <nlohmann/json.hpp>

#include "ferry/plugin_kit.hpp"

namespace ferry_ofi {
namespace {

using json = nlohmann::json;
using ferry::plugin_kit::GetBytes;
using ferry::plugin_kit::GetInt;
using ferry::plugin_kit::ParseObject;

bool GetName(const json& v, const char* key, std::string* out, std::string* err) {
  if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 253) {
    *err = std::string("setting '") + key + "' must be a non-empty string of at most 253 bytes";
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

// "shm", "tcp;ofi_rxm", or a list of them; "auto" alone means the default.
bool GetProviders(const json& v, std::vector<std::string>* out, std::string* err) {
  std::vector<std::string> list;
  if (v.is_string()) {
    std::string one;
    if (!GetName(v, "provider", &one, err)) return false;
    if (one != "auto") list.push_back(one);
  } else if (v.is_array() && !v.empty() && v.size() <= 8) {
    for (const auto& e : v) {
      std::string one;
      if (!GetName(e, "provider", &one, err)) return false;
      if (one == "auto") {
        *err = "setting 'provider': \"auto\" cannot be part of a list";
        return false;
      }
      for (const auto& seen : list) {
        if (seen == one) {
          *err = "setting 'provider' names \"" + one + "\" twice";
          return false;
        }
      }
      list.push_back(one);
    }
  } else {
    *err =
        "setting 'provider' must be a provider name (\"shm\", \"tcp;ofi_rxm\", \"auto\") or a "
        "list of 1..8 names";
    return false;
  }
  *out = std::move(list);
  return true;
}

}  // namespace

bool ParseSettings(const char* text, Settings* out, std::string* err) {
  Settings s;
  json j;
  if (!ParseObject(text, "ofi", &j, err)) return false;
  for (const auto& [key, v] : j.items()) {
    int64_t n = 0;
    if (key == "provider") {
      if (!GetProviders(v, &s.providers, err)) return false;
    } else if (key == "domain") {
      if (!GetName(v, "domain", &s.domain, err)) return false;
    } else if (key == "listen_host") {
      if (!GetName(v, "listen_host", &s.listen_host, err)) return false;
    } else if (key == "chunk_bytes") {
      if (!GetBytes(v, "chunk_bytes", &s.chunk_bytes, err)) return false;
      if (s.chunk_bytes != 0 && (s.chunk_bytes < 4096 || s.chunk_bytes > (1ull << 30))) {
        *err = "setting 'chunk_bytes' must be 0 (automatic) or in 4KiB..1GiB";
        return false;
      }
    } else if (key == "window") {
      if (!GetInt(v, "window", 1, 1024, &n, err)) return false;
      s.window = static_cast<int>(n);
    } else if (key == "spin_us") {
      if (!GetInt(v, "spin_us", 0, 100000, &n, err)) return false;
      s.spin_us = static_cast<int>(n);
    } else if (key == "gpu_stage_bytes") {
      if (!GetBytes(v, "gpu_stage_bytes", &s.gpu_stage_bytes, err)) return false;
      if (s.gpu_stage_bytes < 4096 || s.gpu_stage_bytes > (1ull << 30)) {
        *err = "setting 'gpu_stage_bytes' must be in 4KiB..1GiB";
        return false;
      }
    } else if (key == "gpu_pinned_bytes") {
      if (!GetBytes(v, "gpu_pinned_bytes", &s.gpu_pinned_bytes, err)) return false;
    } else {
      *err = "unknown ofi setting '" + key +
             "' (known: provider, domain, listen_host, chunk_bytes, window, spin_us, "
             "gpu_stage_bytes, gpu_pinned_bytes)";
      return false;
    }
  }
  // One stage is two pieces; a smaller cap could never stage anything.
  if (s.gpu_pinned_bytes < 2 * s.gpu_stage_bytes) {
    *err = "setting 'gpu_pinned_bytes' must be at least twice gpu_stage_bytes (" +
           FormatBytes(2 * s.gpu_stage_bytes) + ")";
    return false;
  }
  *out = std::move(s);
  return true;
}

}  // namespace ferry_ofi
