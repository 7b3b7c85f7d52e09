"""Exported checkpoints: safetensors plus a JSON config, loadable without Lightning.

Layout of an export folder::

    config.json, model.safetensors, tokenizer files   the student, a plain Hugging Face folder
    kvpop.json                                        {"policy", "budget", "sinks", "window", "scorer": {...} | null}
    scorer.safetensors                                scorer and decay parameters (learned policies)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvpop.io import atomic_dir
from kvpop.policies import Policy, make_policy

META = "kvpop.json"
SCORER = "scorer.safetensors"


class CheckpointError(RuntimeError):
    """A missing, partial or corrupt checkpoint; the message names the file."""


def export(student, tokenizer, policy: Policy, out_dir: Path, *, budget: int, sinks: int, window: int, extra: dict | None = None) -> None:
    """Write the export folder atomically (temp folder, then rename)."""
    with atomic_dir(out_dir) as tmp:
        student.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        scorer_cfg = None
        if policy.learned:
            scorer_cfg = dict(policy.scorer.config)
            save_file({k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}, str(tmp / SCORER))
        meta = {"policy": policy.name, "budget": budget, "sinks": sinks, "window": window, "scorer": scorer_cfg, **(extra or {})}
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


def load_export(path: Path, dtype: str = "float32"):
    """(model, tokenizer, policy, meta) of an export folder."""
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
        scorer_forget_gate=sc.get("forget_gate", "sigmoid"),
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
    return model, tok, policy.eval(), meta
