"""Stage train: distill the student under one policy's sparse pattern (one run per policy).

Resume: the run checkpoints every ``train.checkpoint_every`` steps into ``--resume-dir``
(default ``checkpoints/train/<policy>``), a folder that is not a DVC output, because DVC deletes
a stage's outputs before running it. Run the stage again after a crash (``dvc repro`` or this
script) and it continues from the newest checkpoint: weights, scorer, optimizer, schedules, data
position. Only a finished run publishes ``--out/last.ckpt`` and ``--metrics`` and then removes its
resume folder, so DVC sees a complete output or none. A corrupt checkpoint, or a resume folder of
a run with other settings, stops the stage with the file named; delete that folder to start over.

Several devices (``train.strategy`` ddp/fsdp, ``train.devices``): Lightning starts the other
ranks by running this script again; only rank 0 talks to MLflow and writes the outputs.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
from pathlib import Path

import lightning as L
import torch

from kvpop import tracking
from kvpop.config import TRAIN_KEYS_NOT_IN_RESULT
from kvpop.export import CheckpointError
from kvpop.modeling import load_model
from kvpop.pack import load_packed
from kvpop.resume import ResumeCheckpoint, begin_run, checkpoint_step, find_resume_checkpoint, finish_run
from kvpop.train import build_training, resolve_precision

from common import Progress, console, fail, params, write_json


class StepProgress(L.Callback):
    """The training's progress (rank 0): steps of ``train.steps`` with elapsed time, ETA and the latest
    logged metrics; a rich bar on a terminal, else one line per ``train.log_every`` steps."""

    def __init__(self, every: int):
        self.every = every
        self.bar: Progress | None = None

    def on_train_start(self, trainer, pl_module):
        if trainer.is_global_zero:
            self.bar = Progress("train", trainer.max_steps, self.every).__enter__()
            self.bar.update(trainer.global_step)  # a resumed run starts part-way

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.bar is not None:
            m = {k.removeprefix("train/"): float(v) for k, v in trainer.callback_metrics.items() if k in ("train/kl", "train/score_loss")}
            self.bar.update(trainer.global_step, **m)

    def on_train_end(self, trainer, pl_module):
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--data", default="data/packed/train.safetensors")
    ap.add_argument("--out", required=True, help="checkpoint folder")
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--resume-dir", help="periodic checkpoints (default checkpoints/train/<policy>)")
    args = ap.parse_args()
    p = params()
    cfg = p.train.for_policy(args.policy)  # train.per_policy's values for this policy over the section's
    if args.policy not in cfg.policies:
        fail(f"--policy {args.policy!r} is not in train.policies {cfg.policies}")
    if cfg.strategy == "fsdp" and not torch.cuda.is_available():
        fail("train.strategy is 'fsdp' but no CUDA device is visible (Lightning's FSDP needs GPUs)")

    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank0 = rank_zero_only.rank == 0  # set from the environment Lightning gives the ranks it starts
    if not Path(args.data).is_file():
        fail(f"packed training data not found: {args.data} (run the pack stage)")
    if not (Path(args.base) / "config.json").is_file():
        fail(f"base model not found: {args.base} (run the base_model stage)")
    torch.set_float32_matmul_precision(cfg.matmul_precision)  # CUDA's float32 products (TF32 at 'high'); no effect on the CPU
    packed = load_packed(args.data)
    resume_dir = Path(args.resume_dir or f"checkpoints/train/{args.policy}")
    run_config = {  # "precision": train.precision "auto" may resolve differently on other hardware
        "seed": p.seed, "budget": p.budget, "sinks": p.sinks, "window": p.window, "policy": args.policy,
        "precision": resolve_precision(cfg.precision, cfg.accelerator),
        "train": cfg.model_dump(exclude=set(TRAIN_KEYS_NOT_IN_RESULT)), "data_rows": int(packed.input_ids.shape[0]),
        "base_config_sha1": hashlib.sha1((Path(args.base) / "config.json").read_bytes()).hexdigest(),
    }
    try:  # before any heavy work: a bad checkpoint stops here, with nothing touched
        ckpt = find_resume_checkpoint(resume_dir, run_config)
    except CheckpointError as err:
        fail(str(err))
    if rank0:
        begin_run(resume_dir, run_config)
        if ckpt is not None:
            console.print(f"resuming from {ckpt}")

    teacher = load_model(args.base)
    training = build_training(teacher, args.policy, packed, cfg=cfg, layout=p.layout, seed=p.seed)
    saver = ResumeCheckpoint(resume_dir, cfg.checkpoint_every)
    out = Path(args.out)
    logged = {"seed": p.seed, "budget": p.budget, "sinks": p.sinks, "window": p.window, "k": training.long_range, "policy": args.policy,
              "precision": training.precision, "train": cfg.model_dump()}
    runs = tracking.stage_run("train", logged, run_name=f"train/{args.policy}") if rank0 else contextlib.nullcontext()
    with runs as run:
        try:  # Lightning reads ckpt with weights_only=True: a pickled object in it, or a loader of other data settings, stops here
            trainer = training.fit(
                ckpt_path=ckpt,
                logger=run.lightning_logger() if run is not None else False,
                callbacks=[StepProgress(cfg.log_every), saver],
                enable_progress_bar=False,  # StepProgress: Lightning's bar cannot count a max_steps run over a resumable loader
            )
        except CheckpointError as err:
            fail(str(err))
        if not trainer.is_global_zero:
            return
        if trainer.global_step != cfg.steps:
            fail(f"training stopped at step {trainer.global_step} of {cfg.steps}; run the stage again to resume from {resume_dir}")
        final = {k.removeprefix("train/"): v for k, v in saver.metrics.items() if k.startswith("train/")}
        world = trainer.world_size
        metrics = {"policy": args.policy, "steps": trainer.global_step, "seconds": round(saver.seconds, 1),
                   "tokens_per_s": round(trainer.global_step * cfg.batch_size * world * cfg.seq_len / max(saver.seconds, 1e-9), 1),
                   "devices": world, "precision": training.precision, "resumed_from_step": checkpoint_step(ckpt) if ckpt else 0, **final}
        # metrics first: until finish_run has published out/last.ckpt, the resume folder keeps
        # the final checkpoint, so an interruption anywhere here only repeats this ending
        write_json(args.metrics, metrics)
        try:
            finish_run(resume_dir, out, cfg.steps)  # out/last.ckpt whole, then the resume folder goes
        except CheckpointError as err:
            fail(str(err))
        # the curves (train/*) are the run's metrics; the run's totals are bookkeeping: tags, and the JSON
        run.metrics({"tokens_per_s": metrics["tokens_per_s"]})
        run.tags({k: metrics[k] for k in ("steps", "seconds", "devices", "precision", "resumed_from_step")})
    console.print(metrics)


if __name__ == "__main__":
    main()
