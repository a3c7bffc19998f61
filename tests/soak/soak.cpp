// SPDX-License-Identifier: Apache-2.0
// ferry-soak (issue 9 item 6): minutes of random, seeded transfers between this
// process (the initiator engine "soak-init") and --procs target processes
// (ferry-test-peer, started with fork+exec), with periodic target restarts under
// the same engine key, every byte verified, and the RSS / fd / thread counts of
// every long-lived process sampled over time; they must plateau.
//
// Processes: target t0 (the first --stable targets) is never restarted, so the
// target side is checked for leaks too; the others are restarted every
// --restart-every seconds (staggered) while transfers to them are in flight, in
// turn by SIGKILL, by "quit" (the target destroys its engine and exits), and by
// an overlapping start (the new incarnation is registered while the old one
// still runs with transfers in flight, then the old one is killed). The new
// incarnation has the same key; the initiator calls register_remote_engine()
// again (the core drops the old peer and its imports, engine.cpp) and makes a
// new Session; the old Session must report !alive() and fail at once.
//
// The local region is also deregistered and registered again every 64 windows.
//
// One worker thread per target runs windows of 1..--depth concurrent transfers
// (READ or WRITE; Engine calls, the target's long-lived Session, or a Session
// made for that one transfer; single calls or batches of 1..--max-batch items
// of 1 B .. --max-item bytes, log-uniform, at random offsets in the transfer's
// own slot of both regions). Verification, per window:
//   WRITE  the local ranges hold pattern(window seed, local offset); the target
//          hashes its ranges (FNV-1a over every byte) and the hash must match;
//   READ   the target fills its ranges with pattern(window seed, remote offset)
//          first; the local ranges are poisoned with the complement of the
//          expected bytes and every byte is compared afterwards;
//   notify a sample of transfers asks for a notification: the target must pop
//          "INBOUND SUCCESS" for it; a sample of the others must pop NONE.
// Peer re-registration (--reregister-peer-every N): every N windows of a target
// it is deregistered with a window in flight and the same engine registered
// again; that window may fail, the windows after it must verify.
// Cancels (--cancel-every N): in ordinary windows one transfer in N is cancelled
// right after its submission or after later ones of its window (its siblings in
// flight on the same lanes); it ends ERR_CANCELLED (bytes not verified, the
// target told nothing) or SUCCESS (verified as any), and its siblings must
// succeed as ever.
// Every fourth fault is a SIGSTOP longer than the deadline instead (stop_window):
// transfers in flight end by their deadline (WRITEs ERR_OUTCOME_UNKNOWN when the
// fence cannot be answered), the peer stays fenced until SIGCONT, and the windows
// after it verify every byte, so a stale WRITE landing late would show.
// Any failed transfer or mismatch outside a restart window fails the soak. In a
// restart window (transfers in flight when the target is stopped, and a few
// posted while it is down) a transfer may fail, but it must end within the
// deadline (timeout + the core's 1 s watchdog grace + slack) with a message;
// those are counted apart. READs of that window that succeed are verified;
// WRITEs that succeed cannot be (the target is gone) and are counted apart.
//
// A sampler takes VmRSS, the fd count and the thread count of every process
// every --sample-every seconds (table on stdout, CSV with --report); the plateau
// rule and its bounds are explained above the check in main().
//
// Mixed backends and link faults: --backend tcp,cma ranks tcp first and fails
// over to cma. Run inside tests/netns/netns_pair.sh (--same-node --ctrl-link),
// the targets live in the other namespace, tcp crosses a veth link and the
// control plane another; --link-down-every takes the data link down for 1.3
// deadlines under every target at once while the workers go on: tcp attempts
// time out (WRITEs are fenced over the control link) and cma carries the
// transfer, so windows that overlap it must still succeed and verify.
//
// --seed reproduces the op stream of every worker (sizes, offsets, ops, paths);
// where the restarts fall in it depends on timing.
#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// ---- options --------------------------------------------------------------------

struct Options {
  double duration_s = 60;
  double restart_every_s = 10;   // 0: no restarts
  int procs = 3;                 // target processes
  int stable = 1;                // of which never restarted
  std::string backend = "tcp";   // or a ranked list: "tcp,cma"
  double link_down_every_s = 0;  // netns only: the data link goes down this often
  int link_settle_ms = 6000;     // after it is up again, samples are not quiet this long
  uint64_t seed = 0;
  bool seed_given = false;
  std::string report;         // CSV of the samples
  double sample_every_s = 0;  // 0: duration/30, within [1, 5]
  int depth = 4;              // concurrent transfers per target
  int max_batch = 8;
  size_t max_item = (4u << 20) + 3;  // odd on purpose
  size_t slot = 8u << 20;            // bytes of each in-flight transfer's slot
  int timeout_ms = 5000;             // per-transfer deadline (both engines)
  int pace_ms = 0;                   // each worker rests this long after each window
  int cancel_every = 0;              // ordinary windows: 1 transfer in N is cancelled (0: none)
  int reregister_peer_every = 0;     // per target: every N windows, deregister it mid-window
  std::string peer = FERRY_TEST_PEER;
  // To check the checker: leak this much heap (touched) per window, and one fd
  // every N windows, in this process; the plateau check must then fail.
  size_t inject_leak_kib = 0;
  int inject_fd_leak_every = 0;
};

void usage(const char* argv0) {
  std::printf(
      "usage: %s [--duration S] [--restart-every S] [--procs N] [--stable N]\n"
      "          [--backend NAME[,NAME...]] [--link-down-every S] [--link-settle-ms MS]\n"
      "          [--seed N]\n"
      "          [--report FILE.csv] [--sample-every S]\n"
      "          [--depth N] [--max-batch N] [--max-item BYTES] [--timeout-ms MS] [--pace-ms MS]\n"
      "          [--cancel-every N] [--reregister-peer-every WINDOWS] [--peer PATH]\n"
      "          [--inject-leak-kib N] [--inject-fd-leak-every WINDOWS]  (to check the checker)\n"
      "Runs random verified transfers for S seconds (default 60) from this process to N\n"
      "target processes (default 3; the first --stable (1) are never restarted, the others\n"
      "every --restart-every seconds (10; 0 = never)), sampling RSS/fds/threads of every\n"
      "process; exits 0 only when nothing failed and the long-lived processes plateaued.\n"
      "--backend tcp,cma ranks tcp first and fails over to cma (opted in as trusted).\n"
      "--link-down-every S (run inside tests/netns/netns_pair.sh, which starts the targets\n"
      "in the other namespace): every S seconds the data link goes down for 1.3 deadlines;\n"
      "with a second backend that needs no network (cma) every transfer must still succeed.\n"
      "--cancel-every N: in ordinary windows one transfer in N is cancelled while in flight;\n"
      "it must end cancelled or succeed, tell the target only if it succeeded, and the\n"
      "window's other transfers must succeed and verify as ever.\n"
      "--reregister-peer-every N: every N windows of a target, it is deregistered with a\n"
      "window in flight and the same engine registered again (before or after that window\n"
      "ends); the window may fail, the windows after it must succeed and verify.\n",
      argv0);
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--duration")
      o.duration_s = std::stod(val());
    else if (a == "--restart-every")
      o.restart_every_s = std::stod(val());
    else if (a == "--procs")
      o.procs = std::stoi(val());
    else if (a == "--stable")
      o.stable = std::stoi(val());
    else if (a == "--backend")
      o.backend = val();
    else if (a == "--link-down-every")
      o.link_down_every_s = std::stod(val());
    else if (a == "--link-settle-ms")
      o.link_settle_ms = std::stoi(val());
    else if (a == "--seed") {
      o.seed = std::stoull(val());
      o.seed_given = true;
    } else if (a == "--report")
      o.report = val();
    else if (a == "--sample-every")
      o.sample_every_s = std::stod(val());
    else if (a == "--depth")
      o.depth = std::stoi(val());
    else if (a == "--max-batch")
      o.max_batch = std::stoi(val());
    else if (a == "--max-item")
      o.max_item = std::stoull(val());
    else if (a == "--timeout-ms")
      o.timeout_ms = std::stoi(val());
    else if (a == "--peer")
      o.peer = val();
    else if (a == "--pace-ms")
      o.pace_ms = std::stoi(val());
    else if (a == "--cancel-every")
      o.cancel_every = std::stoi(val());
    else if (a == "--reregister-peer-every")
      o.reregister_peer_every = std::stoi(val());
    else if (a == "--inject-leak-kib")
      o.inject_leak_kib = std::stoull(val());
    else if (a == "--inject-fd-leak-every")
      o.inject_fd_leak_every = std::stoi(val());
    else if (a == "--help" || a == "-h") {
      usage(argv[0]);
      std::exit(0);
    } else
      throw std::runtime_error("unknown option " + a);
  }
  if (o.duration_s <= 0 || o.procs < 1 || o.stable < 0 || o.depth < 1 || o.max_batch < 1 ||
      o.max_item < 1 || o.timeout_ms < 100 || o.restart_every_s < 0 || o.cancel_every < 0 ||
      o.reregister_peer_every < 0)
    throw std::runtime_error("bad option value");
  o.stable = std::min(o.stable, o.procs);
  // Items of a transfer take at most 3/4 of its slot; the rest are the gaps.
  o.max_item = std::min(o.max_item, o.slot * 3 / 4);
  if (o.sample_every_s <= 0) o.sample_every_s = std::clamp(o.duration_s / 30, 1.0, 5.0);
  return true;
}

// ---- global state -----------------------------------------------------------------

Options opt;
std::atomic<bool> stop{false};
std::atomic<bool> failed{false};
bool has_cma = false;  // cma among --backend: the target need not run for a transfer
Clock::time_point t_start;
// Restart windows in progress, and a count bumped as each starts and ends: a
// sample is "quiet" when none was in progress while it was taken.
std::atomic<int> restarting{0};
std::atomic<uint64_t> restart_epoch{0};
struct RestartMark {
  RestartMark() {
    ++restarting;
    ++restart_epoch;
  }
  ~RestartMark() {
    --restarting;
    ++restart_epoch;
  }
};

std::mutex report_mu;
std::vector<std::string> errors;
std::map<std::string, uint64_t> restart_codes;  // code of each restart-window failure
std::vector<std::string> restart_messages;      // a few distinct ones, for the summary

void fail(const std::string& what);
// fail(), for use in `return failing(...)` from functions that return bool.
bool failing(const std::string& what) {
  fail(what);
  return false;
}

void fail(const std::string& what) {
  std::lock_guard<std::mutex> lk(report_mu);
  if (errors.size() < 20) {
    errors.push_back(what);
    std::fprintf(stderr, "[%7.1fs] FAIL %s\n",
                 std::chrono::duration<double>(Clock::now() - t_start).count(), what.c_str());
  }
  failed = true;
  stop = true;
}

struct Counters {
  std::atomic<uint64_t> transfers{0}, items{0}, bytes_verified{0};
  std::atomic<uint64_t> reads{0}, writes{0}, via_engine{0}, via_session{0}, via_transient{0};
  std::atomic<uint64_t> singles{0}, batches{0}, notify_checked{0}, silence_checked{0};
  std::atomic<uint64_t> windows{0}, restarts_kill{0}, restarts_quit{0}, restarts_overlap{0};
  std::atomic<uint64_t> stops{0}, stop_unknown{0}, stop_writes_verified{0};
  std::atomic<uint64_t> early_reregister{0}, inflight_at_stop{0}, inflight_at_reregister{0};
  std::atomic<uint64_t> restart_failures{0}, restart_ok_verified{0}, restart_ok_unverified{0};
  std::atomic<uint64_t> max_fail_ms{0}, local_reregister{0}, stale_session_failures{0};
  std::atomic<uint64_t> link_downs{0};
  std::atomic<uint64_t> cancels{0}, cancelled{0}, cancel_too_late{0};
  std::atomic<uint64_t> peer_reregisters{0}, peer_reregister_early{0}, inflight_at_peer_dereg{0};
} C;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string w; std::getline(in, w, sep);)
    if (!w.empty()) out.push_back(w);
  return out;
}

std::vector<std::string> peer_wrapper() {
  const char* w = std::getenv("FERRY_TEST_PEER_WRAPPER");
  return w ? split(w, ' ') : std::vector<std::string>{};
}

// `ip -n NS link set DEV up|down`, waited for; false when it failed.
bool set_link(const std::string& ns, const std::string& dev, bool up) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execlp("ip", "ip", "-n", ns.c_str(), "link", "set", dev.c_str(), up ? "up" : "down",
             static_cast<char*>(nullptr));
    _exit(127);
  }
  int ws = 0;
  return pid > 0 && ::waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
}

void atomic_max(std::atomic<uint64_t>& a, uint64_t v) {
  uint64_t cur = a.load();
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t x = a ^ (b + 0x9E3779B97F4A7C15ull + (a << 6) + (a >> 2));
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  return x;
}

double since_start() { return std::chrono::duration<double>(Clock::now() - t_start).count(); }

// ---- one target and the worker that drives it --------------------------------------

constexpr const char* kInitKey = "soak-init";

struct Xfer {
  Op op = Op::WRITE;
  int via = 0;  // 0 Engine, 1 the target's Session, 2 a Session for this transfer
  bool batch = false;
  bool notify = false;
  bool check_silence = false;  // notify off: the target must have nothing to pop
  bool must_fail = false;      // posted to a stopped target
  bool unfilled = false;       // a READ whose source the (stopped) target could not fill
  int cancel = -1;             // >= 0: cancelled once this many more of its window were submitted
  std::vector<size_t> lo, ro, sz;
  TransferUid uid = 0;
  TransferStatus st;
  Clock::time_point submitted;
  std::unique_ptr<Session> transient;
  std::string describe() const {
    std::ostringstream o;
    o << (op == Op::READ ? "READ" : "WRITE") << " via "
      << (via == 0   ? "engine"
          : via == 1 ? "session"
                     : "transient-session")
      << (batch ? " batch" : " single") << " uid " << uid << " items " << sz.size() << " [";
    for (size_t i = 0; i < sz.size() && i < 4; ++i)
      o << (i ? " " : "") << lo[i] << "->" << ro[i] << "+" << sz[i];
    o << (sz.size() > 4 ? " ...]" : "]");
    return o.str();
  }
};

class Target {
 public:
  Target(Engine& engine, int index, bool restartable)
      : engine_(engine),
        index_(index),
        name_("t" + std::to_string(index)),
        restartable_(restartable),
        region_(static_cast<size_t>(opt.depth) * opt.slot),
        local_(region_),
        rng_(mix(opt.seed, 1000 + index)),
        rrng_(mix(opt.seed, 2000 + index)) {
    // Touch every page now so that RSS reflects the region from the first sample.
    std::memset(local_.data(), 0x5a, local_.size());
    local_mem_ = engine_.register_memory(local_.data(), local_.size());
    if (restartable_ && opt.restart_every_s > 0) {
      const int nrest = opt.procs - opt.stable;
      const int j = index_ - opt.stable;
      next_restart_ = opt.restart_every_s * (1.0 + static_cast<double>(j) / nrest);
    }
  }
  ~Target() {
    session_.reset();
    child_.reset();
  }

  const std::string& name() const { return name_; }
  bool restartable() const { return restartable_; }
  std::atomic<int> pid{0};
  std::atomic<uint64_t> incarnation{0};
  // Of the shapes of the first kDigestWindows ordinary windows: equal for equal seeds.
  static constexpr uint64_t kDigestWindows = 50;
  std::atomic<uint64_t> digest{0};

  // Starts the target process and registers it both ways. False (and fail())
  // when anything goes wrong.
  bool start() {
    EngineDesc d;
    MemoryDesc m;
    return spawn(child_, d, m) && attach(d, m);
  }

  // Starts a target process: READY, its region touched, the initiator registered there.
  bool spawn(std::unique_ptr<test::ChildProcess>& child, EngineDesc& d, MemoryDesc& m) {
    // Inside netns_pair.sh the target runs in the other namespace (the wrapper
    // execs it there: the pid is the target's own, for SIGSTOP and SIGKILL).
    std::vector<std::string> argv = peer_wrapper();
    for (const auto& a :
         {opt.peer, name_, opt.backend, std::to_string(region_), std::to_string(opt.timeout_ms)})
      argv.push_back(a);
    child = std::make_unique<test::ChildProcess>(argv);
    std::string ready = child->read_line(60000);
    std::istringstream in(ready);
    std::string word, ehex, mhex;
    in >> word >> ehex >> mhex;
    if (word != "READY") return failing(name_ + ": target did not start: '" + ready + "'");
    // Touch the whole target region (RSS from the first sample, as above).
    if (auto a = child->ask("fill " + std::to_string(mix(opt.seed, index_))); a != "OK")
      return failing(name_ + ": fill: " + a);
    if (auto a = child->ask("register " + test::to_hex(engine_.desc().pack())); a != "OK")
      return failing(name_ + ": target could not register the initiator: " + a);
    try {
      d = EngineDesc::unpack(test::from_hex(ehex));
      m = MemoryDesc::unpack(test::from_hex(mhex));
    } catch (const Error& e) {
      return failing(name_ + ": bad descriptors: " + e.what());
    }
    if (d.key != name_) return failing(name_ + ": target came back as '" + d.key + "'");
    return true;
  }

  // Registers the target process child_ (descriptors d, m) with the initiator.
  bool attach(const EngineDesc& d, const MemoryDesc& m) {
    pid = child_->pid();
    ++incarnation;
    remote_ = m;
    desc_ = d;
    // The same key again: the engine must take the new descriptor in place of the old one.
    if (Result r = engine_.register_remote_engine(d); !r)
      return failing(name_ + ": register_remote_engine (incarnation " +
                     std::to_string(incarnation.load()) + "): " + r.message);
    return new_session();
  }

  void stop_target() {
    if (!child_) return;
    if (child_->ask("quit", 10000) != "BYE") fail(name_ + ": target did not quit");
    child_.reset();
    pid = 0;
  }

  void run() {
    while (!stop) {
      if (next_restart_ > 0 && since_start() >= next_restart_) {
        // Every fourth fault is a stop longer than the deadline, not a restart.
        if (faults_++ % 4 == 3)
          stop_window();
        else
          restart_window();
        next_restart_ += opt.restart_every_s;
      } else {
        normal_window();
      }
      if (++windows_ % 64 == 0 && !stop) reregister_local();
      if (opt.reregister_peer_every > 0 && windows_ % opt.reregister_peer_every == 0 && !stop &&
          child_)
        reregister_peer_window();
      // Pacing only (to bound the CPU taken on a shared host); it orders nothing.
      if (opt.pace_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(opt.pace_ms));
      if (opt.inject_leak_kib > 0) {
        auto* leak = new std::vector<uint8_t>(opt.inject_leak_kib << 10, 1);
        (void)leak;
      }
      if (opt.inject_fd_leak_every > 0 && windows_ % opt.inject_fd_leak_every == 0) (void)!dup(1);
    }
  }

 private:
  bool new_session() {
    Result why;
    session_ = engine_.create_session(local_mem_, remote_, &why);
    if (!session_) return failing(name_ + ": create_session: " + why.message);
    return true;
  }

  // The application deregisters the target with a window in flight and
  // registers the same engine (same instance) again - a connector dropping a
  // peer's metadata and fetching it again - half of the time while that window
  // is still in flight, else after it ended. The window may fail (a message,
  // within the restart bound); a WRITE of it whose outcome is unknown keeps
  // the peer fenced until the registered-again target answers, so the windows
  // after it succeed and verify every byte (a late byte would break them).
  void reregister_peer_window() {
    RestartMark mark;
    ++C.peer_reregisters;
    const uint64_t wseed = mix(opt.seed, (static_cast<uint64_t>(index_) << 40) + ++wcount_);
    auto xs = plan(rrng_, opt.depth);
    if (!prepare(xs, wseed, false)) return;
    for (auto& x : xs)
      if (!submit(x)) return fail(name_ + ": " + x.describe() + ": " + x.st.Message());
    for (const auto& x : xs) C.inflight_at_peer_dereg += x.st.InProgress();
    session_.reset();
    if (Result r = engine_.deregister_remote_engine(desc_.key); !r)
      return fail(name_ + ": deregister_remote_engine: " + r.message);
    const bool early = rrng_() % 2 == 0;
    auto again = [&] {
      if (Result r = engine_.register_remote_engine(desc_); !r)
        return failing(name_ + ": register_remote_engine (the same engine again): " + r.message);
      return new_session();
    };
    if (early) {
      ++C.peer_reregister_early;
      if (!again()) return;
    }
    for (auto& x : xs)
      if (!settle(x, wseed, "deregistered")) return;
    if (!early) again();
  }

  // Deregister the local region and register it again (nothing is in flight).
  void reregister_local() {
    session_.reset();
    if (Result r = engine_.deregister_memory(local_mem_); !r)
      return fail(name_ + ": deregister_memory: " + r.message);
    local_mem_ = engine_.register_memory(local_.data(), local_.size());
    ++C.local_reregister;
    new_session();
  }

  static size_t log_uniform(std::mt19937_64& rng, size_t cap) {
    if (cap <= 1) return 1;
    double x = std::exp(std::uniform_real_distribution<double>(0, std::log(cap + 1.0))(rng));
    size_t s = std::clamp<size_t>(static_cast<size_t>(x), 1, cap);
    // Now and then a power of two (the sizes applications use most).
    if (rng() % 8 == 0) s = std::bit_floor(s);
    return s;
  }

  // Offsets for items of `sizes` in [base, base + slot), in `order`, random gaps.
  static std::vector<size_t> place(std::mt19937_64& rng, const std::vector<size_t>& sizes,
                                   const std::vector<size_t>& order, size_t base) {
    size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
    size_t free = opt.slot - total;
    std::vector<double> w(sizes.size() + 1);
    for (auto& x : w) x = std::uniform_real_distribution<double>(0.01, 1)(rng);
    double wsum = std::accumulate(w.begin(), w.end(), 0.0);
    std::vector<size_t> offs(sizes.size());
    size_t at = base;
    for (size_t k = 0; k < order.size(); ++k) {
      at += static_cast<size_t>(static_cast<double>(free) * w[k] / wsum);
      offs[order[k]] = at;
      at += sizes[order[k]];
    }
    return offs;
  }

  std::vector<Xfer> plan(std::mt19937_64& rng, int n) {
    std::vector<Xfer> xs(static_cast<size_t>(n));
    for (int k = 0; k < n; ++k) {
      Xfer& x = xs[static_cast<size_t>(k)];
      x.op = rng() % 2 ? Op::READ : Op::WRITE;
      uint64_t r = rng() % 100;
      x.via = r < 50 ? 0 : r < 85 ? 1 : 2;
      x.batch = rng() % 10 >= 3;
      size_t m = x.batch ? 1 + rng() % static_cast<uint64_t>(opt.max_batch) : 1;
      x.notify = rng() % 8 == 0;
      x.check_silence = !x.notify && rng() % 16 == 0;
      size_t budget = opt.slot * 3 / 4;
      for (size_t i = 0; i < m; ++i) {
        size_t cap = std::min(opt.max_item, budget - (m - 1 - i));
        x.sz.push_back(log_uniform(rng, cap));
        budget -= x.sz.back();
      }
      std::vector<size_t> order(m);
      std::iota(order.begin(), order.end(), size_t{0});
      const size_t base = static_cast<size_t>(k) * opt.slot;
      x.lo = place(rng, x.sz, order, base);
      std::shuffle(order.begin(), order.end(), rng);
      x.ro = place(rng, x.sz, order, base);
      if (opt.cancel_every > 0 && rng() % static_cast<uint64_t>(opt.cancel_every) == 0)
        x.cancel = static_cast<int>(rng() % static_cast<uint64_t>(n - k));
    }
    return xs;
  }

  // Fill the local sources of WRITEs and poison the local destinations of READs;
  // ask the target to fill the sources of READs. False if the target did not answer.
  bool prepare(std::vector<Xfer>& xs, uint64_t wseed, bool quiet_fail) {
    std::ostringstream fill;
    size_t nfill = 0;
    for (auto& x : xs)
      for (size_t i = 0; i < x.sz.size(); ++i) {
        if (x.op == Op::WRITE) {
          test::fill_pattern(local_.data(), x.lo[i], x.sz[i], wseed);
        } else {
          for (size_t b = 0; b < x.sz[i]; ++b)
            local_[x.lo[i] + b] = static_cast<uint8_t>(~test::pattern_byte(wseed, x.ro[i] + b));
          fill << " " << x.ro[i] << " " << x.sz[i];
          ++nfill;
        }
      }
    if (nfill == 0) return true;
    std::string a =
        child_->ask("fill " + std::to_string(wseed) + " " + std::to_string(nfill) + fill.str());
    if (a != "OK" && !quiet_fail) fail(name_ + ": target fill: '" + a + "'");
    return a == "OK";
  }

  bool submit(Xfer& x) {
    Session* s = nullptr;
    if (x.via == 1) s = session_.get();
    if (x.via == 2) {
      Result why;
      x.transient = engine_.create_session(local_mem_, remote_, &why);
      if (!x.transient) {
        x.st.Finish(why.code, "create_session: " + why.message);
        x.submitted = Clock::now();
        return false;
      }
      s = x.transient.get();
    }
    if (x.via == 1 && !s) {
      x.st.Finish(StatusCode::ERR_BAD_STATE, "no session");
      x.submitted = Clock::now();
      return false;
    }
    x.uid = s ? s->allocate_transfer_uid() : engine_.allocate_transfer_uid();
    x.submitted = Clock::now();
    const bool w = x.op == Op::WRITE;
    if (x.batch) {
      if (s)
        x.st = w ? s->batch_write(x.lo, x.ro, x.sz, x.uid, x.notify)
                 : s->batch_read(x.lo, x.ro, x.sz, x.uid, x.notify);
      else
        x.st = w ? engine_.batch_write(local_mem_, x.lo, remote_, x.ro, x.sz, x.uid, x.notify)
                 : engine_.batch_read(local_mem_, x.lo, remote_, x.ro, x.sz, x.uid, x.notify);
    } else {
      if (s)
        x.st = w ? s->write(x.lo[0], x.ro[0], x.sz[0], x.uid, x.notify)
                 : s->read(x.lo[0], x.ro[0], x.sz[0], x.uid, x.notify);
      else
        x.st = w ? engine_.write(local_mem_, x.lo[0], remote_, x.ro[0], x.sz[0], x.uid, x.notify)
                 : engine_.read(local_mem_, x.lo[0], remote_, x.ro[0], x.sz[0], x.uid, x.notify);
    }
    ++C.transfers;
    C.items += x.sz.size();
    ++(w ? C.writes : C.reads);
    ++(x.via == 0 ? C.via_engine : x.via == 1 ? C.via_session : C.via_transient);
    ++(x.batch ? C.batches : C.singles);
    return true;
  }

  // Wait until x ends or `bound` after its submission. Returns false on a hang.
  static bool await(const Xfer& x, std::chrono::milliseconds bound) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(x.submitted + bound - Clock::now());
    return x.st.WaitFor(std::max(left, 0ms)) || !x.st.InProgress();
  }

  bool verify_read(const Xfer& x, uint64_t wseed) {
    for (size_t i = 0; i < x.sz.size(); ++i) {
      int64_t bad = test::find_mismatch(local_.data(), x.lo[i], x.sz[i], wseed, x.ro[i]);
      if (bad >= 0) {
        // What is there instead: still the poison (nothing arrived) or other bytes.
        size_t poison = 0, wrong = 0;
        for (size_t k = 0; k < x.sz[i]; ++k) {
          const uint8_t want = test::pattern_byte(wseed, x.ro[i] + k);
          const uint8_t got = local_[x.lo[i] + k];
          poison += got == static_cast<uint8_t>(~want);
          wrong += got != want;
        }
        fail(name_ + ": data mismatch at byte " + std::to_string(bad) + " of item " +
             std::to_string(i) + " of " + x.describe() + " (" + x.st.Message() +
             "): " + std::to_string(wrong) + " of " + std::to_string(x.sz[i]) + " bytes wrong, " +
             std::to_string(poison) + " of them still the poison; " + target_view(x, i, wseed));
        return false;
      }
      C.bytes_verified += x.sz[i];
    }
    return true;
  }

  // Whether the target's own bytes of a READ's item are what it was filled with
  // (then ours were overwritten after the READ) or not (something wrote there).
  std::string target_view(const Xfer& x, size_t i, uint64_t wseed) {
    std::vector<uint8_t> want(x.sz[i]);
    for (size_t k = 0; k < want.size(); ++k) want[k] = test::pattern_byte(wseed, x.ro[i] + k);
    const std::string expect =
        "HASH " + std::to_string(test::fnv1a(want.data(), want.size(), test::kFnvBasis));
    const std::string got =
        child_->ask("hash 1 " + std::to_string(x.ro[i]) + " " + std::to_string(x.sz[i]));
    return got == expect ? "the target holds the right bytes"
                         : "the target's bytes are wrong too ('" + got + "')";
  }

  std::string hash_cmd(const std::vector<const Xfer*>& ws) {
    std::ostringstream o;
    size_t n = 0;
    for (auto* x : ws) n += x->sz.size();
    o << "hash " << n;
    for (auto* x : ws)
      for (size_t i = 0; i < x->sz.size(); ++i) o << " " << x->ro[i] << " " << x->sz[i];
    return o.str();
  }
  uint64_t local_hash(const std::vector<const Xfer*>& ws) {
    uint64_t h = test::kFnvBasis;
    for (auto* x : ws)
      for (size_t i = 0; i < x->sz.size(); ++i)
        h = test::fnv1a(local_.data() + x->lo[i], x->sz[i], h);
    return h;
  }

  void verify_writes(const std::vector<const Xfer*>& ws) {
    if (ws.empty()) return;
    std::string a = child_->ask(hash_cmd(ws));
    if (a == "HASH " + std::to_string(local_hash(ws))) {
      for (auto* x : ws)
        for (size_t s : x->sz) C.bytes_verified += s;
      return;
    }
    // Which one: per transfer.
    for (auto* x : ws) {
      std::string b = child_->ask(hash_cmd({x}));
      if (b != "HASH " + std::to_string(local_hash({x})))
        return fail(name_ + ": data mismatch (target hash '" + b + "') after " + x->describe());
    }
    fail(name_ + ": data mismatch in window (target said '" + a + "')");
  }

  void check_notifications(const std::vector<Xfer>& xs) {
    for (const auto& x : xs) {
      if (x.st.Code() == StatusCode::ERR_CANCELLED) continue;  // below
      if (x.notify) {
        std::string a =
            child_->ask("pop " + std::string(kInitKey) + " " + std::to_string(x.uid) + " 5000");
        if (a != "INBOUND SUCCESS")
          return fail(name_ + ": notification for " + x.describe() + ": '" + a + "'");
        ++C.notify_checked;
      } else if (x.check_silence) {
        std::string a =
            child_->ask("pop " + std::string(kInitKey) + " " + std::to_string(x.uid) + " 0");
        if (a != "NONE")
          return fail(name_ + ": notification without notify for " + x.describe() + ": '" + a +
                      "'");
        ++C.silence_checked;
      }
    }
    // A cancelled transfer tells the target nothing. Asked after the window's
    // successes were popped, so a notification sent for it before theirs
    // would be here by now.
    for (const auto& x : xs) {
      if (x.st.Code() != StatusCode::ERR_CANCELLED) continue;
      std::string a =
          child_->ask("pop " + std::string(kInitKey) + " " + std::to_string(x.uid) + " 0");
      if (a != "NONE")
        return fail(name_ + ": the cancelled " + x.describe() + " was notified: '" + a + "'");
    }
  }

  std::chrono::milliseconds normal_bound() const { return 2ms * opt.timeout_ms + 5000ms; }
  // A transfer hit by a restart ends with the plugin's deadline, or the core's
  // watchdog 1 s after it; 1.5 s on top for scheduling on a loaded 2-core host.
  std::chrono::milliseconds restart_bound() const { return 1ms * opt.timeout_ms + 2500ms; }

  void normal_window() {
    const uint64_t wseed = mix(opt.seed, (static_cast<uint64_t>(index_) << 40) + ++wcount_);
    int n = 1 + static_cast<int>(rng_() % static_cast<uint64_t>(opt.depth));
    auto xs = plan(rng_, n);
    if (++normal_windows_ <= kDigestWindows) {
      uint64_t h = digest.load();
      for (const auto& x : xs) {
        h = mix(h, static_cast<uint64_t>(x.op) << 8 | static_cast<uint64_t>(x.via) << 4 |
                       x.batch << 2 | x.notify << 1 | x.check_silence);
        for (size_t i = 0; i < x.sz.size(); ++i) h = mix(mix(mix(h, x.lo[i]), x.ro[i]), x.sz[i]);
      }
      digest = h;
    }
    if (!prepare(xs, wseed, false)) return;
    // A transfer to cancel is cancelled right after its own submission (0) or
    // after that many of the window's later ones, so siblings are in flight
    // beside it - on the same lanes - when its attempt is fenced.
    for (size_t k = 0; k < xs.size(); ++k) {
      if (!submit(xs[k])) return fail(name_ + ": " + xs[k].describe() + ": " + xs[k].st.Message());
      for (size_t j = 0; j <= k; ++j)
        if (xs[j].cancel >= 0 && static_cast<size_t>(xs[j].cancel) == k - j) {
          xs[j].st.Cancel();
          ++C.cancels;
        }
    }
    std::vector<const Xfer*> ws;
    for (auto& x : xs) {
      if (!await(x, normal_bound()))
        return fail(name_ + ": " + x.describe() + " did not end within " +
                    std::to_string(normal_bound().count()) + " ms");
      if (x.cancel >= 0 && x.st.Code() == StatusCode::ERR_CANCELLED) {
        // Its bytes are whatever landed before the fence: not verified here. A
        // byte of it landing later would show in the next windows on the slot.
        ++C.cancelled;
        continue;
      }
      if (x.cancel >= 0) ++C.cancel_too_late;
      if (x.st.Code() != StatusCode::SUCCESS)
        return fail(name_ + ": " + x.describe() + (x.cancel >= 0 ? " (cancelled)" : "") +
                    " failed: " + to_string(x.st.Code()) + ": " + x.st.Message());
      if (x.op == Op::READ) {
        if (!verify_read(x, wseed)) return;
      } else {
        ws.push_back(&x);
      }
    }
    verify_writes(ws);
    if (failed) return;
    check_notifications(xs);
    ++C.windows;
  }

  // Transfers in flight while the target stops, a few more while it is down;
  // then the target starts again under the same key.
  void restart_window() {
    RestartMark mark;
    // kill: SIGKILL; quit: the target destroys its engine and exits; overlap: the
    // new incarnation starts and is registered while the old one still runs with
    // transfers in flight, then the old one is killed (a rolling restart).
    enum Mode { KILL, QUIT, OVERLAP } mode = static_cast<Mode>(restarts_++ % 3);
    const char* what = mode == KILL ? "killed" : mode == QUIT ? "quit" : "replaced";
    const uint64_t wseed = mix(opt.seed, (static_cast<uint64_t>(index_) << 40) + ++wcount_);
    std::unique_ptr<test::ChildProcess> next;
    EngineDesc next_desc;
    MemoryDesc next_mem;
    if (mode == OVERLAP && !spawn(next, next_desc, next_mem)) return;
    // The last slot is kept for the transfers posted while the target is down.
    auto xs = plan(rrng_, std::max(1, opt.depth - 1));
    if (!prepare(xs, wseed, false)) return;
    for (auto& x : xs)
      if (!submit(x)) return fail(name_ + ": " + x.describe() + ": " + x.st.Message());
    auto old_session = std::move(session_);
    for (const auto& x : xs) C.inflight_at_stop += x.st.InProgress();
    // Stop it now, with (some of) those in flight.
    bool early = false;
    if (mode == OVERLAP) {
      ++C.restarts_overlap;
      for (const auto& x : xs) C.inflight_at_reregister += x.st.InProgress();
      auto old_child = std::move(child_);
      child_ = std::move(next);
      if (!attach(next_desc, next_mem)) return;
      old_child.reset();  // SIGKILL and reap
    } else {
      if (mode == QUIT) {
        std::string bye = child_->ask("quit", 30000);
        if (bye != "BYE") return fail(name_ + ": target did not quit: '" + bye + "'");
        // EOF on its stdout: the process is exiting (its engine has been destroyed).
        const auto asked = Clock::now();
        std::string more = child_->read_line(30000);
        if (!more.empty()) return fail(name_ + ": target said '" + more + "' after BYE");
        if (Clock::now() - asked >= 29s) return fail(name_ + ": target did not exit after BYE");
        ++C.restarts_quit;
      } else {
        ++C.restarts_kill;
      }
      child_.reset();  // SIGKILL (a no-op on the exited one) and reap
      pid = 0;
      // While it is down.
      for (int k = 0; k < 2; ++k) {
        auto more = plan(rrng_, opt.depth);
        Xfer& d = more.back();
        d.via = k;  // one through the engine, one through the old session
        d.notify = false;
        d.must_fail = true;
        if (k == 1) session_ = std::move(old_session);
        submit(d);
        if (k == 1) old_session = std::move(session_);
        xs.push_back(std::move(d));
      }
      // Half of the time the new incarnation is registered while those may
      // still be in flight (the engine drops the old peer under them).
      early = rrng_() % 2 == 0;
      if (early) {
        ++C.early_reregister;
        if (!start()) return;
      }
    }
    for (auto& x : xs)
      if (!settle(x, wseed, what)) return;
    if (mode != OVERLAP && !early && !start()) return;
    if (old_session && old_session->alive())
      return fail(name_ + ": a session to the old incarnation is still alive()");
    if (!session_->alive()) return fail(name_ + ": the new session is not alive()");
    // Transfers through the old incarnation's session after the new one is
    // registered: they must fail at once, and (3 failures being the built-in
    // policy's quarantine threshold) must not quarantine the new incarnation;
    // the next window to it would fail if they did.
    for (int k = 0; k < 4; ++k) {
      auto more = plan(rrng_, opt.depth);
      Xfer& d = more.back();
      d.via = 1;
      d.notify = false;
      d.must_fail = true;
      std::swap(session_, old_session);
      submit(d);
      std::swap(session_, old_session);
      if (!settle(d, wseed, "replaced")) return;
      ++C.stale_session_failures;
    }
  }

  // SIGSTOP the target with a window in flight, longer than the deadline (its
  // transfers end meanwhile: they are what the stop is timed by, not a sleep),
  // post more while it is stopped, SIGCONT, and wait until the initiator says the
  // peer is no longer fenced. WRITEs that succeeded are verified after CONT; one
  // whose outcome is unknown (the fence went unanswered) is not: the later
  // windows to the same slots verify every byte, so a stale landing shows there.
  void stop_window() {
    RestartMark mark;
    ++C.stops;
    const uint64_t wseed = mix(opt.seed, (static_cast<uint64_t>(index_) << 40) + ++wcount_);
    auto xs = plan(rrng_, std::max(1, opt.depth - 1));
    if (!prepare(xs, wseed, false)) return;
    for (auto& x : xs)
      if (!submit(x)) return fail(name_ + ": " + x.describe() + ": " + x.st.Message());
    for (const auto& x : xs) C.inflight_at_stop += x.st.InProgress();
    const int stopped_pid = child_->pid();
    if (::kill(stopped_pid, SIGSTOP) != 0) return fail(name_ + ": SIGSTOP failed");
    // However this window ends, the target runs again (a failing soak still
    // has to make it quit).
    struct Resume {
      int pid;
      bool done = false;
      void now() {
        if (done) return;
        done = true;
        int w = 0;
        ::kill(pid, SIGCONT);
        ::waitpid(pid, &w, WCONTINUED);
      }
      ~Resume() { now(); }
    } resume{stopped_pid};
    int ws = 0;
    if (::waitpid(stopped_pid, &ws, WUNTRACED) != stopped_pid || !WIFSTOPPED(ws))
      return fail(name_ + ": the target did not stop");
    // Posted while it is stopped, on the slot the window left free: over tcp
    // they cannot succeed. cma needs no help from the target: a WRITE (when no
    // fence holds the peer) may succeed and is verified after SIGCONT; a READ
    // may succeed too, but its source could not be filled. One such transfer
    // with cma (two would share the slot), two without.
    for (int k = 0; k < (has_cma ? 1 : 2); ++k) {
      auto more = plan(rrng_, opt.depth);
      Xfer& d = more.back();
      d.notify = false;
      d.must_fail = !has_cma;
      if (d.op == Op::WRITE)
        for (size_t i = 0; i < d.sz.size(); ++i)
          test::fill_pattern(local_.data(), d.lo[i], d.sz[i], wseed);
      else
        d.unfilled = true;
      submit(d);
      xs.push_back(std::move(d));
    }
    std::vector<const Xfer*> landed;
    for (auto& x : xs) {
      if (!settle(x, wseed, "stopped")) return;
      if (x.st.Code() == StatusCode::ERR_OUTCOME_UNKNOWN) ++C.stop_unknown;
      if (x.op == Op::WRITE && x.st.Code() == StatusCode::SUCCESS) landed.push_back(&x);
    }
    resume.now();
    // The fence is answered once the target runs again: probe with a 1-byte READ
    // (it fails at once while the peer is fenced) until it works.
    const auto until = Clock::now() + 15s;
    for (;;) {
      TransferStatus p = engine_.read(local_mem_, 0, remote_, 0, 1, 0, false);
      p.Wait();
      if (p.Code() == StatusCode::SUCCESS) break;
      if (Clock::now() > until)
        return fail(name_ + ": still failing 15 s after SIGCONT: " + p.Message());
      std::this_thread::sleep_for(10ms);  // between probes; the probe's answer decides
    }
    verify_writes(landed);
    C.stop_writes_verified += landed.size();
  }

  // One transfer of a restart window: it may fail (never without a message,
  // never later than restart_bound()); if it succeeds, a READ is verified.
  bool settle(Xfer& x, uint64_t wseed, const char* what) {
    if (!await(x, restart_bound()))
      return failing(name_ + ": " + x.describe() + " (target " + what + ") did not end within " +
                     std::to_string(restart_bound().count()) + " ms of its submission");
    const auto took =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - x.submitted);
    if (x.st.Code() == StatusCode::SUCCESS) {
      if (x.must_fail)
        return failing(name_ + ": " + x.describe() + " (target " + what + ") succeeded");
      if (x.op == Op::READ && !x.unfilled) {
        if (!verify_read(x, wseed)) return false;
        ++C.restart_ok_verified;
      } else {
        ++C.restart_ok_unverified;
      }
      return true;
    }
    ++C.restart_failures;
    atomic_max(C.max_fail_ms, static_cast<uint64_t>(took.count()));
    if (x.st.Message().empty())
      return failing(name_ + ": " + x.describe() + " failed with " + to_string(x.st.Code()) +
                     " and no message");
    std::lock_guard<std::mutex> lk(report_mu);
    ++restart_codes[to_string(x.st.Code())];
    std::string m = x.st.Message().substr(0, 160);
    if (restart_messages.size() < 8 &&
        std::find(restart_messages.begin(), restart_messages.end(), m) == restart_messages.end())
      restart_messages.push_back(m);
    return true;
  }

  Engine& engine_;
  const int index_;
  const std::string name_;
  const bool restartable_;
  const size_t region_;
  std::vector<uint8_t> local_;
  MemoryDesc local_mem_, remote_;
  EngineDesc desc_;  // the target's, as registered
  std::unique_ptr<test::ChildProcess> child_;
  std::unique_ptr<Session> session_;
  std::mt19937_64 rng_, rrng_;  // normal windows; restart windows
  double next_restart_ = 0;     // seconds since start; 0 = never
  uint64_t wcount_ = 0, windows_ = 0, restarts_ = 0, normal_windows_ = 0, faults_ = 0;
};

// ---- sampling ------------------------------------------------------------------------

struct Sample {
  double t;
  int pid;
  long rss_kib, fds, threads;
  bool quiet = true;  // no target restart was in progress while it was taken
};

bool read_proc(int pid, Sample& s) {
  std::ifstream st("/proc/" + std::to_string(pid) + "/status");
  if (!st) return false;
  s.rss_kib = s.threads = -1;
  for (std::string line; std::getline(st, line);) {
    if (line.rfind("VmRSS:", 0) == 0) s.rss_kib = std::stol(line.substr(6));
    if (line.rfind("Threads:", 0) == 0) s.threads = std::stol(line.substr(8));
  }
  DIR* d = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (!d) return false;
  long n = 0;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  s.fds = n - (pid == getpid() ? 1 : 0);  // the directory being read
  s.pid = pid;
  return s.rss_kib >= 0 && s.threads >= 0;
}

struct Series {
  std::string name;
  bool long_lived;
  std::vector<Sample> samples;
};

std::string mib(long kib) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", static_cast<double>(kib) / 1024);
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    parse(argc, argv, opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    usage(argv[0]);
    return 2;
  }
  if (!opt.seed_given) opt.seed = std::random_device{}() * 0x100000001ull ^ std::random_device{}();
#ifdef FERRY_PLUGIN_BUILD_DIR
  setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 0);  // the targets inherit it
#endif
  std::printf(
      "ferry-soak: seed %llu (reproduce: --seed %llu), duration %.0f s, %d targets (%d stable), "
      "restart every %.0f s, backend %s, depth %d, batch <= %d, items 1 B .. %zu B, deadline "
      "%d ms, samples every %.1f s\n",
      static_cast<unsigned long long>(opt.seed), static_cast<unsigned long long>(opt.seed),
      opt.duration_s, opt.procs, opt.stable, opt.restart_every_s, opt.backend.c_str(), opt.depth,
      opt.max_batch, opt.max_item, opt.timeout_ms, opt.sample_every_s);
  std::fflush(stdout);

  EngineConfig cfg;
  cfg.timeout = std::chrono::milliseconds(opt.timeout_ms);
  // Inside netns_pair.sh: the control plane listens where the targets (in the
  // other namespace) can reach it.
  if (const char* h = std::getenv("FERRY_TEST_INITIATOR_HOST"); h && *h) cfg.host = h;
  const std::vector<std::string> backends = split(opt.backend, ',');
  if (backends.empty()) {
    std::fprintf(stderr, "--backend: no backend named\n");
    return 2;
  }
  const char* netns_b = std::getenv("FERRY_NETNS_B");
  const char* dev_b = std::getenv("FERRY_NETNS_DEV_B");
  if (opt.link_down_every_s > 0 && (!netns_b || !dev_b)) {
    std::fprintf(stderr, "--link-down-every needs tests/netns/netns_pair.sh around the soak\n");
    return 2;
  }
  // The backends in the order given, cma opted in (it cannot check on the
  // target side), and a short quarantine: a stop longer than the deadline fails
  // several transfers at once, and 3 failures quarantine tcp for that peer (30 s
  // by default, longer than a soak's pause between faults). The threshold stays
  // 3, so the stale-session check below still means what it says.
  const bool trust = std::find(backends.begin(), backends.end(), "cma") != backends.end();
  has_cma = trust;
  std::string prefer;
  for (const auto& b : backends) prefer += (prefer.empty() ? "" : ", ") + b;
  const std::string policy_path = "/tmp/ferry-soak-policy-" + std::to_string(getpid()) + ".yaml";
  std::string listed;  // backends outside the built-in list must be named under backends:
  for (const auto& b : backends) listed += "  " + b + ": {}\n";
  std::ofstream(policy_path) << "backends:\n"
                             << listed << "rules:\n  - prefer: [" << prefer << "]\n"
                             << (trust ? "    trust_descriptors: true\n" : "")
                             << "failover:\n  quarantine: { after_failures: 3, within: 10s, "
                                "for: 1s, max: 2s }\n";
  cfg.policy_file = policy_path;
  // The targets read it too, unless netns_pair.sh gave them one of their own.
  setenv("FERRY_POLICY", policy_path.c_str(), 0);
  struct RemovePolicy {
    std::string path;
    ~RemovePolicy() { std::remove(path.c_str()); }
  } remove_policy{policy_path};
  std::unique_ptr<Engine> engine;
  try {
    engine = std::make_unique<Engine>(kInitKey, cfg);
  } catch (const Error& e) {
    std::fprintf(stderr, "engine: %s\n", e.what());
    return 1;
  }
  for (const auto& b : backends)
    if (Result r = engine->add_backend(b); !r) {
      std::fprintf(stderr, "add_backend %s: %s\n", b.c_str(), r.message.c_str());
      return 1;
    }

  t_start = Clock::now();
  std::vector<std::unique_ptr<Target>> targets;
  for (int i = 0; i < opt.procs; ++i) {
    targets.push_back(std::make_unique<Target>(*engine, i, i >= opt.stable));
    if (!targets.back()->start()) break;
  }

  // Series: this process, then every target (the restarted ones per key; only
  // the long-lived ones are held to the plateau).
  std::vector<Series> series;
  series.push_back({"init", true, {}});
  for (auto& t : targets) series.push_back({t->name(), !t->restartable(), {}});
  std::mutex sample_mu;
  // Written as the samples come (a long run that dies still leaves its trend).
  std::ofstream csv;
  if (!opt.report.empty()) {
    csv.open(opt.report);
    csv << "t_s,process,pid,rss_kib,fds,threads,quiet" << std::endl;
    if (!csv) std::fprintf(stderr, "could not write %s\n", opt.report.c_str());
  }
  auto take_samples = [&] {
    double t = since_start();
    std::lock_guard<std::mutex> lk(sample_mu);
    const uint64_t epoch = restart_epoch.load();
    const bool calm = restarting.load() == 0;
    std::vector<std::pair<size_t, Sample>> got;
    for (size_t i = 0; i < series.size(); ++i) {
      int pid = i == 0 ? getpid() : targets[i - 1]->pid.load();
      Sample s{t, pid, -1, -1, -1};
      if (pid > 0 && read_proc(pid, s)) got.emplace_back(i, s);
    }
    const bool quiet = calm && restart_epoch.load() == epoch;
    for (auto& [i, s] : got) {
      s.quiet = quiet;
      series[i].samples.push_back(s);
      if (csv.is_open())
        csv << s.t << "," << series[i].name << "," << s.pid << "," << s.rss_kib << "," << s.fds
            << "," << s.threads << "," << s.quiet << std::endl;
    }
  };

  if (!failed) take_samples();
  std::vector<std::thread> workers;
  if (!failed)
    for (auto& t : targets) workers.emplace_back([&t] { t->run(); });
  std::thread sampler([&] {
    auto next = t_start;
    double last_progress = 0;
    while (!stop) {
      next += std::chrono::duration_cast<Clock::duration>(
          std::chrono::duration<double>(opt.sample_every_s));
      while (!stop && Clock::now() < next) std::this_thread::sleep_for(50ms);  // pacing only
      if (stop) break;
      if (since_start() >= opt.duration_s) {
        stop = true;
        break;
      }
      take_samples();
      if (since_start() - last_progress >= 30) {
        last_progress = since_start();
        std::printf(
            "[%6.0fs] transfers %llu, verified %.1f MiB, restarts %llu, restart "
            "failures %llu; init rss %s MiB fds %ld threads %ld; t0 rss %s MiB fds %ld\n",
            since_start(), static_cast<unsigned long long>(C.transfers.load()),
            static_cast<double>(C.bytes_verified.load()) / (1 << 20),
            static_cast<unsigned long long>(C.restarts_kill + C.restarts_quit + C.restarts_overlap),
            static_cast<unsigned long long>(C.restart_failures.load()),
            mib(series[0].samples.back().rss_kib).c_str(), series[0].samples.back().fds,
            series[0].samples.back().threads,
            mib(series[1].samples.empty() ? 0 : series[1].samples.back().rss_kib).c_str(),
            series[1].samples.empty() ? 0L : series[1].samples.back().fds);
        std::fflush(stdout);
      }
    }
  });
  // The data link goes down for 1.3 deadlines every --link-down-every seconds,
  // under every target at once; the workers go on meanwhile.
  std::thread link_fault;
  if (opt.link_down_every_s > 0 && !failed)
    link_fault = std::thread([&] {
      const auto down_for = std::chrono::milliseconds(opt.timeout_ms * 13 / 10);
      double next = opt.link_down_every_s;
      while (!stop) {
        std::this_thread::sleep_for(50ms);  // pacing only: the fault schedule is by time
        if (since_start() < next) continue;
        next += opt.link_down_every_s;
        RestartMark mark;  // samples taken meanwhile are not quiet
        if (!set_link(netns_b, dev_b, false)) return fail("link down failed");
        ++C.link_downs;
        const auto up_at = Clock::now() + down_for;
        while (!stop && Clock::now() < up_at) std::this_thread::sleep_for(50ms);
        if (!set_link(netns_b, dev_b, true)) return fail("link up failed");
        // The targets' lanes whose initiator side was reset while the link was
        // down never saw the RST: they stay until tcp keepalive finds them dead
        // (keepalive_s in the targets' policy; 2 s in soak-netns.yaml.in, so by
        // 2 + 3 x 1 s). Samples taken until then are not quiet either.
        const auto settled_at = Clock::now() + std::chrono::milliseconds(opt.link_settle_ms);
        while (!stop && Clock::now() < settled_at) std::this_thread::sleep_for(50ms);
      }
    });
  if (failed) stop = true;
  sampler.join();
  for (auto& w : workers) w.join();
  if (link_fault.joinable()) link_fault.join();
  const double ran_s = since_start();
  if (!failed) take_samples();  // the last one, before anything is torn down
  std::vector<unsigned long long> digests;
  for (auto& t : targets) {
    digests.push_back(t->digest.load());
    t->stop_target();
  }
  targets.clear();
  engine.reset();

  // ---- report ----
  if (csv.is_open() && !csv) std::fprintf(stderr, "could not write %s\n", opt.report.c_str());
  std::printf(
      "\nsamples (RSS MiB / fds / threads; * = long-lived, held to the plateau; ~ = taken "
      "during a restart, not judged)\n");
  std::printf("%8s", "t_s");
  for (const auto& s : series) std::printf(" %18s", (s.name + (s.long_lived ? "*" : "")).c_str());
  std::printf("\n");
  size_t rows = series[0].samples.size();
  for (size_t r = 0; r < rows; ++r) {
    double t = series[0].samples[r].t;
    std::printf("%7.1f%c", t, series[0].samples[r].quiet ? ' ' : '~');
    for (const auto& s : series) {
      auto it = std::find_if(s.samples.begin(), s.samples.end(),
                             [&](const Sample& x) { return std::abs(x.t - t) < 0.5; });
      if (it == s.samples.end())
        std::printf(" %18s", "-");
      else {
        char cell[64];
        std::snprintf(cell, sizeof cell, "%s/%ld/%ld", mib(it->rss_kib).c_str(), it->fds,
                      it->threads);
        std::printf(" %18s", cell);
      }
    }
    std::printf("\n");
  }

  // Plateau: over the quiet samples (no target restart in progress, so no
  // sockets of a dying or newborn incarnation are counted), the max over the
  // second half of the run may exceed the max over the first half by at most
  //   fds, threads: 2. The first half holds the warm-up (every connection and
  //     thread the backend keeps per peer) and restarts too (at most a quarter of
  //     the run apart), so the steady state after a restart is in it already; 2
  //     covers a lane (socket + thread) caught mid-close or mid-connect outside a
  //     restart. A leak of one fd or thread per restart (several restarts per
  //     half) or per transfer (thousands) exceeds it.
  //   RSS: 8 MiB. Regions are touched before the first sample; what remains is
  //     malloc arenas and per-connection buffers that grow to the largest
  //     transfer seen (max item 4 MiB) within the first seconds. Clean 60 s runs
  //     grow < 0.5 MiB from half to half. Not 10 %: most of these processes is
  //     their registered regions (the initiator's 96 MiB), so 10 % would hide a
  //     leak of ~13 MiB. A leak of 4 KiB per transfer exceeds 8 MiB within ~2000
  //     transfers (the 60 s run does ~3000 per half); in the 30-minute run one of
  //     ~100 bytes per transfer does.
  bool plateau_ok = true;
  std::printf(
      "\nplateau (max of the quiet samples of the first half -> of the second half; first / last "
      "/ max of all):\n");
  const double half = ran_s / 2;
  for (const auto& s : series) {
    if (s.samples.empty()) continue;
    Sample f1{0, 0, 0, 0, 0}, f2{0, 0, 0, 0, 0}, all{0, 0, 0, 0, 0};
    size_t n1 = 0, n2 = 0;
    for (const auto& x : s.samples) {
      all.rss_kib = std::max(all.rss_kib, x.rss_kib);
      all.fds = std::max(all.fds, x.fds);
      all.threads = std::max(all.threads, x.threads);
      if (!x.quiet) continue;
      Sample& h = x.t < half ? f1 : f2;
      (x.t < half ? n1 : n2)++;
      h.rss_kib = std::max(h.rss_kib, x.rss_kib);
      h.fds = std::max(h.fds, x.fds);
      h.threads = std::max(h.threads, x.threads);
    }
    const Sample &first = s.samples.front(), &last = s.samples.back();
    std::string verdict = "not held (restarted)";
    if (s.long_lived) {
      if (n1 < 2 || n2 < 2) {
        verdict = "too few samples to judge";
        plateau_ok = false;
      } else {
        const long rss_slack = 8 * 1024;
        std::vector<std::string> bad;
        if (f2.rss_kib > f1.rss_kib + rss_slack) bad.push_back("RSS");
        if (f2.fds > f1.fds + 2) bad.push_back("fds");
        if (f2.threads > f1.threads + 2) bad.push_back("threads");
        verdict = bad.empty() ? "plateau" : "GROWING:";
        for (auto& b : bad) verdict += " " + b;
        if (!bad.empty()) plateau_ok = false;
      }
    }
    std::printf(
        "  %-5s RSS %s -> %s MiB (%s / %s / %s), fds %ld -> %ld (%ld / %ld / %ld), threads %ld "
        "-> %ld (%ld / %ld / %ld): %s\n",
        s.name.c_str(), mib(f1.rss_kib).c_str(), mib(f2.rss_kib).c_str(),
        mib(first.rss_kib).c_str(), mib(last.rss_kib).c_str(), mib(all.rss_kib).c_str(), f1.fds,
        f2.fds, first.fds, last.fds, all.fds, f1.threads, f2.threads, first.threads, last.threads,
        all.threads, verdict.c_str());
  }

  auto u = [](const std::atomic<uint64_t>& a) { return static_cast<unsigned long long>(a.load()); };
  std::printf(
      "\nsummary: %.1f s, seed %llu\n"
      "  transfers %llu (%llu items; %llu READ, %llu WRITE; engine %llu, session %llu, "
      "one-off session %llu; single %llu, batch %llu), windows %llu\n"
      "  bytes verified %.1f MiB (every byte), notifications checked %llu, absent-as-asked %llu, "
      "local re-registrations %llu\n"
      "  restarts %llu (SIGKILL %llu, quit %llu, overlapping %llu; re-registered before collecting "
      "the old window %llu; in flight at the stop %llu, at an overlapping re-registration %llu; "
      "stale-session failures %llu)\n"
      "  failures-by-restart %llu (max %llu ms after submission; codes:",
      ran_s, static_cast<unsigned long long>(opt.seed), u(C.transfers), u(C.items), u(C.reads),
      u(C.writes), u(C.via_engine), u(C.via_session), u(C.via_transient), u(C.singles),
      u(C.batches), u(C.windows), static_cast<double>(C.bytes_verified.load()) / (1 << 20),
      u(C.notify_checked), u(C.silence_checked), u(C.local_reregister),
      static_cast<unsigned long long>(C.restarts_kill + C.restarts_quit + C.restarts_overlap),
      u(C.restarts_kill), u(C.restarts_quit), u(C.restarts_overlap), u(C.early_reregister),
      u(C.inflight_at_stop), u(C.inflight_at_reregister), u(C.stale_session_failures),
      u(C.restart_failures), u(C.max_fail_ms));
  for (const auto& [code, n] : restart_codes)
    std::printf(" %s %llu", code.c_str(), static_cast<unsigned long long>(n));
  std::printf(
      ")\n  restart-window transfers that succeeded: READ verified %llu, unverifiable (a "
      "WRITE to a target gone, a READ whose stopped target could not fill it) %llu\n",
      u(C.restart_ok_verified), u(C.restart_ok_unverified));
  std::printf("  cancels %llu: ended cancelled %llu, succeeded (the cancel came too late) %llu\n",
              u(C.cancels), u(C.cancelled), u(C.cancel_too_late));
  std::printf(
      "  peers deregistered mid-window and registered again %llu (while the window was in flight "
      "%llu; transfers in flight at the deregistration %llu)\n",
      u(C.peer_reregisters), u(C.peer_reregister_early), u(C.inflight_at_peer_dereg));
  std::printf(
      "  data link down for 1.3 deadlines %llu times\n"
      "  stops longer than the deadline %llu: outcome unknown %llu, WRITEs that succeeded and "
      "were verified after SIGCONT %llu\n",
      u(C.link_downs), u(C.stops), u(C.stop_unknown), u(C.stop_writes_verified));
  for (const auto& m : restart_messages) std::printf("    e.g. \"%s\"\n", m.c_str());
  std::printf("  op stream digest (first %llu windows per target, same seed -> same digest):",
              static_cast<unsigned long long>(Target::kDigestWindows));
  for (size_t i = 0; i < digests.size(); ++i) std::printf(" t%zu %016llx", i, digests[i]);
  std::printf("\n");
  for (const auto& e : errors) std::printf("  FAILURE: %s\n", e.c_str());
  const bool ok = !failed && plateau_ok;
  std::printf("soak %s\n", ok ? "PASSED" : "FAILED");
  return ok ? 0 : 1;
}
