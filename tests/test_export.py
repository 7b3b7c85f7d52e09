"""Exports load without Lightning and reproduce the trained student and scorer; bad ones fail clearly."""

from pathlib import Path

import pytest
import torch

from kvpop.export import CheckpointError, export, load_export
from kvpop.geometry import CacheLayout
from kvpop.modeling import load_model
from kvpop.policies import make_policy


@pytest.fixture
def exported(tiny_llama_dir, tiny_tokenizer, tmp_path):
    model = load_model(tiny_llama_dir)
    torch.manual_seed(3)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    out = tmp_path / "export"
    export(model, tiny_tokenizer, policy, out, layout=CacheLayout(40, 2, 8))
    return out, model, policy


def test_roundtrip(exported):
    out, model, policy = exported
    m2, tok, p2, meta = load_export(out)
    assert meta == {"policy": "kvpop_mlp", "budget": 40, "sinks": 2, "window": 8, "scorer": policy.scorer.config}
    for (k, a), b in zip(policy.state_dict().items(), p2.state_dict().values()):
        assert torch.equal(a, b), k
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    assert "lightning" not in str(type(m2)).lower()


def test_corrupt_scorer(exported):
    out, *_ = exported
    (out / "scorer.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="scorer.safetensors"):
        load_export(out)


def test_missing_and_corrupt_meta(exported, tmp_path):
    out, *_ = exported
    (out / "kvpop.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_export(out)
    with pytest.raises(CheckpointError, match="missing"):
        load_export(tmp_path / "nowhere")


# --- training checkpoints: one file, or an FSDP sharded folder, export the same ------------------

ROOT = Path(__file__).resolve().parents[1]


def _module(model_dir):
    from kvpop.attention import ScorerTraining
    from kvpop.train import DistillModule, TrainSettings

    student = load_model(model_dir)
    torch.manual_seed(7)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for layer in policy.scorer.layers:  # past the zero-initialized start
        torch.nn.init.normal_(layer.w2)
    s = TrainSettings(layout=CacheLayout(13, 2, 6), steps=1, model_lr=1e-3, scorer_lr=1e-2, top_logits=16, scorer_training=ScorerTraining())
    return DistillModule(student, load_model(model_dir), policy, s)


def _save_sharded(rank: int, model_dir: str, port: int, out: str) -> None:
    """What Lightning's FSDPStrategy(state_dict_type="sharded").save_checkpoint writes, on 2 gloo ranks."""
    import os

    import torch.distributed as dist
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save, _get_sharded_state_dict_context
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from kvpop.distributed import decoder_layer_classes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        module = _module(model_dir)
        if rank == 0:  # the single-device checkpoint of the same weights
            torch.save({"state_dict": module.state_dict(), "global_step": 1}, f"{out}/full.ckpt")
        wrapped = FSDP(module, auto_wrap_policy=ModuleWrapPolicy(decoder_layer_classes(module.student)), use_orig_params=True, device_id=torch.device("cpu"))
        opt = torch.optim.AdamW(wrapped.parameters(), lr=0.0)  # a real optimizer state, weights unchanged
        sum(p.sum() for p in wrapped.parameters()).backward()
        opt.step()
        with _get_sharded_state_dict_context(wrapped):
            state = {"model": wrapped.state_dict(), "optimizer_0": FSDP.optim_state_dict(wrapped, opt)}
        assert any(type(v).__name__ in ("ShardedTensor", "DTensor") for v in state["model"].values())
        _distributed_checkpoint_save(state, Path(out) / "sharded.ckpt")
        if rank == 0:
            torch.save({"global_step": 1, "loops": {}, "lr_schedulers": []}, Path(out) / "sharded.ckpt" / "meta.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo processes, then the export stage twice
def test_sharded_checkpoint_exports_like_a_single_device_one(tiny_qwen3_dir, tmp_path):
    import os
    import subprocess
    import sys

    import torch.multiprocessing as mp
    import yaml

    from kvpop.export import check_training_checkpoint, load_training_state

    mp.spawn(_save_sharded, args=(str(tiny_qwen3_dir), 29100 + os.getpid() % 1000, str(tmp_path)), nprocs=2, join=True)
    sharded = tmp_path / "sharded.ckpt"
    assert sharded.is_dir() and len(list(sharded.glob("*.distcp"))) == 2  # one shard per rank
    check_training_checkpoint(sharded)
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"]
    merged = load_training_state(sharded)
    assert merged.keys() == full.keys() and not any(k.startswith("teacher.") for k in merged)
    for k, v in full.items():
        assert torch.equal(merged[k], v), k

    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p.update(budget=40, sinks=2, window=8)
    p["train"]["scorer_hidden"] = 8
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    for name in ("full", "sharded"):
        cmd = [sys.executable, str(ROOT / "pipeline/export.py"), "--policy", "kvpop_mlp", "--ckpt", f"{name}.ckpt",
               "--base", str(tiny_qwen3_dir), "--out", f"export_{name}"]
        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
    a, b = tmp_path / "export_full", tmp_path / "export_sharded"
    assert sorted(x.name for x in a.iterdir()) == sorted(x.name for x in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name  # the same safetensors, byte for byte

    shard = sorted(sharded.glob("*.distcp"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="incomplete"):
        load_training_state(sharded)


@pytest.mark.parametrize("content", [b"", b"\x00garbage" * 10])
def test_corrupt_training_checkpoint(tmp_path, content):
    from kvpop.export import check_training_checkpoint, load_training_state

    f = tmp_path / "last.ckpt"
    f.write_bytes(content)
    for fn in (check_training_checkpoint, load_training_state):
        with pytest.raises(CheckpointError, match="last.ckpt"):
            fn(f)
    (tmp_path / "folder").mkdir()
    with pytest.raises(CheckpointError, match="meta.pt"):
        check_training_checkpoint(tmp_path / "folder")
