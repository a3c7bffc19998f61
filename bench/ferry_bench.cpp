// ferry-bench: nixlbench-style transfer benchmark between two engines.
//
// One command on one machine (the target rank is this same binary, started with
// fork+exec and driven over pipes):
//   ferry-bench --backend tcp --op WRITE --start-block-size 4KiB --max-block-size 64MiB
// Two hosts:
//   host B: ferry-bench --rank 1 --listen 0.0.0.0:7000 [--host B_ADDR]
//   host A: ferry-bench --rank 0 --peer B_ADDR:7000 --host A_ADDR ...
// Every figure comes from real transfers; --check-consistency verifies every
// byte against a pattern that changes per iteration.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_target.h"
#include "ferry/ferry.hpp"
#include "line_channel.h"
#include "pattern.h"

using namespace ferry;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string backend = "tcp";  // or "policy": load every backend the policy names
  std::string policy_file;
  Op op = Op::WRITE;
  size_t start_block = 4096, max_block = 64u << 20;
  size_t start_batch = 1, max_batch = 1;
  int num_iter = 64, warmup_iter = 8;
  int large_block_iter_factor = 16;  // iterations / this for blocks >= 1 MiB
  bool check = false;
  bool session = false;
  bool notify = true;
  std::string json_file, csv_file;
  int rank = -1;  // -1: both ranks locally
  std::string peer, listen, host = "127.0.0.1";
};

bool parse_size_arg(const std::string& s, size_t& out) {
  size_t i = 0;
  unsigned long long v = 0;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) v = v * 10 + (s[i++] - '0');
  if (i == 0) return false;
  std::string u = s.substr(i);
  unsigned long long m = u.empty() || u == "B" ? 1
                         : (u == "K" || u == "KiB") ? 1ull << 10
                         : (u == "M" || u == "MiB") ? 1ull << 20
                         : (u == "G" || u == "GiB") ? 1ull << 30
                                                    : 0;
  if (!m) return false;
  out = static_cast<size_t>(v * m);
  return true;
}

[[noreturn]] void usage(const char* why = nullptr) {
  if (why) std::fprintf(stderr, "ferry-bench: %s\n", why);
  std::fprintf(stderr,
      "usage: ferry-bench [--backend tcp|NAME[,NAME...]|policy] [--policy FILE] [--op WRITE|READ]\n"
      "         [--start-block-size N] [--max-block-size N] [--start-batch-size N]\n"
      "         [--max-batch-size N] [--num-iter N] [--warmup-iter N]\n"
      "         [--large-block-iter-factor N] [--check-consistency] [--session]\n"
      "         [--no-notify] [--json FILE] [--csv FILE]\n"
      "         [--rank 0 --peer HOST:PORT | --rank 1 --listen ADDR:PORT] [--host ADDR]\n"
      "  sizes take K/KiB, M/MiB, G/GiB; block and batch sizes double from start to max.\n");
  std::exit(2);
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    auto size_val = [&](size_t& out) {
      std::string v = val();
      if (!parse_size_arg(v, out) || out == 0) usage(("bad size '" + v + "' for " + a).c_str());
    };
    auto int_val = [&](int& out, int min) {
      std::string v = val();
      try {
        out = std::stoi(v);
      } catch (...) {
        usage(("bad number '" + v + "' for " + a).c_str());
      }
      if (out < min) usage(("value too small for " + a).c_str());
    };
    if (a == "--backend") o.backend = val();
    else if (a == "--policy") o.policy_file = val();
    else if (a == "--op") {
      std::string v = val();
      for (auto& c : v) c = static_cast<char>(toupper(c));
      if (v != "READ" && v != "WRITE") usage("--op must be READ or WRITE");
      o.op = v == "READ" ? Op::READ : Op::WRITE;
    } else if (a == "--start-block-size") size_val(o.start_block);
    else if (a == "--max-block-size") size_val(o.max_block);
    else if (a == "--start-batch-size") size_val(o.start_batch);
    else if (a == "--max-batch-size") size_val(o.max_batch);
    else if (a == "--num-iter") int_val(o.num_iter, 1);
    else if (a == "--warmup-iter") int_val(o.warmup_iter, 0);
    else if (a == "--large-block-iter-factor") int_val(o.large_block_iter_factor, 1);
    else if (a == "--check-consistency") o.check = true;
    else if (a == "--session") o.session = true;
    else if (a == "--no-notify") o.notify = false;
    else if (a == "--json") o.json_file = val();
    else if (a == "--csv") o.csv_file = val();
    else if (a == "--rank") {
      int r;
      int_val(r, 0);
      if (r > 1) usage("--rank is 0 (initiator) or 1 (target)");
      o.rank = r;
    } else if (a == "--peer") o.peer = val();
    else if (a == "--listen") o.listen = val();
    else if (a == "--host") o.host = val();
    else if (a == "--help" || a == "-h") usage();
    else usage(("unknown option " + a).c_str());
  }
  if (o.start_block > o.max_block) usage("--start-block-size is above --max-block-size");
  if (o.start_batch > o.max_batch) usage("--start-batch-size is above --max-batch-size");
  if (o.rank == 0 && o.peer.empty()) usage("--rank 0 needs --peer HOST:PORT");
  if (o.rank == 1 && o.listen.empty()) usage("--rank 1 needs --listen ADDR:PORT");
  return o;
}

// "tcp", "fault,tcp" (load all, the policy ranks them) or "policy" (whatever
// of the known backends loads here).
std::vector<std::string> backends_of(const Options& o) {
  if (o.backend == "policy") return {"tcp", "ofi", "rdma", "xgmi"};
  std::vector<std::string> out;
  std::stringstream ss(o.backend);
  for (std::string b; std::getline(ss, b, ',');)
    if (!b.empty()) out.push_back(b);
  return out;
}

bool split_host_port(const std::string& s, std::string& host, std::string& port) {
  auto c = s.rfind(':');
  if (c == std::string::npos) return false;
  host = s.substr(0, c);
  port = s.substr(c + 1);
  return !host.empty() && !port.empty();
}

// ---- target rank ----------------------------------------------------------------

int serve_over_socket(const Options& o, size_t region) {
  std::string host, port;
  if (!split_host_port(o.listen, host, port)) usage("--listen wants ADDR:PORT");
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) usage("cannot resolve --listen");
  int ls = socket(res->ai_family, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(ls, res->ai_addr, res->ai_addrlen) != 0 || listen(ls, 1) != 0) {
    std::perror("ferry-bench: listen");
    return 1;
  }
  freeaddrinfo(res);
  std::fprintf(stderr, "ferry-bench: target waiting on %s\n", o.listen.c_str());
  int fd = accept(ls, nullptr, nullptr);
  close(ls);
  if (fd < 0) return 1;
  bench::TargetOptions t;
  t.backends = backends_of(o);
  t.host = o.host;
  t.region_bytes = region;
  t.policy_file = o.policy_file;
  int rc = bench::run_target(t, fd, fd);
  close(fd);
  return rc;
}

// ---- initiator rank -------------------------------------------------------------

struct Row {
  size_t block, batch;
  int iters;
  double bw_gbs, max_bw_gbs;
  double avg_lat_us, p99_lat_us, min_lat_us;
  double avg_post_us, p99_post_us;
  double total_mb;
  bool verified;
};

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t idx = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(idx, v.size() - 1)];
}

double avg(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

class Initiator {
 public:
  Initiator(const Options& o, bench::LineChannel& ch, size_t region) : o_(o), ch_(ch), local_(region) {}

  bool setup() {
    std::string ready;
    if (!ch_.recv(ready, 120000) || ready.rfind("READY ", 0) != 0) {
      std::fprintf(stderr, "ferry-bench: target did not start: %s\n", ready.c_str());
      return false;
    }
    std::istringstream in(ready.substr(6));
    std::string ehex, mhex;
    in >> ehex >> mhex;
    EngineConfig cfg;
    cfg.host = o_.host;
    cfg.policy_file = o_.policy_file;
    engine_ = std::make_unique<Engine>("ferry-bench-initiator", cfg);
    int loaded = 0;
    for (const auto& b : backends_of(o_)) {
      Result r = engine_->add_backend(b);
      if (r) ++loaded;
      else if (o_.backend != "policy") {
        std::fprintf(stderr, "ferry-bench: %s\n", r.message.c_str());
        return false;
      }
    }
    if (!loaded) {
      std::fprintf(stderr, "ferry-bench: no backend loaded\n");
      return false;
    }
    EngineDesc target = EngineDesc::unpack(test::from_hex(ehex));
    remote_ = MemoryDesc::unpack(test::from_hex(mhex));
    if (Result r = engine_->register_remote_engine(target); !r) {
      std::fprintf(stderr, "ferry-bench: %s\n", r.message.c_str());
      return false;
    }
    std::string ok = ch_.ask("register " + test::to_hex(engine_->desc().pack()));
    if (ok != "OK") {
      std::fprintf(stderr, "ferry-bench: target could not register us: %s\n", ok.c_str());
      return false;
    }
    local_mem_ = engine_->register_memory(local_.data(), local_.size());
    if (o_.session) {
      Result why;
      session_ = engine_->create_session(local_mem_, remote_, &why);
      if (!session_) {
        std::fprintf(stderr, "ferry-bench: no session: %s\n", why.message.c_str());
        return false;
      }
    }
    return true;
  }

  TransferStatus post(const std::vector<size_t>& offs, const std::vector<size_t>& sizes, TransferUid uid) {
    bool rd = o_.op == Op::READ;
    if (offs.size() == 1) {
      if (session_) return rd ? session_->read(offs[0], offs[0], sizes[0], uid, o_.notify)
                              : session_->write(offs[0], offs[0], sizes[0], uid, o_.notify);
      return rd ? engine_->read(local_mem_, offs[0], remote_, offs[0], sizes[0], uid, o_.notify)
                : engine_->write(local_mem_, offs[0], remote_, offs[0], sizes[0], uid, o_.notify);
    }
    if (session_) return rd ? session_->batch_read(offs, offs, sizes, uid, o_.notify)
                            : session_->batch_write(offs, offs, sizes, uid, o_.notify);
    return rd ? engine_->batch_read(local_mem_, offs, remote_, offs, sizes, uid, o_.notify)
              : engine_->batch_write(local_mem_, offs, remote_, offs, sizes, uid, o_.notify);
  }

  // Verify the bytes of one iteration: the pattern of `seed` must be on the destination.
  bool verify(const std::vector<size_t>& offs, size_t block, uint64_t seed) {
    if (o_.op == Op::READ) {
      for (size_t off : offs)
        if (test::find_mismatch(local_.data(), off, block, seed, off) != -1) return false;
      return true;
    }
    std::ostringstream cmd;
    cmd << "hash " << offs.size();
    uint64_t h = test::kFnvBasis;
    for (size_t off : offs) {
      cmd << " " << off << " " << block;
      h = test::fnv1a(local_.data() + off, block, h);
    }
    return ch_.ask(cmd.str()) == "HASH " + std::to_string(h);
  }

  bool prepare_data(uint64_t seed, size_t bytes) {
    if (o_.op == Op::WRITE) {
      test::fill_pattern(local_.data(), 0, bytes, seed);
      return true;
    }
    std::fill(local_.begin(), local_.begin() + static_cast<long>(bytes), 0);
    return ch_.ask("fill " + std::to_string(seed)) == "OK";
  }

  bool run_point(size_t block, size_t batch, Row& row) {
    int iters = o_.num_iter;
    if (block >= (1u << 20)) iters = std::max(1, iters / o_.large_block_iter_factor);
    std::vector<size_t> offs(batch), sizes(batch, block);
    for (size_t i = 0; i < batch; ++i) offs[i] = i * block;
    std::vector<double> lat, post_us;
    bool verified = true;
    double busy_s = 0;
    for (int it = -o_.warmup_iter; it < iters; ++it) {
      uint64_t seed = next_seed_++;
      if (o_.check && !prepare_data(seed, block * batch)) return false;
      TransferUid uid = engine_->allocate_transfer_uid();
      auto t0 = Clock::now();
      TransferStatus st = post(offs, sizes, uid);
      auto t1 = Clock::now();
      StatusCode code = st.Wait();
      auto t2 = Clock::now();
      if (code != StatusCode::SUCCESS) {
        std::fprintf(stderr, "ferry-bench: transfer failed: %s: %s\n", to_string(code),
                     st.Message().c_str());
        return false;
      }
      if (o_.check && !verify(offs, block, seed)) {
        std::fprintf(stderr, "ferry-bench: DATA MISMATCH at block %zu batch %zu iteration %d\n",
                     block, batch, it);
        verified = false;
      }
      if (it < 0) continue;
      lat.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count());
      post_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      busy_s += std::chrono::duration<double>(t2 - t0).count();
    }
    double bytes = static_cast<double>(block) * static_cast<double>(batch);
    row = {block, batch, iters,
           bytes * iters / busy_s / 1e9, bytes / (pct(lat, 0.0) * 1e-6) / 1e9,
           avg(lat), pct(lat, 0.99), pct(lat, 0.0),
           avg(post_us), pct(post_us, 0.99),
           bytes * iters / 1e6, o_.check ? verified : false};
    return verified;
  }

  void print_stats() {
    EngineStats st = engine_->stats();
    std::printf("stats (initiator):");
    for (const auto& [name, b] : st.backends)
      std::printf(" %s{transfers=%llu bytes=%llu failures=%llu failovers=%llu quarantines=%llu}",
                  name.c_str(), static_cast<unsigned long long>(b.transfers),
                  static_cast<unsigned long long>(b.bytes), static_cast<unsigned long long>(b.failures),
                  static_cast<unsigned long long>(b.failovers),
                  static_cast<unsigned long long>(b.quarantines));
    std::printf("\n");
  }

  StatusCode quit() {
    // Close our side first, so the target's exit is not a lost connection to us.
    session_.reset();
    engine_.reset();
    ch_.ask("quit", 10000);
    return StatusCode::SUCCESS;
  }

 private:
  const Options& o_;
  bench::LineChannel& ch_;
  std::vector<uint8_t> local_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Session> session_;
  MemoryDesc local_mem_, remote_;
  uint64_t next_seed_ = 1;
};

void print_header(const Options& o) {
  std::printf("ferry-bench: backend=%s op=%s api=%s notify=%s check=%s\n", o.backend.c_str(),
              o.op == Op::READ ? "READ" : "WRITE", o.session ? "session" : "engine",
              o.notify ? "on" : "off", o.check ? "on" : "off");
  std::printf("%12s %6s %10s %10s %10s %10s %10s %10s %10s %10s %9s\n", "Block (B)", "Batch",
              "B/W GB/s", "Max GB/s", "Avg Lat us", "P99 Lat us", "Min Lat us", "Avg Post us",
              "P99 Post us", "Total MB", "Verified");
}

void print_row(const Row& r, bool checked) {
  std::printf("%12zu %6zu %10.3f %10.3f %10.1f %10.1f %10.1f %10.2f %10.2f %10.1f %9s\n",
              r.block, r.batch, r.bw_gbs, r.max_bw_gbs, r.avg_lat_us, r.p99_lat_us, r.min_lat_us,
              r.avg_post_us, r.p99_post_us, r.total_mb, !checked ? "off" : r.verified ? "yes" : "NO");
  std::fflush(stdout);
}

void write_files(const Options& o, const std::vector<Row>& rows) {
  if (!o.csv_file.empty()) {
    std::ofstream f(o.csv_file);
    f << "backend,op,block_bytes,batch,iters,bw_gbs,max_bw_gbs,avg_lat_us,p99_lat_us,min_lat_us,"
         "avg_post_us,p99_post_us,total_mb,verified\n";
    for (const auto& r : rows)
      f << o.backend << "," << (o.op == Op::READ ? "READ" : "WRITE") << "," << r.block << ","
        << r.batch << "," << r.iters << "," << r.bw_gbs << "," << r.max_bw_gbs << ","
        << r.avg_lat_us << "," << r.p99_lat_us << "," << r.min_lat_us << "," << r.avg_post_us
        << "," << r.p99_post_us << "," << r.total_mb << "," << (r.verified ? 1 : 0) << "\n";
  }
  if (!o.json_file.empty()) {
    std::ofstream f(o.json_file);
    f << "[";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      f << (i ? ",\n " : "\n ") << "{\"backend\":\"" << o.backend << "\",\"op\":\""
        << (o.op == Op::READ ? "READ" : "WRITE") << "\",\"block_bytes\":" << r.block
        << ",\"batch\":" << r.batch << ",\"iters\":" << r.iters << ",\"bw_gbs\":" << r.bw_gbs
        << ",\"max_bw_gbs\":" << r.max_bw_gbs << ",\"avg_lat_us\":" << r.avg_lat_us
        << ",\"p99_lat_us\":" << r.p99_lat_us << ",\"min_lat_us\":" << r.min_lat_us
        << ",\"avg_post_us\":" << r.avg_post_us << ",\"p99_post_us\":" << r.p99_post_us
        << ",\"total_mb\":" << r.total_mb << ",\"verified\":" << (r.verified ? "true" : "false")
        << "}";
    }
    f << "\n]\n";
  }
}

int run_initiator(const Options& o, bench::LineChannel& ch, size_t region) {
  Initiator ini(o, ch, region);
  if (!ini.setup()) return 1;
  print_header(o);
  std::vector<Row> rows;
  bool ok = true;
  for (size_t block = o.start_block; block <= o.max_block && ok; block *= 2) {
    for (size_t batch = o.start_batch; batch <= o.max_batch && ok; batch *= 2) {
      // A progress line for long sweeps, only where someone is watching.
      bool tty = isatty(STDERR_FILENO);
      if (tty) std::fprintf(stderr, "[ferry-bench] block %zu batch %zu ...", block, batch);
      Row r{};
      ok = ini.run_point(block, batch, r);
      if (tty) std::fprintf(stderr, "\r%60s\r", "");
      if (ok) {
        rows.push_back(r);
        print_row(r, o.check);
      }
    }
  }
  write_files(o, rows);
  ini.print_stats();
  ini.quit();
  if (!ok) std::fprintf(stderr, "ferry-bench: stopped early (see above)\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Internal: the target rank when both ranks run on this machine.
  if (argc >= 2 && std::string(argv[1]) == "--serve-target-on-stdio") {
    if (argc < 7) return 2;
    bench::TargetOptions t;
    Options target_opts;
    target_opts.backend = argv[2];
    t.backends = backends_of(target_opts);
    t.region_bytes = std::stoull(argv[3]);
    t.host = argv[4];
    t.policy_file = std::string(argv[5]) == "-" ? "" : argv[5];
    t.key = argv[6];
    return bench::run_target(t, 0, 1);
  }
  Options o = parse_args(argc, argv);
  size_t region = o.max_block * o.max_batch;
  if (o.rank == 1) return serve_over_socket(o, region);
  if (o.rank == 0) {
    std::string host, port;
    if (!split_host_port(o.peer, host, port)) usage("--peer wants HOST:PORT");
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) usage("cannot resolve --peer");
    int fd = socket(res->ai_family, SOCK_STREAM, 0);
    if (connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
      std::perror("ferry-bench: connect to --peer");
      return 1;
    }
    freeaddrinfo(res);
    bench::LineChannel ch(fd, fd);
    int rc = run_initiator(o, ch, region);
    close(fd);
    return rc;
  }
  // Both ranks here: the target is this binary again, started with exec.
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[1]);
    close(from_child[0]);
    std::string region_s = std::to_string(region);
    std::string policy = o.policy_file.empty() ? "-" : o.policy_file;
    execl("/proc/self/exe", argv[0], "--serve-target-on-stdio", o.backend.c_str(),
          region_s.c_str(), o.host.c_str(), policy.c_str(), "ferry-bench-target",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  signal(SIGPIPE, SIG_IGN);
  bench::LineChannel ch(from_child[0], to_child[1]);
  int rc = run_initiator(o, ch, region);
  close(to_child[1]);
  close(from_child[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  return rc;
}
