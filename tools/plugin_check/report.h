// SPDX-License-Identifier: Apache-2.0
// ferry-plugin-check's verdicts: one line per rule, PASS / FAIL / SKIP with why,
// printed as they are decided (a hang shows which rule it is in).
#pragma once
#include <cstdio>
#include <string>

namespace ferry::plugin_check {

class Report {
 public:
  void pass(const std::string& rule, const std::string& detail = {}) { line("PASS", rule, detail); }
  void fail(const std::string& rule, const std::string& detail) {
    ++failed_;
    line("FAIL", rule, detail);
  }
  void skip(const std::string& rule, const std::string& why) { line("SKIP", rule, why); }
  // PASS when ok, else FAIL; the detail either way.
  bool check(bool ok, const std::string& rule, const std::string& detail) {
    ok ? pass(rule, detail) : fail(rule, detail);
    return ok;
  }
  void note(const std::string& text) {
    std::printf("     %s\n", text.c_str());
    std::fflush(stdout);
  }
  int failed() const { return failed_; }

 private:
  void line(const char* verdict, const std::string& rule, const std::string& detail) {
    std::printf("%s  %-40s %s\n", verdict, rule.c_str(), detail.c_str());
    std::fflush(stdout);
  }
  int failed_ = 0;
};

}  // namespace ferry::plugin_check
