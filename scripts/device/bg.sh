#!/usr/bin/env bash
# One long command on a lent GPU host across calls of at most 10 minutes each: the first call starts it in the
# background (setsid) in a copy of the checkout, /tmp/bg/NAME/tree (the host re-copies the checkout at every call), and
# every call waits for it up to SECONDS, then copies its log, its exit status and what it wrote under $BG (the folder
# /tmp/bg/NAME/out, exported to the command) to $OUT. The machine keeps /tmp and the process only while calls follow
# each other (it goes back after 30 s idle), so call again right after each answer until rc.txt comes back.
#   bash scripts/device/run.sh bash scripts/device/bg.sh decode 560 python3 bench/bench_decode.py --out '$BG/bench_decode_h200.json'
#   bash scripts/device/run.sh bash scripts/device/bg.sh decode 560     # later calls: wait and collect (a command is ignored once started)
# The command is run by bash in the copy, with PYTHONPATH and the rest of run.sh's environment; '$BG' in it is the
# output folder (quote it so that it reaches the host unexpanded). At most 8 files come back from $OUT: keep the
# command's outputs few (the log, rc.txt and status.txt take three).
set -uo pipefail
name=${1:?usage: bg.sh NAME SECONDS [command ...]}
limit=${2:?usage: bg.sh NAME SECONDS [command ...]}
shift 2
[[ $name =~ ^[A-Za-z0-9_-]+$ ]] || { echo "bg.sh: NAME '$name' is not letters, digits, _ and -" >&2; exit 2; }
[[ $limit =~ ^[0-9]+$ ]] || { echo "bg.sh: SECONDS '$limit' is not a whole number" >&2; exit 2; }
t0=$(date +%s)
D=/tmp/bg/$name
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
if [ ! -f "$D/started" ]; then
  [ $# -gt 0 ] || { echo "bg.sh: '$name' has not started here (a fresh machine?): give its command" >&2; exit 2; }
  rm -rf "$D" && mkdir -p "$D/out" "$D/tree"
  tar --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./.whl-rx --exclude=./.devmodel-a --exclude=./.devmodel-b \
    -cf - . | tar -xf - -C "$D/tree"
  printf '%s\n' "$*" > "$D/command"
  date -u +%FT%TZ > "$D/started"
  (cd "$D/tree" && BG="$D/out" setsid nohup bash -c "export BG='$D/out'; $*; echo \$? > '$D/rc'" > "$D/log" 2>&1 < /dev/null &)
fi
while [ ! -f "$D/rc" ] && [ $(( $(date +%s) - t0 )) -lt $(( limit - 10 )) ]; do sleep 5; done
{
  echo "command: $(cat "$D/command")"
  echo "started: $(cat "$D/started"), now $(date -u +%FT%TZ)"
  if [ -f "$D/rc" ]; then echo "finished: rc $(cat "$D/rc")"; else echo "still running"; fi
} > "$OUT/status.txt"
cp "$D/log" "$OUT/log.txt" 2>/dev/null
[ -f "$D/rc" ] && cp "$D/rc" "$OUT/rc.txt"
cp -r "$D/out/." "$OUT/" 2>/dev/null
cat "$OUT/status.txt"
tail -n 20 "$D/log"
