#!/usr/bin/env bash
# The pipeline on a lent GPU host, in slices: each call may run at most 10 minutes, and the machine stays warm
# (its /tmp and its background processes kept) only while calls follow each other. The run therefore goes on in
# the background (setsid), in a copy of the checkout (KV, default /tmp/kv), and each call waits for it up to SECONDS,
# then copies what there is to $OUT. Started through scripts/device/run.sh (the wheels, the model, KVPOP_TRACKING=off):
#   bash scripts/device/run.sh bash scripts/device/job.sh run 560     # the first call starts it; later ones wait and collect
#   bash scripts/device/run.sh bash scripts/device/job.sh status 0    # what it is doing, without waiting
# Stages: base_model, filter and pack in the call that starts the run; then every policy's chain side by side
# (its training, once resumed from its checkpoint if it stops; its export; the evaluate stage over it alone), and beside
# them the evaluate stage over the untrained policies alone (EARLY). Each such evaluate keeps its RULER tasks in the
# shared .cache/ruler under the keys of the final one, so the final evaluate (every policy whose chain ended) takes
# them as done. A policy whose training fails twice is left out and the run goes on. $OUT gets: status.txt,
# eval.json (the final metrics/eval.json), eval_early.json, eval_arm_NAME.json (each arm's), logs.tgz (every stage's and
# RULER worker's log, the per-policy evaluates' JSON), ruler.tgz (.cache/ruler).
# Settings, read by the call that starts the run (environment):
#   KVPOP_GIT_COMMIT  the commit the copy was made from (the host's copy has no .git): the results' provenance
#   PROFILES   profiles layered over params.yaml, in order (default "4k ruler")
#   POLS       train.policies (default: the profiles')
#   SET        more params, "dotted.key=<yaml> ..." (e.g. "evaluate.max_traces=8")
#   EARLY      1 (default): the untrained policies' evaluate beside the trainings; 0: none. EVAL_EACH: the same for each trained one
#   EARLY_RULER 1 (default): the early evaluate runs RULER too; 0: its quotes, KL and other text alone (RULER rows of the
#              untrained policies taken from an earlier run, merged by bench/bench_ruler.py)
#   FINAL      1 (default): the final evaluate over every policy; 0: none (the rows are the per-policy ones and eval_early.json's)
#   EACH_FULL  1 (default): a trained policy's own evaluates make its whole row: quotes, KL and other text (eval_POL.json,
#              kept first), then RULER (eval_POL_ruler.json); 0: RULER alone. NO_RULER: trained policies without the RULER part
#   EW_BESIDE, EW_ONE, EW_AFTER  evaluate.benchmarks.ruler.workers of the early evaluate (4), a policy's own (3 on a card of
#              100 GB or more, else 2), the final one (6)
#   GRAPHS     auto: tests/test_gpu.py -k chunked_graphs runs beside the preparation and, where it passes, the pool policies
#              train with train.pool_graphs (their chunked pass from CUDA graphs; the same times); 0 (default): the params' value
#   ARMS       more arms, side by side with the run, e.g. ARMS="kl30 floor8" ARM_kl30="train.per_policy.kvpop_mlp_pool.scorer_kl=30"
#              ARM_floor8="train.per_policy.kvpop_mlp_pool.pool_floor=8": each the prepared copy again (KV-arm-NAME),
#              ARM_NAME_POLS trained (default: the last of POLS) with ARM_NAME's params more, side by side, RULER off, then
#              the evaluate stage (run_stages.py) over them and the untrained policies: $OUT/eval_arm_NAME.json.
#              B_SET (B_POLS) is the arm named B
set -uo pipefail
if [ -n "${B_SET:-}" ]; then export ARMS="${ARMS:+$ARMS }B" ARM_B="$B_SET" ARM_B_POLS="${B_POLS:-}"; fi
for a in ${ARMS:-}; do
  [[ $a =~ ^[A-Za-z0-9_]+$ ]] || { echo "job.sh: arm name '$a' (ARMS) is not letters, digits and _" >&2; exit 2; }
  [ -n "$(printenv "ARM_$a")" ] || { echo "job.sh: arm '$a' has no params (ARM_$a=\"dotted.key=value ...\")" >&2; exit 2; }
done
mode=${1:?usage: job.sh run|status SECONDS}
limit=${2:-0}
t_start=$(date +%s)
SRC=$(pwd)
KV=${KV:-/tmp/kv}
J=$KV/.job
OUT=${OUT:-$SRC/device-out}
mkdir -p "$OUT"
py=python3
say() { echo "[job $(date +%H:%M:%S)] $*" | tee -a "$J/job.log" >&2; }
# a policy's own RULER workers: 3 on a card of 100 GB or more, else 2 (on an 80 GB H100, 2026-12-07, three beside two
# trainings and another policy's three ran out of memory, and the stage fell back to one process)
gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
ew_one=2
[ "${gpu_mib:-0}" -ge 100000 ] 2>/dev/null && ew_one=3

set_params() {  # set_params FILE POLS "k=v ..."
  $py - "$@" <<'PY'
import sys, yaml
path, pols, sets = sys.argv[1], sys.argv[2], sys.argv[3]
p = yaml.safe_load(open(path))
if pols.strip():
    p.setdefault("train", {})["policies"] = pols.split()
for kv in sets.split():
    key, _, value = kv.partition("=")
    if not _:
        sys.exit(f"job.sh: {kv!r} is not dotted.key=value")
    *head, last = key.split(".")
    node = p
    for h in head:
        node = node.setdefault(h, {})
    node[last] = yaml.safe_load(value)
with open(path, "w") as f:
    yaml.safe_dump(p, f, sort_keys=False)
PY
}

policies() { $py -c "import yaml,sys; print(' '.join(yaml.safe_load(open(sys.argv[1]))['train']['policies']))" "$1"; }

copy_tree() {  # copy_tree FROM TO: the checkout without the kit and git
  mkdir -p "$2"
  tar -C "$1" --exclude=./.git --exclude=./.whl --exclude=./.whl-rx --exclude=./.devmodel-a --exclude=./.devmodel-b \
    --exclude=./device-out -cf - . | tar -C "$2" -xf -
}

prepare() {
  [ -f "$SRC/.cache/embedded/SmolLM2-135M-Instruct.Q4_1.gguf" ] || { echo "job.sh: no model in .cache/embedded: start with scripts/device/run.sh" >&2; exit 2; }
  rm -rf "$KV"
  copy_tree "$SRC" "$KV"
  rm -rf "$KV/metrics" "$KV/plots"  # the committed run's outputs: --skip-done would take them for this run's
  mkdir -p "$J" "$KV/metrics"
  cd "$KV"
  for prof in ${PROFILES-4k ruler}; do $py pipeline/profiles.py "$prof" --write params.yaml || exit; done
  set_params params.yaml "${POLS:-}" "${SET:-}" || exit
  echo "${KVPOP_GIT_COMMIT:-unknown}" > "$J/commit"
  say "prepare: train.policies [$(policies params.yaml)], commit $(cat "$J/commit")"
  if [ "${GRAPHS:-0}" = auto ]; then  # the pool pass from CUDA graphs where its GPU twins pass here (about a minute, beside the preparation)
    (PYTHONPATH="$KV/src:${PYTHONPATH:-}" $py -m pytest -q -p no:cacheprovider tests/test_gpu.py -k chunked_graphs > "$J/graphs_check.log" 2>&1) &
    local check=$!
  fi
  $py pipeline/run_stages.py --to pack > "$J/prep.log" 2>&1 || { tail -30 "$J/prep.log"; exit 1; }
  if [ "${GRAPHS:-0}" = auto ]; then
    if wait "$check" && grep -q " passed" "$J/graphs_check.log"; then  # passed, not skipped (no CUDA)
      set_params params.yaml "" "train.pool_graphs=true" && say "train.pool_graphs on: tests/test_gpu.py -k chunked_graphs passed"
    else say "train.pool_graphs off: its GPU twins did not pass (graphs_check.log)"; fi
  fi
  say "prepared in $(( $(date +%s) - t_start )) s"
}

stage_cmd() {  # stage_cmd STAGE ITEM: dvc.yaml's command for one item of a foreach stage, from this copy's params
  $py - "$1" "$2" <<'PY'
import sys, yaml
sys.path.insert(0, "pipeline")
from run_stages import commands
for stage, item, cmd, _ in commands(yaml.safe_load(open("dvc.yaml")), yaml.safe_load(open("params.yaml"))):
    if (stage, item) == (sys.argv[1], sys.argv[2]):
        print(cmd)
PY
}

eval_copy() {  # eval_copy NAME POLICY|- : the evaluate stage in a copy that shares data, base model, exports and RULER cache,
  # over one trained policy alone (evaluate.policies none) or, with -, over the untrained ones alone; its RULER tasks,
  # kept in the shared .cache/ruler under the same keys, are done for the final evaluate
  local name=$1 pol=$2 E=$KV-$1
  rm -rf "$E"
  mkdir -p "$E/models" "$E/.cache" "$E/metrics" "$KV/.cache/ruler" "$KV/models/export"
  for f in pipeline src dvc.yaml; do cp -r "$KV/$f" "$E/"; done
  ln -s "$KV/data" "$E/data"
  ln -s "$KV/models/base" "$E/models/base"
  ln -s "$KV/models/export" "$E/models/export"
  ln -s "$KV/.cache/ruler" "$E/.cache/ruler"
  if [ "$pol" = - ]; then
    local ruler="evaluate.benchmarks.ruler.workers=${EW_BESIDE:-4}"
    [ "${EARLY_RULER:-1}" = 1 ] || ruler="evaluate.benchmarks.ruler.samples=0"
    eval_run "$E" "$name" "" "train.policies=[] evaluate.one_pool=false $ruler"
    return
  fi
  # a trained policy: its quotes, KL and other text first (seconds; EACH_FULL=1), kept at once as eval_NAME.json (a run
  # cut off in RULER still has the row), then its RULER tasks alone (eval_NAME_ruler.json), unless NO_RULER names it
  local one="evaluate.one_pool=false evaluate.policies=[]"
  if [ "${EACH_FULL:-1}" = 1 ]; then
    eval_run "$E" "$name" "$pol" "$one evaluate.benchmarks.ruler.samples=0" || return
  fi
  case " ${NO_RULER:-} " in *" $pol "*) return ;; esac
  eval_run "$E" "${name}_ruler" "$pol" \
    "$one evaluate.benchmarks.ruler.workers=${EW_ONE:-$ew_one} evaluate.max_traces=1 evaluate.other_text.code=0 evaluate.other_text.prose=0 evaluate.rollouts.problems=0 evaluate.memory_lengths=[]"
}

eval_run() {  # eval_run COPY NAME POLS "k=v ...": the evaluate stage in COPY over the run's params with these, -> $J/eval_NAME.json
  local E=$1 name=$2
  cp "$KV/params.yaml" "$E/params.yaml"
  set_params "$E/params.yaml" "$3" "$4" || return
  if (cd "$E" && PYTHONPATH="$E/src:${PYTHONPATH:-}" $py pipeline/evaluate.py --out metrics/eval.json > "$J/eval_$name.log" 2>&1); then
    cp "$E/metrics/eval.json" "$J/eval_$name.json"; say "evaluate $name done"
  else
    say "evaluate $name failed (eval_$name.log)"; return 1
  fi
}

policy_chain() {  # train (one retry: a training resumes from its checkpoint), export, then its own evaluate
  local pol=$1 try
  export PYTHONPATH="$KV/src:${PYTHONPATH:-}"
  for try in 1 2; do
    [ -f "$J/trained.$pol" ] && break
    if bash -c "$(stage_cmd train "$pol")" >> "$KV/logs/train@$pol.log" 2>&1; then touch "$J/trained.$pol"; else say "training $pol stopped (try $try)"; fi
  done
  [ -f "$J/trained.$pol" ] || { say "training of $pol failed: left out (logs/train@$pol.log)"; return 1; }
  say "trained $pol"
  [ -d "models/export/$pol" ] || bash -c "$(stage_cmd export "$pol")" >> "$KV/logs/export@$pol.log" 2>&1 ||
    { say "export of $pol failed (logs/export@$pol.log)"; return 1; }
  [ "${EVAL_EACH:-1}" = 1 ] && eval_copy "$pol" "$pol"
  return 0
}

arm_copy() {  # arm_copy NAME: the prepared copy again, before any training writes into it (checkpoints, exports)
  local A=$KV-arm-$1
  rm -rf "$A" && cp -a "$KV" "$A" && rm -rf "$A/.job" "$A/.cache/ruler" "$A/checkpoints" "$A/models/train" "$A/models/export" "$A/metrics/train"
}

arm() {  # arm NAME: its copy's policies trained with ARM_NAME's params more, then evaluated alone
  local a=$1 A=$KV-arm-$1 pols
  pols=$(printenv "ARM_${a}_POLS")
  set_params "$A/params.yaml" "${pols:-$(policies params.yaml | awk '{print $NF}')}" \
    "evaluate.benchmarks.ruler.samples=0 evaluate.one_pool=false $(printenv "ARM_$a")" || { say "arm $a: bad params"; touch "$J/arm_$a.done"; return 1; }
  say "arm $a: train.policies [$(policies "$A/params.yaml")] with $(printenv "ARM_$a")"
  if (cd "$A" && PYTHONPATH="$A/src:${PYTHONPATH:-}" $py pipeline/run_stages.py --from train --parallel train --skip-done > "$J/arm_$a.log" 2>&1); then
    cp "$A/metrics/eval.json" "$J/eval_arm_$a.json" && say "arm $a done"
  else say "arm $a failed (arm_$a.log)"; fi
  touch "$J/arm_$a.done"
}

drive() {  # the background part: every policy's chain side by side (and the untrained policies' evaluate, and the arms), then the final evaluate
  cd "$KV"
  mkdir -p logs
  local a
  for a in ${ARMS:-}; do arm_copy "$a" || { say "arm $a: no copy"; touch "$J/arm_$a.done"; }; done
  for a in ${ARMS:-}; do [ -f "$J/arm_$a.done" ] || arm "$a" & done  # they end on their own (arm_NAME.done)
  local early=""
  if [ "${EARLY:-1}" = 1 ]; then eval_copy early - & early=$!; fi
  local chains=() pol
  for pol in $(policies params.yaml); do
    policy_chain "$pol" &
    chains+=($!)
  done
  wait "${chains[@]}" $early  # not the arms: each ends on its own (arm_NAME.done)
  local kept=""
  for pol in $(policies params.yaml); do [ -d "models/export/$pol" ] && kept="$kept $pol"; done
  if [ "${FINAL:-1}" = 1 ]; then
    set_params params.yaml "$kept" "evaluate.benchmarks.ruler.workers=${EW_AFTER:-6}"
    say "final evaluate over [$kept ] and the untrained policies"
    if $py pipeline/run_stages.py --from evaluate > "$J/rest.log" 2>&1; then say "evaluate done"; else say "evaluate failed (rest.log)"; fi
  else
    say "chains done: [$kept ] (FINAL=0: no final evaluate; each policy's own evaluate and eval_early.json hold the rows)"
  fi
  touch "$J/done"
}

collect() {
  {
    echo "commit $(cat "$J/commit" 2>/dev/null); $(date -u +%FT%TZ); $(( $(date +%s) - t_start )) s in this call"
    cat "$J/job.log" 2>/dev/null
    for f in "$KV"/logs/train@*.log "$KV"-arm-*/logs/train@*.log; do
      [ -f "$f" ] && echo "== $f: $(tr '\r' '\n' < "$f" | grep -a '^train [0-9]' | tail -1)"
    done
    for f in "$J"/rest.log "$J"/eval_*.log "$J"/arm_*.log; do [ -f "$f" ] && { echo "== $(basename "$f")"; tail -n 6 "$f"; }; done
    ls "$KV"/.cache/ruler 2>/dev/null | head -50
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
  } > "$OUT/status.txt" 2>&1
  [ -f "$KV/metrics/eval.json" ] && [ -f "$J/done" ] && cp "$KV/metrics/eval.json" "$OUT/eval.json"
  [ -f "$J/eval_early.json" ] && cp "$J/eval_early.json" "$OUT/eval_early.json"  # the untrained policies' (the trained ones' own: logs.tgz)
  for f in "$J"/eval_arm_*.json; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  tar -czf "$OUT/logs.tgz" -C / --ignore-failed-read $(cd / && ls -d "${J#/}" "${KV#/}/logs" "${KV#/}/metrics" tmp/kvpop-ruler-* 2>/dev/null) 2>/dev/null
  [ -d "$KV/.cache/ruler" ] && tar -czf "$OUT/ruler.tgz" -C "$KV/.cache" ruler
  cat "$OUT/status.txt"
}

case $mode in
  run)
    if [ ! -f "$J/started" ]; then
      prepare
      echo "${ARMS:-}" > "$J/arms"
      touch "$J/started"
      # from the copy: the host re-copies the checkout at each call, and bash reads a script as it runs
      setsid nohup bash "$KV/scripts/device/job.sh" _drive > "$J/drive.log" 2>&1 < /dev/null &
    fi
    finished() {
      [ -f "$J/done" ] || return 1
      local a; for a in $(cat "$J/arms" 2>/dev/null); do [ -f "$J/arm_$a.done" ] || return 1; done  # the arms the run started with
    }
    while ! finished && [ $(( $(date +%s) - t_start )) -lt $(( limit - 20 )) ]; do sleep 5; done
    collect
    ;;
  _drive) mkdir -p "$J"; drive ;;
  status) collect ;;
  *) echo "job.sh: unknown mode $mode (run, status)" >&2; exit 2 ;;
esac
