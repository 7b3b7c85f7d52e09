#!/usr/bin/env bash
# At most 8 files come back from a lent GPU's $OUT: run a command with OUT=$OUT/packed (what it writes there), within
# SECONDS, then pack that folder into $OUT/packed.tgz (plus its *.txt beside it, to read at once). Cut short from outside,
# the folder itself comes back (its first 8 files).
#   bash scripts/device/packed.sh 540 bash -c 'LIMIT=200 bash scripts/device/engine.sh profile; LIMIT=300 bash scripts/device/engine.sh prefill'
set -uo pipefail
limit=${1:?usage: packed.sh SECONDS COMMAND...}
shift
top=${OUT:?packed.sh: OUT is not set (the folder of results on the lent GPU)}
export OUT=$top/packed
mkdir -p "$OUT"
timeout "$limit" "$@"
rc=$?
tar czf "$top/packed.tgz" -C "$top" packed && cp "$OUT"/*.txt "$top"/ 2>/dev/null
rm -rf "$OUT"
echo "packed.sh: rc=$rc, $(tar tzf "$top/packed.tgz" | wc -l) entries in packed.tgz"
exit $rc
