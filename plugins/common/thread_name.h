// SPDX-License-Identifier: Apache-2.0
// Names the calling thread, so `top -H`, `ps -L`, /proc/PID/task/*/comm, gdb
// and perf tell ferry's threads apart (a process with a tcp engine runs I/O,
// reaper, deadline and control threads beside its own). Linux keeps 15
// characters; a longer name is cut, never refused. Best effort: a name is a
// diagnostic, so a failure is ignored.
#pragma once

#include <pthread.h>

#include <cstring>
#include <string>
#include <thread>
#include <utility>

namespace ferry {

inline void name_this_thread(const char* name) noexcept {
  char cut[16];
  std::strncpy(cut, name, sizeof cut - 1);
  cut[sizeof cut - 1] = '\0';
  (void)pthread_setname_np(pthread_self(), cut);
}

// A thread that names itself before it runs f: where every thread ferry
// starts is made, so none starts without a name.
template <class F>
std::thread named_thread(const char* name, F f) {
  return std::thread([n = std::string(name), f = std::move(f)]() mutable {
    name_this_thread(n.c_str());
    f();
  });
}

}  // namespace ferry
