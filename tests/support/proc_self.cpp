// SPDX-License-Identifier: Apache-2.0
#include "proc_self.h"

#include <dirent.h>

#include <fstream>
#include <string>

namespace ferry::test {

long rss_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

size_t thread_count() {
  size_t n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

std::map<long, std::string> thread_names() {
  std::map<long, std::string> out;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/comm");
      std::string name;
      if (std::getline(in, name)) out[std::stol(e->d_name)] = name;  // a thread that ended: skipped
    }
    closedir(d);
  }
  return out;
}

}  // namespace ferry::test
