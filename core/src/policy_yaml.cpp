// SPDX-License-Identifier: Apache-2.0
// The YAML form of a Policy (docs/policy.md). Strict on purpose: a typo in a
// policy would otherwise silently route over the wrong backend, so every key,
// type and value is checked and each error names source:line:column.
#include <yaml-cpp/depthguard.h>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>

#include "policy.h"

namespace ferry {
namespace {

using json = nlohmann::json;

// A policy is a few hundred bytes; the cap keeps a mistaken path such as
// /dev/zero from eating memory.
constexpr size_t kMaxPolicyBytes = 1 << 20;
// Aliases let a small file describe an exponentially large tree; converting
// settings to JSON expands them, so the expansion is bounded.
constexpr size_t kMaxSettingsNodes = 10000;
constexpr uint64_t kMaxAttempts = 16;
constexpr size_t kMaxBackendName = 32;

// yaml-cpp 0.7 loops forever, emitting empty documents, on some stray ','
// tokens ("[a]\n,", "&x ,": found by fuzz/fuzz_policy). A first pass counts
// parser events against a budget no real document comes near, and stops there.
class EventBudget : public YAML::EventHandler {
 public:
  struct Exhausted {
    YAML::Mark mark;
  };
  explicit EventBudget(size_t budget) : left_(budget) {}
  void OnDocumentStart(const YAML::Mark& m) override { spend(m); }
  void OnDocumentEnd() override { spend(mark_); }
  void OnNull(const YAML::Mark& m, YAML::anchor_t) override { spend(m); }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t) override { spend(m); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                const std::string&) override {
    spend(m);
  }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {
    spend(m);
  }
  void OnSequenceEnd() override { spend(mark_); }
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {
    spend(m);
  }
  void OnMapEnd() override { spend(mark_); }

 private:
  void spend(const YAML::Mark& m) {
    mark_ = m;
    if (left_-- == 0) throw Exhausted{m};
  }
  size_t left_;
  YAML::Mark mark_ = YAML::Mark::null_mark();
};

const std::vector<std::string> kTopKeys = {"plugin_dirs", "backends", "rules",   "failover",
                                           "timeout",     "notify",   "metadata"};
const std::vector<std::string> kMetadataKeys = {"etcd", "namespace", "lease"};
const std::vector<std::string> kRuleKeys = {"match", "prefer", "trust_descriptors"};
const std::vector<std::string> kMatchKeys = {"peer",   "host",      "same_host", "local",
                                             "remote", "min_bytes", "max_bytes", "op"};
const std::vector<std::string> kFailoverKeys = {"max_attempts", "quarantine"};
const std::vector<std::string> kQuarantineKeys = {"after_failures", "within", "for", "max"};

// Where each key lives, so a key written one level off gets "belongs under"
// instead of a bare "unknown key".
struct Section {
  const std::vector<std::string>* keys;
  const char* where;
};
const Section kSections[] = {
    {&kTopKeys, "the top level"},
    {&kRuleKeys, "a rule (an item of 'rules:')"},
    {&kMatchKeys, "'match:'"},
    {&kFailoverKeys, "'failover:'"},
    {&kQuarantineKeys, "'failover: quarantine:'"},
    {&kMetadataKeys, "'metadata:'"},
};

// Optimal string alignment distance: a swapped pair ("tpc") counts as one edit.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

std::string lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return s;
}

// The closest candidate within two edits, or empty.
std::string suggest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = 3;
  for (const auto& c : candidates) {
    size_t d = edit_distance(lower(word), c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  return best;
}

std::string format_duration(std::chrono::milliseconds d) {
  auto ms = d.count();
  if (ms != 0 && ms % 3600000 == 0) return std::to_string(ms / 3600000) + "h";
  if (ms != 0 && ms % 60000 == 0) return std::to_string(ms / 60000) + "m";
  if (ms != 0 && ms % 1000 == 0) return std::to_string(ms / 1000) + "s";
  return std::to_string(ms) + "ms";
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

bool valid_backend_name(const std::string& s) {
  if (s.empty() || s.size() > kMaxBackendName) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

bool all_stars(const std::string& glob) {
  return !glob.empty() && glob.find_first_not_of('*') == std::string::npos;
}

bool is_quoted(const YAML::Node& n) { return n.Tag() == "!" || n.Tag() == "tag:yaml.org,2002:str"; }

// A value in the file together with what is needed to blame it.
struct Field {
  std::string name;                    // the key as written, for messages
  std::optional<YAML::Mark> key_mark;  // absent for list items and the document
  YAML::Node value;

  // yaml-cpp marks an empty value ("timeout:") at the next token, often on
  // another line; the key is where the user should look.
  YAML::Mark where() const {
    if (value.IsNull() && key_mark) return *key_mark;
    return value.Mark();
  }
};

struct ParsedRule {
  PolicyRule rule;
  YAML::Mark mark;
};

class Parser {
 public:
  explicit Parser(const std::string& source) : source_(source) {}

  Policy parse(const std::string& text);

 private:
  [[noreturn]] void fail(const YAML::Mark& m, const std::string& what) const {
    // A null mark (-1) would print as line 0; 1:1 at least points into the file.
    int line = m.line >= 0 ? m.line + 1 : 1;
    int col = m.column >= 0 ? m.column + 1 : 1;
    throw Error(StatusCode::ERR_INVALID_ARGS,
                source_ + ":" + std::to_string(line) + ":" + std::to_string(col) + ": " + what);
  }

  static std::string describe(const YAML::Node& n) {
    switch (n.Type()) {
      case YAML::NodeType::Null:
        return "nothing";
      case YAML::NodeType::Sequence:
        return "a list";
      case YAML::NodeType::Map:
        return "a mapping";
      default:
        return "'" + n.Scalar() + "'";
    }
  }

  [[noreturn]] void wrong_type(const std::string& ctx, const Field& f, const std::string& want) {
    fail(f.where(), ctx + "'" + f.name + "' must be " + want + ", got " + describe(f.value));
  }

  // The entries of a mapping in file order; rejects non-string keys, duplicate
  // keys (yaml-cpp silently keeps the first) and keys not in `known`.
  std::vector<Field> entries(const std::string& ctx, const Field& f,
                             const std::vector<std::string>* known) {
    std::vector<Field> out;
    // An empty section ("failover:" with every child commented out) means
    // the defaults, like leaving it out.
    if (f.value.IsNull()) return out;
    if (!f.value.IsMap()) wrong_type(ctx, f, "a mapping");
    for (auto it = f.value.begin(); it != f.value.end(); ++it) {
      // By value: it-> yields a temporary pair, so a reference would dangle.
      YAML::Node k = it->first;
      YAML::Node v = it->second;
      if (!k.IsScalar() || k.Scalar().empty())
        fail(k.IsNull() ? v.Mark() : k.Mark(),
             ctx + "keys under '" + f.name + "' must be names, got " + describe(k));
      std::string key = k.Scalar();
      for (const auto& prev : out)
        if (prev.name == key)
          fail(k.Mark(), ctx + "duplicate key '" + key + "' (first at line " +
                             std::to_string(prev.key_mark->line + 1) + ")");
      if (known && std::find(known->begin(), known->end(), key) == known->end())
        unknown_key(ctx, k.Mark(), key, *known);
      out.push_back(Field{key, k.Mark(), v});
    }
    return out;
  }

  [[noreturn]] void unknown_key(const std::string& ctx, const YAML::Mark& m, const std::string& key,
                                const std::vector<std::string>& known) {
    for (const auto& s : kSections)
      if (s.keys != &known && std::find(s.keys->begin(), s.keys->end(), key) != s.keys->end()) {
        std::string here = s.keys == &kTopKeys ? "belongs at " : "belongs under ";
        fail(m, ctx + "unknown key '" + key + "' here ('" + key + "' " + here + s.where + ")");
      }
    std::string guess = suggest(key, known);
    if (!guess.empty()) fail(m, ctx + "unknown key '" + key + "' (did you mean '" + guess + "'?)");
    fail(m, ctx + "unknown key '" + key + "' (known keys: " + join(known) + ")");
  }

  std::string string_value(const std::string& ctx, const Field& f, const std::string& want) {
    if (!f.value.IsScalar() || f.value.Scalar().empty()) wrong_type(ctx, f, want);
    return f.value.Scalar();
  }

  bool bool_value(const std::string& ctx, const Field& f) {
    static const std::set<std::string> yes = {"true", "True", "TRUE"};
    static const std::set<std::string> no = {"false", "False", "FALSE"};
    if (f.value.IsScalar() && !is_quoted(f.value)) {
      if (yes.count(f.value.Scalar())) return true;
      if (no.count(f.value.Scalar())) return false;
    }
    wrong_type(ctx, f, "true or false");
  }

  uint64_t uint_value(const std::string& ctx, const Field& f, uint64_t lo, uint64_t hi) {
    std::string want = "a whole number from " + std::to_string(lo) + " to " + std::to_string(hi);
    if (!f.value.IsScalar() || is_quoted(f.value)) wrong_type(ctx, f, want);
    const std::string& s = f.value.Scalar();
    uint64_t v = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (s.empty() || end != s.data() + s.size() || ec == std::errc::invalid_argument)
      wrong_type(ctx, f, want);
    if (ec == std::errc::result_out_of_range || v < lo || v > hi)
      fail(f.where(), ctx + "'" + f.name + "' is " + s + ", out of range " + std::to_string(lo) +
                          ".." + std::to_string(hi));
    return v;
  }

  uint64_t size_value(const std::string& ctx, const Field& f) {
    std::string want = "a size such as 4096, 64KiB or 1MiB";
    if (!f.value.IsScalar()) wrong_type(ctx, f, want);
    auto v = parse_size(f.value.Scalar());
    if (!v)
      fail(f.where(), ctx + "bad size '" + f.value.Scalar() + "' for '" + f.name + "' (expected " +
                          want + ")");
    return *v;
  }

  std::chrono::milliseconds duration_value(const std::string& ctx, const Field& f) {
    std::string want = "a duration such as 250ms, 30s, 5m or 1h";
    if (!f.value.IsScalar()) wrong_type(ctx, f, want);
    auto v = parse_duration(f.value.Scalar());
    if (!v)
      fail(f.where(), ctx + "bad duration '" + f.value.Scalar() + "' for '" + f.name +
                          "' (expected " + want + ")");
    if (v->count() == 0) fail(f.where(), ctx + "'" + f.name + "' must be longer than 0");
    if (*v > Policy::kMaxDuration) fail(f.where(), ctx + "'" + f.name + "' must be at most 168h");
    return *v;
  }

  MemoryLocation location_value(const std::string& ctx, const Field& f) {
    std::string s = string_value(ctx, f, "cpu or gpu");
    if (s == "cpu") return MemoryLocation::CPU;
    if (s == "gpu") return MemoryLocation::GPU;
    fail(f.where(), ctx + "bad value '" + s + "' for '" + f.name + "' (expected cpu or gpu)");
  }

  Op op_value(const std::string& ctx, const Field& f) {
    std::string s = string_value(ctx, f, "read or write");
    if (s == "read") return Op::READ;
    if (s == "write") return Op::WRITE;
    fail(f.where(), ctx + "bad value '" + s + "' for 'op' (expected read or write)");
  }

  std::string glob_value(const std::string& ctx, const Field& f) {
    return string_value(ctx, f, "a non-empty name or glob pattern (* and ?)");
  }

  std::vector<std::string> parse_plugin_dirs(const Field& f) {
    if (f.value.IsScalar())
      fail(f.where(), "'plugin_dirs' must be a list of folders, got '" + f.value.Scalar() +
                          "' (write [" + f.value.Scalar() + "])");
    if (f.value.IsNull()) return {};
    if (!f.value.IsSequence()) wrong_type("", f, "a list of folders");
    std::vector<std::string> dirs;
    for (const auto& item : f.value)
      dirs.push_back(string_value("", Field{"plugin_dirs", std::nullopt, item}, "a folder path"));
    return dirs;
  }

  json scalar_to_json(const std::string& backend, const YAML::Node& n) {
    const std::string& s = n.Scalar();
    if (is_quoted(n)) return s;
    if (s == "true" || s == "True" || s == "TRUE") return true;
    if (s == "false" || s == "False" || s == "FALSE") return false;
    if (s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
    std::string_view digits = s;
    if (!digits.empty() && (digits[0] == '+' || digits[0] == '-')) digits.remove_prefix(1);
    std::string_view number = s;
    if (!number.empty() && number[0] == '+') number.remove_prefix(1);
    const char* b = number.data();
    const char* e = number.data() + number.size();
    if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string_view::npos) {
      int64_t i = 0;
      if (auto r = std::from_chars(b, e, i); r.ec == std::errc() && r.ptr == e) return i;
      uint64_t u = 0;
      if (auto r = std::from_chars(b, e, u); r.ec == std::errc() && r.ptr == e) return u;
      fail(n.Mark(), "backend '" + backend + "': integer " + s + " does not fit in 64 bits");
    }
    // Only plain decimal floats; "1e3" style too. Anything else (64KiB, 0x10,
    // .inf) stays a string for the plugin to interpret.
    if (!digits.empty() && (std::isdigit(static_cast<unsigned char>(digits[0])) ||
                            (digits[0] == '.' && digits.size() > 1))) {
      double d = 0;
      if (auto r = std::from_chars(b, e, d, std::chars_format::general);
          r.ec == std::errc() && r.ptr == e)
        return d;
    }
    return s;
  }

  json to_json(const std::string& backend, const YAML::Node& n, size_t& budget) {
    if (budget == 0)
      fail(n.Mark(), "settings for backend '" + backend + "' are too large (over " +
                         std::to_string(kMaxSettingsNodes) + " values)");
    --budget;
    switch (n.Type()) {
      case YAML::NodeType::Scalar:
        return scalar_to_json(backend, n);
      case YAML::NodeType::Sequence: {
        json a = json::array();
        for (const auto& item : n) a.push_back(to_json(backend, item, budget));
        return a;
      }
      case YAML::NodeType::Map: {
        json o = json::object();
        for (const auto& f : entries("backend '" + backend + "': ", Field{backend, {}, n}, nullptr))
          o[f.name] = to_json(backend, f.value, budget);
        return o;
      }
      default:
        return nullptr;
    }
  }

  std::map<std::string, std::string> parse_backends(const Field& f) {
    std::map<std::string, std::string> out;
    for (const auto& b : entries("", f, nullptr)) {
      if (!valid_backend_name(b.name))
        fail(*b.key_mark, "bad backend name '" + b.name +
                              "' under 'backends:' (lowercase letters, digits, '_' or '-', at "
                              "most 32; the plugin file is libferry-<name>.so)");
      // An empty entry ("myplugin:") declares a backend without settings.
      if (b.value.IsNull()) {
        out[b.name] = "{}";
        continue;
      }
      if (!b.value.IsMap())
        wrong_type("", b, "a mapping of settings (e.g. { lanes: 8 }) or nothing");
      size_t budget = kMaxSettingsNodes;
      try {
        out[b.name] = to_json(b.name, b.value, budget).dump();
      } catch (const json::type_error&) {
        // Plugins get settings as JSON text, which must be UTF-8 (found by fuzz/fuzz_policy).
        fail(b.value.Mark(), "settings for backend '" + b.name + "' are not valid UTF-8 text");
      }
    }
    return out;
  }

  std::vector<std::string> parse_prefer(const std::string& ctx, const Field& f,
                                        const std::vector<std::string>& known) {
    if (!f.value.IsSequence()) wrong_type(ctx, f, "a list of backend names");
    if (f.value.size() == 0) fail(f.where(), ctx + "'prefer' is empty (name at least one backend)");
    std::vector<std::string> names;
    for (size_t i = 0; i < f.value.size(); ++i) {
      YAML::Node item = f.value[i];
      std::string name = string_value(ctx, Field{"prefer", std::nullopt, item}, "a backend name");
      if (name == "*") {
        if (i + 1 != f.value.size())
          fail(item.Mark(), ctx +
                                "'*' must be the last entry of 'prefer' (it means every other "
                                "loaded backend)");
      } else if (!valid_backend_name(name)) {
        std::string guess = suggest(name, known);
        fail(item.Mark(), ctx + "bad backend name '" + name +
                              "' (lowercase letters, digits, '_' or '-', at most 32)" +
                              (guess.empty() ? "" : "; did you mean '" + guess + "'?"));
      } else if (std::find(known.begin(), known.end(), name) == known.end()) {
        std::string guess = suggest(name, known);
        fail(item.Mark(), ctx + "unknown backend '" + name +
                              "' (known: tcp, rdma, ofi, xgmi, or one listed under backends:)" +
                              (guess.empty() ? "" : "; did you mean '" + guess + "'?"));
      }
      for (size_t j = 0; j < names.size(); ++j)
        if (names[j] == name)
          fail(item.Mark(), ctx + "duplicate backend '" + name + "' in 'prefer' (already entry " +
                                std::to_string(j + 1) + ")");
      names.push_back(name);
    }
    return names;
  }

  void parse_match(const std::string& ctx, const Field& f, PolicyRule& r) {
    std::optional<YAML::Mark> min_mark;
    for (const auto& m : entries(ctx, f, &kMatchKeys)) {
      if (m.name == "peer")
        r.peer = glob_value(ctx, m);
      else if (m.name == "host")
        r.host = glob_value(ctx, m);
      else if (m.name == "same_host")
        r.same_host = bool_value(ctx, m);
      else if (m.name == "local")
        r.local = location_value(ctx, m);
      else if (m.name == "remote")
        r.remote = location_value(ctx, m);
      else if (m.name == "op")
        r.op = op_value(ctx, m);
      else if (m.name == "min_bytes") {
        r.min_bytes = size_value(ctx, m);
        min_mark = m.where();
      } else if (m.name == "max_bytes") {
        r.max_bytes = size_value(ctx, m);
      }
    }
    if (r.min_bytes && r.max_bytes && *r.min_bytes > *r.max_bytes)
      fail(*min_mark, ctx + "'min_bytes' (" + std::to_string(*r.min_bytes) +
                          ") is greater than 'max_bytes' (" + std::to_string(*r.max_bytes) +
                          "): the rule can never match");
  }

  std::vector<ParsedRule> parse_rules(const Field& f, const std::vector<std::string>& known) {
    if (f.value.IsNull() || (f.value.IsSequence() && f.value.size() == 0))
      fail(f.where(), "'rules' is empty (leave it out to use the built-in rule)");
    if (!f.value.IsSequence()) wrong_type("", f, "a list of rules");
    std::vector<ParsedRule> rules;
    for (size_t i = 0; i < f.value.size(); ++i) {
      YAML::Node item = f.value[i];
      std::string ctx = "rule " + std::to_string(i + 1) + ": ";
      if (!item.IsMap())
        fail(item.Mark(), ctx +
                              "a rule must be a mapping with 'prefer' (and optionally "
                              "'match'), got " +
                              describe(item));
      ParsedRule pr;
      pr.mark = item.Mark();
      pr.rule.line = item.Mark().line + 1;
      bool has_prefer = false;
      for (const auto& e :
           entries(ctx, Field{"rule " + std::to_string(i + 1), {}, item}, &kRuleKeys)) {
        if (e.name == "match") {
          parse_match(ctx, e, pr.rule);
        } else if (e.name == "trust_descriptors") {
          pr.rule.trust_descriptors = bool_value(ctx, e);
        } else {
          pr.rule.prefer = parse_prefer(ctx, e, known);
          has_prefer = true;
        }
      }
      if (!has_prefer) fail(item.Mark(), ctx + "missing 'prefer' (the backends to try, in order)");
      rules.push_back(std::move(pr));
    }
    return rules;
  }

  static bool glob_covers(const std::optional<std::string>& a,
                          const std::optional<std::string>& b) {
    if (!a || all_stars(*a)) return true;
    if (!b) return false;
    if (*a == *b) return true;
    // A literal is covered when the broader pattern matches it; pattern
    // against pattern is undecided here, so it is not reported.
    return b->find_first_of("*?") == std::string::npos && glob_match(*a, *b);
  }

  template <typename T>
  static bool equal_covers(const std::optional<T>& a, const std::optional<T>& b) {
    return !a || (b && *a == *b);
  }

  // True when every transfer that `b` matches is also matched by `a`, so a
  // later `b` can never be reached. Match keys are independent conditions,
  // so covering each one is exact, never a false alarm.
  static bool covers(const PolicyRule& a, const PolicyRule& b) {
    return glob_covers(a.peer, b.peer) && glob_covers(a.host, b.host) &&
           equal_covers(a.same_host, b.same_host) && equal_covers(a.local, b.local) &&
           equal_covers(a.remote, b.remote) && equal_covers(a.op, b.op) &&
           a.min_bytes.value_or(0) <= b.min_bytes.value_or(0) &&
           a.max_bytes.value_or(UINT64_MAX) >= b.max_bytes.value_or(UINT64_MAX);
  }

  static bool matches_everything(const PolicyRule& r) { return covers(r, PolicyRule{}); }

  static bool same_match(const PolicyRule& a, const PolicyRule& b) {
    return a.peer == b.peer && a.host == b.host && a.same_host == b.same_host &&
           a.local == b.local && a.remote == b.remote && a.min_bytes == b.min_bytes &&
           a.max_bytes == b.max_bytes && a.op == b.op;
  }

  void check_reachable(const std::vector<ParsedRule>& rules) {
    for (size_t j = 1; j < rules.size(); ++j) {
      for (size_t i = 0; i < j; ++i) {
        const PolicyRule& a = rules[i].rule;
        const PolicyRule& b = rules[j].rule;
        if (!covers(a, b)) continue;
        std::string why = matches_everything(a) ? "matches every transfer"
                          : same_match(a, b)    ? "has the same match"
                                                : "matches every transfer this one would";
        fail(rules[j].mark, "rule " + std::to_string(j + 1) + " can never match: rule " +
                                std::to_string(i + 1) + " at line " + std::to_string(a.line) + " " +
                                why);
      }
    }
  }

  // The same field under its dotted name: "'failover.quarantine.for'" reads
  // better than "'for'" in a message.
  static Field qualified(Field f, const std::string& prefix) {
    f.name = prefix + f.name;
    return f;
  }

  void parse_failover(const Field& f, Policy& p) {
    for (const auto& fe : entries("", f, &kFailoverKeys)) {
      Field e = qualified(fe, "failover.");
      if (fe.name == "max_attempts") {
        p.max_attempts = static_cast<uint32_t>(uint_value("", e, 1, kMaxAttempts));
        continue;
      }
      std::optional<Field> max_field;
      std::string for_text = format_duration(p.quarantine.period) + ", the default";
      for (const auto& qe : entries("", e, &kQuarantineKeys)) {
        Field q = qualified(qe, "failover.quarantine.");
        if (qe.name == "after_failures") {
          p.quarantine.after_failures =
              static_cast<uint32_t>(uint_value("", q, 1, std::numeric_limits<uint32_t>::max()));
        } else if (qe.name == "within") {
          p.quarantine.within = duration_value("", q);
        } else if (qe.name == "for") {
          p.quarantine.period = duration_value("", q);
          for_text = q.value.Scalar();
        } else {
          p.quarantine.max_period = duration_value("", q);
          max_field = q;
        }
      }
      if (p.quarantine.max_period < p.quarantine.period) {
        // Only an explicit max can contradict 'for'; the default just stretches.
        if (max_field)
          fail(max_field->where(), "'failover.quarantine.max' (" + max_field->value.Scalar() +
                                       ") is shorter than 'failover.quarantine.for' (" + for_text +
                                       ")");
        p.quarantine.max_period = p.quarantine.period;
      }
    }
  }

  // metadata: {etcd: [http://127.0.0.1:2379], namespace: ferry, lease: 10s}
  void parse_metadata(const Field& f, Policy& p) {
    for (const auto& fe : entries("", f, &kMetadataKeys)) {
      Field e = qualified(fe, "metadata.");
      if (fe.name == "etcd") {
        std::vector<std::string> eps;
        if (e.value.IsScalar()) {
          eps.push_back(string_value("", e, "an endpoint URL or a list of them"));
        } else if (e.value.IsSequence()) {
          for (const auto& item : e.value)
            eps.push_back(string_value("", Field{e.name, e.key_mark, item}, "an endpoint URL"));
        } else {
          wrong_type("", e, "a list of endpoint URLs such as [http://127.0.0.1:2379]");
        }
        for (const auto& ep : eps)
          if (ep.rfind("http://", 0) != 0 && ep.rfind("https://", 0) != 0)
            fail(e.where(),
                 "'metadata.etcd' endpoint '" + ep + "' must start with http:// or https://");
        p.metadata.etcd = std::move(eps);
      } else if (fe.name == "namespace") {
        p.metadata.ns = string_value("", e, "a key prefix such as ferry");
      } else {
        p.metadata.lease = duration_value("", e);
        if (p.metadata.lease < std::chrono::seconds(2))
          fail(e.where(), "'metadata.lease' must be at least 2s (etcd's minimum TTL)");
      }
    }
  }

  const std::string& source_;
};

Policy Parser::parse(const std::string& text) {
  std::vector<YAML::Node> docs;
  try {
    std::istringstream in(text);
    YAML::Parser events(in);
    EventBudget budget(8 * text.size() + 1024);
    while (events.HandleNextDocument(budget)) {
    }
    docs = YAML::LoadAll(text);
  } catch (const EventBudget::Exhausted& e) {
    fail(e.mark, "YAML syntax error: the parser makes no progress here (a stray ','?)");
  } catch (const YAML::DeepRecursion& e) {
    // yaml-cpp's own message for this is "bad file".
    fail(e.mark, "YAML nested too deeply");
  } catch (const YAML::Exception& e) {
    std::string hint;
    // A bare * starts a YAML alias; the wildcard backend has to be quoted.
    if (e.msg.find("alias") != std::string::npos)
      hint = " (write \"*\" in quotes for 'every other backend')";
    fail(e.mark, "YAML syntax error: " + e.msg + hint);
  }
  Policy p = builtin_policy();
  p.source = source_;
  if (docs.empty() || docs[0].IsNull()) {
    if (docs.size() > 1)
      fail(docs[1].Mark(), "more than one YAML document; a policy is a single document");
    return p;
  }
  if (docs.size() > 1)
    fail(docs[1].Mark(), "more than one YAML document; a policy is a single document");
  const YAML::Node& root = docs[0];
  if (!root.IsMap())
    fail(root.Mark(),
         "a policy must be a mapping with keys such as 'rules:' and 'backends:', got " +
             describe(root));

  std::map<std::string, Field> top;
  for (auto& f : entries("", Field{"policy", {}, root}, &kTopKeys)) top.emplace(f.name, f);

  // backends: first, because prefer lists may name the backends it declares.
  if (auto it = top.find("plugin_dirs"); it != top.end())
    p.plugin_dirs = parse_plugin_dirs(it->second);
  if (auto it = top.find("backends"); it != top.end()) {
    if (!it->second.value.IsNull()) p.backend_settings = parse_backends(it->second);
  }
  std::vector<std::string> known = {"tcp", "rdma", "ofi", "xgmi"};
  for (const auto& [name, settings] : p.backend_settings)
    if (std::find(known.begin(), known.end(), name) == known.end()) known.push_back(name);
  if (auto it = top.find("rules"); it != top.end()) {
    auto parsed = parse_rules(it->second, known);
    check_reachable(parsed);
    p.rules.clear();
    for (auto& r : parsed) p.rules.push_back(std::move(r.rule));
  }
  if (auto it = top.find("failover"); it != top.end()) parse_failover(it->second, p);
  if (auto it = top.find("timeout"); it != top.end()) p.timeout = duration_value("", it->second);
  if (auto it = top.find("notify"); it != top.end()) p.notify = bool_value("", it->second);
  if (auto it = top.find("metadata"); it != top.end()) parse_metadata(it->second, p);
  return p;
}

}  // namespace

Policy parse_policy(const std::string& yaml_text, const std::string& source_name) {
  Parser parser(source_name);
  try {
    return parser.parse(yaml_text);
  } catch (const YAML::Exception& e) {
    // Node accessors should not throw after the checks above; if one does, the
    // caller still gets a positioned ferry::Error rather than a yaml-cpp type.
    int line = e.mark.line >= 0 ? e.mark.line + 1 : 1;
    int col = e.mark.column >= 0 ? e.mark.column + 1 : 1;
    throw Error(StatusCode::ERR_INVALID_ARGS, source_name + ":" + std::to_string(line) + ":" +
                                                  std::to_string(col) + ": " + e.msg);
  }
}

Policy load_policy_file(const std::string& path) {
  auto cannot = [&](int err) {
    return Error(StatusCode::ERR_INVALID_ARGS,
                 "cannot read policy file '" + path + "': " + std::generic_category().message(err));
  };
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) throw cannot(errno);
  std::string text;
  char buf[4096];
  for (;;) {
    size_t n = std::fread(buf, 1, sizeof buf, f.get());
    text.append(buf, n);
    if (text.size() > kMaxPolicyBytes)
      throw Error(StatusCode::ERR_INVALID_ARGS,
                  "policy file '" + path + "' is larger than 1 MiB; is it the right file?");
    if (n < sizeof buf) break;
  }
  // A folder opens fine and fails on the first read (EISDIR).
  if (std::ferror(f.get())) throw cannot(errno);
  return parse_policy(text, path);
}

}  // namespace ferry
