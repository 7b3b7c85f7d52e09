"""Scale-out proof: 1 GPU vs 2 GPUs (DDP, FSDP) on the same global batch, in one call.

Trains through the library's training builder (:func:`kvpop.train.build_training`, as the train
stage: DistillModule, resumable loader, strategy; ``kvpop_mlp``: the student under the learned scorer's pattern,
distilled toward the frozen dense teacher) on a random-init Qwen3-4B-shaped pair (both models
really 4B; the student with AdamW), on synthetic packed rows with document structure:

  (a) 1 GPU, batch 2            (b) 2 GPUs, DDP, batch 1 each        (c) 2 GPUs, FSDP, batch 1 each

The three see the same rows at every step (``kvpop.train.EpochBatches``) and the KL is normalized
by the global token count, so (a), (b), (c) follow the same loss curve up to bf16 rounding and
reduction order. Written to ``--out`` (JSON): per-step ``kl``, ``score_loss`` and ``loss`` of each
run, max abs/rel difference of (b) and (c) against (a), per-GPU peak memory during training and
median step time, through :func:`kvpop.provenance.write_result`. Each run is a fresh process (started here; Lightning's own launcher starts its
second rank), so memory figures do not mix.

    PYTHONPATH=src python bench/multigpu_train.py       # 2 GPUs -> results/multigpu_train/h200.json
    PYTHONPATH=src python bench/multigpu_train.py --cpu-smoke --out /tmp/smoke.json   # tiny, CPU, gloo (no FSDP)

Needs torch, lightning, transformers and pydantic (:class:`kvpop.config.TrainConfig`; no DVC, MLflow,
datasets). The device image has no pydantic: carry its wheels (pydantic, pydantic_core,
annotated-types, typing-inspection; see the device notes) and put them on ``PYTHONPATH``, which
Lightning's launcher hands on to the second rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpop.benchmarking import default_out, run_script
from kvpop.provenance import write_result

PRESETS = {  # Qwen3 shapes (random init); vocab as the real models
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}
MODES = {"single": (1, "single"), "ddp": (2, "ddp"), "fsdp": (2, "fsdp")}


def synthetic_rows(n: int, seq_len: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """(n, S) packed rows: documents of random length, positions restarting, loss on all but the first token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq_len), generator=g)
    doc = torch.full((n, seq_len), -1, dtype=torch.long)
    pos = torch.zeros((n, seq_len), dtype=torch.long)
    lo, hi = max(8, seq_len // 16), max(16, seq_len // 3)
    for r in range(n):
        t, d = 0, 0
        while t < seq_len - 8:  # the tail stays padding
            m = min(int(torch.randint(lo, hi, (1,), generator=g)), seq_len - 8 - t)
            doc[r, t : t + m], pos[r, t : t + m] = d, torch.arange(m)
            t, d = t + m, d + 1
    mask = (doc >= 0).long() * (pos > 0).long()
    return {"input_ids": ids, "doc_ids": doc, "position_ids": pos, "loss_mask": mask}


def worker(args) -> None:
    """One run (one mode); under 2 devices Lightning re-runs this command for rank 1."""
    import lightning as L
    from transformers import AutoModelForCausalLM, Qwen3Config

    from kvpop.attention import register
    from kvpop.config import TrainConfig
    from kvpop.train import PackedDataset, build_training

    devices, strategy_name = MODES[args.worker]
    cuda = not args.cpu_smoke
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    cfg = Qwen3Config(**PRESETS[args.preset], max_position_embeddings=max(4096, args.seq_len))
    cfg._attn_implementation = register()
    L.seed_everything(args.seed)
    with device:  # the same seed gives the same weights on every rank; no CPU init of 4B parameters
        teacher = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    global_batch = 2
    train_cfg = TrainConfig(
        steps=args.steps, seq_len=args.seq_len, batch_size=global_batch // devices, top_logits=256 if cuda else 16,
        precision="bf16-mixed" if cuda else "32-true", accelerator="cuda" if cuda else "cpu", strategy=strategy_name, devices=devices,
    )  # model_lr 1e-5, scorer_lr 1e-2, scorer_hidden 64, grad_clip 1.0: the defaults
    rows = synthetic_rows(args.steps * global_batch, args.seq_len, cfg.vocab_size, seed=args.seed)
    training = build_training(teacher, "kvpop_mlp", PackedDataset(**rows), cfg=train_cfg, budget=args.budget, sinks=args.sinks,
                              window=args.window, seed=args.seed)
    student = training.student

    class Recorder(L.Callback):
        def __init__(self):
            self.curve, self.step_s, self._t = [], [], None

        def on_train_start(self, trainer, pl_module):
            if cuda:  # training memory only, not the one-off full copy before sharding
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            self.step_s.append(time.perf_counter() - self._t)
            m = trainer.callback_metrics  # means over ranks (sync_dist)
            kl, sl = float(m["train/kl"]), float(m.get("train/score_loss", 0.0))
            self.curve.append({"step": trainer.global_step, "kl": kl, "score_loss": sl, "loss": kl + sl})

    rec = Recorder()
    trainer = training.fit(callbacks=[rec], enable_progress_bar=False)
    rank = trainer.global_rank
    part = {"rank": rank, "peak_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            "reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None}
    if rank == 0:
        n_params = sum(p.numel() for p in student.parameters())
        part.update(curve=rec.curve, step_s=rec.step_s, student_params=n_params, devices=devices, strategy=strategy_name, world_size=trainer.world_size)
    Path(args.part).mkdir(parents=True, exist_ok=True)
    (Path(args.part) / f"{args.worker}_rank{rank}.json").write_text(json.dumps(part))


def compare(ref: list[dict], other: list[dict]) -> dict:
    out = {}
    for key in ("kl", "loss"):
        a = torch.tensor([r[key] for r in ref], dtype=torch.float64)
        b = torch.tensor([r[key] for r in other], dtype=torch.float64)
        if a.shape != b.shape:
            return {"error": f"curves of {len(a)} and {len(b)} steps"}
        d = (a - b).abs()
        out[key] = {"max_abs_diff": float(d.max()), "max_rel_diff": float((d / a.abs().clamp(min=1e-12)).max()),
                    "first_step_abs_diff": float(d[0])}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="result JSON (default: results/multigpu_train/<device>[_small].json)")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS), help="model shape (default qwen3-4b; tiny with --cpu-smoke)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default=None, help="comma list of single, ddp, fsdp (default all; no fsdp on CPU)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU, gloo (exercises the whole flow without GPUs)")
    ap.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    smoke = args.cpu_smoke
    args.preset = args.preset or ("tiny" if smoke else "qwen3-4b")
    args.steps = args.steps or (4 if smoke else 12)
    args.seq_len = args.seq_len or (128 if smoke else 2048)
    args.window = args.window or (32 if smoke else 256)
    args.budget = args.budget or (48 if smoke else 512)
    if args.worker:
        return worker(args)
    args.out = args.out or str(default_out(__file__, small=smoke, cuda=not smoke))

    modes = (args.modes or ("single,ddp" if smoke else "single,ddp,fsdp")).split(",")
    if not smoke and torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    result = {"preset": args.preset, "config": PRESETS[args.preset], "steps": args.steps, "seq_len": args.seq_len, "global_batch_rows": 2,
              "policy": "kvpop_mlp", "budget": args.budget, "sinks": args.sinks, "window": args.window,
              "precision": "32-true" if smoke else "bf16-mixed", "runs": {}}
    with tempfile.TemporaryDirectory() as parts:
        for mode in modes:
            cmd = ["--worker", mode, "--part", parts, "--out", args.out, "--preset", args.preset, "--steps", args.steps, "--seq-len", args.seq_len,
                   "--budget", args.budget, "--sinks", args.sinks, "--window", args.window, "--seed", args.seed] + (["--cpu-smoke"] if smoke else [])
            t0 = time.time()
            res = run_script(__file__, cmd, drop_env=("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"))
            run = {"wall_s": round(time.time() - t0, 1), "returncode": res.returncode}
            if res.returncode != 0:
                run["error"] = res.stderr[-4000:]
                print(f"{mode}: FAILED ({res.returncode})\n{res.stderr[-2000:]}", file=sys.stderr)
                result["runs"][mode] = run
                continue
            ranks = [json.loads(p.read_text()) for p in sorted(Path(parts).glob(f"{mode}_rank*.json"))]
            head = next(r for r in ranks if r["rank"] == 0)
            steady = head["step_s"][2:] or head["step_s"]
            run.update(devices=head["devices"], strategy=head["strategy"], student_params=head["student_params"], curve=head["curve"],
                       median_step_s=round(statistics.median(steady), 4), first_step_s=round(head["step_s"][0], 2),
                       peak_gb_per_gpu=[None if r["peak_gb"] is None else round(r["peak_gb"], 2) for r in sorted(ranks, key=lambda r: r["rank"])],
                       reserved_gb_per_gpu=[None if r["reserved_gb"] is None else round(r["reserved_gb"], 2) for r in sorted(ranks, key=lambda r: r["rank"])])
            result["runs"][mode] = run
            print(f"{mode}: {run['wall_s']} s, median step {run['median_step_s']} s, peak GB/GPU {run['peak_gb_per_gpu']}", file=sys.stderr)
    ref = result["runs"].get("single", {}).get("curve")
    if ref:
        result["agreement_vs_single"] = {m: compare(ref, r["curve"]) for m, r in result["runs"].items() if m != "single" and "curve" in r}
        peaks = {m: max(r["peak_gb_per_gpu"]) for m, r in result["runs"].items() if r.get("peak_gb_per_gpu") and r["peak_gb_per_gpu"][0] is not None}
        if "single" in peaks:
            result["peak_gb_ratio_vs_single"] = {m: round(v / peaks["single"], 3) for m, v in peaks.items() if m != "single"}
    write_result(args.out, result)
    print(json.dumps({k: result.get(k) for k in ("agreement_vs_single", "peak_gb_ratio_vs_single")}, indent=2))


if __name__ == "__main__":
    main()
