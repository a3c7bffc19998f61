// SPDX-License-Identifier: Apache-2.0
// Engine and memory descriptors: compact binary (msgpack) and readable JSON.
// Decoding treats the bytes as hostile: every field is type- and range-checked,
// so a truncated, oversized or forged blob becomes ERR_INVALID_ARGS, not a crash.
#include <nlohmann/json.hpp>

#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "hex.h"

namespace ferry {
namespace {

using json = nlohmann::json;

// Version 2 added the engine's access secret ("s") and random region ids;
// descriptors of version 1 carry no secret and are refused with a message.
constexpr int kDescVersion = 2;
constexpr size_t kSecretBytes = 32;
constexpr size_t kMaxDescBytes = 256 * 1024;
constexpr size_t kMaxString = 255;
constexpr size_t kMaxBackends = 32;

[[noreturn]] void bad(const std::string& what) {
  throw Error(StatusCode::ERR_INVALID_ARGS, "malformed descriptor: " + what);
}

json backends_to_json(const std::map<std::string, std::vector<uint8_t>>& b) {
  json o = json::object();
  for (const auto& [name, blob] : b) o[name] = json::binary(blob);
  return o;
}

const json& field(const json& o, const char* name) {
  auto it = o.find(name);
  if (it == o.end()) bad(std::string("missing field '") + name + "'");
  return *it;
}

// Well-formed UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF)
// and no NUL: these strings reach plugins as C strings and Python as str.
bool valid_text(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned c = *p++;
    if (c == 0) return false;
    if (c < 0x80) continue;
    int more;
    unsigned cp, min;
    if ((c & 0xE0) == 0xC0) {
      more = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      more = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      more = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (end - p < more) return false;
    for (int i = 0; i < more; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = cp << 6 | (p[i] & 0x3F);
    }
    p += more;
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  }
  return true;
}

std::string get_string(const json& o, const char* name, bool allow_empty = false) {
  const json& v = field(o, name);
  if (!v.is_string()) bad(std::string("field '") + name + "' is not a string");
  auto s = v.get<std::string>();
  if (s.size() > kMaxString) bad(std::string("field '") + name + "' is too long");
  if (!allow_empty && s.empty()) bad(std::string("field '") + name + "' is empty");
  if (!valid_text(s)) bad(std::string("field '") + name + "' is not valid UTF-8 text");
  return s;
}

uint64_t get_uint(const json& o, const char* name, uint64_t max) {
  const json& v = field(o, name);
  if (!v.is_number_unsigned()) bad(std::string("field '") + name + "' is not an unsigned integer");
  auto x = v.get<uint64_t>();
  if (x > max) bad(std::string("field '") + name + "' is out of range");
  return x;
}

int64_t get_int(const json& o, const char* name, int64_t min, int64_t max) {
  const json& v = field(o, name);
  if (!v.is_number_integer()) bad(std::string("field '") + name + "' is not an integer");
  auto x = v.get<int64_t>();
  if (x < min || x > max) bad(std::string("field '") + name + "' is out of range");
  return x;
}

std::map<std::string, std::vector<uint8_t>> get_backends(const json& o) {
  const json& v = field(o, "b");
  if (!v.is_object()) bad("field 'b' is not a map");
  if (v.size() > kMaxBackends) bad("too many backends");
  std::map<std::string, std::vector<uint8_t>> out;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key().empty() || it.key().size() > 64 || !valid_text(it.key())) bad("bad backend name");
    if (!it.value().is_binary()) bad("backend blob of '" + it.key() + "' is not binary");
    const auto& bin = it.value().get_binary();
    if (bin.size() > FERRY_MAX_BLOB) bad("backend blob of '" + it.key() + "' is too large");
    out[it.key()] = std::vector<uint8_t>(bin.begin(), bin.end());
  }
  return out;
}

// nlohmann's msgpack reader recurses per nesting level; a forged blob of nested
// arrays would overflow the stack. This SAX front stops at a small depth.
class DepthLimitedSax : public nlohmann::json_sax<json> {
 public:
  explicit DepthLimitedSax(json& out) : dom_(out, /*allow_exceptions=*/false) {}
  bool null() override { return dom_.null(); }
  bool boolean(bool v) override { return dom_.boolean(v); }
  bool number_integer(number_integer_t v) override { return dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) override { return dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) override {
    return dom_.number_float(v, s);
  }
  bool string(string_t& v) override { return dom_.string(v); }
  bool binary(binary_t& v) override { return dom_.binary(v); }
  bool start_object(std::size_t n) override {
    return ++depth_ <= kMaxDepth && dom_.start_object(n);
  }
  bool key(string_t& v) override { return dom_.key(v); }
  bool end_object() override {
    --depth_;
    return dom_.end_object();
  }
  bool start_array(std::size_t n) override { return ++depth_ <= kMaxDepth && dom_.start_array(n); }
  bool end_array() override {
    --depth_;
    return dom_.end_array();
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  static constexpr int kMaxDepth = 4;
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  int depth_ = 0;
};

json parse(const std::vector<uint8_t>& bytes, const char* kind) {
  if (bytes.empty()) bad(std::string(kind) + ": empty");
  if (bytes.size() > kMaxDescBytes) bad(std::string(kind) + ": larger than 256 KiB");
  json o;
  DepthLimitedSax sax(o);
  bool ok = false;
  try {
    ok = json::sax_parse(bytes, &sax, json::input_format_t::msgpack, /*strict=*/true);
  } catch (const std::exception&) {
    ok = false;
  }
  if (!ok) bad(std::string(kind) + ": not valid msgpack (truncated or too deep?)");
  if (!o.is_object()) bad(std::string(kind) + ": not a map");
  if (get_string(o, "t") != kind) bad(std::string("not a ") + kind);
  const uint64_t v = get_uint(o, "v", 255);
  if (v < kDescVersion)
    bad(std::string(kind) + " descriptor of format version " + std::to_string(v) +
        " (an older ferry): it carries no access secret; export it again from an engine of "
        "this ferry (format " +
        std::to_string(kDescVersion) + ")");
  if (v > kDescVersion)
    bad(std::string(kind) + " descriptor of format version " + std::to_string(v) +
        " is newer than this ferry understands (" + std::to_string(kDescVersion) + ")");
  return o;
}

std::vector<uint8_t> get_secret(const json& o) {
  const json& v = field(o, "s");
  if (!v.is_binary() || v.get_binary().size() != kSecretBytes)
    bad("engine: the access secret is not " + std::to_string(kSecretBytes) + " bytes");
  const auto& bin = v.get_binary();
  return std::vector<uint8_t>(bin.begin(), bin.end());
}

std::string readable(json o) {
  // The access secret is a credential: printed descriptors end up in logs.
  if (o.contains("s")) o["s"] = "(secret, " + std::to_string(kSecretBytes) + " bytes)";
  // Binary blobs as hex so the JSON form stays plain text.
  for (auto& [name, blob] : o["b"].items()) {
    const auto& bytes = blob.get_binary();
    blob = to_hex(bytes.data(), bytes.size());
  }
  // Keys and hosts come from peers and need not be UTF-8: replace bad bytes
  // rather than throw from a printing function (found by fuzz/fuzz_descriptors).
  return o.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

std::vector<uint8_t> EngineDesc::pack() const {
  json o = {{"t", "engine"},
            {"v", kDescVersion},
            {"k", key},
            {"h", host},
            {"p", port},
            {"n", node_id},
            {"pid", pid},
            {"b", backends_to_json(backends)},
            {"s", json::binary(secret)}};
  if (instance != 0) o["inst"] = instance;
  if (!control_unix.empty()) o["u"] = control_unix;
  return json::to_msgpack(o);
}

EngineDesc EngineDesc::unpack(const std::vector<uint8_t>& bytes) {
  json o = parse(bytes, "engine");
  EngineDesc d;
  d.key = get_string(o, "k");
  d.host = get_string(o, "h");
  d.port = static_cast<uint16_t>(get_uint(o, "p", 65535));
  if (d.port == 0) bad("engine: port 0");
  d.node_id = get_string(o, "n");
  d.pid = static_cast<uint32_t>(get_uint(o, "pid", UINT32_MAX));
  if (o.contains("inst")) d.instance = get_uint(o, "inst", UINT64_MAX);
  d.secret = get_secret(o);
  d.backends = get_backends(o);
  if (o.contains("u")) {
    // Optional (this ferry's engines write it): an abstract socket name we
    // would connect to, so only the characters ours has.
    d.control_unix = get_string(o, "u");
    if (d.control_unix.empty() || d.control_unix.size() > 100 ||
        d.control_unix.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-") !=
            std::string::npos)
      bad("engine: malformed control socket name");
  }
  return d;
}

std::string EngineDesc::to_json() const { return readable(json::from_msgpack(pack())); }

std::vector<uint8_t> MemoryDesc::pack() const {
  json o = {{"t", "memory"},
            {"v", kDescVersion},
            {"k", engine_key},
            {"id", id},
            {"loc", static_cast<int>(location)},
            {"dev", device},
            {"bus", bus_id},
            {"a", addr},
            {"s", size},
            {"b", backends_to_json(backends)}};
  if (engine_instance != 0) o["inst"] = engine_instance;
  return json::to_msgpack(o);
}

MemoryDesc MemoryDesc::unpack(const std::vector<uint8_t>& bytes) {
  json o = parse(bytes, "memory");
  MemoryDesc d;
  d.engine_key = get_string(o, "k");
  if (o.contains("inst")) d.engine_instance = get_uint(o, "inst", UINT64_MAX);
  d.id = get_uint(o, "id", UINT64_MAX);
  if (d.id == 0) bad("memory: id 0");
  auto loc = get_uint(o, "loc", 2);
  if (loc == 0) bad("memory: unknown location");
  d.location = static_cast<MemoryLocation>(loc);
  d.device = static_cast<int32_t>(get_int(o, "dev", -1, 1 << 20));
  d.bus_id = get_string(o, "bus", /*allow_empty=*/true);
  d.addr = get_uint(o, "a", UINT64_MAX);
  d.size = get_uint(o, "s", UINT64_MAX);
  if (d.size == 0) bad("memory: size 0");
  if (d.addr + d.size < d.addr) bad("memory: address range wraps");
  d.backends = get_backends(o);
  return d;
}

std::string MemoryDesc::to_json() const { return readable(json::from_msgpack(pack())); }

}  // namespace ferry
