"""The ``kvpop`` command: generate with a bounded KV cache, or score a policy's fidelity.

    kvpop generate --checkpoint DIR --policy NAME --budget N [--one-pool] [--prompt TEXT | --prompt-file F]
    kvpop score    --checkpoint DIR [--policy NAME,NAME...] [--export DIR2 ...] --budget N [--one-pool] FILE...

``DIR`` is an export folder (``kvpop.export``; its ``sinks``/``window`` are the defaults) or a
plain Hugging Face folder (training-free policies only). ``score`` compares every policy it is
given in one process against ``DIR``'s dense attention, which it names in its output: for an export
folder that is the export's fine-tuned weights; to compare trained exports with the base model, give
the base folder as ``--checkpoint`` and each export with ``--export``. Usage errors, a missing or corrupt
checkpoint, an unknown policy and an empty input exit with status 2 and a message naming it.

``--one-pool`` ranks a trained ``kvpop_mlp``'s own priorities with one pool of slots for the whole
model (:class:`kvpop.policies.OnePool`: the same number of cached entries, split between layers and
heads by the priorities): ``generate`` decodes with it (the engine's pooled kind, :mod:`kvpop.decode.pooled`;
:class:`kvpop.decode.one_pool.OnePoolCache` its reference twin), ``score`` adds a ``<name>, one pool`` row for every policy it can rank so.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpop import geometry
from kvpop.geometry import CacheLayout
from kvpop.policies import names

POLICIES, TRAINED = names(oracle=False), names(trained=True)  # oracles run in the evaluate stage only

DEFAULT_SINKS, DEFAULT_WINDOW = 4, 256  # the pipeline's defaults (kvpop.config.Params), for plain model folders
err = Console(stderr=True, highlight=False, soft_wrap=True)


class UsageError(Exception):
    """A problem with the command's inputs: reported on stderr, exit status 2."""


def check_budget(budget: int, sinks: int, window: int) -> CacheLayout:
    """The pipeline's rule (:func:`kvpop.geometry.check_budget`, as in ``kvpop.config.Params``: at least
    one long-range slot) -> the nominal layout; a UsageError naming --budget, --sinks and --window otherwise."""
    try:
        geometry.check_budget(budget, sinks, window)
    except ValueError as e:
        raise UsageError(f"--budget {budget} --sinks {sinks} --window {window}: {e}") from None
    return CacheLayout(budget, sinks, window)


@dataclass
class Loaded:
    model: object
    tokenizer: object
    policy: object  # kvpop.policies.Policy
    layout: CacheLayout  # the nominal geometry
    trained: object = None  # an export's own trained policy (None for a plain model folder)


def load(args, policy: str | None = None) -> Loaded:
    """Model, tokenizer and policy (``policy``, default ``--policy``) from ``--checkpoint``, with the
    cache geometry."""
    from kvpop.export import META, CheckpointError, read_meta

    name = policy if policy is not None else args.policy
    if name not in POLICIES:
        raise UsageError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    if getattr(args, "one_pool", False) and args.command == "generate" and name not in TRAINED:
        raise UsageError(f"--one-pool ranks a trained kvpop_mlp's static priorities, not {name!r}")
    path = Path(args.checkpoint)
    meta, trained = {}, None
    # what the folder is, and the geometry, before the model loads (which takes seconds)
    export_dir = (path / META).is_file()
    if export_dir:
        try:
            meta = read_meta(path)
        except CheckpointError as e:
            raise UsageError(f"cannot load checkpoint {path}: {e}") from None
    elif not (path / "config.json").is_file():
        raise UsageError(f"no checkpoint at {path}: neither {META} nor config.json found")
    elif name in TRAINED:
        raise UsageError(f"policy {name!r} needs an export folder; {path} is a plain model folder")
    sinks = args.sinks if args.sinks is not None else meta.get("sinks", DEFAULT_SINKS)
    window = args.window if args.window is not None else meta.get("window", DEFAULT_WINDOW)
    layout = check_budget(args.budget, sinks, window)
    from safetensors import SafetensorError  # the heavy imports after every check that needs none of them
    from transformers import AutoTokenizer

    from kvpop.export import load_export
    from kvpop.modeling import load_model
    from kvpop.policies import resolve_policy

    try:
        if export_dir:
            model, tok, trained, meta = load_export(path, args.dtype)
        else:
            model, tok = load_model(path, args.dtype), AutoTokenizer.from_pretrained(path)
    # load_model wraps most loading failures in RuntimeError; a damaged safetensors file escapes it
    except (CheckpointError, RuntimeError, OSError, ValueError, SafetensorError) as e:
        raise UsageError(f"cannot load checkpoint {path}: {e}") from None
    try:
        resolved = resolve_policy(name, trained)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if getattr(args, "one_pool", False) and args.command == "generate":
        resolved = with_one_pool(resolved)
    return Loaded(model.eval(), tok, resolved, layout, trained)


def with_one_pool(policy):
    """``policy`` ranked with one pool for the whole model (``--one-pool``); a UsageError naming the
    policy if it has no static per-head priorities to rank so."""
    from kvpop.policies import OnePool

    if not OnePool.accepts(policy):
        raise UsageError(f"--one-pool ranks a trained kvpop_mlp's static priorities, not {policy.name!r}: {OnePool.refusal(policy)}")
    return OnePool(policy)


def read_prompt(args, tokenizer) -> list[int]:
    if args.prompt_file is not None:
        f = Path(args.prompt_file)
        if not f.is_file():
            raise UsageError(f"prompt file {f} not found")
        text = f.read_text()
    else:
        text = args.prompt
    if not text or not text.strip():
        raise UsageError(f"empty prompt{' in ' + str(args.prompt_file) if args.prompt_file else ''}")
    if args.chat and tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)
    return tokenizer(text).input_ids


def read_texts(files: list[str]) -> list[tuple[str, str | dict]]:
    """(name, document) per document: a text file is one text; a JSONL row a "text" string, or a chat
    row (a dict with "messages", and "metadata" with "quotes" where it records them)."""
    docs = []
    for name in files:
        f = Path(name)
        if not f.is_file():
            raise UsageError(f"input file {f} not found")
        raw = f.read_text()
        if not raw.strip():
            raise UsageError(f"input file {f} is empty")
        if f.suffix != ".jsonl":
            docs.append((f.name, raw))
            continue
        for i, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{f}:{i}: not JSON ({e.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                docs.append((f"{f.name}:{i}", rec["text"]))
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                docs.append((f"{f.name}:{i}", rec))
            else:
                raise UsageError(f'{f}:{i}: expected a "text" string or a "messages" list')
    if not docs:
        raise UsageError("no documents in the input files")
    return docs


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from kvpop.decode import generate, model_device

    lo = load(args)
    if args.compile and model_device(lo.model).type != "cuda":
        raise UsageError("--compile needs a CUDA device (the compiled step is replayed as a CUDA graph); drop it to decode eagerly")
    ids = read_prompt(args, lo.tokenizer)
    streamer = None if args.quiet else TextStreamer(lo.tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        new, stats = generate(
            lo.model, lo.tokenizer, lo.policy, ids, layout=lo.layout,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, streamer=streamer, path=args.path, compile=args.compile,
        )
    except NotImplementedError as e:  # --path engine for a rule or model the engine does not take
        raise UsageError(f"--path {args.path}: {e}") from None
    if args.quiet:
        print(lo.tokenizer.decode(new[0], skip_special_tokens=True))
    err.print(
        f"[bold]{lo.policy.name}[/] budget {lo.layout.budget} (sinks {lo.layout.sinks}, window {lo.layout.window}): "
        f"{stats.prompt_tokens} prompt + {stats.new_tokens} new tokens, "
        f"cache {stats.peak_cache_mb:.3f} MB, {stats.tokens_per_s:.1f} tokens/s ({stats.path} path)"
    )
    return 0


def read_records(docs: list[tuple[str, object]], tokenizer) -> list[dict]:
    """Scored records: every token of a text; the assistant turns of chat rows, with the positions of
    their quotes where a row records them (``metadata.quotes``, as the pipeline's data does)."""
    from kvpop.filter import ChatFormatError, format_and_tokenize

    records = []
    for name, doc in docs:
        if isinstance(doc, str):
            ids = tokenizer(doc).input_ids
            records.append({"input_ids": ids, "loss_mask": [1] * len(ids)})
            continue
        meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
        try:
            t = format_and_tokenize(doc["messages"], tokenizer, quotes=meta.get("quotes") or None)
        except (ChatFormatError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{name}: {e}") from None
        records.append({"input_ids": t.input_ids, "loss_mask": t.loss_mask, "quote_positions": t.quote_positions})
    return [r for r in records if len(r["input_ids"]) >= 2 and any(r["loss_mask"][1:])]


def score_candidates(args):
    """(the loaded checkpoint: the reference model, its tokenizer and the geometry; [Candidate]): the
    ``--policy`` list on ``--checkpoint``'s weights, then each ``--export`` with its own weights and
    trained policy."""
    from kvpop.evaluate import Candidate
    from kvpop.export import CheckpointError, load_export, read_meta
    from kvpop.policies import resolve_policy

    names = [n.strip() for n in (args.policy or "").split(",") if n.strip()]
    if not names and not args.export:
        raise UsageError("nothing to score: give --policy NAME[,NAME...] and/or --export DIR")
    for n in names:
        if n not in POLICIES:
            raise UsageError(f"unknown policy {n!r}; known: {', '.join(POLICIES)}")
    for d in args.export:  # every export's metadata before any model loads
        try:
            read_meta(Path(d))
        except (CheckpointError, FileNotFoundError) as e:
            raise UsageError(f"--export {d}: {e}") from None
    first = load(args, names[0] if names else "dense")  # the checkpoint, once: the reference and the rules' model
    cands = []
    for n in names:
        try:
            cands.append(Candidate(n, first.model, resolve_policy(n, first.trained)))
        except ValueError as e:
            raise UsageError(str(e)) from None
    for d in args.export:
        try:
            model, _, pol, meta = load_export(Path(d), args.dtype)
        except (CheckpointError, RuntimeError, OSError, ValueError) as e:
            raise UsageError(f"--export {d}: {e}") from None
        if (meta["sinks"], meta["window"]) != (first.layout.sinks, first.layout.window):
            raise UsageError(f"--export {d} was trained with sinks/window {meta['sinks']}/{meta['window']}; this run uses "
                             f"{first.layout.sinks}/{first.layout.window} (set --sinks/--window)")
        cands.append(Candidate(f"{pol.name} ({Path(d).name})", model.eval(), pol))
    if args.one_pool:
        from kvpop.evaluate import one_pool_twin

        pools = [twin for c in cands if (twin := one_pool_twin(c))]
        if not pools:
            raise UsageError(f"--one-pool: none of {[c.name for c in cands]} has static per-head priorities to rank with one pool (kvpop_mlp)")
        cands += pools
    return first, cands


def cmd_score(args) -> int:
    from kvpop.evaluate import evaluate_fidelity

    first, cands = score_candidates(args)
    records = read_records(read_texts(args.files), first.tokenizer)
    if not records:
        raise UsageError("no document has 2 or more scored tokens")
    device = next(first.model.parameters()).device
    reference = (f"dense attention with the weights of {args.checkpoint}"
                 + (" (the export's fine-tuned weights, not its base model)" if first.trained is not None else ""))
    for c in cands:
        c.policy.to(device)
    res = evaluate_fidelity(records, first.model, cands, layout=first.layout, device=device)
    quotes = any(r.get("quote_positions") for r in records)
    rows = []
    for name, m in res.items():
        row = {"policy": name, "budget": first.layout.budget, "sinks": first.layout.sinks, "window": first.layout.window, "documents": len(records),
               "tokens": m["tokens"], "kl": m["kl"], "top1_agreement": m["top1_agreement"], "reference": reference}
        if quotes:
            row["quote_accuracy"], row["quote_tokens"] = m["quote_accuracy"], m["quote_tokens"]
        rows.append(row)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    cols = ["kl", "top1_agreement", *(["quote_accuracy"] if quotes else [])]
    table = Table("policy", *cols, title=f"teacher-forced fidelity at budget {first.layout.budget} (sinks {first.layout.sinks}, window {first.layout.window}), "
                  f"{len(records)} documents, {rows[0]['tokens']} scored tokens", caption=f"reference: {reference}")
    for row in rows:
        table.add_row(row["policy"], *(f"{row[c]:.5f}" for c in cols))
    Console().print(table)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop", description="KV-cache eviction: generate with a bounded cache, score fidelity.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp, several: bool = False):
        sp.add_argument("--checkpoint", required=True, help="export folder or plain Hugging Face model folder"
                        + (" (its dense attention is the reference)" if several else ""))
        if several:
            sp.add_argument("--policy", default=None, help=f"comma-separated, on the checkpoint's weights: {', '.join(POLICIES)}")
        else:
            sp.add_argument("--policy", required=True, help=f"one of: {', '.join(POLICIES)}")
        sp.add_argument("--budget", type=int, required=True, help="KV entries per layer and KV head")
        sp.add_argument("--sinks", type=int, default=None, help=f"default: the export's, else {DEFAULT_SINKS}")
        sp.add_argument("--window", type=int, default=None, help=f"default: the export's, else {DEFAULT_WINDOW}")
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        sp.add_argument("--one-pool", action="store_true", help="rank a trained kvpop_mlp's priorities with one pool of slots for the whole "
                        "model (the same number of cached entries, split between layers and heads by the priorities)"
                        + (": adds a row per policy that can be ranked so" if several else ""))
        sp.add_argument("--threads", default=None, help="CPU threads: a count or 'auto' (default: $KVPOP_THREADS, else auto = "
                        "the cores free at start; kvpop.threads)")

    g = sub.add_parser("generate", help="stream a completion decoded with the bounded cache")
    common(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    g.add_argument("--no-chat", dest="chat", action="store_false", help="do not apply the chat template")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quiet", action="store_true", help="no streaming: print the completion at the end")
    g.add_argument("--path", choices=["auto", "engine", "reference"], default="auto",
                   help="decode path: the fast engine (auto: wherever it supports the policy) or the reference cache")
    g.add_argument("--compile", action="store_true",
                   help="CUDA: compile the engine's step and replay it as a CUDA graph (fast per token; about 10 s to compile "
                   "the first time, then reused from $KVPOP_COMPILE_CACHE, default ~/.cache/kvpop/compile). Without it the "
                   "engine runs eagerly and starts at once")
    g.set_defaults(run=cmd_generate)

    s = sub.add_parser("score", help="teacher-forced KL, top-1 agreement and quote accuracy of several policies against dense attention")
    common(s, several=True)
    s.add_argument("--export", action="append", default=[], metavar="DIR",
                   help="also score this export's trained policy with its own weights (repeatable), against --checkpoint's dense attention")
    s.add_argument("files", nargs="+", metavar="FILE", help="text files, or JSONL with a 'text' or chat 'messages' field")
    s.add_argument("--json", action="store_true", help="print one JSON line per policy")
    s.set_defaults(run=cmd_score)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # argparse exits with status 2 on bad usage
    try:
        from kvpop.threads import set_threads

        try:
            set_threads(args.threads)
        except ValueError as e:
            raise UsageError(f"--threads: {e}") from None
        return args.run(args)
    except UsageError as e:
        err.print(f"[bold red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
