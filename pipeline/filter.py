"""Stage filter: math reasoning traces -> chat-formatted token sequences of at most filter.max_tokens."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from kvpop import tracking
from kvpop.data.other_text import KINDS, other_text_records, token_ids
from kvpop.data.sources import NEMOTRON_ID, iter_nemotron
from kvpop.data.synthetic import generate_traces
from kvpop.filter import FilterStats, filter_rows, write_jsonl

from common import Progress, console, fail, params, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default="models/base", help="teacher folder (its tokenizer and chat template)")
    ap.add_argument("--out", default="data/filtered")
    ap.add_argument("--metrics", default="metrics/filter.json")
    args = ap.parse_args()
    p = params()
    cfg = p.filter
    from transformers import AutoTokenizer

    if not (Path(args.base) / "tokenizer_config.json").is_file():
        fail(f"no tokenizer in {args.base} (run the base_model stage)")
    tok = AutoTokenizer.from_pretrained(args.base)
    with tracking.stage_run("filter", {"seed": p.seed, "filter": cfg.model_dump()}) as run:
        if cfg.source == "synthetic":
            s = cfg.synthetic
            shape = dict(min_chars=s.min_chars, max_chars=s.max_chars, num_values=s.num_values, num_recalls=s.num_recalls,
                         min_quote_distance_chars=s.min_quote_distance_chars)
            splits = {
                "train": generate_traces(s.train_traces, p.seed, **shape),
                # held out: another seed (filter.synthetic.eval_seed), so no evaluation trace was trained on
                "eval": generate_traces(s.eval_traces, p.eval_seed, **shape),
            }
            results = {name: filter_rows(rows, tok, max_tokens=cfg.max_tokens) for name, rows in splits.items()}
        else:
            n = cfg.nemotron
            console.print(f"streaming {n.data_files or NEMOTRON_ID} ({', '.join(n.splits)})")
            rows = iter_nemotron(n.splits, data_files=n.data_files)
            # the first eval_rows usable rows are held out, the next train_rows are for training
            results = {"eval": take_kept(rows, tok, cfg.max_tokens, n.eval_rows)}
            results["train"] = take_kept(rows, tok, cfg.max_tokens, n.train_rows)
        mixed = other_text(tok, cfg)
        if mixed:  # other kinds of text in the training rows (filter.other_text)
            results["train"] = (results["train"][0] + mixed, results["train"][1])
        out = Path(args.out)
        metrics = {}
        for name, (records, stats) in results.items():
            if not records:
                fail(f"the {name} split kept no trace ({stats.to_dict()}); check filter.* params")
            write_jsonl(records, out / f"{name}.jsonl")
            lengths = [len(r["input_ids"]) for r in records]
            metrics[name] = {**stats.to_dict(), "tokens": sum(lengths), "max_len": max(lengths), "mean_len": sum(lengths) / len(lengths),
                             "quote_tokens": sum(len(r["quote_positions"]) for r in records),
                             **({"other_text": {k: sum(r.get("kind") == k for r in records) for k in KINDS}} if name == "train" else {})}
        write_json(args.metrics, metrics)
        run.metrics(metrics)
        run.artifact(args.metrics)
    console.print(metrics)


def other_text(tok, cfg) -> list[dict]:
    """``filter.other_text`` pieces as training records (no quotes; every token trained on)."""
    out = []
    for kind in KINDS:
        n = getattr(cfg.other_text, kind)
        pieces = other_text_records(token_ids(tok), kind, n, max_tokens=cfg.max_tokens)
        if len(pieces) < n:
            console.print(f"[yellow]filter.other_text.{kind}: {n} pieces asked, {len(pieces)} available at max_tokens {cfg.max_tokens}")
        out += [{"id": f"other-{kind}-{i}", **r, "quote_positions": [], "quote_source_positions": []} for i, r in enumerate(pieces)]
    return out


def take_kept(rows, tok, max_tokens: int, wanted: int) -> tuple[list[dict], FilterStats]:
    """Filter rows from a stream until ``wanted`` are kept; skips are counted, the rest is left unread."""
    records, skipped, seen = [], Counter(), 0
    with Progress("filter: kept rows", wanted, every=max(1, wanted // 20)) as bar:
        for row in rows:
            kept, stats = filter_rows([row], tok, max_tokens=max_tokens)
            records += kept
            seen += stats.seen
            skipped.update(stats.skipped)
            if kept:
                bar.update(len(records), seen=seen)
            if len(records) >= wanted:
                break
    return records, FilterStats(seen=seen, kept=len(records), skipped=dict(skipped))


if __name__ == "__main__":
    main()
