#include "settings.h"

#include <nlohmann/json.hpp>

namespace ferry_ofi {
namespace {

using json = nlohmann::json;

bool GetInt(const json& v, const char* key, int64_t lo, int64_t hi, int64_t* out,
            std::string* err) {
  if (!v.is_number_integer()) {
    *err = std::string("setting '") + key + "' must be an integer";
    return false;
  }
  const bool neg = v.is_number_unsigned() ? false : v.get<int64_t>() < 0;
  const uint64_t u = neg ? 0 : v.get<uint64_t>();
  if (neg || u < static_cast<uint64_t>(lo) || u > static_cast<uint64_t>(hi)) {
    *err = std::string("setting '") + key + "' must be in " + std::to_string(lo) + ".." +
           std::to_string(hi);
    return false;
  }
  *out = static_cast<int64_t>(u);
  return true;
}

// Accepts 1048576 or "1MiB" / "64KiB" / "4096B" / "1GiB", as the policy YAML writes sizes.
bool GetBytes(const json& v, const char* key, uint64_t* out, std::string* err) {
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
  size_t i = 0;
  uint64_t n = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    if (n > (UINT64_MAX - 9) / 10) break;
    n = n * 10 + static_cast<uint64_t>(s[i] - '0');
    ++i;
  }
  const std::string unit = s.substr(i);
  uint64_t mult = 0;
  if (unit.empty() || unit == "B") mult = 1;
  if (unit == "KiB") mult = 1ull << 10;
  if (unit == "MiB") mult = 1ull << 20;
  if (unit == "GiB") mult = 1ull << 30;
  if (i == 0 || mult == 0 || n > UINT64_MAX / mult) {
    *err = std::string("setting '") + key + "': cannot read \"" + s +
           "\" as a size (use B, KiB, MiB or GiB)";
    return false;
  }
  *out = n * mult;
  return true;
}

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
  const json j = json::parse(text ? text : "{}", nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    *err = "ofi settings are not valid JSON";
    return false;
  }
  if (!j.is_object()) {
    *err = "ofi settings must be a JSON object";
    return false;
  }
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

std::string FormatBytes(uint64_t n) {
  if (n != 0 && n % (1ull << 30) == 0) return std::to_string(n >> 30) + "GiB";
  if (n != 0 && n % (1ull << 20) == 0) return std::to_string(n >> 20) + "MiB";
  if (n != 0 && n % (1ull << 10) == 0) return std::to_string(n >> 10) + "KiB";
  return std::to_string(n) + "B";
}

}  // namespace ferry_ofi
