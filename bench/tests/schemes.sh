#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ferry-bench --scheme on one machine, small: one command starts every rank
# (exec'd, driven over pipes); every byte of every transfer is checked
# (--check-consistency) and every CSV row must say so. A failed transfer or a
# data mismatch makes ferry-bench exit 1, and so this script.
#   usage: schemes.sh BENCH_BINARY pairwise|manytoone|onetomany|tp
#          schemes.sh BENCH_BINARY errors   (bad combinations; a failing backend,
#                                            FERRY_PLUGIN_PATH must hold libferry-fault.so)
set -euo pipefail
bench=$1
scheme=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
sizes=(--backend tcp --start-block-size 4KiB --max-block-size 1MiB --block-multiplier 4
       --max-batch-size 2 --num-iter 4 --warmup-iter 1 --large-block-iter-factor 2
       --check-consistency --no-progress)

# run NAME EXPECTED_INITIATORS EXPECTED_TARGETS ARGS...: rc 0, 10 rows (5 blocks x 2 batches),
# each verified, with the shape asked for and some bandwidth.
run() {
  local name=$1 ni=$2 nt=$3
  shift 3
  echo "== ferry-bench $* (${sizes[*]})"
  if ! "$bench" "$@" "${sizes[@]}" --csv "$dir/$name.csv" >"$dir/$name.out" 2>"$dir/$name.err"; then
    cat "$dir/$name.out" "$dir/$name.err"
    echo "FAIL: $name exited non-zero"
    exit 1
  fi
  cat "$dir/$name.out"
  local rows
  rows=$(tail -n +2 "$dir/$name.csv" | wc -l)
  [ "$rows" -eq 10 ] || { echo "FAIL: $name: expected 10 rows, got $rows"; exit 1; }
  awk -F, -v s="$scheme" -v ni="$ni" -v nt="$nt" '
    NR==1 { for (i = 1; i <= NF; i++) col[$i] = i; n = NF; next }
    NF != n || $col["scheme"] != s || $col["initiators"] != ni || $col["targets"] != nt ||
    $col["verified"] != 1 || $col["bw_gbs"] <= 0 || $col["initiator_min_gbs"] <= 0 {
      print "FAIL: bad row: " $0; bad = 1 }
    END { exit bad }' "$dir/$name.csv"
  grep -q "DATA MISMATCH" "$dir/$name.err" && { cat "$dir/$name.err"; echo "FAIL: mismatch"; exit 1; }
  return 0
}

case $scheme in
  pairwise)
    run write 4 4 --scheme pairwise --num-initiators 4 --op WRITE
    run read 4 4 --num-initiators 4 --op READ --strided
    ;;
  manytoone)
    run write 4 1 --scheme manytoone --num-initiators 4 --op WRITE
    run read 4 1 --scheme manytoone --num-initiators 4 --op READ --strided
    ;;
  onetomany)
    run write 1 4 --scheme onetomany --num-targets 4 --op WRITE
    run read 1 4 --scheme onetomany --num-targets 4 --op READ --strided
    ;;
  tp)
    run one_target 4 1 --scheme tp --num-initiators 4
    grep -q "op=WRITE+READ" "$dir/one_target.out" || { echo "FAIL: tp is not WRITE+READ"; exit 1; }
    run two_targets 4 2 --scheme tp --num-initiators 4 --num-targets 2 --strided
    ;;
  errors)
    # Bad combinations: usage errors (exit 2) that say what is wrong.
    bad() {  # bad "EXPECTED TEXT" ARGS...
      local want=$1 rc=0
      shift
      "$bench" "$@" >"$dir/bad.out" 2>"$dir/bad.err" || rc=$?
      [ "$rc" -eq 2 ] || { cat "$dir/bad.err"; echo "FAIL: '$*' exited $rc, not 2"; exit 1; }
      grep -qF -- "$want" "$dir/bad.err" || { cat "$dir/bad.err"; echo "FAIL: '$*' lacks '$want'"; exit 1; }
      echo "refused as it should: $* -> $(head -1 "$dir/bad.err")"
    }
    bad "--scheme tp needs --num-initiators 2 or more" --scheme tp
    bad "--scheme tp needs --num-initiators 2 or more" --scheme tp --num-initiators 1
    bad "--num-targets must divide" --scheme tp --num-initiators 4 --num-targets 3
    bad "--op READ does not apply" --scheme tp --num-initiators 2 --op READ
    bad "--scheme manytoone needs --num-initiators 2" --scheme manytoone
    bad "--scheme manytoone has one target" --scheme manytoone --num-initiators 2 --num-targets 2
    bad "--scheme onetomany needs --num-targets 2" --scheme onetomany
    bad "--scheme onetomany has one initiator" --scheme onetomany --num-initiators 2 --num-targets 2
    bad "--num-targets must equal --num-initiators" --num-initiators 2 --num-targets 3
    bad "not with --rank" --num-initiators 2 --rank 0 --peer 127.0.0.1:1
    bad "leave --num-threads and --queue-depth at 1" --scheme manytoone --num-initiators 2 --num-threads 2
    bad "ring not in {pairwise,manytoone,onetomany,tp}" --scheme ring
    # Every transfer fails (the test-only fault backend, no other): the run
    # must stop with exit 1 and name the failure, every rank ended.
    rc=0
    "$bench" --scheme manytoone --num-initiators 2 --backend fault \
      --backend-settings 'fault={"mode":"fail_complete"}' --start-block-size 4KiB \
      --max-block-size 4KiB --num-iter 2 --warmup-iter 1 --check-consistency --no-progress \
      >"$dir/fail.out" 2>"$dir/fail.err" || rc=$?
    cat "$dir/fail.err"
    [ "$rc" -eq 1 ] || { echo "FAIL: failing transfers gave exit $rc, not 1"; exit 1; }
    grep -q "transfer to target 0 failed" "$dir/fail.err" || { echo "FAIL: no failure named"; exit 1; }
    ;;
  *)
    echo "unknown scheme $scheme"
    exit 2
    ;;
esac
echo "ferry-bench --scheme $scheme: OK"
