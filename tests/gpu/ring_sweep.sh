#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tests/gpu/ring_sweep.sh OUT_DIR 'JSON' ...: on a many-core host (the GPU host;
# no GPU is used), ferry-bench tcp WRITE and READ CPU -> CPU between two
# processes once per tcp settings JSON, in the order given and then once more in
# reverse (so a drift of the host shows), beside one thread's memcpy (and the
# raw ring) from same_host_probe in the same invocation. Each run's rows land
# in OUT_DIR;
# prints GB/s and average latency per block size and setting. Example:
#   tests/gpu/ring_sweep.sh out '{"same_host_rings":false}' '{}' '{"chunk_bytes":"256KiB"}'
set -u
out=${1:?usage: tests/gpu/ring_sweep.sh OUT_DIR JSON...}; shift
mkdir -p "$out"
cd "$(dirname "$0")/../.."
b=${FERRY_GPU_BUILD_DIR:-build-gpu}
extra=()
[ -n "${FERRY_EXTRA_INCLUDE:-}" ] && extra+=("-DFERRY_EXTRA_INCLUDE=$FERRY_EXTRA_INCLUDE")
cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${extra[@]}" > "$out/configure.log" 2>&1
cmake --build "$b" -j "$(nproc)" --target ferry-tcp ferry-bench same_host_probe > "$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log"; exit 1; }
export FERRY_PLUGIN_PATH=$PWD/$b/lib/ferry/plugins
"$b/bin/same_host_probe" --threads 1 > "$out/memcpy.txt" 2>&1
cat "$out/memcpy.txt"
settings=("$@")
for ((i = ${#settings[@]} - 1; i >= 0; i--)); do settings+=("${settings[i]}"); done
n=0
for s in "${settings[@]}"; do
  n=$((n + 1))
  for op in WRITE READ; do
    "$b/bin/ferry-bench" --backend tcp --no-progress --op $op --start-block-size 4KiB \
      --max-block-size 64MiB --block-multiplier 4 --num-iter 128 --large-block-iter-factor 4 \
      --warmup-iter 8 --backend-settings "tcp=$s" > "$out/run$n-$op.txt" 2>&1
    echo "== run $n $op tcp=$s"
    awk '$1 ~ /^[0-9]+$/ { printf "%10s %8.3f GB/s %9.1f us (min %7.1f)\n", $1, $3, $4, $13 }' "$out/run$n-$op.txt"
  done
done
