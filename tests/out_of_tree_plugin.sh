#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# out_of_tree_plugin.sh BUILD_DIR SOURCE_DIR
# out_of_tree_plugin.sh --prefix PREFIX SOURCE_DIR
#
# What a third party does with ferry, checked end to end:
#   1. install ferry from BUILD_DIR into a fresh prefix (cmake --install), or,
#      with --prefix, take a tree installed already (tests/deb_package.sh passes
#      the unpacked .deb) and build the example from the copy installed in it
#      (PREFIX/share/ferry/plugin-template), and run its ctest (ferry-plugin-check);
#   2. check the installed tree has the header, library, tcp plugin, CMake
#      package and pkg-config file;
#   3. copy examples/plugin-cma out of the source tree and build it against the
#      prefix alone (CMAKE_PREFIX_PATH), checking the compiler saw the prefix's
#      include dir and nothing of the source tree;
#   4. run <prefix>/bin/ferry info with FERRY_PLUGIN_PATH at that build and
#      expect "cma loaded" (and the installed tcp plugin loaded);
#   5. compile a small C++ program with `pkg-config --cflags --libs ferry` that
#      creates an Engine and prints its port, and run it.
# Exits 0 when every check passed, 1 otherwise, 2 on bad usage.
# KEEP_TMP=1 keeps the temporary folder for inspection.
set -u -o pipefail

GIVEN_PREFIX=""
if [[ "${1:-}" == --prefix ]]; then
  GIVEN_PREFIX=$(cd "${2:-}" 2>/dev/null && pwd) || { echo "FAIL: prefix '${2:-}' does not exist" >&2; exit 1; }
  shift 2
fi
if [[ $# -ne 2 && -z "$GIVEN_PREFIX" ]] || [[ $# -ne 1 && -n "$GIVEN_PREFIX" ]]; then
  echo "usage: $0 BUILD_DIR SOURCE_DIR | $0 --prefix PREFIX SOURCE_DIR" >&2
  exit 2
fi
if [[ -z "$GIVEN_PREFIX" ]]; then
  BUILD_DIR=$(cd "$1" 2>/dev/null && pwd) || { echo "FAIL: build dir '$1' does not exist" >&2; exit 1; }
  shift
fi
SOURCE_DIR=$(cd "$1" 2>/dev/null && pwd) || { echo "FAIL: source dir '$1' does not exist" >&2; exit 1; }
EXAMPLE="$SOURCE_DIR/examples/plugin-cma"
[[ -n "$GIVEN_PREFIX" ]] && EXAMPLE="$GIVEN_PREFIX/share/ferry/plugin-template"

TMP=$(mktemp -d "${TMPDIR:-/tmp}/ferry-oot.XXXXXX") || { echo "FAIL: mktemp" >&2; exit 1; }
# shellcheck disable=SC2317  # called through trap
cleanup() {
  if [[ "${KEEP_TMP:-0}" == 1 ]]; then
    echo "(kept $TMP)"
  else
    rm -rf "$TMP"
  fi
}
trap cleanup EXIT
PREFIX=${GIVEN_PREFIX:-$TMP/prefix}
LOGS="$TMP/logs"
mkdir -p "$LOGS"

failures=0
step() { echo "== $*"; }
ok() { echo "   ok: $*"; }
warn() { echo "   WARNING: $*"; }
fail() {
  echo "   FAIL: $*"
  failures=$((failures + 1))
}
# Show the end of a log after a failed command.
show() { sed 's/^/      | /' "$1" | tail -n 30; }
# Stop here: later steps cannot run without this one.
die() {
  fail "$*"
  echo "out_of_tree_plugin: FAILED ($failures check(s)); stopped early"
  exit 1
}
# Run a command quietly; on failure print its log. run LOGNAME CMD...
run() {
  local log="$LOGS/$1.log"
  shift
  if "$@" >"$log" 2>&1; then return 0; fi
  show "$log"
  return 1
}

# Nothing from the caller's environment may point CMake or the compiler at
# another ferry than the one installed below.
unset CMAKE_PREFIX_PATH CPATH CPLUS_INCLUDE_PATH C_INCLUDE_PATH LIBRARY_PATH \
  PKG_CONFIG_PATH FERRY_PLUGIN_PATH FERRY_POLICY

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)

# ---- 1. install ------------------------------------------------------------------
if [[ -n "$GIVEN_PREFIX" ]]; then
  step "use the tree installed at $PREFIX"
else
  step "install ferry from $BUILD_DIR into a fresh prefix"
  [[ -f "$BUILD_DIR/CMakeCache.txt" ]] || die "$BUILD_DIR is not a configured CMake build tree"
  run install cmake --install "$BUILD_DIR" --prefix "$PREFIX" || die "cmake --install failed (was the project built?)"
  ok "installed into $PREFIX"
fi

# ---- 2. the installed tree ---------------------------------------------------------
step "check the installed tree"
for f in include/ferry/plugin.h include/ferry/ferry.hpp lib/ferry/plugins/libferry-tcp.so \
  lib/cmake/ferry/ferryConfig.cmake lib/pkgconfig/ferry.pc lib/pkgconfig/ferry-plugin.pc \
  share/ferry/plugin-template/CMakeLists.txt; do
  if [[ -f "$PREFIX/$f" ]]; then ok "$f"; else fail "missing $f"; fi
done
shopt -s nullglob
libs=("$PREFIX"/lib/libferry.so*)
shopt -u nullglob
if [[ ${#libs[@]} -gt 0 && -e "$PREFIX/lib/libferry.so" ]]; then
  ok "lib/libferry.so* (${#libs[@]} entries)"
else
  fail "missing lib/libferry.so (found: ${libs[*]:-nothing})"
fi
[[ -x "$PREFIX/bin/ferry" ]] || die "missing bin/ferry"

# ---- 3. build the example plugin against the prefix ----------------------------------
build_plugin() {
  step "build examples/plugin-cma out of tree against the prefix"
  [[ -f "$EXAMPLE/CMakeLists.txt" ]] || { fail "no $EXAMPLE/CMakeLists.txt"; return 1; }
  # Build a copy: a folder a stranger copied must not reach back into the source tree.
  mkdir -p "$TMP/src"
  cp -R "$EXAMPLE" "$TMP/src/plugin-cma" || { fail "cannot copy $EXAMPLE"; return 1; }
  run configure cmake -S "$TMP/src/plugin-cma" -B "$TMP/build" "${generator[@]}" \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_EXPORT_COMPILE_COMMANDS=ON \
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF || {
    fail "configuring the plugin against $PREFIX failed (does the package export ferry::plugin_abi?)"
    return 1
  }
  found_dir=$(sed -n 's/^ferry_DIR:PATH=//p' "$TMP/build/CMakeCache.txt")
  if [[ "$found_dir" == "$PREFIX/lib/cmake/ferry" ]]; then
    ok "find_package(ferry) used $found_dir"
  else
    fail "find_package(ferry) used '$found_dir', not the fresh prefix"
  fi
  run build cmake --build "$TMP/build" || { fail "building the plugin failed"; return 1; }
  SO="$TMP/build/libferry-cma.so"
  [[ -f "$SO" ]] || { fail "the build produced no libferry-cma.so"; return 1; }
  ok "built $SO"
  # The template's own test: the installed ferry-plugin-check on the new .so.
  if run template-ctest ctest --test-dir "$TMP/build" --no-tests=error -V --timeout 300; then
    ok "the template's ctest ran ferry-plugin-check on it: $(grep -cE '^([0-9]+: )?PASS  ' "$LOGS/template-ctest.log") rules passed"
  else
    fail "the template's ctest (ferry-plugin-check on $SO) failed"
  fi

  cc_json="$TMP/build/compile_commands.json"
  if [[ ! -f "$cc_json" ]]; then
    fail "no compile_commands.json to check the include paths"
  else
    if grep -q -- "$PREFIX/include" "$cc_json"; then
      ok "the compiler was given $PREFIX/include"
    else
      fail "the compile command does not use $PREFIX/include"
    fi
    if grep -qF -e "core/include" -e "-I${SOURCE_DIR}/" -e "-isystem ${SOURCE_DIR}/" "$cc_json"; then
      fail "the compile command reaches into the source tree:"
      grep -F -e "core/include" -e "${SOURCE_DIR}/" "$cc_json" | sed 's/^/      | /'
    else
      ok "no include path into $SOURCE_DIR"
    fi
  fi
  if command -v nm >/dev/null 2>&1; then
    exports=$(nm -D --defined-only "$SO" | awk '{print $3}' | grep -v '^$' | sort | tr '\n' ' ')
    if [[ "$exports" == "ferry_plugin_v1 " ]]; then
      ok "exports only ferry_plugin_v1"
    else
      fail "exports more than the entry symbol: $exports"
    fi
  fi
}

# ---- 4. ferry info -----------------------------------------------------------------------
check_info() {
  step "ferry info with FERRY_PLUGIN_PATH=$TMP/build"
  info="$LOGS/info.log"
  if ! FERRY_PLUGIN_PATH="$TMP/build" "$PREFIX/bin/ferry" info >"$info" 2>&1; then
    if grep -q "error while loading shared libraries" "$info"; then
      warn "the installed bin/ferry does not find libferry.so on its own (no RPATH);"
      warn "retrying with LD_LIBRARY_PATH=$PREFIX/lib"
      FERRY_PLUGIN_PATH="$TMP/build" LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/ferry" info >"$info" 2>&1 ||
        { show "$info"; fail "ferry info failed"; return 1; }
    else
      show "$info"
      fail "ferry info failed"
      return 1
    fi
  fi
  sed 's/^/      | /' "$info"
  if grep -Eq "^[[:space:]]*cma[[:space:]]+loaded" "$info" && grep -q "$SO" "$info"; then
    ok "cma loaded from the out-of-tree build"
  else
    fail "ferry info does not show cma loaded from $SO"
  fi
  # The path may read <prefix>/bin/../lib/... (found relative to libferry.so).
  if grep -Eq "^[[:space:]]*tcp[[:space:]]+loaded" "$info" &&
    grep -Eq "^[[:space:]]*$PREFIX/(.*/)?lib/ferry/plugins/libferry-tcp.so" "$info"; then
    ok "tcp loaded from the prefix's own plugin folder"
  else
    fail "ferry info does not show the installed tcp plugin loaded"
  fi
}

# The installed ferry-plugin-check finds a plugin by name where the installed
# core looks (<prefix>/lib/ferry/plugins), not in the build it was made from.
check_by_name() {
  step "ferry-plugin-check by name finds the prefix's tcp"
  local log="$LOGS/check-by-name.log"
  env -u FERRY_PLUGIN_PATH "$PREFIX/bin/ferry-plugin-check" --quick tcp >"$log" 2>&1
  local first
  first=$(head -1 "$log")
  if [[ "$first" =~ ^ferry-plugin-check:\ $PREFIX/(.*/)?lib/ferry/plugins/libferry-tcp.so ]]; then
    ok "$first"
  else
    show "$log"
    fail "the installed ferry-plugin-check did not take tcp from $PREFIX"
  fi
}

if build_plugin; then
  check_info
  check_by_name
else
  echo "   (skipping ferry info: the plugin did not build)"
fi

# ---- 5. a C++ program through pkg-config --------------------------------------------------
step "build and run a C++ program with pkg-config --cflags --libs ferry"
if ! command -v pkg-config >/dev/null 2>&1; then
  fail "pkg-config is not installed"
else
  export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig"
  pc=(pkg-config)
  pc_prefix=$(pkg-config --variable=prefix ferry 2>"$LOGS/pc.log") || { show "$LOGS/pc.log"; pc_prefix="?"; }
  # Either written out, or relative to the .pc file (${pcfiledir}/../..).
  if [[ "$(realpath -m -- "$pc_prefix")" == "$(realpath -- "$PREFIX")" ]]; then
    ok "ferry.pc points at the prefix it was installed into"
  else
    fail "ferry.pc says prefix=$pc_prefix, not $PREFIX: it was fixed at configure time" \
      "(CMAKE_INSTALL_PREFIX), so 'cmake --install --prefix' yields a wrong .pc"
    warn "continuing with --define-variable=prefix=$PREFIX to check the rest"
    pc=(pkg-config "--define-variable=prefix=$PREFIX")
  fi
  flags=$("${pc[@]}" --cflags --libs ferry 2>"$LOGS/pc.log") || { show "$LOGS/pc.log"; flags=""; }
  echo "      | pkg-config: $flags"
  cat >"$TMP/engine_port.cpp" <<'EOF'
#include <cstdio>
#include <ferry/ferry.hpp>

int main() {
  ferry::Engine engine("out-of-tree-check");
  unsigned port = engine.desc().port;
  std::printf("engine %s listens on port %u\n", engine.key().c_str(), port);
  return port != 0 ? 0 : 1;
}
EOF
  # shellcheck disable=SC2086  # flags is a list of words
  # Exactly what a user types: no -std, no LD_LIBRARY_PATH (the .pc carries both).
  if run cxx "${CXX:-c++}" "$TMP/engine_port.cpp" -o "$TMP/engine_port" $flags; then
    ok "compiled with nothing but the pkg-config flags"
    if env -u LD_LIBRARY_PATH "$TMP/engine_port" >"$LOGS/run.log" 2>&1; then
      ok "$(cat "$LOGS/run.log") (found libferry.so without LD_LIBRARY_PATH)"
    else
      show "$LOGS/run.log"
      fail "the program failed"
    fi
  else
    fail "compiling with pkg-config flags alone failed"
  fi
  # The same program through find_package(ferry): ferry::ferry brings C++20 along.
  mkdir -p "$TMP/cmake-app"
  cp "$TMP/engine_port.cpp" "$TMP/cmake-app/"
  cat >"$TMP/cmake-app/CMakeLists.txt" <<'EOF2'
cmake_minimum_required(VERSION 3.22)
project(engine_port CXX)
find_package(ferry REQUIRED)
add_executable(engine_port engine_port.cpp)
target_link_libraries(engine_port PRIVATE ferry::ferry)
EOF2
  if run app-configure cmake -S "$TMP/cmake-app" -B "$TMP/cmake-app/build" "${generator[@]}" \
    -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF &&
    run app-build cmake --build "$TMP/cmake-app/build" &&
    env -u LD_LIBRARY_PATH "$TMP/cmake-app/build/engine_port" >"$LOGS/app.log" 2>&1; then
    ok "find_package(ferry) + ferry::ferry: built without setting a C++ standard, and ran"
  else
    show "$LOGS/app.log" 2>/dev/null
    fail "a CMake program linking ferry::ferry did not build or run"
  fi
  # A C plugin compiles against the ABI header alone (ferry-plugin.pc).
  printf '#include <ferry/plugin.h>\nint main(void) { return FERRY_PLUGIN_ABI_MAJOR == 1 ? 0 : 1; }\n' \
    >"$TMP/abi_only.c"
  cflags=$("${pc[@]}" --cflags ferry-plugin 2>"$LOGS/pc-plugin.log") || { show "$LOGS/pc-plugin.log"; cflags=""; }
  # shellcheck disable=SC2086
  if [[ -n "$cflags" ]] && run cc "${CC:-cc}" -std=c99 -Werror $cflags "$TMP/abi_only.c" -o "$TMP/abi_only" &&
    "$TMP/abi_only"; then
    ok "a C99 file compiled against ferry-plugin.pc ($cflags)"
  else
    fail "pkg-config --cflags ferry-plugin does not give a C99 compile of ferry/plugin.h"
  fi
fi

if [[ $failures -eq 0 ]]; then
  echo "out_of_tree_plugin: PASSED"
  exit 0
fi
echo "out_of_tree_plugin: FAILED ($failures check(s))"
exit 1
