// SPDX-License-Identifier: Apache-2.0
// The driver of ferry-bench --scheme (scheme_run.h): starts every rank with
// exec, synchronises them through their pipes, prints the aggregate rows.
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "line_channel.h"
#include "scheme_run.h"

namespace ferry::bench {

namespace {

using Clock = std::chrono::steady_clock;

// A rank: this binary again, its stdin/stdout our pipes.
struct Rank {
  pid_t pid = -1;
  int to = -1, from = -1;  // our ends
  std::unique_ptr<LineChannel> ch;
};

// O_CLOEXEC on every end: a rank must not inherit another rank's pipes (it
// would hold them open, and that rank would never see EOF from us).
bool spawn(const std::vector<std::string>& args, Rank& r) {
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC) != 0) return false;
  if (pipe2(out, O_CLOEXEC) != 0) {
    close(in[0]);
    close(in[1]);
    return false;
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  r.pid = fork();
  if (r.pid == 0) {
    // dup2 leaves the new descriptors without O_CLOEXEC: 0 and 1 survive exec.
    if (dup2(in[0], 0) < 0 || dup2(out[1], 1) < 0) _exit(127);
    execv("/proc/self/exe", argv.data());
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  if (r.pid < 0) {
    close(in[1]);
    close(out[0]);
    return false;
  }
  r.to = in[1];
  r.from = out[0];
  r.ch = std::make_unique<LineChannel>(r.from, r.to);
  return true;
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

struct Row {
  size_t block = 0, batch = 0;
  int iters = 0;  // per initiator
  double agg_gbs = 0, ini_min_gbs = 0, ini_avg_gbs = 0, ini_max_gbs = 0;
  double avg_lat_us = 0, p50_lat_us = 0, p99_lat_us = 0, total_mb = 0;
  bool verified = false;
};

class Driver {
 public:
  Driver(const SchemeRun& r, const std::vector<std::string>& args) : r_(r), args_(args) {}

  ~Driver() { shut_down(); }

  int run() {
    if (!start()) return 1;
    print_header();
    std::vector<Row> rows;
    bool ok = true;
    const auto t0 = Clock::now();
    for (size_t i = 0; i < r_.points.size() && ok; ++i) {
      const auto [block, batch] = r_.points[i];
      if (r_.progress) {
        std::fprintf(stderr, "\r[ferry-bench] %zu/%zu block %zu batch %zu, %.0f s elapsed   ",
                     i + 1, r_.points.size(), block, batch,
                     std::chrono::duration<double>(Clock::now() - t0).count());
        std::fflush(stderr);
      }
      Row row;
      ok = run_point(block, batch, row);
      if (r_.progress) std::fprintf(stderr, "\r%78s\r", "");
      if (row.iters > 0) {
        rows.push_back(row);
        print_row(row);
      }
    }
    write_files(rows);
    const bool clean = shut_down();
    if (!ok) std::fprintf(stderr, "ferry-bench: stopped early (see above)\n");
    return ok && clean ? 0 : 1;
  }

 private:
  std::vector<std::string> rank_args(const char* role, int index) const {
    std::vector<std::string> a{"ferry-bench", role};
    a.insert(a.end(), args_.begin(), args_.end());
    a.push_back("--scheme-index");
    a.push_back(std::to_string(index));
    return a;
  }

  // Targets first (their descriptors), then the initiators.
  bool start() {
    const int m = r_.shape.targets, n = r_.shape.initiators;
    targets_.resize(static_cast<size_t>(m));
    std::string descs = "TARGETS " + std::to_string(m);
    for (int k = 0; k < m; ++k)
      if (!spawn(rank_args("--serve-target-on-stdio", k), targets_[static_cast<size_t>(k)]))
        return fail("cannot start target " + std::to_string(k));
    for (int k = 0; k < m; ++k) {
      std::string ready;
      if (!targets_[static_cast<size_t>(k)].ch->recv(ready, 120000) ||
          ready.rfind("READY ", 0) != 0)
        return fail("target " + std::to_string(k) + " did not start: " + ready);
      descs += " " + ready.substr(6);  // "<engine hex> <memory hex>"
    }
    initiators_.resize(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i)
      if (!spawn(rank_args("--serve-initiator-on-stdio", i), initiators_[static_cast<size_t>(i)]))
        return fail("cannot start initiator " + std::to_string(i));
    for (int i = 0; i < n; ++i) {
      LineChannel& ch = *initiators_[static_cast<size_t>(i)].ch;
      std::string hello;
      if (!ch.recv(hello, 120000) || hello.rfind("HELLO ", 0) != 0)
        return fail("initiator " + std::to_string(i) + " did not start: " + hello);
      for (const Leg& leg : legs_of(r_.shape, i)) {
        const std::string a =
            targets_[static_cast<size_t>(leg.target)].ch->ask("register " + hello.substr(6));
        if (a != "OK")
          return fail("target " + std::to_string(leg.target) + " could not register initiator " +
                      std::to_string(i) + ": " + a);
      }
      std::string ok = ch.ask(descs, 120000);
      if (ok != "OK") return fail("initiator " + std::to_string(i) + ": " + ok);
    }
    return true;
  }

  bool fail(const std::string& why) {
    std::fprintf(stderr, "ferry-bench: %s\n", why.c_str());
    return false;
  }

  // One reply from every initiator (WARM, DONE ... or ERR ...), serving their
  // "ask" lines meanwhile. A rank that exits or stays silent past the limit
  // (every transfer has a deadline, so a live rank answers) counts as an ERR.
  std::vector<std::string> collect() {
    const size_t n = initiators_.size();
    std::vector<std::string> reply(n);
    std::vector<bool> got(n, false);
    size_t left = n;
    while (left > 0) {
      std::vector<pollfd> pfds;
      std::vector<size_t> who;
      for (size_t i = 0; i < n; ++i)
        if (!got[i]) {
          pfds.push_back({initiators_[i].ch->in_fd(), POLLIN, 0});
          who.push_back(i);
        }
      const int pr = poll(pfds.data(), pfds.size(), 600000);
      if (pr < 0 && errno == EINTR) continue;
      if (pr <= 0) {
        for (size_t i : who) reply[i] = "ERR no answer in 600 s";
        break;
      }
      for (size_t p = 0; p < pfds.size(); ++p) {
        if (!pfds[p].revents) continue;
        const size_t i = who[p];
        LineChannel& ch = *initiators_[i].ch;
        std::string line;
        while (!got[i] && ch.recv(line, 0)) {
          if (line.rfind("ask ", 0) == 0) {
            ch.send(relay(line));
            continue;
          }
          reply[i] = line;
          got[i] = true;
          --left;
        }
        if (!got[i] && ch.closed()) {
          reply[i] = "ERR initiator " + std::to_string(i) + " exited";
          got[i] = true;
          --left;
        }
      }
    }
    return reply;
  }

  // "ask <target> <command>" -> that target's answer.
  std::string relay(const std::string& line) {
    std::istringstream in(line.substr(4));
    size_t k = 0;
    in >> k;
    std::string cmd;
    std::getline(in >> std::ws, cmd);
    if (k >= targets_.size()) return "ERR no target " + std::to_string(k);
    return targets_[k].ch->ask(cmd);
  }

  bool report_errors(const std::vector<std::string>& replies, const char* phase) {
    bool ok = true;
    for (size_t i = 0; i < replies.size(); ++i)
      if (replies[i].rfind("ERR", 0) == 0) {
        std::fprintf(stderr, "ferry-bench: initiator %zu (%s): %s\n", i, phase,
                     replies[i].c_str() + std::min<size_t>(4, replies[i].size()));
        ok = false;
      }
    return ok;
  }

  bool run_point(size_t block, size_t batch, Row& row) {
    int iters = r_.num_iter;
    if (block >= (1u << 20)) iters = std::max(1, iters / r_.large_block_iter_factor);
    const std::string point = "point " + std::to_string(block) + " " + std::to_string(batch) + " " +
                              std::to_string(iters);
    for (auto& ini : initiators_) ini.ch->send(point);
    // Every rank warmed up before any starts its timed iterations.
    auto warm = collect();
    if (!report_errors(warm, "warm-up")) return false;
    for (auto& ini : initiators_) ini.ch->send("go");
    auto done = collect();
    if (!report_errors(done, "timed")) return false;

    double slowest = 0, total = 0;
    std::vector<double> per, lat;
    bool verified = true;
    for (const auto& d : done) {
      std::istringstream in(d.substr(5));
      long long wall_ns = 0, excl_ns = 0;
      double bytes = 0;
      int ver = 0;
      size_t k = 0;
      in >> wall_ns >> excl_ns >> bytes >> ver >> k;
      for (size_t j = 0; j < k; ++j) {
        double l = 0;
        in >> l;
        lat.push_back(l);
      }
      // Checking time comes out only when nothing else ran meanwhile: one
      // initiator (its transfers are all final before it checks).
      double wall = static_cast<double>(wall_ns - (initiators_.size() == 1 ? excl_ns : 0)) * 1e-9;
      slowest = std::max(slowest, wall);
      total += bytes;
      per.push_back(wall > 0 ? bytes / wall / 1e9 : 0);
      verified = verified && ver == 1;
    }
    row.block = block;
    row.batch = batch;
    row.iters = iters;
    row.agg_gbs = slowest > 0 ? total / slowest / 1e9 : 0;
    row.ini_min_gbs = *std::min_element(per.begin(), per.end());
    row.ini_max_gbs = *std::max_element(per.begin(), per.end());
    double s = 0;
    for (double p : per) s += p;
    row.ini_avg_gbs = s / static_cast<double>(per.size());
    double ls = 0;
    for (double l : lat) ls += l;
    row.avg_lat_us = lat.empty() ? 0 : ls / static_cast<double>(lat.size());
    row.p50_lat_us = pct(lat, 0.5);
    row.p99_lat_us = pct(lat, 0.99);
    row.total_mb = total / 1e6;
    row.verified = r_.check && verified;
    return !r_.check || verified;
  }

  std::string op_label() const {
    if (r_.shape.scheme == Scheme::TP) return "WRITE+READ";
    return r_.op == Op::READ ? "READ" : "WRITE";
  }

  void print_header() const {
    std::printf(
        "ferry-bench: scheme=%s initiators=%d targets=%d backend=%s op=%s items=%s notify=%s "
        "check=%s initiator=%s target=%s\n",
        to_string(r_.shape.scheme), r_.shape.initiators, r_.shape.targets, r_.backend_label.c_str(),
        op_label().c_str(), r_.strided ? "strided" : "contiguous", r_.notify ? "on" : "off",
        r_.check ? "on" : "off", to_string(r_.init_seg), to_string(r_.target_seg));
    std::printf("%11s %6s %6s %9s %9s %9s %9s %10s %10s %10s %10s %8s\n", "Block (B)", "Batch",
                "Iters", "Agg GB/s", "Ini min", "Ini avg", "Ini max", "Avg Lat us", "P50 Lat us",
                "P99 Lat us", "Total MB", "Verified");
  }

  void print_row(const Row& w) const {
    std::printf("%11zu %6zu %6d %9.3f %9.3f %9.3f %9.3f %10.1f %10.1f %10.1f %10.1f %8s\n", w.block,
                w.batch, w.iters, w.agg_gbs, w.ini_min_gbs, w.ini_avg_gbs, w.ini_max_gbs,
                w.avg_lat_us, w.p50_lat_us, w.p99_lat_us, w.total_mb,
                !r_.check    ? "off"
                : w.verified ? "yes"
                             : "NO");
    std::fflush(stdout);
  }

  // A row's columns as (name, value) for both files; text is quoted in JSON,
  // and in CSV only where it holds a comma (a backend list such as "fault,tcp").
  std::vector<std::pair<const char*, std::string>> columns(const Row& w, bool json) const {
    auto text = [json](const std::string& v) {
      return json || v.find(',') != std::string::npos ? "\"" + v + "\"" : v;
    };
    auto num = [](double v) {
      std::ostringstream f;
      f.precision(6);
      f << v;
      return f.str();
    };
    const std::string verified = !r_.check    ? (json ? "null" : "")
                                 : w.verified ? (json ? "true" : "1")
                                              : (json ? "false" : "0");
    return {{"scheme", text(to_string(r_.shape.scheme))},
            {"initiators", std::to_string(r_.shape.initiators)},
            {"targets", std::to_string(r_.shape.targets)},
            {"backend", text(r_.backend_label)},
            {"op", text(op_label())},
            {"block_bytes", std::to_string(w.block)},
            {"batch", std::to_string(w.batch)},
            {"iters", std::to_string(w.iters)},
            {"bw_gbs", num(w.agg_gbs)},
            {"initiator_min_gbs", num(w.ini_min_gbs)},
            {"initiator_avg_gbs", num(w.ini_avg_gbs)},
            {"initiator_max_gbs", num(w.ini_max_gbs)},
            {"avg_lat_us", num(w.avg_lat_us)},
            {"p50_lat_us", num(w.p50_lat_us)},
            {"p99_lat_us", num(w.p99_lat_us)},
            {"total_mb", num(w.total_mb)},
            {"verified", verified}};
  }

  void write_files(const std::vector<Row>& rows) const {
    if (!r_.csv_file.empty()) {
      std::ofstream f(r_.csv_file);
      const auto names = columns(Row{}, false);
      for (size_t c = 0; c < names.size(); ++c) f << (c ? "," : "") << names[c].first;
      f << "\n";
      for (const auto& w : rows) {
        const auto cols = columns(w, false);
        for (size_t c = 0; c < cols.size(); ++c) f << (c ? "," : "") << cols[c].second;
        f << "\n";
      }
      if (!f) std::fprintf(stderr, "ferry-bench: cannot write %s\n", r_.csv_file.c_str());
    }
    if (!r_.json_file.empty()) {
      std::ofstream f(r_.json_file);
      f << "[";
      for (size_t i = 0; i < rows.size(); ++i) {
        f << (i ? ",\n {" : "\n {");
        const auto cols = columns(rows[i], true);
        for (size_t c = 0; c < cols.size(); ++c)
          f << (c ? "," : "") << "\"" << cols[c].first << "\":" << cols[c].second;
        f << "}";
      }
      f << "\n]\n";
      if (!f) std::fprintf(stderr, "ferry-bench: cannot write %s\n", r_.json_file.c_str());
    }
  }

  // Initiators first (their engines close before the targets'), then the
  // targets; every rank waited for. False when a rank did not end cleanly.
  bool shut_down() {
    bool clean = true;
    for (auto* group : {&initiators_, &targets_}) {
      for (auto& rk : *group)
        if (rk.ch && rk.ch->ask("quit", 30000) != "BYE") clean = false;
      for (auto& rk : *group) {
        if (rk.to >= 0) close(rk.to);
        if (rk.from >= 0) close(rk.from);
        rk.to = rk.from = -1;
        rk.ch.reset();
        int st = 0;
        if (rk.pid > 0 && waitpid(rk.pid, &st, 0) == rk.pid &&
            !(WIFEXITED(st) && WEXITSTATUS(st) == 0))
          clean = false;
        rk.pid = -1;
      }
    }
    return clean;
  }

  const SchemeRun& r_;
  const std::vector<std::string>& args_;
  std::vector<Rank> targets_, initiators_;
};

}  // namespace

int run_scheme_driver(const SchemeRun& run, const std::vector<std::string>& rank_args) {
  Driver d(run, rank_args);
  return d.run();
}

}  // namespace ferry::bench
