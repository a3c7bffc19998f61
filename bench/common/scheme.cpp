// SPDX-License-Identifier: Apache-2.0
#include "scheme.h"

namespace ferry::bench {

namespace {
// Each of these processes has an engine with its own threads and sockets; past
// this a run measures the scheduler, not the transfers.
constexpr int kMaxRanks = 64;
}  // namespace

bool parse_scheme(const std::string& s, Scheme* out) {
  if (s == "pairwise")
    *out = Scheme::PAIRWISE;
  else if (s == "manytoone")
    *out = Scheme::MANY_TO_ONE;
  else if (s == "onetomany")
    *out = Scheme::ONE_TO_MANY;
  else if (s == "tp")
    *out = Scheme::TP;
  else
    return false;
  return true;
}

const char* to_string(Scheme s) {
  switch (s) {
    case Scheme::PAIRWISE:
      return "pairwise";
    case Scheme::MANY_TO_ONE:
      return "manytoone";
    case Scheme::ONE_TO_MANY:
      return "onetomany";
    case Scheme::TP:
      return "tp";
  }
  return "?";
}

std::string complete_shape(SchemeShape& s) {
  const int n = s.initiators;
  const std::string name = std::string("--scheme ") + to_string(s.scheme);
  if (n < 1 || n > kMaxRanks || s.targets < 0 || s.targets > kMaxRanks)
    return "--num-initiators and --num-targets are 1 to " + std::to_string(kMaxRanks);
  switch (s.scheme) {
    case Scheme::PAIRWISE:
      if (s.targets == 0) s.targets = n;
      if (s.targets != n)
        return name +
               " gives each initiator its own target: --num-targets must equal "
               "--num-initiators (or be left out)";
      break;
    case Scheme::MANY_TO_ONE:
      if (s.targets == 0) s.targets = 1;
      if (s.targets != 1) return name + " has one target: leave out --num-targets or give 1";
      if (n < 2) return name + " needs --num-initiators 2 or more";
      break;
    case Scheme::ONE_TO_MANY:
      if (n != 1) return name + " has one initiator: leave out --num-initiators or give 1";
      if (s.targets < 2) return name + " needs --num-targets 2 or more";
      break;
    case Scheme::TP:
      if (s.targets == 0) s.targets = 1;
      if (n < 2) return name + " needs --num-initiators 2 or more (its shards come from many)";
      if (s.targets >= n || n % s.targets != 0)
        return name +
               " gathers the shards of --num-initiators / --num-targets initiators on "
               "each target: --num-targets must divide --num-initiators and be fewer";
      break;
  }
  return "";
}

int slices_per_target(const SchemeShape& s) {
  switch (s.scheme) {
    case Scheme::MANY_TO_ONE:
      return s.initiators;
    case Scheme::TP:
      return s.targets > 0 ? s.initiators / s.targets : s.initiators;
    default:
      return 1;
  }
}

std::vector<Leg> legs_of(const SchemeShape& s, int initiator) {
  switch (s.scheme) {
    case Scheme::PAIRWISE:
      return {{initiator, 0}};
    case Scheme::MANY_TO_ONE:
      return {{0, initiator}};
    case Scheme::ONE_TO_MANY: {
      std::vector<Leg> legs;
      for (int t = 0; t < s.targets; ++t) legs.push_back({t, 0});
      return legs;
    }
    case Scheme::TP: {
      // nixlbench's tp with more initiators than targets: consecutive
      // initiators share a target, each its own slice of it.
      const int per = slices_per_target(s);
      return {{initiator / per, initiator % per}};
    }
  }
  return {};
}

}  // namespace ferry::bench
