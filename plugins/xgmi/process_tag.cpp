// SPDX-License-Identifier: Apache-2.0
#include "process_tag.h"

#include <unistd.h>

#include <random>

namespace ferry_xgmi {
namespace {

uint64_t Seed() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// splitmix64's finaliser: every bit of the seed and the pid reaches every bit.
uint64_t Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t ProcessTag() {
  static const uint64_t seed = Seed();
  return Mix(seed ^ static_cast<uint64_t>(getpid())) | (1ull << 63);
}

}  // namespace ferry_xgmi
