// SPDX-License-Identifier: Apache-2.0
#include "plugin_live_info.h"

#include <mutex>
#include <nlohmann/json.hpp>

#include "guarded_buffer.h"
#include "log.h"

namespace ferry {
namespace {

constexpr size_t kMaxKeys = 32;
constexpr size_t kMaxKeyLen = 32;

bool good_key(const std::string& k) {
  if (k.empty() || k.size() > kMaxKeyLen) return false;
  for (char c : k)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  return true;
}

}  // namespace

std::map<std::string, uint64_t> parse_plugin_counters(const char* json_text) {
  std::map<std::string, uint64_t> out;
  if (json_text == nullptr) return out;
  auto j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return out;
  for (const auto& [k, v] : j.items()) {
    if (out.size() >= kMaxKeys) break;
    if (!good_key(k) || !v.is_number_integer()) continue;
    if (v.is_number_unsigned())
      out[k] = v.get<uint64_t>();
    else if (v.get<int64_t>() >= 0)
      out[k] = static_cast<uint64_t>(v.get<int64_t>());
  }
  return out;
}

void read_live_info(Backend& b, BackendStats& s) {
  // Held shared like every call into the plugin: removal waits, fini() never races.
  std::shared_lock life(b.life);
  if (b.removed || b.ops == nullptr) return;
  // A plugin that writes past the buffer it is given has its text ignored
  // (guarded_buffer.h), and says so where its text would be.
  if (FERRY_HAS_FIELD(ferry_plugin_ops_v1, b.ops, describe) && b.ops->describe) {
    GuardedBuffer buf(4096);
    if (b.ops->describe(b.ctx, buf.data(), buf.size()) == FERRY_OK)
      s.detail = buf.intact() ? printable(buf.text(), 512)
                              : "describe() wrote past the 4096-byte buffer it was given: ignored";
  }
  if (FERRY_HAS_FIELD(ferry_plugin_ops_v1, b.ops, counters) && b.ops->counters) {
    GuardedBuffer buf(4096);
    if (b.ops->counters(b.ctx, buf.data(), buf.size()) == FERRY_OK) {
      if (buf.intact())
        s.plugin = parse_plugin_counters(buf.text().c_str());
      else
        s.detail += (s.detail.empty() ? "" : "; ") +
                    std::string("counters() wrote past the 4096-byte buffer it was given: ignored");
    }
  }
}

}  // namespace ferry
