"""Where one prefill chunk of the pooled engine spends its time (Qwen3-4B architecture, budget 2048, batch 1).

    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py                       # dbtrimkv -> results/profile_pool_prefill/h200.json
    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py --policy kvpop_mlp    # OnePool(kvpop_mlp): the static closed form
    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py --small --out /tmp/p.json   # a tiny Qwen3, runs on the CPU too

The engine is prefilled to ``--context`` tokens (chunks of ``window``), then ``--chunks`` more chunks run under
the profiler with host and device activities: the table (sorted by the host's total, which holds the waits of
every host synchronization, and by the device's) says what a chunk costs besides its attention and GEMMs.
Prints the seconds per chunk (mean over the profiled ones) and writes them, the settings and both tables
(text, under ``"table_host"`` and ``"table_device"``) through :func:`kvpop.provenance.write_result`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from kvpop.benchmarking import default_out, pooled_policy, qwen3_4b_config, random_ids, sync
from kvpop.decode.engine import DecodeEngine
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.provenance import write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None, help="default: results/profile_pool_prefill/<device>[_small].json")
    ap.add_argument("--small", action="store_true", help="a tiny Qwen3 and a short context (smoke test; CPU or CUDA)")
    ap.add_argument("--policy", default="dbtrimkv", help="dbtrimkv (a random gate: decaying ranks) or kvpop_mlp (OnePool of a random scorer)")
    ap.add_argument("--context", type=int, default=4096, help="tokens prefilled before the profiled chunks")
    ap.add_argument("--chunks", type=int, default=2, help="chunks of `window` tokens profiled")
    ap.add_argument("--replay", action="store_true", help="the chunk's competitions replayed query by query (the closed form's twin)")
    args = ap.parse_args()
    if args.chunks < 1 or args.context < 0:
        ap.error(f"--chunks must be >= 1 and --context >= 0, got {args.chunks} and {args.context}")
    out = args.out or default_out(__file__, small=args.small)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = qwen3_4b_config(args.small)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    scorer = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim).to(dev)
    policy = pooled_policy(args.policy, model, scorer, dev)
    budget, window = (2048, 256) if not args.small else (96, 32)
    context = args.context if not args.small else min(args.context, 256)
    eng = DecodeEngine(model, policy, layout=CacheLayout(budget, 4, window), batch_size=1)
    eng.pool_closed_form = not args.replay
    ids = random_ids(1, context + args.chunks * window, cfg.vocab_size, 0, dev)
    t0 = time.perf_counter()
    eng.prefill(ids[:, :context])
    sync(dev)
    warm_s = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for c in range(args.chunks):
            eng.prefill(ids[:, context + c * window : context + (c + 1) * window])
        sync(dev)
        chunk_s = (time.perf_counter() - t0) / args.chunks
    avg = prof.key_averages()
    host = avg.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    device = avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70) if dev.type == "cuda" else ""
    head = (f"{args.policy} ({'replayed' if args.replay else 'one pass'}): {chunk_s:.3f} s per {window}-token chunk after {context} tokens "
            f"(the prefill to there: {warm_s:.1f} s, {context / window:.0f} chunks)")
    print(head + "\n" + host + "\n" + device)
    write_result(out, {"what": f"one prefill chunk of the pooled engine ({args.policy}) under the profiler, host and device",
                       "model": "qwen3-small" if args.small else "Qwen3-4B architecture (random weights)", "policy": args.policy,
                       "one_pass": not args.replay, "budget": budget, "window": window, "context": context, "chunks": args.chunks,
                       "s_per_chunk": round(chunk_s, 4), "prefill_to_context_s": round(warm_s, 2), "summary": head,
                       "table_host": host, "table_device": device})


if __name__ == "__main__":
    main()
