"""Scale-out on CPU: the strategies, DDP == one device on the same global batch, a sharded teacher.

FSDP through Lightning needs CUDA (``bench/multigpu_train.py`` proves it on GPUs); here the
teacher's FSDP sharding (:func:`kvpop.distributed.shard_frozen`, plain PyTorch FSDP) runs on two
gloo processes, and DDP runs through the real train stage (Lightning starts the second rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from kvpop.distributed import decoder_layer_classes, make_strategy, shard_frozen
from kvpop.geometry import CacheLayout
from kvpop.modeling import load_model
from test_resume import METRICS, OUT, base, db, make_workdir, stage_cmd  # noqa: F401 (fixtures)


def test_decoder_layers_and_strategies(tiny_qwen3_dir):
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = load_model(tiny_qwen3_dir)
    classes = decoder_layer_classes(model)
    assert {c.__name__ for c in classes} == {"Qwen3DecoderLayer"}
    assert make_strategy("single") == "auto"
    assert isinstance(make_strategy("ddp"), DDPStrategy)
    fsdp = make_strategy("fsdp", layer_classes=classes, checkpoint_format="sharded")
    assert isinstance(fsdp, FSDPStrategy) and fsdp._state_dict_type == "sharded"
    assert isinstance(fsdp.kwargs["auto_wrap_policy"], ModuleWrapPolicy) and fsdp.kwargs["use_orig_params"]
    with pytest.raises(ValueError, match="no decoder-layer class"):
        decoder_layer_classes(torch.nn.Linear(2, 2))


@pytest.mark.slow  # the train stage twice, once on two ranks
def test_ddp_equals_one_device_on_the_same_global_batch(tmp_path, base, db):  # noqa: F811
    """2 ranks at batch 1 vs 1 device at batch 2: same rows per step, KL over the global token count.

    The scorer learning rate is ~0 so both runs keep the same eviction pattern: the boundary loss is
    a per-rank mean (its gradient differs from the one-device mean when ranks hold different
    numbers of decisions); the KL and the student are exact up to float32 summation order.
    """
    runs = {}
    for name, train in {"one": {"batch_size": 2}, "ddp": {"batch_size": 1, "strategy": "ddp", "devices": 2}}.items():
        cwd = make_workdir(tmp_path / name, base, steps=4, checkpoint_every=4, scorer_lr=1e-12, **train)
        env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
        res = subprocess.run(stage_cmd(base), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = cwd
    m1, m2 = (json.loads((runs[n] / METRICS).read_text()) for n in ("one", "ddp"))
    assert m1["devices"] == 1 and m2["devices"] == 2 and m1["steps"] == m2["steps"] == 4
    # the KL (~5e-5 here: the student barely leaves the teacher) is a float32 sum of terms of the size of each
    # probability, so its summation-order error is absolute (~1e-9 seen), not relative to the small result
    assert m2["kl"] == pytest.approx(m1["kl"], rel=1e-5, abs=1e-8)
    assert m2["decisions"] == m1["decisions"]  # summed over ranks: the same decisions
    a, b = (torch.load(runs[n] / OUT / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"] for n in ("one", "ddp"))
    assert a.keys() == b.keys()
    # Adam divides each element's gradient by its own running scale, so the float32 summation-order error of a
    # near-zero gradient shows up relative to the learning rate, not to the gradient: a few elements differ by
    # ~3e-3 of one step (2.7e-6 at lr 1e-3 seen on an AMX CPU; under 2e-6 on others). A rank that saw other rows
    # moves most touched elements by O(lr); a loss over the wrong token count shows in the KL above.
    lr = yaml.safe_load((runs["one"] / "params.yaml").read_text())["train"]["model_lr"]
    keys = [k for k in a if k.startswith("student.")]
    for k in keys:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-2 * lr, msg=lambda m, k=k: f"{k}: {m}")
    loose = sum(int(((b[k] - a[k]).abs() > 2e-6).sum()) for k in keys)
    assert loose <= 1e-4 * sum(a[k].numel() for k in keys), f"{loose} elements differ by more than 2e-6"
    assert any(not torch.equal(a[k], load_model(base).state_dict()[k.removeprefix("student.")]) for k in a if k.startswith("student."))


def _sharded_teacher(rank: int, model_dir: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from kvpop.attention import SparseContext
        from kvpop.policies import make_policy

        from conftest import packed_toy

        torch.manual_seed(0)
        teacher = load_model(model_dir).requires_grad_(False).eval()
        full_numel = sum(p.numel() for p in teacher.parameters())
        sharded = shard_frozen(teacher, device=torch.device("cpu"), layer_classes=decoder_layer_classes(teacher))
        local_numel = sum(p.numel() for p in sharded.parameters())
        ids, doc, pos = packed_toy(2, 48, seed=rank)  # each rank its own rows
        ids = ids.clamp(max=teacher.config.vocab_size - 1)
        ctx = SparseContext.for_rows(make_policy("dense", num_layers=2, num_kv_heads=2, head_dim=16), doc, pos, layout=CacheLayout(13, 2, 6))
        with torch.no_grad():
            logits = sharded(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False).logits
        torch.save({"logits": logits, "ids": ids, "doc": doc, "pos": pos, "local": local_numel, "full": full_numel}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two gloo processes
def test_sharded_teacher_gives_the_unsharded_logits(tiny_qwen3_dir, tmp_path):
    """Each rank holds half of the frozen teacher and gets the full model's logits on its own rows."""
    from kvpop.attention import SparseContext
    from kvpop.policies import make_policy

    port = 29500 + os.getpid() % 1000
    mp.spawn(_sharded_teacher, args=(str(tiny_qwen3_dir), port, str(tmp_path)), nprocs=2, join=True)
    ref = load_model(tiny_qwen3_dir).eval()
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert r["local"] <= r["full"] // 2 + 64  # half of the flattened parameters (+ padding)
        ctx = SparseContext.for_rows(make_policy("dense", num_layers=2, num_kv_heads=2, head_dim=16), r["doc"], r["pos"], layout=CacheLayout(13, 2, 6))
        with torch.no_grad():
            want = ref(input_ids=r["ids"], position_ids=r["pos"], kvpop_ctx=ctx, use_cache=False).logits
        torch.testing.assert_close(r["logits"], want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
