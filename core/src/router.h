// SPDX-License-Identifier: Apache-2.0
// Ranks the backends for one transfer: the first matching policy rule's list,
// kept only where each backend is loaded here, advertised by the peer and by
// both memory descriptors, able to move that memory and op, and not quarantined.
// Pure function of its inputs, so `ferry policy explain` shows the same reasoning.
#pragma once
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "policy.h"

namespace ferry {

struct RouteInputs {
  RouteQuery query;
  std::vector<std::pair<std::string, uint64_t>> loaded;  // name, caps (in load order)
  // Advertisement sets; a null pointer means "not known, assume yes" (explain).
  const std::set<std::string>* peer_backends = nullptr;
  const std::set<std::string>* local_mem_backends = nullptr;
  const std::set<std::string>* remote_mem_backends = nullptr;
  // Returns a reason when (peer, backend) is unusable now (quarantine), else "".
  std::function<std::string(const std::string& backend)> unusable;
};

struct RouteCandidate {
  std::string backend;
  bool kept = false;
  std::string why;  // why it was dropped, or "ok"
};

struct RouteDecision {
  int rule = -1;  // index of the matching rule, -1 = none
  std::vector<RouteCandidate> candidates;
  std::vector<std::string> kept() const;
  // "tcp: not loaded here; rdma: peer does not offer it" for error messages.
  std::string dropped_summary() const;
};

RouteDecision route(const Policy& policy, const RouteInputs& in);

}  // namespace ferry
