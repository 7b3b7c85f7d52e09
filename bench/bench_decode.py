"""Decode speed and memory: the bounded cache vs dense decoding in the same engine vs eager `generate`.

Qwen3-4B architecture with random weights (36 layers, 32 query / 8 KV heads, head_dim 128, hidden
2560, intermediate 9728, vocabulary 151,936, tied embeddings), bf16, on one GPU. Everything in one
invocation:

* the copy bandwidth of the card (read + write bytes of a 4 GiB device-to-device copy);
* transformers' eager ``generate`` at a 4K prompt, batch 1 (time per new token);
* :class:`kvpop.decode.DecodeEngine` with a bounded cache (``kvpop_mlp`` scorer, random weights,
  scored inside the step) at each budget: chunked prefill to 4K, then ``--steps`` timed decode
  steps, then on to 32K and 131K in the same cache (it evicts as the chunks arrive); the peak
  memory is the running maximum since the engine was built;
* the same engine with a dense static cache (preallocated for the longest context, reading only
  the filled blocks), at the same contexts;
* batch 16 and 64 at 32K for the bounded cache, and dense where it fits (said where it does not);
  the cache is put straight into its state at 32K (:func:`kvpop.benchmarking.fill_cache`; ``--batch-fill prefill`` prefills
  B * 32K tokens instead), since a step does the same work whatever the entries hold.

* ``--parts policies``: decode memory of each evicting policy at ``--policy-context`` (32K), batch 1,
  the first budget, every policy on the same model: the engine where it serves the policy
  (``kvpop_mlp``, ``kvpop``, ``dms``; eager, since these rows are about memory), the reference
  :class:`kvpop.decode.BoundedCache` where it does not (``trimkv``: its ranks fall with age), with the
  allocated cache beside a dense cache's size at that context. Every policy holds the same
  fixed per-head pool (``dms`` caps its gate at it; ``kvpop`` adds its recurrent state), except
  ``dbtrimkv``: one pool of the same total size for every layer and head
  (:class:`kvpop.decode.one_pool.OnePoolCache`, allocated whole at the first token), which takes its
  first ``budget`` prompt tokens and then ``steps`` decoded ones (its memory does not change with
  the context).

* ``--parts pooled`` (in the default): the engine's ``pooled`` kind (:mod:`kvpop.decode.pooled`: one pool of
  ``L x Hk x k`` long-range entries for the whole model) for each of ``--pooled-policies`` (``dbtrimkv``,
  random gate; ``kvpop_mlp``: the scorer above ranked with one pool, ``OnePool(kvpop_mlp)``) at the first
  budget: batch 1 at every context, each prompt prefilled whole from an empty cache (``prefill_s``), then
  ``--steps`` timed steps, the peak memory since that prompt began; the largest of ``--batches`` at
  ``--batch-context`` (cache filled at random, :func:`kvpop.benchmarking.fill_cache`). With it the bounded
  engine's whole-prompt prefill at ``--batch-context`` (``bounded_prefill_s``) and the goals of issue 33
  against the bounded rows of the same run (``pooled_goals``). At ``--batch-context`` both engines prefill
  another prompt of that length first (``prefill_first_s``, ``bounded_prefill_first_s``: their compiles and,
  with ``--chunk-graphs``, a CUDA graph per layer and entry width met), then the timed one.

* ``--parts goals`` (in the default): issue 15's goals table from the rows above plus two scripts
  run in fresh processes after them: ``bench_ttft.py`` (cold, warm and eager time to the first
  token) and ``bench_train_step.py --model 4b`` (the selection's share of the training step; it
  needs pydantic, as the library does), their JSON written beside ``--out`` as ``<stem>_ttft.json``
  and ``<stem>_train_step.json``; a script that fails leaves its goal "not measured" with its error.

For each row: ms per step, tokens/s, peak memory, the bandwidth floor
``(weight bytes + B * KV bytes of the held entries) / copy bandwidth`` and the fraction of it
reached; ratios against eager ``generate`` and against dense at the same context.

    PYTHONPATH=src python3 bench/bench_decode.py      # every row and the goals (about 7 min) -> results/bench_decode/h200.json
    PYTHONPATH=src python3 bench/bench_decode.py --parts b1,batch    # the decode rows only (about 2 min)
    PYTHONPATH=src python3 bench/bench_decode.py --parts b1          # batch-1 rows only
    PYTHONPATH=src python3 bench/bench_decode.py --parts batch       # batch 16/64 rows only
    PYTHONPATH=src python3 bench/bench_decode.py --parts policies --out results/bench_decode/policies_h200.json
    PYTHONPATH=src python3 bench/bench_decode.py --parts b1,batch,pooled --budgets 2048 --batches 64 --dense-modes none --eager-new 0 \
        --out results/bench_decode/pooled_h200.json   # issue 33's rows and goals alone (bounded and pooled)
    PYTHONPATH=src python3 bench/bench_decode.py --small --out /tmp/d.json   # tiny model (also on CPU)

``--out`` defaults to ``results/bench_decode/<device>.json`` (``<device>_small.json`` with ``--small``),
written with :func:`kvpop.provenance.write_result` (command, commit, device, versions, date) after every row.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

from kvpop.benchmarking import copy_bandwidth, default_out, fill_cache, pooled_policy, qwen3_4b_config, random_ids, run_script, sync
from kvpop.decode.cache import enable
from kvpop.decode.engine import COMPILE_MODES, DecodeEngine, engine_refusal, kv_bytes_per_token, weight_bytes
from kvpop.decode.generate import new_cache
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.provenance import device_name, write_result

GB = 1e9


def time_steps(eng: DecodeEngine, steps: int, warmup: int) -> tuple[float, float]:
    """(seconds per decode step, seconds of the warm-up: compilation and CUDA-graph capture)."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        eng.step()
    sync(eng.device)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(eng.device)
    return (time.perf_counter() - t0) / steps, warm


def peak(dev) -> float:
    return torch.cuda.max_memory_allocated(dev) / GB if dev.type == "cuda" else float("nan")


def eager_generate(model, ctx: int, new: int, dev) -> float:
    """Seconds per new token of transformers' eager greedy generate after a ctx-token prompt."""
    ids = random_ids(1, ctx, model.config.vocab_size, 1, dev)

    def run(n):
        sync(dev)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(dev)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return (run(new + 1) - run(1)) / new


def grow(eng: DecodeEngine, target: int, vocab: int, seed: int) -> float:
    """Prefill (in chunks) until the cache has seen ``target`` tokens; returns seconds."""
    n = target - eng.seen
    if n <= 0:
        return 0.0
    t0 = time.perf_counter()
    eng.prefill(random_ids(eng.B, n, vocab, seed, eng.device))
    sync(eng.device)
    return time.perf_counter() - t0


def row(name, *, B, ctx, budget, timed, eng, floor_bytes, bw, base_bytes, dev, prefill_s, extra=None):
    s_step, warm = timed
    return {
        "engine": name, "batch": B, "context": ctx, "budget": budget,
        "ms_per_step": round(s_step * 1e3, 3), "tokens_per_s": round(B / s_step, 1),
        "peak_gb": round(peak(dev), 3), "peak_above_weights_gb": round(peak(dev) - base_bytes / GB, 3),
        "cache_gb": round(eng.cache_bytes() / GB, 3),
        "floor_ms": round(floor_bytes / bw * 1e3, 3), "floor_fraction": round(floor_bytes / bw / s_step, 3),
        "prefill_s": round(prefill_s, 1), "warmup_s": round(warm, 1), "compile_mode": eng.compile_mode,
        "fused": eng.fused, **(extra or {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="default: results/bench_decode/<device>[_small].json")
    ap.add_argument("--small", action="store_true", help="tiny Qwen3 config and short contexts (smoke test)")
    ap.add_argument("--parts", default="b1,batch,pooled,goals", help="comma list of: b1 (eager + batch-1 rows), batch (batch 16/64 at "
                    "--batch-context), pooled (the one-pool engine's rows and issue 33's goals), policies (decode memory per policy), goals "
                    "(issue 15's table: the b1 and batch rows with the time to the first token and the training step's selection share, each "
                    "measured by its own script in a fresh process)")
    ap.add_argument("--pooled-policies", default="dbtrimkv,kvpop_mlp", help="part 'pooled': one-pool policies (kvpop_mlp: OnePool(kvpop_mlp))")
    ap.add_argument("--chunk-graphs", action="store_true", help="part 'pooled': each whole prefill chunk's layers as CUDA graphs "
                    "(DecodeEngine(chunk_graphs=True); rows marked \"chunk_graphs\")")
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--budgets", default="2048,4096")
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--batch-context", type=int, default=32768)
    ap.add_argument("--batch-fill", choices=("fill", "prefill"), default="fill",
                    help="batch rows: put the cache straight into its state at --batch-context (default) or prefill B * context tokens")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--compile-modes", default="layer", help="comma list of DecodeEngine compile modes (layer, step): the batch-1 rows "
                    "for each; the batch rows with the first")
    ap.add_argument("--fused", choices=("auto", "off", "on", "both"), default="auto", help="the bounded engines' fused insert kernel "
                    "(kvpop.kernels.insert): the engine's default (auto: on with CUDA and Triton), off, on, or both side by side "
                    "(batch-1 rows; the batch rows take the last)")
    ap.add_argument("--dense-modes", default=None, help="the batch-1 dense rows' compile modes (default: --compile-modes; none: no dense rows)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--eager-new", type=int, default=32, help="new tokens timed for eager generate (0: no eager row)")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--policies", default="kvpop_mlp,kvpop,dms,trimkv,dbtrimkv", help="part 'policies': the evicting policies compared")
    ap.add_argument("--policy-context", type=int, default=32768, help="part 'policies': the context of the memory rows")
    ap.add_argument("--policy-steps", type=int, default=20, help="part 'policies': decode steps after the prefill")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    for name in ("cache_size_limit", "recompile_limit"):  # one compiled step per engine
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    contexts = [int(c) for c in args.contexts.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    parts = set(args.parts.split(","))
    modes = args.compile_modes.split(",")
    fuse = {"auto": [None], "off": [False], "on": [True], "both": [False, True]}[args.fused]
    if bad := [m for m in modes if m not in COMPILE_MODES]:
        raise SystemExit(f"--compile-modes: unknown {bad}; choose from {', '.join(COMPILE_MODES)}")
    if args.small:
        contexts, budgets, batches, args.batch_context, args.policy_context = [512, 1024], [384], [4], 1024, 1024
        args.chunk, args.steps, args.eager_new = 256, 8, 4
    args.out = args.out or default_out(__file__, small=args.small)
    cfg = qwen3_4b_config(args.small)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
    L, Hk, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    policy = make_policy("kvpop_mlp", num_layers=L, num_kv_heads=Hk, head_dim=D)
    for layer in policy.scorer.layers:  # a scorer that ranks tokens (the zero-initialized one ranks by age only)
        torch.nn.init.normal_(layer.w2, std=0.5)
    policy.to(dev)
    wbytes = weight_bytes(model)
    per_tok = kv_bytes_per_token(model)
    bw = copy_bandwidth(dev, 1 << 32 if dev.type == "cuda" else 1 << 26)
    sync(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    info = {
        "model": "qwen3-small" if args.small else "Qwen3-4B architecture (random weights)", "dtype": str(dtype),
        "weight_gb": round(wbytes / GB, 3), "kv_bytes_per_token": per_tok, "copy_bandwidth_tb_s": round(bw / 1e12, 3),
        "steps": args.steps, "chunk": args.chunk, "policy": "kvpop_mlp (random scorer weights)", "batch_fill": args.batch_fill,
    }
    print(json.dumps(info, indent=1), flush=True)
    rows: list[dict] = []

    def done(r):
        rows.append(r)
        print(json.dumps(r), flush=True)
        write_result(args.out, {"info": info, "rows": rows})

    vocab = cfg.vocab_size
    if "b1" in parts:
        ctx0 = contexts[0]
        if args.eager_new > 0:
            s = eager_generate(model, ctx0, args.eager_new, dev)
            done({"engine": "hf_eager_generate", "batch": 1, "context": ctx0, "budget": None, "ms_per_step": round(s * 1e3, 3),
                  "tokens_per_s": round(1 / s, 1), "floor_ms": round((wbytes + ctx0 * per_tok) / bw * 1e3, 3),
                  "floor_fraction": round((wbytes + ctx0 * per_tok) / bw / s, 3)})
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        for mode, fused, budget in ((m, f, b) for m in modes for f in fuse for b in budgets):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            eng = DecodeEngine(model, policy, layout=CacheLayout(budget, 4, 256), batch_size=1, chunk=args.chunk, compile_mode=mode, fused=fused)
            for ctx in contexts:
                pre = grow(eng, ctx, vocab, ctx)
                timed = time_steps(eng, args.steps, args.warmup)
                held = min(ctx, eng.slots)
                done(row("bounded", B=1, ctx=ctx, budget=budget, timed=timed, eng=eng, floor_bytes=wbytes + held * per_tok, bw=bw,
                         base_bytes=base, dev=dev, prefill_s=pre))
            del eng
            torch.cuda.empty_cache() if dev.type == "cuda" else None
        for mode in [] if args.dense_modes == "none" else args.dense_modes.split(",") if args.dense_modes else modes:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            max_len = -(-(contexts[-1] + len(contexts) * (args.steps + args.warmup) + 1) // 128) * 128
            eng = DecodeEngine(model, None, max_len=max_len, batch_size=1, chunk=args.chunk, compile_mode=mode)
            for ctx in contexts:
                pre = grow(eng, ctx, vocab, ctx)
                timed = time_steps(eng, args.steps, args.warmup)
                done(row("dense", B=1, ctx=ctx, budget=None, timed=timed, eng=eng, floor_bytes=wbytes + ctx * per_tok, bw=bw, base_bytes=base,
                         dev=dev, prefill_s=pre, extra={"static_cache_len": max_len, "kv_gb_at_context": round(ctx * per_tok / GB, 3)}))
            del eng
            torch.cuda.empty_cache() if dev.type == "cuda" else None

    if "batch" in parts:
        ctx = args.batch_context
        for B in batches:
            for budget in budgets:
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                eng = DecodeEngine(model, policy, layout=CacheLayout(budget, 4, 256), batch_size=B, chunk=args.chunk, compile_mode=modes[0],
                                   fused=fuse[-1])
                pre = grow(eng, ctx, vocab, ctx + B) if args.batch_fill == "prefill" else fill_cache(eng, ctx, ctx + B)
                timed = time_steps(eng, args.steps, args.warmup)
                done(row("bounded", B=B, ctx=ctx, budget=budget, timed=timed, eng=eng, floor_bytes=wbytes + B * min(ctx, eng.slots) * per_tok,
                         bw=bw, base_bytes=base, dev=dev, prefill_s=pre))
                del eng
                torch.cuda.empty_cache() if dev.type == "cuda" else None
            max_len = -(-(ctx + args.steps + args.warmup + 1) // 128) * 128
            need = B * max_len * per_tok
            free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else float("inf")
            if need > 0.9 * free:
                done({"engine": "dense", "batch": B, "context": ctx, "budget": None, "fits": False,
                      "needs_cache_gb": round(need / GB, 1), "free_gb": round(free / GB, 1)})
                continue
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            eng = DecodeEngine(model, None, max_len=max_len, batch_size=B, chunk=args.chunk, compile_mode=modes[0])
            pre = grow(eng, ctx, vocab, ctx + B) if args.batch_fill == "prefill" else fill_cache(eng, ctx, ctx + B)
            timed = time_steps(eng, args.steps, args.warmup)
            done(row("dense", B=B, ctx=ctx, budget=None, timed=timed, eng=eng, floor_bytes=wbytes + B * ctx * per_tok, bw=bw,
                     base_bytes=base, dev=dev, prefill_s=pre, extra={"fits": True}))
            del eng
            torch.cuda.empty_cache() if dev.type == "cuda" else None

    if "pooled" in parts:
        pooled_rows(args, model, policy, done, contexts=contexts, budget=budgets[0], batch=max(batches), wbytes=wbytes, per_tok=per_tok, bw=bw,
                    base=base, dev=dev, modes=modes)
        pooled_table = pooled_goals(rows, budget=budgets[0], batch=max(batches), contexts=contexts, batch_context=args.batch_context)
        write_result(args.out, {"info": info, "rows": rows, "pooled_goals": pooled_table})

    if "policies" in parts:  # last: enable() switches the model's attention to the kvpop_cache implementation
        for name in args.policies.split(","):
            done(policy_row(name, model, budget=budgets[0], ctx=args.policy_context, steps=args.policy_steps, warmup=args.warmup,
                            chunk=args.chunk, wbytes=wbytes, per_tok=per_tok, bw=bw, base=base, dev=dev))

    if "goals" in parts:  # fresh processes (a first token is timed from a process's start), this one's model freed first
        del model
        torch.cuda.empty_cache() if dev.type == "cuda" else None
        subs = run_goal_scripts(args.out, budget=budgets[0], small=args.small)
        table = goals(rows, subs, budget=budgets[0], batch=max(batches), contexts=contexts)
        extra = {"pooled_goals": pooled_table} if "pooled" in parts else {}
        write_result(args.out, {"info": info, "rows": rows, "goals": table, "goal_scripts": subs, **extra})
    summarize(info, rows)
    if "goals" in parts:
        print_goals(table)
    if "pooled" in parts:
        print_goals(pooled_table, "issue 33's goals (the pooled engine against the per-head bounded one, same run)")


@torch.no_grad()
def policy_row(name: str, model, *, budget: int, ctx: int, steps: int, warmup: int, chunk: int, wbytes: int, per_tok: int, bw: float,
               base: int, dev) -> dict:
    """Decode memory of one policy after a ``ctx``-token prompt, batch 1: the engine (eager) where it
    serves the policy, else its reference cache (prefill in one forward, then ``steps`` tokens)."""
    cfg = model.config
    pol = make_policy(name, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim).to(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    extra = {"policy": name, "dense_kv_gb_at_context": round(ctx * per_tok / GB, 3)}
    if engine_refusal(model, pol) is None:
        eng = DecodeEngine(model, pol, layout=CacheLayout(budget, 4, 256), batch_size=1, chunk=chunk, compile=False)
        pre = grow(eng, ctx, cfg.vocab_size, ctx)
        r = row("bounded", B=1, ctx=ctx, budget=budget, timed=time_steps(eng, steps, warmup), eng=eng,
                floor_bytes=wbytes + min(ctx, eng.slots) * per_tok, bw=bw, base_bytes=base, dev=dev, prefill_s=pre,
                extra={**extra, "path": "engine (eager)"})
        del eng
        return r
    enable(model)
    cache = new_cache(model, pol, layout=CacheLayout(budget, 4, 256))
    # one pool (dbtrimkv) takes at most `budget` prompt tokens at once (the rest would go one at a time); its
    # buffers are allocated whole at the first token and never change with the context, so the memory after
    # `budget` tokens is the memory at any longer context
    fed = min(ctx, cache.max_prefill or ctx)
    ids = random_ids(1, fed + warmup + steps, cfg.vocab_size, fed, dev)
    sync(dev)
    t0 = time.perf_counter()
    model(input_ids=ids[:, :fed], past_key_values=cache, logits_to_keep=1)
    sync(dev)
    pre = time.perf_counter() - t0
    for t in range(fed, fed + warmup):
        model(input_ids=ids[:, t : t + 1], past_key_values=cache)
    sync(dev)
    t0 = time.perf_counter()
    for t in range(fed + warmup, fed + warmup + steps):
        model(input_ids=ids[:, t : t + 1], past_key_values=cache)
    sync(dev)
    s_step = (time.perf_counter() - t0) / steps
    return row("reference", B=1, ctx=ctx, budget=budget, timed=(s_step, 0.0), eng=cache, floor_bytes=wbytes + min(ctx, cache.slots) * per_tok,
               bw=bw, base_bytes=base, dev=dev, prefill_s=pre,
               extra={**extra, "path": f"reference {type(cache).__name__}", "prompt_fed": fed})


def pooled_rows(args, model, kvpop_mlp, done, *, contexts, budget, batch, wbytes, per_tok, bw, base, dev, modes) -> None:
    """Part ``pooled``: every one-pool policy on the pooled engine (batch 1 at every context, prompt prefilled
    whole; the largest batch at --batch-context, filled), and the bounded engine's whole-prompt prefill."""
    vocab = model.config.vocab_size
    layout = CacheLayout(budget, 4, 256)
    eng = DecodeEngine(model, kvpop_mlp, layout=layout, batch_size=1, chunk=args.chunk, compile_mode=modes[0])
    bounded_first = grow(eng, args.batch_context, vocab, args.batch_context + 1)  # another prompt first: the compiles are not the prompt's
    eng.reset()
    bounded_pre = grow(eng, args.batch_context, vocab, args.batch_context)
    del eng
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    pols = {name: pooled_policy(name, model, kvpop_mlp, dev) for name in args.pooled_policies.split(",")}
    graphs = {"chunk_graphs": True} if args.chunk_graphs else {}
    for name, pol in pols.items():  # every policy's batch-1 rows first: a batch row that fails ends nothing before it
        extra = {"policy": name, "bounded_prefill_s": round(bounded_pre, 2), "bounded_prefill_first_s": round(bounded_first, 2),
                 "bounded_prefill_context": args.batch_context, **graphs}
        eng = DecodeEngine(model, pol, layout=layout, batch_size=1, chunk=args.chunk, compile_mode=modes[0], chunk_graphs=args.chunk_graphs)
        for ctx in contexts:
            first = {}
            if ctx == args.batch_context:  # the goal's prompt after another of its length, as the bounded engine's: its
                eng.reset()  # compiles and chunk graphs (one per layer and width met) are the engine's first prompt's cost
                first = {"prefill_first_s": round(grow(eng, ctx, vocab, ctx + 1), 2)}
            eng.reset()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            pre = grow(eng, ctx, vocab, ctx)
            timed = time_steps(eng, args.steps, args.warmup)
            done(row("pooled", B=1, ctx=ctx, budget=budget, timed=timed, eng=eng, floor_bytes=wbytes + min(ctx, eng.slots) * per_tok, bw=bw,
                     base_bytes=base, dev=dev, prefill_s=pre, extra={**extra, "prefill_s": round(pre, 2), **first}))
        del eng
        torch.cuda.empty_cache() if dev.type == "cuda" else None
    for name, pol in pols.items() if batch > 1 else ():  # --batches 1: the batch-1 rows only
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        eng = None
        try:
            eng = DecodeEngine(model, pol, layout=layout, batch_size=batch, chunk=args.chunk, compile_mode=modes[0], chunk_graphs=args.chunk_graphs)
            pre = fill_cache(eng, args.batch_context, args.batch_context + batch)
            timed = time_steps(eng, args.steps, args.warmup)
        except Exception as e:  # noqa: BLE001 -- recorded as the row (e.g. a compiler's refusal), the other policies still measured
            traceback.print_exc()
            done({"engine": "pooled", "policy": name, "batch": batch, "context": args.batch_context, "budget": budget,
                  "error": f"{type(e).__name__}: {str(e)[:2000]}"})
        else:
            done(row("pooled", B=batch, ctx=args.batch_context, budget=budget, timed=timed, eng=eng,
                     floor_bytes=wbytes + batch * min(args.batch_context, eng.slots) * per_tok, bw=bw, base_bytes=base, dev=dev, prefill_s=pre,
                     extra={"policy": name}))
        del eng
        torch.cuda.empty_cache() if dev.type == "cuda" else None


#: issue 33's goals, each against the bounded engine of the same run: (what, target, higher is better)
POOLED_GOALS = {
    "ms_ratio": ("pooled / bounded ms per step", 1.15, False),
    "prefill_ratio": ("pooled / bounded prefill of the whole prompt", 1.5, False),
    "peak_ratio": ("pooled peak GB at the longest / at the shortest context", 1.02, False),
    "bounded_b1_ms": ("bounded ms per step, batch 1 (today: 3.70)", 3.70, False),
    "bounded_batch_tok_s": ("bounded tokens/s at the largest batch (today: 7,203)", 7203.0, True),
}


def pooled_goals(rows: list[dict], *, budget: int, batch: int, contexts: list[int], batch_context: int) -> list[dict]:
    """Issue 33's table from this run's rows: one dict per goal and policy (None where not measured)."""
    def find(**kw):
        return next((r for r in rows if "ms_per_step" in r and all(r.get(k) == v for k, v in kw.items())), None)

    out = []

    def add(key, value, detail, policy=None):
        what, target, higher = POOLED_GOALS[key]
        met = None if value is None else (value >= target if higher else value <= target)
        out.append({"goal": key, "what": what + (f" [{policy}]" if policy else ""), "value": value, "target": target, "met": met,
                    "detail": detail})

    names = sorted({r["policy"] for r in rows if r.get("engine") == "pooled"})
    for name in names:
        for B, ctx in [(1, c) for c in contexts] + [(batch, batch_context)]:
            p, b = find(engine="pooled", policy=name, batch=B, context=ctx), find(engine="bounded", batch=B, context=ctx, budget=budget)
            add("ms_ratio", round(p["ms_per_step"] / b["ms_per_step"], 3) if p and b else None, f"batch {B}, {ctx} tokens"
                + (f": {p['ms_per_step']} vs {b['ms_per_step']} ms" if p and b else ": a row is missing"), name)
        p = find(engine="pooled", policy=name, batch=1, context=batch_context)
        add("prefill_ratio", round(p["prefill_s"] / p["bounded_prefill_s"], 3) if p else None,
            f"{batch_context} tokens: {p['prefill_s']} vs {p['bounded_prefill_s']} s" if p else "no row", name)
        lo, hi = find(engine="pooled", policy=name, batch=1, context=contexts[0]), find(engine="pooled", policy=name, batch=1, context=contexts[-1])
        ok = lo and hi and lo["peak_gb"] == lo["peak_gb"]  # NaN off CUDA
        add("peak_ratio", round(hi["peak_gb"] / lo["peak_gb"], 4) if ok else None,
            f"{hi['peak_gb']} GB at {contexts[-1]}, {lo['peak_gb']} GB at {contexts[0]}" if ok else "no CUDA rows", name)
    b1 = find(engine="bounded", batch=1, context=contexts[1] if len(contexts) > 1 else contexts[0], budget=budget)
    add("bounded_b1_ms", b1["ms_per_step"] if b1 else None, "at 32K" if b1 else "no row")
    bb = find(engine="bounded", batch=batch, context=batch_context, budget=budget)
    add("bounded_batch_tok_s", bb["tokens_per_s"] if bb else None, f"batch {batch}" if bb else "no row")
    return out


# issue 15's goals: (key, what, target, higher is better)
GOALS = [
    ("floor_fraction_b1", "bounded decode, batch 1: share of the bandwidth floor", 0.60, True),
    ("dense_over_bounded_longest", "dense / bounded step at the longest batch-1 context", 2.5, True),
    ("tokens_per_s_batch", "bounded decode at the largest batch: tokens/s", 8000.0, True),
    ("selection_share", "selection share of the kvpop_mlp training step", 0.02, False),
    ("ttft_warm_s", "seconds to the first token, warm compile cache", 20.0, False),
]


def run_goal_scripts(out: Path, *, budget: int, small: bool) -> dict:
    """bench_ttft.py and bench_train_step.py, each in its own process, their JSON beside ``out``
    (``<stem>_ttft.json``, ``<stem>_train_step.json``) -> {name: {"out", "rc", "error"}}."""
    here = Path(__file__).resolve().parent
    jobs = {
        "ttft": [here / "bench_ttft.py", "--budget", str(budget), *(["--small"] if small else [])],
        "train_step": [here / "bench_train_step.py", *(["--cpu-smoke"] if small else ["--model", "4b"])],
    }
    subs = {}
    for name, cmd in jobs.items():
        path = out.with_name(f"{out.stem}_{name}.json")
        print(f"--- goals: {name} -> {path}", flush=True)
        proc = run_script(cmd[0], [*cmd[1:], "--out", path])
        print(proc.stdout[-3000:], flush=True)
        subs[name] = {"out": str(path), "rc": proc.returncode, "error": proc.stderr[-2000:] if proc.returncode else None}
    return subs


def goals(rows: list[dict], subs: dict, *, budget: int, batch: int, contexts: list[int]) -> list[dict]:
    """Issue 15's table from this run's rows and the two scripts' JSON: one dict per goal with its
    value (None where it was not measured, with the reason), target and whether it is met."""
    def find(**kw):
        return next((r for r in rows if "ms_per_step" in r and all(r.get(k) == v for k, v in kw.items())), None)

    def load(name):
        sub = subs.get(name, {})
        return json.loads(Path(sub["out"]).read_text()) if sub.get("rc") == 0 and Path(sub.get("out", "")).is_file() else None

    got: dict[str, tuple[float | None, str]] = {}
    b1 = find(engine="bounded", batch=1, budget=budget, context=contexts[0])
    got["floor_fraction_b1"] = (b1["floor_fraction"], f"{b1['ms_per_step']} ms at {contexts[0]}") if b1 else (None, "no batch-1 row")
    bl, dl = find(engine="bounded", batch=1, budget=budget, context=contexts[-1]), find(engine="dense", batch=1, context=contexts[-1])
    got["dense_over_bounded_longest"] = ((round(dl["ms_per_step"] / bl["ms_per_step"], 3), f"at {contexts[-1]} tokens") if bl and dl
                                         else (None, "no batch-1 rows at the longest context"))
    bb = find(engine="bounded", batch=batch, budget=budget)
    got["tokens_per_s_batch"] = ((bb["tokens_per_s"], f"batch {batch}, {bb['ms_per_step']} ms") if bb else (None, f"no batch-{batch} row"))
    train = load("train_step")
    got["selection_share"] = ((round(train["summary"]["ratios"]["selection_share_of_kvpop_mlp_step"], 4), train["config"]["model"])
                              if train else (None, f"bench_train_step.py failed: {(subs.get('train_step') or {}).get('error')}"))
    ttft = load("ttft")
    warm = next((m for k, m in (ttft or {}).get("modes", {}).items() if k.startswith("warm")), None)
    got["ttft_warm_s"] = ((warm["to_first_token_s"], "cold, warm and eager in fresh processes") if warm
                          else (None, "no warm row (CUDA only)" if ttft else f"bench_ttft.py failed: {(subs.get('ttft') or {}).get('error')}"))
    table = []
    for key, what, target, higher in GOALS:
        value, how = got[key]
        met = None if value is None else (value >= target if higher else value <= target)
        table.append({"goal": key, "what": what, "value": value, "target": target, "met": met, "detail": how})
    return table


def print_goals(table: list[dict], title: str = "issue 15's goals") -> None:
    print(f"\n{title}")
    for g in table:
        status = "not measured" if g["met"] is None else ("met" if g["met"] else "MISSED")
        print(f"  {g['what']:<58} {g['value'] if g['value'] is not None else '-':>10}  target {g['target']:<8} {status:<12} {g['detail']}")


def summarize(info: dict, rows: list[dict]) -> None:
    """One table: absolute figures with the ratios beside them."""
    eager = next((r for r in rows if r["engine"] == "hf_eager_generate"), None)
    dense = {(r["batch"], r["context"], r.get("compile_mode")): r for r in rows if r["engine"] == "dense" and "ms_per_step" in r}
    print(f"\n{device_name()}, {info['model']}, copy bandwidth {info['copy_bandwidth_tb_s']} TB/s, weights {info['weight_gb']} GB")
    hdr = (f"{'engine':<18}{'compile':>8}{'B':>4}{'context':>9}{'budget':>7}{'ms/step':>9}{'tok/s':>9}{'floor%':>8}{'peak GB':>9}{'vs eager':>9}"
           f"{'vs dense':>9}{'warm-up s':>10}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['engine'] + ' ' + r.get('policy', ''):<18}{'':>8}{r['batch']:>4}{r['context']:>9}{r['budget'] or '':>7}  failed: {r['error'][:200]}")
            continue
        if "ms_per_step" not in r:
            print(f"{r['engine']:<18}{'':>8}{r['batch']:>4}{r['context']:>9}{'':>7}  does not fit: needs {r['needs_cache_gb']} GB of cache, "
                  f"{r['free_gb']} GB free")
            continue
        ve = f"{eager['ms_per_step'] / r['ms_per_step']:.1f}x" if eager and r["batch"] == 1 and r is not eager else ""
        d = dense.get((r["batch"], r["context"], r.get("compile_mode")))
        vd = f"{d['ms_per_step'] / r['ms_per_step']:.2f}x" if d and r["engine"] == "bounded" else ""
        pk = r.get("peak_gb", float("nan"))
        label = f"{r['engine']} {r['policy']}" if "policy" in r else r["engine"] + (" fused" if r.get("fused") else "")
        print(f"{label:<18}{r.get('compile_mode') or '-':>8}{r['batch']:>4}{r['context']:>9}{r['budget'] or '':>7}{r['ms_per_step']:>9.2f}"
              f"{r['tokens_per_s']:>9.1f}{100 * r['floor_fraction']:>7.0f}%{pk:>9.2f}{ve:>9}{vd:>9}{r.get('warmup_s', float('nan')):>10.1f}")
    pols = [r for r in rows if "path" in r]  # part 'policies' (the pooled rows name a policy too)
    if pols:
        print(f"\ndecode memory at {pols[0]['context']} tokens, batch 1, budget {pols[0]['budget']} (dense cache: {pols[0]['dense_kv_gb_at_context']} GB)")
        print(f"{'policy':<12}{'path':<28}{'cache GB':>9}{'peak above weights GB':>23}{'ms/step':>9}")
        for r in pols:
            print(f"{r['policy']:<12}{r['path']:<28}{r['cache_gb']:>9.3f}{r['peak_above_weights_gb']:>23.3f}{r['ms_per_step']:>9.2f}")


if __name__ == "__main__":
    main()
