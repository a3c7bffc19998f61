// SPDX-License-Identifier: Apache-2.0
// One initiator rank of ferry-bench --scheme (scheme_run.h): one engine, one
// local region with a slice per target it talks to, one iteration in flight
// (the parallelism of a scheme is its processes). An iteration posts to every
// target of the rank at once (onetomany: to all of them) and ends when all are
// final; tp's iteration is a WRITE of the shard, then a READ of it back.
#include <chrono>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "line_channel.h"
#include "pattern.h"
#include "scheme_run.h"

namespace ferry::bench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class SchemeInitiator {
 public:
  SchemeInitiator(const SchemeRun& r, int index, LineChannel& ch)
      : r_(r), index_(index), ch_(ch), legs_(legs_of(r.shape, index)) {}

  int serve() {
    std::string why;
    if (!start(&why)) {
      ch_.send("ERR " + why);
      return 1;
    }
    std::string line;
    while (ch_.recv(line)) {
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      if (cmd == "quit") return quit();
      if (cmd != "point") {
        ch_.send("ERR unknown command '" + cmd + "'");
        continue;
      }
      size_t block = 0, batch = 0;
      int iters = 0;
      in >> block >> batch >> iters;
      const std::string reply = run_point(block, batch, iters);
      if (reply.empty()) return quit();  // told to quit instead of go
      ch_.send(reply);
    }
    return 1;  // the driver went away
  }

 private:
  int quit() {
    engine_.reset();  // our side closes first: the target sees no lost peer
    ch_.send("BYE");
    return 0;
  }

  // The engine, the local region, then the targets' descriptors from the driver.
  bool start(std::string* why) {
    local_ = Segment::allocate(r_.init_seg, r_.init_dev, r_.slice_bytes * legs_.size(), why);
    if (!local_) return false;
    EngineConfig cfg;
    cfg.host = r_.host;
    cfg.policy_file = r_.policy_file;
    try {
      engine_ = std::make_unique<Engine>("ferry-bench-initiator-" + std::to_string(index_), cfg);
    } catch (const Error& e) {
      *why = e.what();
      return false;
    }
    int loaded = 0;
    for (const auto& b : r_.backends) {
      auto s = r_.backend_settings.find(b);
      Result res =
          engine_->add_backend(b, s == r_.backend_settings.end() ? std::string() : s->second);
      if (res) {
        ++loaded;
      } else if (r_.backend_label != "policy") {
        *why = res.message;
        return false;
      }
    }
    if (!loaded) {
      *why = "no backend loaded";
      return false;
    }
    std::string line;
    if (!ch_.send("HELLO " + test::to_hex(engine_->desc().pack())) || !ch_.recv(line) ||
        line.rfind("TARGETS ", 0) != 0) {
      *why = "no target descriptors from the driver";
      return false;
    }
    std::istringstream in(line.substr(8));
    size_t m = 0;
    in >> m;
    std::vector<std::pair<std::string, std::string>> hex(m);
    for (auto& [e, mem] : hex) in >> e >> mem;
    try {
      for (const Leg& leg : legs_) {
        if (static_cast<size_t>(leg.target) >= m) {
          *why = "the driver sent too few targets";
          return false;
        }
        const auto& [ehex, mhex] = hex[static_cast<size_t>(leg.target)];
        if (Result res = engine_->register_remote_engine(EngineDesc::unpack(test::from_hex(ehex)));
            !res) {
          *why = res.message;
          return false;
        }
        remotes_.push_back(MemoryDesc::unpack(test::from_hex(mhex)));
        if (remotes_.back().size < (static_cast<size_t>(leg.slice) + 1) * r_.slice_bytes) {
          *why = "target " + std::to_string(leg.target) + "'s region is too small for slice " +
                 std::to_string(leg.slice);
          return false;
        }
      }
      local_mem_ = engine_->register_memory(local_->data(), local_->size(),
                                            local_->registration_device(), local_->location());
    } catch (const Error& e) {
      *why = e.what();
      return false;
    }
    return ch_.send("OK");
  }

  // Leg j's item offsets, here (local) and at its target (remote).
  std::vector<size_t> offsets(size_t j, bool remote, size_t block, size_t batch) const {
    const size_t base =
        remote ? static_cast<size_t>(legs_[j].slice) * r_.slice_bytes : j * r_.slice_bytes;
    const size_t step = block * (r_.strided ? 2 : 1);
    std::vector<size_t> offs(batch);
    for (size_t i = 0; i < batch; ++i) offs[i] = base + i * step;
    return offs;
  }

  std::string ask(int target, const std::string& cmd) {
    return ch_.ask("ask " + std::to_string(target) + " " + cmd, 600000);
  }

  static std::string ranges(const std::vector<size_t>& offs, size_t block) {
    std::ostringstream r;
    r << offs.size();
    for (size_t off : offs) r << " " << off << " " << block;
    return r.str();
  }

  // Posts `op` on every leg at once; "" when all succeeded, else why not.
  std::string transfer(Op op, size_t block, size_t batch) {
    std::vector<TransferStatus> st;
    const std::vector<size_t> sizes(batch, block);
    for (size_t j = 0; j < legs_.size(); ++j) {
      const auto lo = offsets(j, false, block, batch), ro = offsets(j, true, block, batch);
      const TransferUid uid = engine_->allocate_transfer_uid();
      Engine& e = *engine_;
      if (batch == 1)
        st.push_back(op == Op::READ
                         ? e.read(local_mem_, lo[0], remotes_[j], ro[0], block, uid, r_.notify)
                         : e.write(local_mem_, lo[0], remotes_[j], ro[0], block, uid, r_.notify));
      else
        st.push_back(op == Op::READ
                         ? e.batch_read(local_mem_, lo, remotes_[j], ro, sizes, uid, r_.notify)
                         : e.batch_write(local_mem_, lo, remotes_[j], ro, sizes, uid, r_.notify));
    }
    std::string why;
    for (size_t j = 0; j < st.size(); ++j)  // every one ends (its deadline), failed or not
      if (StatusCode c = st[j].Wait(); c != StatusCode::SUCCESS && why.empty())
        why = "transfer to target " + std::to_string(legs_[j].target) + " failed: " + to_string(c) +
              ": " + st[j].Message();
    return why;
  }

  // Before the transfer: the source holds pattern(seed), the destination not.
  std::string prepare(Op op, size_t block, size_t batch, uint64_t seed) {
    for (size_t j = 0; j < legs_.size(); ++j) {
      const auto lo = offsets(j, false, block, batch);
      if (op == Op::WRITE) {
        for (size_t off : lo) local_->fill_pattern(off, block, seed);
        continue;
      }
      for (size_t off : lo) local_->zero(off, block);
      const std::string a = ask(legs_[j].target, "fill " + std::to_string(seed) + " " +
                                                     ranges(offsets(j, true, block, batch), block));
      if (a != "OK") return "target " + std::to_string(legs_[j].target) + ": " + a;
    }
    return "";
  }

  // Every byte of every leg: the same here and at the target (FNV-1a of the
  // ranges, compared by the target), and here pattern(seed) - so a transfer
  // that moved nothing, or another rank's bytes, is caught either way.
  bool verify(size_t block, size_t batch, uint64_t seed) {
    bool ok = true;
    for (size_t j = 0; j < legs_.size(); ++j) {
      const auto lo = offsets(j, false, block, batch), ro = offsets(j, true, block, batch);
      // Where the pattern was made: the target's offsets for a READ of what
      // the target filled, ours for a WRITE (and tp's read-back of it).
      const auto& made = r_.op == Op::READ && r_.shape.scheme != Scheme::TP ? ro : lo;
      uint64_t h = test::kFnvBasis;
      for (size_t off : lo) h = local_->fnv1a(off, block, h);
      for (size_t i = 0; i < lo.size() && ok; ++i)
        ok = local_->find_mismatch(lo[i], block, seed, made[i]) == -1;
      const std::string a = ask(legs_[j].target, "hash " + ranges(ro, block));
      if (a != "HASH " + std::to_string(h)) ok = false;
      if (!ok) {
        std::fprintf(stderr,
                     "ferry-bench: DATA MISMATCH at block %zu batch %zu initiator %d target %d\n",
                     block, batch, index_, legs_[j].target);
        return false;
      }
    }
    return true;
  }

  // One iteration. tx_s: the transfers' own time; excluded_s += the time spent
  // preparing and checking data. Returns "" or why the iteration failed.
  std::string iteration(size_t block, size_t batch, double* tx_s, double* excluded_s,
                        bool* mismatch) {
    const bool tp = r_.shape.scheme == Scheme::TP;
    const Op op = tp ? Op::WRITE : r_.op;
    // A seed per rank and iteration: bytes that land in another rank's slice differ.
    const uint64_t seed = (static_cast<uint64_t>(index_ + 1) << 40) + ++iteration_;
    auto timed = [&](auto&& f, double* into) {
      const auto t0 = Clock::now();
      auto v = f();
      *into += seconds(Clock::now() - t0);
      return v;
    };
    std::string why;
    if (r_.check &&
        !(why = timed([&] { return prepare(op, block, batch, seed); }, excluded_s)).empty())
      return why;
    if (!(why = timed([&] { return transfer(op, block, batch); }, tx_s)).empty()) return why;
    if (tp) {
      // The shard is at the target; read it back (over the bytes just sent:
      // with --check-consistency they are checked, then zeroed, first).
      if (r_.check && !timed(
                          [&] {
                            if (!verify(block, batch, seed)) return false;
                            for (size_t j = 0; j < legs_.size(); ++j)
                              for (size_t off : offsets(j, false, block, batch))
                                local_->zero(off, block);
                            return true;
                          },
                          excluded_s)) {
        *mismatch = true;
        return "";
      }
      if (!(why = timed([&] { return transfer(Op::READ, block, batch); }, tx_s)).empty())
        return why;
    }
    if (r_.check && !timed([&] { return verify(block, batch, seed); }, excluded_s))
      *mismatch = true;
    return "";
  }

  // The reply to "point" (WARM was sent in between); "" when told to quit.
  std::string run_point(size_t block, size_t batch, int iters) {
    bool mismatch = false;
    double tx = 0, excluded = 0;
    for (int i = 0; i < r_.warmup_iter; ++i)
      if (std::string why = iteration(block, batch, &tx, &excluded, &mismatch); !why.empty())
        return "ERR " + why;
    if (mismatch) return "ERR data mismatch in the warm-up";
    if (!ch_.send("WARM")) return "ERR driver gone";
    std::string go;
    if (!ch_.recv(go) || go == "quit") return "";  // another rank failed its warm-up
    if (go != "go") return "ERR expected go, got '" + go + "'";
    std::vector<double> lat;
    excluded = 0;
    const auto start = Clock::now();
    for (int i = 0; i < iters && !mismatch; ++i) {
      double t = 0;
      if (std::string why = iteration(block, batch, &t, &excluded, &mismatch); !why.empty())
        return "ERR " + why;
      lat.push_back(t * 1e6);
    }
    const double wall = seconds(Clock::now() - start);
    const size_t bytes =
        block * batch * legs_.size() * (r_.shape.scheme == Scheme::TP ? 2 : 1) * lat.size();
    std::ostringstream out;
    out << "DONE " << static_cast<long long>(wall * 1e9) << " "
        << static_cast<long long>(excluded * 1e9) << " " << bytes << " " << (mismatch ? 0 : 1)
        << " " << lat.size();
    for (double l : lat) out << " " << l;
    return out.str();
  }

  const SchemeRun& r_;
  const int index_;
  LineChannel& ch_;
  const std::vector<Leg> legs_;
  std::unique_ptr<Segment> local_;  // outlives the engine
  std::unique_ptr<Engine> engine_;
  MemoryDesc local_mem_;
  std::vector<MemoryDesc> remotes_;  // per leg
  uint64_t iteration_ = 0;
};

}  // namespace

int run_scheme_initiator(const SchemeRun& run, int index, int in_fd, int out_fd) {
  LineChannel ch(in_fd, out_fd);
  SchemeInitiator ini(run, index, ch);
  return ini.serve();
}

}  // namespace ferry::bench
