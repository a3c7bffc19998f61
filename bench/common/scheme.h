// SPDX-License-Identifier: Apache-2.0
// nixlbench's communication schemes (--scheme) as a topology of processes:
// which targets each initiator process moves bytes to, and where in each
// target's region its slice lies. Pure functions, shared by the process that
// starts the ranks, the initiator ranks and the target ranks, so every one of
// them derives the same layout from the same command line.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace ferry::bench {

enum class Scheme { PAIRWISE, MANY_TO_ONE, ONE_TO_MANY, TP };

// "pairwise", "manytoone", "onetomany", "tp"; false for anything else.
bool parse_scheme(const std::string& s, Scheme* out);
const char* to_string(Scheme s);

struct SchemeShape {
  Scheme scheme = Scheme::PAIRWISE;
  int initiators = 1;
  int targets = 0;  // 0: the scheme's default (see complete_shape)
};

// Fills in the default number of targets and checks the combination; returns
// "" or a message for the user (e.g. "--scheme tp needs ...").
std::string complete_shape(SchemeShape& s);

// One initiator and one target in one pair is the bench as it always was
// (rank 0 here, rank 1 exec'd or remote); anything else starts more processes.
inline bool multi_process(const SchemeShape& s) {
  return !(s.scheme == Scheme::PAIRWISE && s.initiators == 1);
}

// How many initiators' slices one target's region holds.
int slices_per_target(const SchemeShape& s);

// One target an initiator moves bytes to: which, and which slice of that
// target's region is this initiator's (its byte offset is slice * slice bytes).
struct Leg {
  int target = 0;
  int slice = 0;
};
// In the order the initiator's local region lays them out (leg j at j * slice bytes).
std::vector<Leg> legs_of(const SchemeShape& s, int initiator);

}  // namespace ferry::bench
