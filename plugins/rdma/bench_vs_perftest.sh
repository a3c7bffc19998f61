#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ferry-bench --backend rdma beside perftest's ib_write_bw / ib_read_bw, in ONE
# boot of the Soft-RoCE guest (same kernel, same emulated CPU), printing a
# markdown table with the ratio. From the build directory:
#   ../shared/rxe-vm/run-in-rxe-vm.sh 'bash ../plugins/rdma/bench_vs_perftest.sh .'
# Outside the guest it refuses (it needs an RDMA device: rxe0).
set -uo pipefail
BUILD=$(cd "${1:-.}" && pwd)
DEV=${RDMA_BENCH_DEV:-rxe0}
GID=${RDMA_BENCH_GID:-1}
SIZES=${RDMA_BENCH_SIZES:-"65536 1048576 4194304"}
QD=${RDMA_BENCH_QD:-16}
QPS=${RDMA_BENCH_QPS:-4}  # QPs on both sides: perftest -q, ferry qp_per_transfer
command -v ib_write_bw >/dev/null || { echo "perftest is not installed" >&2; exit 1; }
ibv_devinfo -d "$DEV" >/dev/null 2>&1 || { echo "no RDMA device $DEV here" >&2; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

iters_for() {  # about 32 MiB per point, 8..4096 iterations
  local n=$(( (32 << 20) / $1 ))
  (( n < 8 )) && n=8
  (( n > 4096 )) && n=4096
  echo "$n"
}

# perftest: server in the background, client once the server says it waits.
PORT=18600
perftest_gbs() {  # perftest_gbs write|read SIZE -> GB/s (decimal)
  local tool=ib_$1_bw size=$2 n; n=$(iters_for "$2")
  (( n < 32 )) && n=32
  PORT=$((PORT + 1))  # a fresh port each run: no TIME_WAIT clash with the last one
  local args=(-d "$DEV" -x "$GID" -F -s "$size" -n "$n" -p "$PORT" -q "$QPS")
  timeout 300 "$tool" "${args[@]}" >"$TMP/srv" 2>&1 &
  local srv=$!
  local i
  for i in $(seq 1 600); do
    grep -q "Waiting for client" "$TMP/srv" && break
    kill -0 "$srv" 2>/dev/null || break
    sleep 0.05
  done
  timeout 300 "$tool" "${args[@]}" 127.0.0.1 >"$TMP/cli" 2>&1
  wait "$srv"
  # line: #bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]; MB = 2^20
  local v; v=$(awk -v s="$size" '$1 == s && NF >= 5 { printf "%.4f", $4 * 1048576 / 1e9 }' "$TMP/cli")
  if [ -z "$v" ]; then
    { echo "$tool $size failed:"; tail -n 5 "$TMP/srv" "$TMP/cli"; } >&2
  fi
  echo "$v"
}

ferry_gbs() {  # ferry_gbs WRITE|READ SIZE QD [CHUNK] -> GB/s (ferry-bench: 1e9 B), no data check
  local settings="{\"qp_per_transfer\": $QPS${4:+, \"chunk_bytes\": $4}}"
  timeout 600 "$BUILD/bin/ferry-bench" --backend rdma --backend-settings "rdma=$settings" \
    --op "$1" --start-block-size "$2" --max-block-size "$2" \
    --num-iter "$(iters_for "$2")" --large-block-iter-factor 1 --warmup-iter 4 \
    --queue-depth "$3" --no-progress >"$TMP/f.out" 2>&1 || { cat "$TMP/f.out" >&2; return 1; }
  # ferry-bench's table: Block Batch B/W ... ; take the B/W column of the data row
  awk -v s="$2" '$1 == s { print $3; exit }' "$TMP/f.out"
}

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a > 0 && b > 0) printf "%.2f", a / b; else print "?" }'; }

echo "rdma (Soft-RoCE) in one guest boot: $(uname -r), $(nproc) vCPUs, device $DEV gid $GID, $QPS QPs, $(date -u +%FT%RZ)"
ibv_devinfo -d "$DEV" | grep -E "active_mtu|link_layer" | sed 's/^[[:space:]]*/  /'
echo
echo "perftest: ib_{write,read}_bw -q $QPS (one WR per message); ferry-bench: engine API, notification on,"
echo "queue depth $QD, qp_per_transfer $QPS, default chunk_bytes (256KiB) and chunk_bytes = block (one WR per block, as perftest)"
echo
echo "| op | block (B) | perftest GB/s | ferry GB/s | ferry / perftest | ferry chunk=block GB/s | ratio |"
echo "|---|---|---|---|---|---|---|"
for op in write read; do
  OP=$(echo "$op" | tr a-z A-Z)
  for s in $SIZES; do
    p=$(perftest_gbs "$op" "$s")
    f=$(ferry_gbs "$OP" "$s" "$QD")
    if [ "$s" -gt 262144 ]; then
      fc=$(ferry_gbs "$OP" "$s" "$QD" "$s"); rc=$(ratio "$fc" "$p")
    else
      fc="(same)"; rc="(same)"
    fi
    echo "| $OP | $s | $p | $f | $(ratio "$f" "$p") | $fc | $rc |"
  done
done
