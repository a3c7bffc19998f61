// SPDX-License-Identifier: Apache-2.0
// libFuzzer: the etcd gateway's answers and its watch stream (etcd_json.h),
// network input from the metadata store. Any bytes, split into chunks at any
// points, must give objects, events or an error string - never an exception,
// a crash, a hang or an object over the size bound.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "etcd_json.h"

using namespace ferry::etcd;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  // The first byte picks the chunk size the stream arrives in (1..256).
  const size_t chunk = size_t{data[0]} + 1;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  ObjectSplitter sp;
  std::vector<std::string> objs;
  std::string why;
  for (size_t off = 0; off < text.size(); off += chunk) {
    const size_t n = std::min(chunk, text.size() - off);
    if (!sp.feed(text.data() + off, n, objs, &why)) {
      if (why.empty()) __builtin_trap();  // an error always says why
      break;
    }
  }
  for (const auto& o : objs) {
    if (o.size() > kMaxMessageBytes || o.empty() || o.front() != '{') __builtin_trap();
    WatchMessage m;
    if (parse_watch_message(o, m, &why))
      for (const auto& e : m.events) (void)e.kv.key.size();
  }
  std::vector<KeyValue> kvs;
  int64_t rev = 0, id = 0, ttl = 0;
  (void)parse_range(text, kvs, rev, &why);
  (void)parse_lease(text, id, ttl, &why);
  (void)parse_header_revision(text, rev, &why);
  (void)error_message(text);
  if (auto d = base64_decode(text)) {
    if (base64_encode(*d) != text) __builtin_trap();  // strict: one spelling per value
  }
  return 0;
}
