// SPDX-License-Identifier: Apache-2.0
#include "engine_rules.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "bench_target.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "line_channel.h"
#include "pattern.h"
#include "segment.h"

namespace ferry::plugin_check {
namespace {

using namespace std::chrono_literals;
using bench::LineChannel;
using bench::Segment;
using bench::SegType;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kRegion = 96 * kMiB;   // room for 64 MiB + 1 and the sub-regions
constexpr uint64_t kSubA = 80 * kMiB;     // revocation
constexpr uint64_t kSubB = 84 * kMiB;     // bounds: registered 1 MiB, guard after it
constexpr uint64_t kScratch = 90 * kMiB;  // the stopped-target rules
const char* const kInitiatorKey = "check-initiator";

// The policy both engines run: the plugin alone, trusted where it says it
// cannot check requests on the target side (plugin.h, NO_TARGET_CHECK).
std::string write_policy(const PluginFacts& f) {
  char path[] = "/tmp/ferry-plugin-check-XXXXXX";
  int fd = ::mkstemp(path);
  if (fd < 0) return {};
  ::close(fd);
  std::ofstream out(path);
  // Listed under backends: so a rule may name a plugin the core does not know.
  out << "backends:\n  " << f.name << ": {}\nrules:\n  - prefer: [" << f.name << "]\n";
  if (f.caps & FERRY_CAP_NO_TARGET_CHECK) out << "    trust_descriptors: true\n";
  return path;
}

// The target engine in a process of its own, started with exec.
class Target {
 public:
  ~Target() { stop(); }
  bool start(const EngineRuleOptions& o, const PluginFacts& f, const std::string& policy,
             std::string* why) {
    int cmd[2], ans[2];
    if (::pipe(cmd) != 0 || ::pipe(ans) != 0) {
      *why = "pipe failed";
      return false;
    }
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      // The target dies with the check, also while it is stopped (the
      // stopped-target rule): a killed check leaves no engine behind.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::dup2(cmd[0], 3);
      ::dup2(ans[1], 4);
      for (int fd : {cmd[0], cmd[1], ans[0], ans[1]})
        if (fd > 4) ::close(fd);
      std::vector<std::string> args = {o.self_exe,      "--serve-target", f.name, "--settings",
                                       o.settings_json, "--policy",       policy};
      if (o.gpu) args.push_back("--gpu");
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(o.self_exe.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(cmd[0]);
    ::close(ans[1]);
    to_ = cmd[1];
    from_ = ans[0];
    ch_ = std::make_unique<LineChannel>(from_, to_);
    std::string ready;
    if (pid_ < 0 || !ch_->recv(ready, 120000) || ready.rfind("READY ", 0) != 0) {
      *why = "the target did not start: " + (ready.empty() ? std::string("no answer") : ready);
      return false;
    }
    std::istringstream in(ready.substr(6));
    std::string e, m;
    in >> e >> m;
    desc = EngineDesc::unpack(test::from_hex(e));
    mem = MemoryDesc::unpack(test::from_hex(m));
    return true;
  }
  std::string ask(const std::string& line, int timeout_ms = 120000) {
    return ch_ ? ch_->ask(line, timeout_ms) : "ERR no target";
  }
  uint64_t hash(uint64_t off, uint64_t len) {
    auto a = ask("hash 1 " + std::to_string(off) + " " + std::to_string(len));
    return a.rfind("HASH ", 0) == 0 ? std::stoull(a.substr(5)) : 0;
  }
  bool signal(int sig) { return pid_ > 0 && ::kill(pid_, sig) == 0; }
  pid_t pid() const { return pid_; }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGCONT);
    if (ch_) ch_->ask("quit", 10000);
    ::close(to_);
    ::close(from_);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }

  EngineDesc desc;
  MemoryDesc mem;

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::unique_ptr<LineChannel> ch_;
};

std::string code_text(const TransferStatus& s) {
  std::string m = s.Message();
  return std::string(to_string(s.Code())) + (m.empty() ? "" : " (" + m.substr(0, 160) + ")");
}

std::string size_text(uint64_t n) {
  if (n == 64 * kMiB + 1) return "64MiB+1";
  if (n >= kMiB && n % kMiB == 0) return std::to_string(n / kMiB) + "MiB";
  if (n >= 1024 && n % 1024 == 0) return std::to_string(n / 1024) + "KiB";
  return std::to_string(n) + "B";
}

// utime + stime, in seconds, from a /proc/.../stat file.
double stat_cpu_seconds(const std::string& path) {
  std::ifstream in(path);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto close = s.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream f(s.substr(close + 2));
  std::string skip;
  for (int i = 0; i < 11; ++i) f >> skip;  // state .. cmajflt
  unsigned long long ut = 0, st = 0;
  f >> ut >> st;
  return static_cast<double>(ut + st) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// CPU seconds of a process.
double cpu_seconds(pid_t pid) { return stat_cpu_seconds("/proc/" + std::to_string(pid) + "/stat"); }

// CPU seconds of this process but the calling thread: the engine's threads
// (those that ended too: the process's count keeps them), not the checker
// measuring them (whose own reads of /proc cost whole clock ticks in an
// emulated CPU).
double engine_cpu_seconds() {
  return cpu_seconds(::getpid()) - stat_cpu_seconds("/proc/thread-self/stat");
}

class Checker {
 public:
  Checker(const PluginFacts& f, const EngineRuleOptions& o, Report& r) : f_(f), o_(o), r_(r) {}

  void run() {
    policy_ = write_policy(f_);
    if (policy_.empty()) return r_.fail("engine: setup", "cannot write a policy file in /tmp");
    settings_rules();
    std::string why;
    if (!setup(&why)) {
      r_.fail("engine: two engines connected", why);
    } else {
      r_.pass("engine: two engines connected",
              "target pid " + std::to_string(t_.pid()) + ", " + (o_.gpu ? "VRAM" : "DRAM"));
      data_rules();
      cancel_rule();
      notify_rules();
      revocation_rule();
      bounds_rule();
      live_info_rule();
      idle_cpu_rule();
      peer_removal_rule();
      stopped_target_rules();
      completion_rule();
    }
    engine_.reset();
    t_.stop();
    ::unlink(policy_.c_str());
  }

 private:
  EngineConfig config(std::chrono::milliseconds timeout) const {
    EngineConfig c;
    c.policy_file = policy_;
    c.timeout = timeout;
    return c;
  }

  // init() must refuse what it does not understand, with a reason.
  void settings_rules() {
    try {
      Engine scratch("check-settings", config(o_.timeout));
      auto bad = scratch.add_backend(f_.name, R"({"ferry_plugin_check_no_such_key":1})");
      r_.check(!bad && !bad.message.empty(), "settings: unknown key refused",
               bad ? "accepted" : bad.message.substr(0, 160));
      auto arr = scratch.add_backend(f_.name, "[1,2]");
      r_.check(!arr, "settings: non-object refused", arr ? "accepted" : arr.message.substr(0, 160));
    } catch (const Error& e) {
      r_.fail("settings: unknown key refused", std::string("engine: ") + e.what());
    }
  }

  bool setup(std::string* why) {
    if (!t_.start(o_, f_, policy_, why)) return false;
    try {
      engine_ = std::make_unique<Engine>(kInitiatorKey, config(o_.timeout));
    } catch (const Error& e) {
      *why = e.what();
      return false;
    }
    if (auto a = engine_->add_backend(f_.name, o_.settings_json); !a) {
      *why = "add_backend: " + a.message;
      return false;
    }
    seg_ = Segment::allocate(o_.gpu ? SegType::VRAM : SegType::DRAM, o_.gpu ? 0 : -1, kRegion, why);
    if (!seg_) return false;
    try {
      local_ = engine_->register_memory(seg_->data(), seg_->size(), seg_->registration_device(),
                                        seg_->location());
    } catch (const Error& e) {
      *why = std::string("register_memory: ") + e.what();
      return false;
    }
    if (auto a = engine_->register_remote_engine(t_.desc); !a) {
      *why = "register_remote_engine: " + a.message;
      return false;
    }
    auto a = t_.ask("register " + test::to_hex(engine_->desc().pack()));
    if (a != "OK") {
      *why = "the target registering this engine: " + a;
      return false;
    }
    return true;
  }

  uint64_t local_hash(uint64_t off, uint64_t len) const {
    return seg_->fnv1a(off, len, test::kFnvBasis);
  }
  bool fill_target(uint64_t off, uint64_t len, uint64_t seed) {
    return t_.ask("fill " + std::to_string(seed) + " 1 " + std::to_string(off) + " " +
                  std::to_string(len)) == "OK";
  }
  bool ended(const TransferStatus& s) const { return s.WaitFor(o_.timeout + 10s); }

  // One transfer, checked byte for byte through both sides' hashes.
  void one(Op op, uint64_t size) {
    const std::string rule =
        std::string("data: ") + (op == Op::WRITE ? "WRITE " : "READ ") + size_text(size);
    const uint64_t seed = ++seed_;
    if (op == Op::WRITE)
      seg_->fill_pattern(0, size, seed);
    else if (!fill_target(0, size, seed))
      return r_.fail(rule, "the target could not fill its region");
    auto s = op == Op::WRITE ? engine_->write(local_, 0, t_.mem, 0, size, ++uid_, false)
                             : engine_->read(local_, 0, t_.mem, 0, size, ++uid_, false);
    if (!ended(s)) return r_.fail(rule, "did not end within the timeout + 10 s");
    if (!s.Succeeded()) return r_.fail(rule, code_text(s));
    r_.check(local_hash(0, size) == t_.hash(0, size), rule, "verified");
  }

  // 64 scattered 4 KiB pieces, in a different order on each side.
  void batch(Op op) {
    const std::string rule =
        std::string("data: batch ") + (op == Op::WRITE ? "WRITE" : "READ") + " 64 x 4KiB scattered";
    std::vector<size_t> lo, ro, sz;
    for (size_t i = 0; i < 64; ++i) {
      lo.push_back(i * 3 * 4096);
      ro.push_back((63 - i) * 5 * 4096 + 1);
      sz.push_back(4096);
    }
    const uint64_t seed = ++seed_;
    if (op == Op::WRITE)
      seg_->fill_pattern(0, 64 * 3 * 4096, seed);
    else if (!fill_target(0, 64 * 5 * 4096 + 1, seed))
      return r_.fail(rule, "the target could not fill its region");
    auto s = op == Op::WRITE ? engine_->batch_write(local_, lo, t_.mem, ro, sz, ++uid_, false)
                             : engine_->batch_read(local_, lo, t_.mem, ro, sz, ++uid_, false);
    if (!ended(s)) return r_.fail(rule, "did not end within the timeout + 10 s");
    if (!s.Succeeded()) return r_.fail(rule, code_text(s));
    for (size_t i = 0; i < 64; ++i)
      if (local_hash(lo[i], 4096) != t_.hash(ro[i], 4096))
        return r_.fail(rule, "piece " + std::to_string(i) + " differs");
    r_.pass(rule, "verified");
  }

  // One call over 4 region pairs (4 slices of our memory, the target's one
  // region), 16 scattered 4 KiB pieces each, every byte verified. A plugin
  // that claims FERRY_CAP_MULTI_PAIR (ABI 1.7) gets it as one transfer - one
  // post over every pair - the others one transfer per pair.
  void multi_region(Op op) {
    const std::string rule = std::string("data: one call over 4 region pairs, ") +
                             (op == Op::WRITE ? "WRITE" : "READ") +
                             ((f_.caps & FERRY_CAP_MULTI_PAIR) ? " (one multi-pair post)" : "");
    constexpr size_t kPairs = 4, kPer = 16, kPiece = 4096, kSlice = 1 << 20;
    std::vector<MemoryDesc> slices;
    try {
      for (size_t p = 0; p < kPairs; ++p)
        slices.push_back(engine_->register_memory(seg_->data() + p * kSlice, kSlice,
                                                  seg_->registration_device(), seg_->location()));
    } catch (const Error& e) {
      return r_.fail(rule, std::string("register_memory of a slice: ") + e.what());
    }
    std::vector<TransferItem> items;
    for (size_t p = 0; p < kPairs; ++p)
      for (size_t i = 0; i < kPer; ++i)
        items.push_back({p, ((i * 5) % kPer) * 2 * kPiece, 0,
                         (((kPairs - p) * kPer + i) * 3) * kPiece + 7, kPiece});
    const uint64_t seed = ++seed_;
    if (op == Op::WRITE)
      seg_->fill_pattern(0, kPairs * kSlice, seed);
    else if (!fill_target(0, (2 * kPairs * kPer * 3 + 3) * kPiece, seed))
      return r_.fail(rule, "the target could not fill its region");
    const auto before = engine_->stats().backends[f_.name].transfers;
    auto s = engine_->transfer(op, slices, {t_.mem}, items, ++uid_, false);
    std::string why;
    if (!ended(s)) {
      why = "did not end within the timeout + 10 s";
    } else if (!s.Succeeded()) {
      why = code_text(s);
    } else {
      for (size_t i = 0; i < items.size() && why.empty(); ++i)
        if (local_hash(items[i].local * kSlice + items[i].local_offset, kPiece) !=
            t_.hash(items[i].remote_offset, kPiece))
          why = "piece " + std::to_string(i) + " differs";
      const auto n = engine_->stats().backends[f_.name].transfers - before;
      const uint64_t want = (f_.caps & FERRY_CAP_MULTI_PAIR) ? 1 : kPairs;
      if (why.empty() && n != want)
        why = std::to_string(n) + " transfers counted, expected " + std::to_string(want);
    }
    for (const auto& m : slices) engine_->deregister_memory(m);
    r_.check(why.empty(), rule, why.empty() ? "verified" : why);
  }

  void data_rules() {
    std::vector<uint64_t> sizes = {1, 4096, kMiB};
    if (!o_.quick) sizes.push_back(64 * kMiB + 1);
    const bool w = f_.caps & FERRY_CAP_OP_WRITE, rd = f_.caps & FERRY_CAP_OP_READ;
    for (uint64_t n : sizes) {
      if (w) one(Op::WRITE, n);
      if (rd) one(Op::READ, n);
    }
    if (w) batch(Op::WRITE);
    if (rd) batch(Op::READ);
    if (w) multi_region(Op::WRITE);
    if (rd) multi_region(Op::READ);
    const auto st = engine_->stats();
    auto it = st.backends.find(f_.name);
    r_.check(it != st.backends.end() && it->second.transfers > 0 && it->second.failovers == 0,
             "route: transfers went through " + f_.name,
             it == st.backends.end() ? "no transfers counted"
                                     : std::to_string(it->second.transfers) + " transfers, " +
                                           std::to_string(it->second.bytes) + " bytes");
  }

  // A cancel ends its own transfer only: WRITEs in flight beside it - on the
  // same connections, lanes or QPs - end as if it had not been made. A round:
  // a 16 MiB WRITE, seven 1 MiB ones behind it, then the first is cancelled
  // (its bytes are moving now, the others' queued behind them). It ends
  // ERR_CANCELLED or (the cancel too late) SUCCESS, verified then.
  void cancel_rule() {
    const std::string rule = "cancel: the other transfers in flight go on";
    if (!(f_.caps & FERRY_CAP_OP_WRITE)) return r_.skip(rule, "no WRITE");
    constexpr size_t kN = 8, kVictim = 0, kRounds = 4;
    constexpr uint64_t kVictimBytes = 16 * kMiB, kVictimAt = 8 * kMiB;
    auto off = [](size_t i) { return i == kVictim ? kVictimAt : i * kMiB; };
    auto len = [](size_t i) { return i == kVictim ? kVictimBytes : kMiB; };
    int cancelled = 0;
    for (size_t round = 0; round < kRounds; ++round) {
      seg_->fill_pattern(0, kVictimAt + kVictimBytes, ++seed_);
      std::vector<TransferStatus> st;
      for (size_t i = 0; i < kN; ++i)
        st.push_back(engine_->write(local_, off(i), t_.mem, off(i), len(i), ++uid_, false));
      st[kVictim].Cancel();
      for (size_t i = 0; i < kN; ++i) {
        const std::string which = "round " + std::to_string(round) + ", WRITE " + std::to_string(i);
        if (!ended(st[i])) return r_.fail(rule, which + " did not end within the timeout + 10 s");
        if (i == kVictim && st[i].Code() == StatusCode::ERR_CANCELLED) {
          ++cancelled;
          continue;
        }
        if (!st[i].Succeeded())
          return r_.fail(
              rule, which + (i == kVictim ? " (the cancelled one)" : "") + ": " + code_text(st[i]));
        if (local_hash(off(i), len(i)) != t_.hash(off(i), len(i)))
          return r_.fail(rule, which + " succeeded but its bytes differ");
      }
    }
    r_.pass(rule, std::to_string(kN - 1) + " x " + std::to_string(kRounds) +
                      " WRITEs beside a cancelled one verified; the cancel took effect " +
                      std::to_string(cancelled) + " of " + std::to_string(kRounds) + " times");
  }

  // The target learns of a notify transfer exactly once, and of a message once.
  void notify_rules() {
    const Op op = (f_.caps & FERRY_CAP_OP_WRITE) ? Op::WRITE : Op::READ;
    const uint64_t uid = ++uid_;
    auto s = op == Op::WRITE ? engine_->write(local_, 0, t_.mem, 0, 4096, uid, true)
                             : engine_->read(local_, 0, t_.mem, 0, 4096, uid, true);
    const std::string how = (f_.caps & FERRY_CAP_NATIVE_NOTIFY) ? "native" : "by the core";
    if (!ended(s) || !s.Succeeded()) {
      r_.fail("notify: exactly once (" + how + ")", "the transfer: " + code_text(s));
    } else {
      const std::string pop = "pop " + std::string(kInitiatorKey) + " " + std::to_string(uid);
      const auto first = t_.ask(pop + " 10000");
      const auto again = t_.ask(pop + " 500");
      r_.check(first == "INBOUND SUCCESS" && again == "NONE", "notify: exactly once (" + how + ")",
               "first pop: " + first + ", second: " + again);
    }
    auto m = op == Op::WRITE
                 ? engine_->write(local_, 0, t_.mem, 0, 4096, ++uid_, false, "plugin-check")
                 : engine_->read(local_, 0, t_.mem, 0, 4096, ++uid_, false, "plugin-check");
    if (!ended(m) || !m.Succeeded()) return r_.fail("notify: message once", code_text(m));
    const auto got = t_.ask("notifs 10000");
    const auto more = t_.ask("notifs 300");
    r_.check(got.rfind("NOTIFS 1 ", 0) == 0 && more == "NOTIFS 0", "notify: message once",
             got.substr(0, 60) + " then " + more);
  }

  // The target-side rules apply to a plugin that checks there and can WRITE:
  // 1 MiB of the target's region at `off` as a region of its own, or a verdict.
  std::optional<MemoryDesc> target_subregion(const std::string& rule, uint64_t off) {
    if (f_.caps & FERRY_CAP_NO_TARGET_CHECK) {
      r_.skip(rule, "the plugin declares NO_TARGET_CHECK (trusted descriptors only)");
    } else if (!(f_.caps & FERRY_CAP_OP_WRITE)) {
      r_.skip(rule, "no WRITE");
    } else if (auto a = t_.ask("subregion " + std::to_string(off) + " " + std::to_string(kMiB));
               a.rfind("MEM ", 0) != 0) {
      r_.fail(rule, "subregion: " + a);
    } else {
      return MemoryDesc::unpack(test::from_hex(a.substr(4)));
    }
    return std::nullopt;
  }

  // After the target deregisters a region, a request for it changes nothing.
  void revocation_rule() {
    const std::string rule = "target: deregistered region not written";
    const auto maybe = target_subregion(rule, kSubA);
    if (!maybe) return;
    const MemoryDesc& sub = *maybe;
    seg_->fill_pattern(0, kMiB, ++seed_);
    auto s = engine_->write(local_, 0, sub, 0, kMiB, ++uid_, false);
    if (!ended(s) || !s.Succeeded()) return r_.fail(rule, "before: " + code_text(s));
    const uint64_t before = t_.hash(kSubA, kMiB);
    if (auto d = t_.ask("dropsub 0"); d != "OK") return r_.fail(rule, "dropsub: " + d);
    seg_->fill_pattern(0, kMiB, ++seed_);
    auto late = engine_->write(local_, 0, sub, 0, kMiB, ++uid_, false);
    if (!ended(late)) return r_.fail(rule, "did not end within the timeout + 10 s");
    const uint64_t after = t_.hash(kSubA, kMiB);
    r_.check(!late.Succeeded() && after == before, rule,
             std::string(late.Succeeded() ? "the WRITE succeeded" : code_text(late)) +
                 (after == before ? ", bytes unchanged" : ", BYTES CHANGED"));
  }

  // A descriptor claiming more than was registered: the target refuses.
  void bounds_rule() {
    const std::string rule = "target: out-of-bounds request not applied";
    auto maybe = target_subregion(rule, kSubB);
    if (!maybe) return;
    MemoryDesc forged = *maybe;
    forged.size = 2 * kMiB;  // the initiator's core checks against this
    const uint64_t guard = t_.hash(kSubB + kMiB, 64 * 1024);
    seg_->fill_pattern(0, 64 * 1024, ++seed_);
    auto s = engine_->write(local_, 0, forged, kMiB, 64 * 1024, ++uid_, false);
    if (!ended(s)) return r_.fail(rule, "did not end within the timeout + 10 s");
    const bool same = t_.hash(kSubB + kMiB, 64 * 1024) == guard;
    r_.check(
        !s.Succeeded() && same, rule,
        std::string(s.Succeeded() ? "the WRITE succeeded" : code_text(s)) +
            (same ? ", bytes after the region unchanged" : ", BYTES AFTER THE REGION CHANGED"));
  }

  // complete() exactly once per accepted transfer (plugin.h): every call the
  // core could not match to a transfer the plugin held - a second completion,
  // or a context it was never given - was counted over all the rules above.
  void completion_rule() {
    const auto st = engine_->stats();
    auto it = st.backends.find(f_.name);
    if (it == st.backends.end())
      return r_.fail("complete: exactly once per transfer", "no backend");
    r_.check(it->second.stray_completions == 0, "complete: exactly once per transfer",
             it->second.stray_completions == 0
                 ? "no stray complete()"
                 : std::to_string(it->second.stray_completions) +
                       " complete() call(s) for no transfer the plugin held (a second "
                       "completion, or a context it was never given)");
  }

  // ABI 1.5: what the live instance says reaches Engine::stats().
  void live_info_rule() {
    const auto st = engine_->stats();
    auto it = st.backends.find(f_.name);
    if (it == st.backends.end()) return r_.fail("stats: live describe/counters", "no backend");
    if (f_.has_describe)
      r_.check(!it->second.detail.empty(), "stats: live describe()",
               it->second.detail.substr(0, 100));
    else
      r_.skip("stats: live describe()", "no describe()");
    if (f_.has_counters) {
      std::string kv;
      for (const auto& [k, v] : it->second.plugin) kv += k + "=" + std::to_string(v) + " ";
      r_.check(!it->second.plugin.empty(), "stats: live counters()",
               kv.empty() ? "none kept (check plugin.h's rules for counters())" : kv);
    } else {
      r_.skip("stats: live counters()", "no counters() (ABI 1.5, optional)");
    }
  }

  // An idle engine pair costs no CPU: both engines over two seconds (a clock
  // tick is 0.5% of that).
  void idle_cpu_rule() {
    const double me0 = engine_cpu_seconds(), t0 = cpu_seconds(t_.pid());
    const auto w0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(2s);  // measuring an interval, not ordering events
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
    const double me = std::max(0.0, engine_cpu_seconds() - me0) / secs,
                 t = (cpu_seconds(t_.pid()) - t0) / secs;
    char d[96];
    std::snprintf(d, sizeof d, "initiator %.1f%%, target %.1f%% of a core", 100 * me, 100 * t);
    r_.check(me < 0.05 && t < 0.05, "idle: no CPU when nothing moves", d);
  }

  // peer_remove with transfers in flight: every one ends, none hangs; the peer
  // is usable again once registered again.
  void peer_removal_rule() {
    const std::string rule = "peer: deregistered with transfers in flight";
    const Op op = (f_.caps & FERRY_CAP_OP_WRITE) ? Op::WRITE : Op::READ;
    std::vector<TransferStatus> st;
    for (int i = 0; i < 16; ++i)
      st.push_back(op == Op::WRITE ? engine_->write(local_, 0, t_.mem, 0, 4 * kMiB, ++uid_, false)
                                   : engine_->read(local_, 0, t_.mem, 0, 4 * kMiB, ++uid_, false));
    auto d = engine_->deregister_remote_engine(t_.desc.key);
    const bool all = wait_all(st, o_.timeout + 10s);
    int ok = 0;
    for (auto& s : st) ok += s.Succeeded();
    if (!r_.check(d && all, rule,
                  !d    ? "deregister: " + d.message
                  : all ? std::to_string(ok) + " of 16 landed, the rest failed"
                        : "a transfer did not end within the timeout + 10 s"))
      return;
    auto again = engine_->register_remote_engine(t_.desc);
    seg_->fill_pattern(0, kMiB, ++seed_);
    auto s = op == Op::WRITE ? engine_->write(local_, 0, t_.mem, 0, kMiB, ++uid_, false)
                             : engine_->read(local_, 0, t_.mem, 0, kMiB, ++uid_, false);
    const bool done = ended(s);
    const bool same = done && s.Succeeded() && local_hash(0, kMiB) == t_.hash(0, kMiB);
    r_.check(again && same, "peer: usable again after registering it again",
             !again ? "register: " + again.message
                    : code_text(s) + (same   ? ", verified"
                                      : done ? ", data differs"
                                             : ""));
  }

  // A stopped target: the transfer ends by its deadline, and an attempt the
  // core reports as not landed lands nothing after the target resumes.
  void stopped_target_rules() {
    const std::string rule = "deadline: stopped target";
    if (!(f_.caps & FERRY_CAP_OP_WRITE)) return r_.skip(rule, "no WRITE");
    const auto deadline = 1500ms;
    std::unique_ptr<Engine> e;
    MemoryDesc local;
    try {
      e = std::make_unique<Engine>("check-deadline", config(deadline));
      if (auto a = e->add_backend(f_.name, o_.settings_json); !a) return r_.fail(rule, a.message);
      local = e->register_memory(seg_->data(), seg_->size(), seg_->registration_device(),
                                 seg_->location());
      if (auto a = e->register_remote_engine(t_.desc); !a) return r_.fail(rule, a.message);
    } catch (const Error& x) {
      return r_.fail(rule, x.what());
    }
    if (!fill_target(kScratch, kMiB, ++seed_)) return r_.fail(rule, "fill");
    const uint64_t before = t_.hash(kScratch, kMiB);
    seg_->fill_pattern(0, kMiB, ++seed_);
    if (!t_.signal(SIGSTOP)) return r_.fail(rule, "cannot stop the target");
    const auto t0 = std::chrono::steady_clock::now();
    auto s = e->write(local, 0, t_.mem, kScratch, kMiB, ++uid_, false);
    const bool done = s.WaitFor(deadline + 10s);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    t_.signal(SIGCONT);
    if (!done) return r_.fail(rule, "still running " + std::to_string(ms) + " ms later");
    // Two round trips through the resumed target, then its bytes.
    t_.ask("stats");
    t_.ask("stats");
    const uint64_t after = t_.hash(kScratch, kMiB);
    const bool in_time = ms <= deadline.count() + 3000;
    const std::string when = " after " + std::to_string(ms) + " ms (deadline " +
                             std::to_string(deadline.count()) + " ms)";
    if (s.Succeeded()) {
      // Allowed (an initiator-side copy needs no running target), when it is true.
      const bool landed = after == local_hash(0, kMiB);
      r_.check(
          in_time && landed, rule,
          std::string(landed ? "SUCCESS, the bytes are there" : "SUCCESS, BYTES MISSING") + when);
    } else {
      r_.check(in_time, rule, code_text(s) + when);
    }
    const std::string fence = "fence: a failed WRITE lands nothing later";
    if (s.Succeeded()) {
      r_.skip(fence, "the WRITE succeeded");
    } else if (s.Code() == StatusCode::ERR_OUTCOME_UNKNOWN) {
      r_.pass(fence, "outcome unknown: the core keeps the peer fenced (plugin.h, FENCE)");
    } else {
      r_.check(after == before, fence,
               code_text(s) + (after == before ? ", target bytes unchanged" : ", BYTES LANDED"));
    }
  }

  const PluginFacts& f_;
  const EngineRuleOptions& o_;
  Report& r_;
  std::string policy_;
  Target t_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Segment> seg_;
  MemoryDesc local_;
  uint64_t seed_ = 1000, uid_ = 1;
};

}  // namespace

void run_engine_rules(const PluginFacts& facts, const EngineRuleOptions& o, Report& r) {
  Checker(facts, o, r).run();
}

int serve_target(const std::string& plugin, const std::string& settings_json, bool gpu,
                 const std::string& policy_file) {
  bench::TargetOptions t;
  t.key = "check-target";
  t.backends = {plugin};
  t.backend_settings[plugin] = settings_json;
  t.region_bytes = kRegion;
  t.policy_file = policy_file;
  t.seg_type = gpu ? SegType::VRAM : SegType::DRAM;
  t.device = gpu ? 0 : -1;
  return bench::run_target(t, 3, 4);
}

}  // namespace ferry::plugin_check
