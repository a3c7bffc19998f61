// SPDX-License-Identifier: Apache-2.0
// ferry's threads carry names (plugins/common/thread_name.h), so `top -H`,
// `ps -L` and a debugger tell them apart from the application's: two engines
// in this process over tcp, a transfer with notification between them, and
// then every thread of the process but this one has a name of ferry's own.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ferry/ferry.hpp"
#include "proc_self.h"
#include "thread_name.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

std::string own_name() {
  std::ifstream in("/proc/thread-self/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

TEST(ThreadNames, ALongNameIsCutToWhatLinuxKeeps) {
  std::string seen;
  std::thread([&] {
    name_this_thread("a-name-longer-than-fifteen-characters");
    seen = own_name();
  }).join();
  EXPECT_EQ(seen, "a-name-longer-t");
  std::thread([&] {
    name_this_thread("short");
    seen = own_name();
  }).join();
  EXPECT_EQ(seen, "short");
}

TEST(ThreadNames, EveryThreadOfTwoTcpEnginesIsNamed) {
  setenv("FERRY_PLUGIN_PATH", FERRY_PLUGIN_BUILD_DIR, 1);
  const std::string process_name = own_name();  // what an unnamed thread inherits
  std::vector<uint8_t> src(1 << 20, 0x5a), dst(1 << 20, 0);
  EngineConfig cfg;
  cfg.timeout = 20s;
  auto ini = std::make_unique<Engine>("ini", cfg);
  auto tgt = std::make_unique<Engine>("tgt", cfg);
  for (Engine* e : {ini.get(), tgt.get()})
    ASSERT_TRUE(e->add_backend("tcp")) << "the tcp plugin did not load";
  ini->register_remote_engine(tgt->desc());
  const MemoryDesc l = ini->register_memory(src.data(), src.size());
  const MemoryDesc r = tgt->register_memory(dst.data(), dst.size());
  TransferStatus st = ini->write(l, 0, r, 0, src.size(), ini->allocate_transfer_uid(), true);
  ASSERT_EQ(st.Wait(), StatusCode::SUCCESS) << st.Message();
  ASSERT_EQ(dst, src);

  const long self = static_cast<long>(gettid());
  std::set<std::string> names;
  for (const auto& [tid, name] : test::thread_names()) {
    if (tid == self) continue;
    EXPECT_NE(name, process_name) << "thread " << tid << " has no name of its own";
    names.insert(name);
  }
  // The control plane and tcp's I/O pool run in any engine with tcp.
  EXPECT_TRUE(names.count("ferry-ctrl")) << "no control-plane thread named";
  EXPECT_TRUE(names.count("tcp-io")) << "no tcp I/O thread named";
}

}  // namespace
