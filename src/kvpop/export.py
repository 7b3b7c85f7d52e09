"""Exported checkpoints: safetensors plus a JSON config, loadable without Lightning.

Layout of an export folder::

    config.json, model.safetensors, tokenizer files   the student, a plain Hugging Face folder
    kvpop.json                                        {"policy", "budget", "sinks", "window", "scorer": {...} | null}
                                                      (kvpop_pool: "scorer" holds its read-out "delay"; a pool trained
                                                      with a per-head floor: "pool_floor")
    scorer.safetensors                                scorer and decay parameters (learned policies)

Training checkpoints come in two layouts, both read by :func:`load_training_state`: one file
(``torch.save`` of Lightning's checkpoint dict: single device, DDP, FSDP ``full``) or a folder
(FSDP ``sharded``: ``torch.distributed.checkpoint`` shards of ``{"model": ..., "optimizer_0": ...}``
plus ``meta.pt`` with the rest). A sharded one is consolidated on the CPU in one process, model
weights only, into the same ``state_dict`` a single-device run saves, so both export identically.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvpop.geometry import CacheLayout
from kvpop.io import atomic_dir
from kvpop.policies import Policy, make_policy

META = "kvpop.json"
SCORER = "scorer.safetensors"
#: the non-tensor part of Lightning's FSDP sharded checkpoint folder
SHARDED_META = "meta.pt"
#: what every Lightning training checkpoint holds besides the weights (resume needs all of it)
TRAINING_KEYS = ("optimizer_states", "lr_schedulers", "loops", "global_step")


class CheckpointError(RuntimeError):
    """A missing, partial or corrupt checkpoint; the message names the file."""


def refused_pickle(path: Path, err: Exception) -> CheckpointError | None:
    """The :class:`CheckpointError` for ``torch.load(path, weights_only=True)`` refusing a pickled object
    (``err``), or None when ``err`` is another failure (a truncated or foreign file)."""
    import pickle

    if not isinstance(err, pickle.UnpicklingError) or "Weights only load failed" not in str(err):
        return None
    lines = [ln.strip() for ln in str(err).splitlines()]
    what = next((ln for ln in lines if ln.startswith("WeightsUnpickler error:")), lines[0])
    what = what.removeprefix("WeightsUnpickler error:").split(". Please use")[0].strip()  # e.g. "Unsupported global: GLOBAL m.C was not ..."
    return CheckpointError(
        f"refused checkpoint {path}: it holds a pickled object that is not a tensor or a plain container ({what}); "
        "kvpop loads checkpoints with weights_only=True and never runs the code a pickle names"
    )


def load_weights_only(path: Path, *, what: str = "corrupt", **kw) -> dict:
    """``torch.load(path, map_location="cpu", weights_only=True, **kw)``: tensors, plain containers and
    torch's default allow-list only (enough for every checkpoint kvpop writes: weights, optimizer and
    schedule states, loop and loader positions, generator states, callback floats). A file holding any
    other pickled object, or a damaged one, raises :class:`CheckpointError` naming ``path``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except Exception as err:  # a truncated or foreign file raises one of several types
        raise refused_pickle(path, err) or CheckpointError(f"{what} {path}: {err}") from None


def _check_sharded(path: Path) -> None:
    """A complete Lightning FSDP sharded checkpoint folder: meta.pt, DCP metadata, every shard whole."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = path / SHARDED_META
    if not meta.is_file():
        raise CheckpointError(f"{path} is a folder but not a sharded checkpoint: {meta} is missing")
    rest = load_weights_only(meta)
    missing = [k for k in ("loops", "global_step") if k not in rest]
    if missing:
        raise CheckpointError(f"corrupt {meta}: keys {missing} missing")
    try:
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise CheckpointError(f"corrupt sharded checkpoint {path} (its .metadata): {err}") from None
    if not any(k.startswith("model.") for k in md.state_dict_metadata):
        raise CheckpointError(f"sharded checkpoint {path} holds no model weights")
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file() or f.stat().st_size < size:
            raise CheckpointError(f"sharded checkpoint {path} is incomplete: {f} is missing or truncated")


def check_training_checkpoint(path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``path`` is a complete Lightning training checkpoint.

    A file is opened memory-mapped (cheap even for large models) and must hold the weights, the
    optimizer and schedule states and the loop state; a sharded folder must have every shard.
    """
    path = Path(path)
    if path.is_dir():
        return _check_sharded(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    ckpt = load_weights_only(path, what="corrupt checkpoint", mmap=True)  # truncated zip, garbage, foreign pickle
    missing = [k for k in ("state_dict", *TRAINING_KEYS) if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"incomplete checkpoint {path}: keys {missing} missing")


def load_training_state(path: Path) -> dict[str, torch.Tensor]:
    """The LightningModule ``state_dict`` (keys ``student.*``, ``policy.*``) of a training checkpoint.

    ``path``: a checkpoint file, or an FSDP sharded folder, which is consolidated here (model
    weights only; no process group needed). Raises :class:`CheckpointError` naming the file.
    """
    path = Path(path)
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        _check_sharded(path)
        state: dict = {}
        try:  # as torch's dcp_to_torch_save: the planner rebuilds whole tensors; "model" only, no optimizer
            _load_state_dict(state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
        except Exception as err:
            raise CheckpointError(f"cannot consolidate sharded checkpoint {path}: {err}") from None
        return state["model"]
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    ckpt = load_weights_only(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise CheckpointError(f"{path} is not a training checkpoint (no state_dict)")
    return ckpt["state_dict"]


def export(student, tokenizer, policy: Policy, out_dir: Path, *, layout: CacheLayout, extra: dict | None = None) -> None:
    """Write the export folder atomically (temp folder, then rename)."""
    with atomic_dir(out_dir) as tmp:
        student.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        scorer_cfg = None
        if policy.learned:
            scorer_cfg = dict(policy.scorer.config)
            if (delay := policy.read_delay(layout.window)) is not None:  # kvpop_pool: the read-out delay at this window
                scorer_cfg["delay"] = delay
            save_file({k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}, str(tmp / SCORER))
        meta = {"policy": policy.name, "budget": layout.budget, "sinks": layout.sinks, "window": layout.window, "scorer": scorer_cfg, **(extra or {})}
        if policy.pool_floor:  # trained with a per-head floor in its pool: it runs with it
            meta["pool_floor"] = policy.pool_floor
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(path: Path) -> dict:
    path = Path(path)
    f = path / META
    if not f.is_file():
        raise CheckpointError(f"not a kvpop export: {f} is missing")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"corrupt {f}: {err}") from None
    for key in ("policy", "budget", "sinks", "window"):
        if key not in meta:
            raise CheckpointError(f"corrupt {f}: key {key!r} missing")
    return meta


def load_export(path: Path, dtype: str = "float32", *, recency: float | None = None, recency_space: str | None = None):
    """(model, tokenizer, policy, meta) of an export folder; ``recency`` and ``recency_space`` override a
    learned scorer's fixed age decay and its scale (:mod:`kvpop.scorer`; None: the exported ones)."""
    from transformers import AutoTokenizer

    from kvpop.modeling import load_model, model_shape

    path = Path(path)
    meta = read_meta(path)
    model = load_model(path, dtype)
    tok = AutoTokenizer.from_pretrained(path)
    shape = model_shape(model)
    sc = meta.get("scorer") or {}
    policy = make_policy(
        meta["policy"], num_layers=shape["num_layers"], num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
        scorer_hidden=sc.get("hidden", 64), scorer_dk=sc.get("d_k", 16), scorer_dv=sc.get("d_v", 16),
        scorer_forget_gate=sc.get("forget_gate", "sigmoid"), scorer_recency=sc.get("recency", 0.0) if recency is None else recency,
        scorer_recency_space=sc.get("recency_space", "log") if recency_space is None else recency_space, scorer_delay=sc.get("delay"),
    )
    if policy.learned:
        f = path / SCORER
        if not f.is_file():
            raise CheckpointError(f"{f} is missing for learned policy {meta['policy']!r}")
        try:
            state = load_file(str(f))
        except Exception as err:  # safetensors raises several types for damaged files
            raise CheckpointError(f"corrupt {f}: {err}") from None
        try:
            policy.load_state_dict(state)
        except RuntimeError as err:
            raise CheckpointError(f"{f} does not match the model: {err}") from None
    policy.to(dtype=torch.float32)
    if floor := meta.get("pool_floor", 0):
        if not isinstance(floor, int) or floor < 0 or not policy.one_pool:
            raise CheckpointError(f"corrupt {path / META}: pool_floor {floor!r} (a whole number >= 0, for a one-pool policy; {meta['policy']!r})")
        policy = policy.with_floor(floor)
    return model, tok, policy.eval(), meta
