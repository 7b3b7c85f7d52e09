"""Benchmark of one training step: kvpop_mlp vs a dense-KL step of the same model at 16,384-token rows.

Both steps are the pipeline's own loop, built by :func:`kvpop.train.build_training` as in the train
stage: ``lightning.Trainer.fit`` on a :class:`kvpop.train.DistillModule` (its ``training_step`` and
``configure_optimizers``), with Lightning's ``bf16-mixed`` precision on CUDA (the step under bf16
autocast, backward, gradient clipping at ``train.grad_clip``, AdamW). The
frozen teacher runs densely (top-256 logits); the student runs under the ``dense`` policy (the
dense-KL step: the same code path, FlexAttention with a causal-within-document BlockMask) or under
``kvpop_mlp`` (scorer, selection, sparse FlexAttention, target pass and boundary loss in every
layer).

Model: the Qwen3-4B architecture (36 layers, 32 query / 8 KV heads, head_dim 128, hidden 2560,
intermediate 9728, vocab 151,936, tied embeddings), random weights. Student: fp32 master weights,
fp32 gradients and fp32 AdamW states, computing in bf16 under autocast (the pipeline's
``train.precision: bf16-mixed``), with activation checkpointing (non-reentrant); teacher: bf16
weights (under autocast it computes in bf16 either way). ``--model auto`` falls back to the Qwen3-1.7B
and then the Qwen3-0.6B architecture should the 4B one run out of memory, and says so.

One row of 16,384 tokens packing 4 documents (6,000 + 4,500 + 3,000 + 2,884 tokens); budget 2,048
(sinks 4, window 256, k 1,788). The scorer's output layer is randomly initialized, so its
selection is scattered (an untrained scorer selects by recency, which leaves whole blocks out:
the best case for FlexAttention's block sparsity, not the trained case).

Parts are timed with CUDA events around the library functions, wrapped by this script (the
library is unchanged): ``policy.scores`` (scorer, forward), ``eviction_times`` +
``block_mask_from_eviction_times`` (selection), ``future_attention_target`` (target pass),
``boundary_loss``, the attention executor (forward, and the recomputation in backward), and around
the phases of the step: teacher forward (with its top-256), student forward (with the KL), backward
(with the recomputation of every layer), optimizer. Medians over ``--steps`` steps after
``--warmup`` steps (the first compiles FlexAttention).

    PYTHONPATH=src python bench/bench_train_step.py                                  # one H200 -> results/bench_train_step/h200.json
    PYTHONPATH=src python bench/bench_train_step.py --model small --out /tmp/ts.json  # 4 layers of the 4B
    PYTHONPATH=src python bench/bench_train_step.py --cpu-smoke --out /tmp/ts.json    # CPU, tiny, 256 tokens

``--out`` (default ``results/bench_train_step/<device>[_small].json``) is written through
:func:`kvpop.provenance.write_result` after every variant.

Needs pydantic (:class:`kvpop.config.TrainConfig`), which the device image lacks: carry its wheels
(pydantic, pydantic_core, annotated-types, typing-inspection) as the device notes say.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import statistics
import time
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch

import kvpop.attention as kv_attention
from kvpop.attention import register
from kvpop.benchmarking import default_out
from kvpop.config import TrainConfig
from kvpop.geometry import CacheLayout
from kvpop.policies import Dense, make_policy
from kvpop.provenance import device_name, versions, write_result
from kvpop.train import PackedDataset, build_training

# Qwen3 architectures (hidden, intermediate, layers, query heads, KV heads); head_dim 128, vocab 151,936, tied
QWEN3 = {
    "4b": (2560, 9728, 36, 32, 8),
    "1.7b": (2048, 6144, 28, 16, 8),
    "0.6b": (1024, 3072, 28, 16, 8),
    "small": (2560, 9728, 4, 32, 8),  # 4 layers of the 4B: a quick run of the same per-layer shapes
}
MODEL_NAMES = {"4b": "Qwen3-4B architecture", "1.7b": "Qwen3-1.7B architecture", "0.6b": "Qwen3-0.6B architecture",
               "small": "4 layers of the Qwen3-4B architecture"}
FALLBACK = ["4b", "1.7b", "0.6b"]
WRAPPED = {  # kvpop.attention's globals -> part
    "eviction_times": "selection",
    "block_mask_from_eviction_times": "selection",
    "dense_mask": "selection",
    "future_attention_target": "target",
    "boundary_loss": "boundary_loss",
    "flex_execute": "attention",
    "sdpa_execute": "attention",
}
# (key in the JSON, its source in the timer (None: summed over the student's forward and backward), row label)
PARTS = [
    ("prep", "prep", "batch start (prediction mask)"),
    ("teacher", "teacher", "teacher forward (+ top-256)"),
    ("student_forward", "student_forward", "student forward (+ KL, logging)"),
    ("backward", "backward", "backward (+ recomputation)"),
    ("optimizer", "optimizer", "optimizer (AdamW, schedule)"),
    ("student_scorer", None, "  scorer (policy.scores, fwd)"),
    ("student_selection", None, "  selection (eviction_times + mask)"),
    ("student_target", None, "  target pass"),
    ("student_boundary_loss", None, "  boundary loss (fwd)"),
    ("student_attention", None, "  attention executor (fwd + recompute)"),
    ("teacher_selection", "teacher/selection", "  teacher: mask build"),
    ("teacher_attention", "teacher/attention", "  teacher: attention executor"),
]


class Timer:
    """Spans on the device timeline (CUDA events) or the host clock (CPU), grouped by (phase, part)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.phase = "idle"
        self.spans: dict[tuple[str, str], list] = defaultdict(list)
        self.marks: list = []

    def now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kw):
            t0 = self.now()
            out = fn(*args, **kw)
            self.spans[(self.phase, part)].append((t0, self.now()))
            return out

        return timed

    def enter(self, phase: str) -> None:
        self.marks.append((phase, self.now()))
        self.phase = phase

    def collect(self) -> dict[str, float]:
        """Seconds per phase, per (phase, part) and for the step; resets."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = defaultdict(float)
        for (phase, t0), (_, t1) in zip(self.marks, self.marks[1:]):
            out[phase] += self.seconds(t0, t1)
        out["step"] = self.seconds(self.marks[0][1], self.marks[-1][1])
        for (phase, part), spans in self.spans.items():
            out[f"{phase}/{part}"] += sum(self.seconds(a, b) for a, b in spans)
            out[f"{phase}/{part}/calls"] += len(spans)
        self.spans.clear()
        self.marks.clear()
        self.phase = "idle"
        return dict(out)


def build_models(name: str, dev: torch.device, cuda: bool, tiny: bool):
    """(teacher, student): random Qwen3 weights; teacher bf16 (fp32 on CPU), student fp32."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if tiny:
        from kvpop.modeling import tiny_config

        cfg = tiny_config("qwen3")
    else:
        hidden, inter, layers, heads, kv_heads = QWEN3[name]
        cfg = Qwen3Config(
            vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=128, max_position_embeddings=40960,
            tie_word_embeddings=True, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        )
    cfg.use_cache = False  # a training forward needs no KV cache
    torch.manual_seed(0)
    with torch.device(dev):
        teacher = AutoModelForCausalLM.from_config(cfg, attn_implementation=register(), dtype=torch.bfloat16 if cuda else torch.float32)
    student = copy.deepcopy(teacher).float()  # activation checkpointing: train.activation_checkpointing
    return teacher, student


def packed_rows(S: int, doc_lens: list[int], vocab: int, n: int) -> PackedDataset:
    """``n`` copies of one row packing documents of the given lengths; every token is distilled."""
    assert sum(doc_lens) == S, (doc_lens, S)
    g = torch.Generator().manual_seed(0)
    doc = torch.cat([torch.full((m,), d) for d, m in enumerate(doc_lens)])[None]
    pos = torch.cat([torch.arange(m) for m in doc_lens])[None]
    ids = torch.randint(0, vocab, (1, S), generator=g)
    rep = lambda t: t.expand(n, S).clone()  # noqa: E731
    return PackedDataset(rep(ids), rep(doc), rep(pos), torch.ones(n, S, dtype=torch.long))


class StepTimer(L.Callback):
    """Marks the phases of every training step on the timer; keeps the steps after the warm-up."""

    def __init__(self, timer: Timer, label: str, warmup: int, cuda: bool):
        self.timer, self.label, self.warmup, self.cuda = timer, label, warmup, cuda
        self.steps: list[dict] = []
        self.peak = None

    def on_train_start(self, trainer, pl_module):
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t_wall = time.perf_counter()
        self.timer.enter("prep")  # then the teacher's and the student's forward pre-hooks

    def on_before_backward(self, trainer, pl_module, loss):
        self.timer.enter("backward")

    def on_after_backward(self, trainer, pl_module):
        self.timer.enter("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.timer.enter("end")
        parts = self.timer.collect()
        parts["wall"] = time.perf_counter() - self.t_wall
        parts["loss"] = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        tag = "warm-up" if batch_idx < self.warmup else "timed"
        print(f"  {self.label} step {batch_idx} ({tag}): {parts['step'] * 1e3:.0f} ms on the device timeline, "
              f"{parts['wall']:.1f} s wall, loss {parts['loss']:.3f}", flush=True)
        if batch_idx >= self.warmup:
            self.steps.append(parts)
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated() / 2**30


def run_variant(label: str, teacher, student, policy, rows: PackedDataset, args, cuda: bool) -> dict:
    """``args.warmup + args.steps`` steps of ``Trainer.fit`` on one DistillModule; per-step seconds of every part.

    The pipeline's loop (:func:`kvpop.train.build_training`): Lightning's precision plugin
    (``bf16-mixed`` on CUDA: fp32 weights, the step under bf16 autocast), gradient clipping, the
    module's ``configure_optimizers`` (AdamW), one row per step.
    """
    cfg = TrainConfig(
        steps=1000, seq_len=args.tokens, batch_size=1, model_lr=1e-6, scorer_lr=1e-4, top_logits=args.top_logits,
        precision="bf16-mixed" if cuda else "32-true", accelerator="cuda" if cuda else "cpu", activation_checkpointing=True,
    )  # steps: the scorer's schedule length (only the first steps run)
    training = build_training(teacher, policy, rows, cfg=cfg, layout=CacheLayout(args.budget, args.sinks, args.window), seed=0, student=student)
    timer = Timer(cuda)
    cb = StepTimer(timer, label, args.warmup, cuda)
    saved = {n: getattr(kv_attention, n) for n in WRAPPED}
    for n, part in WRAPPED.items():
        setattr(kv_attention, n, timer.wrap(part, saved[n]))
    if policy.evicts:
        policy.scores = timer.wrap("scorer", policy.scores)
    hooks = [teacher.register_forward_pre_hook(lambda m, a: timer.enter("teacher")),
             student.register_forward_pre_hook(lambda m, a: timer.enter("student_forward"))]
    try:
        trainer = training.fit(max_steps=args.warmup + args.steps, callbacks=[cb], enable_progress_bar=False, default_root_dir=args.tmp_dir)
    finally:
        for h in hooks:
            h.remove()
        for n, fn in saved.items():
            setattr(kv_attention, n, fn)
        if "scores" in policy.__dict__:
            del policy.scores
        student.zero_grad(set_to_none=True)
    if trainer.global_step != args.warmup + args.steps:
        raise RuntimeError(f"{label}: {trainer.global_step} optimizer steps, expected {args.warmup + args.steps}")
    keys = sorted({k for st in cb.steps for k in st})
    med = {k: statistics.median(st.get(k, 0.0) for st in cb.steps) for k in keys}
    del trainer, training
    return {"median_s": med, "steps": cb.steps, "peak_memory_gib": cb.peak}


def summarize(res: dict) -> dict:
    """Totals per part over the step's phases, shares of the step, and the ratios."""
    out = {}
    for label, r in res["variants"].items():
        m = r["median_s"]
        step = m["step"]
        student = lambda part, m=m: sum(m.get(f"{ph}/{part}", 0.0) for ph in ("student_forward", "backward"))  # noqa: E731
        parts = {key: (m.get(src, 0.0) if src else student(key.removeprefix("student_"))) for key, src, _ in PARTS}
        out[label] = {
            "recomputed_layers_per_step": m.get("backward/attention/calls", 0.0),  # activation checkpointing at work
            "step_s": step,
            "tokens_per_s": res["config"]["tokens"] / step,
            "parts_s": parts,
            "shares": {k: v / step for k, v in parts.items()},
            "peak_memory_gib": r["peak_memory_gib"],
        }
    d, s = out.get("dense"), out.get("kvpop_mlp")
    if d and s:
        sel = s["shares"]["student_selection"]
        out["ratios"] = {
            "step_kvpop_mlp_over_dense": s["step_s"] / d["step_s"],
            "tokens_per_s_kvpop_mlp_over_dense": s["tokens_per_s"] / d["tokens_per_s"],
            "selection_share_of_kvpop_mlp_step": sel,
            "goal_step_ratio_le_1.5": s["step_s"] / d["step_s"] <= 1.5,
            "goal_selection_share_le_2pct": sel <= 0.02,
        }
    return out


def print_table(res: dict, summ: dict) -> None:
    c = res["config"]
    v = versions()
    print(f"\n{device_name()}, torch {v.get('torch')}, transformers {v.get('transformers')}")
    print(f"{c['model']} ({c['params_b']:.2f}B parameters, {c['layers']} layers, {c['heads']}/{c['kv_heads']} heads), "
          f"1 x {c['tokens']:,} tokens ({len(c['doc_lens'])} documents), budget {c['budget']} (sinks {c['sinks']}, "
          f"window {c['window']}, k {c['k']}), {c['precision']}, activation checkpointing; medians of {c['steps']} steps")
    d, s = summ.get("dense"), summ.get("kvpop_mlp")
    for label in ("dense", "kvpop_mlp"):
        if label in summ and summ[label]["recomputed_layers_per_step"] != c["layers"]:
            print(f"WARNING: {label}: {summ[label]['recomputed_layers_per_step']:.0f} layers recomputed per step, expected {c['layers']}")

    def cell(v, key):
        if v is None:
            return f"{'-':>22}"
        x = v["parts_s"][key]
        return f"{x * 1e3:>10.1f} ms {100 * x / v['step_s']:>6.1f}%  "

    print(f"{'part':<42}{'dense-KL':>22}{'kvpop_mlp':>22}{'kvpop_mlp / dense':>20}")
    for k, name in (("step_s", "step"), ("tokens_per_s", "tokens/s")):
        fmt = (lambda x: f"{x * 1e3:>13.1f} ms   ") if k == "step_s" else (lambda x: f"{x:>16,.0f}   ")
        ratio = f"{s[k] / d[k]:>19.2f}x" if d and s else ""
        print(f"{name:<42}{fmt(d[k]) if d else '-':>22}{fmt(s[k]) if s else '-':>22}{ratio}")
    for key, _, name in PARTS:
        dv, sv = (d["parts_s"][key] if d else None), (s["parts_s"][key] if s else None)
        ratio = f"{sv / dv:>19.2f}x" if d and s and dv > 1e-6 else f"{'-':>20}"
        print(f"{name:<42}{cell(d, key)}{cell(s, key)}{ratio}")
    if d and s:
        gib = lambda v: f"{v['peak_memory_gib']:>17.1f} GiB" if v["peak_memory_gib"] is not None else f"{'-':>21}"  # noqa: E731
        print(f"{'peak memory (allocated)':<42}{gib(d)} {gib(s)}")
        r = summ["ratios"]
        ok = lambda b: "met" if b else "MISSED"  # noqa: E731
        print(f"\ngoal: kvpop_mlp step <= 1.5x the dense-KL step: {r['step_kvpop_mlp_over_dense']:.2f}x ({ok(r['goal_step_ratio_le_1.5'])}); "
              f"selection <= 2% of the step: {100 * r['selection_share_of_kvpop_mlp_step']:.2f}% ({ok(r['goal_selection_share_le_2pct'])})")
    print("(indented parts are contained in the phases above them: scorer, selection, target pass, boundary loss and "
          "executor are timed inside the student forward and the recomputation in backward; their backward is in 'backward')")


def run_model(name: str, args, dev, cuda: bool, res: dict, out: Path) -> None:
    teacher, student = build_models(name, dev, cuda, tiny=args.cpu_smoke)
    cfg = student.config
    S = args.tokens
    doc_lens = args.doc_lens or [S * n // 16384 for n in (6000, 4500, 3000)]
    doc_lens = doc_lens if args.doc_lens else doc_lens + [S - sum(doc_lens)]  # 6,000 + 4,500 + 3,000 + 2,884 at 16,384
    rows = packed_rows(S, doc_lens, cfg.vocab_size, args.warmup + args.steps)
    k = args.budget - args.sinks - args.window
    res["config"] = {
        "model": MODEL_NAMES.get(name, "tiny Qwen3 (the tests' tiny_config)"),
        "params_b": sum(p.numel() for p in student.parameters()) / 1e9,
        "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
        "tokens": S, "batch": 1, "doc_lens": doc_lens, "budget": args.budget, "sinks": args.sinks, "window": args.window,
        "k": k, "top_logits": args.top_logits, "scorer_hidden": 64,
        "precision": "bf16-mixed (student fp32 weights, grads and AdamW states; bf16 autocast; teacher bf16)" if cuda
        else "float32",
        "activation_checkpointing": "non-reentrant, every decoder layer of the student",
        "warmup": args.warmup, "steps": args.steps, "statistic": "median",
        "timer": "CUDA events" if cuda else "perf_counter",
    }
    res["variants"] = {}
    dims = dict(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    for label in args.variants:
        print(f"--- {label}: {res['config']['model']}, {S} tokens", flush=True)
        if label == "dense":
            policy = Dense()
        else:
            torch.manual_seed(1)
            policy = make_policy("kvpop_mlp", **dims, scorer_hidden=64).to(dev)
            for layer in policy.scorer.layers:  # scattered selection (see the module docstring)
                torch.nn.init.normal_(layer.w2)
        res["variants"][label] = run_variant(label, teacher, student, policy, rows, args, cuda)
        del policy
        gc.collect()
        write_result(out, res)  # partial results after every variant
    res["summary"] = summarize(res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto", choices=["auto", *QWEN3], help="auto: 4b, falling back to 1.7b, 0.6b on OOM")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--doc-lens", type=int, nargs="+", default=None, help="document lengths of the row (sum = --tokens)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--top-logits", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--variants", nargs="+", default=["dense", "kvpop_mlp"], choices=["dense", "kvpop_mlp"])
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, tiny Qwen3, one 256-token row")
    ap.add_argument("--out", default=None, help="default: results/bench_train_step/<device>[_small].json")
    ap.add_argument("--tmp-dir", default="/tmp/bench_train_step", help="Lightning's default_root_dir (nothing is written there)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if args.cpu_smoke:
        args.model, args.tokens, args.doc_lens = "tiny", 256, [100, 80, 76]
        args.budget, args.sinks, args.window, args.top_logits, args.warmup, args.steps = 64, 4, 32, 16, 1, 3
    elif not cuda:
        raise SystemExit("no CUDA device: use --cpu-smoke for the CPU run")
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    res: dict = {}
    out = Path(args.out) if args.out else default_out(__file__, small=args.cpu_smoke, cuda=cuda)
    t0 = time.time()
    names = FALLBACK if args.model == "auto" else [args.model]
    for i, name in enumerate(names):
        try:
            run_model(name, args, dev, cuda, res, out)
            break
        except torch.OutOfMemoryError as err:
            if i + 1 == len(names):
                raise
            msg = f"{MODEL_NAMES[name]} ran out of memory ({str(err).splitlines()[0]}); falling back to {MODEL_NAMES[names[i + 1]]}"
        # outside the except block: the traceback (and the models in its frames) is gone
        print(msg, flush=True)
        res.setdefault("fallbacks", []).append(msg)
        res.pop("variants", None)
        gc.collect()
        torch.cuda.empty_cache()
    res["seconds_total"] = round(time.time() - t0, 1)
    write_result(out, res)
    print_table(res, res["summary"])
    print(f"wrote {out} ({res['seconds_total']} s)")


if __name__ == "__main__":
    main()
