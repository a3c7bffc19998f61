#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Removes what killed processes left in /dev/shm: libfabric shm regions
# ("<pid>:<n>:<n>", 16 MiB each) and ofi plugin doorbells ("ferry-ofi-<pid>-<token>")
# whose process no longer exists. engine_process_test kills its target with
# SIGKILL on purpose, and nothing else gets to unlink them. Only names with the
# pid of a dead process are touched.
shopt -s nullglob
removed=0
for f in /dev/shm/*; do
  name=${f#/dev/shm/}
  if [[ $name =~ ^([0-9]+):[0-9]+:[0-9]+$ ]] || [[ $name =~ ^ferry-ofi-([0-9]+)-[0-9a-f]{16}$ ]]; then
    pid=${BASH_REMATCH[1]}
    if [[ ! -d /proc/$pid ]]; then
      rm -f -- "$f" && removed=$((removed + 1))
    fi
  fi
done
echo "shm_cleanup: removed $removed stale /dev/shm entries"
