#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ferry-bench's two-host mode over loopback: rank 1 listens (port 0 = any free
# port), rank 0 connects with --peer; both move verified data, WRITE and READ,
# and write a CSV with every column.   usage: two_rank_loopback.sh BENCH_BINARY
set -euo pipefail
bench=$1
dir=$(mktemp -d)
target_pid=
cleanup() {
  [ -n "$target_pid" ] && kill "$target_pid" 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT
sizes=(--start-block-size 4KiB --max-block-size 64KiB --max-batch-size 4 --num-iter 8 --warmup-iter 2
       --num-threads 2 --strided)

for op in WRITE READ; do
  : >"$dir/target.err"  # exists before the background target opens it
  "$bench" --rank 1 --listen 127.0.0.1:0 "${sizes[@]}" 2>"$dir/target.err" &
  target_pid=$!
  port=
  for _ in $(seq 500); do
    port=$(sed -n 's/^ferry-bench: target waiting on 127.0.0.1:\([0-9]*\)$/\1/p' "$dir/target.err")
    [ -n "$port" ] && break
    kill -0 "$target_pid" 2>/dev/null || { cat "$dir/target.err"; exit 1; }
    sleep 0.02
  done
  [ -n "$port" ] || { echo "target never listened"; cat "$dir/target.err"; exit 1; }
  "$bench" --rank 0 --peer "127.0.0.1:$port" --op "$op" "${sizes[@]}" --check-consistency \
    --csv "$dir/$op.csv" --no-progress >"$dir/$op.out"
  wait "$target_pid"
  target_pid=
  cat "$dir/$op.out"
  rows=$(tail -n +2 "$dir/$op.csv" | wc -l)
  [ "$rows" -eq 15 ] || { echo "expected 15 rows in the $op CSV, got $rows"; exit 1; }
  # Every row verified, every column present.
  awk -F, -v op="$op" 'NR==1 { for (i = 1; i <= NF; i++) col[$i] = i; n = NF; next }
    NF != n || $col["op"] != op || $col["verified"] != 1 || $col["threads"] != 2 || $col["bw_gbs"] <= 0 {
      print "bad row: " $0; bad = 1 }
    END { exit bad }' "$dir/$op.csv"
done
# A target sized for less than the initiator asks for is refused with a clear message.
: >"$dir/target.err"
"$bench" --rank 1 --listen 127.0.0.1:0 --max-block-size 4KiB 2>"$dir/target.err" &
target_pid=$!
for _ in $(seq 500); do
  port=$(sed -n 's/^ferry-bench: target waiting on 127.0.0.1:\([0-9]*\)$/\1/p' "$dir/target.err")
  [ -n "$port" ] && break
  sleep 0.02
done
if "$bench" --rank 0 --peer "127.0.0.1:$port" --max-block-size 1MiB 2>"$dir/init.err" >/dev/null; then
  echo "an undersized target was accepted"; exit 1
fi
grep -q "needs" "$dir/init.err" || { cat "$dir/init.err"; exit 1; }
wait "$target_pid" || true
target_pid=
echo "two-rank loopback: OK"
