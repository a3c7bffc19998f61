#!/usr/bin/env bash
# The README's two commands. On a fresh Debian 12 machine, as root:
#   scripts/run.sh bench   install what is missing, build, run the transfer benchmark
#   scripts/run.sh test    install what is missing, build, run every test
#                          (plain build, then core+tcp again under ASan/UBSan)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-bench}
jobs=${FERRY_JOBS:-$(nproc)}

# Debian packages only (no PyPI); installed only when missing.
pkgs=(build-essential cmake ninja-build pkg-config libyaml-cpp-dev nlohmann-json3-dev
      libgtest-dev libgmock-dev libbenchmark-dev libssl-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

build() {  # build DIR [cmake args...]
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
}

case "$mode" in
  bench)
    build build -DCMAKE_BUILD_TYPE=RelWithDebInfo
    ./build/bin/ferry info
    ./build/bin/ferry-bench --backend tcp --op WRITE --start-block-size 4KiB \
      --max-block-size 64MiB --check-consistency
    ./build/bin/ferry-bench --backend tcp --op READ --start-block-size 4KiB \
      --max-block-size 64MiB --check-consistency
    ;;
  test)
    build build -DCMAKE_BUILD_TYPE=RelWithDebInfo
    (cd build && ctest --output-on-failure --timeout 900)
    echo "== core + tcp tests again under AddressSanitizer + UBSan"
    build build-asan -DCMAKE_BUILD_TYPE=Debug -DFERRY_SANITIZE=ON -DFERRY_BUILD_BENCH=OFF
    (cd build-asan && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      ctest --output-on-failure --timeout 900 -L 'core|tcp')
    ;;
  *)
    echo "usage: $0 bench|test" >&2
    exit 2
    ;;
esac
