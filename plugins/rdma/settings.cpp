// SPDX-License-Identifier: Apache-2.0
#include "settings.h"

#include <nlohmann/json.hpp>

#include "ferry/plugin_kit.hpp"

namespace ferry_rdma {
namespace {

using json = nlohmann::json;
using ferry::plugin_kit::GetBytes;
using ferry::plugin_kit::GetInt;
using ferry::plugin_kit::ParseObject;

bool GetBool(const json& v, const char* key, bool* out, std::string* err) {
  if (!v.is_boolean()) {
    *err = std::string("setting '") + key + "' must be true or false";
    return false;
  }
  *out = v.get<bool>();
  return true;
}

bool GetDevices(const json& v, std::vector<std::string>* out, std::string* err) {
  const char* what = "setting 'devices' must be a list of \"dev\" or \"dev:port\" strings";
  json list = v;
  if (v.is_string()) list = json::array({v});
  if (!list.is_array()) {
    *err = what;
    return false;
  }
  std::vector<std::string> devs;
  for (const auto& e : list) {
    if (!e.is_string() || e.get<std::string>().empty() || e.get<std::string>().size() > 80) {
      *err = what;
      return false;
    }
    const std::string s = e.get<std::string>();
    const size_t colon = s.find(':');
    if (colon == 0 || (colon != std::string::npos &&
                       (colon + 1 == s.size() ||
                        s.find_first_not_of("0123456789", colon + 1) != std::string::npos ||
                        s.size() - colon > 4))) {
      *err = "setting 'devices': cannot read \"" + s + "\" (use \"mlx5_0\" or \"mlx5_0:1\")";
      return false;
    }
    for (char c : s)
      if (c <= 0x20 || c >= 0x7f) {
        *err = "setting 'devices': \"" + s + "\" has a bad character";
        return false;
      }
    devs.push_back(s);
  }
  *out = std::move(devs);
  return true;
}

}  // namespace

bool ParseSettings(const char* text, Settings* out, std::string* err) {
  Settings s;
  json j;
  if (!ParseObject(text, "rdma", &j, err)) return false;
  struct IntKey {
    const char* name;
    int* field;
    int64_t lo, hi;
  };
  const IntKey ints[] = {
      {"qp_per_transfer", &s.qp_per_transfer, 1, 64},
      {"max_send_wr", &s.max_send_wr, 4, 65536},
      {"recv_depth", &s.recv_depth, 4, 4096},
      {"cq_size", &s.cq_size, 64, 4194304},
      {"max_inline", &s.max_inline, 0, 4096},
      {"max_sge", &s.max_sge, 1, 64},
      {"qp_timeout", &s.qp_timeout, 1, 31},
      {"retry_cnt", &s.retry_cnt, 0, 7},
      {"rnr_retry", &s.rnr_retry, 0, 7},
      {"min_rnr_timer", &s.min_rnr_timer, 0, 31},
      {"traffic_class", &s.traffic_class, 0, 255},
      {"service_level", &s.service_level, 0, 15},
      {"connect_timeout_ms", &s.connect_timeout_ms, 1, 600000},
      {"qp_idle_ms", &s.qp_idle_ms, 0, 86400000},
      {"max_qps_per_peer", &s.max_qps_per_peer, 1, 65536},
      {"spin_us", &s.spin_us, 0, 1000000},
  };
  for (const auto& [key, v] : j.items()) {
    int64_t n = 0;
    bool done = false;
    for (const auto& ik : ints) {
      if (key != ik.name) continue;
      if (!GetInt(v, ik.name, ik.lo, ik.hi, &n, err)) return false;
      *ik.field = static_cast<int>(n);
      done = true;
    }
    if (done) continue;
    if (key == "devices") {
      if (!GetDevices(v, &s.devices, err)) return false;
    } else if (key == "gid_index") {
      if (v.is_string() && v.get<std::string>() == "auto") {
        s.gid_index = -1;
      } else {
        if (!GetInt(v, "gid_index", 0, 1023, &n, err)) {
          *err = "setting 'gid_index' must be \"auto\" or an integer in 0..1023";
          return false;
        }
        s.gid_index = static_cast<int>(n);
      }
    } else if (key == "chunk_bytes") {
      if (!GetBytes(v, "chunk_bytes", &s.chunk_bytes, err)) return false;
      if (s.chunk_bytes < 4096 || s.chunk_bytes > (1ull << 30)) {
        *err = "setting 'chunk_bytes' must be in 4KiB..1GiB";
        return false;
      }
    } else if (key == "busy_poll") {
      if (!GetBool(v, "busy_poll", &s.busy_poll, err)) return false;
    } else {
      *err = "unknown rdma setting '" + key +
             "' (known: devices, gid_index, qp_per_transfer, max_send_wr, recv_depth, cq_size, "
             "max_inline, max_sge, chunk_bytes, qp_timeout, retry_cnt, rnr_retry, min_rnr_timer, "
             "traffic_class, service_level, connect_timeout_ms, qp_idle_ms, max_qps_per_peer, "
             "busy_poll, spin_us)";
      return false;
    }
  }
  *out = std::move(s);
  return true;
}

}  // namespace ferry_rdma
