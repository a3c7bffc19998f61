#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# plugin_check_abi11.sh CHECK PLUGIN: a plugin built against the frozen plugin.h
# 1.1 (tests/plugins/abi-1.1; the cma template under the name cma11) keeps
# loading and working with this core. ferry-plugin-check runs the whole contract
# on it; every rule must pass but one: a 1.1 plugin cannot declare
# FERRY_CAP_NO_TARGET_CHECK (1.2), so the check expects cma's target side to
# refuse a WRITE into deregistered memory, which it cannot. That FAIL, and only
# that one, is the right verdict for this plugin.
set -u -o pipefail
check=${1:?usage: plugin_check_abi11.sh CHECK PLUGIN}
plugin=${2:?usage: plugin_check_abi11.sh CHECK PLUGIN}
out=$("$check" "$plugin" 2>/dev/null)
rc=$?
echo "$out"
bad=0
expect() { # expect DESCRIPTION COMMAND...
  if "${@:2}"; then echo "ok: $1"; else echo "NOT OK: $1"; bad=1; fi
}
expect "the check exits 1 (one rule failed)" test "$rc" -eq 1
expect "it saw ABI 1.1" grep -qE '^PASS  abi: abi_minor +1\.1 ' <<<"$out"
expect "all 12 data rules passed" test "$(grep -cE '^PASS  data: ' <<<"$out")" -eq 12
expect "notify and message exactly once" test "$(grep -cE '^PASS  notify: ' <<<"$out")" -eq 2
expect "the one FAIL is the revocation rule" \
  test "$(grep -E '^FAIL  ' <<<"$out" | grep -v 'rule(s) failed')" = \
  "$(grep -E '^FAIL  target: deregistered region not written' <<<"$out")"
expect "exactly one FAIL" test "$(grep -cE '^FAIL  [a-z]' <<<"$out")" -eq 1
[ "$bad" -eq 0 ] && echo "plugin_check_abi11: PASSED" || echo "plugin_check_abi11: FAILED"
exit "$bad"
