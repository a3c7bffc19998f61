#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# tests/gpu/run-all.sh REPORT_DIR: on a GPU host, build ferry and run every GPU
# test and benchmark in one go; the report lands in REPORT_DIR (report.md plus
# the raw logs). Needs cmake, ninja, pkg-config, a C++20 compiler, yaml-cpp,
# GoogleTest, OpenSSL, libcurl and cpp-httplib (the core's /metrics and etcd
# client) and a CUDA or HIP runtime; no GPU SDK headers are needed to build. On
# a host without Debian's packages, unpack them (dpkg -x) into a folder and
# point CMAKE_PREFIX_PATH, PKG_CONFIG_PATH + PKG_CONFIG_SYSROOT_DIR,
# FERRY_EXTRA_INCLUDE and LD_LIBRARY_PATH at it.
set -uo pipefail
report=${1:?usage: tests/gpu/run-all.sh REPORT_DIR}
mkdir -p "$report"
report=$(cd "$report" && pwd)
cd "$(dirname "$0")/../.."
build=${FERRY_GPU_BUILD_DIR:-build-gpu}
status=0
log() { echo "$*" | tee -a "$report/report.md"; }

: > "$report/report.md"
log "# ferry GPU report, $(date -u +%Y-%m-%dT%H:%MZ), $(hostname)"
log '```'
(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 || rocm-smi 2>&1) | tee -a "$report/report.md"
nvidia-smi topo -m 2>/dev/null | tee -a "$report/report.md"
log '```'

extra=()
[ -n "${FERRY_EXTRA_INCLUDE:-}" ] && extra+=("-DFERRY_EXTRA_INCLUDE=$FERRY_EXTRA_INCLUDE")
# The Python binding for the python3 that holds torch with CUDA (pybind11 from its pip package).
py=$(command -v python3 || true)
if [ -n "$py" ] && pyb=$("$py" -m pybind11 --cmakedir 2>/dev/null); then
  extra+=("-DPython3_EXECUTABLE=$py" "-Dpybind11_DIR=$pyb")
fi
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${extra[@]}" > "$report/configure.log" 2>&1; then
  log "configure FAILED (see configure.log)"; tail -30 "$report/configure.log"; exit 1
fi
targets=(ferry ferry-cli ferry-tcp ferry-xgmi ferry-gpu-peer gpu_transfer_test ferry-gpu-bench gpu-peer-ref
         engine_process_test ferry-test-peer ferry-bench ferry-plugin-check same_host_probe)

grep -q "ferry_python" "$build/build.ninja" 2>/dev/null && targets+=(ferry_python ferry_python_files)
if ! cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" > "$report/build.log" 2>&1; then
  log "build FAILED (see build.log)"; grep -m 30 -E "error" "$report/build.log"; exit 1
fi
# ofi where libfabric was found; its absence or failure only makes GpuOfi skip.
if grep -q "ferry-ofi" "$build/build.ninja" 2>/dev/null; then
  cmake --build "$build" -j "$(nproc)" --target ferry-ofi > "$report/ofi-build.log" 2>&1 ||
    log "ofi plugin did not build (ofi-build.log): GpuOfi will skip"
else
  log "ofi plugin not configured (no libfabric found): GpuOfi will skip"
fi
export FERRY_PLUGIN_PATH="$PWD/$build/lib/ferry/plugins"

log "## ferry info"; log '```'
"$build/bin/ferry" info 2>&1 | tee -a "$report/report.md"; log '```'

log "## gpu_transfer_test (xgmi matrix, detection, 1024x16KiB batch, IPC-open failure)"
"$build/bin/gpu_transfer_test" > "$report/gpu_transfer_test.log" 2>&1 || status=1
log '```'; grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests? ran|FAILED TEST" "$report/gpu_transfer_test.log" | tee -a "$report/report.md"; log '```'

log "## ferry-plugin-check: the plugin contract for xgmi (GPU memory, device 0) and tcp with GPU memory"
for p in xgmi tcp; do
  log "### $p"
  log '```'
  "$build/bin/ferry-plugin-check" --gpu "$build/lib/ferry/plugins/libferry-$p.so" \
    > "$report/plugin-check-$p.txt" 2> "$report/plugin-check-$p.err" || status=1
  tee -a "$report/report.md" < "$report/plugin-check-$p.txt"
  log '```'
done

log "## CPU two-process matrix on this host (tcp), as a sanity check"
"$build/bin/engine_process_test" > "$report/engine_process_test.log" 2>&1 || status=1
log '```'; tail -3 "$report/engine_process_test.log" | tee -a "$report/report.md"; log '```'

log "## raw reference: gpu-peer-ref (runtime async copies and the batch call's methods, no ferry)"
log '```'; "$build/bin/gpu-peer-ref" 2>&1 | tee -a "$report/report.md"; log '```'
log "## ferry-gpu-bench over xgmi (two processes; each row beside the raw copy of the same run)"
log '```'; "$build/bin/ferry-gpu-bench" xgmi 2>&1 | tee -a "$report/report.md" || status=1; log '```'
log "### the same with every piece through the gather kernel (--method gather)"
log '```'; "$build/bin/ferry-gpu-bench" xgmi --method gather 2>&1 | tee -a "$report/report.md" || status=1; log '```'
log "## tcp with GPU memory staged (on one host: in the rings' own bytes), beside tcp CPU->CPU"
log "(the last two columns: the same transfers between host memory, alternating with each run)"
log '```'; "$build/bin/ferry-gpu-bench" tcp --runs 3 2>&1 | tee -a "$report/report.md" || status=1; log '```'
log "## same-host CPU -> CPU: the raw references beside tcp (issue 19, item 4)"
log "same_host_probe: memcpy one thread; process_vm_readv pulled by the target; a polled shared ring"
log '```'; "$build/bin/same_host_probe" --threads 1,4 2>&1 | tee -a "$report/report.md"; log '```'
# Both engines on this host: tcp's lanes run over shared rings (channel.h);
# the same sweep with same_host_rings off is TCP over loopback, for the ratio.
for stream in rings tcp; do
  settings='{}'
  [ "$stream" = tcp ] && settings='{"same_host_rings":false}'
  for op in WRITE READ; do
    log "### ferry-bench tcp $op, CPU -> CPU, two processes, lanes over $stream"
    log '```'
    "$build/bin/ferry-bench" --backend tcp --no-progress --op $op --start-block-size 4KiB \
      --max-block-size 64MiB --block-multiplier 4 --num-iter 64 --large-block-iter-factor 2 \
      --warmup-iter 4 --backend-settings "tcp=$settings" 2>&1 | tee "$report/bench-$stream-$op.txt" |
      tee -a "$report/report.md" || status=1
    log '```'
  done
done
log "rings / tcp, same run (GB/s ratio, avg latency us):"
log '```'
for op in WRITE READ; do
  awk -v op=$op 'NR==FNR { if ($1 ~ /^[0-9]+$/) { g[$1] = $3; l[$1] = $4 } next }
       ($1 ~ /^[0-9]+$/) && ($1 in g) && $3 > 0 {
         printf "%5s %10s  rings %8.3f GB/s %8.1f us  tcp %8.3f GB/s %8.1f us  ratio %.2f\n", op, $1, g[$1], l[$1], $3, $4, g[$1] / $3 }' \
    "$report/bench-rings-$op.txt" "$report/bench-tcp-$op.txt" | tee -a "$report/report.md"
done
log '```'
log "## ferry-bench --kv: a KV-cache request (64 regions x 1024 x 16 KiB, 128 blocks) VRAM -> VRAM"
for b in xgmi tcp; do
  log "### backend $b"
  log '```'
  "$build/bin/ferry-bench" --kv --backend "$b" --initiator-seg-type VRAM --target-seg-type VRAM \
    --check-consistency > "$report/kv-$b.txt" 2>&1 || status=1
  tee -a "$report/report.md" < "$report/kv-$b.txt"
  log '```'
done
log "### DRAM -> DRAM over tcp on this host (the same request, for scale)"
log '```'
"$build/bin/ferry-bench" --kv --backend tcp --check-consistency > "$report/kv-dram.txt" 2>&1 || status=1
tee -a "$report/report.md" < "$report/kv-dram.txt"
log '```'
log "## the connectors' call sequences with CUDA tensors (mori.io and nixl over ferry)"
if ls "$build"/python/ferry/_ferry*.so > /dev/null 2>&1; then
  log '```'
  PYTHONPATH="$PWD/$build/python" FERRY_CONNECTOR_DEVICE=cuda FERRY_REQUIRE_TORCH=1 \
    "$py" -m pytest -q -p no:cacheprovider -rs python/tests/test_connectors.py python/tests/test_mori.py \
    python/tests/test_nixl.py > "$report/connectors.log" 2>&1 || status=1
  tail -5 "$report/connectors.log" | tee -a "$report/report.md"
  # vLLM's MoRIIOConnector with its xgmi backend choice (XgmiBackendConfig), both modes.
  for m in write read; do
    PYTHONPATH="$PWD/python/tests/connectors:$PWD/$build/python" "$py" \
      python/tests/connectors/vllm_moriio.py --device cuda --backend xgmi --mode $m \
      > "$report/moriio-xgmi-$m.log" 2>&1 && log "vllm_moriio --backend xgmi --mode $m: passed" ||
      { log "vllm_moriio --backend xgmi --mode $m: FAILED"; status=1; }
  done
  log '```'
else
  log "Python binding not built (configure.log: python3 headers or pybind11 missing): FAILED"
  status=1
fi
log "exit status: $status"
exit $status
