// SPDX-License-Identifier: Apache-2.0
#include "etcd_json.h"

#include <charconv>
#include <nlohmann/json.hpp>

namespace ferry::etcd {

namespace {

using json = nlohmann::json;

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int b64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// The gateway writes int64 as a string ("123"), proto3 JSON's rule; accept a
// number too. Absent: 0.
bool get_i64(const json& j, const char* name, int64_t& out) {
  out = 0;
  if (!j.is_object()) return false;
  auto it = j.find(name);
  if (it == j.end()) return true;
  if (it->is_number_integer()) {
    out = it->get<int64_t>();
    return true;
  }
  if (!it->is_string()) return false;
  const std::string& s = it->get_ref<const std::string&>();
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && end == s.data() + s.size();
}

bool get_b64(const json& j, const char* name, std::string& out) {
  out.clear();
  auto it = j.find(name);
  if (it == j.end()) return true;  // proto3 leaves empty fields out
  if (!it->is_string()) return false;
  auto v = base64_decode(it->get_ref<const std::string&>());
  if (!v) return false;
  out = std::move(*v);
  return true;
}

bool parse_kv(const json& j, KeyValue& kv) {
  if (!j.is_object()) return false;
  return get_b64(j, "key", kv.key) && get_b64(j, "value", kv.value) &&
         get_i64(j, "mod_revision", kv.mod_revision) && get_i64(j, "lease", kv.lease);
}

bool parse_text(const std::string& text, json& j, std::string* why) {
  if (text.size() > kMaxMessageBytes) {
    if (why) *why = "etcd answer larger than " + std::to_string(kMaxMessageBytes) + " bytes";
    return false;
  }
  j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    if (why) *why = "etcd answer is not a JSON object";
    return false;
  }
  return true;
}

bool header_revision(const json& j, int64_t& rev) {
  auto h = j.find("header");
  if (h == j.end()) {
    rev = 0;
    return true;
  }
  return get_i64(*h, "revision", rev);
}

bool malformed(std::string* why, const char* what) {
  if (why) *why = std::string("malformed etcd ") + what;
  return false;
}

}  // namespace

std::string base64_encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += kAlphabet[v >> 18];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(const std::string& in) {
  if (in.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = in[i + k];
      if (c == '=' && last && k >= 2) {
        ++pad;
        v[k] = 0;
        continue;
      }
      if (pad > 0) return std::nullopt;  // a character after '='
      v[k] = b64_value(c);
      if (v[k] < 0) return std::nullopt;
    }
    // Bits below the last byte must be zero: one spelling per value.
    if ((pad == 2 && (v[1] & 0xf) != 0) || (pad == 1 && (v[2] & 0x3) != 0)) return std::nullopt;
    const uint32_t w = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out += static_cast<char>(w >> 16);
    if (pad < 2) out += static_cast<char>((w >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(w & 0xff);
  }
  return out;
}

bool ObjectSplitter::feed(const char* data, size_t len, std::vector<std::string>& out,
                          std::string* why) {
  for (size_t i = 0; i < len; ++i) {
    const char c = data[i];
    if (depth_ == 0) {
      if (c == ' ' || c == '\n' || c == '\r' || c == '\t') continue;
      if (c != '{') {
        if (why) *why = "etcd watch stream: unexpected byte outside a JSON object";
        return false;
      }
    }
    cur_ += c;
    if (cur_.size() > kMaxMessageBytes) {
      if (why)
        *why = "etcd watch message larger than " + std::to_string(kMaxMessageBytes) + " bytes";
      return false;
    }
    if (in_string_) {
      if (escaped_)
        escaped_ = false;
      else if (c == '\\')
        escaped_ = true;
      else if (c == '"')
        in_string_ = false;
      continue;
    }
    if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      // nlohmann's parser limits nesting itself, but a deep stack of '['
      // costs it recursion: refuse early.
      if (++depth_ > 64) {
        if (why) *why = "etcd watch message nested too deeply";
        return false;
      }
    } else if (c == '}' || c == ']') {
      if (--depth_ == 0) {
        out.push_back(std::move(cur_));
        cur_.clear();
      }
    }
  }
  return true;
}

bool parse_watch_message(const std::string& text, WatchMessage& out, std::string* why) {
  out = WatchMessage{};
  json j;
  if (!parse_text(text, j, why)) return false;
  // The gateway wraps each WatchResponse in {"result": ...}; an error in {"error": ...}.
  auto r = j.find("result");
  if (r == j.end()) {
    if (why)
      *why = "etcd watch: " +
             (error_message(text).empty() ? std::string("no result") : error_message(text));
    return false;
  }
  if (!r->is_object()) return malformed(why, "watch message");
  if (!header_revision(*r, out.revision)) return malformed(why, "watch header");
  auto flag = [&](const char* name) {
    auto it = r->find(name);
    return it != r->end() && it->is_boolean() && it->get<bool>();
  };
  out.created = flag("created");
  out.canceled = flag("canceled");
  if (!get_i64(*r, "compact_revision", out.compact_revision))
    return malformed(why, "watch message");
  if (auto it = r->find("cancel_reason"); it != r->end() && it->is_string())
    out.cancel_reason = it->get<std::string>();
  if (auto ev = r->find("events"); ev != r->end()) {
    if (!ev->is_array()) return malformed(why, "watch events");
    for (const auto& e : *ev) {
      if (!e.is_object()) return malformed(why, "watch event");
      WatchEvent w;
      auto t = e.find("type");  // PUT is proto3's default (0): left out
      if (t != e.end()) {
        if (!t->is_string()) return malformed(why, "watch event type");
        const std::string& s = t->get_ref<const std::string&>();
        if (s == "DELETE")
          w.is_delete = true;
        else if (s != "PUT")
          return malformed(why, "watch event type");
      }
      auto kv = e.find("kv");
      if (kv == e.end() || !parse_kv(*kv, w.kv)) return malformed(why, "watch event kv");
      out.events.push_back(std::move(w));
    }
  }
  return true;
}

bool parse_range(const std::string& text, std::vector<KeyValue>& kvs, int64_t& revision,
                 std::string* why) {
  kvs.clear();
  json j;
  if (!parse_text(text, j, why)) return false;
  if (!header_revision(j, revision)) return malformed(why, "range header");
  auto it = j.find("kvs");
  if (it == j.end()) return true;
  if (!it->is_array()) return malformed(why, "range answer");
  for (const auto& e : *it) {
    KeyValue kv;
    if (!parse_kv(e, kv)) return malformed(why, "range kv");
    kvs.push_back(std::move(kv));
  }
  return true;
}

bool parse_lease(const std::string& text, int64_t& id, int64_t& ttl, std::string* why) {
  json j;
  if (!parse_text(text, j, why)) return false;
  const json* body = &j;
  // keepalive answers {"result": {...}}; grant answers the fields directly.
  if (auto r = j.find("result"); r != j.end()) body = &*r;
  if (!body->is_object() || !get_i64(*body, "ID", id) || !get_i64(*body, "TTL", ttl))
    return malformed(why, "lease answer");
  if (auto e = body->find("error");
      e != body->end() && e->is_string() && !e->get<std::string>().empty()) {
    if (why) *why = "etcd: " + e->get<std::string>();
    return false;
  }
  return true;
}

bool parse_header_revision(const std::string& text, int64_t& revision, std::string* why) {
  json j;
  if (!parse_text(text, j, why)) return false;
  if (!header_revision(j, revision)) return malformed(why, "header");
  return true;
}

std::string error_message(const std::string& text) {
  if (text.size() > kMaxMessageBytes) return {};
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return {};
  for (const char* k : {"message", "error"}) {
    auto it = j.find(k);
    if (it != j.end() && it->is_string() && !it->get<std::string>().empty())
      return it->get<std::string>();
    if (it != j.end() && it->is_object()) {
      auto m = it->find("message");
      if (m != it->end() && m->is_string()) return m->get<std::string>();
    }
  }
  return {};
}

}  // namespace ferry::etcd
