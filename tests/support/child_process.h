// SPDX-License-Identifier: Apache-2.0
// A helper process started with fork+exec, spoken to by lines on stdin/stdout.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace ferry::test {

class ChildProcess {
 public:
  // argv[0] is the program path. Throws std::runtime_error if it cannot start.
  explicit ChildProcess(const std::vector<std::string>& argv);
  ~ChildProcess();  // kills (SIGKILL) if still running, and reaps
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  void send_line(const std::string& line);
  // The next line from the child's stdout; empty string on EOF or timeout.
  std::string read_line(int timeout_ms = 30000);
  // send_line + read_line.
  std::string ask(const std::string& line, int timeout_ms = 30000);
  void kill_now();  // SIGKILL and reap
  int pid() const { return pid_; }

 private:
  int pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buf_;
};

// Runs a shell command; its exit status (-1 when it did not exit) and its
// stdout and stderr together.
std::pair<int, std::string> run_command(const std::string& cmd);

}  // namespace ferry::test
