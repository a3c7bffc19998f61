// SPDX-License-Identifier: Apache-2.0
#include "settings.h"

#include <nlohmann/json.hpp>

#include "ferry/plugin_kit.hpp"
#include "ring_handover.h"
#include "wire.h"

namespace ferry_tcp {
namespace {

using json = nlohmann::json;
using ferry::plugin_kit::GetBool;
using ferry::plugin_kit::GetBytes;
using ferry::plugin_kit::GetInt;
using ferry::plugin_kit::ParseObject;

// A size that bounds one frame's payload: 4KiB..kMaxPayload.
bool GetPayloadBytes(const json& v, const char* key, uint64_t* out, std::string* err) {
  if (!GetBytes(v, key, out, err)) return false;
  if (*out < 4096 || *out > wire::kMaxPayload) {
    *err = std::string("setting '") + key + "' must be in 4KiB.." + FormatBytes(wire::kMaxPayload);
    return false;
  }
  return true;
}

bool GetHost(const json& v, const char* key, std::string* out, std::string* err) {
  if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 253) {
    *err = std::string("setting '") + key + "' must be a host name or address";
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

}  // namespace

bool ParseSettings(const char* text, Settings* out, std::string* err) {
  Settings s;
  json j;
  if (!ParseObject(text, "tcp", &j, err)) return false;
  for (const auto& [key, v] : j.items()) {
    int64_t n = 0;
    if (key == "lanes") {
      if (!GetInt(v, "lanes", 1, 16, &n, err)) return false;
      s.lanes = static_cast<int>(n);
    } else if (key == "chunk_bytes") {
      if (!GetPayloadBytes(v, "chunk_bytes", &s.chunk_bytes, err)) return false;
    } else if (key == "listen_host") {
      if (!GetHost(v, "listen_host", &s.listen_host, err)) return false;
    } else if (key == "listen_port") {
      if (!GetInt(v, "listen_port", 0, 65535, &n, err)) return false;
      s.listen_port = static_cast<uint16_t>(n);
    } else if (key == "advertise_host") {
      if (!GetHost(v, "advertise_host", &s.advertise_host, err)) return false;
    } else if (key == "connect_timeout_ms") {
      if (!GetInt(v, "connect_timeout_ms", 1, 600000, &n, err)) return false;
      s.connect_timeout_ms = static_cast<int>(n);
    } else if (key == "io_timeout_ms") {
      if (!GetInt(v, "io_timeout_ms", 1, 3600000, &n, err)) return false;
      s.io_timeout_ms = static_cast<int>(n);
    } else if (key == "keepalive_s") {
      if (!GetInt(v, "keepalive_s", 0, 86400, &n, err)) return false;
      s.keepalive_s = static_cast<int>(n);
    } else if (key == "io_threads") {
      if (!GetInt(v, "io_threads", 0, 64, &n, err)) return false;
      s.io_threads = static_cast<int>(n);
    } else if (key == "lane_idle_ms") {
      if (!GetInt(v, "lane_idle_ms", 0, 86400000, &n, err)) return false;
      s.lane_idle_ms = static_cast<int>(n);
    } else if (key == "gpu_stage_bytes") {
      if (!GetPayloadBytes(v, "gpu_stage_bytes", &s.gpu_stage_bytes, err)) return false;
    } else if (key == "gpu_chunk_bytes") {
      if (!GetPayloadBytes(v, "gpu_chunk_bytes", &s.gpu_chunk_bytes, err)) return false;
    } else if (key == "gpu_pinned_bytes") {
      if (!GetBytes(v, "gpu_pinned_bytes", &s.gpu_pinned_bytes, err)) return false;
    } else if (key == "same_host_rings") {
      if (!GetBool(v, "same_host_rings", &s.same_host_rings, err)) return false;
    } else if (key == "gpu_stage_in_ring") {
      if (!GetBool(v, "gpu_stage_in_ring", &s.gpu_stage_in_ring, err)) return false;
    } else if (key == "same_host_direct") {
      if (!GetBool(v, "same_host_direct", &s.same_host_direct, err)) return false;
    } else if (key == "direct_min_bytes") {
      if (!GetBytes(v, "direct_min_bytes", &s.direct_min_bytes, err)) return false;
    } else if (key == "ring_bytes") {
      if (!GetBytes(v, "ring_bytes", &s.ring_bytes, err)) return false;
      s.ring_bytes_given = true;
      if (s.ring_bytes < shm::kMinCapacity || s.ring_bytes > kMaxAcceptedRing ||
          (s.ring_bytes & (s.ring_bytes - 1)) != 0) {
        *err = "setting 'ring_bytes' must be a power of two in 64KiB.." +
               FormatBytes(kMaxAcceptedRing);
        return false;
      }
    } else if (key == "ring_chunk_bytes") {
      if (!GetPayloadBytes(v, "ring_chunk_bytes", &s.ring_chunk_bytes, err)) return false;
    } else if (key == "ring_spin_us") {
      if (!GetInt(v, "ring_spin_us", 0, 10000, &n, err)) return false;
      s.ring_spin_us = static_cast<int>(n);
    } else if (key == "sender_spin_us") {
      if (!GetInt(v, "sender_spin_us", 0, 1000, &n, err)) return false;
      s.sender_spin_us = static_cast<int>(n);
    } else if (key == "target_spin_us") {
      if (!GetInt(v, "target_spin_us", 0, 1000, &n, err)) return false;
      s.target_spin_us = static_cast<int>(n);
    } else if (key == "post_flush_us") {
      if (!GetInt(v, "post_flush_us", 0, 100000, &n, err)) return false;
      // The flusher ticks at half of it: below 10 us it would spin a core.
      if (n > 0 && n < 10) {
        *err = "setting 'post_flush_us' must be 0 or 10..100000";
        return false;
      }
      s.post_flush_us = static_cast<int>(n);
    } else {
      *err = "unknown tcp setting '" + key +
             "' (known: lanes, chunk_bytes, listen_host, listen_port, advertise_host, "
             "connect_timeout_ms, io_timeout_ms, keepalive_s, io_threads, lane_idle_ms, "
             "gpu_stage_bytes, "
             "gpu_chunk_bytes, "
             "gpu_pinned_bytes, gpu_stage_in_ring, same_host_rings, same_host_direct, "
             "direct_min_bytes, ring_bytes, "
             "ring_chunk_bytes, ring_spin_us, "
             "sender_spin_us, target_spin_us, post_flush_us)";
      return false;
    }
  }
  // One stage is two pieces; a cap below that would pin nothing at all.
  if (s.gpu_pinned_bytes != 0 && s.gpu_pinned_bytes < 2 * s.gpu_stage_bytes) {
    *err = "setting 'gpu_pinned_bytes' must be 0 (never pin) or at least twice gpu_stage_bytes (" +
           FormatBytes(2 * s.gpu_stage_bytes) + ")";
    return false;
  }
  *out = std::move(s);
  return true;
}

bool StagesInRing(const Settings& s, bool gpu_pins) {
  return gpu_pins && s.gpu_stage_in_ring && s.gpu_pinned_bytes != 0;
}

Settings WithRuntimeDefaults(Settings s, bool gpu_pins) {
  if (StagesInRing(s, gpu_pins) && !s.ring_bytes_given) s.ring_bytes = kGpuRingBytes;
  return s;
}

}  // namespace ferry_tcp
