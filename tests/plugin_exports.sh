#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# plugin_exports.sh PLUGIN_DIR: every plugin built for installation exports
# exactly one dynamic symbol, ferry_plugin_v1 (plugins/common/exports.map), so
# no plugin interposes libstdc++ or another plugin's inline code.
set -u -o pipefail
dir=${1:?usage: plugin_exports.sh PLUGIN_DIR}
command -v nm >/dev/null || { echo "FAIL: nm (binutils) is not installed"; exit 1; }
shopt -s nullglob
plugins=("$dir"/libferry-*.so)
[[ ${#plugins[@]} -gt 0 ]] || { echo "FAIL: no plugins in $dir"; exit 1; }
failures=0
for so in "${plugins[@]}"; do
  exports=$(nm -D --defined-only "$so" | awk 'NF == 3 {print $3}' | sort | tr '\n' ' ')
  if [[ "$exports" == "ferry_plugin_v1 " ]]; then
    echo "ok: $(basename "$so") exports only ferry_plugin_v1"
  else
    echo "FAIL: $(basename "$so") exports: ${exports:0:300}"
    failures=$((failures + 1))
  fi
done
[[ $failures -eq 0 ]] && echo "plugin_exports: PASSED" && exit 0
echo "plugin_exports: FAILED ($failures plugin(s))"
exit 1
