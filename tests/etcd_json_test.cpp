// SPDX-License-Identifier: Apache-2.0
// The etcd gateway's JSON (etcd_json.h), the latency histogram and the
// Prometheus text (metrics_text.h): pure functions, no server.
#include "etcd_json.h"

#include <gtest/gtest.h>

#include "latency_histogram.h"
#include "metadata_sync.h"
#include "metrics_text.h"

using namespace ferry;
using namespace std::chrono_literals;

TEST(EtcdJson, Base64RoundTripAndStrictness) {
  for (const std::string& s :
       {std::string(), std::string("a"), std::string("ab"), std::string("abc"), std::string("abcd"),
        std::string("\0\xff\x10", 3)})
    EXPECT_EQ(etcd::base64_decode(etcd::base64_encode(s)), s);
  EXPECT_EQ(etcd::base64_encode("ferry/a/engine"), "ZmVycnkvYS9lbmdpbmU=");
  EXPECT_FALSE(etcd::base64_decode("abc"));       // not a multiple of 4
  EXPECT_FALSE(etcd::base64_decode("ab=c"));      // padding inside
  EXPECT_FALSE(etcd::base64_decode("a==="));      // too much padding
  EXPECT_FALSE(etcd::base64_decode("ab$d"));      // not the alphabet
  EXPECT_FALSE(etcd::base64_decode("ab==ab=="));  // padding before the end
  EXPECT_FALSE(etcd::base64_decode("ev=="));  // non-zero bits under the padding (fuzz_etcd_json)
  EXPECT_FALSE(etcd::base64_decode("ewt="));
}

TEST(EtcdJson, SplitterFindsObjectsAcrossChunks) {
  const std::string stream =
      "{\"result\":{\"header\":{\"revision\":\"5\"},\"created\":true}}\n"
      "{\"result\":{\"header\":{\"revision\":\"7\"},\"events\":[{\"type\":\"DELETE\",\"kv\":{"
      "\"key\":\"" +
      etcd::base64_encode("ns/a/engine") + "\",\"mod_revision\":\"7\"}},{\"kv\":{\"key\":\"" +
      etcd::base64_encode("k}{\"") + "\",\"value\":\"" + etcd::base64_encode("v") +
      "\",\"lease\":\"12\"}}]}}\n";
  // Byte by byte: every split point.
  etcd::ObjectSplitter sp;
  std::vector<std::string> objs;
  std::string why;
  for (char c : stream) ASSERT_TRUE(sp.feed(&c, 1, objs, &why)) << why;
  ASSERT_EQ(objs.size(), 2u);
  etcd::WatchMessage m;
  ASSERT_TRUE(etcd::parse_watch_message(objs[0], m, &why)) << why;
  EXPECT_TRUE(m.created);
  EXPECT_EQ(m.revision, 5);
  ASSERT_TRUE(etcd::parse_watch_message(objs[1], m, &why)) << why;
  ASSERT_EQ(m.events.size(), 2u);
  EXPECT_TRUE(m.events[0].is_delete);
  EXPECT_EQ(m.events[0].kv.key, "ns/a/engine");
  EXPECT_EQ(m.events[0].kv.mod_revision, 7);
  EXPECT_FALSE(m.events[1].is_delete);  // PUT is left out (proto3 default)
  EXPECT_EQ(m.events[1].kv.key, "k}{\"");
  EXPECT_EQ(m.events[1].kv.lease, 12);
}

TEST(EtcdJson, MalformedInputIsAnError) {
  etcd::ObjectSplitter sp;
  std::vector<std::string> objs;
  std::string why;
  EXPECT_FALSE(sp.feed("x{}", 3, objs, &why));
  EXPECT_FALSE(why.empty());
  etcd::ObjectSplitter deep;
  std::string nest(100, '[');
  nest.insert(nest.begin(), '{');
  EXPECT_FALSE(deep.feed(nest.data(), nest.size(), objs, &why));
  etcd::WatchMessage m;
  for (const char* bad : {"{}", "{\"result\":[]}", "{\"result\":{\"events\":{}}}",
                          "{\"result\":{\"events\":[{\"type\":\"NOPE\",\"kv\":{}}]}}",
                          "{\"result\":{\"events\":[{\"kv\":{\"key\":\"***\"}}]}}",
                          "{\"result\":{\"header\":{\"revision\":\"x\"}}}", "not json"})
    EXPECT_FALSE(etcd::parse_watch_message(bad, m, &why)) << bad;
  std::vector<etcd::KeyValue> kvs;
  int64_t rev = 0;
  EXPECT_FALSE(etcd::parse_range("{\"kvs\":3}", kvs, rev, &why));
  ASSERT_TRUE(etcd::parse_range("{\"header\":{\"revision\":\"9\"}}", kvs, rev, &why));
  EXPECT_EQ(rev, 9);
  EXPECT_TRUE(kvs.empty());
  int64_t id = 0, ttl = 0;
  ASSERT_TRUE(etcd::parse_lease("{\"result\":{\"ID\":\"42\",\"TTL\":\"10\"}}", id, ttl, &why));
  EXPECT_EQ(id, 42);
  EXPECT_EQ(ttl, 10);
  ASSERT_TRUE(etcd::parse_lease("{\"result\":{\"ID\":\"42\"}}", id, ttl, &why));
  EXPECT_EQ(ttl, 0);  // the lease is gone
  EXPECT_EQ(etcd::error_message("{\"error\":\"bad\",\"message\":\"etcdserver: no key\"}"),
            "etcdserver: no key");
}

TEST(EtcdJson, KeyLayout) {
  EXPECT_EQ(MetadataSync::escape_key("a/b%c"), "a%2Fb%25c");
  EXPECT_EQ(etcd::prefix_end("ferry/"), "ferry0");
}

TEST(Metrics, HistogramBucketsAndSizeClasses) {
  EXPECT_EQ(TransferMetrics::size_class(1), 0u);
  EXPECT_EQ(TransferMetrics::size_class(4096), 0u);
  EXPECT_EQ(TransferMetrics::size_class(4097), 1u);
  EXPECT_EQ(TransferMetrics::size_class(1ull << 30), 4u);
  EXPECT_EQ(TransferMetrics::bucket(5us), 0u);
  EXPECT_EQ(TransferMetrics::bucket(11us), 1u);
  EXPECT_EQ(TransferMetrics::bucket(100s), TransferMetrics::kBuckets);
  TransferMetrics m;
  m.record(Op::WRITE, 8192, 30us);
  m.record(Op::WRITE, 8192, 2ms);
  m.record(Op::READ, 100, 1us);
  EXPECT_EQ(m.bytes(1), 16384u);
  EXPECT_EQ(m.transfers(1), 2u);
  EXPECT_EQ(m.transfers(0), 1u);
  EXPECT_EQ(m.cell(1, 1).buckets[TransferMetrics::bucket(30us)].load(), 1u);
}

TEST(Metrics, TextFormat) {
  MetricsInput in;
  in.engine_key = "pre\"fill\n";
  in.counters["tcp"] = std::make_shared<BackendCounters>();
  in.counters["tcp"]->metrics.record(Op::WRITE, 1 << 20, 300us);
  in.counters["tcp"]->failures = 2;
  in.inbound_pending = 3;
  in.metadata = MetadataCounts{};
  const std::string t = render_prometheus(in);
  EXPECT_NE(t.find("ferry_engine_info{engine=\"pre\\\"fill\\n\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("ferry_transfer_bytes_total{backend=\"tcp\",op=\"write\"} 1048576\n"),
            std::string::npos);
  EXPECT_NE(t.find("ferry_transfer_failures_total{backend=\"tcp\"} 2\n"), std::string::npos);
  EXPECT_NE(t.find("ferry_inbound_table_size 3\n"), std::string::npos);
  EXPECT_NE(t.find("ferry_transfer_duration_seconds_bucket{backend=\"tcp\",op=\"write\","
                   "size_class=\"le1MiB\",le=\"0.0005\"} 1\n"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("ferry_transfer_duration_seconds_count{backend=\"tcp\",op=\"write\","
                   "size_class=\"le1MiB\"} 1\n"),
            std::string::npos);
  EXPECT_NE(t.find("ferry_metadata_store_up 0\n"), std::string::npos);
}
