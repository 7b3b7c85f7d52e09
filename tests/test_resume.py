"""Training that survives a crash: kill the train stage mid-run, run it again, get the same result.

The stage runs as a subprocess on a tiny Qwen3 (2 layers, float32 on CPU) with a periodic
checkpoint every 2 of 8 steps and 4 batches per epoch, so a resume lands mid-epoch and the run
crosses an epoch boundary. Tolerance of the comparison: the resumed run must reproduce the
uninterrupted run's final student and scorer weights and final metrics exactly (same ops, same
order, same data on CPU; compared with ``torch.equal`` and ``==``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from kvpop.export import CheckpointError
from kvpop.pack import pack_records, save_packed
from kvpop.resume import begin_run, checkpoint_name, complete_checkpoints, find_resume_checkpoint
from kvpop.train import EpochBatches, PackedDataset, ResumableLoader

from conftest import build_tiny_model, packed_toy

ROOT = Path(__file__).resolve().parents[1]
POLICY = "kvpop_mlp"
STEPS, EVERY = 8, 2
RESUME = Path("checkpoints/train") / POLICY
OUT = Path("models/train") / POLICY
METRICS = Path("metrics/train") / f"{POLICY}.json"
TIMING = {"seconds", "tokens_per_s", "resumed_from_step"}


def toy_records(n: int = 24, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    recs = []
    for _ in range(n):
        m = int(torch.randint(20, 60, (1,), generator=g))
        recs.append({"input_ids": torch.randint(3, 300, (m,), generator=g).tolist(), "loss_mask": [1] * m})
    return recs


def make_workdir(path: Path, base: Path, **train) -> Path:
    """A run folder: params.yaml for a micro run, packed rows (8 rows of 128 tokens)."""
    path.mkdir(parents=True, exist_ok=True)
    save_packed(pack_records(toy_records(), seq_len=128, pad_id=0), path / "data/packed/train.safetensors")
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p.update(budget=48, sinks=4, window=32)
    p["base_model"]["source"] = str(base)
    p["train"].update(
        policies=[POLICY], steps=STEPS, seq_len=128, top_logits=16, scorer_hidden=8, batch_size=2, model_lr=1e-3,
        checkpoint_every=EVERY, precision="32-true", accelerator="cpu",
    )
    p["train"].update(train)
    (path / "params.yaml").write_text(yaml.safe_dump(p))
    return path


def stage_cmd(base: Path, script: str = "train.py") -> list[str]:
    return [sys.executable, str(ROOT / "pipeline" / script), "--policy", POLICY, "--base", str(base), "--out", str(OUT), "--metrics", str(METRICS)]


def env(db: Path) -> dict:
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db}", "DVC_EXP_NAME": "resume"}


def run_stage(cwd: Path, base: Path, db: Path) -> subprocess.CompletedProcess:
    return subprocess.run(stage_cmd(base), cwd=cwd, env=env(db), capture_output=True, text=True, timeout=300)


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def base(tiny_qwen3_dir) -> Path:
    """The base model of these runs: the session's tiny Qwen3 (conftest), read only."""
    return tiny_qwen3_dir


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow") / "mlflow.db"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, base, db) -> Path:
    cwd = make_workdir(tmp_path_factory.mktemp("whole"), base)
    res = run_stage(cwd, base, db)
    assert res.returncode == 0, res.stderr[-3000:]
    return cwd


@pytest.fixture(scope="module")
def killed(tmp_path_factory, base, db) -> Path:
    """A run killed (SIGKILL) right after its first periodic checkpoint appeared."""
    cwd = make_workdir(tmp_path_factory.mktemp("killed"), base)
    first = cwd / RESUME / checkpoint_name(EVERY)
    proc = subprocess.Popen(stage_cmd(base), cwd=cwd, env=env(db), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert first.exists(), f"no checkpoint appeared: {err[-3000:]}"
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (cwd / OUT).exists() and not (cwd / METRICS).exists()  # nothing published: DVC sees no output
    return cwd


@pytest.mark.slow  # the train stage three times (whole, killed, resumed)
def test_killed_run_resumes_to_the_uninterrupted_result(killed, uninterrupted, base, db, tmp_path):
    cwd = tmp_path / "run"
    shutil.copytree(killed, cwd)
    resumed_from = complete_checkpoints(cwd / RESUME)[-1][0]
    assert 0 < resumed_from < STEPS
    res = run_stage(cwd, base, db)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resuming from {RESUME / checkpoint_name(resumed_from)}" in " ".join(res.stderr.split())

    # DVC sees a complete, consistent output: last.ckpt and the metrics, nothing stale
    assert sorted(p.name for p in (cwd / OUT).iterdir()) == ["last.ckpt"]
    assert not (cwd / RESUME).exists()
    a = torch.load(uninterrupted / OUT / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(cwd / OUT / "last.ckpt", map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == STEPS
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert any(k.startswith("policy.") for k in a["state_dict"])
    for k, v in a["state_dict"].items():
        assert torch.equal(v, b["state_dict"][k]), k
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert all(torch.equal(sa[x], sb[x]) for x in sa)
    assert a["lr_schedulers"] == b["lr_schedulers"]
    ma, mb = (json.loads((d / METRICS).read_text()) for d in (uninterrupted, cwd))
    assert {k: v for k, v in ma.items() if k not in TIMING} == {k: v for k, v in mb.items() if k not in TIMING}
    assert ma["resumed_from_step"] == 0 and mb["resumed_from_step"] == resumed_from


class Payload:
    """An arbitrary object: unpickling it (a load without ``weights_only``) touches the file ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __setstate__(self, state: dict) -> None:
        Path(state["marker"]).touch()
        self.__dict__.update(state)


def plant_payload(ckpt: Path, marker: Path, out: Path | None = None) -> Path:
    """A real training checkpoint with a pickled :class:`Payload` among its callback states, at ``out`` (default: in place)."""
    c = torch.load(ckpt, map_location="cpu", weights_only=True)
    c["callbacks"]["Payload"] = Payload(marker)
    out = out or ckpt
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(c, out)
    return out


@pytest.mark.slow  # the train stage, killed, then run again
@pytest.mark.parametrize("damage", ["truncate", "garbage", "object"])
def test_corrupt_checkpoint_is_a_clear_error_and_touches_nothing(killed, base, db, tmp_path, damage):
    cwd = tmp_path / "run"
    shutil.copytree(killed, cwd)
    step, ckpt = complete_checkpoints(cwd / RESUME)[-1]
    marker = tmp_path / "unpickled"
    if damage == "object":  # a pickled object of a class defined here: refused, never unpickled
        plant_payload(ckpt, marker)
    else:
        data = ckpt.read_bytes()
        ckpt.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00not a checkpoint" * 64)
    before = files(cwd)
    if damage in ("truncate", "object"):  # the stage itself: exits before any work
        res = run_stage(cwd, base, db)
        msg = " ".join(res.stderr.split())
        assert res.returncode == 1, msg[-2000:]
        assert str(RESUME / checkpoint_name(step)) in msg and f"delete {RESUME} to start this run over" in msg
        if damage == "object":
            assert f"refused checkpoint {RESUME / checkpoint_name(step)}" in msg and "Payload" in msg, msg[-2000:]
            assert not marker.exists()
    else:  # the library check the stage calls
        run_config = json.loads((cwd / RESUME / "run.json").read_text())
        with pytest.raises(CheckpointError, match=checkpoint_name(step)):
            find_resume_checkpoint(cwd / RESUME, run_config)
    assert files(cwd) == before  # nothing deleted, nothing overwritten, no fresh start


def test_lightning_resume_load_refuses_an_object_even_when_torch_is_told_to_unpickle(tmp_path, monkeypatch):
    """Lightning's own load (``Trainer.fit(ckpt_path=...)``, through :meth:`Training.fit`) reads with
    ``weights_only=True``: a checkpoint holding a pickled object is refused naming the file, even with
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which makes torch unpickle wherever the caller leaves
    ``weights_only`` unset), and the object is never built; the same checkpoint without it resumes."""
    from kvpop.config import TrainConfig
    from kvpop.geometry import CacheLayout
    from kvpop.resume import ResumeCheckpoint
    from kvpop.train import build_training

    teacher = build_tiny_model("llama")
    ids, doc, pos = packed_toy(4, 64)
    data = PackedDataset(ids, doc, pos, (doc >= 0).long())

    def training(steps: int):
        cfg = TrainConfig(steps=steps, batch_size=2, top_logits=16, scorer_hidden=8, precision="32-true", accelerator="cpu")
        return build_training(teacher, POLICY, data, cfg=cfg, layout=CacheLayout(13, 2, 6), seed=0)

    kw = dict(enable_progress_bar=False, default_root_dir=tmp_path)
    training(2).fit(callbacks=[ResumeCheckpoint(tmp_path / "resume", 2)], **kw)
    good = tmp_path / "resume" / checkpoint_name(2)
    marker = tmp_path / "unpickled"
    evil = plant_payload(good, marker, tmp_path / "evil" / checkpoint_name(2))
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError, match=rf"refused checkpoint {re.escape(str(evil))}: .*Payload"):
        training(3).fit(ckpt_path=evil, callbacks=[ResumeCheckpoint(tmp_path / "again", 3)], **kw)
    assert not marker.exists()
    resumed = training(3).fit(ckpt_path=good, callbacks=[ResumeCheckpoint(tmp_path / "again", 3)], **kw)
    assert resumed.global_step == 3  # torch's default allow-list holds all a checkpoint needs


def test_other_settings_are_refused_by_name(tmp_path):
    begin_run(tmp_path, {"seed": 0, "train": {"steps": 8, "model_lr": 1e-3}})
    (tmp_path / checkpoint_name(2)).write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"train\.model_lr: 0\.001 -> 0\.01.*delete"):
        find_resume_checkpoint(tmp_path, {"seed": 0, "train": {"steps": 8, "model_lr": 1e-2}})


def test_partial_writes_are_never_resumed_and_are_cleared(tmp_path):
    cfg = {"seed": 0}
    begin_run(tmp_path, cfg)
    (tmp_path / f".{checkpoint_name(4)}.partial").write_bytes(b"half")  # a save killed midway
    assert complete_checkpoints(tmp_path) == [] and find_resume_checkpoint(tmp_path, cfg) is None
    begin_run(tmp_path, cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".gitignore", "run.json"]


def batches_of(loader, n: int) -> list[list[int]]:
    out = []
    for _ in range(n):  # a fresh iterator per epoch, as Lightning does
        for batch in loader:
            out.append(batch["input_ids"][:, 0].tolist())
            if len(out) == n:
                return out
    return out


def test_loader_resumes_mid_epoch_and_across_epochs():
    """A loader restored from another's state yields exactly the batches the first would have."""
    n = 10
    ids = torch.arange(n)[:, None].repeat(1, 4)  # row i holds token i
    ds = PackedDataset(ids, torch.zeros_like(ids), torch.zeros_like(ids), torch.ones_like(ids))
    whole = batches_of(ResumableLoader(ds, 3, seed=5, rank=0, world_size=1), 7)  # 3 batches per epoch
    assert len(whole) == 7 and all(len(b) == 3 for b in whole)
    assert sorted(sum(whole[:3], [])) == sorted(set(sum(whole[:3], [])))  # no row twice in an epoch
    assert whole[:3] != whole[3:6]  # a new order each epoch
    first = ResumableLoader(ds, 3, seed=5, rank=0, world_size=1)
    head = batches_of(first, 4)  # one epoch and one batch
    second = ResumableLoader(ds, 3, seed=5, rank=0, world_size=1)
    second.load_state_dict(first.state_dict())
    assert head + batches_of(second, 3) == whole
    # epoch 0 is the order of DataLoader(shuffle=True, generator=manual_seed(seed)) that it replaces
    g = torch.Generator().manual_seed(5)
    ref = [int(i) for i in torch.utils.data.RandomSampler(range(n), generator=g)]
    assert sum(whole[:3], []) == ref[:9]
    with pytest.raises(CheckpointError, match="batch_size 3 \\(now 2\\)"):
        ResumableLoader(ds, 2, seed=5, rank=0, world_size=1).load_state_dict(first.state_dict())


def test_ranks_share_the_single_device_global_batch():
    """W ranks at batch B see, step by step, exactly the rows of one device at batch W * B."""
    one = EpochBatches(17, 4, seed=1, rank=0, world_size=1)
    ranks = [EpochBatches(17, 2, seed=1, rank=r, world_size=2) for r in range(2)]
    assert len(one) == len(ranks[0]) == 4
    for step, (a, b0, b1) in enumerate(zip(one, *ranks)):
        assert a == b0 + b1, step
