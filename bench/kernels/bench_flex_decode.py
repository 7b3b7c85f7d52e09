"""FlexAttention's decode kernel at the engine's shapes, over a sweep of its kernel options.

The decode step's attention as :class:`kvpop.decode.DecodeEngine` calls it: one query per row and
query head over ``B x Hk x T`` cache slots (:func:`kvpop.decode.engine.slot_mask_mod` over every
slot, :func:`kvpop.decode.engine.block_mask`, ``enable_gqa``), bf16, Qwen3-4B's heads by default
(32 query / 8 KV, head_dim 128) and budget 2,048. ``--layers`` separate buffers (36, as the engine
holds), so that no call finds its keys in L2 from the call before; the calls are compiled with
``fullgraph`` (as the engine compiles its layer) and replayed from one CUDA graph.

For each batch: flex's own choice (no options), then ``SPLIT_KV`` (the number of programs per row
and KV head), then ``BLOCK_N`` x ``num_warps`` at the best split, then ``num_stages`` at the best of
those. Each row: microseconds per call (per layer), the floor (the keys' and values' bytes at the
card's copy bandwidth, measured in the run) and the share of it reached, and the largest difference
from the default's output (the options change the tiling and the split's reduction order, not the
result). On an H200 at batch 64 (results/bench_flex_decode_h200.json) flex's own choice, one program
per row and KV head, was already the fastest and reads the keys and values at 89% of the copy
bandwidth; splitting the slots over more programs was slower. The engine therefore passes no options.

    PYTHONPATH=src python3 bench/kernels/bench_flex_decode.py         # -> results/bench_flex_decode/h200.json
    PYTHONPATH=src python3 bench/kernels/bench_flex_decode.py --batches 64 --out /tmp/f.json

Written through :func:`kvpop.provenance.write_result` after every row.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from kvpop.benchmarking import copy_bandwidth, cuda_graph_seconds, default_out
from kvpop.decode.engine import BLOCK, block_mask, slot_mask_mod
from kvpop.provenance import write_result


def make_call(opts: dict | None, *, G: int, scale: float, kv_blocks: torch.Tensor, kv_indices: torch.Tensor):
    """The engine's decode attention with kernel options ``opts``, compiled on its own."""
    torch._dynamo.reset()  # a fresh compile per setting (the options are baked into the kernel)

    def call(q, k, v, pos, p):  # q (B, H, 1, D); k, v (B, Hk, T, D); pos (B, Hk, T) int64; p () int64
        bm = block_mask(slot_mask_mod(pos, p, G), kv_blocks, 1, k.shape[2], kv_indices)
        return flex_attention(q, k, v, block_mask=bm, scale=scale, enable_gqa=True, kernel_options=opts)

    return torch.compile(call, fullgraph=True, dynamic=False)


def time_setting(fn, bufs: list[tuple], p: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    """Microseconds per call of ``fn`` over every layer's buffers, replayed from one CUDA graph
    (:func:`kvpop.benchmarking.cuda_graph_seconds`); the last layer's output."""
    s, outs = cuda_graph_seconds(lambda: [fn(q, k, v, pos, p) for q, k, v, pos in bufs], replays=reps, warmup=1)
    return s * 1e6 / len(bufs), outs[-1]


def result_row(B: int, stage: str, opts: dict | None, us: float, out: torch.Tensor, *, floor_us: float, base_us: float,
               ref: torch.Tensor) -> dict:
    """One setting's row: time, floor share, speed-up over flex's own choice, difference from its output."""
    return {"batch": B, "stage": stage, "options": opts, "us_per_call": round(us, 2), "floor_us": round(floor_us, 2),
            "floor_fraction": round(floor_us / us, 3), "vs_default": round(base_us / us, 3),
            "max_abs_diff_vs_default": float((out.float() - ref.float()).abs().max())}


def settings(B: int, Hk: int, sms: int, best: dict) -> dict[str, list[dict]]:
    """The sweep's stages: the split, then the tile and warps at the best split, then the stages."""
    default_split = max(sms // (B * Hk) * 2, 1)  # flex's own choice (torch's get_split_k)
    splits = sorted({max(default_split // 4, 1), max(default_split // 2, 1), default_split, default_split * 2} | ({2, 3, 4} if default_split == 1 else set()))
    return {
        "split": [{"SPLIT_KV": s} for s in splits],
        "tile": [{**best, "BLOCK_N": n, "num_warps": w} for n in (32, 64, 128) for w in (2, 4, 8)],
        "stages": [{**best, "num_stages": st} for st in (1, 2, 3)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="default: results/bench_flex_decode/<device>.json")
    ap.add_argument("--batches", default="64,1")
    ap.add_argument("--slots", type=int, default=2048, help="cache slots per row and KV head (the budget)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--stages", default="split,tile,stages", help="which of the sweep's stages to run, in order")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_flex_decode.py measures FlexAttention's CUDA decode kernel: it needs a CUDA device")
    args.out = args.out or default_out(__file__)
    dev = torch.device("cuda")
    H, Hk, D, T, L = args.heads, args.kv_heads, args.head_dim, -(-args.slots // BLOCK) * BLOCK, args.layers
    G, scale = H // Hk, D**-0.5
    bw = copy_bandwidth(dev, 4 << 30)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    info = {"heads": H, "kv_heads": Hk, "head_dim": D, "slots": T, "layers": L, "dtype": "bfloat16", "sms": sms,
            "copy_bandwidth_tb_s": round(bw / 1e12, 3), "timer": "CUDA events over CUDA-graph replays of every layer's call"}
    print(json.dumps(info), flush=True)
    rows: list[dict] = []
    kv_blocks = torch.full((1,), T // BLOCK, dtype=torch.int32, device=dev)
    kv_indices = torch.arange(T // BLOCK, dtype=torch.int32, device=dev).view(1, 1, 1, -1)
    p = torch.tensor(T + 1000, dtype=torch.int64, device=dev)  # every slot holds an earlier token
    for B in map(int, args.batches.split(",")):
        g = torch.Generator(device=dev).manual_seed(B)
        bufs = [(torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16, generator=g),
                 torch.randn(B, Hk, T, D, device=dev, dtype=torch.bfloat16, generator=g),
                 torch.randn(B, Hk, T, D, device=dev, dtype=torch.bfloat16, generator=g),
                 torch.randperm(T + 1000, device=dev, generator=g)[:T].expand(B, Hk, T).contiguous())
                for _ in range(L)]
        floor_us = 2 * B * Hk * T * D * 2 / bw * 1e6  # keys and values, bf16
        common = dict(G=G, scale=scale, kv_blocks=kv_blocks, kv_indices=kv_indices)
        t0 = time.time()
        base_us, ref = time_setting(make_call(None, **common), bufs, p, args.reps)

        def record(r: dict) -> None:
            rows.append(r)
            print(json.dumps(r), flush=True)
            write_result(args.out, {"info": info, "rows": rows})

        row = functools.partial(result_row, B, floor_us=floor_us, base_us=base_us, ref=ref)
        record(row("default", None, base_us, ref))
        best: dict = {}
        best_us = base_us
        for stage in args.stages.split(","):
            for opts in settings(B, Hk, sms, best)[stage]:
                try:
                    us, out = time_setting(make_call(opts, **common), bufs, p, args.reps)
                except Exception as e:  # a setting the template rejects (shared memory, tile shape): said, and the sweep goes on
                    record({"batch": B, "stage": stage, "options": opts, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                record(row(stage, opts, us, out))
                if us < best_us:
                    best, best_us = dict(opts), us
        summary = {"batch": B, "stage": "best", "options": best or None, "us_per_call": round(best_us, 2), "default_us": round(base_us, 2),
                   "speedup": round(base_us / best_us, 3), "floor_fraction": round(floor_us / best_us, 3), "sweep_s": round(time.time() - t0, 1)}
        record(summary)
        del bufs
        torch.cuda.empty_cache()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
