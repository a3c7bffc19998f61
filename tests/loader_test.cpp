// SPDX-License-Identifier: Apache-2.0
// The loader reports every unusable plugin with its reason and never crashes.
#include <gtest/gtest.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "child_process.h"
#include "ferry/ferry.hpp"
#include "ferry/plugin.h"
#include "ferry/plugin_kit.hpp"
#include "plugin_loader.h"
#include "plugin_probe_child.h"

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
  const std::string e = load_error("smallops");
  EXPECT_NE(e.find("ops table is 16 bytes, ABI 1.0 needs at least 128"), std::string::npos) << e;
}

// A table whose length disagrees with its abi_minor loads (nothing past its
// struct_size is read) and carries a warning; ferry-plugin-check fails it.
TEST(Loader, AnOpsTableShorterThanItsMinorSaysLoadsWithAWarning) {
  PluginLoad l = load_plugin("sizeminor", {kDir});
  ASSERT_TRUE(l.lib) << l.error;
  EXPECT_NE(l.warning.find("its 128-byte table ends before fence (1.2"), std::string::npos)
      << l.warning;
  bool seen = false;
  for (const auto& p : discover_plugins({kDir}))
    if (p.name == "sizeminor") {
      seen = true;
      EXPECT_TRUE(p.loaded) << p.error;
      EXPECT_EQ(p.warning, l.warning);
    }
  EXPECT_TRUE(seen);
  EXPECT_TRUE(load_plugin("abi11", {kDir}).warning.empty());
}

TEST(Loader, OpsSizeVersusMinorNamesTheFirstDisagreement) {
  ferry_plugin_ops_v1 ops{};
  ops.struct_size = sizeof ops;
  ops.abi_minor = FERRY_PLUGIN_ABI_MINOR;
  EXPECT_EQ(plugin_kit::OpsSizeVersusMinor(ops), "");
  ops.abi_minor = 0;  // a whole table that says 1.0
  EXPECT_NE(plugin_kit::OpsSizeVersusMinor(ops).find("covers fence, added in 1.2"),
            std::string::npos);
  ops.abi_minor = 5;
  EXPECT_NE(plugin_kit::OpsSizeVersusMinor(ops).find("covers progress, added in 1.6"),
            std::string::npos);
  ops.struct_size = offsetof(ferry_plugin_ops_v1, counters);  // 1.2's table
  ops.abi_minor = 2;
  EXPECT_EQ(plugin_kit::OpsSizeVersusMinor(ops), "");
  ops.abi_minor = 6;
  EXPECT_NE(plugin_kit::OpsSizeVersusMinor(ops).find("ends before counters (1.5"),
            std::string::npos)
      << plugin_kit::OpsSizeVersusMinor(ops);
}

// `ferry info` starts each plugin in a child process: an init that crashes is
// that plugin's error line (with what its table said), and the listing goes on.
TEST(Loader, FerryInfoReportsAnInitThatCrashesAndListsTheRest) {
  const std::string probe_dir = FERRY_TEST_PROBE_PLUGIN_DIR;
  // Its log lines (stderr) stay out of the JSON.
  auto [rc, out] = test::run_command("(env -u FERRY_PLUGIN_PATH " + std::string(FERRY_CLI) +
                                     " info --json --plugin-dir " + probe_dir + " --plugin-dir " +
                                     kDir + " 2>/dev/null)");
  ASSERT_EQ(rc, 0) << out;
  const auto list = nlohmann::json::parse(out, nullptr, false);
  ASSERT_TRUE(list.is_array()) << out;
  bool crashed = false, after = false;
  for (const auto& p : list) {
    if (p.value("name", "") == "initcrash") {
      crashed = true;
      EXPECT_FALSE(p.value("loaded", true));
      const std::string e = p.value("error", "");
      EXPECT_NE(e.find("crashed while started once"), std::string::npos) << e;
      // SIGSEGV; under ASan (abort_on_error) its report ends in SIGABRT.
      EXPECT_TRUE(e.find("signal " + std::to_string(SIGSEGV)) != std::string::npos ||
                  e.find("signal " + std::to_string(SIGABRT)) != std::string::npos)
          << e;
      EXPECT_EQ(p.value("version", ""), "0.0-test");  // reported before init ran
    }
    if (crashed && p.value("name", "") == "fault") after = p.value("loaded", false);
  }
  EXPECT_TRUE(crashed) << out;
  EXPECT_TRUE(after) << "the listing stopped at the crash: " << out;
}

// A probe that never ends is stopped at its limit and reported.
TEST(Loader, AProbeThatHangsIsStoppedAtItsLimit) {
  PluginInfo info;
  info.name = "hangs";
  const auto t0 = std::chrono::steady_clock::now();
  const PluginInfo r = probe_in_child(
      info,
      [](PluginInfo i, const ProbeReport& report) {
        i.version = "1.2.3";
        report(i);
        for (;;) ::pause();
        return i;
      },
      std::chrono::milliseconds(300));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(300));
  EXPECT_FALSE(r.loaded);
  EXPECT_NE(r.error.find("within 300 ms"), std::string::npos) << r.error;
  EXPECT_EQ(r.version, "1.2.3");
  // And one that ends is taken as it reported.
  const PluginInfo ok = probe_in_child(info, [](PluginInfo i, const ProbeReport&) {
    i.loaded = true;
    i.description = "fine";
    return i;
  });
  EXPECT_TRUE(ok.loaded) << ok.error;
  EXPECT_EQ(ok.description, "fine");
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
        p.name == "abi11" || p.name == "cma11" || p.name == "sizeminor")
      continue;
    EXPECT_FALSE(p.loaded) << p.name;
    EXPECT_FALSE(p.error.empty()) << p.name;
    ++failed;
  }
  EXPECT_EQ(failed, 8);  // the eight broken ones; fault, faultmp, abi11, cma11, sizeminor load
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
