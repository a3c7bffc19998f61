#include "bench_target.h"

#include <cstdio>
#include <sstream>
#include <vector>

#include "ferry/ferry.hpp"
#include "line_channel.h"
#include "pattern.h"

namespace ferry::bench {

int run_target(const TargetOptions& opt, int in_fd, int out_fd) {
  LineChannel ch(in_fd, out_fd);
  EngineConfig cfg;
  cfg.host = opt.host;
  cfg.policy_file = opt.policy_file;
  cfg.timeout = opt.timeout;
  std::unique_ptr<Engine> engine;
  try {
    engine = std::make_unique<Engine>(opt.key, cfg);
  } catch (const Error& e) {
    ch.send(std::string("ERR ") + e.what());
    return 1;
  }
  for (const auto& b : opt.backends) {
    if (auto r = engine->add_backend(b); !r) {
      ch.send("ERR " + r.message);
      return 1;
    }
  }
  std::vector<uint8_t> region(opt.region_bytes);
  MemoryDesc mem = engine->register_memory(region.data(), region.size());
  ch.send("READY " + test::to_hex(engine->desc().pack()) + " " + test::to_hex(mem.pack()));
  std::string line;
  while (ch.recv(line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    std::ostringstream out;
    if (cmd == "register") {
      std::string hex;
      in >> hex;
      try {
        auto r = engine->register_remote_engine(EngineDesc::unpack(test::from_hex(hex)));
        out << (r ? "OK" : "ERR " + r.message);
      } catch (const Error& e) {
        out << "ERR " << e.what();
      }
    } else if (cmd == "fill") {
      uint64_t seed;
      in >> seed;
      test::fill_pattern(region.data(), 0, region.size(), seed);
      out << "OK";
    } else if (cmd == "hash") {
      size_t n = 0;
      in >> n;
      uint64_t h = test::kFnvBasis;
      bool ok = true;
      for (size_t i = 0; i < n && ok; ++i) {
        uint64_t off = 0, len = 0;
        in >> off >> len;
        ok = off <= region.size() && len <= region.size() - off;
        if (ok) h = test::fnv1a(region.data() + off, len, h);
      }
      if (ok) out << "HASH " << h;
      else out << "ERR range outside the region";
    } else if (cmd == "pop") {
      std::string key;
      uint64_t uid = 0;
      long ms = 0;
      in >> key >> uid >> ms;
      auto s = engine->wait_inbound_transfer_status(key, uid, std::chrono::milliseconds(ms));
      if (s) out << "INBOUND " << to_string(s->Code());
      else out << "NONE";
    } else if (cmd == "stats") {
      auto st = engine->stats();
      out << "STATS " << st.inbound_notifications << " " << st.ctrl_rejected;
    } else if (cmd == "remove_backend") {
      std::string name;
      in >> name;
      auto r = engine->remove_backend(name);
      out << (r ? "OK" : "ERR " + r.message);
    } else if (cmd == "quit") {
      ch.send("BYE");
      return 0;
    } else {
      out << "ERR unknown command '" << cmd << "'";
    }
    if (!ch.send(out.str())) break;
  }
  return 0;
}

}  // namespace ferry::bench
