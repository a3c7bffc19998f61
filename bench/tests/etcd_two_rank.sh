#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ferry-bench's two ranks meeting through etcd, nixlbench-style (no --peer,
# no --listen): a real etcd (Debian's etcd-server) started here on a free
# port and stopped at the end; rank 1 publishes its rendezvous address and
# its engine's descriptors there, rank 0 finds them, both move verified data.
# While rank 0 runs, its Prometheus /metrics is scraped and each scrape must
# pass `promtool check metrics` (Debian's prometheus package).
#   usage: etcd_two_rank.sh BENCH_BINARY [loopback|netns]
# loopback: no --rank at all - etcd numbers the ranks, as nixlbench's (the one
# started first, with the output flags, claims rank 0).
# netns: run inside tests/netns/netns_pair.sh: etcd and rank 0 in namespace A
# (etcd on A's veth address), rank 1 in namespace B through FERRY_TEST_PEER_WRAPPER
# (explicit --rank 0 / --rank 1).
# A missing etcd or promtool skips (77) unless FERRY_REQUIRE_ETCD /
# FERRY_REQUIRE_PROMTOOL is 1 (scripts/run.sh), then it fails.
set -euo pipefail
bench=$1
mode=${2:-loopback}
need() {  # need BINARY ENV_NAME PACKAGE
  command -v "$1" >/dev/null && return 0
  if [ "${!2:-}" = 1 ]; then echo "FAIL: $1 is not installed (apt-get install $3)"; exit 1; fi
  echo "SKIP: $1 is not installed (apt-get install $3)"; exit 77
}
need etcd FERRY_REQUIRE_ETCD etcd-server
need promtool FERRY_REQUIRE_PROMTOOL prometheus

if [ "$mode" = netns ]; then
  host_a=${FERRY_NETNS_ADDR_A:?run me through netns_pair.sh}
  host_b=${FERRY_NETNS_ADDR_B:?}
  read -r -a wrap <<<"${FERRY_TEST_PEER_WRAPPER:?}"
else
  host_a=127.0.0.1 host_b=127.0.0.1 wrap=()
fi

dir=$(mktemp -d /tmp/ferry-etcd-bench.XXXXXX)
etcd_pid= target_pid= init_pid=
cleanup() {
  local p
  for p in $init_pid $target_pid $etcd_pid; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

free_port() {  # a port free now on $host_a
  python3 -c 'import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])' "$host_a"
}
cport=$(free_port) pport=$(free_port)
ep="http://$host_a:$cport"
etcd --name bench --data-dir "$dir/etcd" --listen-client-urls "$ep" --advertise-client-urls "$ep" \
  --listen-peer-urls "http://$host_a:$pport" --initial-advertise-peer-urls "http://$host_a:$pport" \
  --initial-cluster "bench=http://$host_a:$pport" --log-level warn --logger zap >"$dir/etcd.log" 2>&1 &
etcd_pid=$!
# Ready when a range request is answered (polled, bounded: 20 s).
ready=0
for _ in $(seq 400); do
  if python3 - "$ep" <<'PY' 2>/dev/null; then ready=1; break; fi
import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/v3/kv/range", data=b'{"key":"eA=="}'), timeout=1).read()
PY
  kill -0 "$etcd_pid" 2>/dev/null || { cat "$dir/etcd.log"; echo "etcd exited"; exit 1; }
  sleep 0.05
done
[ "$ready" = 1 ] || { cat "$dir/etcd.log"; echo "etcd never served at $ep"; exit 1; }
echo "etcd serving at $ep ($mode)"

ns="run-$$"
sizes=(--start-block-size 4KiB --max-block-size 256KiB --max-batch-size 4 --num-iter 400
       --warmup-iter 4 --num-threads 2)
rank0=(--rank 0) rank1=(--rank 1)
[ "$mode" = netns ] || rank0=() rank1=()
: >"$dir/init.err"
"$bench" "${rank0[@]}" --etcd-endpoints "$ep" --etcd-namespace "$ns" --host "$host_a" --op WRITE \
  "${sizes[@]}" --check-consistency --csv "$dir/write.csv" --no-progress \
  --metrics-address "$host_a:0" >"$dir/init.out" 2>"$dir/init.err" &
init_pid=$!
if [ "$mode" != netns ]; then  # the first one claims rank 0 before the second starts
  for _ in $(seq 400); do
    grep -q "rank 0 (claimed" "$dir/init.err" && break
    kill -0 "$init_pid" 2>/dev/null || { cat "$dir/init.err"; exit 1; }
    sleep 0.05
  done
  grep -q "rank 0 (claimed" "$dir/init.err" || { echo "no rank claimed"; cat "$dir/init.err"; exit 1; }
fi
"${wrap[@]}" "$bench" "${rank1[@]}" --etcd-endpoints "$ep" --etcd-namespace "$ns" --host "$host_b" \
  "${sizes[@]}" 2>"$dir/target.err" &
target_pid=$!

# Scrape rank 0's /metrics while it runs, until a scrape shows landed writes.
addr=
scraped=0
while kill -0 "$init_pid" 2>/dev/null; do
  [ -n "$addr" ] || addr=$(sed -n 's|^ferry-bench: metrics on http://\(.*\)/metrics$|\1|p' "$dir/init.err")
  if [ -n "$addr" ] && python3 - "$addr" "$dir/metrics.txt" <<'PY' 2>/dev/null; then
import sys, urllib.request
body = urllib.request.urlopen("http://" + sys.argv[1] + "/metrics", timeout=2).read()
open(sys.argv[2], "wb").write(body)
PY
    promtool check metrics <"$dir/metrics.txt" || { echo "promtool rejected the scrape:"; cat "$dir/metrics.txt"; exit 1; }
    if grep -Eq '^ferry_transfers_total\{backend="tcp",op="write"\} [1-9]' "$dir/metrics.txt"; then
      scraped=1
      break
    fi
  fi
  sleep 0.05  # polling the running bench
done
rc=0
wait "$init_pid" || rc=$?
init_pid=
wait "$target_pid" || true
target_pid=
cat "$dir/init.out"
if [ "$rc" != 0 ]; then
  echo "rank 0 failed ($rc):"; cat "$dir/init.err"; echo "rank 1:"; cat "$dir/target.err"; exit 1
fi
[ "$scraped" = 1 ] || { echo "no /metrics scrape during the run showed landed writes"; cat "$dir/init.err"; exit 1; }
grep -q "descriptors came from etcd" "$dir/init.err" || { echo "rank 0 did not use etcd"; cat "$dir/init.err"; exit 1; }
grep -q "published in etcd" "$dir/target.err" || { echo "rank 1 did not publish in etcd"; cat "$dir/target.err"; exit 1; }
if [ "$mode" != netns ]; then
  grep -q "rank 1 (claimed" "$dir/target.err" || { echo "the second process was not rank 1"; cat "$dir/target.err"; exit 1; }
fi
awk -F, 'NR==1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
  $col["verified"] != 1 || $col["bw_gbs"] <= 0 { print "bad row: " $0; bad = 1 }
  END { if (NR < 2) { print "no rows"; bad = 1 } exit bad }' "$dir/write.csv"
# The rendezvous key is gone (rank 1 revoked its lease once rank 0 connected).
left=$(python3 - "$ep" "$ns/rendezvous/target" <<'PY'
import sys, json, base64, urllib.request
key = base64.b64encode(sys.argv[2].encode()).decode()
r = json.loads(urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/v3/kv/range", data=json.dumps({"key": key}).encode()), timeout=2).read())
print(r.get("count", "0"))
PY
)
[ "$left" = 0 ] || { echo "the rendezvous key outlived the run"; exit 1; }
# So are the rank claims (released once the ranks met): the next run starts afresh.
claims=$(python3 - "$ep" "$ns/rank/" <<'PY'
import sys, json, base64, urllib.request
p = sys.argv[2].encode()
end = p[:-1] + bytes([p[-1] + 1])
body = {"key": base64.b64encode(p).decode(), "range_end": base64.b64encode(end).decode()}
r = json.loads(urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/v3/kv/range", data=json.dumps(body).encode()), timeout=2).read())
print(r.get("count", "0"))
PY
)
[ "$claims" = 0 ] || { echo "$claims rank claims outlived the run"; exit 1; }
echo "etcd two-rank ($mode): OK, /metrics scraped mid-run and accepted by promtool"
