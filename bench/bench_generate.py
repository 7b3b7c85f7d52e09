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
before the engine was their default). Each figure is the median of ``--reps`` runs after one
warm-up run. ``--out`` (default ``results/bench_generate/cpu.json``) takes the figures as JSON,
written through :func:`kvpop.provenance.write_result`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvpop.benchmarking import default_out, time_calls
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


def timed(fn, reps: int) -> tuple[float, object]:
    """(median seconds of ``reps`` calls after one warm-up call, the last call's result)."""
    t = time_calls(fn, reps=reps, warmup=1)
    return t.median, t.out


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

    hf_s, _ = timed(hf, args.reps)
    hf_tps = N * args.batch / hf_s
    rows = {"hf": {"seconds": hf_s, "tokens_per_s": hf_tps, "vs_hf": 1.0}}
    print(f"{args.model}: {args.batch} x (prompt {ids.shape[1]} tokens, {N} new), budget {args.budget} (sinks {args.sinks}, window {args.window}), "
          f"{torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'policy':<16}{'path':<11}{'tokens/s':>10}{'vs hf':>8}  same greedy tokens as reference")
    print(f"{'dense':<16}{'hf':<11}{hf_tps:>10.1f}{1.0:>8.2f}")
    shape = {k: v for k, v in model_shape(model).items() if k != "num_heads"}
    geo = dict(layout=CacheLayout(args.budget, args.sinks, args.window), max_new_tokens=N)
    for name in args.policies:
        policy = make_policy(name, **shape)
        got = {}
        for path in ("engine", "reference"):
            # min_new_tokens is not a kvpop option: EOS may end both paths early, equally (same tokens)
            sec, (new, stats) = timed(lambda path=path, policy=policy: generate(model, tok, policy, ids, path=path, **geo), args.reps)
            got[path] = new
            tps = new.numel() / sec
            rows[f"{name}/{path}"] = {"seconds": sec, "new_tokens": new.shape[1], "tokens_per_s": tps, "vs_hf": tps / hf_tps}
            same = "" if path == "engine" else str(torch.equal(got["engine"], new))
            print(f"{name:<16}{path:<11}{tps:>10.1f}{tps / hf_tps:>8.2f}  {same}")
        rows[f"{name}/engine"]["same_tokens_as_reference"] = torch.equal(got["engine"], got["reference"])
    out = args.out or default_out(__file__, cuda=False)  # the model runs on the CPU
    meta = {"threads": torch.get_num_threads(), **vars(args), "out": str(out)}
    write_result(out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
