// SPDX-License-Identifier: Apache-2.0
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
  cfg.metadata = opt.metadata;
  // The region outlives the engine: nothing may land in unmapped memory.
  std::unique_ptr<Segment> seg;
  std::vector<std::unique_ptr<Segment>> kv_segs;  // ferry-bench --kv's regions
  std::vector<MemoryDesc> subs;                   // parts of seg registered on their own
  std::unique_ptr<Engine> engine;
  try {
    engine = std::make_unique<Engine>(opt.key, cfg);
  } catch (const Error& e) {
    ch.send(std::string("ERR ") + e.what());
    return 1;
  }
  for (const auto& b : opt.backends) {
    auto settings = opt.backend_settings.find(b);
    if (auto r = engine->add_backend(
            b, settings == opt.backend_settings.end() ? std::string() : settings->second);
        !r) {
      ch.send("ERR " + r.message);
      return 1;
    }
  }
  std::string why;
  seg = Segment::allocate(opt.seg_type, opt.device, opt.region_bytes, &why);
  if (!seg) {
    ch.send("ERR " + why);
    return 1;
  }
  MemoryDesc mem;
  try {
    mem = engine->register_memory(seg->data(), seg->size(), seg->registration_device(),
                                  seg->location());
  } catch (const Error& e) {
    ch.send(std::string("ERR ") + e.what());
    return 1;
  }
  if (engine->has_metadata_store())
    if (Result r = engine->publish_memory("bench", mem); !r) {
      ch.send("ERR " + r.message);
      return 1;
    }
  const size_t region_size = seg->size();
  // Ranges "<off> <len>" from the command, checked against the region.
  auto in_region = [&](uint64_t off, uint64_t len) {
    return off <= region_size && len <= region_size - off;
  };
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
      uint64_t seed = 0;
      size_t n = 0;
      in >> seed;
      bool ok = true;
      try {
        if (!(in >> n)) {
          seg->fill_pattern(0, region_size, seed);
        } else {
          for (size_t i = 0; i < n && ok; ++i) {
            uint64_t off = 0, len = 0;
            in >> off >> len;
            ok = in_region(off, len);
            if (ok) seg->fill_pattern(off, len, seed);
          }
        }
        if (ok)
          out << "OK";
        else
          out << "ERR range outside the region";
      } catch (const Error& e) {
        out << "ERR " << e.what();
      }
    } else if (cmd == "hash") {
      size_t n = 0;
      in >> n;
      uint64_t h = test::kFnvBasis;
      bool ok = true;
      try {
        for (size_t i = 0; i < n && ok; ++i) {
          uint64_t off = 0, len = 0;
          in >> off >> len;
          ok = in_region(off, len);
          if (ok) h = seg->fnv1a(off, len, h);
        }
        if (ok)
          out << "HASH " << h;
        else
          out << "ERR range outside the region";
      } catch (const Error& e) {
        out << "ERR " << e.what();
      }
    } else if (cmd == "pop") {
      std::string key;
      uint64_t uid = 0;
      long ms = 0;
      in >> key >> uid >> ms;
      auto s = engine->wait_inbound_transfer_status(key, uid, std::chrono::milliseconds(ms));
      if (s)
        out << "INBOUND " << to_string(s->Code());
      else
        out << "NONE";
    } else if (cmd == "notifs") {  // what arrived, waiting up to ms for the first
      long ms = 0;
      in >> ms;
      auto got = engine->wait_notifications(std::chrono::milliseconds(ms));
      size_t n = 0;
      for (auto& [k, v] : got) n += v.size();
      out << "NOTIFS " << n;
      for (auto& [k, v] : got)
        for (auto& m : v)
          out << " " << k << ":" << test::to_hex(std::vector<uint8_t>(m.begin(), m.end()));
    } else if (cmd == "msghash") {  // the first message, and the ranges' hash as it arrived
      long ms = 0;
      size_t n = 0;
      in >> ms >> n;
      std::vector<std::pair<uint64_t, uint64_t>> ranges(n);
      bool ok = true;
      for (auto& [off, len] : ranges) {
        in >> off >> len;
        ok = ok && in_region(off, len);
      }
      if (!ok) {
        out << "ERR range outside the region";
      } else {
        auto got = engine->wait_notifications(std::chrono::milliseconds(ms));
        uint64_t h = test::kFnvBasis;
        for (auto& [off, len] : ranges) h = seg->fnv1a(off, len, h);
        if (got.empty()) {
          out << "NONE";
        } else {
          const auto& [k, v] = *got.begin();
          out << "MSG " << v.size() << " " << k << ":"
              << test::to_hex(std::vector<uint8_t>(v[0].begin(), v[0].end())) << " HASH " << h;
        }
      }
    } else if (cmd == "send") {  // a notification message to a peer: SENT <code>
      std::string key, hex;
      in >> key >> hex;
      auto bytes = test::from_hex(hex);
      auto s = engine->send_notification(key, std::string(bytes.begin(), bytes.end()));
      s.Wait();
      out << "SENT " << to_string(s.Code());
    } else if (cmd == "stats") {
      auto st = engine->stats();
      out << "STATS " << st.inbound_notifications << " " << st.ctrl_rejected;
    } else if (cmd == "deregister") {  // the region: later requests for it are refused
      auto r = engine->deregister_memory(mem);
      out << (r ? "OK" : "ERR " + r.message);
    } else if (cmd == "reregister") {  // the same bytes under a new descriptor
      try {
        mem = engine->register_memory(seg->data(), seg->size(), seg->registration_device(),
                                      seg->location());
        out << "MEM " << test::to_hex(mem.pack());
      } catch (const Error& e) {
        out << "ERR " << e.what();
      }
    } else if (cmd == "kvregions") {  // n more regions of `bytes` each (ferry-bench --kv)
      size_t n = 0, bytes = 0;
      in >> n >> bytes;
      out << "KVREGIONS";
      try {
        for (size_t i = 0; i < n; ++i) {
          auto s = Segment::allocate(opt.seg_type, opt.device, bytes, &why);
          if (!s) throw Error(StatusCode::ERR_BAD_STATE, why);
          MemoryDesc d = engine->register_memory(s->data(), s->size(), s->registration_device(),
                                                 s->location());
          kv_segs.push_back(std::move(s));
          out << " " << test::to_hex(d.pack());
        }
      } catch (const Error& e) {
        out.str("");
        out << "ERR " << e.what();
      }
    } else if (cmd == "kvhash") {  // kvhash <region> <off> <len>: of a kvregions region
      size_t r = 0;
      uint64_t off = 0, len = 0;
      in >> r >> off >> len;
      if (r >= kv_segs.size() || off > kv_segs[r]->size() || len > kv_segs[r]->size() - off)
        out << "ERR no such range";
      else
        out << "HASH " << kv_segs[r]->fnv1a(off, len, test::kFnvBasis);
    } else if (cmd == "subregion") {
      uint64_t off = 0, len = 0;
      in >> off >> len;
      if (len == 0 || !in_region(off, len)) {
        out << "ERR range outside the region";
      } else {
        try {
          subs.push_back(engine->register_memory(seg->data() + off, len, seg->registration_device(),
                                                 seg->location()));
          out << "MEM " << test::to_hex(subs.back().pack());
        } catch (const Error& e) {
          out << "ERR " << e.what();
        }
      }
    } else if (cmd == "dropsub") {
      size_t i = 0;
      in >> i;
      if (i >= subs.size()) {
        out << "ERR no such subregion";
      } else {
        auto r = engine->deregister_memory(subs[i]);
        out << (r ? "OK" : "ERR " + r.message);
      }
    } else if (cmd == "remove_backend") {
      std::string name;
      in >> name;
      auto r = engine->remove_backend(name);
      out << (r ? "OK" : "ERR " + r.message);
    } else if (cmd == "publish") {  // the region in the metadata store (etcd) as <name>
      std::string name;
      in >> name;
      auto r = engine->publish_memory(name, mem);
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
