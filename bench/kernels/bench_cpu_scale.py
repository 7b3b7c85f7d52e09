"""CPU cost at long context (S = 16,384): the selection and the mLSTM scorer's training form (chunkwise since 2026-12-01).

These were shape-only "runs quickly" tests in the default suite (tests/test_selection.py,
tests/test_mlstm.py); they are timings, so they live here. Each row prints seconds per call
(best of ``--reps``: the CPU may be shared) and a ratio against a baseline measured in the same run:

  (i)  eviction_times (wavelet matrix), B=1, Hk=8, packed rows   vs torch.sort of the same priorities
       ratio = ours / sort (how many sorts one selection costs)
  (ii) MLSTMScorer.raw_scores forward, one layer, Hk=8, D=128     vs its own cost at S=1024 x (S / 1024)
       ratio = t(S) / (t(1024) * S / 1024); 1 = linear in S, S / 1024 = quadratic

    PYTHONPATH=src python3 bench/kernels/bench_cpu_scale.py            # -> results/bench_cpu_scale/cpu.json
    PYTHONPATH=src python3 bench/kernels/bench_cpu_scale.py --small    # smoke test, S = 2048 -> results/bench_cpu_scale/cpu_small.json

Written through :func:`kvpop.provenance.write_result` (``--out`` to choose the file).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from kvpop.benchmarking import default_out, time_calls
from kvpop.mlstm import MLSTMScorer
from kvpop.provenance import write_result
from kvpop.selection import eviction_times


def best_of(fn, reps: int) -> tuple[float, object]:
    """(fastest of ``reps`` calls in seconds, the last result)."""
    t = time_calls(fn, reps=reps)
    return t.best, t.out


def packed_row(S: int, pad: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row: documents of S/16 and S/4 tokens, one filling the rest, then ``pad`` padding
    tokens -> doc_ids (1, S) (-1 = padding), pos (1, S)."""
    lens = [S // 16, S // 4]
    lens.append(S - pad - sum(lens))
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)] + [torch.full((pad,), -1)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(pad, dtype=torch.long)])
    return doc_ids[None], pos[None]


def bench_selection(S: int, Hk: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    doc_ids, pos = packed_row(S)
    prio = torch.randn(1, Hk, S, generator=gen)
    kw = dict(sinks=4, window=64, long_range=512)
    eviction_times(prio, doc_ids, pos, **kw)  # warm-up
    t_ours, e = best_of(lambda: eviction_times(prio, doc_ids, pos, **kw), reps)
    assert e.shape == (1, Hk, S)
    t_sort, _ = best_of(lambda: torch.sort(prio, dim=-1), reps)
    return {"S": S, "Hk": Hk, **kw, "eviction_times_s": t_ours, "sort_s": t_sort, "ratio": t_ours / t_sort}


def bench_mlstm(S: int, S_base: int, Hk: int, Dh: int, chunk: int, reps: int) -> dict:
    torch.manual_seed(0)
    sc = MLSTMScorer(1, Hk, Dh, chunk=chunk)
    k, v = torch.randn(1, Hk, S, Dh), torch.randn(1, Hk, S, Dh)

    def run(n: int):
        doc = torch.zeros(1, n, dtype=torch.long)  # one document: the worst case (full key range)
        return sc.raw_scores(0, k[..., :n, :], v[..., :n, :], doc_ids=doc, window=256)

    with torch.no_grad():
        run(min(64, S))  # warm-up
        t_base, _ = best_of(lambda: run(S_base), reps)
        t_big, r = best_of(lambda: run(S), reps)
    assert r.shape == (1, Hk, S) and torch.isfinite(r).all()
    scale = S / S_base
    return {
        "S": S, "S_base": S_base, "Hk": Hk, "head_dim": Dh, "chunk": chunk,
        "raw_scores_s": t_big, "raw_scores_base_s": t_base, "ratio": t_big / (t_base * scale),
        "exponent": math.log(t_big / t_base) / math.log(scale) if scale > 1 else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=16384, help="sequence length S")
    ap.add_argument("--base-seq", type=int, default=1024, help="the mLSTM baseline length")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--small", action="store_true", help="smoke test: S=2048, base 512, one rep")
    ap.add_argument("--out", type=Path, default=None, help="the result JSON (default: results/bench_cpu_scale/cpu[_small].json)")
    args = ap.parse_args()
    if args.small:
        args.seq, args.base_seq, args.reps = 2048, 512, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    res = {"threads": torch.get_num_threads()}
    sel = res["selection"] = bench_selection(args.seq, args.kv_heads, args.reps)
    print(f"(i)  eviction_times S={sel['S']} Hk={sel['Hk']}: {sel['eviction_times_s']:.4f} s/call"
          f"  | torch.sort {sel['sort_s']:.4f} s/call  | ratio ours/sort {sel['ratio']:.1f}x")
    ml = res["mlstm"] = bench_mlstm(args.seq, args.base_seq, args.kv_heads, args.head_dim, args.chunk, args.reps)
    print(f"(ii) raw_scores fwd S={ml['S']} Hk={ml['Hk']} D={ml['head_dim']} chunk={ml['chunk']}: {ml['raw_scores_s']:.3f} s/call"
          f"  | S={ml['S_base']}: {ml['raw_scores_base_s']:.4f} s/call  | ratio vs linear scaling {ml['ratio']:.2f}"
          f" (t ~ S^{ml['exponent']:.2f})")
    print(f"threads={res['threads']}")
    out = write_result(args.out or default_out(__file__, small=args.small, cuda=False), res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
