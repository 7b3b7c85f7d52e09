"""The ``kvpop`` command: generate with a bounded KV cache, or score a policy's fidelity.

    kvpop generate --checkpoint DIR --policy NAME --budget N [--prompt TEXT | --prompt-file F]
    kvpop score    --checkpoint DIR --policy NAME --budget N FILE...

``DIR`` is an export folder (``kvpop.export``; its ``sinks``/``window`` are the defaults) or a
plain Hugging Face folder (training-free policies only). Usage errors, a missing or corrupt
checkpoint, an unknown policy and an empty input exit with status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvpop.policies import names

POLICIES, TRAINED = names(oracle=False), names(trained=True)  # oracles run in the evaluate stage only

DEFAULT_SINKS, DEFAULT_WINDOW = 4, 256  # the pipeline's defaults (kvpop.config.Params), for plain model folders
err = Console(stderr=True, highlight=False, soft_wrap=True)


class UsageError(Exception):
    """A problem with the command's inputs: reported on stderr, exit status 2."""


def check_budget(budget: int, sinks: int, window: int) -> None:
    """The pipeline's rule (``kvpop.config.Params``): window >= 1, sinks >= 0 and at least one
    long-range slot, budget > sinks + window; a UsageError naming the numbers otherwise."""
    if window < 1 or sinks < 0:
        raise UsageError(f"need --window >= 1 and --sinks >= 0; got sinks {sinks}, window {window}")
    if budget <= sinks + window:
        raise UsageError(f"--budget {budget} must exceed sinks + window = {sinks} + {window} (at least one long-range slot)")


@dataclass
class Loaded:
    model: object
    tokenizer: object
    policy: object  # kvpop.policies.Policy
    sinks: int
    window: int
    budget: int


def load(args) -> Loaded:
    """Model, tokenizer and policy from ``--checkpoint``, with the cache geometry."""
    from safetensors import SafetensorError
    from transformers import AutoTokenizer

    from kvpop.export import META, CheckpointError, load_export, read_meta
    from kvpop.modeling import load_model
    from kvpop.policies import resolve_policy

    if args.policy not in POLICIES:
        raise UsageError(f"unknown policy {args.policy!r}; known: {', '.join(POLICIES)}")
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
    elif args.policy in TRAINED:
        raise UsageError(f"policy {args.policy!r} needs an export folder; {path} is a plain model folder")
    sinks = args.sinks if args.sinks is not None else meta.get("sinks", DEFAULT_SINKS)
    window = args.window if args.window is not None else meta.get("window", DEFAULT_WINDOW)
    check_budget(args.budget, sinks, window)
    try:
        if export_dir:
            model, tok, trained, meta = load_export(path, args.dtype)
        else:
            model, tok = load_model(path, args.dtype), AutoTokenizer.from_pretrained(path)
    # load_model wraps most loading failures in RuntimeError; a damaged safetensors file escapes it
    except (CheckpointError, RuntimeError, OSError, ValueError, SafetensorError) as e:
        raise UsageError(f"cannot load checkpoint {path}: {e}") from None
    try:
        policy = resolve_policy(args.policy, trained)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return Loaded(model.eval(), tok, policy, sinks, window, args.budget)


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


def read_texts(files: list[str], tokenizer) -> list[tuple[str, str]]:
    """(name, text) per document: a text file is one document; JSONL rows have "text" or chat "messages"."""
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
                docs.append((f"{f.name}:{i}", tokenizer.apply_chat_template(rec["messages"], tokenize=False)))
            else:
                raise UsageError(f'{f}:{i}: expected a "text" string or a "messages" list')
    if not docs:
        raise UsageError("no documents in the input files")
    return docs


def cmd_generate(args) -> int:
    from transformers import TextStreamer

    from kvpop.decode import generate

    lo = load(args)
    ids = read_prompt(args, lo.tokenizer)
    streamer = None if args.quiet else TextStreamer(lo.tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        new, stats = generate(
            lo.model, lo.tokenizer, lo.policy, ids, budget=lo.budget, sinks=lo.sinks, window=lo.window,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, streamer=streamer, path=args.path,
        )
    except NotImplementedError as e:  # --path engine for a rule or model the engine does not take
        raise UsageError(f"--path {args.path}: {e}") from None
    if args.quiet:
        print(lo.tokenizer.decode(new[0], skip_special_tokens=True))
    err.print(
        f"[bold]{lo.policy.name}[/] budget {lo.budget} (sinks {lo.sinks}, window {lo.window}): "
        f"{stats.prompt_tokens} prompt + {stats.new_tokens} new tokens, "
        f"cache {stats.peak_cache_mb:.3f} MB, {stats.tokens_per_s:.1f} tokens/s ({stats.path} path)"
    )
    return 0


def cmd_score(args) -> int:
    import torch

    from kvpop.decode import teacher_forced_logits
    from kvpop.evaluate import Candidate, evaluate_fidelity, forward_logits
    from kvpop.policies import Dense

    lo = load(args)
    docs = read_texts(args.files, lo.tokenizer)
    records = [{"input_ids": lo.tokenizer(text).input_ids} for _, text in docs]
    records = [dict(r, loss_mask=[1] * len(r["input_ids"])) for r in records if len(r["input_ids"]) >= 2]
    if not records:
        raise UsageError("every document is shorter than 2 tokens")
    device = next(lo.model.parameters()).device
    geometry = dict(sinks=lo.sinks, window=lo.window)
    if not lo.policy.needs_attention:  # dense or static priorities: the training-time pattern, whole sequence at once
        cand = Candidate(lo.policy.name, lo.model, lo.policy.to(device))
        result = evaluate_fidelity(records, lo.model, [cand], budget=lo.budget, device=device, **geometry)[cand.name]
    else:  # attention rules exist only at decode time: teacher-forced decoding through the bounded cache
        kl = agree = n = 0.0
        for r in records:
            ids = torch.tensor(r["input_ids"], device=device)[None]
            ref = forward_logits(lo.model, Dense(), ids, long_range=lo.budget, **geometry)[:-1].log_softmax(-1)  # (S-1, V)
            got = teacher_forced_logits(lo.model, lo.policy, ids, budget=lo.budget, **geometry)[0, :-1].float().log_softmax(-1)
            kl += (ref.exp() * (ref - got)).sum().item()
            agree += (ref.argmax(-1) == got.argmax(-1)).sum().item()
            n += ref.shape[0]
        result = {"kl": kl / n, "top1_agreement": agree / n}
    result = {"policy": lo.policy.name, "budget": lo.budget, "sinks": lo.sinks, "window": lo.window, "documents": len(records),
              "tokens": sum(len(r["input_ids"]) - 1 for r in records), "kl": result["kl"], "top1_agreement": result["top1_agreement"]}
    if args.json:
        print(json.dumps(result))
    else:
        table = Table("", "", title="teacher-forced fidelity vs dense", show_header=False)
        for key, value in result.items():
            table.add_row(key, f"{value:.5f}" if isinstance(value, float) else str(value))
        Console().print(table)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpop", description="KV-cache eviction: generate with a bounded cache, score fidelity.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--checkpoint", required=True, help="export folder or plain Hugging Face model folder")
        sp.add_argument("--policy", required=True, help=f"one of: {', '.join(POLICIES)}")
        sp.add_argument("--budget", type=int, required=True, help="KV entries per layer and KV head")
        sp.add_argument("--sinks", type=int, default=None, help=f"default: the export's, else {DEFAULT_SINKS}")
        sp.add_argument("--window", type=int, default=None, help=f"default: the export's, else {DEFAULT_WINDOW}")
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

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
    g.set_defaults(run=cmd_generate)

    s = sub.add_parser("score", help="teacher-forced KL and top-1 agreement against dense attention")
    common(s)
    s.add_argument("files", nargs="+", metavar="FILE", help="text files, or JSONL with a 'text' or chat 'messages' field")
    s.add_argument("--json", action="store_true", help="print the result as one JSON line")
    s.set_defaults(run=cmd_score)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # argparse exits with status 2 on bad usage
    try:
        return args.run(args)
    except UsageError as e:
        err.print(f"[bold red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
