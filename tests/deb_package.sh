#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# deb_package.sh BUILD_DIR SOURCE_DIR
#
# The Debian package a user installs, checked without installing it:
#   1. cpack -G DEB in BUILD_DIR writes ferry_<version>_amd64.deb;
#   2. its file list holds the library, every plugin built here, the headers,
#      the CMake package, the pkg-config file, ferry, ferry-bench, the Python
#      package and the example plugin's sources;
#   3. dpkg -x unpacks it into a temporary root, and tests/out_of_tree_plugin.sh
#      --prefix ROOT/usr builds the example plugin from the package's own copy
#      against that tree alone and loads it with the unpacked `ferry info`;
#   4. the unpacked ferry-bench and Python package run from the tree.
# Exits 0 when every check passed, 1 otherwise. KEEP_TMP=1 keeps the folder.
set -u -o pipefail
[[ $# -eq 2 ]] || { echo "usage: $0 BUILD_DIR SOURCE_DIR" >&2; exit 2; }
BUILD_DIR=$(cd "$1" && pwd) || exit 1
SOURCE_DIR=$(cd "$2" && pwd) || exit 1
command -v dpkg-deb >/dev/null || { echo "FAIL: dpkg-deb is not installed" >&2; exit 1; }

TMP=$(mktemp -d "${TMPDIR:-/tmp}/ferry-deb.XXXXXX") || exit 1
# shellcheck disable=SC2317  # called through trap
cleanup() { if [[ "${KEEP_TMP:-0}" == 1 ]]; then echo "(kept $TMP)"; else rm -rf "$TMP"; fi; }
trap cleanup EXIT
failures=0
ok() { echo "   ok: $*"; }
fail() { echo "   FAIL: $*"; failures=$((failures + 1)); }

echo "== cpack -G DEB"
version=$(sed -n 's/^CMAKE_PROJECT_VERSION:STATIC=//p' "$BUILD_DIR/CMakeCache.txt")
arch=$(dpkg --print-architecture)
if ! cpack -G DEB --config "$BUILD_DIR/CPackConfig.cmake" -B "$TMP/out" >"$TMP/cpack.log" 2>&1; then
  tail -n 30 "$TMP/cpack.log"; echo "deb_package: FAILED (cpack)"; exit 1
fi
deb="$TMP/out/ferry_${version}_${arch}.deb"
[[ -f "$deb" ]] || { ls "$TMP/out"; echo "deb_package: FAILED (no $(basename "$deb"))"; exit 1; }
ok "$(basename "$deb") ($(du -k "$deb" | cut -f1) KiB)"
dpkg-deb -f "$deb" Package Version Architecture Depends Recommends | sed 's/^/      | /'

echo "== the package's files"
# perms owner size date time NAME [-> TARGET]: the sixth field is the path.
dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|' >"$TMP/files"
want=(/usr/lib/libferry.so /usr/include/ferry/plugin.h /usr/include/ferry/ferry.hpp
  /usr/lib/cmake/ferry/ferryConfig.cmake /usr/lib/pkgconfig/ferry.pc /usr/bin/ferry
  /usr/bin/ferry-bench /usr/lib/python3/dist-packages/ferry/__init__.py
  /usr/lib/python3/dist-packages/mori/io/engine.py /usr/lib/python3/dist-packages/mori/cpp/_types.py
  /usr/lib/python3/dist-packages/nixl/_api.py /usr/lib/python3/dist-packages/nixl/_bindings.py
  /usr/share/ferry/plugin-template/cma_plugin.c)
shopt -s nullglob
for so in "$BUILD_DIR"/lib/ferry/plugins/libferry-*.so; do
  want+=("/usr/lib/ferry/plugins/$(basename "$so")")
done
for so in "$BUILD_DIR"/python/ferry/_ferry*.so; do
  want+=("/usr/lib/python3/dist-packages/ferry/$(basename "$so")")
done
shopt -u nullglob
for f in "${want[@]}"; do
  if grep -qxF "$f" "$TMP/files"; then ok "$f"; else fail "the package lacks $f"; fi
done

echo "== dpkg -x into $TMP/root"
dpkg -x "$deb" "$TMP/root" || { echo "deb_package: FAILED (dpkg -x)"; exit 1; }
ROOT=$TMP/root/usr
if bash "$SOURCE_DIR/tests/out_of_tree_plugin.sh" --prefix "$ROOT" "$SOURCE_DIR"; then
  ok "the example plugin builds and loads against the unpacked package alone"
else
  fail "out_of_tree_plugin.sh against the unpacked package"
fi

echo "== the unpacked binaries and Python package"
"$ROOT/bin/ferry-bench" --help >"$TMP/bench.log" 2>&1  # prints its usage (exit 0)
if grep -q "^usage: ferry-bench" "$TMP/bench.log"; then
  ok "ferry-bench --help runs from the tree (finds libferry.so by its RPATH)"
else
  sed 's/^/      | /' "$TMP/bench.log" | tail -n 20; fail "ferry-bench --help"
fi
if [[ -e "$ROOT/lib/python3/dist-packages/ferry/__init__.py" ]]; then
  # No FERRY_PLUGIN_PATH: the installed module finds <libdir>/ferry/plugins itself.
  if env -u FERRY_PLUGIN_PATH PYTHONPATH="$ROOT/lib/python3/dist-packages" /usr/bin/python3 -c '
import ferry, sys
loaded = [p["name"] for p in ferry.list_plugins() if p["loaded"]]
print("      | plugins loaded:", loaded, "from", ferry.__file__)
sys.exit(0 if "tcp" in loaded and ferry.__file__.startswith(sys.argv[1]) else 1)' "$ROOT" >"$TMP/py.log" 2>&1; then
    cat "$TMP/py.log"; ok "import ferry from the tree lists the packaged tcp plugin"
  else
    sed 's/^/      | /' "$TMP/py.log" | tail -n 20; fail "import ferry from the unpacked package"
  fi
  # The drop-in packages from the tree: a WRITE through mori.io and one through nixl.
  if env -u FERRY_PLUGIN_PATH PYTHONPATH="$ROOT/lib/python3/dist-packages" /usr/bin/python3 -c '
import ctypes, sys
import mori.io as m
from nixl._api import nixl_agent
assert m.__file__.startswith(sys.argv[1]), m.__file__
a, b = (m.IOEngine(k, m.IOEngineConfig("127.0.0.1", 0)) for k in ("deb-a", "deb-b"))
for e in (a, b):
    e.create_backend(m.BackendType.TCP)
src, dst = ctypes.create_string_buffer(b"ferry" * 8), ctypes.create_string_buffer(40)
ls = a.register_memory(ctypes.addressof(src), 40, -1, m.MemoryLocationType.CPU)
rd = m.MemoryDesc.unpack(b.register_memory(ctypes.addressof(dst), 40, -1,
                                           m.MemoryLocationType.CPU).pack())
a.register_remote_engine(m.EngineDesc.unpack(b.get_engine_desc().pack()))
assert a.write(ls, 0, rd, 0, 40, 1).WaitFor(-1) == m.StatusCode.SUCCESS and dst.raw == src.raw[:40]
x, y = nixl_agent("deb-x"), nixl_agent("deb-y")
dst2 = ctypes.create_string_buffer(40)
x.register_memory([(ctypes.addressof(src), 40, 0, "")], "DRAM")
y.register_memory([(ctypes.addressof(dst2), 40, 0, "")], "DRAM")
name = x.add_remote_agent(y.get_agent_metadata())
h = x.initialize_xfer("WRITE", x.get_xfer_descs([(ctypes.addressof(src), 40, 0)], "DRAM"),
                      x.get_xfer_descs([(ctypes.addressof(dst2), 40, 0)], "DRAM"), name, b"done")
x.transfer(h)
while x.check_xfer_state(h) != "DONE":
    pass
assert dst2.raw == src.raw[:40]
print("      | mori.io and nixl WRITEs landed, from", m.__file__.rsplit("/", 2)[0])' "$ROOT" >"$TMP/dropin.log" 2>&1; then
    cat "$TMP/dropin.log"; ok "mori.io and nixl from the tree move bytes over the packaged tcp"
  else
    sed 's/^/      | /' "$TMP/dropin.log" | tail -n 20; fail "mori.io / nixl from the unpacked package"
  fi
fi

if [[ $failures -eq 0 ]]; then echo "deb_package: PASSED"; exit 0; fi
echo "deb_package: FAILED ($failures check(s))"
exit 1
