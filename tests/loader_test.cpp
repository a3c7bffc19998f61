// SPDX-License-Identifier: Apache-2.0
// The loader reports every unusable plugin with its reason and never crashes.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "plugin_loader.h"

using namespace ferry;

namespace {
const std::string kDir = FERRY_TEST_PLUGIN_DIR;

std::string load_error(const std::string& name) {
  PluginLoad l = load_plugin(name, {kDir});
  EXPECT_FALSE(l.lib) << name << " should not load";
  return l.error;
}
}  // namespace

TEST(Loader, MissingPluginSaysWhereItLooked) {
  auto e = load_error("doesnotexist");
  EXPECT_NE(e.find("libferry-doesnotexist.so not found"), std::string::npos) << e;
  EXPECT_NE(e.find(kDir), std::string::npos) << e;
}

TEST(Loader, NotAnElfFileGivesTheDlerror) {
  auto dir = std::filesystem::temp_directory_path() / ("ferry-loader-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "libferry-garbage.so") << "this is not a shared object";
  PluginLoad l = load_plugin("garbage", {dir.string()});
  std::filesystem::remove_all(dir);
  EXPECT_FALSE(l.lib);
  EXPECT_NE(l.error.find("dlopen failed"), std::string::npos) << l.error;
}

TEST(Loader, MissingEntrySymbol) {
  EXPECT_NE(load_error("nosym").find("no entry symbol 'ferry_plugin_v1'"), std::string::npos);
}

TEST(Loader, PluginForAnotherAbiMajor) {
  auto e = load_error("newabi");
  EXPECT_NE(e.find("built for plugin ABI 2"), std::string::npos) << e;
}

TEST(Loader, OpsTableTooSmall) {
  EXPECT_NE(load_error("smallops").find("ops table is 16 bytes"), std::string::npos);
}

TEST(Loader, NameMismatch) {
  EXPECT_NE(load_error("misnamed").find("calls itself 'someoneelse'"), std::string::npos);
}

TEST(Loader, RequiredFunctionMissing) {
  EXPECT_NE(load_error("nopost").find("'post' is NULL"), std::string::npos);
}

TEST(Loader, InitFailureIsReportedByTheEngine) {
  setenv("FERRY_PLUGIN_PATH", kDir.c_str(), 1);
  Engine e("loader-test");
  Result r = e.add_backend("initfail");
  EXPECT_FALSE(r);
  EXPECT_NE(r.message.find("no widget present"), std::string::npos) << r.message;
  EXPECT_TRUE(e.backends().empty());
  Result r2 = e.add_backend("nosym");
  EXPECT_EQ(r2.code, StatusCode::ERR_NOT_FOUND);
  unsetenv("FERRY_PLUGIN_PATH");
}

TEST(Loader, DiscoveryListsEveryPluginWithItsReason) {
  auto infos = discover_plugins({kDir});
  int failed = 0;
  for (const auto& p : infos) {
    if (p.path.rfind(kDir, 0) != 0 || p.name == "fault" || p.name == "faultmp" ||
        p.name == "abi11" || p.name == "cma11")
      continue;
    EXPECT_FALSE(p.loaded) << p.name;
    EXPECT_FALSE(p.error.empty()) << p.name;
    ++failed;
  }
  EXPECT_EQ(failed, 8);  // the eight broken ones; fault, faultmp, abi11 and cma11 load
}

// A plugin that throws out of init, or fills its error buffer with no
// terminator, is reported - by discovery (ferry info) and by add_backend -
// and neither the exception nor bytes past the buffer come out.
TEST(Loader, AnInitThatThrowsOrLeavesNoTerminatorIsReported) {
  bool threw = false, nonul = false;
  for (const auto& p : discover_plugins({kDir})) {
    if (p.name == "initthrows") {
      threw = true;
      EXPECT_FALSE(p.loaded);
      EXPECT_NE(p.error.find("threw"), std::string::npos) << p.error;
    }
    if (p.name == "errnonul") {
      nonul = true;
      EXPECT_FALSE(p.loaded);
      // "init failed: " and at most the buffer less its last byte, all 'A'.
      EXPECT_LE(p.error.size(), std::string("init failed: ").size() + 511) << p.error;
      EXPECT_EQ(p.error.find_first_not_of('A', std::string("init failed: ").size()),
                std::string::npos)
          << p.error;
    }
  }
  EXPECT_TRUE(threw && nonul) << "test plugins not built into " << kDir;
  setenv("FERRY_PLUGIN_PATH", kDir.c_str(), 1);
  Engine e("loader-throws");
  Result r;
  EXPECT_NO_THROW(r = e.add_backend("initthrows"));
  EXPECT_EQ(r.code, StatusCode::ERR_BAD_STATE) << r.message;
  EXPECT_NE(r.message.find("threw"), std::string::npos) << r.message;
  Result r2 = e.add_backend("errnonul");
  EXPECT_FALSE(r2);
  EXPECT_LE(r2.message.size(), 600u);
  EXPECT_TRUE(e.backends().empty());
  unsetenv("FERRY_PLUGIN_PATH");
}

// A plugin built against the previous minor (a frozen ABI 1.1 plugin.h: its ops
// table ends before fence(), its caps know no FENCE) still loads and serves:
// the core reads nothing past its struct_size and treats it as unable to fence.
TEST(Loader, PluginBuiltForAbi11StillLoads) {
  bool seen = false;
  for (const auto& p : discover_plugins({kDir})) {
    if (p.name != "abi11") continue;
    seen = true;
    EXPECT_TRUE(p.loaded) << p.error;
    EXPECT_EQ(p.abi_major, 1u);
    EXPECT_EQ(p.abi_minor, 1u);
    EXPECT_EQ(p.caps & FERRY_CAP_FENCE, 0u);
  }
  EXPECT_TRUE(seen) << "abi11 not built into " << kDir;
  setenv("FERRY_PLUGIN_PATH", kDir.c_str(), 1);
  Engine e("loader-abi11");
  Result r = e.add_backend("abi11");
  EXPECT_TRUE(r) << r.message;
  EXPECT_EQ(e.backends(), std::vector<std::string>{"abi11"});
  unsetenv("FERRY_PLUGIN_PATH");
}
