// SPDX-License-Identifier: Apache-2.0
// Inputs the fuzzers (fuzz/) once crashed on, kept as unit tests. The same
// inputs also sit in fuzz/corpus/<target>/regress-*, so every fuzz run starts
// by replaying them.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "policy.h"

using namespace ferry;

// fuzz_descriptors: a descriptor whose node id is not UTF-8 decoded fine, and
// to_json() then threw nlohmann::type_error (terminating `ferry` tools that print it).
TEST(FuzzRegression, DescriptorWithInvalidUtf8PrintsAsJson) {
  EngineDesc d;
  d.key = "prefill-0";
  d.host = "10.1.2.3";
  d.port = 41000;
  d.node_id =
      "n\xef"
      "de-a";
  d.secret.assign(32, 7);
  // Such a descriptor no longer decodes (strings must be UTF-8 text) ...
  EXPECT_THROW(EngineDesc::unpack(d.pack()), Error);
  // ... but one built locally still prints without throwing.
  std::string json;
  ASSERT_NO_THROW(json = d.to_json());
  EXPECT_NE(json.find("\"k\":\"prefill-0\""), std::string::npos) << json;
  MemoryDesc m;
  m.engine_key = "\xfe\xff";
  m.id = 1;
  m.location = MemoryLocation::CPU;
  m.size = 4096;
  EXPECT_THROW(MemoryDesc::unpack(m.pack()), Error);
  ASSERT_NO_THROW((void)m.to_json());
}

// fuzz_policy: a backend setting that is not UTF-8 escaped parse_policy as
// nlohmann::type_error instead of a ferry::Error naming the line.
TEST(FuzzRegression, PolicySettingWithInvalidUtf8IsAPositionedError) {
  const std::string text = "backends:\n  tcp:\n    lanes: 8\n    note: \"a\xfe\"\n";
  try {
    parse_policy(text, "p.yaml");
    FAIL() << "accepted a setting that is not UTF-8";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    EXPECT_EQ(std::string(e.what()).rfind("p.yaml:3:", 0), 0u) << e.what();
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
  }
}

// fuzz_policy: yaml-cpp 0.7 never returned from documents with a stray ','
// where a node should start; parse_policy (and so Engine's constructor) hung.
TEST(FuzzRegression, StrayCommaDoesNotHangThePolicyParser) {
  for (const char* text : {"#\n ,", " ,", "[a]\n,", "{a: 1}\n,", "\"x\"\n,", "&x ,", "!t ,",
                           "rules:\n  - prefer: [tcp]\n...\n,"}) {
    SCOPED_TRACE(text);
    try {
      parse_policy(text, "p.yaml");
      FAIL() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("p.yaml:", 0), 0u) << e.what();
    }
  }
  // Valid policies still parse.
  EXPECT_EQ(parse_policy("rules:\n  - prefer: [tcp, \"*\"]\n", "ok.yaml").rules.size(), 1u);
}
