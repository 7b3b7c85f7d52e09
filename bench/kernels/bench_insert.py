"""The fused insert kernel (kvpop.kernels.insert) alone: microseconds per launch for each launch setting.

    PYTHONPATH=src python3 bench/kernels/bench_insert.py                  # -> results/bench_insert/h200.json
    PYTHONPATH=src python3 bench/kernels/bench_insert.py --budgets 2048 --batches 1 --out /tmp/insert.json

One layer's buffers of the Qwen3-4B engine (8 KV heads, head_dim 128, scorer width 64) at budget
2,048 and 4,096, batch 1 and 64, kvpop_mlp's rule (MLP + decay) with every long-range slot full; each
setting's launches are captured in one CUDA graph (as the engine's step replays them) and timed over
its replays (:func:`kvpop.benchmarking.cuda_graph_seconds`). ``kvpop.kernels.insert.launch_config`` holds
the setting the engine uses (the fastest here). Written through :func:`kvpop.provenance.write_result`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from kvpop.benchmarking import cuda_graph_seconds, default_out
from kvpop.kernels import insert as ins
from kvpop.provenance import write_result


def time_launches(fn, reps: int = 200) -> float:
    """Mean microseconds of ``fn`` over ``reps`` calls captured in one CUDA graph, replayed 5 times."""

    def launches():
        for _ in range(reps):
            fn()

    s, _ = cuda_graph_seconds(launches, replays=5, warmup=1)
    return s * 1e6 / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="default: results/bench_insert/<device>.json")
    ap.add_argument("--block-d", default="16,32,64,128")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--budgets", default="2048,4096")
    ap.add_argument("--batches", default="1,64")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_insert.py times a Triton kernel: it needs a CUDA device")
    dev = torch.device("cuda")
    Hk, D, F, sinks, window = 8, 128, 64, 4, 256
    gen = torch.Generator(dev).manual_seed(0)
    rows = []
    for budget, B in itertools.product(map(int, args.budgets.split(",")), map(int, args.batches.split(","))):
        T, lr = budget, sinks + window
        keys = torch.randn(B, Hk, T, D, device=dev, generator=gen, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        pos = torch.randperm(10 * T, device=dev, generator=gen)[:T].sort().values.expand(B, Hk, T).contiguous()  # (B, Hk, T) int64
        prio = torch.randn(B, Hk, T, device=dev, generator=gen, dtype=torch.float64)
        k, v = torch.randn(B, Hk, D, device=dev, dtype=torch.bfloat16), torch.randn(B, Hk, D, device=dev, dtype=torch.bfloat16)
        p = torch.tensor(10 * T, device=dev)  # 0-d int64: the new token, past the window
        at = torch.tensor([sinks + 7], device=dev)
        w1 = torch.randn(Hk, 2 * D, F, device=dev, generator=gen) * 0.05
        b1, w2 = torch.randn(Hk, F, device=dev, generator=gen), torch.randn(Hk, F, device=dev, generator=gen)
        b2, lg = torch.randn(Hk, device=dev, generator=gen), torch.full((Hk,), -1e-4, device=dev, dtype=torch.float64)

        call = functools.partial(ins.insert_token, keys, values, pos, prio, k, v, p, at, w1, b1, w2, b2, lg, lr, T, sinks + window, window,
                                 True, True)

        for bd, w in itertools.product(map(int, args.block_d.split(",")), map(int, args.warps.split(","))):
            ins.LAUNCH.update(block_d=bd, num_warps=w)
            us = time_launches(call)
            rows.append({"budget": budget, "batch": B, "block_d": bd, "num_warps": w, "us_per_launch": round(us, 2)})
            print(json.dumps(rows[-1]), flush=True)
    ins.LAUNCH.clear()
    info = {"kv_heads": Hk, "head_dim": D, "scorer_hidden": F, "timer": "CUDA events over CUDA-graph replays of 200 launches"}
    write_result(args.out or default_out(__file__), {"info": info, "rows": rows})


if __name__ == "__main__":
    main()
