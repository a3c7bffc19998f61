// SPDX-License-Identifier: Apache-2.0
// ferry-bench: nixlbench-style transfer benchmark between two engines.
//
// One command on one machine (the target rank is this same binary, started with
// fork+exec and driven over pipes):
//   ferry-bench --backend tcp --op WRITE --start-block-size 4KiB --max-block-size 64MiB
// Two hosts (give both ranks the same size/thread/queue flags: they size the region):
//   host B: ferry-bench --rank 1 --listen 0.0.0.0:7000 --host B_ADDR
//             --backend-settings 'tcp={"listen_host":"0.0.0.0"}' ...
//   host A: ferry-bench --rank 0 --peer B_ADDR:7000 --host A_ADDR ...
// Or through etcd, as nixlbench: the same command on both hosts, ranks numbered
// by etcd (docs/operations.md):
//   ferry-bench --etcd-endpoints http://ETCD:2379 --host THIS_ADDR ...
// nixlbench's schemes with many processes, all on this machine (scheme_run.h):
//   ferry-bench --scheme manytoone --num-initiators 4 ...
// Every figure comes from real transfers; --check-consistency verifies every
// byte against a pattern that changes per iteration.
//
// Per iteration (nixlbench's columns): prep = building the iteration's
// descriptors (offsets, sizes, uid); post = the read/write call itself;
// tx = from the post call until the transfer's status is final; latency =
// prep + tx. B/W = bytes of the timed iterations of all threads / wall time.
// MORI's columns: total MB, max BW (one iteration's bytes / fastest tx), avg BW
// (= B/W), min and avg latency.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_target.h"
#include "etcd_rendezvous.h"
#include "ferry/ferry.hpp"
#include "kv_bench.h"
#include "line_channel.h"
#include "pattern.h"
#include "scheme.h"
#include "scheme_run.h"
#include "segment.h"

using namespace ferry;
using bench::SegType;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string backend = "tcp";  // or "policy": load every backend the policy names
  std::string policy_file;
  std::string stats_socket;  // the initiator serves its stats here (ferry stats PATH)
  bool stats_hold = false;   // after the run, serve them until stdin closes
  std::map<std::string, std::string> backend_settings;  // name -> JSON, both ranks
  Op op = Op::WRITE;
  size_t start_block = 4096, max_block = 64u << 20, block_mult = 2;
  size_t start_batch = 1, max_batch = 1, batch_mult = 2;
  int num_iter = 64, warmup_iter = 8;
  int large_block_iter_factor = 16;  // iterations / this for blocks >= 1 MiB
  int num_threads = 1;
  int queue_depth = 1;  // transfers in flight per thread (as ucx_perftest -O)
  // Idle this long before each post (not timed): a caller that sat waiting,
  // whose post() then runs with cold caches and TLB whatever the size.
  int post_gap_us = 0;
  bool check = false;
  bool session = false;
  bool notify = true;
  bool strided = false;
  int progress = -1;  // -1: when stderr is a terminal
  SegType init_seg = SegType::DRAM, target_seg = SegType::DRAM;
  int init_dev = -1, target_dev = -1;  // -1: 0 for VRAM
  std::string json_file, csv_file;
  int rank = -1;  // -1: both ranks locally
  std::string peer, listen, host = "127.0.0.1";
  // --etcd-endpoints: the ranks meet through etcd and the engines exchange
  // descriptors through it (no --peer / --listen).
  std::vector<std::string> etcd_endpoints;
  std::string etcd_ns = "ferry-bench";
  std::string metrics_address;  // the initiator's Prometheus endpoint
  bool kv = false;              // --kv: a KV-cache shipment per request (kv_bench.h)
  bench::KvOptions kv_opts;
  bool num_iter_given = false, warmup_given = false;
  // --scheme / --num-initiators / --num-targets (scheme.h); one pair is the
  // classic two-rank bench, anything else runs scheme_run.h's driver.
  bench::SchemeShape shape;
  int scheme_index = -1;  // internal: which target or initiator rank this process is
};

bool parse_size_arg(const std::string& s, size_t& out) {
  size_t i = 0;
  unsigned long long v = 0;
  while (i < s.size() && isdigit(static_cast<unsigned char>(s[i]))) {
    if (v > (~0ull) / 10 - 9) return false;
    v = v * 10 + static_cast<unsigned long long>(s[i++] - '0');
  }
  if (i == 0) return false;
  std::string u = s.substr(i);
  unsigned long long m = u.empty() || u == "B"      ? 1
                         : (u == "K" || u == "KiB") ? 1ull << 10
                         : (u == "M" || u == "MiB") ? 1ull << 20
                         : (u == "G" || u == "GiB") ? 1ull << 30
                                                    : 0;
  if (!m || v > (~0ull) / m) return false;
  out = static_cast<size_t>(v * m);
  return true;
}

// Usage errors found after parsing (and --listen/--peer that do not resolve):
// the same shape and exit code (2) as the parse errors main() reports.
[[noreturn]] void bad_usage(const std::string& why) {
  std::fprintf(stderr, "ferry-bench: %s\nRun with --help for more information.\n", why.c_str());
  std::exit(2);
}

// A size as --help shows it (the unit parse_size_arg takes back).
std::string size_str(size_t v) {
  for (auto [shift, unit] : {std::pair{30, "GiB"}, std::pair{20, "MiB"}, std::pair{10, "KiB"}})
    if (v != 0 && v % (size_t{1} << shift) == 0) return std::to_string(v >> shift) + unit;
  return std::to_string(v);
}

// A decimal int of at least `min`. Not CLI11's own integer conversion: that
// takes C prefixes (010 is 8, 0x10 is 16), and the bench has always read decimal.
int parse_int_arg(const std::string& name, const std::string& v, int min) {
  int out = 0;
  try {
    size_t used = 0;
    out = std::stoi(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
  } catch (const std::exception&) {
    throw CLI::ValidationError(name, "bad number '" + v + "'");
  }
  if (out < min)
    throw CLI::ValidationError(name, "value too small (at least " + std::to_string(min) + ")");
  return out;
}

// The first name of "--a,--b", for error messages.
std::string first_name(const std::string& names) { return names.substr(0, names.find(',')); }

// type "SIZE" (bytes, shown with a unit) or "N" (a count, shown plain); both take units.
CLI::Option* add_size(CLI::App& app, const std::string& names, size_t& out, const char* type,
                      const std::string& desc) {
  return app
      .add_option_function<std::string>(
          names,
          [&out, name = first_name(names)](const std::string& v) {
            if (!parse_size_arg(v, out) || out == 0)
              throw CLI::ValidationError(
                  name, "bad size '" + v + "' (above 0; units K/KiB, M/MiB, G/GiB)");
          },
          desc)
      ->type_name(type)
      ->default_str(std::string(type) == "N" ? std::to_string(out) : size_str(out));
}

CLI::Option* add_int(CLI::App& app, const std::string& names, int& out, int min,
                     const std::string& desc) {
  return app
      .add_option_function<std::string>(
          names,
          [&out, min, name = first_name(names)](const std::string& v) {
            out = parse_int_arg(name, v, min);
          },
          desc)
      ->type_name("N");
}

// nixlbench writes --start_block_size; accept both spellings. Only the option's
// name changes ("--a_b=x_y" becomes "--a-b=x_y"); "--" ends the options.
std::vector<std::string> dashed_args(int argc, char** argv) {
  std::vector<std::string> args;
  bool options = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") options = false;
    if (options && a.size() > 2 && a.rfind("--", 0) == 0)
      std::replace(a.begin() + 2,
                   a.begin() + static_cast<std::ptrdiff_t>(std::min(a.find('='), a.size())), '_',
                   '-');
    args.push_back(std::move(a));
  }
  std::reverse(args.begin(), args.end());  // CLI11's App::parse(vector) takes them last first
  return args;
}

// argv[1..argc-1] into Options; a bad command line exits 2 (after the message),
// --help exits 0.
Options parse_args(int argc, char** argv) {
  Options o;
  CLI::App app{
      "ferry-bench: nixlbench-style transfer benchmark between two engines. Both ranks\n"
      "run here (the target is this binary again) unless --rank is given.",
      "ferry-bench"};
  // The last of a repeated option wins, as it always did (docs/benchmarks.md's
  // command lines repeat --num-iter); CLI11's default would refuse them.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // "usage: ferry-bench" is what tests/deb_package.sh looks for in --help.
  app.get_formatter()->label("Usage", "usage");
  app.get_formatter()->column_width(34);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("ferry-bench: ") + e.what() + "\nRun with --help for more information.\n";
  });
  app.footer(
      "Sizes take K/KiB, M/MiB, G/GiB; block and batch sizes grow by their multiplier.\n"
      "--scheme (nixlbench's), every rank a process of this machine started by exec:\n"
      "  pairwise   N initiators, each with its own target (N pairs; N=1 is the classic bench)\n"
      "  manytoone  N initiators into one target's region, each its own slice, at once\n"
      "  onetomany  one initiator; each iteration posts to all M targets at once\n"
      "  tp         N initiators, N/M per target (default M=1): each WRITEs its shard, then\n"
      "             READs it back (one-sided ops: the 'and back' is the initiator's READ;\n"
      "             bytes of both count). --op does not apply.\n"
      "  Agg GB/s = bytes of all initiators' timed iterations / wall time of the slowest;\n"
      "  Ini min/avg/max = each initiator's own bytes / its own wall time.\n"
      "  Each initiator process has one iteration in flight (the processes are the\n"
      "  parallelism); --check-consistency checks every byte of every rank.\n"
      "--kv: --kv-layers x {K,V} regions of --kv-blocks blocks on each side, a request's\n"
      "random blocks moved for every layer, then a notification; prepared lists,\n"
      "multi-region items and per-region batches compared in one run.\n"
      "nixlbench spellings with '_' work too (--num_iter); a repeated option's last value wins.\n"
      "Two hosts (give both ranks the same size/thread/queue flags: they size the region):\n"
      "  host B: ferry-bench --rank 1 --listen 0.0.0.0:7000 --host B_ADDR \\\n"
      "            --backend-settings 'tcp={\"listen_host\":\"0.0.0.0\"}' ...\n"
      "  host A: ferry-bench --rank 0 --peer B_ADDR:7000 --host A_ADDR ...\n"
      "Or through etcd (nixlbench-style; the first started is rank 0), on both hosts:\n"
      "  ferry-bench --etcd-endpoints http://ETCD:2379 --host THIS_ADDR ...");

  const char* backends = "Backends";
  app.add_option("--backend", o.backend,
                 "backends to load (the policy ranks them); policy: every known one")
      ->type_name("NAME[,NAME...]|policy")
      ->capture_default_str()
      ->group(backends);
  app.add_option("--policy", o.policy_file, "policy YAML (ranking, timeout, settings)")
      ->type_name("FILE")
      ->group(backends);
  std::vector<std::string> settings;
  app.add_option("--backend-settings", settings,
                 "plugin settings for both ranks (repeatable)")
      ->type_name("NAME=JSON")
      ->take_all()
      ->allow_extra_args(false)  // one NAME=JSON per --backend-settings
      ->check(CLI::Validator(
          [](std::string& v) {
            const auto eq = v.find('=');
            return eq == std::string::npos || eq == 0 ? std::string("wants NAME=JSON")
                                                      : std::string();
          },
          ""))
      ->group(backends);
  app.add_option("--stats-socket", o.stats_socket,
                 "serve the initiator's stats here, for `ferry stats PATH`")
      ->type_name("PATH")
      ->group(backends);
  app.add_flag("--stats-hold", o.stats_hold,
               "after the run, keep serving --stats-socket until standard input closes (a "
               "script that samples the stats then reads the final ones, however fast the run)")
      ->group(backends);

  const char* xfer = "Transfers";
  std::string op = "WRITE", init_seg = "DRAM", target_seg = "DRAM";
  app.add_option("--op,--op-type", op, "the initiator reads or writes the target")
      ->transform(CLI::IsMember({"READ", "WRITE"}, CLI::ignore_case).description(""))
      ->type_name("READ|WRITE")
      ->capture_default_str()
      ->group(xfer);
  app.add_option("--initiator-seg-type", init_seg, "the initiator's memory")
      ->transform(CLI::IsMember({"DRAM", "VRAM"}, CLI::ignore_case).description(""))
      ->type_name("DRAM|VRAM")
      ->capture_default_str()
      ->group(xfer);
  add_int(app, "--initiator-device", o.init_dev, 0, "the initiator's GPU (default 0 for VRAM)")
      ->group(xfer);
  app.add_option("--target-seg-type", target_seg, "the target's memory")
      ->transform(CLI::IsMember({"DRAM", "VRAM"}, CLI::ignore_case).description(""))
      ->type_name("DRAM|VRAM")
      ->capture_default_str()
      ->group(xfer);
  add_int(app, "--target-device", o.target_dev, 0, "the target's GPU (default 0 for VRAM)")
      ->group(xfer);
  add_int(app, "--num-threads", o.num_threads, 1,
          "initiator threads, each its own region slice (at most 256)")
      ->default_str(std::to_string(o.num_threads))
      ->group(xfer);
  add_int(app, "--queue-depth", o.queue_depth, 1,
          "transfers in flight per thread, as ucx_perftest -O (<= 1024)")
      ->default_str(std::to_string(o.queue_depth))
      ->group(xfer);
  app.add_flag("--session", o.session, "session API (default: engine API)")->group(xfer);
  app.add_flag("--strided", o.strided, "batch items non-contiguous (a gap after each block)")
      ->group(xfer);
  app.add_flag("--check-consistency", o.check,
               "verify every byte (the pattern changes per iteration)")
      ->group(xfer);
  app.add_flag_callback(
         "--no-notify", [&o] { o.notify = false; }, "no target notification")
      ->group(xfer);

  const char* sweep = "Sweep";
  add_size(app, "--start-block-size", o.start_block, "SIZE", "first block size")->group(sweep);
  add_size(app, "--max-block-size", o.max_block, "SIZE", "last block size")->group(sweep);
  add_size(app, "--block-multiplier", o.block_mult, "N", "block size growth, at least 2")
      ->group(sweep);
  add_size(app, "--start-batch-size", o.start_batch, "N", "first number of blocks per transfer")
      ->group(sweep);
  add_size(app, "--max-batch-size", o.max_batch, "N", "last number of blocks per transfer")
      ->group(sweep);
  add_size(app, "--batch-multiplier", o.batch_mult, "N", "batch size growth, at least 2")
      ->group(sweep);
  auto* num_iter = add_int(app, "--num-iter", o.num_iter, 1,
                           "timed iterations per point (--kv: requests, default 16)")
                       ->default_str(std::to_string(o.num_iter))
                       ->group(sweep);
  auto* warmup_iter =
      add_int(app, "--warmup-iter", o.warmup_iter, 0, "untimed iterations first (--kv: default 2)")
          ->default_str(std::to_string(o.warmup_iter))
          ->group(sweep);
  add_int(app, "--large-block-iter-factor,--large-blk-iter-ftr", o.large_block_iter_factor, 1,
          "iterations are divided by this for blocks >= 1 MiB")
      ->default_str(std::to_string(o.large_block_iter_factor))
      ->group(sweep);
  add_int(app, "--post-gap-us", o.post_gap_us, 0,
          "sleep this long before each post, untimed (post() of a caller that sat idle)")
      ->default_str("0")
      ->group(sweep);

  const char* schemes = "Schemes (many processes, this machine)";
  std::string scheme = "pairwise";
  app.add_option("--scheme", scheme, "nixlbench's communication scheme (below)")
      ->transform(CLI::IsMember({"pairwise", "manytoone", "onetomany", "tp"}, CLI::ignore_case)
                      .description(""))
      ->type_name("pairwise|manytoone|onetomany|tp")
      ->capture_default_str()
      ->group(schemes);
  add_int(app, "--num-initiators", o.shape.initiators, 1, "initiator processes (at most 64)")
      ->default_str("1")
      ->group(schemes);
  add_int(app, "--num-targets", o.shape.targets, 1,
          "target processes (default: pairwise N, manytoone and tp 1)")
      ->group(schemes);
  add_int(app, "--scheme-index", o.scheme_index, 0, "internal: this rank's index")->group("");

  const char* out = "Output";
  app.add_option("--json", o.json_file, "write the rows as JSON")->type_name("FILE")->group(out);
  app.add_option("--csv", o.csv_file, "write the rows as CSV")->type_name("FILE")->group(out);
  // On each occurrence, so the last of --progress/--no-progress wins.
  app.add_flag_callback(
         "--progress", [&o] { o.progress = 1; },
         "a progress line on stderr (default: if stderr is a terminal)")
      ->trigger_on_parse()
      ->group(out);
  app.add_flag_callback(
         "--no-progress", [&o] { o.progress = 0; }, "no progress line")
      ->trigger_on_parse()
      ->group(out);

  const char* hosts = "Two hosts";
  app.add_option_function<std::string>(
         "--rank",
         [&o](const std::string& v) {
           o.rank = parse_int_arg("--rank", v, 0);
           if (o.rank > 1) throw CLI::ValidationError("--rank", "is 0 (initiator) or 1 (target)");
         },
         "0: the initiator, with --peer; 1: the target, with --listen")
      ->type_name("0|1")
      ->group(hosts);
  app.add_option("--peer", o.peer, "rank 0: the target's --listen address")
      ->type_name("HOST:PORT")
      ->group(hosts);
  app.add_option("--listen", o.listen, "rank 1: where to wait for rank 0 (port 0: any)")
      ->type_name("ADDR:PORT")
      ->group(hosts);
  app.add_option("--host", o.host, "this rank's address for its backends")
      ->type_name("ADDR")
      ->capture_default_str()
      ->group(hosts);
  app.add_option("--etcd-endpoints", o.etcd_endpoints,
                 "meet the other rank through etcd (nixlbench-style; no --peer/--listen): "
                 "the rendezvous and both engines' descriptors go through it; without "
                 "--rank, the first process started is rank 0, the second rank 1")
      ->type_name("URL")
      ->delimiter(',')
      ->group(hosts);
  app.add_option("--etcd-namespace", o.etcd_ns, "etcd key prefix of this run (both ranks)")
      ->capture_default_str()
      ->group(hosts);
  app.add_option("--metrics-address", o.metrics_address,
                 "serve the initiator's Prometheus /metrics on HOST:PORT (port 0: any)")
      ->type_name("HOST:PORT");

  const char* kv = "KV cache (--kv)";
  app.add_flag("--kv", o.kv, "a KV-cache shipment per request instead of the sweep (below)")
      ->group(kv);
  add_int(app, "--kv-layers", o.kv_opts.layers, 1, "layers, each a K and a V region (at most 4096)")
      ->default_str(std::to_string(o.kv_opts.layers))
      ->group(kv);
  add_size(app, "--kv-blocks", o.kv_opts.blocks, "N", "blocks per region")->group(kv);
  add_size(app, "--kv-block-size", o.kv_opts.block_bytes, "SIZE", "bytes per block")->group(kv);
  add_size(app, "--kv-request-blocks", o.kv_opts.request_blocks, "N", "random blocks per request")
      ->group(kv);

  try {
    app.parse(dashed_args(argc, argv));
  } catch (const CLI::Error& e) {  // ParseError, and whatever else CLI11 may throw while parsing
    // --help is a success (0); every other parse error keeps the bench's old code, 2.
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  for (const auto& v : settings) {
    const auto eq = v.find('=');
    o.backend_settings[v.substr(0, eq)] = v.substr(eq + 1);
  }
  o.op = op == "READ" ? Op::READ : Op::WRITE;
  bench::parse_scheme(scheme, &o.shape.scheme);
  bench::parse_seg_type(init_seg, &o.init_seg);
  bench::parse_seg_type(target_seg, &o.target_seg);
  o.num_iter_given = num_iter->count() > 0;
  o.warmup_given = warmup_iter->count() > 0;
  if (o.kv && o.post_gap_us > 0) bad_usage("--post-gap-us is for the block sweep, not --kv");
  if (o.kv) {
    // The sweep's region is not used: keep it small on both ranks.
    o.start_block = o.max_block = 4096;
    o.start_batch = o.max_batch = 1;
    bench::KvOptions& k = o.kv_opts;
    if (k.blocks == 0 || k.block_bytes == 0 || k.request_blocks == 0)
      bad_usage("--kv sizes must be above 0");
    if (k.request_blocks > k.blocks) bad_usage("--kv-request-blocks is above --kv-blocks");
    if (k.layers > 4096) bad_usage("--kv-layers is at most 4096");
    k.requests = o.num_iter_given ? o.num_iter : 16;
    k.warmup = o.warmup_given ? o.warmup_iter : 2;
    k.op = o.op;
    k.init_seg = o.init_seg;
    k.init_dev = o.init_dev < 0 && o.init_seg == SegType::VRAM ? 0 : o.init_dev;
    k.target_seg = o.target_seg;
    k.check = o.check;
    k.label = o.backend;
  }
  if (o.start_block > o.max_block) bad_usage("--start-block-size is above --max-block-size");
  if (o.start_batch > o.max_batch) bad_usage("--start-batch-size is above --max-batch-size");
  if (o.block_mult < 2 || o.batch_mult < 2) bad_usage("multipliers must be at least 2");
  if (o.num_threads > 256) bad_usage("--num-threads is at most 256");
  if (o.queue_depth > 1024) bad_usage("--queue-depth is at most 1024");
  const bool etcd = !o.etcd_endpoints.empty();
  if (etcd && (!o.peer.empty() || !o.listen.empty()))
    bad_usage("--etcd-endpoints replaces --peer and --listen (the ranks meet through etcd)");
  if (o.rank == 0 && o.peer.empty() && !etcd)
    bad_usage("--rank 0 needs --peer HOST:PORT or --etcd-endpoints URL");
  if (o.rank == 1 && o.listen.empty() && !etcd)
    bad_usage("--rank 1 needs --listen ADDR:PORT or --etcd-endpoints URL");
  if (o.stats_hold && o.stats_socket.empty()) bad_usage("--stats-hold needs --stats-socket");
  if (o.init_seg == SegType::VRAM && o.init_dev < 0) o.init_dev = 0;
  if (o.target_seg == SegType::VRAM && o.target_dev < 0) o.target_dev = 0;
  if (std::string why = bench::complete_shape(o.shape); !why.empty()) bad_usage(why);
  if (bench::multi_process(o.shape)) {
    const std::string s = std::string("--scheme ") + bench::to_string(o.shape.scheme);
    if (etcd || o.rank >= 0 || !o.peer.empty() || !o.listen.empty())
      bad_usage(s +
                " with more than one pair runs every rank on this machine: not with "
                "--rank, --peer, --listen or --etcd-endpoints");
    if (o.kv) bad_usage("--kv measures one pair: not with " + s + " or --num-initiators");
    if (o.num_threads != 1 || o.queue_depth != 1)
      bad_usage("each initiator process of " + s +
                " has one iteration in flight: leave --num-threads and --queue-depth at 1 "
                "(more --num-initiators instead)");
    if (o.session || !o.stats_socket.empty() || !o.metrics_address.empty() || o.post_gap_us > 0)
      bad_usage(
          "--session, --stats-socket, --metrics-address and --post-gap-us are for one pair, "
          "not " +
          s);
    if (o.shape.scheme == bench::Scheme::TP && o.op == Op::READ)
      bad_usage("--scheme tp writes each shard and reads it back: --op READ does not apply");
  }
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

const char* op_name(Op op) { return op == Op::READ ? "READ" : "WRITE"; }

// Where each thread's transfers land: thread t owns queue_depth slots, each big
// enough for the largest batch; strided items leave a block-sized gap behind them.
struct Layout {
  size_t stride_factor = 1;
  size_t slot_bytes = 0;
  size_t region = 0;
  int queue_depth = 1;

  explicit Layout(const Options& o) : stride_factor(o.strided ? 2 : 1), queue_depth(o.queue_depth) {
    slot_bytes = o.max_block * o.max_batch * stride_factor;
    region = slot_bytes * static_cast<size_t>(o.queue_depth) * static_cast<size_t>(o.num_threads);
  }
  size_t item_offset(int thread, int slot, size_t item, size_t block) const {
    return (static_cast<size_t>(thread) * static_cast<size_t>(queue_depth) +
            static_cast<size_t>(slot)) *
               slot_bytes +
           item * block * stride_factor;
  }
};

bench::TargetOptions target_options(const Options& o) {
  bench::TargetOptions t;
  t.backends = backends_of(o);
  t.backend_settings = o.backend_settings;
  t.host = o.host;
  // manytoone and tp: a slice per initiator that shares this target.
  t.region_bytes = Layout(o).region * static_cast<size_t>(bench::slices_per_target(o.shape));
  t.policy_file = o.policy_file;
  t.seg_type = o.target_seg;
  t.device = o.target_dev;
  t.key = "ferry-bench-target";
  if (o.scheme_index >= 0) t.key += "-" + std::to_string(o.scheme_index);  // one of several
  t.metadata.etcd = o.etcd_endpoints;
  t.metadata.ns = o.etcd_ns;
  return t;
}

bool split_host_port(const std::string& s, std::string& host, std::string& port) {
  auto c = s.rfind(':');
  if (c == std::string::npos) return false;
  host = s.substr(0, c);
  port = s.substr(c + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return !host.empty() && !port.empty();
}

// ---- target rank ----------------------------------------------------------------

int serve_over_socket(const Options& o) {
  std::string host, port;
  if (!split_host_port(o.listen, host, port)) bad_usage("--listen wants ADDR:PORT");
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0)
    bad_usage("cannot resolve --listen");
  int ls = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(ls, res->ai_addr, res->ai_addrlen) != 0 || listen(ls, 1) != 0) {
    std::perror("ferry-bench: listen");
    freeaddrinfo(res);
    return 1;
  }
  freeaddrinfo(res);
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  getsockname(ls, reinterpret_cast<sockaddr*>(&ss), &sl);
  unsigned bound = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                                  : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  // The port line is what scripts wait for (port 0 = any free one).
  std::fprintf(stderr, "ferry-bench: target waiting on %s:%u\n", host.c_str(), bound);
  std::fflush(stderr);
  int fd = accept(ls, nullptr, nullptr);
  close(ls);
  if (fd < 0) return 1;
  int rc = bench::run_target(target_options(o), fd, fd);
  close(fd);
  return rc;
}

// ---- initiator rank -------------------------------------------------------------

struct Row {
  size_t block = 0, batch = 0;
  int iters = 0;  // per thread
  double bw_gbs = 0, max_bw_gbs = 0;
  double avg_lat_us = 0, p50_lat_us = 0, p99_lat_us = 0, min_lat_us = 0;
  double avg_prep_us = 0, p99_prep_us = 0;
  double avg_post_us = 0, p99_post_us = 0;
  double avg_tx_us = 0, p99_tx_us = 0, min_tx_us = 0;
  double total_mb = 0;
  bool verified = false;
};

struct Sample {
  double prep, post, tx, lat;  // microseconds
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

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

class Initiator {
 public:
  Initiator(const Options& o, bench::LineChannel& ch) : o_(o), ch_(ch), layout_(o) {}

  bool setup() {
    std::string ready;
    if (!ch_.recv(ready, 120000) || ready.rfind("READY ", 0) != 0) {
      std::fprintf(stderr, "ferry-bench: target did not start: %s\n", ready.c_str());
      return false;
    }
    std::istringstream in(ready.substr(6));
    std::string ehex, mhex;
    in >> ehex >> mhex;
    std::string why;
    local_ = bench::Segment::allocate(o_.init_seg, o_.init_dev, layout_.region, &why);
    if (!local_) {
      std::fprintf(stderr, "ferry-bench: initiator memory: %s\n", why.c_str());
      return false;
    }
    EngineConfig cfg;
    cfg.host = o_.host;
    cfg.policy_file = o_.policy_file;
    cfg.stats_socket = o_.stats_socket;
    cfg.metrics_address = o_.metrics_address;
    cfg.metadata.etcd = o_.etcd_endpoints;
    cfg.metadata.ns = o_.etcd_ns;
    try {
      engine_ = std::make_unique<Engine>("ferry-bench-initiator", cfg);
      if (!o_.metrics_address.empty())
        std::fprintf(stderr, "ferry-bench: metrics on http://%s/metrics\n",
                     engine_->metrics_address().c_str());
    } catch (const Error& e) {
      std::fprintf(stderr, "ferry-bench: %s\n", e.what());
      return false;
    }
    int loaded = 0;
    for (const auto& b : backends_of(o_)) {
      auto s = o_.backend_settings.find(b);
      Result r =
          engine_->add_backend(b, s == o_.backend_settings.end() ? std::string() : s->second);
      if (r)
        ++loaded;
      else if (o_.backend != "policy") {
        std::fprintf(stderr, "ferry-bench: %s\n", r.message.c_str());
        return false;
      }
    }
    if (!loaded) {
      std::fprintf(stderr, "ferry-bench: no backend loaded\n");
      return false;
    }
    if (!o_.etcd_endpoints.empty()) {
      // nixlbench's way: the target's descriptors from the store, not the channel.
      Result r = engine_->fetch_remote_engine("ferry-bench-target", std::chrono::seconds(60));
      std::optional<MemoryDesc> m;
      if (r) m = engine_->fetch_memory("ferry-bench-target", "bench", std::chrono::seconds(60), &r);
      if (!m) {
        std::fprintf(stderr, "ferry-bench: etcd: %s\n", r.message.c_str());
        return false;
      }
      remote_ = *m;
      std::fprintf(stderr, "ferry-bench: the target's descriptors came from etcd (%s)\n",
                   o_.etcd_ns.c_str());
    } else
      try {
        EngineDesc target = EngineDesc::unpack(test::from_hex(ehex));
        remote_ = MemoryDesc::unpack(test::from_hex(mhex));
        if (Result r = engine_->register_remote_engine(target); !r) {
          std::fprintf(stderr, "ferry-bench: %s\n", r.message.c_str());
          return false;
        }
      } catch (const Error& e) {
        std::fprintf(stderr, "ferry-bench: bad descriptor from the target: %s\n", e.what());
        return false;
      }
    if (remote_.size < layout_.region) {
      std::fprintf(stderr,
                   "ferry-bench: the target's region has %llu bytes, this run needs %zu; give "
                   "both ranks the same --max-block-size, --max-batch-size, --num-threads, "
                   "--queue-depth and --strided\n",
                   static_cast<unsigned long long>(remote_.size), layout_.region);
      return false;
    }
    std::string ok = ask("register " + test::to_hex(engine_->desc().pack()));
    if (ok != "OK") {
      std::fprintf(stderr, "ferry-bench: target could not register us: %s\n", ok.c_str());
      return false;
    }
    try {
      local_mem_ = engine_->register_memory(local_->data(), local_->size(),
                                            local_->registration_device(), local_->location());
    } catch (const Error& e) {
      std::fprintf(stderr, "ferry-bench: register_memory: %s\n", e.what());
      return false;
    }
    if (o_.session) {
      for (int t = 0; t < o_.num_threads; ++t) {
        Result why_s;
        auto s = engine_->create_session(local_mem_, remote_, &why_s);
        if (!s) {
          std::fprintf(stderr, "ferry-bench: no session: %s\n", why_s.message.c_str());
          return false;
        }
        sessions_.push_back(std::move(s));
      }
    }
    return true;
  }

  bool run_point(size_t block, size_t batch, Row& row) {
    int iters = o_.num_iter;
    if (block >= (1u << 20)) iters = std::max(1, iters / o_.large_block_iter_factor);
    const int n = o_.num_threads;
    std::vector<std::vector<Sample>> samples(static_cast<size_t>(n));
    std::vector<Clock::time_point> start(static_cast<size_t>(n)), end(static_cast<size_t>(n));
    std::vector<double> excluded_s(static_cast<size_t>(n), 0.0);
    std::atomic<bool> failed{false}, mismatch{false};
    std::barrier sync(n);
    std::vector<std::thread> threads;
    for (int t = 0; t < n; ++t) {
      threads.emplace_back([&, t] {
        const auto ti = static_cast<size_t>(t);
        ThreadRun run{*this, t, block, batch};
        run.loop(o_.warmup_iter, nullptr, failed, mismatch, nullptr);
        sync.arrive_and_wait();  // every thread starts the timed part together
        start[ti] = Clock::now();
        if (!failed) run.loop(iters, &samples[ti], failed, mismatch, &excluded_s[ti]);
        end[ti] = Clock::now();
      });
    }
    for (auto& th : threads) th.join();
    if (failed) return false;

    double wall = 0;
    std::vector<double> prep, post, tx, lat;
    for (size_t t = 0; t < static_cast<size_t>(n); ++t) {
      // Checking time is taken out only when nothing else was in flight meanwhile
      // (one thread, queue depth 1); otherwise B/W includes it (a lower bound).
      const double excl = n == 1 && o_.queue_depth == 1 ? excluded_s[t] : 0.0;
      wall = std::max(wall, std::chrono::duration<double>(end[t] - start[t]).count() - excl);
      for (const Sample& s : samples[t]) {
        prep.push_back(s.prep);
        post.push_back(s.post);
        tx.push_back(s.tx);
        lat.push_back(s.lat);
      }
    }
    const double bytes = static_cast<double>(block) * static_cast<double>(batch);
    const double total = bytes * static_cast<double>(iters) * n;
    row.block = block;
    row.batch = batch;
    row.iters = iters;
    row.bw_gbs = wall > 0 ? total / wall / 1e9 : 0;
    row.min_tx_us = pct(tx, 0.0);
    row.max_bw_gbs = row.min_tx_us > 0 ? bytes / (row.min_tx_us * 1e-6) / 1e9 : 0;
    row.avg_lat_us = avg(lat);
    row.p50_lat_us = pct(lat, 0.50);
    row.p99_lat_us = pct(lat, 0.99);
    row.min_lat_us = pct(lat, 0.0);
    row.avg_prep_us = avg(prep);
    row.p99_prep_us = pct(prep, 0.99);
    row.avg_post_us = avg(post);
    row.p99_post_us = pct(post, 0.99);
    row.avg_tx_us = avg(tx);
    row.p99_tx_us = pct(tx, 0.99);
    row.total_mb = total / 1e6;
    row.verified = o_.check && !mismatch;
    return !mismatch;
  }

  void print_stats() {
    EngineStats st = engine_->stats();
    std::printf("stats (initiator):");
    for (const auto& [name, b] : st.backends)
      std::printf(" %s{transfers=%llu bytes=%llu failures=%llu failovers=%llu quarantines=%llu}",
                  name.c_str(), static_cast<unsigned long long>(b.transfers),
                  static_cast<unsigned long long>(b.bytes),
                  static_cast<unsigned long long>(b.failures),
                  static_cast<unsigned long long>(b.failovers),
                  static_cast<unsigned long long>(b.quarantines));
    std::printf("\n");
  }

  Engine& engine() { return *engine_; }
  std::string ask_target(const std::string& line) { return ask(line); }

  void quit() {
    // Close our side first, so the target's exit is not a lost connection to us.
    sessions_.clear();
    engine_.reset();
    ask("quit", 10000);
  }

 private:
  // One thread's iterations at one (block, batch) point, queue_depth in flight.
  struct ThreadRun {
    Initiator& ini;
    int thread;
    size_t block, batch;

    struct Slot {
      bool busy = false;
      TransferStatus st;
      Clock::time_point t_prep, t_post0, t_post1;
      uint64_t seed = 0;
      std::vector<size_t> offs, sizes;
    };

    // samples == nullptr: warm-up (nothing recorded). excluded: seconds spent
    // preparing and checking data, taken out of the wall time.
    void loop(int iters, std::vector<Sample>* samples, std::atomic<bool>& failed,
              std::atomic<bool>& mismatch, double* excluded) {
      const Options& o = ini.o_;
      std::vector<Slot> slots(static_cast<size_t>(o.queue_depth));
      if (samples) samples->reserve(static_cast<size_t>(iters));
      auto complete = [&](Slot& s) {
        StatusCode code = s.st.Wait();
        auto t_done = Clock::now();
        s.busy = false;
        if (code != StatusCode::SUCCESS) {
          std::fprintf(stderr, "ferry-bench: transfer failed: %s: %s\n", to_string(code),
                       s.st.Message().c_str());
          failed = true;
          return;
        }
        if (samples)
          samples->push_back({us(s.t_post0 - s.t_prep), us(s.t_post1 - s.t_post0),
                              us(t_done - s.t_post0), us(t_done - s.t_prep)});
        if (o.check) {
          auto c0 = Clock::now();
          if (!ini.verify(s.offs, block, s.seed)) {
            std::fprintf(stderr, "ferry-bench: DATA MISMATCH at block %zu batch %zu thread %d\n",
                         block, batch, thread);
            mismatch = true;
          }
          if (excluded) *excluded += std::chrono::duration<double>(Clock::now() - c0).count();
        }
      };
      for (int it = 0; it < iters && !failed; ++it) {
        const int si = it % o.queue_depth;
        Slot& s = slots[static_cast<size_t>(si)];
        if (s.busy) complete(s);
        if (failed) break;
        if (o.check) {
          auto c0 = Clock::now();
          s.seed = ini.next_seed_.fetch_add(1);
          std::vector<size_t> offs(batch);
          for (size_t i = 0; i < batch; ++i)
            offs[i] = ini.layout_.item_offset(thread, si, i, block);
          if (!ini.prepare_data(offs, block, s.seed)) {
            std::fprintf(stderr, "ferry-bench: target could not prepare data\n");
            failed = true;
            break;
          }
          if (excluded) *excluded += std::chrono::duration<double>(Clock::now() - c0).count();
        }
        if (o.post_gap_us > 0) {
          auto g0 = Clock::now();
          std::this_thread::sleep_for(std::chrono::microseconds(o.post_gap_us));
          if (excluded) *excluded += std::chrono::duration<double>(Clock::now() - g0).count();
        }
        // prep: this iteration's descriptors.
        s.t_prep = Clock::now();
        s.offs.resize(batch);
        for (size_t i = 0; i < batch; ++i)
          s.offs[i] = ini.layout_.item_offset(thread, si, i, block);
        s.sizes.assign(batch, block);
        TransferUid uid = ini.engine_->allocate_transfer_uid();
        s.t_post0 = Clock::now();
        s.st = ini.post(thread, s.offs, s.sizes, uid);
        s.t_post1 = Clock::now();
        s.busy = true;
      }
      for (auto& s : slots)
        if (s.busy) complete(s);
    }
  };

  std::string ask(const std::string& line, int timeout_ms = 120000) {
    std::lock_guard lk(ch_mu_);
    return ch_.ask(line, timeout_ms);
  }

  TransferStatus post(int thread, const std::vector<size_t>& offs, const std::vector<size_t>& sizes,
                      TransferUid uid) {
    const bool rd = o_.op == Op::READ;
    if (!sessions_.empty()) {
      Session& s = *sessions_[static_cast<size_t>(thread)];
      if (offs.size() == 1)
        return rd ? s.read(offs[0], offs[0], sizes[0], uid, o_.notify)
                  : s.write(offs[0], offs[0], sizes[0], uid, o_.notify);
      return rd ? s.batch_read(offs, offs, sizes, uid, o_.notify)
                : s.batch_write(offs, offs, sizes, uid, o_.notify);
    }
    Engine& e = *engine_;
    if (offs.size() == 1)
      return rd ? e.read(local_mem_, offs[0], remote_, offs[0], sizes[0], uid, o_.notify)
                : e.write(local_mem_, offs[0], remote_, offs[0], sizes[0], uid, o_.notify);
    return rd ? e.batch_read(local_mem_, offs, remote_, offs, sizes, uid, o_.notify)
              : e.batch_write(local_mem_, offs, remote_, offs, sizes, uid, o_.notify);
  }

  std::string ranges(const std::vector<size_t>& offs, size_t block) {
    std::ostringstream r;
    r << offs.size();
    for (size_t off : offs) r << " " << off << " " << block;
    return r.str();
  }

  // The pattern of `seed` must be on the destination of every item.
  bool verify(const std::vector<size_t>& offs, size_t block, uint64_t seed) {
    if (o_.op == Op::READ) {
      for (size_t off : offs)
        if (local_->find_mismatch(off, block, seed) != -1) return false;
      return true;
    }
    uint64_t h = test::kFnvBasis;
    for (size_t off : offs) h = local_->fnv1a(off, block, h);
    return ask("hash " + ranges(offs, block)) == "HASH " + std::to_string(h);
  }

  // The source holds pattern(seed), the destination something else.
  bool prepare_data(const std::vector<size_t>& offs, size_t block, uint64_t seed) {
    if (o_.op == Op::WRITE) {
      for (size_t off : offs) local_->fill_pattern(off, block, seed);
      return true;
    }
    for (size_t off : offs) local_->zero(off, block);
    return ask("fill " + std::to_string(seed) + " " + ranges(offs, block)) == "OK";
  }

  const Options& o_;
  bench::LineChannel& ch_;
  std::mutex ch_mu_;
  const Layout layout_;
  std::unique_ptr<bench::Segment> local_;  // outlives the engine
  std::unique_ptr<Engine> engine_;
  std::vector<std::unique_ptr<Session>> sessions_;
  MemoryDesc local_mem_, remote_;
  std::atomic<uint64_t> next_seed_{1};
};

void print_header(const Options& o) {
  std::printf(
      "ferry-bench: backend=%s op=%s api=%s threads=%d queue_depth=%d items=%s notify=%s "
      "check=%s initiator=%s target=%s\n",
      o.backend.c_str(), op_name(o.op), o.session ? "session" : "engine", o.num_threads,
      o.queue_depth, o.strided ? "strided" : "contiguous", o.notify ? "on" : "off",
      o.check ? "on" : "off", bench::to_string(o.init_seg), bench::to_string(o.target_seg));
  std::printf("%11s %6s %9s %10s %9s %9s %9s %9s %10s %10s %10s %9s %10s %10s %8s\n", "Block (B)",
              "Batch", "B/W GB/s", "Avg Lat us", "Avg Prep", "P99 Prep", "Avg Post", "P99 Post",
              "Avg Tx us", "P99 Tx us", "Total MB", "Max GB/s", "Min Lat us", "P99 Lat us",
              "Verified");
}

void print_row(const Row& r, bool checked) {
  std::printf(
      "%11zu %6zu %9.3f %10.1f %9.2f %9.2f %9.2f %9.2f %10.1f %10.1f %10.1f %9.3f %10.1f "
      "%10.1f %8s\n",
      r.block, r.batch, r.bw_gbs, r.avg_lat_us, r.avg_prep_us, r.p99_prep_us, r.avg_post_us,
      r.p99_post_us, r.avg_tx_us, r.p99_tx_us, r.total_mb, r.max_bw_gbs, r.min_lat_us, r.p99_lat_us,
      !checked     ? "off"
      : r.verified ? "yes"
                   : "NO");
  std::fflush(stdout);
}

std::string fmt(double v) {
  std::ostringstream s;
  s.precision(6);
  s << v;
  return s.str();
}

void write_files(const Options& o, const std::vector<Row>& rows) {
  // One list of columns serves both files; `text` columns are quoted in JSON.
  struct Col {
    const char* name;
    bool text;
    std::string (*get)(const Options&, const Row&);
  };
#define FERRY_BENCH_COL(field)                                               \
  {                                                                          \
#field, false, [](const Options&, const Row& r) { return fmt(r.field); } \
  }
  static const Col cols[] = {
      {"backend", true, [](const Options& o, const Row&) { return o.backend; }},
      {"op", true, [](const Options& o, const Row&) { return std::string(op_name(o.op)); }},
      {"api", true,
       [](const Options& o, const Row&) { return std::string(o.session ? "session" : "engine"); }},
      {"threads", false,
       [](const Options& o, const Row&) { return std::to_string(o.num_threads); }},
      {"queue_depth", false,
       [](const Options& o, const Row&) { return std::to_string(o.queue_depth); }},
      {"strided", false,
       [](const Options& o, const Row&) { return std::to_string(o.strided ? 1 : 0); }},
      {"notify", false,
       [](const Options& o, const Row&) { return std::to_string(o.notify ? 1 : 0); }},
      {"initiator_seg", true,
       [](const Options& o, const Row&) { return std::string(bench::to_string(o.init_seg)); }},
      {"target_seg", true,
       [](const Options& o, const Row&) { return std::string(bench::to_string(o.target_seg)); }},
      {"block_bytes", false, [](const Options&, const Row& r) { return std::to_string(r.block); }},
      {"batch", false, [](const Options&, const Row& r) { return std::to_string(r.batch); }},
      {"iters", false, [](const Options&, const Row& r) { return std::to_string(r.iters); }},
      FERRY_BENCH_COL(bw_gbs),
      FERRY_BENCH_COL(avg_lat_us),
      FERRY_BENCH_COL(p50_lat_us),
      FERRY_BENCH_COL(p99_lat_us),
      FERRY_BENCH_COL(min_lat_us),
      FERRY_BENCH_COL(avg_prep_us),
      FERRY_BENCH_COL(p99_prep_us),
      FERRY_BENCH_COL(avg_post_us),
      FERRY_BENCH_COL(p99_post_us),
      FERRY_BENCH_COL(avg_tx_us),
      FERRY_BENCH_COL(p99_tx_us),
      FERRY_BENCH_COL(min_tx_us),
      FERRY_BENCH_COL(total_mb),
      FERRY_BENCH_COL(max_bw_gbs),
      {"avg_bw_gbs", false, [](const Options&, const Row& r) { return fmt(r.bw_gbs); }},
      // Empty (CSV) / null (JSON) when the run did not check the data.
      {"verified", false,
       [](const Options& o, const Row& r) {
         return std::string(!o.check ? "" : r.verified ? "1" : "0");
       }},
  };
#undef FERRY_BENCH_COL
  if (!o.csv_file.empty()) {
    // RFC 4180: a value with a comma (a backend list such as "fault,tcp"), a
    // quote or a line break is quoted, its quotes doubled.
    auto field = [](const std::string& v) {
      if (v.find_first_of(",\"\r\n") == std::string::npos) return v;
      std::string q = "\"";
      for (char ch : v) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
      return q + "\"";
    };
    std::ofstream f(o.csv_file);
    for (size_t c = 0; c < std::size(cols); ++c) f << (c ? "," : "") << cols[c].name;
    f << "\n";
    for (const auto& r : rows) {
      for (size_t c = 0; c < std::size(cols); ++c) f << (c ? "," : "") << field(cols[c].get(o, r));
      f << "\n";
    }
    if (!f) std::fprintf(stderr, "ferry-bench: cannot write %s\n", o.csv_file.c_str());
  }
  if (!o.json_file.empty()) {
    std::ofstream f(o.json_file);
    f << "[";
    for (size_t i = 0; i < rows.size(); ++i) {
      f << (i ? ",\n {" : "\n {");
      for (size_t c = 0; c < std::size(cols); ++c) {
        std::string v = cols[c].get(o, rows[i]);
        if (cols[c].text)
          v = "\"" + v + "\"";
        else if (v.empty())
          v = "null";
        else if (std::strcmp(cols[c].name, "verified") == 0)
          v = v == "1" ? "true" : "false";
        f << (c ? "," : "") << "\"" << cols[c].name << "\":" << v;
      }
      f << "}";
    }
    f << "\n]\n";
    if (!f) std::fprintf(stderr, "ferry-bench: cannot write %s\n", o.json_file.c_str());
  }
}

// The sweep's points, in order.
std::vector<std::pair<size_t, size_t>> sweep(const Options& o) {
  std::vector<std::pair<size_t, size_t>> pts;
  for (size_t block = o.start_block; block <= o.max_block; block *= o.block_mult) {
    for (size_t batch = o.start_batch; batch <= o.max_batch; batch *= o.batch_mult) {
      pts.emplace_back(block, batch);
      if (batch > o.max_batch / o.batch_mult) break;
    }
    if (block > o.max_block / o.block_mult) break;
  }
  return pts;
}

// What the scheme driver and its initiator ranks need of the command line.
bench::SchemeRun scheme_run(const Options& o) {
  bench::SchemeRun r;
  r.shape = o.shape;
  r.backends = backends_of(o);
  r.backend_label = o.backend;
  r.backend_settings = o.backend_settings;
  r.policy_file = o.policy_file;
  r.host = o.host;
  r.op = o.op;
  r.notify = o.notify;
  r.check = o.check;
  r.strided = o.strided;
  r.progress = o.progress < 0 ? isatty(STDERR_FILENO) != 0 : o.progress == 1;
  r.init_seg = o.init_seg;
  r.target_seg = o.target_seg;
  r.init_dev = o.init_dev;
  r.slice_bytes = Layout(o).region;  // one thread, queue depth 1: one slot
  r.points = sweep(o);
  r.num_iter = o.num_iter;
  r.warmup_iter = o.warmup_iter;
  r.large_block_iter_factor = o.large_block_iter_factor;
  r.csv_file = o.csv_file;
  r.json_file = o.json_file;
  return r;
}

int run_initiator(const Options& o, bench::LineChannel& ch) {
  Initiator ini(o, ch);
  if (!ini.setup()) {
    ini.quit();
    return 1;
  }
  if (o.kv) {
    int rc = 1;
    try {
      rc = bench::run_kv(o.kv_opts, ini.engine(),
                         [&](const std::string& line) { return ini.ask_target(line); });
    } catch (const Error& e) {
      std::fprintf(stderr, "ferry-bench --kv: %s\n", e.what());
    }
    ini.print_stats();
    ini.quit();
    return rc;
  }
  print_header(o);
  std::vector<Row> rows;
  bool ok = true;
  const auto points = sweep(o);
  const bool progress = o.progress < 0 ? isatty(STDERR_FILENO) != 0 : o.progress == 1;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < points.size() && ok; ++i) {
    auto [block, batch] = points[i];
    if (progress) {
      // A progress line for long sweeps: point, size, elapsed time.
      std::fprintf(stderr, "\r[ferry-bench] %zu/%zu block %zu batch %zu, %.0f s elapsed   ", i + 1,
                   points.size(), block, batch,
                   std::chrono::duration<double>(Clock::now() - t0).count());
      std::fflush(stderr);
    }
    Row r{};
    ok = ini.run_point(block, batch, r);
    if (progress) std::fprintf(stderr, "\r%78s\r", "");
    if (ok || r.iters > 0) {
      rows.push_back(r);
      print_row(r, o.check);
    }
  }
  write_files(o, rows);
  ini.print_stats();
  if (o.stats_hold) {
    std::fflush(stdout);
    char buf[256];
    while (::read(STDIN_FILENO, buf, sizeof buf) > 0) {
    }
  }
  ini.quit();
  if (!ok) std::fprintf(stderr, "ferry-bench: stopped early (see above)\n");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Internal: the target rank when both ranks run on this machine; the rest of
  // the command line is the initiator's, so both size the region the same way.
  if (argc >= 2 && std::string(argv[1]) == "--serve-target-on-stdio") {
    Options o = parse_args(argc - 1, argv + 1);
    return bench::run_target(target_options(o), 0, 1);
  }
  // Internal: one initiator rank of a --scheme run (scheme_run.h).
  if (argc >= 2 && std::string(argv[1]) == "--serve-initiator-on-stdio") {
    Options o = parse_args(argc - 1, argv + 1);
    signal(SIGPIPE, SIG_IGN);
    return bench::run_scheme_initiator(scheme_run(o), o.scheme_index, 0, 1);
  }
  Options o = parse_args(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  if (bench::multi_process(o.shape))
    return bench::run_scheme_driver(scheme_run(o), std::vector<std::string>(argv + 1, argv + argc));
  if (!o.etcd_endpoints.empty()) {
    bench::EtcdRendezvous rv{o.etcd_endpoints, o.etcd_ns};
    std::string why;
    // No --rank: numbered through etcd, as nixlbench's ranks are.
    if (o.rank < 0 && (o.rank = bench::claim_rank(rv, &why)) < 0) {
      std::fprintf(stderr, "ferry-bench: etcd: %s\n", why.c_str());
      return 1;
    }
    const int fd = o.rank == 1 ? bench::rendezvous_accept(rv, o.host, std::chrono::minutes(5), &why)
                               : bench::rendezvous_connect(rv, std::chrono::minutes(5), &why);
    if (fd < 0) {
      std::fprintf(stderr, "ferry-bench: etcd rendezvous: %s\n", why.c_str());
      return 1;
    }
    int rc = 0;
    if (o.rank == 1) {
      rc = bench::run_target(target_options(o), fd, fd);
    } else {
      bench::LineChannel ch(fd, fd);
      rc = run_initiator(o, ch);
    }
    close(fd);
    return rc;
  }
  if (o.rank == 1) return serve_over_socket(o);
  if (o.rank == 0) {
    std::string host, port;
    if (!split_host_port(o.peer, host, port)) bad_usage("--peer wants HOST:PORT");
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0)
      bad_usage("cannot resolve --peer");
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
      std::perror("ferry-bench: connect to --peer");
      freeaddrinfo(res);
      return 1;
    }
    freeaddrinfo(res);
    bench::LineChannel ch(fd, fd);
    int rc = run_initiator(o, ch);
    close(fd);
    return rc;
  }
  // Both ranks here: the target is this binary again, started with exec.
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  std::vector<char*> args;
  args.push_back(argv[0]);
  args.push_back(const_cast<char*>("--serve-target-on-stdio"));
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[0]);
    close(to_child[1]);
    close(from_child[0]);
    close(from_child[1]);
    execv("/proc/self/exe", args.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  bench::LineChannel ch(from_child[0], to_child[1]);
  int rc = run_initiator(o, ch);
  close(to_child[1]);
  close(from_child[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  return rc;
}
