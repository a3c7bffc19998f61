// SPDX-License-Identifier: Apache-2.0
// One polling round's pause: tells the CPU this thread is spinning (cheaper
// for its sibling hyperthread, and no memory-order stall on leaving the loop).
#pragma once

namespace ferry_xgmi {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace ferry_xgmi
