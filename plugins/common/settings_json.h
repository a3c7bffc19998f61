// Reading a plugin's settings (the JSON object the core hands to init): typed
// getters that say in words which key was wrong and why (see format_bytes.h for
// what plugins/common is).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace ferry_plugin_kit {

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

// Accepts 1048576 or "1MiB" / "64KiB" / "4096B" / "1GiB", as the policy YAML writes sizes.
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

}  // namespace ferry_plugin_kit
