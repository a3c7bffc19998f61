// SPDX-License-Identifier: Apache-2.0
// Faults on a real link (issue 9 item 4). Two network namespaces joined by a
// veth pair (tests/netns/netns_pair.sh --same-node --ctrl-link, policy
// faults.yaml.in): this process is the initiator in namespace A, a
// ferry-test-peer is the target in B. tcp runs over the data link (veth-a <->
// veth-b); the engines' control planes run over a second veth pair, so a fault
// on the data link hits the data path only. cma (process_vm_*, no network) is
// the fallback for WRITEs; READs are tcp-only.
//
// Faults: the data link goes down; the target is SIGKILLed; the target is
// restarted under the same engine key; its TCP connections are reset (ss -K);
// the link is slow (netem delay+loss, or a tbf rate limit). Each is injected
// while large transfers are in flight (the link's byte counters prove it), and
// each case checks that
//   - every transfer ends within its deadline (+ slack): SUCCESS with verified
//     data and one notification, or a failure with a clear message;
//   - WRITEs fail over to cma while the peer lives, with correct data;
//   - tcp itself works again once the fault is gone;
//   - nothing of a failed tcp attempt lands later: WRITEs that succeeded on cma
//     while the link was down still hold their data once the link is back and
//     the cut connections can deliver nothing more;
//   - the initiator leaks nothing: open fds return to the baseline, RSS stays
//     within a bound (see kRssSlackKiB).
// Lines starting with "RESULT" carry the measured numbers (tests/faults/RESULTS.md).
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "pattern.h"
#include "proc_self.h"

using namespace ferry;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;

namespace {

// Per attempt: EngineConfig::timeout here and in the peer (faults.yaml.in says the same).
constexpr ms kTimeout = 2000ms;
constexpr int kAttempts = 2;  // tcp, then cma (failover.max_attempts)
// The core's watchdog ends an attempt this long after its deadline when the
// plugin does not (kWatchdogGrace in core/src/transfer.cpp).
constexpr ms kWatchdogGrace = 1000ms;
// The longest any transfer may take: each attempt runs to its deadline and the
// watchdog's grace. Measured from the fault, since the transfers began before it.
constexpr ms kDeadline = kAttempts * (kTimeout + kWatchdogGrace);
// Scheduling noise on a loaded 2-core CI machine (hashing 64 MiB in another
// thread, the peer process, the kernel's softirq work for the veth).
constexpr ms kSlack = 2000ms;

// Each wave moves kSlots transfers of kSlot bytes, slot i at offset i * kSlot on
// both sides: even slots WRITE, odd slots READ, so no two transfers touch the
// same bytes and each one is verified on its own.
constexpr size_t kSlot = 16u << 20;
constexpr int kSlots = 8;
constexpr size_t kRegion = kSlot * kSlots;
// The fault is injected once this much has crossed the data link in this wave.
constexpr uint64_t kInFlightBytes = 8u << 20;

// RSS may grow by this much over the fault cycles that follow the baseline. The
// test's own buffers are allocated and touched before the baseline; what may
// still move is allocator caching: glibc gives threads their own malloc arenas
// and keeps freed chunks there, and the tcp plugin's lane threads (restarted
// after each fault) each allocate a 16 KiB read-ahead buffer and a stack of which
// a few pages are touched. That is well under 16 MiB; a leaked transfer buffer or
// a per-cycle copy of a slot (16 MiB each) would exceed it.
constexpr long kRssSlackKiB = 16 * 1024;

// ---- the environment netns_pair.sh provides --------------------------------------

struct NetEnv {
  std::string ns_b, addr_a, addr_b, dev_a, dev_b;
  std::vector<std::string> peer_wrapper;
  std::string initiator_host;
};

std::string env_or(const char* name, const char* dflt = "") {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

std::optional<NetEnv> net_env() {
  NetEnv e;
  e.ns_b = env_or("FERRY_NETNS_B");
  e.addr_a = env_or("FERRY_NETNS_ADDR_A");
  e.addr_b = env_or("FERRY_NETNS_ADDR_B");
  e.dev_a = env_or("FERRY_NETNS_DEV_A", "veth-a");
  e.dev_b = env_or("FERRY_NETNS_DEV_B", "veth-b");
  e.initiator_host = env_or("FERRY_TEST_INITIATOR_HOST");
  std::istringstream words(env_or("FERRY_TEST_PEER_WRAPPER"));
  for (std::string w; words >> w;) e.peer_wrapper.push_back(w);
  if (e.ns_b.empty() || e.addr_a.empty() || e.peer_wrapper.empty() ||
      env_or("FERRY_NETNS_CTRL_ADDR_A").empty())
    return std::nullopt;
  return e;
}

#define NEED_NETNS(env)                                                              \
  auto env##_opt = net_env();                                                        \
  if (!env##_opt)                                                                    \
    GTEST_SKIP() << "run through tests/netns/netns_pair.sh --same-node --ctrl-link " \
                    "--policy tests/faults/faults.yaml.in (ctest -L faults does)";   \
  const NetEnv& env = *env##_opt

// ---- small system helpers ----------------------------------------------------------

std::string which(const std::string& prog) {
  std::istringstream path(env_or("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"));
  for (std::string dir; std::getline(path, dir, ':');) {
    std::string p = dir + "/" + prog;
    if (access(p.c_str(), X_OK) == 0) return p;
  }
  return {};
}

// Runs argv (argv[0] looked up in PATH) to completion; stdout and stderr go to
// *out. Returns the exit status, or -1 when it could not run.
int run(std::vector<std::string> argv, std::string* out = nullptr) {
  std::string prog = which(argv[0]);
  if (prog.empty()) {
    if (out) *out = argv[0] + ": not found";
    return -1;
  }
  argv[0] = prog;
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  pid_t pid = fork();
  if (pid < 0) {
    close(p[0]);
    close(p[1]);
    return -1;
  }
  if (pid == 0) {
    dup2(p[1], 1);
    dup2(p[1], 2);
    execv(args[0], args.data());
    _exit(127);
  }
  close(p[1]);
  std::string text;
  char buf[4096];
  for (ssize_t k; (k = read(p[0], buf, sizeof buf)) != 0;) {
    if (k < 0) {
      if (errno == EINTR) continue;
      break;
    }
    text.append(buf, static_cast<size_t>(k));
  }
  close(p[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  while (!text.empty() && text.back() == '\n') text.pop_back();
  if (out) *out = text;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

std::vector<std::string> in_b(const NetEnv& env, std::vector<std::string> argv) {
  argv.insert(argv.begin(), {"ip", "netns", "exec", env.ns_b});
  return argv;
}

size_t open_fds() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  return n - 1;  // the directory stream's own fd
}

std::string fd_list() {
  std::string s;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char target[256] = {};
      std::string p = std::string("/proc/self/fd/") + e->d_name;
      ssize_t k = readlink(p.c_str(), target, sizeof target - 1);
      s += std::string(" ") + e->d_name + "=" + (k > 0 ? target : "?");
    }
    closedir(d);
  }
  return s;
}

// Sockets and threads are closed by the plugin's and core's own threads just
// after a status ends: wait (bounded) for the count to come back down.
size_t fds_settled(size_t want, ms limit = 3000ms) {
  auto end = Clock::now() + limit;
  size_t n = open_fds();
  while (n != want && Clock::now() < end) {
    std::this_thread::sleep_for(5ms);
    n = open_fds();
  }
  return n;
}

uint64_t read_u64(const std::string& path) {
  std::ifstream f(path);
  uint64_t v = 0;
  f >> v;
  return v;
}

// Bytes through this side's end of the data link, both directions.
uint64_t link_bytes(const NetEnv& env) {
  std::string base = "/sys/class/net/" + env.dev_a + "/statistics/";
  return read_u64(base + "tx_bytes") + read_u64(base + "rx_bytes");
}

// B answers on the data link again: a TCP connect to a closed port on B is
// refused (an answer), rather than failing with "no route" while the neighbour
// entry is still marked failed from the outage. Bounded; returns the last error.
std::string wait_reachable(const NetEnv& env, ms limit = 10000ms) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(9);
  inet_pton(AF_INET, env.addr_b.c_str(), &sa.sin_addr);
  auto end = Clock::now() + limit;
  std::string last = "no attempt";
  while (Clock::now() < end) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return std::strerror(errno);
    int rc = connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      err = poll(&pfd, 1, 500) == 1 ? 0 : ETIMEDOUT;
      socklen_t sl = sizeof err;
      if (err == 0) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl);
    }
    close(fd);
    if (err == ECONNREFUSED || err == 0) return {};
    last = std::strerror(err);
    std::this_thread::sleep_for(20ms);
  }
  return last;
}

// One line of `ss -H -t -n -a`: state, recv-q, send-q, local, peer.
struct SockLine {
  std::string state;
  long recv_q = 0, send_q = 0;
  int local_port = 0, peer_port = 0;
};
std::vector<SockLine> tcp_sockets(const std::vector<std::string>& ss_argv) {
  std::string out;
  std::vector<SockLine> v;
  if (run(ss_argv, &out) != 0) return v;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    std::istringstream f(line);
    SockLine s;
    std::string local, peer;
    if (!(f >> s.state >> s.recv_q >> s.send_q >> local >> peer)) continue;
    s.local_port = std::atoi(local.substr(local.rfind(':') + 1).c_str());
    s.peer_port = std::atoi(peer.substr(peer.rfind(':') + 1).c_str());
    v.push_back(s);
  }
  return v;
}

// The local ports of this side's data connections to B (the tcp lanes).
std::vector<int> lane_ports(const NetEnv& env) {
  std::vector<int> ports;
  for (const auto& s :
       tcp_sockets({"ss", "-H", "-t", "-n", "state", "established", "dst", env.addr_b}))
    ports.push_back(s.local_port);
  return ports;
}

// Nothing of the old lanes can reach the target's memory any more: on this side
// each is gone or has had all it sent acknowledged (FIN-WAIT-2, TIME-WAIT), and
// on B each is gone or has nothing left unread. Bounded; false on timeout.
bool wait_old_lanes_drained(const NetEnv& env, const std::vector<int>& ports, ms limit,
                            std::string* why) {
  auto old = [&](int p) { return std::find(ports.begin(), ports.end(), p) != ports.end(); };
  auto end = Clock::now() + limit;
  for (;;) {
    std::ostringstream pending;
    for (const auto& s : tcp_sockets({"ss", "-H", "-t", "-n", "-a", "dst", env.addr_b}))
      if (old(s.local_port) && s.state != "FIN-WAIT-2" && s.state != "TIME-WAIT")
        pending << " A:" << s.local_port << " " << s.state << " send-q " << s.send_q << ";";
    for (const auto& s : tcp_sockets(in_b(env, {"ss", "-H", "-t", "-n", "-a", "dst", env.addr_a})))
      if (old(s.peer_port) && s.recv_q > 0)
        pending << " B<-" << s.peer_port << " " << s.state << " recv-q " << s.recv_q << ";";
    if (pending.str().empty()) return true;
    if (Clock::now() >= end) {
      *why = pending.str();
      return false;
    }
    std::this_thread::sleep_for(20ms);
  }
}

long ms_since(Clock::time_point t) {
  return static_cast<long>(std::chrono::duration_cast<ms>(Clock::now() - t).count());
}

// ---- the target process --------------------------------------------------------------

struct Peer {
  Peer(const NetEnv& env, size_t region)
      : child([&] {
          auto argv = env.peer_wrapper;
          for (std::string a :
               {std::string(FERRY_TEST_PEER), std::string("target"), std::string("tcp,cma"),
                std::to_string(region), std::to_string(kTimeout.count())})
            argv.push_back(a);
          return argv;
        }()) {
    std::string ready = child.read_line(60000);
    std::istringstream in(ready);
    std::string word, ehex, mhex;
    in >> word >> ehex >> mhex;
    if (word != "READY") throw std::runtime_error("peer did not start: '" + ready + "'");
    desc = EngineDesc::unpack(test::from_hex(ehex));
    mem = MemoryDesc::unpack(test::from_hex(mhex));
  }
  test::ChildProcess child;
  EngineDesc desc;
  MemoryDesc mem;
};

// ---- one wave of transfers -----------------------------------------------------------

struct Xfer {
  Op op;
  size_t off, len;
  TransferUid uid;
  TransferStatus st;
};

struct Tally {
  int writes_ok = 0, writes_failed = 0, reads_ok = 0, reads_failed = 0;
  int transport = 0, timeout = 0;  // failure codes
  int target_saw_success = 0;      // failed here, yet the target recorded it as landed
  long last_end_ms = 0;            // from the fault (or from the post) to the last end
  std::string first_error;
  int ok() const { return writes_ok + reads_ok; }
  int failed() const { return writes_failed + reads_failed; }
};

// The initiator engine in this process and the target in namespace B.
class Rig {
 public:
  explicit Rig(const NetEnv& env) : env_(env), local_(kRegion) {
    EngineConfig cfg;
    cfg.host = env.initiator_host;
    cfg.timeout = kTimeout;
    engine_ = std::make_unique<Engine>("initiator", cfg);
    for (const char* b : {"tcp", "cma"})
      if (Result r = engine_->add_backend(b); !r)
        throw std::runtime_error(std::string(b) + ": " + r.message);
    mem_ = engine_->register_memory(local_.data(), local_.size());
  }
  ~Rig() {
    peer_.reset();
    engine_.reset();
  }

  // Starts a target under the key "target" (again, after a restart) and
  // registers it both ways.
  void start_peer() {
    peer_.reset();
    peer_ = std::make_unique<Peer>(env_, kRegion);
    if (Result r = engine_->register_remote_engine(peer_->desc); !r)
      throw std::runtime_error("register_remote_engine: " + r.message);
    std::string ok = peer_->child.ask("register " + test::to_hex(engine_->desc().pack()));
    if (ok != "OK") throw std::runtime_error("target register: " + ok);
  }
  void kill_peer() { peer_->child.kill_now(); }

  // Fresh data on both sides, then every slot's transfer posted at once.
  std::vector<Xfer> post_wave(uint64_t seed, size_t len = kSlot) {
    std::ostringstream fill;
    fill << "fill " << seed + 1 << " " << kSlots / 2;
    for (int i = 0; i < kSlots; ++i) {
      size_t off = i * kSlot;
      if (i % 2 == 0) {
        test::fill_pattern(local_.data(), off, len, seed);
      } else {
        std::fill_n(local_.data() + off, len, uint8_t{0});
        fill << " " << off << " " << len;
      }
    }
    EXPECT_EQ(peer_->child.ask(fill.str()), "OK");
    read_seed_ = seed + 1;
    std::vector<Xfer> w;
    for (int i = 0; i < kSlots; ++i) {
      Xfer x{
          i % 2 == 0 ? Op::WRITE : Op::READ, i * kSlot, len, engine_->allocate_transfer_uid(), {}};
      x.st = x.op == Op::WRITE ? engine_->write(mem_, x.off, peer_->mem, x.off, len, x.uid)
                               : engine_->read(mem_, x.off, peer_->mem, x.off, len, x.uid);
      w.push_back(x);
    }
    return w;
  }

  static int in_progress(const std::vector<Xfer>& w) {
    int n = 0;
    for (const auto& x : w) n += x.st.InProgress();
    return n;
  }

  // Waits (bounded) until kInFlightBytes crossed the data link since `before`
  // with transfers of the wave still running: then a fault hits them mid-flight.
  bool wait_in_flight(const std::vector<Xfer>& w, uint64_t before) {
    auto end = Clock::now() + 20s;
    while (Clock::now() < end) {
      if (in_progress(w) == 0) return false;
      if (link_bytes(env_) - before >= kInFlightBytes) return true;
      std::this_thread::sleep_for(200us);
    }
    return false;
  }

  // Waits for the wave to end (bounded: kDeadline + kSlack from `since`) and
  // checks every transfer: SUCCESS with verified data and exactly one inbound
  // notification (when the target still lives), or a failure with a message
  // naming the backend(s) it failed on.
  Tally settle(std::vector<Xfer>& w, Clock::time_point since, bool peer_alive,
               const std::string& what) {
    Tally t;
    std::vector<TransferStatus> sts;
    for (auto& x : w) sts.push_back(x.st);
    ms left =
        std::max(ms(0), kDeadline + kSlack - std::chrono::duration_cast<ms>(Clock::now() - since));
    bool ended = wait_all(sts, left);
    t.last_end_ms = ms_since(since);
    EXPECT_TRUE(ended) << what << ": a transfer did not end within " << (kDeadline + kSlack).count()
                       << " ms of the fault";
    EXPECT_LE(t.last_end_ms, (kDeadline + kSlack).count()) << what;
    if (!ended) return t;
    for (auto& x : w) {
      const bool write = x.op == Op::WRITE;
      if (x.st.Succeeded()) {
        (write ? t.writes_ok : t.reads_ok)++;
        if (write && peer_alive) {
          std::string h =
              peer_->child.ask("hash 1 " + std::to_string(x.off) + " " + std::to_string(x.len));
          EXPECT_EQ(h, "HASH " + std::to_string(test::fnv1a(local_.data() + x.off, x.len)))
              << what << ": WRITE at " << x.off << " reported SUCCESS (" << x.st.Message()
              << ") but the target holds other bytes";
        }
        if (!write) {
          EXPECT_EQ(test::find_mismatch(local_.data(), x.off, x.len, read_seed_, x.off), -1)
              << what << ": READ at " << x.off << " reported SUCCESS (" << x.st.Message()
              << ") with wrong bytes";
        }
        if (peer_alive) {
          std::string pop = "pop initiator " + std::to_string(x.uid);
          EXPECT_EQ(peer_->child.ask(pop + " 5000", 40000), "INBOUND SUCCESS")
              << what << ": uid " << x.uid;
          EXPECT_EQ(peer_->child.ask(pop + " 0"), "NONE")
              << what << ": uid " << x.uid << " notified twice";
        }
      } else {
        (write ? t.writes_failed : t.reads_failed)++;
        t.transport += x.st.Code() == StatusCode::ERR_TRANSPORT;
        t.timeout += x.st.Code() == StatusCode::ERR_TIMEOUT;
        EXPECT_TRUE(x.st.Failed()) << what << ": " << to_string(x.st.Code());
        EXPECT_NE(x.st.Message().find("tcp"), std::string::npos)
            << what << ": the error should name the backend: '" << x.st.Message() << "'";
        if (t.first_error.empty())
          t.first_error = std::string(to_string(x.st.Code())) + ": " + x.st.Message();
        // Observed, not asserted: e.g. a READ whose last byte the target sent
        // (after recording the landing) just before the link went down.
        if (peer_alive)
          t.target_saw_success += peer_->child.ask("pop initiator " + std::to_string(x.uid) +
                                                   " 0") == "INBOUND SUCCESS";
      }
    }
    return t;
  }

  // A wave with no fault: every transfer succeeds on tcp itself (not on cma).
  std::vector<Xfer> clean_wave(uint64_t seed, const std::string& what) {
    uint64_t tcp_before = engine_->stats().backends["tcp"].transfers;
    auto start = Clock::now();
    auto w = post_wave(seed);
    auto posted = Clock::now();
    std::vector<TransferStatus> sts;
    for (auto& x : w) sts.push_back(x.st);
    wait_all(sts, kDeadline + kSlack);
    std::printf("RESULT %s: %d x %zu MiB in %ld ms after post (%ld ms with the fills)\n",
                what.c_str(), kSlots, kSlot >> 20, ms_since(posted), ms_since(start));
    Tally t = settle(w, start, true, what);
    EXPECT_EQ(t.ok(), kSlots) << what << ": " << t.first_error;
    EXPECT_EQ(engine_->stats().backends["tcp"].transfers - tcp_before, uint64_t{kSlots})
        << what << ": the transfers should run on tcp again";
    return w;
  }

  // The WRITEs of a finished wave still hold their data at the target: nothing
  // of an earlier, failed attempt landed on top of them afterwards.
  void verify_writes_again(const std::vector<Xfer>& w, const std::string& what) {
    for (const auto& x : w) {
      if (x.op != Op::WRITE || !x.st.Succeeded()) continue;
      std::string h =
          peer_->child.ask("hash 1 " + std::to_string(x.off) + " " + std::to_string(x.len));
      EXPECT_EQ(h, "HASH " + std::to_string(test::fnv1a(local_.data() + x.off, x.len)))
          << what << ": the WRITE at " << x.off << " (uid " << x.uid
          << ") was overwritten after it succeeded: bytes of a timed-out tcp attempt landed "
             "later";
    }
  }

  const NetEnv& env_;
  std::vector<uint8_t> local_;
  std::unique_ptr<Engine> engine_;
  MemoryDesc mem_;
  std::unique_ptr<Peer> peer_;
  uint64_t read_seed_ = 0;
};

void report(const std::string& what, int cycle, int in_flight, const Tally& t, ms bound) {
  std::printf(
      "RESULT %s cycle=%d in_flight_at_fault=%d writes_ok=%d writes_failed=%d reads_ok=%d "
      "reads_failed=%d (transport=%d timeout=%d target_saw_success=%d) last_end_ms=%ld "
      "bound_ms=%ld%s%s\n",
      what.c_str(), cycle, in_flight, t.writes_ok, t.writes_failed, t.reads_ok, t.reads_failed,
      t.transport, t.timeout, t.target_saw_success, t.last_end_ms, static_cast<long>(bound.count()),
      t.first_error.empty() ? "" : " first_error=", t.first_error.c_str());
  std::fflush(stdout);
}

// Baselines for the leak checks: fds before the rig exists, and fds/RSS of the
// running rig after the first fault cycle (which opens the connections that
// stay: the control connection its first failover's notification opens, say).
struct LeakCheck {
  size_t fds_before_rig = open_fds();
  size_t fds_base = 0;
  long rss_base = 0;
  bool have_base = false;
  void baseline() {
    fds_base = open_fds();
    rss_base = test::rss_kib();
    have_base = true;
  }
  // At the start of a fault cycle: the baseline is taken once the engine is
  // warm, i.e. once a failover happened (the first WRITE re-run on cma opens the
  // control connection its notification needs, which stays open). At least one
  // whole fault cycle must follow the baseline.
  void baseline_when_warm(Engine& e, int cycle, int cycles) {
    // A fence (of a WRITE cut mid-way) opens control connections too.
    if (have_base || (e.stats().backends["cma"].transfers == 0 && e.stats().fences == 0)) return;
    std::printf("RESULT leak baseline taken at the start of cycle %d of %d\n", cycle, cycles);
    baseline();
  }
  void after_cycles_checked(const std::string& what, bool require_warm = true) {
    if (!require_warm && !have_base) {
      std::printf(
          "RESULT %s no cycle needed a failover or a fence; fds are checked after "
          "teardown only\n",
          what.c_str());
      return;
    }
    EXPECT_TRUE(have_base) << what << ": no fault cycle ended in a failover or a fence";
    if (have_base) after_cycles(what);
  }
  void after_cycles(const std::string& what) {
    size_t fds = fds_settled(fds_base);
    long rss = test::rss_kib();
    std::printf("RESULT %s fds baseline=%zu after=%zu rss_kib baseline=%ld after=%ld (+%ld)\n",
                what.c_str(), fds_base, fds, rss_base, rss, rss - rss_base);
    EXPECT_EQ(fds, fds_base) << what << ": fds leaked over the fault cycles:" << fd_list();
    EXPECT_LE(rss - rss_base, kRssSlackKiB) << what << ": RSS grew over the fault cycles";
  }
  void after_teardown(const std::string& what) {
    size_t fds = fds_settled(fds_before_rig);
    std::printf("RESULT %s fds before_rig=%zu after_teardown=%zu\n", what.c_str(), fds_before_rig,
                fds);
    EXPECT_EQ(fds, fds_before_rig)
        << what << ": fds left after the engine was destroyed:" << fd_list();
  }
};

constexpr int kCycles = 3;

bool set_link(const NetEnv& env, bool up) {
  std::string out;
  int rc = run({"ip", "-n", env.ns_b, "link", "set", env.dev_b, up ? "up" : "down"}, &out);
  EXPECT_EQ(rc, 0) << out;
  return rc == 0;
}

// Carrier on this side's end again (bounded).
bool wait_carrier(const NetEnv& env) {
  auto end = Clock::now() + 5s;
  while (Clock::now() < end) {
    if (read_u64("/sys/class/net/" + env.dev_a + "/carrier") == 1) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

// ---- the cases -----------------------------------------------------------------------

// 1. The data link goes down while 128 MiB are in flight: WRITEs fail over to
// cma (data verified, target notified once), READs fail with ERR_TIMEOUT at
// their deadline. Link up: tcp carries a full wave again.
TEST(LinkFault, LinkDownMidTransfer) {
  NEED_NETNS(env);
  LeakCheck leaks;
  {
    Rig rig(env);
    rig.start_peer();
    rig.clean_wave(1, "link_down warm-up");
    for (int c = 1; c <= kCycles; ++c) {
      const std::string cyc = "link_down cycle " + std::to_string(c);
      leaks.baseline_when_warm(*rig.engine_, c, kCycles);
      const auto lanes = lane_ports(env);
      uint64_t before = link_bytes(env);
      auto w = rig.post_wave(100 + c);
      ASSERT_TRUE(rig.wait_in_flight(w, before)) << "the wave ended before it was in flight";
      int in_flight = Rig::in_progress(w);
      ASSERT_TRUE(set_link(env, false));
      auto fault = Clock::now();
      EXPECT_GT(in_flight, 0) << "the wave ended before the link went down";
      Tally t = rig.settle(w, fault, true, cyc);
      report("link_down", c, in_flight, t, kDeadline + kSlack);
      EXPECT_EQ(t.writes_failed, 0) << "WRITEs must fail over to cma: " << t.first_error;
      EXPECT_EQ(t.transport + t.timeout, t.failed()) << t.first_error;

      // The application goes on during the outage: WRITEs go to cma, READs fail.
      auto during = Clock::now();
      auto w2 = rig.post_wave(150 + c);
      Tally t2 = rig.settle(w2, during, true, cyc + " (link still down)");
      report("link_down_during", c, kSlots, t2, kDeadline + kSlack);
      EXPECT_EQ(t2.writes_ok, kSlots / 2) << t2.first_error;
      EXPECT_EQ(t2.reads_ok, 0);

      ASSERT_TRUE(set_link(env, true));
      auto up = Clock::now();
      ASSERT_TRUE(wait_carrier(env));
      std::string unreachable = wait_reachable(env);
      ASSERT_EQ(unreachable, "") << "B does not answer on the data link after it came back up";
      long reachable_ms = ms_since(up);
      // The lanes the fault cut had WRITE payload of the timed-out attempts queued.
      // Once nothing of theirs can reach the target any more, the WRITEs that
      // succeeded on cma during the outage must still be what the target holds.
      std::vector<int> old;
      const auto now_up = lane_ports(env);
      for (int p : lanes)
        if (std::find(now_up.begin(), now_up.end(), p) == now_up.end()) old.push_back(p);
      EXPECT_FALSE(old.empty()) << "the fault cut no lane";
      std::string why;
      auto drain = Clock::now();
      EXPECT_TRUE(wait_old_lanes_drained(env, old, 15000ms, &why))
          << "the lanes cut by the fault still hold data:" << why;
      std::printf(
          "RESULT link_down cycle=%d reachable_after_up_ms=%ld old_lanes=%zu drained_ms=%ld\n", c,
          reachable_ms, old.size(), ms_since(drain));
      rig.verify_writes_again(w2, cyc + " (outage WRITEs after the link came back)");
      rig.clean_wave(200 + c, "link_down recovery " + std::to_string(c));
    }
    auto st = rig.engine_->stats();
    EXPECT_GT(st.backends["tcp"].failovers, 0u);
    EXPECT_GT(st.backends["cma"].transfers, 0u);
    leaks.after_cycles_checked("link_down");
  }
  leaks.after_teardown("link_down");
}

// 2. The target is SIGKILLed mid-transfer: everything in flight fails with a
// clear error (tcp: the connection is reset by the dying process; cma: the
// process is gone) well within the deadline; READs that finished are verified.
// Transfers posted afterwards fail too, and deregistering the dead peer frees
// what it held.
TEST(LinkFault, PeerKilledMidTransfer) {
  NEED_NETNS(env);
  LeakCheck leaks;
  {
    Rig rig(env);
    leaks.baseline();  // engine up, no peer yet
    rig.start_peer();
    rig.clean_wave(1, "peer_killed warm-up");
    uint64_t before = link_bytes(env);
    auto w = rig.post_wave(300);
    ASSERT_TRUE(rig.wait_in_flight(w, before)) << "the wave ended before it was in flight";
    int in_flight = Rig::in_progress(w);
    rig.kill_peer();
    auto fault = Clock::now();
    Tally t = rig.settle(w, fault, false, "peer_killed");
    report("peer_killed", 1, in_flight, t, kDeadline + kSlack);
    EXPECT_GT(t.failed(), 0) << "transfers were in flight when the target died";
    // Later transfers to the dead peer fail as well, within the same bound.
    auto after = Clock::now();
    std::vector<Xfer> late;
    for (Op op : {Op::WRITE, Op::READ}) {
      TransferUid uid = rig.engine_->allocate_transfer_uid();
      auto st = op == Op::WRITE ? rig.engine_->write(rig.mem_, 0, rig.peer_->mem, 0, 1u << 20, uid)
                                : rig.engine_->read(rig.mem_, 0, rig.peer_->mem, 0, 1u << 20, uid);
      late.push_back({op, 0, 1u << 20, uid, st});
    }
    Tally lt = rig.settle(late, after, false, "peer_killed later");
    report("peer_killed_later", 1, 2, lt, kDeadline + kSlack);
    EXPECT_EQ(lt.failed(), 2);
    ASSERT_TRUE(rig.engine_->deregister_remote_engine("target"));
    rig.peer_.reset();
    leaks.after_cycles("peer_killed (dead peer deregistered)");
  }
  leaks.after_teardown("peer_killed");
}

// 3. The target is killed mid-transfer and a new process starts under the same
// engine key; the initiator registers the new descriptor over the old one (the
// core drops the old peer first) and full verified waves run on tcp again.
TEST(LinkFault, PeerRestartedWithSameKey) {
  NEED_NETNS(env);
  LeakCheck leaks;
  {
    Rig rig(env);
    rig.start_peer();
    rig.clean_wave(1, "peer_restart warm-up");
    for (int c = 1; c <= kCycles; ++c) {
      if (c == 2) leaks.baseline();
      uint64_t before = link_bytes(env);
      auto w = rig.post_wave(400 + c);
      ASSERT_TRUE(rig.wait_in_flight(w, before)) << "the wave ended before it was in flight";
      const uint32_t old_pid = rig.peer_->desc.pid;
      const MemoryDesc old_mem = rig.peer_->mem;
      int in_flight = Rig::in_progress(w);
      rig.kill_peer();
      auto fault = Clock::now();
      EXPECT_GT(in_flight, 0) << "the wave ended before the kill";
      Tally t = rig.settle(w, fault, false, "peer_restart cycle " + std::to_string(c));
      report("peer_restart_kill", c, in_flight, t, kDeadline + kSlack);
      auto restart = Clock::now();
      ASSERT_NO_THROW(rig.start_peer());  // same key "target", new process, new ports
      std::printf(
          "RESULT peer_restart cycle=%d restart_and_register_ms=%ld old_pid=%u new_pid=%u\n", c,
          ms_since(restart), old_pid, rig.peer_->desc.pid);
      EXPECT_NE(rig.peer_->desc.pid, old_pid);
      if (c == 1) {
        // The dead process's MemoryDesc, used after the restart, names memory id
        // that the new process reuses: it must be refused, and nothing may land.
        test::fill_pattern(rig.local_.data(), 0, 4096, 77);
        const std::string before = rig.peer_->child.ask("hash 1 0 4096");
        auto st =
            rig.engine_->write(rig.mem_, 0, old_mem, 0, 4096, rig.engine_->allocate_transfer_uid());
        ASSERT_TRUE(st.WaitFor(10s));
        EXPECT_EQ(st.Code(), StatusCode::ERR_NOT_FOUND) << st.Message();
        EXPECT_NE(st.Message().find("previous instance"), std::string::npos) << st.Message();
        EXPECT_EQ(rig.peer_->child.ask("hash 1 0 4096"), before)
            << "bytes landed in the new process through a stale descriptor";
      }
      rig.clean_wave(500 + c, "peer_restart new peer " + std::to_string(c));
    }
    leaks.after_cycles("peer_restart");
  }
  leaks.after_teardown("peer_restart");
}

// Established TCP sockets in B towards A's data address.
int sockets_to_a(const NetEnv& env) {
  std::string out;
  if (run(in_b(env, {"ss", "-H", "-t", "-n", "state", "established", "dst", env.addr_a}), &out) !=
      0)
    return -1;
  int n = 0;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// 4. Every TCP connection of the data link is reset mid-transfer (ss -K in B:
// the kernel aborts the target's sockets and sends RSTs): in-flight READs fail
// at once with ERR_TRANSPORT (the reset is reported, not waited out), WRITEs fail
// over to cma; the next wave reconnects and runs on tcp.
TEST(LinkFault, ConnectionReset) {
  NEED_NETNS(env);
  if (which("ss").empty()) GTEST_SKIP() << "no 'ss' (iproute2) to reset connections with";
  LeakCheck leaks;
  {
    Rig rig(env);
    rig.start_peer();
    rig.clean_wave(1, "reset warm-up");
    for (int c = 1; c <= kCycles; ++c) {
      leaks.baseline_when_warm(*rig.engine_, c, kCycles);
      int open_before = sockets_to_a(env);  // the lanes, up since the last wave
      uint64_t before = link_bytes(env);
      auto w = rig.post_wave(600 + c);
      ASSERT_TRUE(rig.wait_in_flight(w, before)) << "the wave ended before it was in flight";
      std::string out;
      int in_flight = Rig::in_progress(w);
      int rc = run(in_b(env, {"ss", "-K", "-t", "dst", env.addr_a}), &out);
      auto fault = Clock::now();
      EXPECT_GT(in_flight, 0) << "the wave ended before the reset";
      int open_after = sockets_to_a(env);
      if (c == 1 && (rc != 0 || (open_before > 0 && open_after >= open_before))) {
        rig.settle(w, fault, true, "reset (unsupported)");
        GTEST_SKIP() << "ss -K closed no socket (kernel without CONFIG_INET_DIAG_DESTROY?): rc "
                     << rc << ", " << open_before << " -> " << open_after << " sockets; " << out;
      }
      std::printf("RESULT reset cycle=%d sockets_in_b=%d->%d\n", c, open_before, open_after);
      Tally t = rig.settle(w, fault, true, "reset cycle " + std::to_string(c));
      report("reset", c, in_flight, t, kDeadline + kSlack);
      EXPECT_EQ(t.writes_failed, 0) << "WRITEs must fail over to cma: " << t.first_error;
      EXPECT_EQ(t.timeout, 0) << "a reset must be reported as such, not by the deadline: "
                              << t.first_error;
      // A reset is an answer: everything (the cma re-runs included) ends well
      // before a single attempt's deadline would have fired.
      EXPECT_LT(t.last_end_ms, kTimeout.count()) << t.first_error;
      rig.clean_wave(700 + c, "reset recovery " + std::to_string(c));
    }
    // What the reset cut depends on timing: frames still queued get a fresh
    // connection, a WRITE cut mid-way is fenced (landed: SUCCESS on tcp; not:
    // cma carries it), a READ cut mid-way fails. Every case must end well and
    // fast (asserted per cycle above); how many were cut is reported.
    std::printf("RESULT reset over %d cycles: tcp failures %llu, fences %llu, failovers %llu\n",
                kCycles,
                static_cast<unsigned long long>(rig.engine_->stats().backends["tcp"].failures),
                static_cast<unsigned long long>(rig.engine_->stats().fences),
                static_cast<unsigned long long>(rig.engine_->stats().backends["tcp"].failovers));
    leaks.after_cycles_checked("reset", /*require_warm=*/false);
  }
  leaks.after_teardown("reset");
}

// 5. A slow link. `qdisc` is installed on both ends' egress; a wave of small
// transfers (8 x 256 KiB) and a wave of large ones (8 x 16 MiB) run through
// it. Each transfer ends in time either way: it arrives (verified), or it
// fails at its deadline (READs) / fails over to cma (WRITEs).
void slow_link(const NetEnv& env, const std::string& name, const std::vector<std::string>& qdisc) {
  auto add = [&](bool in_b_ns, const std::string& dev) {
    std::vector<std::string> cmd = {"tc", "qdisc", "add", "dev", dev, "root"};
    cmd.insert(cmd.end(), qdisc.begin(), qdisc.end());
    std::string out, text = "'";
    for (const auto& word : cmd) text += (text.size() > 1 ? " " : "") + word;
    int rc = run(in_b_ns ? in_b(env, cmd) : cmd, &out);
    return rc == 0 ? std::string() : text + "' failed (rc " + std::to_string(rc) + "): " + out;
  };
  auto del = [&](bool in_b_ns, const std::string& dev) {
    std::vector<std::string> cmd = {"tc", "qdisc", "del", "dev", dev, "root"};
    std::string out;
    EXPECT_EQ(run(in_b_ns ? in_b(env, cmd) : cmd, &out), 0) << out;
  };
  if (which("tc").empty()) GTEST_SKIP() << "no 'tc' (iproute2) here";
  LeakCheck leaks;
  {
    Rig rig(env);
    rig.start_peer();
    rig.clean_wave(1, name + " warm-up");
    if (std::string err = add(true, env.dev_b); !err.empty())
      GTEST_SKIP() << name << ": the kernel has no such qdisc here, case skipped: " << err;
    if (std::string err = add(false, env.dev_a); !err.empty()) {
      del(true, env.dev_b);
      GTEST_SKIP() << name << ": " << err;
    }
    // Small, large, small, large: the second pair repeats the first, which opened
    // whatever stays open (the control connection of a failover's notification;
    // the lanes, reconnected by the small wave): the leak baseline sits between.
    const size_t sizes[] = {size_t{256} << 10, kSlot, size_t{256} << 10, kSlot};
    for (int i = 0; i < 4; ++i) {
      const size_t len = sizes[i];
      if (i == 3) leaks.baseline();
      const std::string what = name + " " + std::to_string(len >> 10) + "KiB";
      auto start = Clock::now();
      auto w = rig.post_wave(800 + 10 * i, len);
      Tally t = rig.settle(w, start, true, what);
      report(what, i + 1, kSlots, t, kDeadline + kSlack);
      EXPECT_EQ(t.writes_failed, 0) << "WRITEs must fail over to cma: " << t.first_error;
      EXPECT_EQ(t.transport + t.timeout, t.failed()) << t.first_error;
    }
    del(true, env.dev_b);
    del(false, env.dev_a);
    rig.clean_wave(900, name + " recovery");
    leaks.after_cycles(name);
  }
  leaks.after_teardown(name);
}

TEST(LinkFault, SlowLinkNetem) {
  NEED_NETNS(env);
  slow_link(env, "netem", {"netem", "delay", "20ms", "loss", "1%"});
}

// Where netem is missing (kernels without CONFIG_NET_SCH_NETEM), a token bucket
// still makes the link slow: 100 Mbit/s (12.5 MB/s) each way, so a 16 MiB wave
// cannot make its 2 s deadline while the 256 KiB wave does.
TEST(LinkFault, SlowLinkRateLimited) {
  NEED_NETNS(env);
  slow_link(env, "tbf", {"tbf", "rate", "100mbit", "burst", "64kb", "latency", "200ms"});
}

}  // namespace
