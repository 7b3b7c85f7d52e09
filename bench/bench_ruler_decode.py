"""RULER's generation on the engine: a task's prompts one at a time against prefilled together.

RULER's prompts are long (about 3,800-3,950 tokens at 4,096) and its answers short, so a generation is mostly
its prompt's prefill. :func:`kvpop.decode.generate.engine_generate_ragged` prefills a task's prompts as one
batch (their common length), then finishes each prompt and decodes its answer alone on an engine of batch 1;
this script times both ways per policy on the same prompts and checks that they give the same answers:

    python bench/bench_ruler_decode.py                     # CUDA: SmolLM2-135M's architecture, random weights
    python bench/bench_ruler_decode.py --small --prompts 4 --context 300 --budget 96 --new 8   # a smoke run (CPU too)

The model has the embedded SmolLM2-135M-Instruct's architecture (30 layers, 9 query / 3 KV heads, head dim 64)
with random weights and bf16 on CUDA (``--small``: a 2-layer model of that width); the prompts are random ids of
RULER's lengths at 4,096 (those of the embedded tokenizer's samples, ``--context`` shifts them), budget 512; every
answer runs to ``--new`` tokens (random weights emit no EOS: an upper bound on a task's decode time). The policies
get random scorers (their decisions differ from trained ones, their work does not). Per policy: seconds for the
prompts one at a time (``engine_generate``, compiled engine of batch 1) and prefilled together (``--batch`` rows),
the ratio, and whether every answer agreed. Written with :func:`kvpop.provenance.write_result`
(``results/bench_ruler_decode/<device>.json``).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvpop.benchmarking import default_out, smollm2_config, sync
from kvpop.decode import DecodeEngine, enable
from kvpop.decode.generate import engine_generate, engine_generate_ragged
from kvpop.geometry import CacheLayout
from kvpop.policies import OnePool, make_policy
from kvpop.provenance import write_result

#: niah_single_1's prompt lengths with the embedded tokenizer at 4,096 tokens (25 samples, seed 42; 3,859-3,871)
NIAH_LENGTHS = [3865, 3862, 3859, 3865, 3862, 3868, 3865, 3871, 3862, 3859, 3865, 3862, 3868, 3865, 3862, 3859, 3865, 3862, 3868,
                3865, 3862, 3871, 3865, 3859, 3862]
POLICIES = ["dense", "streaming_llm", "kvpop_mlp", "kvpop", "dbtrimkv", "kvpop_mlp_pool"]


def make(name: str, cfg, dev):
    if name == "dense":
        return None
    policy = make_policy("kvpop_mlp" if name == "one_pool_mlp" else name, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            p.normal_(std=0.5)
    return (OnePool(policy) if name == "one_pool_mlp" else policy).to(dev)


def positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--prompts", type=positive, default=25, help="prompts of the task (RULER's niah_single_1 lengths, cycled)")
    ap.add_argument("--context", type=positive, default=4096, help="the lengths are niah_single_1's at 4,096, shifted by context - 4096")
    ap.add_argument("--budget", type=positive, default=512)
    ap.add_argument("--new", type=positive, default=128, help="tokens each answer decodes (niah: 128)")
    ap.add_argument("--batch", type=positive, default=25, help="rows prefilled together")
    ap.add_argument("--small", action="store_true", help="a 2-layer model of SmolLM2's width (smoke runs)")
    ap.add_argument("--out", help="default results/bench_ruler_decode/<device>[_small].json")
    args = ap.parse_args()
    if args.budget < 4 + 2:
        ap.error(f"--budget {args.budget} leaves no window after the 4 sinks")
    if min(NIAH_LENGTHS) + args.context - 4096 < 1:
        ap.error(f"--context {args.context} leaves no prompt (niah_single_1's shortest prompt at 4,096 is {min(NIAH_LENGTHS)} tokens)")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = smollm2_config(2 if args.small else 30)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = enable(AutoModelForCausalLM.from_config(cfg).to(dev, torch.bfloat16 if cuda else torch.float32).eval())
    lengths = [NIAH_LENGTHS[i % len(NIAH_LENGTHS)] + args.context - 4096 for i in range(args.prompts)]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    layout = CacheLayout(args.budget, 4, min(256, args.budget // 2))
    max_len = max(lengths) + args.new
    none = torch.tensor([], dtype=torch.long, device=dev)
    rows = {}
    for name in args.policies:
        policy = make(name, cfg, dev)
        kw = dict(layout=layout, max_len=max_len, compile=cuda)
        single = DecodeEngine(model, policy, batch_size=1, **kw)
        many = DecodeEngine(model, policy, batch_size=args.batch, **kw)
        # warm-up: every compiled piece and graph of both engines (two prompts, two answers)
        engine_generate_ragged(many, single, prompts[:2], max_new_tokens=2, eos=none, pad=0)
        engine_generate(single, torch.tensor([prompts[0]], device=dev), max_new_tokens=2, eos=none, pad=0)
        sync(dev)
        t0 = time.perf_counter()
        alone = [engine_generate(single, torch.tensor([p], device=dev), max_new_tokens=args.new, eos=none, pad=0)[0].tolist() for p in prompts]
        sync(dev)
        t1 = time.perf_counter()
        together = engine_generate_ragged(many, single, prompts, max_new_tokens=args.new, eos=none, pad=0)
        sync(dev)
        t2 = time.perf_counter()
        agree = sum(a == b for a, b in zip(alone, together))
        rows[name] = {"engine": single.kind, "one_at_a_time_s": round(t1 - t0, 3), "together_s": round(t2 - t1, 3),
                      "speedup": round((t1 - t0) / max(t2 - t1, 1e-9), 2), "answers_equal": agree, "prompts": len(prompts)}
        print(f"{name:16s} {single.kind:8s} one at a time {t1 - t0:7.2f} s   together {t2 - t1:7.2f} s   "
              f"{rows[name]['speedup']:5.2f}x   answers equal {agree}/{len(prompts)}", flush=True)
        del single, many
        if cuda:
            torch.cuda.empty_cache()
    out = args.out or default_out(__file__, small=args.small)
    write_result(out, {
        "what": f"RULER's generation on the engine, a task's {args.prompts} prompts (niah_single_1's lengths at {args.context}) one at a time "
                f"against prefilled {args.batch} together (engine_generate_ragged), {args.new} new tokens each, budget {args.budget}, "
                f"SmolLM2-135M architecture{' (2 layers)' if args.small else ''}, random weights",
        "config": {"prompts": args.prompts, "lengths": [min(lengths), max(lengths)], "budget": args.budget, "new_tokens": args.new,
                   "batch": args.batch, "dtype": "bfloat16" if cuda else "float32", "compiled": cuda},
        "policies": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
