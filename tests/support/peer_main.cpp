// SPDX-License-Identifier: Apache-2.0
// ferry-test-peer: a target engine in its own process for the multi-process
// tests (started with fork+exec), speaking bench_target's line protocol on
// stdin/stdout.   usage: ferry-test-peer KEY BACKEND[,BACKEND...] REGION_BYTES [TIMEOUT_MS]
// FERRY_TEST_TARGET_HOST (default 127.0.0.1) is where its engine listens.
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "bench_target.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s KEY BACKEND[,BACKEND...] REGION_BYTES [TIMEOUT_MS]\n", argv[0]);
    return 2;
  }
  ferry::bench::TargetOptions opt;
  opt.key = argv[1];
  opt.backends.clear();
  std::stringstream bs(argv[2]);
  for (std::string b; std::getline(bs, b, ',');)
    if (!b.empty()) opt.backends.push_back(b);
  opt.region_bytes = std::stoull(argv[3]);
  if (argc > 4) opt.timeout = std::chrono::milliseconds(std::stoll(argv[4]));
  if (const char* h = std::getenv("FERRY_TEST_TARGET_HOST"); h && *h) opt.host = h;
  return ferry::bench::run_target(opt, 0, 1);
}
