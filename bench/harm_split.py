"""Where a trained policy's harm lies: its fine-tuned model, its scores, or the two together.

A trained export (``models/export/<policy>``) is a fine-tuned model and a scorer. This script scores three
candidates on the same rows, teacher-forced against the base model's dense attention
(:func:`kvpop.evaluate.evaluate_fidelity` on the held-out traces, :func:`kvpop.evaluate.evaluate_other_text`
on held-out code and prose):

* ``trained``: the fine-tuned model with its own scores (what the evaluate stage reports);
* ``finetuned_dense``: the fine-tuned model without eviction (what the fine-tuning alone moved);
* ``base_scores``: the base model's weights with the trained scores (what the eviction pattern alone costs).

Where ``base_scores`` is as far from dense as ``trained``, the harm lies in the scores; where
``finetuned_dense`` is, in the fine-tuned weights. An export trained with the model frozen (``model_lr`` 0: its
weights equal the base's) is scored once: ``base_scores`` is then ``trained`` and ``finetuned_dense`` dense (``"frozen":
true`` in the run). Run it in a checkout whose pipeline has run (params.yaml,
``models/base``, ``data/filtered/eval.jsonl``, the export); the pieces and traces are those of
``evaluate.other_text`` and ``evaluate.max_traces``:

    PYTHONPATH=src .venv/bin/python bench/harm_split.py --policy kvpop_mlp_pool --out results/harm_split/cpu.json

Several checkouts (one per setting) go into one file with ``--merge NAME=RESULT`` (repeatable): each an earlier
output of this script, kept under its name beside this run's (``--name``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: the three candidates, in the order they are reported
CANDIDATES = ("trained", "finetuned_dense", "base_scores")


def split(p, policy: str, *, base: Path, exports: Path, data: Path, device: str = "cpu") -> dict:
    """``{"traces": {candidate: {quote_accuracy, kl, top1_agreement}}, "other_text": {kind: {candidate: {...}}}}``
    for ``policy``'s export under ``exports`` (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from kvpop.data.other_text import held_out_records, token_ids
    from kvpop.evaluate import Candidate, evaluate_fidelity, evaluate_other_text
    from kvpop.export import load_export
    from kvpop.filter import read_jsonl
    from kvpop.modeling import load_model, model_shape
    from kvpop.policies import make_policy

    precision = p.evaluate.precision
    teacher = load_model(str(base), precision).to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    tuned, _, pol, _ = load_export(exports / policy, precision)
    tuned = tuned.to(device).eval()
    pol = pol.to(device)
    shape = {k: v for k, v in model_shape(teacher).items() if k != "num_heads"}
    # a model trained frozen (train.per_policy.<policy>.model_lr 0) is the base model: then base_scores is trained, and
    # finetuned_dense is the teacher's own forward; scored once each instead of three forwards per trace
    teacher_sd = teacher.state_dict()
    frozen = all(torch.equal(w, teacher_sd[k]) for k, w in tuned.state_dict().items())
    if frozen:
        tuned = teacher
    cands = [Candidate("trained", tuned, pol), Candidate("finetuned_dense", tuned, make_policy("dense", **shape))]
    if not frozen:
        cands.append(Candidate("base_scores", teacher, pol))

    def rows(res: dict) -> dict:
        return {n: res["trained" if frozen and n == "base_scores" else n] for n in CANDIDATES}

    torch.manual_seed(p.seed)
    records = read_jsonl(data)[: p.evaluate.max_traces]
    fid = rows(evaluate_fidelity(records, teacher, cands, layout=p.layout, device=device))
    out = {"traces": {n: {k: fid[n][k] for k in ("quote_accuracy", "kl", "top1_agreement")} for n in CANDIDATES},
           "eval_traces": len(records), "frozen": frozen}
    want = {k: n for k, n in p.evaluate.other_text.model_dump().items() if n}
    if want:
        pieces = {k: held_out_records(token_ids(tok), k, n, max_tokens=p.train.seq_len) for k, n in want.items()}
        out["other_text"] = {kind: rows(r) for kind, r in evaluate_other_text(pieces, teacher, cands, layout=p.layout, device=device).items()}
    return out


def table(runs: dict) -> str:
    """One Markdown row per (run, candidate): quotes and KL on the traces, KL on each kind of other text."""
    kinds = sorted({k for r in runs.values() for k in r.get("other_text", {})})
    lines = ["| run | candidate | quotes | KL | " + " | ".join(f"{k} KL" for k in kinds) + " |",
             "|---|---|---|---|" + "---|" * len(kinds)]
    for name, r in runs.items():
        for c in CANDIDATES:
            t = r["traces"][c]
            other = " | ".join(f"{r['other_text'][k][c]['kl']:.4f}" if k in r.get("other_text", {}) else "-" for k in kinds)
            lines.append(f"| {name} | {c} | {t['quote_accuracy']:.3f} | {t['kl']:.4f} | {other} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", required=True, help="a trained policy of train.policies (its export is read)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--base", type=Path, default=Path("models/base"))
    ap.add_argument("--exports", type=Path, default=Path("models/export"))
    ap.add_argument("--data", type=Path, default=Path("data/filtered/eval.jsonl"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="run", help="this run's name in the result")
    ap.add_argument("--merge", action="append", default=[], metavar="NAME=RESULT", help="an earlier result of this script, kept as NAME")
    ap.add_argument("--note", help="how the runs differ (params), kept in the result")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from kvpop.config import ParamsError, load_params
    from kvpop.export import CheckpointError
    from kvpop.provenance import write_result

    runs = {}
    for item in args.merge:
        name, eq, path = item.partition("=")
        try:
            if not (eq and name and path):
                raise ValueError(f"--merge wants NAME=RESULT, got {item!r}")
            kept = json.loads(Path(path).read_text())["runs"]
            if len(kept) != 1:
                raise ValueError(f"it holds {len(kept)} runs, not one")
            runs[name] = next(iter(kept.values()))
            if not all(c in runs[name]["traces"] for c in CANDIDATES):
                raise ValueError(f"its traces lack one of {CANDIDATES}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            print(f"error: --merge {item}: {err} (not a result of this script)", file=sys.stderr)
            return 2
    try:
        p = load_params(args.params)
    except ParamsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.policy not in p.train.policies:
        print(f"error: --policy {args.policy!r} is not in train.policies {p.train.policies}", file=sys.stderr)
        return 2
    try:
        runs[args.name] = split(p, args.policy, base=args.base, exports=args.exports, data=args.data, device=args.device)
    except (CheckpointError, OSError, ValueError) as err:  # a missing or unreadable base, export or data file
        print(f"error: {err}", file=sys.stderr)
        return 2
    what = (f"where {args.policy}'s harm lies: the fine-tuned model with its scores, the fine-tuned model dense, and the base "
            f"model with the trained scores, on held-out traces and other text (budget {p.budget})")
    write_result(args.out, {"what": what, "policy": args.policy, "budget": p.budget, **({"note": args.note} if args.note else {}), "runs": runs})
    print(table(runs))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
