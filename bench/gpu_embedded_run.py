"""The GPU-scale run of the embedded model: 8,192-token rows, budget 1,024, train + teacher-forced evaluation.

SmolLM2-135M-Instruct on synthetic long-range traces. The SmolLM2 tokenizer gives about 1.22-1.24
characters of assistant content per token for this format (measured), so 6,200-9,600 characters
give chat-formatted traces of about 5,000-7,950 tokens, all under the 8,192-token rows; the quotes
sit thousands of tokens after their definitions (definitions first, recalls at the end).

One run trains three policies with the library's training builder (:func:`kvpop.train.build_training`,
as the train stage) on the same rows, in the same order, for the same number of steps (``--steps``,
which is also the scorers' cosine-schedule length): ``kvpop`` (the delayed mLSTM scorer; its k is
``policy.long_range_slots``, i.e. the budget less the slots its recurrent state costs), then ``kvpop_mlp`` (k = budget - sinks -
window), then ``streaming_llm_plus``. ``kvpop`` is trained first, under a wall-clock safety guard
(``--first-budget``): should the guard stop it early, the other two get exactly the steps it
reached (the schedule length stays ``--steps`` for all three). Measured on an H200 at these sizes
(steady state, per step, before the chunkwise form of 2026-12-01): kvpop 5.5 s (the mLSTM's chunked parallel form over 8K-token rows, with
recomputation), kvpop_mlp 1.2 s, streaming_llm_plus 0.25 s; conversion + data + evaluation of 16
traces about 65 s. So ``--steps 56 --first-budget 340`` fills a 575-s device call; the first run
used ``--steps 140 --first-budget 230``, and the guard stopped kvpop (hence all three) at 39 steps. Lightning precision
``--precision`` (default ``auto``: ``bf16-mixed`` on CUDA, i.e. fp32 master weights and bf16 autocast for the
model); :class:`kvpop.attention.SparseContext` runs the scorers' hooks with autocast off, so the scorers
compute in fp32. The GGUF becomes a Hugging Face folder through :func:`kvpop.base_model.materialize`
(the embedded source, read from the GGUF's folder). Evaluation: :func:`kvpop.evaluate.evaluate_fidelity`
in float32 on held-out traces of another seed, for dense, streaming_llm (base model),
streaming_llm_plus, kvpop_mlp and kvpop.

Device calls (the GGUF comes in two halves, see ``../shared/tools/device-model.sh``; the wheels,
gguf and pydantic (for :class:`kvpop.config.TrainConfig`; the device image has none):
``python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5
annotated-types==0.8.0 typing-inspection==0.4.5`` with the device's platform flags, see the device notes):

    call 1, carry [".devmodel-a"]:  mkdir -p /tmp/devmodel && cp .devmodel-a/part_aa /tmp/devmodel/
    call 2 right after, carry [".devmodel-b", ".whl"]:
      f=/tmp/devmodel/SmolLM2-135M-Instruct.Q4_1.gguf; cat /tmp/devmodel/part_aa .devmodel-b/part_ab > $f &&
      echo "$(cat .devmodel-b/SHA256)  $f" | sha256sum -c &&
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
      PYTHONUNBUFFERED=1 PYTHONPATH=src:/tmp/site python3 bench/gpu_embedded_run.py --gguf $f \
        --model-dir /tmp/smol-hf --steps 56 --first-budget 340 --out $OUT/gpu_embedded_8k.json

CPU smoke test (tiny sizes): ``PYTHONPATH=src .venv/bin/python bench/gpu_embedded_run.py --small --model-dir models/base``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from kvpop.base_model import EMBEDDED_GGUF, materialize
from kvpop.config import TrainConfig
from kvpop.data.synthetic import generate_traces
from kvpop.evaluate import Candidate, evaluate_fidelity, score_positions
from kvpop.filter import filter_rows
from kvpop.modeling import load_model, model_shape
from kvpop.pack import pack_records
from kvpop.policies import make_policy
from kvpop.train import build_training, resolve_precision


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """The embedded model's GGUF (already on disk: nothing is downloaded) as a float32 Hugging Face folder."""
    if gguf.name != Path(EMBEDDED_GGUF).name or not gguf.is_file():
        raise SystemExit(f"--gguf must be an existing {Path(EMBEDDED_GGUF).name} (the embedded model), got {gguf}")
    materialize("embedded", out_dir, dtype="float32", cache_dir=gguf.parent)


def make_records(tok, n: int, seed: int, args) -> tuple[list[dict], dict, list[int], float]:
    """Records that fit seq_len, filter stats, quote distances (chars) of all rows, chars/token."""
    rows = generate_traces(n, seed, min_chars=args.min_chars, max_chars=args.max_chars, num_values=args.num_values,
                           num_recalls=args.num_recalls, min_quote_distance_chars=args.min_quote_distance_chars)
    records, stats = filter_rows(rows, tok, max_tokens=10 * args.seq_len)  # measure every trace, then cut
    chars = sum(len(r["messages"][-1]["content"]) for r in rows)
    cpt = chars / max(1, sum(len(r["input_ids"]) for r in records))
    qd = [d for r in rows for d in r["metadata"].get("quote_distance_chars", [])]
    st = stats.to_dict()
    kept = [r for r in records if len(r["input_ids"]) <= args.seq_len]
    st["too_long_for_seq_len"] = len(records) - len(kept)
    st["kept"] = len(kept)
    return kept, st, qd, cpt


def length_stats(xs: list[int], seq_len: int | None) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    out = {"n": len(xs), "min": xs[0], "median": xs[len(xs) // 2], "mean": round(sum(xs) / len(xs)), "max": xs[-1]}
    if seq_len:
        out["frac_5000_8000"] = round(sum(5000 <= x <= 8000 for x in xs) / len(xs), 3)
    return out


class StopAfter:
    """Lightning callback factory: stop when the wall-clock budget of the fit is spent."""

    @staticmethod
    def make(seconds: float):
        import lightning as L

        class _Stop(L.Callback):
            def on_train_start(self, trainer, pl_module):
                self.t0 = time.time()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if time.time() - self.t0 > seconds:
                    trainer.should_stop = True

        return _Stop()


def step_timer():
    """Lightning callback recording the wall-clock time at the end of every training step."""
    import lightning as L

    class _Timer(L.Callback):
        def __init__(self):
            self.t0, self.ends = None, []

        def on_train_start(self, trainer, pl_module):
            self.t0 = time.time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.ends.append(time.time())

        def summary(self) -> dict:
            e = self.ends
            out = {"first_step_s": round(e[0] - self.t0, 1) if e else None}
            if len(e) > 11:  # steady state: after the first 10 steps (compiles, warm-up)
                out["steady_s_per_step"] = round((e[-1] - e[10]) / (len(e) - 11), 3)
            return out

    return _Timer()


def train_policy(name: str, teacher, shape, packed, args, *, max_steps: int, time_budget: float | None, accelerator: str):
    # steps: the scorer's cosine-schedule length; max_steps (the first policy's) may stop earlier
    cfg = TrainConfig(steps=args.steps, seq_len=args.seq_len, batch_size=1, model_lr=args.model_lr, scorer_lr=args.scorer_lr,
                      scorer_hidden=args.scorer_hidden, top_logits=256, precision=args.precision, accelerator=accelerator)
    training = build_training(teacher, name, packed, cfg=cfg, budget=args.budget, sinks=args.sinks, window=args.window, seed=args.seed,
                              policy_kw={"scorer_dk": args.scorer_dk, "scorer_dv": args.scorer_dv})
    timer = step_timer()
    callbacks = [timer] + ([StopAfter.make(time_budget)] if time_budget else [])
    t0 = time.time()
    trainer = training.fit(max_steps=max_steps, callbacks=callbacks, enable_progress_bar=False)
    secs = time.time() - t0
    final = {k.removeprefix("train/"): round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    info = {"steps": trainer.global_step, "k": training.long_range, "seconds": round(secs, 1), **timer.summary(), **final}
    print(f"[train] {name}: {info}", flush=True)
    student, policy = training.student, training.policy
    if not policy.learned:
        policy = make_policy(name, **{x: shape[x] for x in ("num_layers", "num_kv_heads", "head_dim")})
    return student.float().eval(), policy.float().eval(), info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="GGUF to convert into --model-dir first (if that has no config.json)")
    ap.add_argument("--model-dir", default="/tmp/smol-hf")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--train-traces", type=int, default=192)
    ap.add_argument("--eval-traces", type=int, default=16)
    ap.add_argument("--min-chars", type=int, default=6_200, help="~1.23 chars/token: ~5,000 tokens")
    ap.add_argument("--max-chars", type=int, default=9_600, help="~7,950 tokens, under the 8,192-token rows")
    ap.add_argument("--num-values", type=int, default=40)
    ap.add_argument("--num-recalls", type=int, default=8)
    ap.add_argument("--min-quote-distance-chars", type=int, default=4_000)
    ap.add_argument("--steps", type=int, default=56, help="training steps of every policy; also the scorers' cosine-schedule length")
    ap.add_argument("--first-budget", type=float, default=340.0,
                    help="safety guard: seconds of kvpop training (fit, incl. compile); if hit, the others get kvpop's steps")
    ap.add_argument("--model-lr", type=float, default=1e-5)
    ap.add_argument("--scorer-lr", type=float, default=3e-3)
    ap.add_argument("--scorer-hidden", type=int, default=64)
    ap.add_argument("--scorer-dk", type=int, default=16)
    ap.add_argument("--scorer-dv", type=int, default=16)
    ap.add_argument("--precision", default="auto", help="Lightning precision (auto: bf16-mixed on CUDA or a bf16 CPU, else 32-true)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=1)
    ap.add_argument("--policies", default="kvpop,kvpop_mlp,streaming_llm_plus",
                    help="trained policies, in training order (the first runs under --first-budget)")
    ap.add_argument("--small", action="store_true", help="CPU smoke test with tiny sizes")
    ap.add_argument("--out", default="results/gpu_embedded_8k.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if args.small:
        args.seq_len, args.budget, args.window, args.train_traces, args.eval_traces = 768, 160, 64, 2, 1
        args.min_chars, args.max_chars, args.num_values, args.num_recalls = 700, 900, 24, 4
        args.min_quote_distance_chars, args.steps, args.first_budget = 500, 2, 60.0
    accelerator = "cuda" if cuda else "cpu"
    args.precision = resolve_precision(args.precision, accelerator)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    torch.backends.cuda.matmul.allow_tf32 = True
    t_start = time.time()

    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        if not args.gguf:
            raise SystemExit(f"{model_dir} has no config.json and no --gguf was given")
        convert_gguf(Path(args.gguf), model_dir)
        print(f"converted {args.gguf} -> {model_dir} ({time.time() - t_start:.0f}s)", flush=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    teacher = load_model(model_dir, "float32").to(dev)
    shape = model_shape(teacher)
    print(f"model {shape}, device {dev}", flush=True)

    train_recs, train_stats, _, cpt = make_records(tok, args.train_traces, args.seed, args)
    eval_recs, eval_stats, eval_qd, _ = make_records(tok, args.eval_traces, args.eval_seed, args)
    packed = pack_records(train_recs, seq_len=args.seq_len, pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    tl = [len(r["input_ids"]) for r in train_recs]
    el = [len(r["input_ids"]) for r in eval_recs]
    print(f"train: {train_stats}, {packed.stats.rows} packed rows (fill {packed.stats.fill_ratio:.2f}), trace tokens {min(tl)}-{max(tl)}", flush=True)
    print(f"eval: {eval_stats}, trace tokens {length_stats(el, args.seq_len)}, quote distance chars {length_stats(eval_qd, None)}, "
          f"{cpt:.3f} chars/token", flush=True)

    dims = {x: shape[x] for x in ("num_layers", "num_kv_heads", "head_dim")}
    out = {
        "budget": args.budget,
        "sinks": args.sinks,
        "window": args.window,
        "seq_len": args.seq_len,
        "eval_traces": len(eval_recs),
        "eval_trace_tokens": length_stats(el, args.seq_len),
        "train_traces": len(train_recs),
        "train_trace_tokens": length_stats(tl, args.seq_len),
        "train_rows": packed.stats.rows,
        "train_fill": round(packed.stats.fill_ratio, 3),
        "eval_quote_distance_chars": length_stats(eval_qd, None),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "precision": {"train": f"{args.precision} (scorer hooks in fp32, autocast off)", "eval": "float32"},
        "data": {"min_chars": args.min_chars, "max_chars": args.max_chars, "num_values": args.num_values,
                 "num_recalls": args.num_recalls, "min_quote_distance_chars": args.min_quote_distance_chars,
                 "seed": args.seed, "eval_seed": args.eval_seed, "chars_per_token_measured": round(cpt, 3),
                 "filter": {"train": train_stats, "eval": eval_stats}},
        "schedule_steps": args.steps,
        "train": {},
    }

    def write(partial: bool) -> None:
        out["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        out["seconds_total"] = round(time.time() - t_start, 1)
        out["partial"] = partial
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))

    # Training: same rows, same order (seeded loader), same step count for all three. kvpop first
    # (the slowest), under the safety guard; the others get exactly the steps it reached.
    trained = {}
    steps = args.steps
    for i, name in enumerate(args.policies.split(",")):
        student, policy, info = train_policy(name, teacher, shape, packed, args, max_steps=steps,
                                             time_budget=args.first_budget if i == 0 else None, accelerator=accelerator)
        if i == 0:
            steps = info["steps"]
        trained[name] = (student, policy, info)
        out["train"][name] = info
        out["steps"] = steps
        write(partial=True)
    teacher = teacher.float().to(dev).eval()

    # Evaluation. Every trace is right-padded to seq_len: the padding comes after the trace, so
    # causal logits of the trace are unchanged and padding is never scored (the delayed mLSTM reads
    # tokens up to t + window only for tokens t that leave the window, i.e. inside the trace); one
    # shape means one FlexAttention compile (evaluate_fidelity runs one trace per forward, and the
    # compiled flex is dynamic=False, so distinct lengths would recompile on every trace).
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    padded = []
    for r in eval_recs:
        n = args.seq_len - len(r["input_ids"])
        padded.append({**r, "input_ids": r["input_ids"] + [pad_id] * n, "loss_mask": r["loss_mask"] + [0] * n})
    cands = [Candidate("dense", teacher, make_policy("dense", **dims)), Candidate("streaming_llm", teacher, make_policy("streaming_llm", **dims))]
    cands += [Candidate(n, trained[n][0].to(dev), trained[n][1].to(dev))
              for n in ("streaming_llm_plus", "kvpop_mlp", "kvpop") if n in trained]
    out["k"] = {c.name: c.policy.long_range_slots(budget=args.budget, sinks=args.sinks, window=args.window, head_dim=shape["head_dim"])
                for c in cands}
    t0 = time.time()
    results = evaluate_fidelity(padded, teacher, cands, budget=args.budget, sinks=args.sinks, window=args.window, device=dev,
                                progress=lambda i, n: print(f"  eval trace {i}/{n} ({time.time() - t0:.0f}s)", flush=True))
    eval_tokens = sum(score_positions(r)[0].numel() for r in eval_recs)
    quote_tokens = sum(len(r["quote_positions"]) for r in eval_recs)
    out = {"policies": results, "eval_tokens": eval_tokens, "eval_quote_tokens": quote_tokens,
           "eval_seconds": round(time.time() - t0, 1), **out}
    write(partial=False)
    print(f"k per policy: {out['k']}; train: {out['train']}")
    print(f"\nteacher-forced fidelity, budget {args.budget} of {args.seq_len}-token rows, {steps} training steps per policy, "
          f"{eval_tokens} scored tokens ({quote_tokens} quote tokens) on {len(eval_recs)} held-out traces")
    print(f"{'policy':<20}{'KL to dense':>14}{'top-1 agree':>14}{'quote acc':>12}")
    for name, m in results.items():
        print(f"{name:<20}{m['kl']:>14.4f}{m['top1_agreement']:>14.3f}{m['quote_accuracy']:>12.3f}")
    print(f"wrote {args.out} ({out['seconds_total']}s total)")


if __name__ == "__main__":
    main()
