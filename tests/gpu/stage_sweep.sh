#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tests/gpu/stage_sweep.sh STAGE[:GPU_CHUNK] ...: on a GPU host, tcp with GPU
# memory (staged, GPU0 -> GPU1) beside tcp with host memory (default settings),
# one pair of runs per setting, each through a policy
# `backends: tcp: {gpu_stage_bytes, gpu_chunk_bytes}`; prints the GB/s ratio per
# row. Example: tests/gpu/stage_sweep.sh 1MiB:1MiB 1MiB:4MiB 512KiB:4MiB
set -u
cd "$(dirname "$0")/../.."
b=${FERRY_GPU_BUILD_DIR:-build-gpu}
out=$(mktemp -d)
extra=()
[ -n "${FERRY_EXTRA_INCLUDE:-}" ] && extra+=("-DFERRY_EXTRA_INCLUDE=$FERRY_EXTRA_INCLUDE")
cmake -S . -B "$b" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${extra[@]}" > "$out/configure.log" 2>&1
cmake --build "$b" -j "$(nproc)" --target ferry-tcp ferry-gpu-bench ferry-gpu-peer > "$out/build.log" 2>&1 ||
  { tail -20 "$out/build.log"; exit 1; }
export FERRY_PLUGIN_PATH=$PWD/$b/lib/ferry/plugins
for spec in "$@"; do
  piece=${spec%%:*}; chunk=${spec##*:}; [ "$chunk" = "$spec" ] && chunk=4MiB
  printf 'backends:\n  tcp: { gpu_stage_bytes: %s, gpu_chunk_bytes: %s }\n' "$piece" "$chunk" > "$out/policy.yaml"
  FERRY_POLICY="$out/policy.yaml" "$b/bin/ferry-gpu-bench" tcp > "$out/gpu.txt" 2>&1
  FERRY_POLICY="$out/policy.yaml" "$b/bin/ferry-gpu-bench" tcp -1 -1 > "$out/cpu.txt" 2>&1
  echo "== gpu_stage_bytes=$piece gpu_chunk_bytes=$chunk"
  awk 'NR==FNR { if ($4 ~ /^[0-9.]+$/) g[$1 " " $2 " " $3] = $4; next }
       ($4 ~ /^[0-9.]+$/) && (($1 " " $2 " " $3) in g) && $4 > 0 {
         printf "%6s %12s notify %-3s  gpu %6.2f  cpu %6.2f  ratio %.2f\n", $1, $2, $3, g[$1 " " $2 " " $3], $4, g[$1 " " $2 " " $3] / $4 }' \
    "$out/gpu.txt" "$out/cpu.txt"
done
rm -rf "$out"
