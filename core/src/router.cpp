// SPDX-License-Identifier: Apache-2.0
#include "router.h"

#include <algorithm>

#include "ferry/plugin.h"

namespace ferry {

std::vector<std::string> RouteDecision::kept() const {
  std::vector<std::string> out;
  for (const auto& c : candidates)
    if (c.kept) out.push_back(c.backend);
  return out;
}

std::string RouteDecision::dropped_summary() const {
  std::string s;
  for (const auto& c : candidates) {
    if (c.kept) continue;
    if (!s.empty()) s += "; ";
    s += c.backend + ": " + c.why;
  }
  if (rule < 0)
    s = "no policy rule matches this transfer";
  else if (candidates.empty())
    s = "the matching rule lists no backend";
  return s;
}

namespace {

uint64_t mem_cap(MemoryLocation loc) {
  return loc == MemoryLocation::GPU ? FERRY_CAP_MEM_GPU : FERRY_CAP_MEM_CPU;
}

std::string check(const RouteInputs& in, const PolicyRule& rule, bool named,
                  const std::string& name, uint64_t caps) {
  const RouteQuery& q = in.query;
  if ((caps & FERRY_CAP_NO_TARGET_CHECK) && !(named && rule.trust_descriptors))
    return "cannot check requests on the target side (trusts the initiator's descriptor); "
           "used only where a rule names it and sets trust_descriptors: true";
  if ((caps & mem_cap(q.local)) == 0)
    return std::string("cannot move ") + to_string(q.local) + " memory";
  if ((caps & mem_cap(q.remote)) == 0)
    return std::string("cannot move ") + to_string(q.remote) + " memory";
  uint64_t opcap = q.op == Op::READ ? FERRY_CAP_OP_READ : FERRY_CAP_OP_WRITE;
  if ((caps & opcap) == 0) return q.op == Op::READ ? "cannot READ" : "cannot WRITE";
  if ((caps & FERRY_CAP_SAME_HOST_ONLY) && !q.same_host) return "same-host only, peer is remote";
  if (in.peer_backends && !in.peer_backends->count(name)) return "peer does not offer it";
  if (in.local_mem_backends && !in.local_mem_backends->count(name))
    return "local memory not registered with it";
  if (in.remote_mem_backends && !in.remote_mem_backends->count(name))
    return "remote memory not registered with it";
  if (in.unusable) return in.unusable(name);
  return {};
}

}  // namespace

RouteDecision route(const Policy& policy, const RouteInputs& in) {
  RouteDecision d;
  d.rule = policy.match(in.query);
  if (d.rule < 0) return d;
  const auto& prefer = policy.rules[static_cast<size_t>(d.rule)].prefer;
  std::vector<std::string> order;
  for (const auto& name : prefer) {
    if (name != "*") {
      order.push_back(name);
      continue;
    }
    // "*": every other loaded backend, by name.
    std::vector<std::string> rest;
    for (const auto& [n, caps] : in.loaded)
      if (std::find(prefer.begin(), prefer.end(), n) == prefer.end()) rest.push_back(n);
    std::sort(rest.begin(), rest.end());
    order.insert(order.end(), rest.begin(), rest.end());
  }
  for (const auto& name : order) {
    RouteCandidate c{name, false, {}};
    auto it = std::find_if(in.loaded.begin(), in.loaded.end(),
                           [&](const auto& l) { return l.first == name; });
    if (it == in.loaded.end())
      c.why = "not loaded here";
    else
      c.why =
          check(in, policy.rules[static_cast<size_t>(d.rule)],
                std::find(prefer.begin(), prefer.end(), name) != prefer.end(), name, it->second);
    c.kept = c.why.empty();
    if (c.kept) c.why = "ok";
    // A "*" expansion only lists what is loaded; do not pad errors with unloaded names.
    d.candidates.push_back(std::move(c));
  }
  return d;
}

}  // namespace ferry
