"""``kvpop generate``'s decode paths against transformers' own ``generate``, side by side.

    PYTHONPATH=src python3 bench/bench_generate.py                      # the CPU default: models/base
    PYTHONPATH=src python3 bench/bench_generate.py --prompt-tokens 1000 --budget 384

For each policy, greedy decoding of ``--new-tokens`` after a prompt of ``--prompt-tokens`` (a chat
prompt of the embedded model's own tokens, cut to length) through

* ``engine``: :func:`kvpop.decode.generate` on :class:`kvpop.decode.DecodeEngine`;
* ``reference``: :func:`kvpop.decode.generate` on ``model.generate`` + ``BoundedCache``;
* ``hf``: ``model.generate`` with its default cache and attention (the baseline, dense: it
  evicts nothing), measured once in the same run.

Prints tokens/s (prefill included, as ``kvpop generate`` reports it), the ratio of each path
to ``hf``, and whether the engine's greedy tokens equal the reference path's (the text users got
before the engine was their default). After one warm-up call of each, ``--reps`` rounds each time
``hf`` and then every policy and path once: a path's ratio to ``hf`` is the median over the rounds of
the ratio within a round, so a machine whose load changes during the run (cores shared with other
processes) shifts both sides of a ratio alike; its spread over the rounds is printed and kept. The
tokens/s are medians over the rounds. ``--out`` (default ``results/bench_generate/cpu.json``) takes
the figures as JSON, written through :func:`kvpop.provenance.write_result`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvpop.benchmarking import default_out
from kvpop.decode import generate
from kvpop.geometry import CacheLayout
from kvpop.modeling import load_model, model_shape
from kvpop.policies import make_policy
from kvpop.provenance import write_result

PROMPT = (
    "Solve step by step. Let a = 17 and b = 25. Compute c = a * 3 + b, then d = c - 11, then e = d * 2. "
    "Recall each value when you use it, and give the final answer as \\boxed{e}."
)


def prompt_ids(tokenizer, n: int) -> list[int]:
    """A chat prompt cut or repeated to exactly ``n`` tokens."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False)
    while len(ids) < n:
        ids = ids + tokenizer(" " + PROMPT).input_ids
    return ids[-n:] if len(ids) > n else ids


def timed(fn) -> tuple[float, object]:
    """(seconds of one call, its result)."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--policies", nargs="+", default=["dense", "streaming_llm", "kvpop_mlp", "kvpop"])
    ap.add_argument("--prompt-tokens", type=int, default=53)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=384)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1, help="rows decoded together (copies of the prompt)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=None, help="default: results/bench_generate/cpu.json")
    ap.add_argument("--what", default=None, help="one line for the result file (default: the run's settings)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    model = load_model(args.model, args.dtype).eval()
    model.set_attn_implementation("sdpa")  # transformers' default attention for the baseline (load_model sets kvpop's)
    tok = AutoTokenizer.from_pretrained(args.model)
    ids = torch.tensor([prompt_ids(tok, args.prompt_tokens)] * args.batch)
    N = args.new_tokens
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def hf():  # transformers' own generate: default (dynamic) cache and attention, no EOS stop
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=pad)

    shape = {k: v for k, v in model_shape(model).items() if k != "num_heads"}
    geo = dict(layout=CacheLayout(args.budget, args.sinks, args.window), max_new_tokens=N)
    calls = {"hf": hf}  # every timed call: transformers' generate, then each policy on each path
    for name in args.policies:
        policy = make_policy(name, **shape)
        for path in ("engine", "reference"):
            # min_new_tokens is not a kvpop option: EOS may end both paths early, equally (same tokens)
            calls[f"{name}/{path}"] = lambda path=path, policy=policy: generate(model, tok, policy, ids, path=path, **geo)[0]
    seconds: dict[str, list[float]] = {key: [] for key in calls}
    new: dict[str, torch.Tensor] = {}
    for rnd in range(1 + args.reps):  # round 0 warms up
        for key, fn in calls.items():
            sec, out = timed(fn)
            if rnd:
                seconds[key].append(sec)
            new[key] = out
    produced = {key: N * args.batch if key == "hf" else new[key].numel() for key in calls}
    print(f"{args.model}: {args.batch} x (prompt {ids.shape[1]} tokens, {N} new), budget {args.budget} (sinks {args.sinks}, window {args.window}), "
          f"{torch.get_num_threads()} threads, {args.dtype}, {args.reps} rounds")
    print(f"{'policy':<16}{'path':<11}{'tokens/s':>10}{'vs hf':>8}{'spread':>14}  same greedy tokens as reference")
    rows = {}
    for key in calls:
        sec = statistics.median(seconds[key])
        ratios = [produced[key] / s / (produced["hf"] / h) for s, h in zip(seconds[key], seconds["hf"], strict=True)]  # within each round
        row = {"seconds": sec, "seconds_per_round": seconds[key], "tokens_per_s": produced[key] / sec,
               "vs_hf": statistics.median(ratios), "vs_hf_per_round": ratios}
        if key != "hf":
            row["new_tokens"] = new[key].shape[1]
        name, _, path = key.partition("/")
        same = ""
        if path == "engine":
            row["same_tokens_as_reference"] = torch.equal(new[key], new[f"{name}/reference"])
            same = str(row["same_tokens_as_reference"])
        rows[key] = row
        print(f"{name if path else 'dense':<16}{path or 'hf':<11}{row['tokens_per_s']:>10.1f}{row['vs_hf']:>8.2f}"
              f"{min(ratios):>7.2f}-{max(ratios):<6.2f}  {same}")
    out = args.out or default_out(__file__, cuda=False)  # the model runs on the CPU
    meta = {"threads": torch.get_num_threads(), **vars(args), "out": str(out)}
    what = args.what or (f"tokens/s of kvpop.decode.generate (engine, reference) vs transformers' generate on the CPU: {args.batch} x "
                         f"({ids.shape[1]}-token prompt + {N} new), budget {args.budget}, ratios within interleaved rounds")
    write_result(out, {"meta": meta, "rows": rows}, what=what)


if __name__ == "__main__":
    main()
