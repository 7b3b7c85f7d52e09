"""CPU threads for decoding: 1 thread vs every core, on an idle machine and with one core busy.

``kvpop.threads`` chooses the thread count from the cores free when a process starts. This measures
why: greedy decoding of 48 tokens after a 600-token prompt with the bounded cache (``kvpop.decode.generate``,
the fast path where it applies), for an export (default: the CPU pipeline's ``kvpop_mlp``), each
configuration after one warm-up call; "busy" runs a spinning process on one core meanwhile. Prints
tokens/s and the ratio to 1 thread in the same condition, and what ``auto`` picks.

    PYTHONPATH=src .venv/bin/python bench/bench_threads.py     # -> results/bench_threads/cpu.json
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvpop.benchmarking import default_out
from kvpop.decode import generate
from kvpop.export import load_export
from kvpop.geometry import CacheLayout
from kvpop.provenance import write_result
from kvpop.threads import auto_threads, usable_cores


def tokens_per_s(model, tok, pol, meta, ids, threads: int) -> float:
    torch.set_num_threads(threads)
    kw = dict(layout=CacheLayout(meta["budget"], meta["sinks"], meta["window"]), max_new_tokens=48)
    generate(model, tok, pol, ids, **kw)  # warm-up
    return generate(model, tok, pol, ids, **kw)[1].tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", default="models/export/kvpop_mlp")
    ap.add_argument("--out", type=Path, default=None, help="default: results/bench_threads/cpu.json")
    args = ap.parse_args()
    model, tok, pol, meta = load_export(args.export)
    model.eval()
    ids = tok("Let apple = 381. Let pear = 22. " * 40).input_ids[:600]
    cores = usable_cores()
    counts = sorted({1, cores})
    res = {"export": args.export, "cores": cores, "prompt_tokens": len(ids), "new_tokens": 48, "tokens_per_s": {}}
    for cond in ("idle", "one core busy"):
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if cond != "idle" else None
        try:
            if spin is not None:
                time.sleep(0.5)
            res.setdefault("auto_picks", {})[cond] = auto_threads()
            res["tokens_per_s"][cond] = {n: round(tokens_per_s(model, tok, pol, meta, ids, n), 2) for n in counts}
        finally:
            if spin is not None:
                spin.kill()
    print(f"{'condition':<16}{'threads':>8}{'tokens/s':>10}{'vs 1 thread':>13}   auto picks")
    for cond, by in res["tokens_per_s"].items():
        for n, v in by.items():
            print(f"{cond:<16}{n:>8}{v:>10.2f}{v / by[1]:>12.2f}x   {res['auto_picks'][cond] if n == counts[0] else ''}")
    write_result(args.out or default_out(__file__, cuda=False), res)


if __name__ == "__main__":
    main()
