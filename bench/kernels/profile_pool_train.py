"""Where the pool's training pass spends its time: :func:`kvpop.pool.pool_chunked` (SmolLM2-135M architecture, one row).

    PYTHONPATH=src python3 bench/kernels/profile_pool_train.py                           # kvpop_mlp_pool -> results/profile_pool_train/h200.json
    PYTHONPATH=src python3 bench/kernels/profile_pool_train.py --policy kvpop_pool       # the delayed mLSTM: chunks of window - delay
    PYTHONPATH=src python3 bench/kernels/profile_pool_train.py --small --out /tmp/p.json  # 2 layers, 512 tokens (smoke test; CPU too)

Every training step of a pool-trained policy (``kvpop_mlp_pool``, ``kvpop_pool``) first runs the student without
gradients through ``pool_chunked`` (``S / chunk`` model calls, the pool's closed form before each) for its eviction
times; at 4,096 tokens on an H200 that pass was 1.27 s of ``kvpop_mlp_pool``'s 2.16 s step and 4.43 s of
``kvpop_pool``'s 5.38 s (``bench/bench_pool_step.py``). One warm-up pass, then one under the profiler with host and
device activities; ranges split it into the closed form (``pool/times``), each layer's scores (``pool/scores``), its
mask (``pool/mask``) and attention (``pool/attention``). Prints the seconds of the pass, each range's share and the
two tables (by host time, which holds every synchronization's wait, and by device time), and writes them through
:func:`kvpop.provenance.write_result`.

``--twin``: also times the pass's layer-by-layer twin (``pool_chunked(..., stack_layers=False)``: each layer
scores its own chunk as it runs, as before 2026-12-05) in the same run, median of ``--reps`` passes each, and
prints the ratio. ``--ops`` (the CPU, eager): counts the operations (:class:`kvpop.benchmarking.OpCount`, views
aside) of one pass per chunk by part, both forms, and of the training forward and backward's scorer work
(:class:`kvpop.attention.SparseContext`, ``stack_scorers`` True and False: the pool's loss over every layer
scored once after the forward, or layer by layer): on a GPU each is a kernel launch, and at this model size
the pass is launch-bound.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

import kvpop.pool as pool_module
from kvpop.attention import ScorerTraining, SparseContext, register
from kvpop.benchmarking import OpCount, default_out, random_ids, smollm2_config, sync, time_calls
from kvpop.geometry import CacheLayout
from kvpop.masks import ChunkRows
from kvpop.policies import make_policy
from kvpop.pool import pool_chunked
from kvpop.provenance import write_result

RANGES = ("pool/times", "pool/scores", "pool/mask", "pool/attention")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="default: results/profile_pool_train/<device>[_small].json")
    ap.add_argument("--small", action="store_true", help="2 layers and 512 tokens (smoke test; CPU or CUDA)")
    ap.add_argument("--policy", default="kvpop_mlp_pool", choices=["kvpop_mlp_pool", "kvpop_pool", "dbtrimkv"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--twin", action="store_true", help="also time the layer-by-layer twin (stack_layers=False) in the same run")
    ap.add_argument("--reps", type=int, default=3, help="passes per form for --twin (median)")
    ap.add_argument("--ops", action="store_true", help="count operations per chunk by part, both forms, and the training scorers' (CPU)")
    args = ap.parse_args()
    if args.tokens < 1 or args.reps < 1:
        ap.error(f"--tokens and --reps must be >= 1, got {args.tokens} and {args.reps}")
    if args.ops and torch.cuda.is_available():
        ap.error("--ops counts the eager CPU path's operations: run it on the CPU")
    out = args.out or default_out(__file__, small=args.small, suffix="" if args.policy == "kvpop_mlp_pool" else args.policy)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = 2 if args.small else 30
    cfg = smollm2_config(layers)
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=register(),
                                                 dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    policy = make_policy(args.policy, num_layers=layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim).to(dev)
    tokens = min(args.tokens, 512) if args.small else args.tokens
    budget, window = (512, 256) if not args.small else (96, 32)
    layout = CacheLayout(budget, 4, window)
    ids = random_ids(1, tokens, 1000, 0, dev)
    pool_chunked(model, policy, ids, layout=layout)  # warm-up: every kernel compiled, the allocator filled
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        pool_chunked(model, policy, ids, layout=layout)
        sync(dev)
        pass_s = time.perf_counter() - t0
    avg = prof.key_averages()
    shares = {}
    for ev in avg:
        if ev.key in RANGES:
            shares[ev.key] = {"host_s": round(ev.cpu_time_total / 1e6, 4), "calls": ev.count}
    host = avg.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    device = avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70) if dev.type == "cuda" else ""
    chunk = policy.read_delay(window)
    C = window - (chunk or 0)
    head = (f"{args.policy}: pool_chunked over {tokens} tokens in {-(-tokens // C)} chunks of {C}: {pass_s:.3f} s; "
            + ", ".join(f"{k} {v['host_s']:.3f} s ({v['calls']} calls)" for k, v in shares.items()))
    print(head + "\n" + host + "\n" + device)
    extra = {}
    if args.twin:
        cuda = dev.type == "cuda"
        forms = {f: time_calls(lambda f=f: pool_chunked(model, policy, ids, layout=layout, stack_layers=f == "stacked"), reps=args.reps,
                               warmup=1, cuda=cuda).median for f in ("stacked", "layer_by_layer")}
        extra["twin_s"] = {f: round(t, 4) for f, t in forms.items()}
        extra["twin_ratio"] = round(forms["layer_by_layer"] / forms["stacked"], 3)
        print(f"pass, median of {args.reps}: stacked {forms['stacked']:.3f} s, layer by layer {forms['layer_by_layer']:.3f} s "
              f"({extra['twin_ratio']:.2f}x)")
    if args.ops:
        extra["ops_per_chunk"] = {f: count_pass(model, policy, ids, layout, stack_layers=f == "stacked") for f in ("stacked", "layer_by_layer")}
        if policy.learned and not policy.gated:
            extra["training_scorer_ops"] = {f: count_training(model, policy, ids, layout, stack=f == "stacked") for f in ("stacked", "layer_by_layer")}
        for key in ("ops_per_chunk", "training_scorer_ops"):
            if key in extra:
                print(key + ":", extra[key])
    write_result(out, {"what": f"the pool's training pass (kvpop.pool.pool_chunked, {args.policy}) under the profiler, host and device",
                       "model": f"SmolLM2-135M architecture{' (2 layers)' if args.small else ''}, random weights", "policy": args.policy,
                       "tokens": tokens, "budget": budget, "window": window, "chunk": C, "pass_s": round(pass_s, 4), "ranges": shares,
                       "summary": head, "table_host": host, "table_device": device, **extra})


def count_pass(model, policy, ids, layout, *, stack_layers: bool) -> dict[str, float]:
    """Operations of one pool_chunked pass per chunk, by part: each layer's scores (or the stacked call), its mask,
    its attention, the closed form's times, the rest (the model's own layers)."""
    counter = OpCount()
    for obj, name, label in [(pool_module.ChunkContext, "_score", "scores"), (ChunkRows, "__init__", "mask"), (ChunkRows, "allowed", "mask"),
                             (pool_module.F, "scaled_dot_product_attention", "attention"), (pool_module, "global_eviction_times", "times"),
                             (pool_module, "global_decaying_eviction_times", "times")]:
        counter.part(obj, name, label)
    try:
        with counter:
            pool_chunked(model, policy, ids, layout=layout, stack_layers=stack_layers)
    finally:
        counter.restore()
    delay = policy.read_delay(layout.window)
    chunks = -(-ids.shape[1] // (layout.window - (delay or 0)))
    per = {k: round(v / chunks, 1) for k, v in counter.counts.items()}
    return {**per, "total": round(sum(counter.counts.values()) / chunks, 1)}


def count_training(model, policy, ids, layout, *, stack: bool) -> dict[str, int]:
    """Operations of the training forward and backward under pool_chunked's times, in all (the model frozen for it,
    so the backward is the scorers' and their loss's; ``SparseContext.stack_scorers`` says how they run): the two
    forms differ only in the scorers' work."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    evict, _ = pool_chunked(model, policy, ids, layout=layout)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    counter = OpCount()
    try:
        with counter:
            ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout, scorer_training=ScorerTraining(weighting="uniform"),
                                         global_evict=evict, stack_scorers=stack)
            model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False, logits_to_keep=1)
            (loss,) = ctx.finish_scorer_losses()
            loss.backward()
    finally:
        policy.zero_grad(set_to_none=True)
        for p in trainable:
            p.requires_grad_(True)
    return {"total": sum(counter.counts.values())}


if __name__ == "__main__":
    main()
