"""Does a learned policy harm text it was never trained on? KL to the *base* model's dense attention.

The learned policies train on math-like reasoning traces. On other kinds of text (source code,
prose) they should do no worse than the recency rules. Unlike ``kvpop score``, which compares an
export with its own fine-tuned weights under dense attention, this compares every policy with
the base model's dense attention (the teacher): fine-tuning and eviction together, as a user sees
them; and, to separate the two, each export's weights with dense attention (``<name> weights, dense``).

Documents: the given files, cut into pieces of at most ``--max-tokens`` tokens (the first
``--docs-per-kind`` pieces of each kind); ``--code`` and ``--prose`` default to files that ship
with this environment (Python sources of the standard library and of torch; the long descriptions
in installed packages' METADATA). Metrics per kind: mean KL over all next-token predictions and top-1
agreement (:func:`kvpop.evaluate.evaluate_fidelity`, float32, CPU or CUDA).

    PYTHONPATH=src .venv/bin/python bench/bench_no_harm.py --out results/no_harm_cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sysconfig
import time
from pathlib import Path

import torch

from kvpop.data.other_text import HELD_OUT_CODE
from kvpop.evaluate import Candidate, evaluate_fidelity, one_pool_twin
from kvpop.export import load_export, read_meta
from kvpop.modeling import load_model
from kvpop.policies import make_policy
from kvpop.scorer import has_recency, with_recency


def default_files() -> dict[str, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    purelib = Path(sysconfig.get_paths()["purelib"])
    code = [stdlib / f for f in HELD_OUT_CODE]  # never mixed into training (kvpop.data.other_text)
    prose = sorted(purelib.glob("*.dist-info/METADATA"))
    return {"code": [p for p in code if p.is_file()], "prose": prose}


def pieces(tok, files: list[Path], max_tokens: int, n: int, min_tokens: int) -> list[dict]:
    """Up to n records of min_tokens..max_tokens tokens, from the files in order."""
    out = []
    for f in files:
        text = f.read_text(errors="replace")
        if f.name == "METADATA":  # the long description follows the headers
            text = text.partition("\n\n")[2]
        ids = tok(text).input_ids
        for s in range(0, len(ids), max_tokens):
            chunk = ids[s : s + max_tokens]
            if len(chunk) >= min_tokens:
                out.append({"input_ids": chunk, "loss_mask": [1] * len(chunk), "source": str(f)})
            if len(out) == n:
                return out
    return out


def recency_list(text: str) -> list[float]:
    """``--recency``: comma-separated fixed age decays per token (:mod:`kvpop.scorer`), each >= 0."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--recency {text!r}: comma-separated numbers expected") from None
    if any(not v >= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"--recency {text!r}: every value must be >= 0")
    return vals


def recency_label(label: str, recency: float) -> str:
    """The evaluated name of ``label``'s scorer with a fixed age decay added (``--recency``)."""
    return f"{label}, recency {recency:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--exports", default="models/export")
    ap.add_argument("--trained", default="streaming_llm_plus,kvpop_mlp,kvpop", help="export folders under --exports")
    ap.add_argument("--budget", type=int, default=None, help="default: the exports' budget")
    ap.add_argument("--max-tokens", type=int, default=1536)
    ap.add_argument("--min-tokens", type=int, default=768)
    ap.add_argument("--docs-per-kind", type=int, default=4)
    ap.add_argument("--code", nargs="*", type=Path, default=None)
    ap.add_argument("--prose", nargs="*", type=Path, default=None)
    ap.add_argument("--recency", type=recency_list, default=[], help="also score every export whose scorer has an age decay "
                    "with these fixed extra decays (comma-separated, per token; kvpop.scorer), as '<name>, recency <r>'")
    ap.add_argument("--shared-pool", action="store_true", help="also score every kvpop_mlp export by its own priorities with one "
                    "pool of slots for the whole model (kvpop.policies.one_pool), as '<name>, one pool'")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # CUDA: one compiled FlexAttention per document length and candidate pattern (the pooled policies add several)
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    from transformers import AutoTokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    files = default_files()
    files = {"code": args.code or files["code"], "prose": args.prose or files["prose"]}
    tok = AutoTokenizer.from_pretrained(args.base)
    teacher = load_model(args.base, "float32").to(dev).eval()
    names = [n for n in args.trained.split(",") if n]
    meta = read_meta(Path(args.exports) / names[0]) if names else {"budget": args.budget, "sinks": 4, "window": 256}
    geo = dict(budget=args.budget or meta["budget"], sinks=meta["sinks"], window=meta["window"])
    cands = [Candidate("dense", teacher, make_policy("dense")), Candidate("streaming_llm", teacher, make_policy("streaming_llm"))]
    for n in names:
        model, _, pol, m = load_export(Path(args.exports) / n)
        if (m["sinks"], m["window"]) != (geo["sinks"], geo["window"]):
            raise SystemExit(f"{n}: exported for sinks/window {m['sinks']}/{m['window']}, others use {geo['sinks']}/{geo['window']}")
        model = model.to(dev).eval()
        trained = Candidate(n, model, pol.to(dev))
        cands.append(trained)
        if args.recency and has_recency(pol):
            cands += [Candidate(recency_label(n, r), model, with_recency(pol, r)) for r in args.recency]
        if args.shared_pool and (twin := one_pool_twin(trained)):
            cands.append(twin)
        # the same fine-tuned weights with dense attention: what fine-tuning alone changes
        cands.append(Candidate(f"{n} weights, dense", model, make_policy("dense")))
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__, **geo,
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "kinds": {}}
    for kind, fs in files.items():
        recs = pieces(tok, fs, args.max_tokens, args.docs_per_kind, args.min_tokens)
        if not recs:
            raise SystemExit(f"no {kind} document of at least {args.min_tokens} tokens in {[str(f) for f in fs][:5]}...")
        t0 = time.time()
        r = evaluate_fidelity(recs, teacher, cands, device=dev, **geo)
        res["kinds"][kind] = {"documents": [x["source"] for x in recs], "tokens": [len(x["input_ids"]) for x in recs],
                              "seconds": round(time.time() - t0, 1),
                              "policies": {n: {"kl": m["kl"], "top1_agreement": m["top1_agreement"]} for n, m in r.items()}}
        print(f"\n{kind}: {len(recs)} documents, {sum(len(x['input_ids']) for x in recs)} tokens, budget {geo['budget']} "
              f"(window {geo['window']}), KL to the base model's dense attention")
        for n, m in r.items():
            print(f"  {n:<34} KL {m['kl']:.4f}  top-1 {m['top1_agreement']:.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
