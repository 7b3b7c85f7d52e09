#!/usr/bin/env bash
# Issue 33's measurements on a lent GPU in one call: each part under its own time limit, its log and JSON written
# to $OUT as it goes (a part cut short keeps the rows it finished). Started through scripts/device/run.sh (carry .whl
# on a fresh machine; no model needed: the GPU twins build tiny random models, the benches Qwen3-4B's architecture):
#   bash scripts/device/run.sh bash scripts/device/engine.sh twins decode
#   POOLED=dbtrimkv DECODE_PARTS=pooled bash scripts/device/run.sh bash scripts/device/engine.sh decode
# Parts, in the order given:
#   twins   tests/test_gpu.py's pool, chunked and chunk-graph twins (the compiled pooled engine == OnePoolCache, ...; TWINS_K: another -k,
#           TWINS_FILES: other test files, e.g. "tests/test_gpu.py tests/test_order.py")
#   decode  bench/bench_decode.py: DECODE_PARTS (default b1,batch,pooled) at budget 2,048, batch BATCHES (64; 1: none), no dense rows, the
#           pooled policies POOLED (default kvpop_mlp,dbtrimkv) with chunk graphs (GRAPHS=0: without), contexts CONTEXTS
#   profile bench/kernels/profile_decode.py at batch 1, 4K: the bounded step (kvpop_mlp) and the pooled one of each of PROFILE_POLICIES
#           (default PROFILE_POLICY, default dbtrimkv; several: profile_pooled_POLICY.json; kvpop_mlp_one_pool: OnePool(kvpop_mlp)),
#           the first with its selection sorted (--sorted; SORTED=0: not), then with each FlexAttention split of SPLITS
#           (e.g. "32 64": --split-kv), every kernel listed (here: bench/kernels/compare_profiles.py A.json B.json groups them and
#           prints where the difference goes)
#   step    bench/bench_pool_step.py --graphs --delays 64 (train.pool_graphs, issue 32)
#   prefill bench/kernels/profile_pool_prefill.py --chunk-graphs --timeline at PREFILL_CONTEXT (default 32768) for each of
#           PREFILL_POLICIES (default "dbtrimkv kvpop_mlp"), PREFILL_ARGS more (e.g. "--chunk-attention sdpa"): every chunk's
#           seconds and graphs, the phases, the kernels; DECAY_BLOCKS (e.g. "8 16"): each policy once per --decay-block (dbtrimkv's
#           candidate lists), files prefill_POLICY_bN.json; TIMELINE="" (set, empty): without --timeline (the profiled chunks alone)
# LIMIT (default 570) is the call's seconds from this script's start; each part gets what is left less 15 s.
# At most 8 files come back from a call's $OUT: the profile part with two SPLITS writes 8 with gpu.txt and parts.txt, so run it alone.
# The whole command (every part of bench_decode.py, over 10 minutes) runs across calls with scripts/device/bg.sh:
#   bash scripts/device/run.sh bash scripts/device/bg.sh decode 560 python3 bench/bench_decode.py --out '$BG/bench_decode_h200.json'
set -uo pipefail
t0=$(date +%s)
LIMIT=${LIMIT:-570}
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
left() { echo $(( LIMIT - ($(date +%s) - t0) - 15 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/gpu.txt" 2>&1
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(twins decode)
for part in "${parts[@]}"; do  # every name checked before anything runs
  case $part in twins|decode|profile|step|prefill) ;; *) echo "engine.sh: unknown part '$part' (twins, decode, profile, step, prefill)" >&2; exit 2 ;; esac
done
for part in "${parts[@]}"; do
  s=$(left)
  [ "$s" -gt 30 ] || { echo "engine.sh: no time left for $part" | tee -a "$OUT/parts.txt"; continue; }
  p0=$(date +%s)
  case $part in
    twins) timeout "$s" python3 -m pytest -q -x -p no:cacheprovider ${TWINS_FILES:-tests/test_gpu.py} -k "${TWINS_K:-pool or chunked}" > "$OUT/twins.log" 2>&1 ;;
    decode)
      g=--chunk-graphs
      [ "${GRAPHS:-1}" = 0 ] && g=
      timeout "$s" python3 bench/bench_decode.py --parts "${DECODE_PARTS:-b1,batch,pooled}" --budgets 2048 --batches "${BATCHES:-64}" \
        --contexts "${CONTEXTS:-4096,32768,131072}" --dense-modes none --eager-new 0 --pooled-policies "${POOLED:-kvpop_mlp,dbtrimkv}" $g \
        --out "$OUT/decode${TAG:-}.json" > "$OUT/decode${TAG:-}.log" 2>&1 ;;
    profile)
      pols=(${PROFILE_POLICIES:-${PROFILE_POLICY:-dbtrimkv}})
      timeout "$s" python3 bench/kernels/profile_decode.py --out "$OUT/profile_bounded${TAG:-}.json" > "$OUT/profile${TAG:-}.log" 2>&1
      for pol in "${pols[@]}"; do
        sfx=$([ ${#pols[@]} -gt 1 ] && echo "_$pol")
        [ "$(left)" -gt 60 ] && timeout "$(left)" python3 bench/kernels/profile_decode.py --policy "$pol" --out "$OUT/profile_pooled$sfx${TAG:-}.json" \
          >> "$OUT/profile${TAG:-}.log" 2>&1
      done
      [ "${SORTED:-1}" = 1 ] && [ "$(left)" -gt 60 ] && timeout "$(left)" python3 bench/kernels/profile_decode.py --policy "${pols[0]}" --sorted \
        --out "$OUT/profile_sorted${TAG:-}.json" >> "$OUT/profile${TAG:-}.log" 2>&1
      for n in ${SPLITS:-}; do
        [ "$(left)" -gt 60 ] && timeout "$(left)" python3 bench/kernels/profile_decode.py --policy "${pols[0]}" --split-kv "$n" \
          --out "$OUT/profile_split$n${TAG:-}.json" >> "$OUT/profile${TAG:-}.log" 2>&1
      done ;;
    step) timeout "$s" python3 bench/bench_pool_step.py --graphs --delays 64 --out "$OUT/pool_step.json" > "$OUT/pool_step.log" 2>&1 ;;
    prefill)
      for pol in ${PREFILL_POLICIES:-dbtrimkv kvpop_mlp}; do
        for db in ${DECAY_BLOCKS:--}; do  # "-": the store's own decay_block
          a=() && sfx=
          [ "$db" = - ] || { a=(--decay-block "$db") && sfx=_b$db; }
          [ "$(left)" -gt 60 ] && timeout "$(left)" python3 bench/kernels/profile_pool_prefill.py --policy "$pol" --context "${PREFILL_CONTEXT:-32768}" \
            --chunk-graphs ${TIMELINE---timeline} "${a[@]}" ${PREFILL_ARGS:-} --out "$OUT/prefill_$pol$sfx${TAG:-}.json" >> "$OUT/prefill${TAG:-}.log" 2>&1
        done
      done ;;
  esac
  rc=$?
  echo "$part rc=$rc $(( $(date +%s) - p0 )) s" | tee -a "$OUT/parts.txt"
done
tail -n 3 "$OUT"/*.log
