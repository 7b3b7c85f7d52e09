"""Stage evaluate: teacher-forced fidelity of every policy at the run's budget on held-out traces."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import console, fail, params, write_json
from rich.console import Console
from rich.table import Table

from kvpop import tracking
from kvpop.evaluate import Candidate, evaluate_fidelity, score_positions
from kvpop.export import CheckpointError, load_export
from kvpop.filter import read_jsonl
from kvpop.modeling import load_model, model_shape
from kvpop.policies import make_policy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--data", default="data/filtered/eval.jsonl")
    ap.add_argument("--exports", default="models/export")
    ap.add_argument("--out", default="metrics/eval.json")
    args = ap.parse_args()
    p = params()
    cfg = p.evaluate
    if not Path(args.data).is_file():
        fail(f"held-out data not found: {args.data} (run the filter stage)")
    records = list(read_jsonl(args.data))[: cfg.max_traces]
    if not records:
        fail(f"{args.data} holds no traces")
    torch.manual_seed(p.seed)
    teacher = load_model(args.base, cfg.precision).eval()
    shape = model_shape(teacher)
    candidates = []
    for name in cfg.policies:
        try:
            pol = make_policy(name, **{k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")})
        except ValueError as err:
            fail(f"evaluate.policies: {err}")
        candidates.append(Candidate(name, teacher, pol))
    for name in p.train.policies:
        try:
            model, _, pol, meta = load_export(Path(args.exports) / name, cfg.precision)
        except (CheckpointError, FileNotFoundError, RuntimeError) as err:
            fail(f"trained policy {name!r}: {err}")
        if (meta["budget"], meta["sinks"], meta["window"]) != (p.budget, p.sinks, p.window):
            fail(f"{name} was exported for budget/sinks/window {meta['budget']}/{meta['sinks']}/{meta['window']}, "
                 f"params say {p.budget}/{p.sinks}/{p.window}")
        candidates.append(Candidate(name, model.eval(), pol))

    eval_tokens = sum(score_positions(r)[0].numel() for r in records)
    lengths = [len(r["input_ids"]) for r in records]
    logged = {"budget": p.budget, "sinks": p.sinks, "window": p.window, "evaluate": cfg.model_dump(), "train.policies": p.train.policies}
    with tracking.stage_run("evaluate", logged) as run:
        console.print(f"[bold]evaluate[/]: {len(records)} traces ({min(lengths)}-{max(lengths)} tokens), "
                      f"budget {p.budget}, policies {[c.name for c in candidates]}")
        results = evaluate_fidelity(
            records, teacher, candidates, budget=p.budget, sinks=p.sinks, window=p.window,
            progress=lambda i, n: console.print(f"  trace {i}/{n}", highlight=False),
        )
        out = {"policies": results, "budget": p.budget, "eval_tokens": eval_tokens, "eval_traces": len(records),
               "mean_trace_tokens": sum(lengths) / len(lengths)}
        write_json(args.out, out)
        for name, m in results.items():
            run.metrics(m, prefix=f"{name}.")
        run.metrics({"budget": p.budget, "eval_tokens": eval_tokens})
        run.artifact(args.out)

    table = Table(title=f"teacher-forced fidelity, budget {p.budget} ({eval_tokens} tokens)")
    for col in ("policy", "KL to dense", "top-1 agreement", "quote accuracy"):
        table.add_column(col, justify="right" if col != "policy" else "left")
    for name, m in results.items():
        table.add_row(name, f"{m['kl']:.4f}", f"{m['top1_agreement']:.3f}", f"{m['quote_accuracy']:.3f}")
    Console().print(table)  # the table goes to stdout, progress to stderr


if __name__ == "__main__":
    main()
