"""Training cost of the delayed mLSTM scorer: its chunkwise vs its parallel form, against the MLP scorer.

One layer shaped like the embedded model (SmolLM2-135M: 3 KV heads, head_dim 64; d_k = d_v = 16),
random keys and values, one document per row (the parallel form's worst case: every read-out
touches the key range from the row's start), window 256. Each row times forward + backward of
``raw_scores`` (the loss is a fixed random projection of the scores; gradients reach the scorer's
parameters, and the chunkwise and parallel forms checkpoint per chunk, as in training):

  mlstm parallel   ``MLSTMScorer(form="parallel")``: quadratic in S (chunk = read-out tokens per chunk)
  mlstm chunkwise  ``MLSTMScorer(form="chunkwise")``: linear in S (chunk = time-axis tokens per chunk)
  mlp              ``kvpop.scorer.MLPScorer.raw_scores`` (hidden 64), the baseline of every ratio

ratio = t(row) / t(mlp), measured at the same S in the same run. Seconds are the median of
``--reps`` calls after ``--warmup`` calls (:func:`kvpop.benchmarking.time_calls`: CUDA events on CUDA).
Written through :func:`kvpop.provenance.write_result` (default ``results/bench_mlstm/<device>[_small].json``).

    PYTHONPATH=src python3 bench/kernels/bench_mlstm.py                                  # CPU, S = 2048 4096 8192
    PYTHONPATH=src python3 bench/kernels/bench_mlstm.py --small                          # smoke test: S = 512 1024, one rep
    PYTHONPATH=src python3 bench/kernels/bench_mlstm.py --device cuda                    # -> results/bench_mlstm/h200.json
    PYTHONPATH=src python3 bench/kernels/bench_mlstm.py --seq 4096 --chunks 64 128 256 --no-parallel   # chunk sweep
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

from kvpop.benchmarking import default_out, time_calls
from kvpop.mlstm import MLSTMScorer
from kvpop.provenance import write_result
from kvpop.scorer import MLPScorer


def timeit(fn, *, warmup: int, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()``."""
    return time_calls(fn, warmup=warmup, reps=reps, cuda=cuda).median


def fwd_bwd(scorer, k, v, proj, **kw):
    """One forward + backward of ``scorer.raw_scores`` on layer 0; the grads are cleared first."""
    scorer.zero_grad(set_to_none=True)
    r = scorer.raw_scores(0, k, v, **kw)  # (B, Hk, S)
    (r * proj).sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192], help="sequence lengths S")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[256], help="chunkwise: time-axis chunk lengths L (one row each)")
    ap.add_argument("--parallel-chunk", type=int, default=256, help="parallel: read-out tokens per chunk")
    ap.add_argument("--no-parallel", action="store_true", help="skip the (quadratic) parallel form")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--small", action="store_true", help="smoke test: S = 512 1024, one rep, no warm-up")
    ap.add_argument("--out", type=Path, default=None, help="the result JSON (default: results/bench_mlstm/<device>[_small].json)")
    args = ap.parse_args()
    if args.small:
        args.seq, args.reps, args.warmup = [512, 1024], 1, 0
    if args.threads:
        torch.set_num_threads(args.threads)
    dev, cuda = torch.device(args.device), args.device == "cuda"
    B, Hk, Dh, W = args.batch, args.kv_heads, args.head_dim, args.window

    torch.manual_seed(0)
    mlp = MLPScorer(1, Hk, Dh).to(dev)
    with torch.no_grad():
        mlp.layers[0].w2.normal_()  # the zero-initialized output layer would give w1 no gradient
    forms = [] if args.no_parallel else [("mlstm parallel", "parallel", args.parallel_chunk)]
    forms += [("mlstm chunkwise", "chunkwise", L) for L in args.chunks]
    res = {"device": args.device, "threads": torch.get_num_threads(), "B": B, "Hk": Hk, "head_dim": Dh, "window": W, "d_k": 16, "d_v": 16, "rows": []}
    print(f"forward + backward of raw_scores, one layer: B={B} Hk={Hk} D={Dh} window={W}, one document per row; {args.device}, {res['threads']} threads")
    print(f"{'S':>6}  {'scorer':<16} {'chunk':>6}  {'seconds':>9}  {'ratio vs mlp':>12}")
    for S in args.seq:
        gen = torch.Generator().manual_seed(S)
        k, v = (torch.randn(B, Hk, S, Dh, generator=gen).to(dev) for _ in range(2))
        proj = torch.randn(B, Hk, S, generator=gen).to(dev)
        doc = torch.zeros(B, S, dtype=torch.long, device=dev)
        t_mlp = timeit(functools.partial(fwd_bwd, mlp, k, v, proj), warmup=args.warmup, reps=args.reps, cuda=cuda)
        rows = [("mlp", "", t_mlp)]
        for name, form, chunk in forms:
            torch.manual_seed(0)
            sc = MLSTMScorer(1, Hk, Dh, chunk=chunk, form=form).to(dev)
            t = timeit(functools.partial(fwd_bwd, sc, k, v, proj, doc_ids=doc, window=W), warmup=args.warmup, reps=args.reps, cuda=cuda)
            rows.append((name, chunk, t))
        for name, chunk, t in rows:
            print(f"{S:>6}  {name:<16} {chunk!s:>6}  {t:>9.4f}  {t / t_mlp:>11.2f}x")
            res["rows"].append({"S": S, "scorer": name, "chunk": chunk or None, "seconds": t, "ratio_vs_mlp": t / t_mlp})
    out = write_result(args.out or default_out(__file__, small=args.small, cuda=cuda), res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
