// SPDX-License-Identifier: Apache-2.0
// ferry-gpu-peer: a target engine whose region is GPU memory, in its own process
// (started with exec: a CUDA process must not fork and use CUDA in the child).
//   usage: ferry-gpu-peer KEY BACKEND[,BACKEND...] DEVICE REGION_BYTES
// DEVICE -1 puts the region in host memory (the CPU side of GPU<->CPU tests and
// the CPU reference of the benchmarks).
// The region is a sub-allocation: it starts 4 KiB + 256 B into a larger device
// allocation, so IPC export must carry the offset inside the allocation.
// Speaks the line protocol of bench/common/bench_target.h (register, fill,
// hash, pop, stats, quit); fill/hash go through a host copy of the region;
// `ipc` exports a second allocation for ferry-gpu-bench's raw IPC reference.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "ferry/ferry.hpp"
#include "gpu_runtime.h"
#include "line_channel.h"
#include "pattern.h"

using namespace ferry;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s KEY BACKEND[,BACKEND...] DEVICE REGION_BYTES [SETTINGS]\n",
                 argv[0]);
    return 2;
  }
  bench::LineChannel ch(0, 1);
  const int device = std::stoi(argv[3]);
  const size_t size = std::stoull(argv[4]);
  const size_t lead = 4096 + 256;
  try {
    Engine engine(argv[1]);
    // SETTINGS go to the first backend, as ferry-gpu-bench's --settings on its side.
    const std::string settings = argc > 5 ? argv[5] : "";
    std::stringstream bs(argv[2]);
    bool first = true;
    for (std::string b; std::getline(bs, b, ',');) {
      if (auto r = engine.add_backend(b, first ? settings : std::string()); !r)
        throw Error(r.code, r.message);
      first = false;
    }
    const bool on_gpu = device >= 0;
    std::vector<uint8_t> host_region(on_gpu ? 0 : size + lead + 4096);
    uint8_t* alloc =
        on_gpu ? static_cast<uint8_t*>(gpu::alloc(size + lead + 4096, device)) : host_region.data();
    uint8_t* region = alloc + lead;
    void* raw_ipc = nullptr;  // the "ipc" command's allocation
    std::vector<uint8_t> host(size);
    MemoryDesc mem = engine.register_memory(region, size);  // location and device detected
    if (on_gpu && (mem.location != MemoryLocation::GPU || mem.device != device))
      throw Error(StatusCode::ERR_GPU_OP, "GPU memory was not detected as such");
    if (!on_gpu && mem.location != MemoryLocation::CPU)
      throw Error(StatusCode::ERR_GPU_OP, "host memory was not detected as such");
    ch.send("READY " + test::to_hex(engine.desc().pack()) + " " + test::to_hex(mem.pack()));
    std::string line;
    while (ch.recv(line)) {
      std::istringstream in(line);
      std::string cmd;
      in >> cmd;
      std::ostringstream out;
      if (cmd == "register") {
        std::string hex;
        in >> hex;
        auto r = engine.register_remote_engine(EngineDesc::unpack(test::from_hex(hex)));
        out << (r ? "OK" : "ERR " + r.message);
      } else if (cmd == "fill") {
        uint64_t seed;
        in >> seed;
        test::fill_pattern(host.data(), 0, size, seed);
        if (on_gpu) {
          gpu::copy(region, host.data(), size);
        } else {
          std::copy(host.begin(), host.end(), region);
        }
        out << "OK";
      } else if (cmd == "hash") {
        if (on_gpu) {
          gpu::copy(host.data(), region, size);
        } else {
          std::copy(region, region + size, host.begin());
        }
        size_t n = 0;
        in >> n;
        uint64_t h = test::kFnvBasis;
        for (size_t i = 0; i < n; ++i) {
          uint64_t off = 0, len = 0;
          in >> off >> len;
          if (off > size || len > size - off) throw Error(StatusCode::ERR_INVALID_ARGS, "range");
          h = test::fnv1a(host.data() + off, len, h);
        }
        out << "HASH " << h;
      } else if (cmd == "pop") {
        std::string key;
        uint64_t uid = 0;
        long ms = 0;
        in >> key >> uid >> ms;
        auto s = engine.wait_inbound_transfer_status(key, uid, std::chrono::milliseconds(ms));
        out << (s ? std::string("INBOUND ") + to_string(s->Code()) : std::string("NONE"));
      } else if (cmd == "ipc") {
        // A second allocation of the region's size, exported as a bare IPC
        // handle: the benchmark's raw reference copies into it through the
        // same kind of mapping xgmi uses, without ferry (a mapping of the
        // region itself would be a second open of xgmi's handle there).
        if (!on_gpu) throw Error(StatusCode::ERR_INVALID_ARGS, "ipc: the region is host memory");
        if (raw_ipc == nullptr) raw_ipc = gpu::alloc(size, device);
        uint8_t h[64];
        const ferry_gpu_v1* g = gpu_runtime();
        if (g->ipc_get_handle(g->gpu_ctx, raw_ipc, h) != FERRY_OK)
          throw Error(StatusCode::ERR_GPU_OP, std::string("ipc: ") + g->last_error(g->gpu_ctx));
        out << "IPC " << test::to_hex(std::vector<uint8_t>(h, h + 64));
      } else if (cmd == "quit") {
        ch.send("BYE");
        break;
      } else {
        out << "ERR unknown command";
      }
      ch.send(out.str());
    }
    engine.deregister_memory(mem);
    if (on_gpu) gpu::free(alloc);
    if (raw_ipc != nullptr) gpu::free(raw_ipc);
  } catch (const Error& e) {
    ch.send(std::string("ERR ") + e.what());
    return 1;
  }
  return 0;
}
