"""Training step of the pool's learned policies: kvpop_pool (the delayed mLSTM, chunks of window - delay) vs kvpop_mlp_pool.

Both are trained in one pool (:mod:`kvpop.policies.kvpop_pool`): each step runs the student without
gradients through the chunked pool forward (:func:`kvpop.pool.pool_chunked`, chunks of ``window`` for
``kvpop_mlp_pool``, of ``window - delay`` for ``kvpop_pool``), then the differentiable forward under its
times, the teacher's forward and the pool's boundary loss. Each variant runs the pipeline's own loop
(:func:`kvpop.train.build_training`, Lightning's ``fit``; ``bf16-mixed`` on CUDA, float32 on the CPU)
on the embedded model's architecture (SmolLM2-135M: 30 layers, 9 query / 3 KV heads, head_dim 64,
hidden 576, intermediate 1536, vocabulary 49,152; random weights), one document per row, budget 512,
sinks 4, window 256, with random scorer read-outs (a scattered selection). Per variant: the median
seconds of a whole step (from the batch's start to its end: forwards, backward, optimizer) and of the
chunked pass alone (the same call outside the step), and both as ratios to ``kvpop_mlp_pool``'s.

    PYTHONPATH=src python bench/bench_pool_step.py                                  # CUDA: 4,096 tokens, delays 64, 128, 192
    PYTHONPATH=src python bench/bench_pool_step.py --cpu-smoke --out /tmp/pool.json  # CPU: 2 layers, 512 tokens, window 64
    PYTHONPATH=src python bench/bench_pool_step.py --scorer-kl 30 --delays --out /tmp/kl.json  # the KL signal's cost alone
    PYTHONPATH=src python bench/bench_pool_step.py --graphs --delays 64            # the pass and the step from CUDA graphs (train.pool_graphs)

``--out`` defaults to ``results/bench_pool_step/<device>[_small].json`` (:func:`kvpop.provenance.write_result`).
Needs pydantic (:class:`kvpop.config.TrainConfig`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import lightning as L
import torch

from kvpop.attention import register
from kvpop.benchmarking import default_out, smollm2_config, sync
from kvpop.config import TrainConfig
from kvpop.geometry import CacheLayout
from kvpop.pool import ChunkedGraphs, pool_chunked
from kvpop.provenance import write_result
from kvpop.train import PackedDataset, build_training


class StepTimer(L.Callback):
    """Seconds of every training batch, from its start to its end (forwards, backward, optimizer step)."""

    def __init__(self, dev: torch.device):
        self.dev, self.seconds, self.t0 = dev, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sync(self.dev)
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sync(self.dev)
        self.seconds.append(time.perf_counter() - self.t0)


def smollm2_model(layers: int, dev: torch.device):
    """The embedded model's architecture with random weights, every attention layer through kvpop's executors."""
    from transformers import AutoModelForCausalLM

    cfg = smollm2_config(layers)
    cfg._attn_implementation = register()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dev).eval().requires_grad_(False)


def fit_variant(teacher, name: str, delay: int | None, rows: PackedDataset, args, dev: torch.device, scorer_kl: float, graphs: bool):
    """One variant's training by the pipeline's loop -> (its Training, the step seconds after the warm-up)."""
    cuda = dev.type == "cuda"
    cfg = TrainConfig(steps=args.warmup + args.steps, batch_size=1, top_logits=args.top_logits, scorer_delay=delay, target="max",
                      boundary_weight="uniform", scorer_kl=scorer_kl, precision="bf16-mixed" if cuda else "32-true", accelerator=dev.type,
                      pool_graphs=graphs)
    training = build_training(teacher, name, rows, cfg=cfg, layout=CacheLayout(args.budget, args.sinks, args.window), seed=0)
    with torch.no_grad():
        for cell in training.policy.scorer.layers:  # read-outs that differ per token: a scattered selection
            torch.nn.init.normal_(cell.w2 if hasattr(cell, "w2") else cell.w_o)
    timer = StepTimer(dev)
    training.fit(callbacks=[timer], enable_progress_bar=False, default_root_dir=args.tmp_dir)
    return training, statistics.median(timer.seconds[args.warmup :])


def time_pass(run, n: int, warmup: int, dev: torch.device, cuda: bool) -> float:
    """Median seconds of ``run()`` (the chunked pass) after ``warmup`` calls, under the training's autocast."""
    seconds = []
    for _ in range(n):
        sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            run()
        sync(dev)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[warmup:])


def run_variant(teacher, name: str, delay: int | None, rows: PackedDataset, args, dev: torch.device, scorer_kl: float = 0.0) -> dict:
    cuda = dev.type == "cuda"
    training, step_s = fit_variant(teacher, name, delay, rows, args, dev, scorer_kl, graphs=False)
    ids = rows.t["input_ids"][:1].to(dev)
    student, policy = training.student.to(dev), training.policy.to(dev)  # Lightning's fit hands the module back on the CPU
    layout = training.module.s.layout
    n = args.warmup + args.steps
    row = {"policy": name, "delay": delay, "scorer_kl": scorer_kl, "chunk": args.window - (policy.read_delay(args.window) or 0),
           "long_range": layout.long_range, "step_s": step_s,
           "chunked_s": time_pass(lambda: pool_chunked(student, policy, ids, layout=layout), n, args.warmup, dev, cuda)}
    row["chunks"] = -(-args.tokens // row["chunk"])
    if args.graphs:  # the same pass replayed from a CUDA graph (captured in the first call), then a training with train.pool_graphs
        doc, pos = torch.zeros_like(ids), torch.arange(ids.shape[1], device=dev).expand_as(ids)
        graphs = ChunkedGraphs(student, policy, layout=layout)
        row["chunked_graph_s"] = time_pass(lambda: graphs(ids, doc_ids=doc, pos=pos), n, args.warmup, dev, cuda)
        row["graph_fallback"] = graphs.fallback  # why the eager pass ran instead, if it did
        row["step_graph_s"] = fit_variant(teacher, name, delay, rows, args, dev, scorer_kl, graphs=True)[1]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--delays", type=int, nargs="*", default=None, help="kvpop_pool's train.scorer_delay, one variant each (default 64 128 192, "
                    "--cpu-smoke 16 32 48; none given: no kvpop_pool row)")
    ap.add_argument("--scorer-kl", type=float, nargs="*", default=[], help="kvpop_mlp_pool with train.scorer_kl A, one variant each "
                    "(the KL's signal to the scorer: every layer scored before its attention, a float mask with a gradient)")
    ap.add_argument("--graphs", action="store_true", help="also each variant's chunked pass replayed from a CUDA graph (kvpop.pool.ChunkedGraphs) "
                    "and its step with train.pool_graphs (a second training): chunked_graph_s, step_graph_s")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--top-logits", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU, 2 layers, 512 tokens, budget 128, window 64, delays 16 32 48")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tmp-dir", default="/tmp/bench_pool_step", help="Lightning's default_root_dir (nothing is written there)")
    args = ap.parse_args()
    if bad := [a for a in args.scorer_kl if a < 0]:
        ap.error(f"--scorer-kl {bad}: train.scorer_kl is >= 0 (0: the plain step, always the first row)")
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if args.cpu_smoke:
        args.tokens, args.budget, args.window, args.layers = 512, 128, 64, 2
        args.delays = [16, 32, 48] if args.delays is None else args.delays
        args.top_logits, args.warmup, args.steps = 16, 1, 2
    elif not cuda:
        raise SystemExit("no CUDA device: use --cpu-smoke for the CPU run")
    if args.delays is None:
        args.delays = [64, 128, 192]
    torch.set_float32_matmul_precision("high")  # TF32 on CUDA, as the profiles train (train.matmul_precision); no effect on the CPU
    dev = torch.device("cuda" if cuda else "cpu")
    out = Path(args.out) if args.out else default_out(__file__, small=args.cpu_smoke, cuda=cuda)
    teacher = smollm2_model(args.layers, dev)
    g = torch.Generator().manual_seed(1)
    n, S = args.warmup + args.steps, args.tokens
    ids = torch.randint(0, teacher.config.vocab_size, (n, S), generator=g)
    rows = PackedDataset(ids, torch.zeros(n, S, dtype=torch.long), torch.arange(S).expand(n, S).clone(), torch.ones(n, S, dtype=torch.long))
    res = {"config": {"model": f"SmolLM2-135M architecture, {args.layers} layers, random weights", "tokens": S, "budget": args.budget,
                      "sinks": args.sinks, "window": args.window, "warmup": args.warmup, "steps": args.steps, "statistic": "median",
                      "precision": "bf16-mixed" if cuda else "float32"}, "variants": []}
    variants = [("kvpop_mlp_pool", None, 0.0)] + [("kvpop_mlp_pool", None, a) for a in args.scorer_kl if a > 0]
    for name, delay, kl in variants + [("kvpop_pool", d, 0.0) for d in args.delays]:
        row = run_variant(teacher, name, delay, rows, args, dev, scorer_kl=kl)
        base = res["variants"][0] if res["variants"] else row
        row.update(step_ratio=round(row["step_s"] / base["step_s"], 3), chunked_ratio=round(row["chunked_s"] / base["chunked_s"], 3))
        res["variants"].append(row)
        graphs = ""
        if "chunked_graph_s" in row:
            why = f" (eager: {row['graph_fallback']})" if row["graph_fallback"] else ""
            graphs = (f"; CUDA graph{why}: pass {row['chunked_graph_s']:.3f} s ({row['chunked_s'] / row['chunked_graph_s']:.2f}x faster), "
                      f"step {row['step_graph_s']:.3f} s ({row['step_s'] / row['step_graph_s']:.2f}x faster)")
        print(f"{name:15s} delay {delay!s:>4} scorer_kl {kl:g} chunk {row['chunk']:4d}: step {row['step_s']:.3f} s ({row['step_ratio']:.2f}x), "
              f"chunked pass {row['chunked_s']:.3f} s ({row['chunked_ratio']:.2f}x){graphs}", flush=True)
        write_result(out, res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
