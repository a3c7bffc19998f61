#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs a two-process test across two "hosts": network namespaces A and B joined
# by a veth pair with private test addresses (10.203.N.1 in A, 10.203.N.2 in B;
# they exist only inside these namespaces). The command runs in A; the test
# starts its peer in B through FERRY_TEST_PEER_WRAPPER. Everything is removed
# on exit. Exits 77 (ctest: skipped) without the rights to build namespaces.
#
# usage: netns_pair.sh [--policy TEMPLATE] [--timeout SECONDS] [--same-node] [--ctrl-link]
#                      -- COMMAND [ARGS...]
#   TEMPLATE: a policy file; @ADDR@ becomes each side's address, and each side
#             gets its own copy through FERRY_POLICY.
#   --same-node: both sides get one FERRY_NODE_ID (netns-<pid>): to the router the
#             two namespaces are one host, so same-host-only backends (cma) join in.
#   --ctrl-link: a second veth pair (vctl-a/vctl-b, 10.204.N.1/.2) carries the
#             engines' control planes: FERRY_TEST_INITIATOR_HOST/TARGET_HOST become
#             these addresses, while @ADDR@ (the data backends) stays on veth-a/veth-b.
#             A fault on the data link then leaves the control plane up (as with a
#             separate management network). Exported as FERRY_NETNS_CTRL_ADDR_A/B.
# The command (in A) sees:
#   FERRY_TEST_INITIATOR_HOST=10.203.N.1  FERRY_TEST_TARGET_HOST=10.203.N.2
#   FERRY_TEST_PEER_WRAPPER="<ip> netns exec B <env> FERRY_POLICY=... FERRY_NODE_ID=... FERRY_TEST_TARGET_HOST=..."
#   FERRY_NODE_ID=netns-a-<pid> (B gets netns-b-<pid>: two hosts to the router)
#   FERRY_NETNS_A, FERRY_NETNS_B, FERRY_NETNS_ADDR_A, FERRY_NETNS_ADDR_B,
#   FERRY_NETNS_DEV_A=veth-a, FERRY_NETNS_DEV_B=veth-b (the data link's two ends)
set -u

policy=""
limit=900
same_node=0
ctrl_link=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --policy) policy="$2"; shift 2 ;;
    --timeout) limit="$2"; shift 2 ;;
    --same-node) same_node=1; shift ;;
    --ctrl-link) ctrl_link=1; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [--policy TEMPLATE] [--timeout SECONDS] [--same-node] [--ctrl-link] -- COMMAND [ARGS...]" >&2
  exit 2
fi

skip() {
  echo "SKIP: netns_pair: $*" >&2
  exit 77
}

IP=$(command -v ip || true)
ENV=$(command -v env || true)
[[ -n "$IP" && -n "$ENV" ]] || skip "no 'ip' (iproute2) here"
[[ $(id -u) -eq 0 ]] || skip "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"

tag="$$"
A="ferry-a-$tag"
B="ferry-b-$tag"
# A /24 picked from the pid so concurrent runs never share a subnet (they could:
# the addresses live only inside their own namespaces, but logs stay clearer).
sub=$(( tag % 250 + 1 ))
ADDR_A="10.203.$sub.1"
ADDR_B="10.203.$sub.2"
CTRL_A="10.204.$sub.1"
CTRL_B="10.204.$sub.2"
work=$(mktemp -d /tmp/ferry-netns.XXXXXX)

cleanup() {
  local ns pid
  for ns in "$A" "$B"; do
    # Processes this run started inside the namespace (a crashed peer, say).
    for pid in $("$IP" netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
    "$IP" netns del "$ns" 2>/dev/null  # also destroys its end of the veth pair
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

"$IP" netns add "$A" 2>"$work/err" || skip "cannot create a network namespace: $(cat "$work/err")"
"$IP" netns add "$B" 2>"$work/err" || skip "cannot create a network namespace: $(cat "$work/err")"
set -e
"$IP" link add veth-a netns "$A" type veth peer name veth-b netns "$B"
"$IP" -n "$A" addr add "$ADDR_A/24" dev veth-a
"$IP" -n "$B" addr add "$ADDR_B/24" dev veth-b
for ns in "$A" "$B"; do "$IP" -n "$ns" link set lo up; done
"$IP" -n "$A" link set veth-a up
"$IP" -n "$B" link set veth-b up
links="$A:veth-a $B:veth-b"
if [[ $ctrl_link -eq 1 ]]; then
  "$IP" link add vctl-a netns "$A" type veth peer name vctl-b netns "$B"
  "$IP" -n "$A" addr add "$CTRL_A/24" dev vctl-a
  "$IP" -n "$B" addr add "$CTRL_B/24" dev vctl-b
  "$IP" -n "$A" link set vctl-a up
  "$IP" -n "$B" link set vctl-b up
  links="$links $A:vctl-a $B:vctl-b"
fi
set +e

# Carrier on both ends, then proof that A reaches B: a TCP connect to a closed
# port on B must be refused (an answer), not time out (bounded: 5 s).
for side in $links; do
  # Captured, not "| grep -q" (its early exit would fail the pipeline under pipefail).
  state=$("$IP" -n "${side%%:*}" -br link show "${side##*:}" 2>&1 || true)
  if [[ "$state" != *LOWER_UP* ]]; then
    echo "netns_pair: ${side##*:} in ${side%%:*} has no carrier" >&2
    exit 1
  fi
done
probe=$("$IP" netns exec "$A" timeout 5 bash -c "exec 3<>/dev/tcp/$ADDR_B/9" 2>&1)
if [[ "$probe" != *"refused"* ]]; then
  echo "netns_pair: $ADDR_A cannot reach $ADDR_B: ${probe:-no answer}" >&2
  exit 1
fi

pol_a="" pol_b=""
if [[ -n "$policy" ]]; then
  sed "s/@ADDR@/$ADDR_A/g" "$policy" >"$work/policy-a.yaml"
  sed "s/@ADDR@/$ADDR_B/g" "$policy" >"$work/policy-b.yaml"
  pol_a="FERRY_POLICY=$work/policy-a.yaml"
  pol_b="FERRY_POLICY=$work/policy-b.yaml"
fi

node_a="netns-a-$tag" node_b="netns-b-$tag"
[[ $same_node -eq 1 ]] && node_a="netns-$tag" node_b="netns-$tag"
host_a="$ADDR_A" host_b="$ADDR_B" ctrl_env=""
if [[ $ctrl_link -eq 1 ]]; then
  host_a="$CTRL_A" host_b="$CTRL_B"
  ctrl_env="FERRY_NETNS_CTRL_ADDR_A=$CTRL_A FERRY_NETNS_CTRL_ADDR_B=$CTRL_B"
fi

echo "netns_pair: $A ($ADDR_A) <-> $B ($ADDR_B)${policy:+, policy $policy}${ctrl_env:+, control $CTRL_A <-> $CTRL_B}" >&2
"$IP" netns exec "$A" "$ENV" $pol_a $ctrl_env \
  FERRY_NODE_ID="$node_a" \
  FERRY_TEST_INITIATOR_HOST="$host_a" \
  FERRY_TEST_TARGET_HOST="$host_b" \
  FERRY_TEST_PEER_WRAPPER="$IP netns exec $B $ENV $pol_b FERRY_NODE_ID=$node_b FERRY_TEST_TARGET_HOST=$host_b" \
  FERRY_NETNS_A="$A" FERRY_NETNS_B="$B" FERRY_NETNS_ADDR_A="$ADDR_A" FERRY_NETNS_ADDR_B="$ADDR_B" \
  FERRY_NETNS_DEV_A=veth-a FERRY_NETNS_DEV_B=veth-b \
  timeout --kill-after=10 "$limit" "$@"
rc=$?
[[ $rc -eq 124 || $rc -eq 137 ]] && echo "netns_pair: the command ran past ${limit}s" >&2
exit $rc
