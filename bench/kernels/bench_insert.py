"""The fused insert kernel (kvpop.kernels.insert) alone: microseconds per launch for each launch setting.

    PYTHONPATH=src python3 bench/bench_insert.py --out /tmp/insert.json

One layer's buffers of the Qwen3-4B engine (8 KV heads, head_dim 128, scorer width 64) at budget
2,048 and 4,096, batch 1 and 64, kvpop_mlp's rule (MLP + decay) with every long-range slot full; each
setting's launches are captured in one CUDA graph (as the engine's step replays them) and timed over
its replays. ``kvpop.kernels.insert.launch_config`` holds the setting the engine uses (the fastest here).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch

from kvpop.kernels import insert as ins


def time_launches(fn, reps: int = 200) -> float:
    """Mean microseconds of ``fn`` over ``reps`` calls replayed from one CUDA graph."""
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--block-d", default="16,32,64,128")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--budgets", default="2048,4096")
    ap.add_argument("--batches", default="1,64")
    args = ap.parse_args()
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
    info = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "kv_heads": Hk, "head_dim": D, "scorer_hidden": F}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"info": info, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
