#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Build the libFuzzer targets with clang (ASan + UBSan) in build-fuzz and run
# each for DURATION seconds from its seed corpus (fuzz/corpus/<target>/).
# Exits non-zero on any finding (crash, sanitizer report, leak, timeout, OOM);
# the input that triggered it is left in build-fuzz/artifacts/.
#   fuzz/run.sh DURATION [TARGET...]   e.g. fuzz/run.sh 30, fuzz/run.sh 600 policy
#   fuzz/run.sh corpus                 regenerate the seed corpora from valid encodings
set -euo pipefail
cd "$(dirname "$0")/.."
arg=${1:?usage: fuzz/run.sh DURATION [TARGET...] | corpus}
shift || true
jobs=${FERRY_JOBS:-$(nproc)}
all=(ctrl_frame tcp_wire descriptors policy etcd_json xgmi_wire rdma_wire ofi_blob cma_blob)
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DFERRY_BUILD_FUZZ=ON -DFERRY_BUILD_TESTS=OFF -DFERRY_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz -j "$jobs" --target fuzzers

if [ "$arg" = corpus ]; then
  ./build-fuzz/fuzz/fuzz_make_corpus "$PWD"
  echo "== seed corpora written to fuzz/corpus/"
  exit 0
fi
[[ "$arg" =~ ^[0-9]+$ ]] || { echo "DURATION must be whole seconds" >&2; exit 2; }

export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
mkdir -p build-fuzz/artifacts
failed=()
for t in "${targets[@]}"; do
  bin=build-fuzz/fuzz/fuzz_$t
  [ -x "$bin" ] || { echo "no fuzz target '$t' (have: ${all[*]})" >&2; exit 2; }
  work=build-fuzz/corpus/$t   # new inputs land here; the committed seeds stay as they are
  mkdir -p "$work"
  log=build-fuzz/fuzz-$t.log
  echo "== fuzz_$t for ${arg}s"
  if "$bin" -max_total_time="$arg" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
       -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$t-" \
       "$work" "fuzz/corpus/$t" >"$log" 2>&1; then
    execs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
    cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | grep -o 'cov: [0-9]*' || true)
    echo "   ok: ${execs:-?} inputs, ${cov:-cov: ?}, corpus $(ls "$work" | wc -l) files"
  else
    echo "   FINDING in fuzz_$t (log: $log):"
    # grep -m, not "| head": under pipefail head's early exit fails the pipeline.
    grep -m 20 -E 'ERROR|SUMMARY|runtime error|Test unit written|deadly signal' "$log" || tail -30 "$log"
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "== fuzzing found problems in: ${failed[*]}" >&2
  exit 1
fi
echo "== fuzzing: no findings"
