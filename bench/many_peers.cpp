// SPDX-License-Identifier: Apache-2.0
// many_peers: one engine serving many peer engines (issue 20 item 3). The
// central engine ("central", this process) registers one region; --procs child
// processes (this binary again, by exec) start --peers engines between them,
// each registers the central engine only (one-way, as vLLM does), WRITEs its
// own --bytes slice of the region once and then idles. The central engine's
// threads, descriptors and RSS are read from /proc/self before any peer, once
// every peer has written, and again once its idle lanes are reaped (tcp
// `lane_idle_ms`; rdma `qp_idle_ms`, when its target QPs are gone too; the
// control plane's connections after the same time); every
// slice is then checked byte for byte. The central engine's plugin counters
// (rdma: its QPs and connections) are printed at each phase.
//
// --direction out turns it round: the central engine is the initiator, the
// peers the targets. Each peer registers a region and hands its descriptions
// to the central engine (a file per child), which adds every peer and WRITEs
// a slice to each - all posted, then waited for - and idles; the children
// check their bytes when told to end.
//
//   many_peers [--backend tcp|rdma] [--direction in|out] [--peers 1024]
//              [--procs 8] [--bytes 4096] [--idle-ms 2000] [--settings JSON]
//              [--max-threads N --max-fds N] [--max-active-threads N]
//
// Prints one RESULT line per phase, and the most threads the central engine
// had while the peers were writing (sampled every 5 ms: a measurement, not a
// synchronisation). Exit 0 when every transfer succeeded, the data is right
// and, with --max-threads/--max-fds, the central engine's counts after reaping
// are within those bounds above its count before any peer; with
// --max-active-threads, its peak while they wrote is within that bound too.
#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string backend = "tcp";
  bool out = false;  // --direction out: the central engine initiates
  int peers = 1024;
  int procs = 8;
  size_t bytes = 4096;
  int idle_ms = 2000;
  std::string settings;  // the backend's settings; its idle time is added from --idle-ms
  long max_threads = -1, max_fds = -1;
  long max_active_threads = -1;
};

size_t Entries(const char* dir) {
  size_t n = 0;
  if (DIR* d = opendir(dir)) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n - 2;  // . and ..
}

long RssKib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}

struct Sample {
  size_t threads, fds;
  long rss_kib;
};
Sample Now() { return {Entries("/proc/self/task"), Entries("/proc/self/fd"), RssKib()}; }

void Print(const char* phase, const Sample& s, const Sample& base, int peers) {
  std::printf(
      "RESULT %-8s threads %5zu (%+5ld)  fds %6zu (%+6ld)  rss %8ld KiB (%+8ld, %+.1f KiB per "
      "peer)\n",
      phase, s.threads, static_cast<long>(s.threads) - static_cast<long>(base.threads), s.fds,
      static_cast<long>(s.fds) - static_cast<long>(base.fds), s.rss_kib, s.rss_kib - base.rss_kib,
      static_cast<double>(s.rss_kib - base.rss_kib) / peers);
  std::fflush(stdout);
}

// A plugin counter of the central engine's backend; 0 when it keeps none of that name.
uint64_t Counter(ferry::Engine& e, const std::string& backend, const std::string& name) {
  const auto st = e.stats();
  auto b = st.backends.find(backend);
  if (b == st.backends.end()) return 0;
  auto c = b->second.plugin.find(name);
  return c == b->second.plugin.end() ? 0 : c->second;
}

void PrintCounters(const char* phase, ferry::Engine& e, const std::string& backend) {
  const auto st = e.stats();
  auto b = st.backends.find(backend);
  // tcp's counters say nothing of its lanes: the thread and fd counts do.
  if (backend != "rdma" || b == st.backends.end() || b->second.plugin.empty()) return;
  std::string kv;
  for (const auto& [k, v] : b->second.plugin) kv += " " + k + "=" + std::to_string(v);
  std::printf("RESULT %-8s %s counters:%s\n", phase, backend.c_str(), kv.c_str());
  std::fflush(stdout);
}

// Many engines need many descriptors: take the hard limit.
void RaiseFdLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    setrlimit(RLIMIT_NOFILE, &r);
  }
}

uint8_t PatternByte(int peer, size_t i) { return static_cast<uint8_t>(peer * 131 + i * 7 + 1); }

std::string BackendSettings(const Options& o) {
  std::string s = o.settings.empty() ? "{}" : o.settings;
  const std::string idle =
      (o.backend == "rdma" ? "\"qp_idle_ms\":" : "\"lane_idle_ms\":") + std::to_string(o.idle_ms);
  return s == "{}" ? "{" + idle + "}" : "{" + idle + "," + s.substr(1);
}

// Every engine here closes idle control-plane connections (rdma's handshakes
// use them) after the same idle time as the backend's lanes or QPs.
ferry::EngineConfig Config(const Options& o) {
  ferry::EngineConfig c;
  c.control_idle_close = std::chrono::milliseconds(o.idle_ms);
  return c;
}

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void PutBlob(std::ofstream& f, const std::vector<uint8_t>& b) {
  const auto n = static_cast<uint32_t>(b.size());
  f.write(reinterpret_cast<const char*>(&n), sizeof n);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// The next length-prefixed blob of `in` from *at; empty at the end or on a short file.
std::vector<uint8_t> TakeBlob(const std::vector<uint8_t>& in, size_t* at) {
  uint32_t n = 0;
  if (*at + sizeof n > in.size()) return {};
  std::memcpy(&n, in.data() + *at, sizeof n);
  if (*at + sizeof n + n > in.size()) return {};
  std::vector<uint8_t> b(in.begin() + static_cast<long>(*at + sizeof n),
                         in.begin() + static_cast<long>(*at + sizeof n + n));
  *at += sizeof n + n;
  return b;
}

// A child of --direction out: peers [first, first + count) as targets. Their
// engine and memory descriptions go to `out_file`, then one byte to `done_fd`
// (1: all started); once `quit_fd` reaches end of file each checks the slice
// the central engine wrote to it. Exit 0 when every slice is right.
int TargetChild(const Options& o, int first, int count, const std::string& out_file, int done_fd,
                int quit_fd) {
  RaiseFdLimit();
  std::vector<std::unique_ptr<ferry::Engine>> engines;
  std::vector<std::vector<uint8_t>> bufs;
  bool ok = true;
  {
    std::ofstream f(out_file, std::ios::binary | std::ios::trunc);
    for (int p = first; p < first + count && ok; ++p) {
      auto e = std::make_unique<ferry::Engine>("peer-" + std::to_string(p), Config(o));
      if (ferry::Result r = e->add_backend(o.backend, BackendSettings(o)); !r) {
        std::fprintf(stderr, "many_peers: peer %d: %s\n", p, r.message.c_str());
        ok = false;
        break;
      }
      std::vector<uint8_t> buf(o.bytes, 0);
      const ferry::MemoryDesc mem = e->register_memory(buf.data(), buf.size());
      PutBlob(f, e->desc().pack());
      PutBlob(f, mem.pack());
      engines.push_back(std::move(e));
      bufs.push_back(std::move(buf));
    }
    ok = ok && static_cast<bool>(f.flush());
  }
  const uint8_t done = ok ? 1 : 0;
  if (write(done_fd, &done, 1) != 1) return 1;
  char c;
  while (read(quit_fd, &c, 1) > 0) {
  }
  for (size_t k = 0; k < bufs.size() && ok; ++k) {
    for (size_t i = 0; i < o.bytes; ++i) {
      if (bufs[k][i] != PatternByte(first + static_cast<int>(k), i)) {
        std::fprintf(stderr, "many_peers: peer %zu: slice wrong at byte %zu\n", first + k, i);
        ok = false;
        break;
      }
    }
  }
  return ok ? 0 : 1;
}

// --direction out, in the central engine: adds every peer the children
// described and WRITEs each its slice of `region`, all posted before any is
// waited for. False when one failed.
bool WriteToPeers(const Options& o, ferry::Engine& central, const ferry::MemoryDesc& mem,
                  const std::string& desc_file) {
  std::vector<ferry::MemoryDesc> targets;
  for (int c = 0; c < o.procs; ++c) {
    const std::vector<uint8_t> in = ReadFile(desc_file + "." + std::to_string(c));
    size_t at = 0;
    for (;;) {
      std::vector<uint8_t> e = TakeBlob(in, &at), m = TakeBlob(in, &at);
      if (e.empty() || m.empty()) break;
      if (ferry::Result r = central.register_remote_engine(ferry::EngineDesc::unpack(e)); !r) {
        std::fprintf(stderr, "many_peers: adding a peer: %s\n", r.message.c_str());
        return false;
      }
      targets.push_back(ferry::MemoryDesc::unpack(m));
    }
  }
  if (targets.size() != static_cast<size_t>(o.peers)) {
    std::fprintf(stderr, "many_peers: %zu peers described, %d expected\n", targets.size(), o.peers);
    return false;
  }
  std::vector<ferry::TransferStatus> sent;
  sent.reserve(targets.size());
  for (int p = 0; p < o.peers; ++p) {
    sent.push_back(central.write(mem, static_cast<size_t>(p) * o.bytes, targets[p], 0, o.bytes,
                                 static_cast<uint64_t>(p) + 1));
  }
  bool ok = true;
  for (int p = 0; p < o.peers; ++p) {
    if (sent[p].Wait() != ferry::StatusCode::SUCCESS) {
      std::fprintf(stderr, "many_peers: WRITE to peer %d: %s\n", p, sent[p].Message().c_str());
      ok = false;
    }
  }
  return ok;
}

// A child: peers [first, first + count) of the central engine described in
// `desc_file`. Writes one byte to `done_fd` once every peer wrote (1: all
// succeeded, 0: one failed), then idles until `quit_fd` reaches end of file.
int Child(const Options& o, int first, int count, const std::string& desc_file, int done_fd,
          int quit_fd) {
  RaiseFdLimit();
  const std::vector<uint8_t> blob = ReadFile(desc_file);
  // The file: u32 length of the packed EngineDesc, it, then the packed MemoryDesc.
  uint32_t n = 0;
  std::memcpy(&n, blob.data(), sizeof n);
  const ferry::EngineDesc central = ferry::EngineDesc::unpack(
      std::vector<uint8_t>(blob.begin() + sizeof n, blob.begin() + sizeof n + n));
  const ferry::MemoryDesc region =
      ferry::MemoryDesc::unpack(std::vector<uint8_t>(blob.begin() + sizeof n + n, blob.end()));
  std::vector<std::unique_ptr<ferry::Engine>> engines;
  std::vector<std::vector<uint8_t>> bufs;
  bool ok = true;
  for (int p = first; p < first + count && ok; ++p) {
    auto e = std::make_unique<ferry::Engine>("peer-" + std::to_string(p), Config(o));
    ferry::Result r = e->add_backend(o.backend, BackendSettings(o));
    if (r) r = e->register_remote_engine(central);
    if (!r) {
      std::fprintf(stderr, "many_peers: peer %d: %s\n", p, r.message.c_str());
      ok = false;
      break;
    }
    std::vector<uint8_t> buf(o.bytes);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = PatternByte(p, i);
    const ferry::MemoryDesc local = e->register_memory(buf.data(), buf.size());
    ferry::TransferStatus st =
        e->write(local, 0, region, static_cast<size_t>(p) * o.bytes, o.bytes, p + 1);
    if (st.Wait() != ferry::StatusCode::SUCCESS) {
      std::fprintf(stderr, "many_peers: peer %d: %s\n", p, st.Message().c_str());
      ok = false;
    }
    engines.push_back(std::move(e));
    bufs.push_back(std::move(buf));
  }
  const uint8_t done = ok ? 1 : 0;
  if (write(done_fd, &done, 1) != 1) return 1;
  char c;
  while (read(quit_fd, &c, 1) > 0) {
  }
  return ok ? 0 : 1;
}

bool ParseArgs(int argc, char** argv, Options* o, std::vector<std::string>* child) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (a == "--child") {
      for (int k = 0; k < 5 && i + 1 < argc; ++k) child->push_back(argv[++i]);
      continue;
    }
    if (!(v = next())) return false;
    if (a == "--backend")
      o->backend = v;
    else if (a == "--direction" && (std::strcmp(v, "in") == 0 || std::strcmp(v, "out") == 0))
      o->out = std::strcmp(v, "out") == 0;
    else if (a == "--peers")
      o->peers = std::atoi(v);
    else if (a == "--procs")
      o->procs = std::atoi(v);
    else if (a == "--bytes")
      o->bytes = std::strtoull(v, nullptr, 10);
    else if (a == "--idle-ms")
      o->idle_ms = std::atoi(v);
    else if (a == "--settings")
      o->settings = v;
    else if (a == "--max-threads")
      o->max_threads = std::atol(v);
    else if (a == "--max-fds")
      o->max_fds = std::atol(v);
    else if (a == "--max-active-threads")
      o->max_active_threads = std::atol(v);
    else
      return false;
  }
  return (o->backend == "tcp" || o->backend == "rdma") && o->peers > 0 && o->procs > 0 &&
         o->procs <= o->peers && o->bytes > 0 && o->idle_ms > 0 &&
         (o->settings.empty() || (o->settings.front() == '{' && o->settings.back() == '}'));
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::vector<std::string> child;
  if (!ParseArgs(argc, argv, &o, &child)) {
    std::fprintf(stderr,
                 "usage: many_peers [--backend tcp|rdma] [--direction in|out] [--peers 1024] "
                 "[--procs 8] [--bytes 4096] "
                 "[--idle-ms 2000] "
                 "[--settings JSON] [--max-threads N] [--max-fds N] [--max-active-threads N]\n");
    return 2;
  }
  if (child.size() == 5 && o.out) {
    return TargetChild(o, std::atoi(child[0].c_str()), std::atoi(child[1].c_str()), child[2],
                       std::atoi(child[3].c_str()), std::atoi(child[4].c_str()));
  }
  if (child.size() == 5) {
    return Child(o, std::atoi(child[0].c_str()), std::atoi(child[1].c_str()), child[2],
                 std::atoi(child[3].c_str()), std::atoi(child[4].c_str()));
  }
  RaiseFdLimit();
  ferry::Engine central("central", Config(o));
  if (ferry::Result r = central.add_backend(o.backend, BackendSettings(o)); !r) {
    std::fprintf(stderr, "many_peers: %s\n", r.message.c_str());
    return 1;
  }
  std::vector<uint8_t> region(static_cast<size_t>(o.peers) * o.bytes, 0);
  if (o.out) {  // the source of every slice
    for (int p = 0; p < o.peers; ++p)
      for (size_t i = 0; i < o.bytes; ++i)
        region[static_cast<size_t>(p) * o.bytes + i] = PatternByte(p, i);
  }
  const ferry::MemoryDesc mem = central.register_memory(region.data(), region.size());
  char desc_file[] = "/tmp/many_peers.XXXXXX";
  const int dfd = mkstemp(desc_file);
  if (dfd < 0) return 1;
  {
    const std::vector<uint8_t> d = central.desc().pack(), m = mem.pack();
    const auto n = static_cast<uint32_t>(d.size());
    if (write(dfd, &n, sizeof n) != sizeof n ||
        write(dfd, d.data(), d.size()) != static_cast<ssize_t>(d.size()) ||
        write(dfd, m.data(), m.size()) != static_cast<ssize_t>(m.size())) {
      return 1;
    }
    close(dfd);
  }
  std::printf("# many_peers: %d peers in %d processes, %zu B each, %s %s, the central engine %s\n",
              o.peers, o.procs, o.bytes, o.backend.c_str(), BackendSettings(o).c_str(),
              o.out ? "writes to each peer" : "is written to by each peer");
  const Sample base = Now();
  Print("before", base, base, o.peers);
  PrintCounters("before", central, o.backend);

  int done[2], quit[2];
  if (pipe2(done, O_CLOEXEC) != 0 || pipe2(quit, O_CLOEXEC) != 0) return 1;
  const auto start = Clock::now();
  std::vector<pid_t> pids;
  for (int c = 0; c < o.procs; ++c) {
    const int first = o.peers * c / o.procs, last = o.peers * (c + 1) / o.procs;
    const pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
      // exec: the child starts its own engines with nothing of ours inherited.
      const int d = dup(done[1]), q = dup(quit[0]);  // without CLOEXEC
      std::vector<std::string> args = {
          argv[0],
          "--backend",
          o.backend,
          "--direction",
          o.out ? "out" : "in",
          "--peers",
          std::to_string(o.peers),
          "--bytes",
          std::to_string(o.bytes),
          "--idle-ms",
          std::to_string(o.idle_ms),
          "--child",
          std::to_string(first),
          std::to_string(last - first),
          o.out ? std::string(desc_file) + "." + std::to_string(c) : std::string(desc_file),
          std::to_string(d),
          std::to_string(q)};
      if (!o.settings.empty()) {
        args.insert(args.begin() + 1, o.settings);
        args.insert(args.begin() + 1, "--settings");
      }
      std::vector<char*> cargs;
      for (auto& s : args) cargs.push_back(s.data());
      cargs.push_back(nullptr);
      execv("/proc/self/exe", cargs.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  close(done[1]);
  close(quit[0]);
  // The peak while peers connect and write: lanes come and go faster than the
  // phases below can see.
  std::atomic<bool> sampling{true};
  std::atomic<size_t> peak_threads{base.threads};
  std::thread sampler([&] {
    while (sampling.load()) {
      const size_t t = Entries("/proc/self/task") - 1;  // not counting the sampler
      if (t > peak_threads.load()) peak_threads.store(t);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  bool ok = true;
  for (int c = 0; c < o.procs; ++c) {
    uint8_t b = 0;
    if (read(done[0], &b, 1) != 1 || b != 1) ok = false;
  }
  if (o.out && ok) ok = WriteToPeers(o, central, mem, desc_file);
  sampling.store(false);
  sampler.join();
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  const Sample busy = Now();
  std::printf("# every peer wrote once: %s, %.1f s\n", ok ? "all succeeded" : "FAILURES", secs);
  Print("active", busy, base, o.peers);
  PrintCounters("active", central, o.backend);
  std::printf("RESULT peak     threads %5zu (%+5ld) while the peers connected and wrote\n",
              peak_threads.load(),
              static_cast<long>(peak_threads.load()) - static_cast<long>(base.threads));
  const bool peak_ok =
      o.max_active_threads < 0 || static_cast<long>(peak_threads.load()) <=
                                      static_cast<long>(base.threads) + o.max_active_threads;
  if (!peak_ok) std::printf("# the central engine's threads went above the bound given\n");

  // Reaping: the central engine's lane threads end once the peers' lanes close.
  const auto limit =
      Clock::now() + std::chrono::milliseconds(3 * o.idle_ms) + std::chrono::seconds(30);
  Sample after = Now();
  const auto settled = [&](const Sample& s) {
    return (o.max_threads < 0 ||
            static_cast<long>(s.threads) <= static_cast<long>(base.threads) + o.max_threads) &&
           (o.max_fds < 0 || static_cast<long>(s.fds) <= static_cast<long>(base.fds) + o.max_fds);
  };
  const auto reap_start = Clock::now();
  bool reaped = false;
  while (!reaped && Clock::now() < limit) {
    after = Now();
    reaped = after.threads <= base.threads + 2 && after.fds <= base.fds + 2 &&
             Counter(central, o.backend, "target_qps") == 0;
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a bounded poll
  }
  std::printf("# idle lanes %s after %.1f s (idle time %d ms)\n",
              reaped ? "reaped" : "NOT reaped (threads or fds above before + 2, or QPs left)",
              std::chrono::duration<double>(Clock::now() - reap_start).count(), o.idle_ms);
  Print("reaped", after, base, o.peers);
  PrintCounters("reaped", central, o.backend);

  size_t wrong = 0;
  if (o.out) {
    std::printf("# data: the peers check their slices (their exit status)\n");
  } else {
    for (int p = 0; p < o.peers; ++p) {
      for (size_t i = 0; i < o.bytes; ++i) {
        if (region[static_cast<size_t>(p) * o.bytes + i] != PatternByte(p, i)) {
          ++wrong;
          break;
        }
      }
    }
    std::printf("# data: %zu of %d slices wrong\n", wrong, o.peers);
  }
  close(quit[1]);  // the children end
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ok = false;
  }
  unlink(desc_file);
  for (int c = 0; o.out && c < o.procs; ++c)
    unlink((std::string(desc_file) + "." + std::to_string(c)).c_str());
  const bool bounded = settled(after);
  if (!bounded) std::printf("# the central engine did not come back within the bounds given\n");
  return ok && wrong == 0 && bounded && peak_ok ? 0 : 1;
}
