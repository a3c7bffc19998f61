// SPDX-License-Identifier: Apache-2.0
// rdma-test-gate PROGRAM [ARGS...]: runs PROGRAM when this machine can load the
// rdma backend, else exits 77 (ctest SKIP_RETURN_CODE) saying why. It lets the
// generic two-process matrix run over rdma inside the Soft-RoCE VM and skip
// cleanly on hosts without an RDMA device.
#include <unistd.h>

#include <cstdio>
#include <string>

#include "ferry/ferry.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PROGRAM [ARGS...]\n", argv[0]);
    return 2;
  }
  {
    ferry::Engine probe("rdma-gate-probe");
    ferry::Result r = probe.add_backend("rdma");
    if (!r) {
      const bool no_device = r.message.find("no RDMA device") != std::string::npos ||
                             r.message.find("no active RDMA port") != std::string::npos;
      std::printf("%s: %s\n",
                  no_device ? "SKIPPED (no RDMA device here; the rdma tests run inside "
                              "the Soft-RoCE VM, see docs/backends/rdma.md)"
                            : "rdma backend cannot start",
                  r.message.c_str());
      std::fflush(stdout);
      return no_device ? 77 : 1;
    }
  }
  execv(argv[1], argv + 1);
  std::perror("execv");
  return 1;
}
