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
``--reps`` calls after ``--warmup`` calls (CUDA: synchronized around each call).

    PYTHONPATH=src python3 bench/bench_mlstm.py                                  # CPU, S = 2048 4096 8192
    PYTHONPATH=src python3 bench/bench_mlstm.py --seq 2048 4096 --reps 2
    PYTHONPATH=src python3 bench/bench_mlstm.py --device cuda --out results/bench_mlstm_h200.json
    PYTHONPATH=src python3 bench/bench_mlstm.py --seq 4096 --chunks 64 128 256 --no-parallel   # chunk sweep
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from kvpop.mlstm import MLSTMScorer
from kvpop.scorer import MLPScorer


def timeit(fn, *, warmup: int, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


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
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
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
    res = {"date": dt.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__, "device": args.device,
           "device_name": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
           "B": B, "Hk": Hk, "head_dim": Dh, "window": W, "d_k": 16, "d_v": 16, "rows": []}
    print(f"forward + backward of raw_scores, one layer: B={B} Hk={Hk} D={Dh} window={W}, one document per row; {res['device_name']}")
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
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
