"""Kernel breakdown of one bounded decode step (Qwen3-4B architecture, budget 2048, batch 1 unless --batch).

    PYTHONPATH=src:bench python3 bench/profile_decode.py --out results/profile_decode_h200.txt
    PYTHONPATH=src:bench python3 bench/profile_decode.py --max-autotune --out /tmp/p.txt   # GEMMs autotuned by inductor
    PYTHONPATH=src:bench python3 bench/profile_decode.py --fused off --out /tmp/p.txt      # the tensor insert instead of the kernel
    PYTHONPATH=src:bench python3 bench/profile_decode.py --batch 64 --context 32768 --out /tmp/p64.txt   # batch 64 at 32K

Prints the ms per step (mean of 200 replays) above the kernel table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvpop.decode.engine import DecodeEngine
from kvpop.policies import make_policy

from bench_decode import fill, qwen3_4b, random_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--max-autotune", action="store_true", help="let inductor autotune the step's GEMMs (cuBLAS and Triton templates)")
    ap.add_argument("--fused", choices=("auto", "off", "on"), default="auto",
                    help="the fused insert kernel (kvpop.kernels.insert): the engine's default (auto: on with Triton), off or on")
    ap.add_argument("--batch", type=int, default=1, help="rows; above 1 the cache is put into its state at --context (bench_decode's fill)")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args()
    if args.max_autotune:
        import torch._inductor.config as ic

        ic.max_autotune_gemm = True
        ic.max_autotune_gemm_backends = "ATEN,TRITON"
    from transformers import AutoModelForCausalLM

    dev = torch.device("cuda")
    cfg = qwen3_4b(args.small)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    policy = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim).to(dev)
    fused = {"auto": None, "off": False, "on": True}[args.fused]
    eng = DecodeEngine(model, policy, budget=2048, sinks=4, window=256, batch_size=args.batch, fused=fused)
    if args.batch == 1:
        eng.prefill(random_ids(1, args.context, cfg.vocab_size, 0, dev))
    else:
        fill(eng, args.context, 0)
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        eng.step()
    torch.cuda.synchronize()
    mode = ("max-autotune" if args.max_autotune else "default") + (", fused insert" if eng.fused else ", tensor insert")
    head = f"{mode} compile: {(time.perf_counter() - t0) / 200 * 1e3:.3f} ms per step (batch {args.batch}, context {args.context}, budget 2048)\n"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
    print(head + table)
    args.out.write_text(head + table)


if __name__ == "__main__":
    main()
