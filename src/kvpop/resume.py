"""Resume checkpoints of the train stage: periodic, atomic, checked before use.

:class:`ResumeCheckpoint` writes ``<dir>/step-XXXXXXXX.ckpt`` every ``every`` steps and at the last
one (a temp name, then a rename, so a kill at any moment leaves the previous complete checkpoint);
:func:`find_resume_checkpoint` finds and checks the newest one against the run's settings
(``run.json``), and a corrupt one, or one from other settings, raises
:class:`~kvpop.export.CheckpointError` naming the file: never a silent fresh start.
:func:`begin_run` and :func:`finish_run` bracket a run: only a finished run publishes its final
checkpoint into the stage's output folder (whole or not at all) and removes the resume folder.
The resume folder is not a DVC output (DVC deletes a stage's outputs before running it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import lightning as L

from kvpop.export import CheckpointError, check_training_checkpoint
from kvpop.io import atomic_dir, atomic_file

RUN_FILE = "run.json"
_CKPT = re.compile(r"^step-(\d{8})\.ckpt$")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.ckpt"


def checkpoint_step(path: Path) -> int:
    """The step of a resume checkpoint, from its name."""
    m = _CKPT.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not named like a resume checkpoint (step-XXXXXXXX.ckpt)")
    return int(m.group(1))


def complete_checkpoints(resume_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``resume_dir``, oldest first (temp names excluded)."""
    resume_dir = Path(resume_dir)
    if not resume_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in resume_dir.iterdir() if (m := _CKPT.match(p.name))]
    return sorted(found)


def _diff(a, b, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [f"{prefix.rstrip('.')}: {a!r} -> {b!r}"]


def find_resume_checkpoint(resume_dir: Path, run_config: dict) -> Path | None:
    """The newest complete checkpoint of this run in ``resume_dir``, checked; None for a fresh start.

    Raises :class:`CheckpointError` (naming the file, saying how to start over, touching nothing)
    when the folder belongs to a run with another configuration or its newest checkpoint is
    unreadable or incomplete.
    """
    resume_dir = Path(resume_dir)
    run_file = resume_dir / RUN_FILE
    found = complete_checkpoints(resume_dir)
    start_over = f"delete {resume_dir} to start this run over"
    if not run_file.is_file():
        if found:
            raise CheckpointError(f"{run_file} is missing beside checkpoints {[p.name for _, p in found]}; {start_over}")
        return None
    try:
        saved = json.loads(run_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"corrupt {run_file}: {err}; {start_over}") from None
    diff = _diff(saved, json.loads(json.dumps(run_config)))
    if diff:
        raise CheckpointError(
            f"{resume_dir} holds an interrupted run with other settings ({'; '.join(diff[:5])}); "
            f"restore those settings to resume it, or {start_over}"
        )
    if not found:
        return None
    path = found[-1][1]
    try:
        check_training_checkpoint(path)
    except CheckpointError as err:
        raise CheckpointError(f"cannot resume: {err}; nothing was changed, {start_over}") from None
    return path


def begin_run(resume_dir: Path, run_config: dict) -> None:
    """Prepare ``resume_dir`` for (re)starting: record the run's settings, drop partial writes."""
    resume_dir = Path(resume_dir)
    resume_dir.mkdir(parents=True, exist_ok=True)
    (resume_dir / ".gitignore").write_text("*\n")  # resume state is never versioned
    for p in resume_dir.glob(".step-*.partial"):  # an interrupted save: never complete
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    if not (resume_dir / RUN_FILE).is_file():
        with atomic_file(resume_dir / RUN_FILE) as f:
            f.write(json.dumps(run_config, indent=2, sort_keys=True) + "\n")


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` (a file or a folder of files) to ``dst``; copy across file systems."""
    def one(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_dir():
        shutil.copytree(src, dst, copy_function=one)
    else:
        one(str(src), str(dst))


def finish_run(resume_dir: Path, out_dir: Path, steps: int) -> Path:
    """Publish the final checkpoint as ``out_dir/last.ckpt`` (whole or not at all), then drop ``resume_dir``.

    The final checkpoint is hard-linked into the output, so until the output is complete the
    resume folder still holds it: an interruption here only repeats this step.
    """
    found = complete_checkpoints(resume_dir)
    if not found or found[-1][0] != steps:
        raise CheckpointError(f"no checkpoint of the final step {steps} in {resume_dir} (found {[p.name for _, p in found]})")
    with atomic_dir(out_dir) as tmp:
        _link_or_copy(found[-1][1], tmp / "last.ckpt")
    shutil.rmtree(resume_dir)
    return Path(out_dir) / "last.ckpt"


class ResumeCheckpoint(L.Callback):
    """Every ``every`` steps and at the last one, an atomic checkpoint ``<dir>/step-XXXXXXXX.ckpt``.

    All ranks write to ``.step-XXXXXXXX.ckpt.partial`` (a file, or a folder for FSDP sharded
    state), then rank 0 renames it to its final name and removes older ones: a kill at any moment
    leaves the previous complete checkpoint in place. The callback's own state (the last logged
    training metrics and the training seconds so far) travels in the checkpoint, so a run that
    resumes at its last step still reports its final metrics.
    """

    def __init__(self, dirpath: Path, every: int):
        self.dirpath, self.every = Path(dirpath), every
        self.metrics: dict[str, float] = {}
        self.seconds_before = 0.0  # training time of earlier (interrupted) processes
        self.resumed_from = 0
        self._t0: float | None = None

    @property
    def seconds(self) -> float:
        return self.seconds_before + (time.monotonic() - self._t0 if self._t0 is not None else 0.0)

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = time.monotonic()
        self.resumed_from = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        step = trainer.global_step
        if step % self.every == 0 or step >= trainer.max_steps:
            self.save(trainer)

    def save(self, trainer) -> Path:
        name = checkpoint_name(trainer.global_step)
        final, tmp = self.dirpath / name, self.dirpath / f".{name}.partial"
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        trainer.strategy.barrier("kvpop_ckpt_begin")
        trainer.save_checkpoint(tmp, weights_only=False)  # the whole training state (optimizer, schedules, loops), not the weights alone
        trainer.strategy.barrier("kvpop_ckpt_written")
        if trainer.is_global_zero:
            if final.exists():  # the same step saved again (a resumed last step)
                shutil.rmtree(final) if final.is_dir() else final.unlink()
            os.replace(tmp, final)
            _fsync_dir(self.dirpath)
            for _, old in complete_checkpoints(self.dirpath)[:-1]:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        trainer.strategy.barrier("kvpop_ckpt_done")
        return final

    def state_dict(self) -> dict:
        return {"metrics": dict(self.metrics), "seconds": self.seconds}

    def load_state_dict(self, state: dict) -> None:
        self.metrics = dict(state.get("metrics", {}))
        self.seconds_before = float(state.get("seconds", 0.0))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
