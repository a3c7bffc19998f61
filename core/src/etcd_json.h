// SPDX-License-Identifier: Apache-2.0
// etcd v3 JSON gateway messages (etcd_client.cpp speaks them): base64 for keys
// and values, the answers of range / lease calls, and the watch stream - a
// never-ending HTTP body of JSON objects, one per message, split here as the
// bytes arrive. All of it is network input: sizes are bounded and anything
// malformed is an error string, never an exception or a crash (fuzzed by
// fuzz/fuzz_etcd_json.cpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ferry::etcd {

// One watch message (or an answer) may not exceed this; descriptors are a few KiB.
constexpr size_t kMaxMessageBytes = 4u << 20;

std::string base64_encode(const std::string& bytes);
// Strict (standard alphabet, '=' padding only at the end); nullopt when malformed.
std::optional<std::string> base64_decode(const std::string& text);

struct KeyValue {
  std::string key, value;
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

struct WatchEvent {
  bool is_delete = false;  // DELETE (key deleted or its lease expired); else PUT
  KeyValue kv;
};

struct WatchMessage {
  int64_t revision = 0;  // header.revision
  bool created = false;
  bool canceled = false;
  int64_t compact_revision = 0;  // > 0: the start revision was compacted away
  std::string cancel_reason;
  std::vector<WatchEvent> events;
};

// Splits a byte stream into top-level JSON object texts (whitespace between
// them is skipped). Tracks strings and escapes, so braces inside values do
// not confuse it.
class ObjectSplitter {
 public:
  // Appends each complete object to `out`; false (with *why) when the stream
  // is malformed or an object grows past kMaxMessageBytes. After false the
  // splitter must not be fed again (the stream is dropped and reopened).
  bool feed(const char* data, size_t len, std::vector<std::string>& out, std::string* why);

 private:
  std::string cur_;
  int depth_ = 0;
  bool in_string_ = false;
  bool escaped_ = false;
};

// Each returns false with *why on malformed input.
bool parse_watch_message(const std::string& text, WatchMessage& out, std::string* why);
bool parse_range(const std::string& text, std::vector<KeyValue>& kvs, int64_t& revision,
                 std::string* why);
// lease/grant and lease/keepalive: the lease ID and TTL (seconds; 0 or
// absent from keepalive: the lease is gone).
bool parse_lease(const std::string& text, int64_t& id, int64_t& ttl, std::string* why);
// The header revision of a put / deleterange answer.
bool parse_header_revision(const std::string& text, int64_t& revision, std::string* why);
// The gateway's error body ({"error": ..., "message": ...}); empty if none.
std::string error_message(const std::string& text);

}  // namespace ferry::etcd
