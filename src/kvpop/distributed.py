"""Scale-out of training: the Lightning strategy, and the frozen teacher placed where the data lives.

Three strategies, all Lightning's own (:func:`make_strategy`):

- ``single``: one device (Lightning's default strategy), the embedded default.
- ``ddp``: :class:`~lightning.pytorch.strategies.DDPStrategy`. Student and scorer are replicated,
  gradients averaged; the teacher is replicated too (a plain copy on each device: frozen, it needs
  no DDP wrapper).
- ``fsdp``: :class:`~lightning.pytorch.strategies.FSDPStrategy` (PyTorch FSDP), full sharding with
  one FSDP unit per decoder layer (the classes named by the model's ``_no_split_modules``, e.g.
  ``Qwen3DecoderLayer``) and ``use_orig_params=True``, because the root unit mixes the trainable
  student embeddings with the scorer. The frozen teacher is sharded the same way
  (:func:`place_teacher`: its own FSDP root, same per-layer wrapping, same mixed precision), so
  both 8B models together take 1/N of their weights per GPU, plus one layer gathered at a time.

The teacher stays outside the LightningModule's tree on purpose: it is never checkpointed, never
handed to the optimizer, and Lightning's FSDP wrapping of the module is left untouched (Lightning
skips its auto-wrap policy when it finds an FSDP unit already inside the module).

Each rank runs the teacher on its own rows: the top-``top_logits`` logits (B, S, K) and the KL are
computed where the data lives; the (B, S, V) vocabulary logits are never gathered across ranks.
With FSDP, only parameters travel (one decoder layer all-gathered at a time).

Checkpoints under FSDP (``train.checkpoint_format``): ``full`` gathers the state to rank 0 and
writes one file, the same layout as a single-device run (simple, but rank 0 needs CPU memory for
the whole student and its optimizer state); ``sharded`` has every rank write its own shard with
``torch.distributed.checkpoint`` into a folder (fast, no gather; the layout is Lightning's: DCP
shards plus ``meta.pt``). :func:`kvpop.export.load_training_state` consolidates either.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import nn

Strategy = Literal["single", "ddp", "fsdp"]


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes of ``model`` that form one FSDP unit each: those in ``model._no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder-layer class (_no_split_modules={sorted(names)}); cannot shard it")
    return classes


def make_strategy(
    name: Strategy, *, layer_classes: set[type[nn.Module]] | None = None, checkpoint_format: Literal["full", "sharded"] = "full",
    precision: str = "32-true", timeout_s: int = 1800,
):
    """The Lightning strategy for ``train.strategy`` (``layer_classes`` needed for ``fsdp``).

    FSDP under ``bf16-mixed`` keeps float32 parameters (all-gathered in float32) and computes in
    bf16 through autocast, exactly as one device does; Lightning's default would cast every
    parameter of a unit to bf16, including the scorer and decay that share the root unit with the
    embeddings (the decay's ``gamma`` lives in [0.999, 0.999999], too fine for bf16).
    ``bf16-true`` keeps Lightning's all-bf16 setting.
    """
    from datetime import timedelta

    if name == "single":
        return "auto"
    if name == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        # every trainable parameter is used by every step (the scorer of every layer, the decay)
        return DDPStrategy(find_unused_parameters=False, timeout=timedelta(seconds=timeout_s))
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if not layer_classes:
            raise ValueError("fsdp needs the decoder-layer classes to wrap")
        mp = None
        if precision == "bf16-mixed":
            from torch.distributed.fsdp import MixedPrecision

            mp = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
        return FSDPStrategy(
            mixed_precision=mp,
            auto_wrap_policy=ModuleWrapPolicy(layer_classes),
            sharding_strategy="FULL_SHARD",
            use_orig_params=True,  # the root unit mixes student params (frozen if model_lr = 0) with the scorer's
            limit_all_gathers=True,
            state_dict_type=checkpoint_format,
            timeout=timedelta(seconds=timeout_s),
        )
    raise ValueError(f"unknown strategy {name!r}")


def is_fsdp(strategy) -> bool:
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, FSDPStrategy)


def shard_frozen(
    model: nn.Module, *, device: torch.device, layer_classes: set[type[nn.Module]], mixed_precision=None, sharding_strategy="FULL_SHARD"
) -> nn.Module:
    """A frozen model as its own FSDP root, one unit per decoder layer (needs a process group).

    Every parameter must be frozen: no gradient, no optimizer state, only sharded storage plus
    the layer being all-gathered during the forward.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("shard_frozen expects a frozen model (requires_grad False everywhere)")
    if isinstance(sharding_strategy, str):
        sharding_strategy = ShardingStrategy[sharding_strategy]
    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy(layer_classes), mixed_precision=mixed_precision,
        sharding_strategy=sharding_strategy, device_id=device, limit_all_gathers=True, use_orig_params=False,
    )


def place_teacher(teacher: nn.Module, strategy) -> nn.Module:
    """Put the frozen teacher on the training device(s) the way ``strategy`` trains the student.

    Under FSDP: sharded like the student (same wrapping, mixed precision and sharding strategy);
    otherwise: converted by the precision plugin (``bf16-true`` casts it) and moved to the device.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(teacher, FullyShardedDataParallel):
        return teacher
    if is_fsdp(strategy):
        mp = strategy.mixed_precision_config
        if mp is not None:  # its inputs are token ids and the SparseContext: nothing to cast, nothing to copy
            mp = dataclasses.replace(mp, cast_root_forward_inputs=False)
        return shard_frozen(
            teacher, device=strategy.root_device, layer_classes=decoder_layer_classes(teacher),
            mixed_precision=mp, sharding_strategy=strategy.sharding_strategy,
        )
    teacher = strategy.precision_plugin.convert_module(teacher)
    return teacher.to(strategy.root_device)
