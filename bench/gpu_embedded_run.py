"""The GPU-scale run of the embedded model: 8,192-token rows, budget 1,024, train + teacher-forced evaluation.

SmolLM2-135M-Instruct on synthetic long-range traces (~4,000-8,000 tokens, quotes thousands of
tokens after their definitions). ``kvpop_mlp`` is trained first under a wall-clock budget; then
``streaming_llm_plus`` is trained for exactly the same number of steps on the same rows in the
same order. Both use the library's DistillModule (Lightning, precision ``bf16-mixed``: fp32 master
weights, bf16 autocast for the model; the scorer's hook runs with autocast off, so the scorer
computes in fp32). Evaluation: :func:`kvpop.evaluate.evaluate_fidelity` in float32 on held-out
traces of another seed, for dense, streaming_llm (base model), streaming_llm_plus and kvpop_mlp.

On the GPU machine (model folder made once from the GGUF):

    PYTHONPATH=src:/tmp/site python3 bench/gpu_embedded_run.py \
        --gguf /tmp/devmodel/SmolLM2-135M-Instruct.Q4_1.gguf --model-dir /tmp/smol-hf \
        --time-budget 150 --out results/gpu_embedded_8k.json

CPU smoke test (tiny sizes): ``PYTHONPATH=src .venv/bin/python bench/gpu_embedded_run.py --small --model-dir models/base``
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import time
from pathlib import Path

import torch

from kvpop.attention import ScorerTraining
from kvpop.data.synthetic import generate_traces
from kvpop.evaluate import Candidate, evaluate_fidelity, score_positions
from kvpop.filter import filter_rows
from kvpop.modeling import load_model, model_shape
from kvpop.pack import pack_records
from kvpop.policies import LearnedMLP, make_policy
from kvpop.train import DistillModule, PackedDataset, TrainSettings, make_loader


class FP32ScorerMLP(LearnedMLP):
    """kvpop_mlp whose scoring hook runs with autocast off (fp32 scorer under bf16-mixed)."""

    def scores(self, layer, k, v, pos):
        with torch.autocast(device_type=k.device.type, enabled=False):
            return super().scores(layer, k.float(), v.float(), pos)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


def make_records(tok, n: int, seed: int, args) -> tuple[list[dict], dict]:
    rows = generate_traces(n, seed, min_chars=args.min_chars, max_chars=args.max_chars, num_values=args.num_values,
                           num_recalls=args.num_recalls, min_quote_distance_chars=args.min_quote_distance_chars)
    records, stats = filter_rows(rows, tok, max_tokens=args.seq_len)
    return records, stats.to_dict()


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


def train_policy(name: str, teacher, shape, packed, args, *, max_steps: int, time_budget: float | None, accelerator: str):
    import lightning as L

    L.seed_everything(args.seed, workers=True)
    student = copy.deepcopy(teacher).requires_grad_(True)  # the teacher was frozen by an earlier DistillModule
    if name == "kvpop_mlp":
        base = make_policy(name, **{k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")}, scorer_hidden=args.scorer_hidden)
        policy = FP32ScorerMLP(base.scorer)
    else:
        policy = make_policy(name, **{k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")})
    settings = TrainSettings(
        sinks=args.sinks, window=args.window, k=args.budget - args.sinks - args.window, steps=max_steps,
        model_lr=args.model_lr, scorer_lr=args.scorer_lr, top_logits=256,
        scorer_training=ScorerTraining(tau=1.0, tie_margin=0.5, generator=torch.Generator().manual_seed(args.seed)),
    )
    module = DistillModule(student, teacher, policy, settings)
    ds = PackedDataset(packed.input_ids, packed.doc_ids, packed.position_ids, packed.loss_mask)
    loader = make_loader(ds, 1, args.seed)
    callbacks = [StopAfter.make(time_budget)] if time_budget else []
    trainer = L.Trainer(
        max_steps=max_steps, accelerator=accelerator, devices=1, precision=args.precision, gradient_clip_val=1.0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks,
    )
    t0 = time.time()
    trainer.fit(module, loader)
    secs = time.time() - t0
    final = {k.removeprefix("train/"): round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
    info = {"steps": trainer.global_step, "seconds": round(secs, 1), **final}
    print(f"[train] {name}: {info}", flush=True)
    eval_policy = make_policy(name, **{k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")}, scorer_hidden=args.scorer_hidden)
    if name == "kvpop_mlp":
        eval_policy = policy  # the trained scorer (its hook is plain fp32 outside autocast)
    return student.float().eval(), eval_policy.float().eval(), info


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
    ap.add_argument("--min-chars", type=int, default=6_500)
    ap.add_argument("--max-chars", type=int, default=13_000)
    ap.add_argument("--num-values", type=int, default=40)
    ap.add_argument("--num-recalls", type=int, default=8)
    ap.add_argument("--min-quote-distance-chars", type=int, default=4_000)
    ap.add_argument("--max-steps", type=int, default=400, help="upper bound; also the scorer's cosine-schedule length")
    ap.add_argument("--time-budget", type=float, default=150.0, help="seconds of kvpop_mlp training (fit, incl. compile)")
    ap.add_argument("--model-lr", type=float, default=1e-5)
    ap.add_argument("--scorer-lr", type=float, default=3e-3)
    ap.add_argument("--scorer-hidden", type=int, default=64)
    ap.add_argument("--precision", default=None, help="Lightning precision (default bf16-mixed on CUDA, 32-true on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="CPU smoke test with tiny sizes")
    ap.add_argument("--out", default="results/gpu_embedded_8k.json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    if args.small:
        args.seq_len, args.budget, args.window, args.train_traces, args.eval_traces = 1024, 160, 64, 6, 2
        args.min_chars, args.max_chars, args.num_values, args.num_recalls = 700, 1300, 24, 4
        args.min_quote_distance_chars, args.max_steps, args.time_budget = 700, 2, 60.0
    args.precision = args.precision or ("bf16-mixed" if cuda else "32-true")
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

    train_recs, train_stats = make_records(tok, args.train_traces, args.seed, args)
    eval_recs, eval_stats = make_records(tok, args.eval_traces, args.eval_seed, args)
    packed = pack_records(train_recs, seq_len=args.seq_len, pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    tl = [len(r["input_ids"]) for r in train_recs]
    el = [len(r["input_ids"]) for r in eval_recs]
    print(f"train: {train_stats}, {packed.stats.rows} packed rows (fill {packed.stats.fill_ratio:.2f}), trace tokens {min(tl)}-{max(tl)}", flush=True)
    print(f"eval: {eval_stats}, trace tokens {min(el)}-{max(el)}", flush=True)

    k = args.budget - args.sinks - args.window
    accelerator = "gpu" if cuda else "cpu"
    trained = {}
    s_kv, m_kv, info_kv = train_policy("kvpop_mlp", teacher, shape, packed, args, max_steps=args.max_steps,
                                       time_budget=args.time_budget, accelerator=accelerator)
    trained["kvpop_mlp"] = (s_kv, m_kv, info_kv)
    steps = info_kv["steps"]
    s_sl, m_sl, info_sl = train_policy("streaming_llm_plus", teacher, shape, packed, args, max_steps=steps,
                                       time_budget=None, accelerator=accelerator)
    trained["streaming_llm_plus"] = (s_sl, m_sl, info_sl)
    teacher = teacher.float().to(dev).eval()

    # Evaluation. Every trace is right-padded to seq_len: the padding comes after the trace, so
    # causal logits of the trace are unchanged and padding is never scored; one shape means one
    # FlexAttention compile (evaluate_fidelity runs one trace per forward, and the compiled flex is
    # dynamic=False, so distinct lengths would recompile on every trace).
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    padded = []
    for r in eval_recs:
        n = args.seq_len - len(r["input_ids"])
        padded.append({**r, "input_ids": r["input_ids"] + [pad_id] * n, "loss_mask": r["loss_mask"] + [0] * n})
    cands = [
        Candidate("dense", teacher, make_policy("dense", **{x: shape[x] for x in ("num_layers", "num_kv_heads", "head_dim")})),
        Candidate("streaming_llm", teacher, make_policy("streaming_llm", **{x: shape[x] for x in ("num_layers", "num_kv_heads", "head_dim")})),
        Candidate("streaming_llm_plus", s_sl.to(dev), m_sl.to(dev)),
        Candidate("kvpop_mlp", s_kv.to(dev), m_kv.to(dev)),
    ]
    t0 = time.time()
    results = evaluate_fidelity(padded, teacher, cands, budget=args.budget, sinks=args.sinks, window=args.window, device=dev,
                                progress=lambda i, n: print(f"  eval trace {i}/{n} ({time.time() - t0:.0f}s)", flush=True))
    eval_tokens = sum(score_positions(r)[0].numel() for r in eval_recs)
    quote_tokens = sum(len(r["quote_positions"]) for r in eval_recs)
    out = {
        "policies": results,
        "budget": args.budget,
        "sinks": args.sinks,
        "window": args.window,
        "k": k,
        "eval_tokens": eval_tokens,
        "eval_quote_tokens": quote_tokens,
        "eval_traces": len(eval_recs),
        "eval_trace_tokens": [min(el), max(el)],
        "train_traces": len(train_recs),
        "train_rows": packed.stats.rows,
        "train_fill": round(packed.stats.fill_ratio, 3),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "steps": steps,
        "seq_len": args.seq_len,
        "precision": {"train": f"{args.precision} (scorer hook in fp32, autocast off)", "eval": "float32"},
        "train": {name: info for name, (_, _, info) in trained.items()},
        "data": {"min_chars": args.min_chars, "max_chars": args.max_chars, "num_values": args.num_values,
                 "num_recalls": args.num_recalls, "min_quote_distance_chars": args.min_quote_distance_chars,
                 "seed": args.seed, "eval_seed": args.eval_seed},
        "seconds_total": round(time.time() - t_start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nteacher-forced fidelity, budget {args.budget} of {args.seq_len}-token rows, {steps} training steps per policy, "
          f"{eval_tokens} scored tokens ({quote_tokens} quote tokens) on {len(eval_recs)} held-out traces")
    print(f"{'policy':<20}{'KL to dense':>14}{'top-1 agree':>14}{'quote acc':>12}")
    for name, m in results.items():
        print(f"{name:<20}{m['kl']:>14.4f}{m['top1_agreement']:>14.3f}{m['quote_accuracy']:>12.3f}")
    print(f"wrote {args.out} ({out['seconds_total']}s total)")


if __name__ == "__main__":
    main()
