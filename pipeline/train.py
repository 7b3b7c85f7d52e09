"""Stage train: distill the student under one policy's sparse pattern (one run per policy)."""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import lightning as L
import torch
from common import console, fail, params, write_json

from kvpop import tracking
from kvpop.attention import ScorerTraining
from kvpop.modeling import load_model, model_shape
from kvpop.pack import load_packed
from kvpop.policies import long_range_slots, make_policy
from kvpop.train import DistillModule, PackedDataset, TrainSettings, make_loader


class StepPrinter(L.Callback):
    """One line per logged step on stderr when the progress bar cannot draw (logs, CI)."""

    def __init__(self, every: int):
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every == 0 or step == trainer.max_steps:
            m = {k.removeprefix("train/"): f"{float(v):.4g}" for k, v in trainer.callback_metrics.items()}
            console.print(f"step {step}/{trainer.max_steps} " + " ".join(f"{k}={v}" for k, v in m.items()), highlight=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--data", default="data/packed/train.safetensors")
    ap.add_argument("--out", required=True, help="checkpoint folder")
    ap.add_argument("--metrics", required=True)
    args = ap.parse_args()
    p = params()
    cfg = p.train
    if args.policy not in cfg.policies:
        fail(f"--policy {args.policy!r} is not in train.policies {cfg.policies}")

    from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar

    L.seed_everything(p.seed, workers=True)
    if not Path(args.data).is_file():
        fail(f"packed training data not found: {args.data} (run the pack stage)")
    packed = load_packed(args.data)
    teacher = load_model(args.base)
    student = copy.deepcopy(teacher)
    shape = model_shape(teacher)
    policy = make_policy(args.policy, **{k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")}, scorer_hidden=cfg.scorer_hidden)
    k = long_range_slots(policy, budget=p.budget, sinks=p.sinks, window=p.window, head_dim=shape["head_dim"])
    settings = TrainSettings(
        sinks=p.sinks, window=p.window, k=k, steps=cfg.steps, model_lr=cfg.model_lr, scorer_lr=cfg.scorer_lr,
        scorer_warmup=cfg.scorer_warmup, weight_decay=cfg.weight_decay, top_logits=cfg.top_logits,
        scorer_training=ScorerTraining(
            tau=cfg.tau, tie_margin=cfg.tie_margin, query_samples=cfg.query_samples,
            target_normalizer=cfg.target_normalizer, generator=torch.Generator().manual_seed(p.seed),
        ),
    )
    module = DistillModule(student, teacher, policy, settings)
    ds = PackedDataset(packed.input_ids, packed.doc_ids, packed.position_ids, packed.loss_mask)
    loader = make_loader(ds, cfg.batch_size, p.seed)
    out = Path(args.out)
    logged = {"seed": p.seed, "budget": p.budget, "sinks": p.sinks, "window": p.window, "k": k, "policy": args.policy, "train": cfg.model_dump()}
    with tracking.stage_run("train", logged, run_name=f"train/{args.policy}") as run:
        trainer = L.Trainer(
            max_steps=cfg.steps,
            accelerator=cfg.accelerator,
            devices=1,
            precision=cfg.precision,
            gradient_clip_val=cfg.grad_clip,
            log_every_n_steps=cfg.log_every,
            logger=run.lightning_logger(),
            callbacks=[RichProgressBar() if console.is_terminal else StepPrinter(cfg.log_every), ModelCheckpoint(dirpath=out, filename="last", save_last=False, every_n_train_steps=cfg.steps)],
            enable_model_summary=False,
            num_sanity_val_steps=0,
            deterministic=False,
        )
        t0 = time.time()
        trainer.fit(module, loader)
        elapsed = time.time() - t0
        final = {k.removeprefix("train/"): float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        metrics = {"policy": args.policy, "steps": trainer.global_step, "seconds": round(elapsed, 1),
                   "tokens_per_s": round(trainer.global_step * cfg.batch_size * cfg.seq_len / max(elapsed, 1e-9), 1), **final}
        write_json(args.metrics, metrics)
        run.metrics({k: v for k, v in metrics.items() if k != "policy"}, prefix="final/")
    if not (out / "last.ckpt").is_file():
        fail(f"training finished without writing {out / 'last.ckpt'}")
    console.print(metrics)


if __name__ == "__main__":
    main()
