#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ferry-bench with a scripted failing backend ahead of tcp: the policy prefers
# the test-only `fault` plugin, which fails every transfer at completion; after
# three failures the policy quarantines it for the peer. Every row must still be
# verified, the bench's final stats must show the 3 failovers and the quarantine,
# and `ferry stats` must read the counters from the bench while it runs.
#   usage: failover_bench.sh BENCH_BINARY FERRY_CLI
set -euo pipefail
bench=$1 cli=$2
dir=$(mktemp -d)
bench_pid=
cleanup() {
  [ -n "$bench_pid" ] && kill "$bench_pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
cat >"$dir/policy.yaml" <<'YAML'
backends:
  fault: {}
rules:
  - prefer: [fault, tcp]
failover:
  max_attempts: 2
  quarantine: { after_failures: 3, within: 60s, for: 60s }
timeout: 5s
YAML
sock="$dir/stats.sock"
# --stats-hold: the bench keeps serving its stats after the run until its
# stdin (this fifo) closes, so a sampler slower than the run (a loaded CI
# machine) still reads them; closing fd 4 below lets it end.
mkfifo "$dir/hold"
"$bench" --backend fault,tcp --policy "$dir/policy.yaml" \
  --backend-settings 'fault={"mode":"fail_complete"}' \
  --start-block-size 4KiB --max-block-size 256KiB --num-iter 64 --warmup-iter 2 \
  --check-consistency --csv "$dir/rows.csv" --no-progress --stats-socket "$sock" \
  --stats-hold <"$dir/hold" >"$dir/out" 2>"$dir/err" &
bench_pid=$!
exec 4>"$dir/hold"
# Sample the bench (bounded poll) until its stats show the quarantine: it
# comes after the third transfer, while hundreds more are still to run (or
# have run: the stats stay until fd 4 closes).
# (fault's describe() line, "detail", sits after bytes; its own counters,
# "plugin":{...}, between failures and quarantines.)
want='"fault":{"bytes":0,"detail":"fault plugin (scripted failures)","failovers":3,"failures":3,'
want_q='"quarantines":1,"stray_completions":0,"transfers":0}'
sample=
for _ in $(seq 2000); do
  s=$("$cli" stats "$sock" --json 2>/dev/null) && sample=$s
  case "$sample" in *"$want"*"$want_q"*) break ;; esac
  kill -0 "$bench_pid" 2>/dev/null || break
  sleep 0.01
done
exec 4>&-
wait "$bench_pid" || { cat "$dir/out" "$dir/err"; exit 1; }
bench_pid=
cat "$dir/out"
[ -n "$sample" ] || { echo "ferry stats never read the running bench"; exit 1; }
echo "ferry stats during the run: $sample"
for w in '"engine":"ferry-bench-initiator"' "$want" "$want_q"; do
  case "$sample" in *"$w"*) ;; *) echo "the stats read during the run lack $w"; exit 1 ;; esac
done
# Every row verified (a real CSV reader: the backend column "fault,tcp" is quoted).
/usr/bin/python3 - "$dir/rows.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
bad = [r for r in rows if r["verified"] != "1" or r["backend"] != "fault,tcp"]
if not rows or bad:
    sys.exit("unverified or malformed rows: %r" % (bad or "none"))
print("%d rows, all verified" % len(rows))
PY
# The bench's own final stats: three failovers, one quarantine, nothing lost.
grep -q 'fault{transfers=0 bytes=0 failures=3 failovers=3 quarantines=1}' "$dir/out" ||
  { echo "the final stats do not show the 3 failovers and the quarantine"; exit 1; }
grep -q 'tcp{transfers=[1-9][0-9]* bytes=[1-9][0-9]* failures=0 ' "$dir/out" ||
  { echo "tcp did not carry the transfers"; exit 1; }
[ ! -e "$sock" ] || { echo "the stats socket outlived the bench"; exit 1; }
echo "failover bench: OK"
