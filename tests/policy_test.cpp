// SPDX-License-Identifier: Apache-2.0
// The policy: YAML parsing and its errors, globs, sizes, durations, rule
// matching, and the shipped config/*.yaml examples. Needs only policy.cpp and
// policy_yaml.cpp.
#include "policy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "ferry/plugin.h"
#include "router.h"

namespace ferry {
namespace {

using std::chrono::milliseconds;

// The message parse_policy throws for `yaml`, or "" when it parses.
std::string error_of(const std::string& yaml) {
  try {
    parse_policy(yaml, "f.yaml");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
    return e.what();
  }
  return "";
}

// Fails unless parsing `yaml` throws a message starting "f.yaml:<where>: "
// and containing `what`.
::testing::AssertionResult Rejects(const std::string& yaml, const std::string& where,
                                   const std::string& what) {
  std::string msg = error_of(yaml);
  if (msg.empty()) return ::testing::AssertionFailure() << "parsed without error:\n" << yaml;
  // A `where` ending in ':' pins the line only.
  std::string prefix = "f.yaml:" + where + (where.back() == ':' ? "" : ": ");
  if (msg.rfind(prefix, 0) != 0)
    return ::testing::AssertionFailure() << "expected prefix '" << prefix << "', got: " << msg;
  if (msg.find(what) == std::string::npos)
    return ::testing::AssertionFailure() << "expected '" << what << "' in: " << msg;
  return ::testing::AssertionSuccess();
}

const char* kDesignExample = R"(plugin_dirs: [./build/lib/ferry/plugins]
backends:
  tcp:  { lanes: 8 }
  rdma: { qp_per_transfer: 4, chunk_bytes: 64KiB }
rules:
  - match: { local: gpu, remote: gpu, same_host: true }
    prefer: [xgmi, rdma, ofi, tcp]
  - match: { peer: "decode-*", min_bytes: 64KiB }
    prefer: [rdma, ofi, tcp]
  - prefer: [rdma, ofi, tcp]
failover:
  max_attempts: 3
  quarantine: { after_failures: 4, within: 10s, for: 30s, max: 5m }
timeout: 45s
)";

using Names = std::vector<std::string>;

// ---- good files -----------------------------------------------------------------

TEST(PolicyParse, DesignExample) {
  Policy p = parse_policy(kDesignExample, "f.yaml");
  EXPECT_EQ(p.source, "f.yaml");
  EXPECT_EQ(p.plugin_dirs, Names{"./build/lib/ferry/plugins"});
  ASSERT_EQ(p.backend_settings.size(), 2u);
  EXPECT_EQ(p.backend_settings.at("tcp"), R"({"lanes":8})");
  EXPECT_EQ(p.backend_settings.at("rdma"), R"({"chunk_bytes":"64KiB","qp_per_transfer":4})");
  EXPECT_EQ(p.settings_for("tcp"), R"({"lanes":8})");
  EXPECT_EQ(p.settings_for("ofi"), "{}");

  ASSERT_EQ(p.rules.size(), 3u);
  const PolicyRule& gpu = p.rules[0];
  EXPECT_EQ(gpu.line, 6);
  EXPECT_EQ(gpu.local, MemoryLocation::GPU);
  EXPECT_EQ(gpu.remote, MemoryLocation::GPU);
  EXPECT_EQ(gpu.same_host, true);
  EXPECT_FALSE(gpu.peer || gpu.host || gpu.min_bytes || gpu.max_bytes || gpu.op);
  EXPECT_EQ(gpu.prefer, (Names{"xgmi", "rdma", "ofi", "tcp"}));

  const PolicyRule& decode = p.rules[1];
  EXPECT_EQ(decode.line, 8);
  EXPECT_EQ(decode.peer, "decode-*");
  EXPECT_EQ(decode.min_bytes, 65536u);
  EXPECT_FALSE(decode.max_bytes || decode.local || decode.same_host);
  EXPECT_EQ(decode.prefer, (Names{"rdma", "ofi", "tcp"}));

  const PolicyRule& rest = p.rules[2];
  EXPECT_EQ(rest.line, 10);
  EXPECT_FALSE(rest.peer || rest.host || rest.same_host || rest.local || rest.remote ||
               rest.min_bytes || rest.max_bytes || rest.op);

  EXPECT_EQ(p.max_attempts, 3u);
  EXPECT_EQ(p.quarantine.after_failures, 4u);
  EXPECT_EQ(p.quarantine.within, milliseconds(10000));
  EXPECT_EQ(p.quarantine.period, milliseconds(30000));
  EXPECT_EQ(p.quarantine.max_period, milliseconds(300000));
  EXPECT_EQ(p.timeout, milliseconds(45000));
}

TEST(PolicyParse, EveryMatchKey) {
  Policy p = parse_policy(R"(rules:
  - match:
      peer: "prefill-?"
      host: "10.0.*"
      same_host: false
      local: cpu
      remote: gpu
      min_bytes: 4096
      max_bytes: 1MiB
      op: read
    prefer: [tcp]
  - match: { op: write }
    prefer: [ofi]
)",
                          "f.yaml");
  ASSERT_EQ(p.rules.size(), 2u);
  const PolicyRule& r = p.rules[0];
  EXPECT_EQ(r.line, 2);
  EXPECT_EQ(r.peer, "prefill-?");
  EXPECT_EQ(r.host, "10.0.*");
  EXPECT_EQ(r.same_host, false);
  EXPECT_EQ(r.local, MemoryLocation::CPU);
  EXPECT_EQ(r.remote, MemoryLocation::GPU);
  EXPECT_EQ(r.min_bytes, 4096u);
  EXPECT_EQ(r.max_bytes, 1048576u);
  EXPECT_EQ(r.op, Op::READ);
  EXPECT_EQ(p.rules[1].op, Op::WRITE);
  EXPECT_EQ(p.rules[1].line, 12);
}

TEST(PolicyParse, SettingsKeepTheirYamlTypes) {
  Policy p = parse_policy(R"(backends:
  tcp:
    lanes: 8
    neg: -3
    big: 18446744073709551615
    ratio: 0.5
    on: true
    off: False
    quoted: "8"
    size: 64KiB
    hex: 0x10
    nothing: ~
    list: [1, two, {three: 3}]
    nested: { a: { b: yes } }
)",
                          "f.yaml");
  EXPECT_EQ(p.backend_settings.at("tcp"),
            R"({"big":18446744073709551615,"hex":"0x10","lanes":8,"list":[1,"two",{"three":3}],)"
            R"("neg":-3,"nested":{"a":{"b":"yes"}},"nothing":null,"off":false,"on":true,)"
            R"("quoted":"8","ratio":0.5,"size":"64KiB"})");
}

TEST(PolicyParse, ThirdPartyBackendDeclaredUnderBackends) {
  Policy p = parse_policy(R"(backends:
  my-nic_2:
  tcp: {}
rules:
  - prefer: [my-nic_2, tcp, "*"]
)",
                          "f.yaml");
  EXPECT_EQ(p.backend_settings.at("my-nic_2"), "{}");
  EXPECT_EQ(p.backend_settings.at("tcp"), "{}");
  EXPECT_EQ(p.rules.at(0).prefer, (Names{"my-nic_2", "tcp", "*"}));
}

TEST(PolicyParse, NotifyDefault) {
  EXPECT_TRUE(parse_policy("timeout: 1s\n", "f.yaml").notify);
  EXPECT_FALSE(parse_policy("notify: false\n", "f.yaml").notify);
  EXPECT_TRUE(parse_policy("notify: true\n", "f.yaml").notify);
  EXPECT_TRUE(Rejects("notify: maybe\n", "1:", "notify"));
}

// metadata: the etcd store (issue 21, docs/operations.md).
TEST(PolicyParse, Metadata) {
  Policy p = parse_policy(
      "metadata: {etcd: [http://127.0.0.1:2379, https://e:2379], namespace: prod, lease: 15s}\n",
      "f.yaml");
  EXPECT_EQ(p.metadata.etcd, (std::vector<std::string>{"http://127.0.0.1:2379", "https://e:2379"}));
  EXPECT_EQ(p.metadata.ns, "prod");
  EXPECT_EQ(p.metadata.lease, std::chrono::seconds(15));
  EXPECT_EQ(parse_policy("metadata: {etcd: http://h:1}\n", "f.yaml").metadata.etcd.size(), 1u);
  EXPECT_TRUE(parse_policy("timeout: 1s\n", "f.yaml").metadata.etcd.empty());
  EXPECT_TRUE(Rejects("metadata: {etcd: [127.0.0.1:2379]}\n", "1:", "http://"));
  EXPECT_TRUE(Rejects("metadata: {lease: 1s}\n", "1:", "at least 2s"));
  EXPECT_TRUE(Rejects("metadata: {namespce: x}\n", "1:", "did you mean 'namespace'"));
  EXPECT_TRUE(Rejects("metadata: {etcd: {a: 1}}\n", "1:", "list of endpoint URLs"));
}

TEST(PolicyParse, EmptyFileIsTheBuiltinPolicy) {
  Policy builtin = builtin_policy();
  for (const char* text : {"", "\n", "# nothing here\n", "---\n", "~\n"}) {
    SCOPED_TRACE(text);
    Policy p = parse_policy(text, "empty.yaml");
    EXPECT_EQ(p.source, "empty.yaml");
    ASSERT_EQ(p.rules.size(), builtin.rules.size());
    EXPECT_EQ(p.rules[0].prefer, builtin.rules[0].prefer);
    EXPECT_EQ(p.rules[0].line, 0);
    EXPECT_EQ(p.max_attempts, builtin.max_attempts);
    EXPECT_EQ(p.timeout, builtin.timeout);
    EXPECT_TRUE(p.plugin_dirs.empty());
    EXPECT_TRUE(p.backend_settings.empty());
  }
}

TEST(PolicyParse, NoRulesKeyUsesTheBuiltinRule) {
  Policy p = parse_policy("backends:\n  tcp: { lanes: 2 }\ntimeout: 5s\n", "f.yaml");
  ASSERT_EQ(p.rules.size(), 1u);
  EXPECT_EQ(p.rules[0].prefer, builtin_policy().rules[0].prefer);
  EXPECT_EQ(p.rules[0].prefer.back(), "*");
  EXPECT_EQ(p.backend_settings.at("tcp"), R"({"lanes":2})");
  EXPECT_EQ(p.timeout, milliseconds(5000));
}

TEST(PolicyParse, EmptySectionsMeanDefaults) {
  Policy p = parse_policy("plugin_dirs:\nbackends:\nfailover:\n  quarantine:\n", "f.yaml");
  EXPECT_TRUE(p.plugin_dirs.empty());
  EXPECT_TRUE(p.backend_settings.empty());
  EXPECT_EQ(p.max_attempts, 3u);
  EXPECT_EQ(p.quarantine.period, milliseconds(30000));
}

TEST(PolicyParse, QuarantineMaxDefaultStretchesToFor) {
  Policy p = parse_policy("failover:\n  quarantine: { for: 10m }\n", "f.yaml");
  EXPECT_EQ(p.quarantine.period, milliseconds(600000));
  EXPECT_EQ(p.quarantine.max_period, milliseconds(600000));
  p = parse_policy("failover:\n  quarantine: { for: 1m, max: 1m }\n", "f.yaml");
  EXPECT_EQ(p.quarantine.max_period, milliseconds(60000));
}

TEST(PolicyParse, AttemptBounds) {
  EXPECT_EQ(parse_policy("failover: { max_attempts: 1 }", "f.yaml").max_attempts, 1u);
  EXPECT_EQ(parse_policy("failover: { max_attempts: 16 }", "f.yaml").max_attempts, 16u);
}

// Rules that look alike but each match something the earlier ones do not.
TEST(PolicyParse, ReachableRulesAreAccepted) {
  Policy p = parse_policy(R"(rules:
  - match: { op: read, local: gpu }
    prefer: [rdma]
  - match: { op: write, remote: gpu }
    prefer: [tcp]
  - match: { peer: "a*" }
    prefer: [tcp]
  - match: { peer: "b*", op: read }
    prefer: [tcp]
  - match: { peer: b1 }
    prefer: [ofi]
  - match: { max_bytes: 4KiB }
    prefer: [tcp]
  - match: { min_bytes: 1MiB }
    prefer: [rdma]
  - prefer: [tcp]
)",
                          "f.yaml");
  EXPECT_EQ(p.rules.size(), 8u);
}

// The check proves a rule dead only when one earlier rule covers it. Dead
// rules that need a glob-inside-glob proof or several earlier rules together
// are accepted: a missed warning, never a false one.
TEST(PolicyParse, UnreachableOnlyByPatternsOrUnionsIsNotReported) {
  EXPECT_NO_THROW(
      parse_policy("rules:\n  - match: { peer: \"a*\" }\n    prefer: [tcp]\n"
                   "  - match: { peer: \"ab*\" }\n    prefer: [rdma]\n",
                   "f.yaml"));
  EXPECT_NO_THROW(
      parse_policy("rules:\n  - match: { op: read }\n    prefer: [rdma]\n"
                   "  - match: { op: write }\n    prefer: [tcp]\n  - prefer: [ofi]\n",
                   "f.yaml"));
}

// ---- errors -----------------------------------------------------------------------

TEST(PolicyErrors, UnknownKeys) {
  EXPECT_TRUE(
      Rejects("rule:\n  - prefer: [tcp]\n", "1:1", "unknown key 'rule' (did you mean 'rules'?)"));
  EXPECT_TRUE(Rejects("timeout: 1s\ncolour: red\n", "2:1",
                      "unknown key 'colour' (known keys: plugin_dirs, backends, rules"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { min_byte: 1 }\n    prefer: [tcp]\n", "2:14",
                      "rule 1: unknown key 'min_byte' (did you mean 'min_bytes'?)"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [tcp]\n    prefr: [tcp]\n", "3:5",
                      "unknown key 'prefr' (did you mean 'prefer'?)"));
  EXPECT_TRUE(Rejects("failover:\n  quarantine: { witin: 1s }\n", "2:17",
                      "unknown key 'witin' (did you mean 'within'?)"));
  EXPECT_TRUE(Rejects("failover:\n  max_attempt: 2\n", "2:3",
                      "unknown key 'max_attempt' (did you mean 'max_attempts'?)"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { Peer: x }\n    prefer: [tcp]\n", "2:14",
                      "did you mean 'peer'?"));
}

TEST(PolicyErrors, KeysOneLevelOff) {
  EXPECT_TRUE(Rejects("rules:\n  - peer: x\n    prefer: [tcp]\n", "2:5",
                      "unknown key 'peer' here ('peer' belongs under 'match:')"));
  EXPECT_TRUE(Rejects("max_attempts: 3\n", "1:1", "belongs under 'failover:'"));
  EXPECT_TRUE(Rejects("failover:\n  within: 1s\n", "2:3", "belongs under 'failover: quarantine:'"));
  EXPECT_TRUE(Rejects("failover:\n  timeout: 1s\n", "2:3", "belongs at the top level"));
}

TEST(PolicyErrors, DuplicateKeys) {
  EXPECT_TRUE(
      Rejects("timeout: 1s\ntimeout: 2s\n", "2:1", "duplicate key 'timeout' (first at line 1)"));
  EXPECT_TRUE(
      Rejects("backends:\n  tcp: { lanes: 1, lanes: 2 }\n", "2:20", "duplicate key 'lanes'"));
}

TEST(PolicyErrors, WrongTypes) {
  EXPECT_TRUE(Rejects("rules:\n  - match: { same_host: yes }\n    prefer: [tcp]\n", "2:25",
                      "'same_host' must be true or false, got 'yes'"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { same_host: \"true\" }\n    prefer: [tcp]\n", "2:25",
                      "'same_host' must be true or false"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { local: tpu }\n    prefer: [tcp]\n", "2:21",
                      "bad value 'tpu' for 'local' (expected cpu or gpu)"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { remote: [gpu] }\n    prefer: [tcp]\n", "2:22",
                      "'remote' must be cpu or gpu, got a list"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { op: put }\n    prefer: [tcp]\n", "2:18",
                      "bad value 'put' for 'op' (expected read or write)"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { peer: \"\" }\n    prefer: [tcp]\n", "2:20",
                      "'peer' must be a non-empty name or glob"));
  EXPECT_TRUE(Rejects("rules:\n  - match: [peer]\n    prefer: [tcp]\n", "2:12",
                      "'match' must be a mapping, got a list"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: tcp\n", "2:13",
                      "'prefer' must be a list of backend names, got 'tcp'"));
  EXPECT_TRUE(Rejects("rules:\n  prefer: [tcp]\n", "2:3",
                      "'rules' must be a list of rules, got a mapping"));
  EXPECT_TRUE(Rejects("rules:\n  - tcp\n", "2:5", "rule 1: a rule must be a mapping"));
  EXPECT_TRUE(Rejects("failover: { max_attempts: three }\n", "1:27",
                      "'failover.max_attempts' must be a whole number from 1 to 16, got 'three'"));
  EXPECT_TRUE(Rejects("failover: { max_attempts: \"3\" }\n", "1:27", "must be a whole number"));
  EXPECT_TRUE(Rejects("failover: { max_attempts: 2.5 }\n", "1:27", "must be a whole number"));
  EXPECT_TRUE(Rejects("failover: 3\n", "1:11", "'failover' must be a mapping, got '3'"));
  EXPECT_TRUE(Rejects("timeout: [1s]\n", "1:10", "'timeout' must be a duration"));
  EXPECT_TRUE(Rejects("timeout:\n", "1:1",
                      "'timeout' must be a duration such as 250ms, 30s, 5m or 1h, got nothing"));
  EXPECT_TRUE(
      Rejects("plugin_dirs: ./plugins\n", "1:14",
              "'plugin_dirs' must be a list of folders, got './plugins' (write [./plugins])"));
  EXPECT_TRUE(Rejects("plugin_dirs: [a, [b]]\n", "1:18", "must be a folder path, got a list"));
  EXPECT_TRUE(Rejects("backends: [tcp]\n", "1:11", "'backends' must be a mapping, got a list"));
  EXPECT_TRUE(Rejects("backends:\n  tcp: 8\n", "2:8", "'tcp' must be a mapping of settings"));
  EXPECT_TRUE(Rejects("hello\n", "1:1", "a policy must be a mapping"));
  EXPECT_TRUE(Rejects("- rules\n", "1:1", "a policy must be a mapping"));
}

TEST(PolicyErrors, BadSizesAndDurations) {
  const char* rule = "rules:\n  - match: { min_bytes: %s }\n    prefer: [tcp]\n";
  auto with_size = [&](const std::string& v) {
    std::string s = rule;
    return s.replace(s.find("%s"), 2, v);
  };
  EXPECT_TRUE(Rejects(with_size("64KB5"), "2:25", "rule 1: bad size '64KB5' for 'min_bytes'"));
  EXPECT_TRUE(Rejects(with_size("-1"), "2:25", "bad size '-1'"));
  EXPECT_TRUE(Rejects(with_size("64 KiB"), "2:25", "bad size '64 KiB'"));
  EXPECT_TRUE(
      Rejects(with_size("99999999999999999999"), "2:25", "bad size '99999999999999999999'"));
  EXPECT_TRUE(Rejects(with_size("17179869184GiB"), "2:25", "bad size '17179869184GiB'"));
  EXPECT_TRUE(Rejects(with_size("{}"), "2:25", "'min_bytes' must be a size"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { max_bytes: 1kib }\n    prefer: [tcp]\n", "2:25",
                      "bad size '1kib' for 'max_bytes'"));

  EXPECT_TRUE(Rejects("timeout: 30 s\n", "1:10", "bad duration '30 s' for 'timeout'"));
  EXPECT_TRUE(Rejects("timeout: 30\n", "1:10", "bad duration '30'"));
  EXPECT_TRUE(Rejects("timeout: 1d\n", "1:10", "bad duration '1d'"));
  EXPECT_TRUE(Rejects("timeout: 0s\n", "1:10", "'timeout' must be longer than 0"));
  // Deadlines are now + timeout on the steady clock: centuries would wrap it
  // and fail every transfer at once with ERR_TIMEOUT.
  EXPECT_TRUE(Rejects("timeout: 169h\n", "1:10", "'timeout' must be at most 168h"));
  EXPECT_TRUE(Rejects("timeout: 2629800000s\n", "1:10", "'timeout' must be at most 168h"));
  EXPECT_TRUE(Rejects("failover:\n  quarantine: { within: 99999999999999999s }\n", "2:25",
                      "bad duration '99999999999999999s' for 'failover.quarantine.within'"));
  EXPECT_TRUE(Rejects("failover:\n  quarantine: { for: 0ms }\n", "2:22",
                      "'failover.quarantine.for' must be longer than 0"));
}

TEST(PolicyErrors, OutOfRange) {
  EXPECT_TRUE(Rejects("failover: { max_attempts: 0 }\n", "1:27",
                      "'failover.max_attempts' is 0, out of range 1..16"));
  EXPECT_TRUE(Rejects("failover: { max_attempts: 17 }\n", "1:27", "is 17, out of range 1..16"));
  EXPECT_TRUE(Rejects("failover: { max_attempts: 99999999999999999999999 }\n", "1:27",
                      "out of range 1..16"));
  EXPECT_TRUE(Rejects("failover: { max_attempts: -1 }\n", "1:27", "must be a whole number"));
  EXPECT_TRUE(Rejects("failover:\n  quarantine: { after_failures: 0 }\n", "2:33",
                      "'failover.quarantine.after_failures' is 0, out of range 1..4294967295"));
  EXPECT_TRUE(
      Rejects("failover:\n  quarantine: { for: 1m, max: 30s }\n", "2:31",
              "'failover.quarantine.max' (30s) is shorter than 'failover.quarantine.for' (1m)"));
  EXPECT_TRUE(Rejects("failover:\n  quarantine: { max: 1s }\n", "2:22",
                      "is shorter than 'failover.quarantine.for' (30s, the default)"));
  EXPECT_TRUE(
      Rejects("rules:\n  - match: { min_bytes: 1MiB, max_bytes: 64KiB }\n    prefer: [tcp]\n",
              "2:25", "rule 1: 'min_bytes' (1048576) is greater than 'max_bytes' (65536)"));
}

TEST(PolicyErrors, PreferLists) {
  EXPECT_TRUE(Rejects("rules:\n  - prefer: []\n", "2:13", "rule 1: 'prefer' is empty"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { op: read }\n", "2:5", "rule 1: missing 'prefer'"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [tpc]\n", "2:14",
                      "rule 1: unknown backend 'tpc' (known: tcp, rdma, ofi, xgmi, or one listed "
                      "under backends:); did you mean 'tcp'?"));
  EXPECT_TRUE(Rejects("backends: { mynic: {} }\nrules:\n  - prefer: [mynik]\n", "3:14",
                      "unknown backend 'mynik' (known: tcp, rdma, ofi, xgmi, or one listed under "
                      "backends:); did you mean 'mynic'?"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [carrier-pigeon]\n", "2:14",
                      "unknown backend 'carrier-pigeon'"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [RDMA]\n", "2:14", "bad backend name 'RDMA'"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [tcp, rdma, tcp]\n", "2:25",
                      "duplicate backend 'tcp' in 'prefer' (already entry 1)"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [\"*\", tcp]\n", "2:14", "'*' must be the last entry"));
  EXPECT_TRUE(
      Rejects("rules:\n  - prefer: [tcp, \"*\", \"*\"]\n", "2:19", "'*' must be the last entry"));
  EXPECT_TRUE(
      Rejects("rules:\n  - prefer: [tcp, [rdma]]\n", "2:19", "must be a backend name, got a list"));
}

TEST(PolicyErrors, EmptyRules) {
  EXPECT_TRUE(
      Rejects("rules: []\n", "1:8", "'rules' is empty (leave it out to use the built-in rule)"));
  EXPECT_TRUE(Rejects("rules:\ntimeout: 1s\n", "1:1", "'rules' is empty"));
}

TEST(PolicyErrors, UnreachableRules) {
  // The brief's example: the catch-all is rule 2 at line 4, rule 3 comes after.
  EXPECT_TRUE(Rejects(R"(rules:
  - match: { local: gpu }
    prefer: [xgmi]
  - prefer: [rdma, tcp]
  - match: { peer: "decode-*" }
    prefer: [rdma]
)",
                      "5:5", "rule 3 can never match: rule 2 at line 4 matches every transfer"));
  EXPECT_TRUE(Rejects(
      "rules:\n  - match: {}\n    prefer: [tcp]\n  - match: { op: read }\n    prefer: [rdma]\n",
      "4:5", "rule 2 can never match: rule 1 at line 2 matches every transfer"));
  EXPECT_TRUE(Rejects("rules:\n  - match: { peer: \"*\" }\n    prefer: [tcp]\n  - prefer: [rdma]\n",
                      "4:5", "rule 2 can never match: rule 1 at line 2 matches every transfer"));
  EXPECT_TRUE(Rejects(R"(rules:
  - match: { peer: "d-*", op: read }
    prefer: [tcp]
  - match: { op: write }
    prefer: [ofi]
  - match: { op: read, peer: "d-*" }
    prefer: [rdma]
)",
                      "6:5", "rule 3 can never match: rule 1 at line 2 has the same match"));
  EXPECT_TRUE(Rejects(
      R"(rules:
  - match: { peer: "decode-*" }
    prefer: [rdma]
  - match: { peer: decode-7, min_bytes: 1MiB }
    prefer: [tcp]
)",
      "4:5", "rule 2 can never match: rule 1 at line 2 matches every transfer this one would"));
  EXPECT_TRUE(Rejects(R"(rules:
  - match: { min_bytes: 1KiB, max_bytes: 1MiB }
    prefer: [rdma]
  - match: { min_bytes: 4KiB, max_bytes: 64KiB, local: gpu }
    prefer: [tcp]
)",
                      "4:5", "rule 2 can never match: rule 1 at line 2"));
}

TEST(PolicyErrors, YamlSyntax) {
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [tcp,\ntimeout: 1s\n", "4:1",
                      "YAML syntax error: end of sequence flow not found"));
  EXPECT_TRUE(Rejects("rules:\n  - prefer: [tcp, *]\n", "2:20", "write \"*\" in quotes"));
  EXPECT_TRUE(Rejects("timeout: 1s\n\tfailover: {}\n", "2:1", "YAML syntax error"));
  EXPECT_TRUE(Rejects("timeout: 1s\n---\ntimeout: 2s\n", "3:1", "more than one YAML document"));
  std::string deep =
      "backends:\n  tcp: { x: " + std::string(5000, '[') + std::string(5000, ']') + " }\n";
  EXPECT_TRUE(Rejects(deep, "2:", "nested too deeply"));
}

// Aliases make a tiny file describe a huge tree; expanding it into settings
// JSON must stop with an error, not exhaust memory.
TEST(PolicyErrors, AliasBombInSettings) {
  std::string y = "backends:\n  tcp:\n    l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n";
  for (int i = 1; i <= 6; ++i) {
    std::string prev = "*l" + std::to_string(i - 1);
    y += "    l" + std::to_string(i) + ": &l" + std::to_string(i) + " [";
    for (int j = 0; j < 10; ++j) y += (j ? ", " : "") + prev;
    y += "]\n";
  }
  std::string msg = error_of(y);
  EXPECT_EQ(msg.rfind("f.yaml:", 0), 0u) << msg;
  EXPECT_NE(msg.find("settings for backend 'tcp' are too large"), std::string::npos) << msg;
}

// ---- files --------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/ferry_policy_test_XXXXXX";
    path_ = ::mkdtemp(tmpl) ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(PolicyFile, LoadsAndNamesItself) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  std::string good = dir.path() + "/good.yaml";
  std::ofstream(good) << kDesignExample;
  Policy p = load_policy_file(good);
  EXPECT_EQ(p.source, good);
  EXPECT_EQ(p.rules.size(), 3u);

  std::string bad = dir.path() + "/bad.yaml";
  std::ofstream(bad) << "timeout: 1s\nrules:\n  - prefer: [tpc]\n";
  try {
    load_policy_file(bad);
    FAIL() << "parsed";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(bad + ":3:14: ", 0), 0u) << e.what();
  }
}

TEST(PolicyFile, UnreadableFiles) {
  TempDir dir;
  auto message = [](const std::string& path) -> std::string {
    try {
      load_policy_file(path);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::ERR_INVALID_ARGS);
      return e.what();
    }
    return "";
  };
  std::string missing = dir.path() + "/missing.yaml";
  EXPECT_EQ(message(missing),
            "cannot read policy file '" + missing + "': No such file or directory");
  EXPECT_EQ(message(dir.path()), "cannot read policy file '" + dir.path() + "': Is a directory");

  std::string huge = dir.path() + "/huge.yaml";
  std::ofstream(huge) << "# " << std::string(2 << 20, 'x') << "\n";
  EXPECT_NE(message(huge).find("is larger than 1 MiB"), std::string::npos);

  std::string empty = dir.path() + "/empty.yaml";
  std::ofstream(empty).flush();
  EXPECT_EQ(load_policy_file(empty).source, empty);
}

TEST(PolicyFile, ShippedExamplesParse) {
#ifndef FERRY_SOURCE_DIR
  GTEST_SKIP() << "FERRY_SOURCE_DIR not defined; cannot find config/";
#else
  namespace fs = std::filesystem;
  fs::path config = fs::path(FERRY_SOURCE_DIR) / "config";
  ASSERT_TRUE(fs::is_directory(config)) << config;
  std::vector<std::string> seen;
  for (const auto& entry : fs::directory_iterator(config)) {
    if (entry.path().extension() != ".yaml") continue;
    SCOPED_TRACE(entry.path().string());
    Policy p;
    EXPECT_NO_THROW(p = load_policy_file(entry.path().string()));
    EXPECT_EQ(p.source, entry.path().string());
    EXPECT_FALSE(p.rules.empty());
    seen.push_back(entry.path().filename().string());
  }
  for (const char* name :
       {"policy.yaml", "single-host-gpu.yaml", "rdma-cluster.yaml", "tcp-only.yaml"})
    EXPECT_NE(std::find(seen.begin(), seen.end(), name), seen.end()) << name << " missing";

  Policy tcp = load_policy_file((config / "tcp-only.yaml").string());
  EXPECT_NE(tcp.settings_for("tcp").find("\"lanes\""), std::string::npos);

  RouteQuery gpu_pair;
  gpu_pair.same_host = true;
  gpu_pair.local = gpu_pair.remote = MemoryLocation::GPU;
  Policy single = load_policy_file((config / "single-host-gpu.yaml").string());
  int i = single.match(gpu_pair);
  ASSERT_GE(i, 0);
  EXPECT_EQ(single.rules[i].prefer.front(), "xgmi");
#endif
}

// ---- glob, sizes, durations -------------------------------------------------------

TEST(Glob, Matches) {
  EXPECT_TRUE(glob_match("", ""));
  EXPECT_FALSE(glob_match("", "a"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("*", "anything"));
  EXPECT_TRUE(glob_match("**", "x"));
  EXPECT_FALSE(glob_match("?", ""));
  EXPECT_TRUE(glob_match("?", "a"));
  EXPECT_FALSE(glob_match("?", "ab"));
  EXPECT_TRUE(glob_match("decode-*", "decode-"));
  EXPECT_TRUE(glob_match("decode-*", "decode-12"));
  EXPECT_FALSE(glob_match("decode-*", "prefill-1"));
  EXPECT_FALSE(glob_match("decode-*", "Decode-1"));
  EXPECT_TRUE(glob_match("a*b", "ab"));
  EXPECT_TRUE(glob_match("a*b", "axxb"));
  EXPECT_FALSE(glob_match("a*b", "axxbc"));
  EXPECT_TRUE(glob_match("a*a*b", "aaaab"));  // needs backtracking
  EXPECT_TRUE(glob_match("*.local", "node1.local"));
  EXPECT_TRUE(glob_match("10.0.?.*", "10.0.3.17"));
  EXPECT_FALSE(glob_match("10.0.?.*", "10.0.33.17"));
  EXPECT_TRUE(glob_match("exact", "exact"));
  EXPECT_FALSE(glob_match("exact", "exactly"));
  EXPECT_FALSE(glob_match("[ab]", "a"));  // no character classes: literal brackets
  EXPECT_TRUE(glob_match("[ab]", "[ab]"));
}

TEST(Sizes, Parse) {
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("4096B"), 4096u);
  EXPECT_EQ(parse_size("64KiB"), 65536u);
  EXPECT_EQ(parse_size("64K"), 65536u);
  EXPECT_EQ(parse_size("1MiB"), 1048576u);
  EXPECT_EQ(parse_size("2GiB"), 2ull << 30);
  EXPECT_EQ(parse_size("1KB"), 1000u);
  EXPECT_EQ(parse_size("1MB"), 1000000u);
  EXPECT_EQ(parse_size("3GB"), 3000000000u);
  EXPECT_EQ(parse_size("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(parse_size("17179869183GiB"), 17179869183ull << 30);

  EXPECT_EQ(parse_size(""), std::nullopt);
  EXPECT_EQ(parse_size("KiB"), std::nullopt);
  EXPECT_EQ(parse_size("64KB5"), std::nullopt);
  EXPECT_EQ(parse_size("64 KiB"), std::nullopt);
  EXPECT_EQ(parse_size(" 64"), std::nullopt);
  EXPECT_EQ(parse_size("-1"), std::nullopt);
  EXPECT_EQ(parse_size("+1"), std::nullopt);
  EXPECT_EQ(parse_size("1.5MiB"), std::nullopt);
  EXPECT_EQ(parse_size("1kib"), std::nullopt);
  EXPECT_EQ(parse_size("1TiB"), std::nullopt);
  EXPECT_EQ(parse_size("18446744073709551616"), std::nullopt);  // 2^64
  EXPECT_EQ(parse_size("99999999999999999999999"), std::nullopt);
  EXPECT_EQ(parse_size("17179869184GiB"), std::nullopt);  // 2^34 GiB = 2^64
  EXPECT_EQ(parse_size("18446744073709552KB"), std::nullopt);
}

TEST(Durations, Parse) {
  EXPECT_EQ(parse_duration("250ms"), milliseconds(250));
  EXPECT_EQ(parse_duration("30s"), milliseconds(30000));
  EXPECT_EQ(parse_duration("5m"), milliseconds(300000));
  EXPECT_EQ(parse_duration("1h"), milliseconds(3600000));
  EXPECT_EQ(parse_duration("0ms"), milliseconds(0));
  EXPECT_EQ(parse_duration("1099511627776ms"), milliseconds(1ll << 40));
  EXPECT_EQ(parse_duration("1099511627776h"), milliseconds((1ll << 40) * 3600000));

  EXPECT_EQ(parse_duration(""), std::nullopt);
  EXPECT_EQ(parse_duration("30"), std::nullopt);
  EXPECT_EQ(parse_duration("30 s"), std::nullopt);
  EXPECT_EQ(parse_duration("s"), std::nullopt);
  EXPECT_EQ(parse_duration("1d"), std::nullopt);
  EXPECT_EQ(parse_duration("1S"), std::nullopt);
  EXPECT_EQ(parse_duration("1.5s"), std::nullopt);
  EXPECT_EQ(parse_duration("-1s"), std::nullopt);
  EXPECT_EQ(parse_duration("1099511627777ms"), std::nullopt);
  EXPECT_EQ(parse_duration("99999999999999999999999s"), std::nullopt);
}

// ---- matching ---------------------------------------------------------------------

RouteQuery query(std::string peer, uint64_t bytes, Op op = Op::WRITE,
                 MemoryLocation local = MemoryLocation::CPU,
                 MemoryLocation remote = MemoryLocation::CPU, bool same_host = false,
                 std::string host = "10.0.0.2") {
  RouteQuery q;
  q.peer_key = std::move(peer);
  q.peer_host = std::move(host);
  q.bytes = bytes;
  q.op = op;
  q.local = local;
  q.remote = remote;
  q.same_host = same_host;
  return q;
}

TEST(PolicyMatch, FirstMatchWins) {
  Policy p = parse_policy(R"(rules:
  - match: { local: gpu, remote: gpu, same_host: true }
    prefer: [xgmi, rdma]
  - match: { peer: "decode-*", min_bytes: 64KiB, max_bytes: 1MiB }
    prefer: [rdma]
  - match: { op: read, host: "10.1.*" }
    prefer: [ofi]
  - match: { remote: gpu }
    prefer: [rdma, tcp]
  - match: { peer: "decode-*" }
    prefer: [tcp]
)",
                          "f.yaml");
  using ML = MemoryLocation;
  // Rule 0 needs all three conditions.
  EXPECT_EQ(p.match(query("x", 1, Op::WRITE, ML::GPU, ML::GPU, true)), 0);
  EXPECT_EQ(p.match(query("x", 1, Op::WRITE, ML::GPU, ML::GPU, false)), 3);
  EXPECT_EQ(p.match(query("x", 1, Op::WRITE, ML::CPU, ML::GPU, true)), 3);
  // An earlier rule shadows later ones for the same transfer.
  EXPECT_EQ(p.match(query("decode-1", 64 << 10, Op::WRITE, ML::GPU, ML::GPU, true)), 0);
  // Byte bounds are inclusive.
  EXPECT_EQ(p.match(query("decode-1", (64 << 10) - 1)), 4);
  EXPECT_EQ(p.match(query("decode-1", 64 << 10)), 1);
  EXPECT_EQ(p.match(query("decode-1", 1 << 20)), 1);
  EXPECT_EQ(p.match(query("decode-1", (1 << 20) + 1)), 4);
  EXPECT_EQ(p.match(query("prefill-1", 64 << 10)), -1);
  // op and host.
  EXPECT_EQ(p.match(query("p", 1, Op::READ, ML::CPU, ML::CPU, false, "10.1.7.7")), 2);
  EXPECT_EQ(p.match(query("p", 1, Op::WRITE, ML::CPU, ML::CPU, false, "10.1.7.7")), -1);
  EXPECT_EQ(p.match(query("p", 1, Op::READ, ML::CPU, ML::CPU, false, "10.2.7.7")), -1);
  EXPECT_EQ(p.match(query("p", 1, Op::READ, ML::CPU, ML::GPU, false, "10.2.7.7")), 3);
}

TEST(PolicyMatch, BuiltinMatchesEverything) {
  Policy p = builtin_policy();
  EXPECT_EQ(p.source, "built-in");
  EXPECT_EQ(p.match(query("", 0)), 0);
  EXPECT_EQ(p.match(query("any", UINT64_MAX, Op::READ, MemoryLocation::GPU)), 0);
  EXPECT_EQ(p.rules[0].prefer, (Names{"xgmi", "rdma", "ofi", "tcp", "*"}));
  EXPECT_EQ(builtin_backend_order(), (Names{"xgmi", "rdma", "ofi", "tcp"}));
  // xgmi cannot check on the target side: the built-in rule trusts what it names.
  EXPECT_TRUE(p.rules[0].trust_descriptors);
}

// xgmi declares NO_TARGET_CHECK (its peer copy bypasses the target): the
// built-in policy and the shipped GPU rules still route same-host GPU pairs to
// it; a rule without the opt-in drops it with the reason.
TEST(PolicyRoute, XgmiIsTrustedByTheBuiltinRuleOnly) {
  const uint64_t xgmi_caps = FERRY_CAP_MEM_GPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE |
                             FERRY_CAP_SAME_HOST_ONLY | FERRY_CAP_INITIATOR_COPY |
                             FERRY_CAP_NO_TARGET_CHECK;
  RouteInputs in;
  in.query = query("peer", 1 << 20, Op::WRITE, MemoryLocation::GPU, MemoryLocation::GPU, true);
  in.loaded = {{"xgmi", xgmi_caps}};
  EXPECT_EQ(route(builtin_policy(), in).kept(), (Names{"xgmi"}));
  const RouteDecision d = route(parse_policy("rules:\n  - prefer: [xgmi]\n", "t.yaml"), in);
  EXPECT_TRUE(d.kept().empty());
  ASSERT_FALSE(d.candidates.empty());
  EXPECT_NE(d.candidates[0].why.find("trust_descriptors"), std::string::npos);
}

// A backend that cannot check on the target side (cma) is routed to only by a
// rule that names it and sets trust_descriptors: true; never through "*" (so not
// by the built-in policy either); the reason is what `ferry policy explain` prints.
TEST(PolicyRoute, NoTargetCheckBackendsNeedAnOptIn) {
  const uint64_t cma_caps = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE |
                            FERRY_CAP_SAME_HOST_ONLY | FERRY_CAP_NO_TARGET_CHECK;
  RouteInputs in;
  in.query = query("peer", 4096, Op::WRITE, MemoryLocation::CPU, MemoryLocation::CPU, true);
  in.loaded = {{"cma", cma_caps}};
  auto decide = [&](const Policy& p) { return route(p, in); };
  RouteDecision d = decide(builtin_policy());
  ASSERT_EQ(d.candidates.size(), 5u);  // xgmi, rdma, ofi, tcp, then "*" -> cma
  EXPECT_FALSE(d.candidates.back().kept);
  EXPECT_NE(d.candidates.back().why.find("trust_descriptors"), std::string::npos)
      << d.candidates.back().why;
  const std::string head = "backends:\n  cma: {}\nrules:\n";
  d = decide(parse_policy(head + "  - prefer: [cma]\n", "t.yaml"));
  EXPECT_TRUE(d.kept().empty()) << "named without the opt-in";
  d = decide(parse_policy(head + "  - prefer: [cma]\n    trust_descriptors: true\n", "t.yaml"));
  EXPECT_EQ(d.kept(), (Names{"cma"}));
  d = decide(
      parse_policy(head + "  - prefer: [tcp, \"*\"]\n    trust_descriptors: true\n", "t.yaml"));
  EXPECT_TRUE(d.kept().empty()) << "the opt-in covers only the backends a rule names";
  // Without the flag the same plugin is used as before.
  in.loaded = {{"cma", cma_caps & ~FERRY_CAP_NO_TARGET_CHECK}};
  EXPECT_EQ(decide(builtin_policy()).kept(), (Names{"cma"}));
  // The key takes true or false, nothing else, and says where.
  try {
    parse_policy(head + "  - prefer: [cma]\n    trust_descriptors: yes please\n", "t.yaml");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("t.yaml:5:"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ferry
