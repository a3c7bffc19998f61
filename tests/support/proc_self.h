// SPDX-License-Identifier: Apache-2.0
// What this process holds now, from /proc/self: for tests that bound resources.
#pragma once
#include <cstddef>
#include <map>
#include <string>

namespace ferry::test {

long rss_kib();         // VmRSS in KiB, -1 if unreadable
size_t thread_count();  // entries of /proc/self/task
// Each thread's name (/proc/self/task/TID/comm, without the newline) by tid.
std::map<long, std::string> thread_names();

}  // namespace ferry::test
