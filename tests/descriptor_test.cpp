// SPDX-License-Identifier: Apache-2.0
// Descriptors survive a round trip; hostile bytes are clear errors, never crashes.
#include <gtest/gtest.h>

#include <random>

#include "ferry/ferry.hpp"

using namespace ferry;

namespace {

EngineDesc sample_engine() {
  EngineDesc d;
  d.key = "prefill-0";
  d.host = "10.0.0.7";
  d.port = 4242;
  d.node_id = "node-a";
  d.pid = 1234;
  d.instance = 0x1234567890abcdefull;
  d.secret.assign(32, 0);
  for (size_t i = 0; i < d.secret.size(); ++i) d.secret[i] = static_cast<uint8_t>(0xa0 + i);
  d.backends["tcp"] = {1, 2, 3, 4};
  d.backends["rdma"] = std::vector<uint8_t>(300, 7);
  return d;
}

MemoryDesc sample_mem() {
  MemoryDesc m;
  m.engine_key = "prefill-0";
  m.engine_instance = 0x1234567890abcdefull;
  m.id = 42;
  m.location = MemoryLocation::GPU;
  m.device = 3;
  m.bus_id = "0000:1b:00.0";
  m.addr = 0x7f0000001000;
  m.size = 1 << 30;
  m.backends["xgmi"] = std::vector<uint8_t>(64, 9);
  return m;
}

TEST(Descriptors, InstanceIsOptionalOnTheWire) {
  // Descriptors without an instance (from an engine before it existed) still decode, as 0.
  EngineDesc d = sample_engine();
  d.instance = 0;
  EXPECT_EQ(EngineDesc::unpack(d.pack()).instance, 0u);
  MemoryDesc m = sample_mem();
  m.engine_instance = 0;
  EXPECT_EQ(MemoryDesc::unpack(m.pack()).engine_instance, 0u);
}

// The control plane's unix socket name is optional: absent (an older ferry,
// or no socket) it decodes as empty; present it must look like ours.
TEST(Descriptors, ControlSocketNameIsOptionalAndChecked) {
  EngineDesc d = sample_engine();
  EXPECT_EQ(EngineDesc::unpack(d.pack()).control_unix, "");
  d.control_unix = "ferry-ctrl-0123456789abcdef";
  EXPECT_EQ(EngineDesc::unpack(d.pack()), d);
  for (std::string bad :
       {std::string("../etc"), std::string("a b"), std::string(101, 'a'), std::string("x\x01")}) {
    d.control_unix = bad;
    EXPECT_THROW(EngineDesc::unpack(d.pack()), Error) << bad;
  }
}

TEST(Descriptors, EngineRoundTrip) {
  EngineDesc d = sample_engine();
  EXPECT_EQ(EngineDesc::unpack(d.pack()), d);
  EXPECT_NE(d.to_json().find("\"prefill-0\""), std::string::npos);
}

TEST(Descriptors, TheAccessSecretTravelsButIsNeverPrinted) {
  EngineDesc d = sample_engine();
  EXPECT_EQ(EngineDesc::unpack(d.pack()).secret, d.secret);
  const std::string json = d.to_json();
  EXPECT_NE(json.find("(secret, 32 bytes)"), std::string::npos) << json;
  // Not as hex, not as the bytes themselves.
  EXPECT_EQ(json.find("a0a1a2a3"), std::string::npos) << json;
  EXPECT_EQ(json.find("\xa0"), std::string::npos) << json;
  for (size_t bad : {0u, 16u, 31u, 33u}) {
    EngineDesc e = sample_engine();
    e.secret.assign(bad, 1);
    EXPECT_THROW(EngineDesc::unpack(e.pack()), Error) << bad << "-byte secret";
  }
}

// A descriptor of format version 1 (before access by descriptor), as that
// ferry packed it: the same map without "s", with "v": 1.
std::vector<uint8_t> version1_engine() {
  // msgpack by hand, so the test does not depend on today's encoder.
  std::vector<uint8_t> b = {0x87};  // map of 7
  auto str = [&](const std::string& s) {
    b.push_back(static_cast<uint8_t>(0xa0 | s.size()));
    b.insert(b.end(), s.begin(), s.end());
  };
  str("t"), str("engine");
  str("v"), b.push_back(0x01);
  str("k"), str("prefill-0");
  str("h"), str("10.0.0.7");
  str("p"), b.push_back(0xcd), b.push_back(0x10), b.push_back(0x92);  // 4242
  str("n"), str("node-a");
  str("b"), b.push_back(0x80);  // {}
  return b;
}

TEST(Descriptors, AnOlderFormatVersionIsRefusedWithAMessage) {
  try {
    EngineDesc::unpack(version1_engine());
    FAIL() << "a version-1 descriptor was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    const std::string w = e.what();
    EXPECT_NE(w.find("format version 1"), std::string::npos) << w;
    EXPECT_NE(w.find("export it again"), std::string::npos) << w;
  }
  std::vector<uint8_t> v9 = version1_engine();
  v9[12] = 0x09;  // "v": 9
  ASSERT_EQ(v9[11], 'v');
  try {
    EngineDesc::unpack(v9);
    FAIL() << "a version-9 descriptor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("newer than this ferry"), std::string::npos) << e.what();
  }
}

TEST(Descriptors, MemoryRoundTrip) {
  MemoryDesc m = sample_mem();
  EXPECT_EQ(MemoryDesc::unpack(m.pack()), m);
  EXPECT_NE(m.to_json().find("0000:1b:00.0"), std::string::npos);
}

TEST(Descriptors, EveryTruncationIsAnError) {
  auto bytes = sample_engine().pack();
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<long>(n));
    EXPECT_THROW(EngineDesc::unpack(cut), Error) << "length " << n;
  }
  auto mbytes = sample_mem().pack();
  for (size_t n = 0; n < mbytes.size(); ++n) {
    std::vector<uint8_t> cut(mbytes.begin(), mbytes.begin() + static_cast<long>(n));
    EXPECT_THROW(MemoryDesc::unpack(cut), Error) << "length " << n;
  }
}

TEST(Descriptors, WrongKindIsAnError) {
  EXPECT_THROW(MemoryDesc::unpack(sample_engine().pack()), Error);
  EXPECT_THROW(EngineDesc::unpack(sample_mem().pack()), Error);
}

TEST(Descriptors, ForgedFieldsAreErrors) {
  MemoryDesc m = sample_mem();
  m.size = 0;
  EXPECT_THROW(MemoryDesc::unpack(m.pack()), Error);
  m = sample_mem();
  m.addr = UINT64_MAX - 10;  // range wraps
  EXPECT_THROW(MemoryDesc::unpack(m.pack()), Error);
  m = sample_mem();
  m.backends["x"] = std::vector<uint8_t>(5000, 1);  // blob over the limit
  EXPECT_THROW(MemoryDesc::unpack(m.pack()), Error);
  EngineDesc e = sample_engine();
  e.key = std::string(300, 'k');
  EXPECT_THROW(EngineDesc::unpack(e.pack()), Error);
  e = sample_engine();
  e.port = 0;
  EXPECT_THROW(EngineDesc::unpack(e.pack()), Error);
  try {
    EngineDesc::unpack({0xc1});
    FAIL() << "no error";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_NE(std::string(err.what()).find("malformed descriptor"), std::string::npos);
  }
}

// Keys, hosts, node and bus ids reach plugins as C strings and Python as str:
// bytes that are not UTF-8 text (or hold a NUL) are refused at unpack.
TEST(Descriptors, StringsThatAreNotUtf8TextAreRefused) {
  const std::vector<std::string> bad = {
      std::string("pre\xff"
                  "fill"),              // not UTF-8 at all
      std::string("\xc0\xaf"),          // overlong '/'
      std::string("\xed\xa0\x80"),      // a UTF-16 surrogate
      std::string("\xf4\x90\x80\x80"),  // above U+10FFFF
      std::string("cut\xe2\x82"),       // truncated sequence
      std::string("nul\0inside", 10),   // NUL: a C string would end early
  };
  auto expect_refused = [](auto unpack, const std::vector<uint8_t>& bytes,
                           const std::string& what) {
    try {
      unpack(bytes);
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), StatusCode::ERR_INVALID_ARGS) << what;
      EXPECT_NE(std::string(err.what()).find("UTF-8"), std::string::npos) << err.what();
    }
  };
  for (const auto& s : bad) {
    EngineDesc e = sample_engine();
    e.key = s;
    expect_refused(EngineDesc::unpack, e.pack(), "engine key");
    e = sample_engine();
    e.host = s;
    expect_refused(EngineDesc::unpack, e.pack(), "engine host");
    e = sample_engine();
    e.node_id = s;
    expect_refused(EngineDesc::unpack, e.pack(), "node id");
    MemoryDesc m = sample_mem();
    m.engine_key = s;
    expect_refused(MemoryDesc::unpack, m.pack(), "memory key");
    m = sample_mem();
    m.bus_id = s;
    expect_refused(MemoryDesc::unpack, m.pack(), "bus id");
  }
  // Real UTF-8 beyond ASCII is fine.
  EngineDesc e = sample_engine();
  e.key =
      "d\xc3\xa9"
      "code-\xe2\x82\xac-\xf0\x9f\x9a\xa2";
  EXPECT_EQ(EngineDesc::unpack(e.pack()).key, e.key);
}

TEST(Descriptors, OversizedAndDeeplyNestedInputIsRejected) {
  EXPECT_THROW(EngineDesc::unpack(std::vector<uint8_t>(300 * 1024, 0x90)), Error);
  // 100k nested one-element arrays: must not recurse until the stack breaks.
  std::vector<uint8_t> nested(100000, 0x91);
  nested.push_back(0xc0);
  EXPECT_THROW(EngineDesc::unpack(nested), Error);
}

TEST(Descriptors, RandomBytesNeverCrash) {
  std::mt19937_64 rng(7);
  auto good = sample_mem().pack();
  for (int i = 0; i < 20000; ++i) {
    std::vector<uint8_t> b = good;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    try {
      MemoryDesc::unpack(b);  // may decode to something valid; must not crash
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    }
  }
}

}  // namespace
