// SPDX-License-Identifier: Apache-2.0
#include "policy.h"

#include <algorithm>

#include "ferry/plugin_kit.hpp"

namespace ferry {

bool glob_match(const std::string& p, const std::string& t) {
  size_t pi = 0, ti = 0, star = std::string::npos, mark = 0;
  while (ti < t.size()) {
    if (pi < p.size() && (p[pi] == '?' || p[pi] == t[ti])) {
      ++pi;
      ++ti;
    } else if (pi < p.size() && p[pi] == '*') {
      star = pi++;
      mark = ti;
    } else if (star != std::string::npos) {
      pi = star + 1;
      ti = ++mark;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

bool PolicyRule::matches(const RouteQuery& q) const {
  if (peer && !glob_match(*peer, q.peer_key)) return false;
  if (host && !glob_match(*host, q.peer_host)) return false;
  if (same_host && *same_host != q.same_host) return false;
  if (local && *local != q.local) return false;
  if (remote && *remote != q.remote) return false;
  if (min_bytes && q.bytes < *min_bytes) return false;
  if (max_bytes && q.bytes > *max_bytes) return false;
  if (op && *op != q.op) return false;
  return true;
}

int Policy::match(const RouteQuery& q) const {
  for (size_t i = 0; i < rules.size(); ++i)
    if (rules[i].matches(q)) return static_cast<int>(i);
  return -1;
}

std::vector<uint64_t> Policy::size_breaks() const {
  std::vector<uint64_t> b;
  for (const auto& r : rules) {
    if (r.min_bytes) b.push_back(*r.min_bytes);
    if (r.max_bytes && *r.max_bytes < UINT64_MAX) b.push_back(*r.max_bytes + 1);
  }
  std::sort(b.begin(), b.end());
  b.erase(std::unique(b.begin(), b.end()), b.end());
  return b;
}

std::string Policy::settings_for(const std::string& backend) const {
  auto it = backend_settings.find(backend);
  return it == backend_settings.end() ? "{}" : it->second;
}

const std::vector<std::string>& builtin_backend_order() {
  static const std::vector<std::string> order = {"xgmi", "rdma", "ofi", "tcp"};
  return order;
}

Policy builtin_policy() {
  Policy p;
  PolicyRule any;
  any.prefer = builtin_backend_order();
  any.prefer.push_back("*");  // then every other loaded backend, by name
  // Trusts the descriptors of the backends it names (xgmi: a GPU IPC handle is
  // a capability, docs/security.md); never those reached through "*" (cma).
  any.trust_descriptors = true;
  p.rules.push_back(any);
  return p;
}

// One size grammar for the policy and every plugin's settings (plugin_kit.hpp).
std::optional<uint64_t> parse_size(const std::string& s) { return plugin_kit::ParseSize(s); }

std::optional<std::chrono::milliseconds> parse_duration(const std::string& s) {
  size_t i = 0;
  uint64_t v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    v = v * 10 + static_cast<uint64_t>(s[i] - '0');
    if (v > (1ull << 40)) return std::nullopt;
    ++i;
  }
  if (i == 0) return std::nullopt;
  std::string unit = s.substr(i);
  uint64_t ms;
  if (unit == "ms")
    ms = v;
  else if (unit == "s")
    ms = v * 1000;
  else if (unit == "m")
    ms = v * 60 * 1000;
  else if (unit == "h")
    ms = v * 3600 * 1000;
  else
    return std::nullopt;
  return std::chrono::milliseconds(ms);
}

}  // namespace ferry
