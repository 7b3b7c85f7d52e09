"""Scorer fit against the frozen teacher: each variant's target ceiling vs its fitted scorer vs baselines.

The work is :mod:`kvpop.probe` (read its docstring); this script parses flags, reads the pipeline's own
outputs (the teacher folder ``models/base``, the filter stage's ``data/filtered/train.jsonl`` and
``eval.jsonl``; run ``dvc repro filter`` first), calls :func:`kvpop.probe.run_probe` and writes the result
with its provenance (:func:`kvpop.provenance.write_result`) to ``results/scorer_fit/<name>.json``.

A variant is the params file with dotted overrides, comma-separated, as ``dvc exp run -S`` takes them;
``--variant`` repeats, and without one the params file itself is the only variant:

    PYTHONPATH=src .venv/bin/python bench/scorer_fit.py --epochs 3 \\
        --variant train.target=max,train.policies=[kvpop_mlp] \\
        --variant train.target=max.model,train.boundary_weight=regret,train.policies=[kvpop_mlp] \\
        --one-pool --out max-vs-model

The teacher cache (``--cache``, default ``.cache/scorer_fit/teacher-<key>.pt``, the key naming the
teacher's weights, the training traces and the window) is reused by later calls with the same inputs.
Bad flags, overrides, files and caches exit with status 2 and a message naming them.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from kvpop.config import ParamsError, load_params
from kvpop.probe import CacheError, ProbeError, make_variant, mix_records, read_records, run_probe, split_overrides

USAGE = ("scorer_fit.py [--params P] [--variant K=V[,K=V...]]... [--epochs N] [--train-traces N] [--eval-traces N] [--one-pool] "
         "[--mix N] [--other-text N] [--cache FILE] [--out NAME] [--device DEV] [--base DIR] [--data DIR]")


def whole(least: int):
    """An argparse type: a whole number >= ``least``."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < least:
            raise argparse.ArgumentTypeError(f"{text} must be >= {least}")
        return n

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(usage=USAGE, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml", help="the pipeline's params file: budget, sinks, window, seed and train.*")
    ap.add_argument("--variant", action="append", default=[], metavar="K=V[,K=V...]",
                    help="dotted overrides of train.* and seed, comma-separated (repeatable; default: the params as they are)")
    ap.add_argument("--epochs", type=whole(1), default=1, help="passes over the cached training traces per fit")
    ap.add_argument("--train-traces", type=whole(1), default=16, help="the first N records of <data>/train.jsonl")
    ap.add_argument("--eval-traces", type=whole(1), default=8, help="the first N records of <data>/eval.jsonl")
    ap.add_argument("--one-pool", action="store_true", help="also rank every row that can be ranked so with one pool of slots for "
                    "the whole model (kvpop.evaluate.one_pool_twin)")
    ap.add_argument("--mix", type=whole(0), default=0, help="also train on N pieces each of code and prose (kvpop.data.other_text, "
                    "as filter.other_text), at most filter.max_tokens tokens each")
    ap.add_argument("--other-text", type=whole(0), default=0, help="also score every row on N held-out pieces each of code and prose "
                    "(kvpop.data.other_text.held_out_records, at most filter.max_tokens tokens each; KL to the dense teacher)")
    ap.add_argument("--cache", type=Path, default=None, help="the teacher cache file (default .cache/scorer_fit/teacher-<key>.pt)")
    ap.add_argument("--out", default="scorer_fit", help="the result's name: results/scorer_fit/<name>.json")
    ap.add_argument("--device", default=None, help="where the teacher, the cache and the fits live (default: cuda where there is one)")
    ap.add_argument("--base", type=Path, default=Path("models/base"), help="the teacher folder (the base_model stage's output)")
    ap.add_argument("--data", type=Path, default=Path("data/filtered"), help="the filter stage's folder (train.jsonl, eval.jsonl)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # argparse names a bad flag and exits with status 2
    try:
        if "/" in args.out or args.out.endswith(".json") or not args.out.strip():
            raise ProbeError(f"--out {args.out!r}: a name (the file is results/scorer_fit/<name>.json)")
        params = load_params(args.params)
        variants = [make_variant(params, split_overrides(v)) for v in args.variant] or [make_variant(params)]
        for path in (args.base / "config.json", args.data / "train.jsonl", args.data / "eval.jsonl"):
            if not path.is_file():
                raise ProbeError(f"{path} not found: the pipeline's outputs come first (dvc repro filter)")
        import torch

        from kvpop.evaluate import pad_records
        from kvpop.modeling import load_model
        from kvpop.provenance import write_result
        from kvpop.threads import set_threads

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ProbeError(f"--device {device}: no CUDA device is visible here (use --device cpu)")
        set_threads(None)  # $KVPOP_THREADS, else the cores free now
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.base)
        teacher = load_model(args.base, "float32").to(device)
        train = read_records(args.data / "train.jsonl", args.train_traces)
        if args.mix:
            train += mix_records(tok, args.mix, max_tokens=params.filter.max_tokens)
        evals = read_records(args.data / "eval.jsonl", args.eval_traces)
        if torch.device(device).type == "cuda":  # one shape: one FlexAttention compile (the CPU runs SDPA, unpadded)
            evals = pad_records(evals, max(len(r["input_ids"]) for r in evals), tok.pad_token_id if tok.pad_token_id is not None else 0)
        cache = args.cache
        if cache is None:
            key = hashlib.sha256(f"{args.base.resolve()}|{args.data.resolve()}|{len(train)}|{args.mix}|{params.window}".encode()).hexdigest()
            cache = Path(".cache/scorer_fit") / f"teacher-{key[:12]}.pt"
        other = None
        if args.other_text:
            from kvpop.data.other_text import KINDS, held_out_records, token_ids

            other = {kind: held_out_records(token_ids(tok), kind, args.other_text, max_tokens=params.filter.max_tokens) for kind in KINDS}
        doc = run_probe(teacher, params, variants, train, evals, epochs=args.epochs, one_pool=args.one_pool, cache=cache, device=device,
                        log=lambda s: print(f"[scorer_fit] {s}", file=sys.stderr, flush=True), other_text=other)
        doc = {"params": str(args.params), "base": str(args.base), "data": str(args.data), "mix": args.mix, "other_text_pieces": args.other_text,
               **doc}
        out = write_result(Path("results/scorer_fit") / f"{args.out}.json", doc)
    except (ProbeError, ParamsError, CacheError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"budget {params.budget} (sinks {params.sinks}, window {params.window}); {doc['train_traces']} training traces x "
          f"{args.epochs} epochs, frozen teacher; {doc['eval_traces']} held-out traces")
    kinds = list(doc.get("other_text", {}))
    print(f"{'row':<64}{'KL':>10}{'top-1':>8}{'quote acc':>10}" + "".join(f"{'KL, ' + k:>12}" for k in kinds))
    for name, m in doc["rows"].items():
        cols = "".join(f"{doc['other_text'][k][name]['kl']:>12.4f}" if name in doc["other_text"][k] else f"{'-':>12}" for k in kinds)
        print(f"{name:<64}{m['kl']:>10.4f}{m['top1_agreement']:>8.3f}{m['quote_accuracy']:>10.3f}" + cols)
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
