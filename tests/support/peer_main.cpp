// ferry-test-peer: a target engine in its own process, driven over stdin/stdout
// by the multi-process tests (started with fork+exec).
//   start: ferry-test-peer KEY BACKEND REGION_BYTES [TIMEOUT_MS]
//   prints: READY <engine desc hex> <memory desc hex>
//   commands (one per line), each answered by one line:
//     register <engine desc hex>        -> OK | ERR <why>
//     fill <seed>                       -> OK         (whole region = pattern(seed))
//     hash <n> <off> <len> ...          -> HASH <fnv1a of the n ranges, concatenated>
//     pop <key> <uid> <timeout_ms>      -> INBOUND <code> | NONE
//     stats                             -> STATS <inbound notifications> <ctrl rejected>
//     quit                              -> exits
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "pattern.h"

using namespace ferry;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s KEY BACKEND REGION_BYTES [TIMEOUT_MS]\n", argv[0]);
    return 2;
  }
  EngineConfig cfg;
  if (argc > 4) cfg.timeout = std::chrono::milliseconds(std::stoll(argv[4]));
  Engine engine(argv[1], cfg);
  if (auto r = engine.add_backend(argv[2]); !r) {
    std::printf("ERR %s\n", r.message.c_str());
    return 1;
  }
  size_t size = std::stoull(argv[3]);
  std::vector<uint8_t> region(size);
  MemoryDesc mem = engine.register_memory(region.data(), region.size());
  std::printf("READY %s %s\n", test::to_hex(engine.desc().pack()).c_str(),
              test::to_hex(mem.pack()).c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "register") {
      std::string hex;
      in >> hex;
      try {
        auto r = engine.register_remote_engine(EngineDesc::unpack(test::from_hex(hex)));
        std::printf(r ? "OK\n" : "ERR %s\n", r.message.c_str());
      } catch (const Error& e) {
        std::printf("ERR %s\n", e.what());
      }
    } else if (cmd == "fill") {
      uint64_t seed;
      in >> seed;
      test::fill_pattern(region.data(), 0, region.size(), seed);
      std::printf("OK\n");
    } else if (cmd == "hash") {
      size_t n;
      in >> n;
      uint64_t h = 1469598103934665603ull;
      for (size_t i = 0; i < n; ++i) {
        uint64_t off, len;
        in >> off >> len;
        h = test::fnv1a(region.data() + off, len, h);
      }
      std::printf("HASH %llu\n", static_cast<unsigned long long>(h));
    } else if (cmd == "pop") {
      std::string key;
      uint64_t uid;
      long ms;
      in >> key >> uid >> ms;
      auto s = engine.wait_inbound_transfer_status(key, uid, std::chrono::milliseconds(ms));
      if (s) std::printf("INBOUND %s\n", to_string(s->Code()));
      else std::printf("NONE\n");
    } else if (cmd == "stats") {
      auto st = engine.stats();
      std::printf("STATS %llu %llu\n", static_cast<unsigned long long>(st.inbound_notifications),
                  static_cast<unsigned long long>(st.ctrl_rejected));
    } else if (cmd == "quit") {
      break;
    } else {
      std::printf("ERR unknown command\n");
    }
    std::fflush(stdout);
  }
  return 0;
}
