"""Kernel breakdown of one bounded decode step (Qwen3-4B architecture, budget 2048, batch 1 unless --batch).

    PYTHONPATH=src python3 bench/kernels/profile_decode.py                    # -> results/profile_decode/h200.json
    PYTHONPATH=src python3 bench/kernels/profile_decode.py --max-autotune --out /tmp/p.json   # GEMMs autotuned by inductor
    PYTHONPATH=src python3 bench/kernels/profile_decode.py --fused off --out /tmp/p.json      # the tensor insert instead of the kernel
    PYTHONPATH=src python3 bench/kernels/profile_decode.py --batch 64 --context 32768 --out /tmp/p64.json   # batch 64 at 32K
    PYTHONPATH=src python3 bench/kernels/profile_decode.py --policy dbtrimkv --out /tmp/pool.json   # the pooled engine (one pool)
    PYTHONPATH=src python3 bench/kernels/profile_decode.py --policy dbtrimkv --sorted --out /tmp/pool_sorted.json   # its selection sorted

Prints the ms per step (mean of 200 replays) above the kernel table, and writes both as JSON
(``ms_per_step``, the settings, the profiler's table as text under ``"table"``, every kernel's microseconds and launches
per step under ``"kernels"``, and their sum, ``gpu_busy_ms``, against the wall time) through
:func:`kvpop.provenance.write_result`. Needs CUDA.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvpop.benchmarking import default_out, fill_cache, pooled_policy, qwen3_4b_config, random_ids
from kvpop.decode.engine import DecodeEngine
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.provenance import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None, help="default: results/profile_decode/<device>[_small].json")
    ap.add_argument("--small", action="store_true", help="a tiny Qwen3 (smoke test; still CUDA)")
    ap.add_argument("--max-autotune", action="store_true", help="let inductor autotune the step's GEMMs (cuBLAS and Triton templates)")
    ap.add_argument("--fused", choices=("auto", "off", "on"), default="auto",
                    help="the fused insert kernel (kvpop.kernels.insert): the engine's default (auto: on with Triton), off or on")
    ap.add_argument("--batch", type=int, default=1, help="rows; above 1 the cache is put into its state at --context (kvpop.benchmarking.fill_cache)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--policy", default="kvpop_mlp", help="kvpop_mlp (the bounded engine), or a one-pool policy on the pooled engine "
                    "(bench_decode.py's: dbtrimkv with a random gate, kvpop_mlp_one_pool for OnePool(kvpop_mlp))")
    ap.add_argument("--sorted", action="store_true", help="the pooled step's selection by sorted topk and sort "
                    "(kvpop.decode.pooled.RANKED_SELECTION off: the twins of the default's pairwise ranks)")
    ap.add_argument("--split-kv", type=int, default=None, help="the pooled step's FlexAttention decode split (kvpop.decode.engine.POOL_SPLIT_KV)")
    ap.add_argument("--list-steps", type=int, default=None, help="the pooled engine's candidate list: steps per refresh (0: the whole "
                    "pool at every step; default: the engine's)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py profiles the CUDA kernels of a decode step: it needs a CUDA device")
    out = args.out or default_out(__file__, small=args.small)
    if args.max_autotune:
        import torch._inductor.config as ic

        ic.max_autotune_gemm = True
        ic.max_autotune_gemm_backends = "ATEN,TRITON"
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    cfg = qwen3_4b_config(args.small)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    policy = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim).to(dev)
    if args.policy != "kvpop_mlp":
        policy = pooled_policy("kvpop_mlp" if args.policy == "kvpop_mlp_one_pool" else args.policy, model, policy, dev)
    fused = {"auto": None, "off": False, "on": True}[args.fused]
    extra = {} if args.list_steps is None else {"list_steps": args.list_steps}
    if args.split_kv:
        import kvpop.decode.engine

        kvpop.decode.engine.POOL_SPLIT_KV = args.split_kv
    if args.sorted:
        import kvpop.decode.pooled

        kvpop.decode.pooled.RANKED_SELECTION = False
    eng = DecodeEngine(model, policy, layout=CacheLayout(2048, 4, 256), batch_size=args.batch, fused=fused, **extra)
    if args.batch == 1:
        eng.prefill(random_ids(1, args.context, cfg.vocab_size, 0, dev))
    else:
        fill_cache(eng, args.context, 0)
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    listed = 0  # pooled: steps over the candidate list (the others compete over the whole pool: PoolStore.refresh_list)
    t0 = time.perf_counter()
    for _ in range(200):
        eng.step()
        listed += eng.store is not None and eng.store.listed
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / 200 * 1e3
    mode = ("max-autotune" if args.max_autotune else "default") + (", fused insert" if eng.fused else ", tensor insert")
    head = f"{mode} compile: {ms:.3f} ms per step (batch {args.batch}, context {args.context}, budget 2048)\n"
    lists = (f", the pool's candidate list every {eng.store.list_steps} steps (it served {listed} of the 200)" if eng.store is not None
             else "")
    head = head.rstrip("\n") + lists + "\n"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    table = avg.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    print(head + table)
    # every kernel (the table keeps the top 40): name, microseconds and launches per step
    dev_us = lambda e: getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)  # noqa: E731
    kernels = sorted(({"name": e.key, "us_per_step": round(dev_us(e) / 10, 2), "calls_per_step": e.count / 10} for e in avg if dev_us(e) > 0),
                     key=lambda k: -k["us_per_step"])
    busy = sum(k["us_per_step"] for k in kernels)
    print(f"GPU busy {busy / 1e3:.3f} ms per step in {sum(k['calls_per_step'] for k in kernels):.0f} kernels, of {ms:.3f} ms wall")
    write_result(out, {"model": "qwen3-small" if args.small else "Qwen3-4B architecture (random weights)", "compile": mode, "policy": args.policy,
                       "engine": eng.kind, "selection": "sorted" if args.sorted else "ranked", "split_kv": args.split_kv,
                       "list_steps": eng.store.list_steps if eng.store is not None else None,
                       "listed_steps": listed if eng.store is not None else None,
                       "batch": args.batch, "context": args.context, "budget": 2048, "ms_per_step": round(ms, 3),
                       "steps_timed": 200, "steps_profiled": 10, "summary": head.strip(), "gpu_busy_ms": round(busy / 1e3, 3),
                       "kernels_per_step": sum(k["calls_per_step"] for k in kernels), "table": table, "kernels": kernels})


if __name__ == "__main__":
    main()
