// SPDX-License-Identifier: Apache-2.0
// A plugin whose init throws a C++ exception across the C ABI (which nothing
// may do): broken_plugin.c built as C++ with BROKEN_INIT_THROWS.
#define BROKEN_INIT_THROWS
#include "broken_plugin.c"  // NOLINT(bugprone-suspicious-include)
