// SPDX-License-Identifier: Apache-2.0
// Uses the core's etcd client (core/src/etcd_client.h, exported by libferry)
// rather than a second one.
#include "etcd_rendezvous.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <optional>
#include <thread>

#include "etcd_client.h"

namespace ferry::bench {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kLease = std::chrono::seconds(10);

std::string key_of(const EtcdRendezvous& r) { return r.ns + "/rendezvous/target"; }

int listen_on(const std::string& host, std::string& bound, std::string* why) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (getaddrinfo(host.c_str(), "0", &hints, &res) != 0) {
    *why = "cannot resolve --host " + host;
    return -1;
  }
  const int ls = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = ls >= 0 && bind(ls, res->ai_addr, res->ai_addrlen) == 0 && listen(ls, 1) == 0;
  freeaddrinfo(res);
  if (!ok) {
    *why = std::string("listen on ") + host + ": " + std::strerror(errno);
    if (ls >= 0) close(ls);
    return -1;
  }
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  getsockname(ls, reinterpret_cast<sockaddr*>(&ss), &sl);
  const unsigned port =
      ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                     : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  bound =
      (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
  return ls;
}

int connect_to(const std::string& address, std::string* why) {
  const size_t c = address.rfind(':');
  std::string host = address.substr(0, c), port = address.substr(c + 1);
  if (host.size() >= 2 && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{}, *res = nullptr;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0) {
    *why = "cannot resolve the target's address '" + address + "' from etcd";
    return -1;
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const bool ok = fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0;
  freeaddrinfo(res);
  if (!ok) {
    *why = "connect to the target at " + address + " (from etcd): " + std::strerror(errno);
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

// Keeps the rank claim alive (every 3 s at most), and lets it go at the end.
void refresh_claim(etcd::Client& c, const EtcdRendezvous& r, Clock::time_point& last) {
  if (r.claim_lease == 0 || Clock::now() - last < std::chrono::seconds(3)) return;
  int64_t ttl = 0;
  c.keepalive(r.claim_lease, ttl);
  last = Clock::now();
}

void release_claim(etcd::Client& c, const EtcdRendezvous& r) {
  if (r.claim_lease != 0) c.revoke(r.claim_lease);
}

}  // namespace

int claim_rank(EtcdRendezvous& r, std::string* why) {
  etcd::Client c(r.endpoints);
  int64_t lease = 0;
  if (Result res = c.grant(kLease, lease); !res) {
    *why = res.message;
    return -1;
  }
  for (int rank = 0; rank < 2; ++rank) {
    bool created = false;
    Result res = c.create_if_absent(r.ns + "/rank/" + std::to_string(rank),
                                    std::to_string(::getpid()), lease, created);
    if (!res) {
      c.revoke(lease);
      *why = res.message;
      return -1;
    }
    if (created) {
      r.claim_lease = lease;
      std::fprintf(stderr, "ferry-bench: rank %d (claimed %s/rank/%d in etcd)\n", rank,
                   r.ns.c_str(), rank);
      return rank;
    }
  }
  c.revoke(lease);
  *why = "ranks 0 and 1 are both taken in etcd namespace '" + r.ns +
         "' (another run? use --etcd-namespace, or wait 10 s for a crashed run's claims to expire)";
  return -1;
}

int rendezvous_accept(const EtcdRendezvous& r, const std::string& host,
                      std::chrono::milliseconds wait, std::string* why) {
  std::string bound;
  const int ls = listen_on(host, bound, why);
  if (ls < 0) return -1;
  etcd::Client c(r.endpoints);
  int64_t lease = 0;
  Result res = c.grant(kLease, lease);
  if (res) res = c.put(key_of(r), bound, lease);
  if (!res) {
    *why = res.message;
    close(ls);
    return -1;
  }
  std::fprintf(stderr, "ferry-bench: target waiting on %s (published in etcd as %s)\n",
               bound.c_str(), key_of(r).c_str());
  std::fflush(stderr);
  const auto deadline = Clock::now() + wait;
  auto last_claim = Clock::now();
  int fd = -1;
  while (fd < 0) {
    refresh_claim(c, r, last_claim);
    pollfd p{ls, POLLIN, 0};
    // Wake every lease/3 to keep the published address alive.
    if (poll(&p, 1, 3000) > 0) fd = accept4(ls, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) break;
    int64_t ttl = 0;
    if (Clock::now() > deadline) {
      *why = "no initiator came within " + std::to_string(wait.count() / 1000) + " s";
      break;
    }
    if (Result k = c.keepalive(lease, ttl); !k || ttl <= 0)
      std::fprintf(stderr, "ferry-bench: etcd keep-alive: %s\n",
                   k ? "lease expired" : k.message.c_str());
  }
  close(ls);
  c.revoke(lease);  // the address is taken: the next run publishes its own
  release_claim(c, r);
  return fd;
}

int rendezvous_connect(const EtcdRendezvous& r, std::chrono::milliseconds wait, std::string* why) {
  etcd::Client c(r.endpoints);
  const auto deadline = Clock::now() + wait;
  // The target may start later (wait for it); the store itself down is
  // reported after a short grace instead of after the whole wait.
  const auto unreachable_deadline = Clock::now() + std::chrono::seconds(10);
  auto last_claim = Clock::now();
  for (;;) {
    refresh_claim(c, r, last_claim);
    std::optional<etcd::KeyValue> kv;
    Result res = c.get(key_of(r), kv);
    if (res && kv) {
      const int fd = connect_to(kv->value, why);
      release_claim(c, r);
      return fd;
    }
    if (Clock::now() > deadline || (!res && Clock::now() > unreachable_deadline)) {
      *why = res ? "no target published " + key_of(r) + " in etcd within " +
                       std::to_string(wait.count() / 1000) + " s"
                 : res.message;
      return -1;
    }
    // Polling the store for the key, with the deadline above.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace ferry::bench
