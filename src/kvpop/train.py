"""Training: KL distillation of the student toward its dense self, plus the detached scorer loss.

The student starts as a copy of the teacher and runs under a policy's sparse pattern; the frozen
teacher runs densely (causal within each packed document). The loss is

    KL(teacher || student) on the teacher's top-``top_logits`` tokens   -> student model only
      and the rest of the vocabulary as one outcome (zero when the two agree)
  + boundary loss of the learned scorer (if any), mean over layers       -> scorer and decay only

The two never mix: the pattern is built from detached priorities, and the scorer reads detached
keys and values. A ``gated`` policy (``dms``, ``trimkv``) has no boundary loss: its gate learns
from the KL itself, through the relaxed pattern (:meth:`kvpop.policies.Policy.relax`), plus its
budget loss (:meth:`kvpop.policies.Policy.gate_loss`: dms's compression loss, trimkv's capacity
loss). A policy that declares ``trains_model = False`` (``trimkv``) leaves the student frozen.
Optimizer groups: a fixed learning rate for the model, a cosine schedule for the scorer (or gate).

Scale-out and resume (see also :mod:`kvpop.distributed`):

- Each rank trains on its own share of every global batch (:class:`EpochBatches`: rank ``r`` of
  ``W`` takes rows ``[r * B, (r + 1) * B)`` of the global batch of ``W * B`` rows, so 1 GPU at
  batch ``W * B`` sees exactly the rows of ``W`` GPUs at batch ``B``). The KL is normalized by the
  global count of distilled tokens (an all-reduce of one number), so averaged gradients equal the
  single-device gradient of the same global batch. (The boundary loss is a per-rank mean.)
- :class:`ResumableLoader` is a stateful loader (``state_dict``/``load_state_dict``, which
  Lightning stores in the checkpoint's loop state): a resumed run consumes exactly the batches
  the uninterrupted run would have, mid-epoch included.
- Periodic, atomic resume checkpoints and their checks live in :mod:`kvpop.resume`.

One builder, :func:`build_training`, turns a ``TrainConfig`` (``params.yaml``'s ``train`` section or
one built in code) into the module, the loader and the Lightning trainer; the train stage and every
bench script use it, so a setting is read in one place. :func:`resolve_precision` maps
``train.precision: auto`` to the precision the hardware runs natively.

Shapes: B batch, S sequence, V vocabulary, K kept teacher logits.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from kvpop.attention import GateTraining, ScorerTraining, SparseContext
from kvpop.distributed import decoder_layer_classes, make_strategy, place_teacher
from kvpop.export import CheckpointError
from kvpop.geometry import CacheLayout
from kvpop.modeling import model_shape
from kvpop.policies import Dense, Policy, make_policy
from kvpop.pool import ChunkedGraphs

if TYPE_CHECKING:  # kvpop.config needs pydantic; this module does not
    from kvpop.config import TrainConfig


def teacher_topk(teacher_logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The teacher's ``k`` most likely next tokens: logits (B, S, V) -> their log-probabilities under the
    whole vocabulary's softmax (B, S, k) float32 and their ids (B, S, k)."""
    t = teacher_logits.float()
    vals, idx = t.topk(k, dim=-1)
    return vals - t.logsumexp(-1, keepdim=True), idx


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _kl_rows(student_logits: Tensor, t_logp: Tensor, top_idx: Tensor) -> Tensor:
    """(N, V) student logits, (N, K) teacher log-probs (whole-vocabulary softmax) and ids -> (N,) the KL
    over the K tokens and the rest of the vocabulary as one more outcome."""
    s_logp = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, top_idx)  # (N, K)
    p = t_logp.exp()
    p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)  # (N,)
    s_rest = _log1mexp(torch.logsumexp(s_logp, -1).clamp(max=-1e-7))  # log of the student's mass off the K
    return (p * (t_logp - s_logp)).sum(-1) + torch.special.xlogy(p_rest, p_rest) - p_rest * s_rest


def topk_kl(student_logits: Tensor, top_logp: Tensor, top_idx: Tensor, mask: Tensor, denom: Tensor | None = None, chunk: int = 2048) -> Tensor:
    """Mean over masked tokens of KL(p_T || p_S) over the teacher's top-K tokens and one outcome more, the
    rest of the vocabulary (the KL of both distributions coarsened to those K + 1 outcomes).

    student_logits (B, S, V); top_logp, top_idx (B, S, K) the teacher's log-probabilities (the whole
    vocabulary's softmax: :func:`teacher_topk`) and token ids; mask (B, S) 1 where the token's next-token
    prediction is distilled. ``denom`` replaces the local token count (data parallel: the global count /
    world size). Zero when the student's distribution is the teacher's; with K = V, the full KL. (The
    teacher renormalized over its K against the student's full softmax, as before, is not zero there: it
    is ``-log`` of the teacher's top-K mass, and its gradient moves the student's tail mass onto the K.)

    The student's log-softmax over the vocabulary is computed ``chunk`` tokens at a time and
    recomputed in backward (activation checkpointing), so no float32 (B, S, V) tensor is kept: at
    16K tokens and Qwen3's 151,936-token vocabulary that would be ~10 GB for the upcast and as much
    again for the saved log-softmax.
    """
    from torch.utils.checkpoint import checkpoint

    B, S, V = student_logits.shape
    t_logp = top_logp.float().flatten(0, 1)  # (B * S, K)
    if bool((t_logp.exp().sum(-1) > 1.0 + 1e-3).any()):
        raise ValueError("topk_kl takes the teacher's log-probabilities of its top-K tokens (kvpop.train.teacher_topk), "
                         "not its logits: their probabilities sum to more than 1")
    logits, idx = student_logits.flatten(0, 1), top_idx.flatten(0, 1)  # (B * S, V), (B * S, K)
    parts = []
    for s in range(0, B * S, chunk):
        sl = slice(s, s + chunk)
        if torch.is_grad_enabled() and logits.requires_grad:
            parts.append(checkpoint(_kl_rows, logits[sl], t_logp[sl], idx[sl], use_reentrant=False))
        else:
            parts.append(_kl_rows(logits[sl], t_logp[sl], idx[sl]))
    kl = torch.cat(parts).view(B, S)  # (B, S)
    m = mask.to(kl.dtype)
    d = m.sum() if denom is None else denom.to(kl.dtype)
    return (kl * m).sum() / d.clamp(min=1.0)


def prediction_mask(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """(B, S): position i predicts token i + 1 of the same document, which must be distilled."""
    nxt = F.pad(loss_mask[:, 1:], (0, 1))
    same = F.pad(doc_ids[:, 1:] == doc_ids[:, :-1], (0, 1))
    return nxt.bool() & same & (doc_ids >= 0)


class PackedDataset(Dataset):
    """Rows of the pack stage: dicts of (S,) tensors."""

    def __init__(self, input_ids: Tensor, doc_ids: Tensor, position_ids: Tensor, loss_mask: Tensor):
        self.t = dict(input_ids=input_ids.long(), doc_ids=doc_ids.long(), position_ids=position_ids.long(), loss_mask=loss_mask.long())

    def __len__(self) -> int:
        return self.t["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.t.items()}


@dataclass
class TrainSettings:
    layout: CacheLayout  # the policy's geometry (its long-range slots k)
    steps: int
    model_lr: float
    scorer_lr: float
    scorer_warmup: int = 0
    weight_decay: float = 0.0
    top_logits: int = 256
    scorer_training: ScorerTraining | None = None
    activation_checkpointing: bool = False
    pool_graphs: bool = False  # the pool policies' chunked pass from a CUDA graph (kvpop.pool.ChunkedGraphs), single-device runs
    gate_training: GateTraining | None = None  # gated policies (dms, trimkv)

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, layout: CacheLayout, seed: int) -> TrainSettings:
        """The settings of ``cfg``; the boundary loss samples its queries from a generator seeded with ``seed``."""
        return cls(
            layout=layout, steps=cfg.steps, model_lr=cfg.model_lr, scorer_lr=cfg.scorer_lr,
            scorer_warmup=cfg.scorer_warmup, weight_decay=cfg.weight_decay, top_logits=cfg.top_logits,
            scorer_training=ScorerTraining(
                tau=cfg.tau, tie_margin=cfg.tie_margin, query_samples=cfg.query_samples,
                target_normalizer=cfg.target_normalizer, target=cfg.target, weighting=cfg.boundary_weight,
                calibration=cfg.scorer_calibration, kl_signal=cfg.scorer_kl,
                generator=torch.Generator().manual_seed(seed),
            ),
            activation_checkpointing=cfg.activation_checkpointing,
            pool_graphs=cfg.pool_graphs,
            gate_training=GateTraining(tau=cfg.gate_tau, generator=torch.Generator().manual_seed(seed + 1),
                                       loss_weight=cfg.compression_weight, loss_ramp=cfg.compression_ramp),
        )


def scorer_schedule(warmup: int, steps: int):
    """The scorer's learning-rate factor per step: linear warm-up over ``warmup`` steps, then a
    cosine from 1 to 0 over the rest of ``steps``."""
    total = max(1, steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


class DistillModule(L.LightningModule):
    """Student under ``policy`` distilled toward a frozen dense ``teacher``."""

    def __init__(self, student, teacher, policy: Policy, settings: TrainSettings):
        super().__init__()
        self.student = student.train()  # from_pretrained returns eval mode
        self.policy = policy
        self.s = settings
        # the teacher is frozen and not part of the checkpoint: keep it out of the module tree
        teacher.requires_grad_(False).eval()
        self.__dict__["teacher"] = teacher
        self._dense = Dense()
        if settings.model_lr == 0 or not policy.trains_model:  # trimkv: the gate alone learns
            student.requires_grad_(False)
        if settings.activation_checkpointing:  # recompute each decoder layer in backward
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._pool_pass: ChunkedGraphs | None = None  # one_pool policies: the chunked pass before each step (on_fit_start makes it)

    def on_fit_start(self) -> None:
        if self.policy.one_pool and not self.policy.gated:  # trained in the pool: CUDA graphs on one device only (a sharded
            # student gathers its weights in the forward); a fit starts without the graphs of an earlier one
            self._pool_pass = ChunkedGraphs(self.student, self.policy, layout=self.s.layout, graphs=self.s.pool_graphs and self.trainer.world_size == 1,
                                            say=warnings.warn)
        # after the strategy has set up the student: replicate (single, DDP) or shard (FSDP) the teacher
        self.__dict__["teacher"] = place_teacher(self.teacher, self.trainer.strategy)

    def _generators(self) -> dict[str, torch.Generator]:
        """The random streams a resumed run must continue: the boundary loss's query sampling, the gate's noise."""
        st, gt = self.s.scorer_training, self.s.gate_training
        gens = {"kvpop_query_generator": st.generator if st is not None else None,
                "kvpop_gate_generator": gt.generator if gt is not None and self.policy.gated else None}
        return {k: g for k, g in gens.items() if g is not None}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        for key, g in self._generators().items():
            checkpoint[key] = g.get_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        for key, g in self._generators().items():
            if key in checkpoint:
                g.set_state(checkpoint[key])

    def _ctx(self, policy: Policy, batch, scorer_training=None, gate_training=None) -> SparseContext:
        return SparseContext.for_rows(
            policy, batch["doc_ids"], batch["position_ids"], self.s.layout,
            executor="flex" if batch["input_ids"].is_cuda else "sdpa", scorer_training=scorer_training, gate_training=gate_training,
        )

    def training_step(self, batch, batch_idx):
        ids, pos = batch["input_ids"], batch["position_ids"]
        mask = prediction_mask(batch["loss_mask"], batch["doc_ids"])
        distributed = self.trainer.world_size > 1
        with torch.no_grad():  # on this rank's rows: the (B, S, V) logits never leave the device
            t_logits = self.teacher(input_ids=ids, position_ids=pos, kvpop_ctx=self._ctx(self._dense, batch), use_cache=False).logits
            top_logp, top_idx = teacher_topk(t_logits, self.s.top_logits)  # (B, S, K)
            del t_logits
            # global distilled-token count / world size: averaged gradients = the global-batch gradient
            denom = self.trainer.strategy.reduce(mask.sum().float(), reduce_op="mean") if distributed else None
        gated = self.policy.gated
        ctx = self._ctx(self.policy, batch, self.s.scorer_training if self.policy.learned and not gated else None,
                        self.s.gate_training if gated else None)
        if self.policy.one_pool and not gated:  # trained in the pool (kvpop_mlp_pool, kvpop_pool): its pattern under the current scorer, exactly
            ctx.global_evict = self._pool_pass(ids, doc_ids=batch["doc_ids"], pos=pos)
        s_logits = self.student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False).logits
        ctx.finish_scorer_losses()
        kl = topk_kl(s_logits, top_logp, top_idx, mask, denom)
        loss = kl
        logs = {"train/kl": kl.detach()}
        if gated:
            gt = self.s.gate_training
            gate_loss, gate_logs = self.policy.gate_loss(
                ctx.gate_relaxations, doc_ids=batch["doc_ids"], pos=pos, layout=self.s.layout,
                weight=gt.loss_weight, ramp=gt.loss_ramp, progress=self.global_step / max(1, self.s.steps),
            )
            loss = loss + gate_loss
            logs.update({f"train/{k}": v for k, v in gate_logs.items()})
        if ctx.losses:
            score_loss = ctx.mean_scorer_loss()
            loss = loss + score_loss
            logs["train/score_loss"] = score_loss.detach()
            for key in ("agreement", "keep_rate"):
                logs[f"train/boundary_{key}"] = torch.stack([s[key].float().to(self.device) for s in ctx.stats]).mean()
            if all("calibration" in s for s in ctx.stats):  # train.scorer_calibration: r_hat's squared error to the target
                logs["train/calibration"] = torch.stack([s["calibration"].float().to(self.device) for s in ctx.stats]).mean()
            decisions = torch.stack([s["decisions"].float().to(self.device) for s in ctx.stats]).sum()
            log_g = torch.stack([self.policy.scorer.decay.log_gamma(i) for i in range(ctx.scored_layers)])
            logs["train/gamma_mean"] = log_g.exp().mean().float()
        # one dtype and device for every value, so that ranks all-reduce matching tensors
        logs = {k: v.detach().float().to(self.device) for k, v in logs.items()}
        self.log_dict(logs, prog_bar=True, on_step=True, batch_size=ids.shape[0], sync_dist=distributed)  # mean over ranks
        if ctx.losses:
            self.log("train/decisions", decisions, prog_bar=True, on_step=True, batch_size=ids.shape[0], sync_dist=distributed, reduce_fx="sum")
        return loss

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by the global norm; under FSDP through the root unit, which sums the norm over shards."""
        from kvpop.distributed import is_fsdp

        if gradient_clip_val and is_fsdp(self.trainer.strategy):
            if gradient_clip_algorithm not in (None, "norm"):
                raise ValueError(f"only norm clipping under FSDP, got {gradient_clip_algorithm!r}")
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    def configure_optimizers(self):
        groups, lambdas = [], []
        student_params = [p for p in self.student.parameters() if p.requires_grad]  # none when the policy freezes it (trimkv)
        if self.s.model_lr > 0 and student_params:
            groups.append({"params": student_params, "lr": self.s.model_lr, "weight_decay": self.s.weight_decay})
            lambdas.append(lambda step: 1.0)  # fixed learning rate for the model
        scorer_params = [p for p in self.policy.parameters() if p.requires_grad]
        if scorer_params:
            groups.append({"params": scorer_params, "lr": self.s.scorer_lr, "weight_decay": 0.0})
            lambdas.append(scorer_schedule(self.s.scorer_warmup, self.s.steps))
        if not groups:
            raise ValueError("nothing to train: train.model_lr is 0 and the policy has no scorer")
        opt = torch.optim.AdamW(groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class EpochBatches(Sampler[list[int]]):
    """This rank's batches of row indices, one seeded permutation of the rows per epoch.

    Epoch ``e`` uses the ``e + 1``-th ``randperm`` of a generator seeded with ``seed`` (the order
    of ``DataLoader(shuffle=True, generator=...)``). Global batch ``b`` is
    ``perm[b * W * B : (b + 1) * W * B]``; rank ``r`` takes its ``r``-th slice of ``B`` rows.
    Batches are full (the remainder of an epoch is dropped); a single-device dataset smaller
    than one batch gives one short batch. Iteration starts at batch ``start`` of ``epoch``.
    Rank and world size default to those of the initialized process group (read when used, so
    the same object works before and after Lightning starts its processes).
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int | None = None, world_size: int | None = None):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._rank, self._world = rank, world_size
        self.epoch, self.start = 0, 0

    def rank_world(self) -> tuple[int, int]:
        dist = torch.distributed
        live = dist.is_available() and dist.is_initialized()
        rank = self._rank if self._rank is not None else (dist.get_rank() if live else 0)
        world = self._world if self._world is not None else (dist.get_world_size() if live else 1)
        return rank, world

    def __len__(self) -> int:
        _, world = self.rank_world()
        per_step = self.batch_size * world
        if self.n >= per_step:
            return self.n // per_step
        if world == 1 and self.n > 0:
            return 1
        raise ValueError(f"{self.n} training rows cannot fill one global batch of {per_step} (train.batch_size {self.batch_size} x {world} devices)")

    def permutation(self, epoch: int) -> Tensor:
        """(n,) the row order of ``epoch``."""
        g = torch.Generator().manual_seed(self.seed)
        for _ in range(epoch):
            torch.randperm(self.n, generator=g)
        return torch.randperm(self.n, generator=g)

    def __iter__(self):
        rank, world = self.rank_world()
        nb, bs = len(self), min(self.batch_size, self.n)
        perm = self.permutation(self.epoch)
        for b in range(self.start, nb):
            first = (b * world + rank) * bs
            yield perm[first : first + bs].tolist()


class ResumableLoader(DataLoader):
    """A DataLoader over :class:`EpochBatches` that remembers how far it got (Lightning ``_Stateful``).

    ``position`` counts the batches handed out in the current epoch; Lightning fetches a sized
    loader's batch right before its training step (no prefetch), so at a checkpoint it equals
    the batches trained on. ``load_state_dict`` makes the next iteration continue from there.
    Use it with ``Trainer(use_distributed_sampler=False)``: it shards the rows itself.
    """

    def __init__(self, ds: Dataset, batch_size: int, seed: int, *, rank: int | None = None, world_size: int | None = None, num_workers: int = 0):
        super().__init__(ds, batch_sampler=EpochBatches(len(ds), batch_size, seed, rank, world_size), num_workers=num_workers)
        self.position = {"epoch": 0, "batch": 0}

    def __iter__(self):
        sampler = self.batch_sampler
        sampler.epoch, sampler.start = self.position["epoch"], self.position["batch"]
        for batch in super().__iter__():
            self.position["batch"] += 1
            yield batch
        self.position = {"epoch": self.position["epoch"] + 1, "batch": 0}

    def state_dict(self) -> dict:
        s = self.batch_sampler
        return {**self.position, "seed": s.seed, "batch_size": s.batch_size, "world_size": s.rank_world()[1], "rows": s.n}

    def load_state_dict(self, state: dict) -> None:
        now = self.state_dict()
        bad = {k: (state.get(k), now[k]) for k in ("seed", "batch_size", "world_size", "rows") if state.get(k) != now[k]}
        if bad:
            raise CheckpointError(
                "the resume checkpoint was written by a run with other data settings "
                + ", ".join(f"{k} {a} (now {b})" for k, (a, b) in bad.items())
                + "; resume with the same seed, train.batch_size, train.devices and data"
            )
        self.position = {"epoch": int(state["epoch"]), "batch": int(state["batch"])}


def make_loader(ds: PackedDataset, batch_size: int, seed: int, **kw) -> ResumableLoader:
    """The training loader: seeded shuffling, full batches, resumable mid-epoch."""
    return ResumableLoader(ds, batch_size, seed, **kw)


# --- precision and the training builder ------------------------------------------------------------

#: /proc/cpuinfo flags of CPUs with native bf16 arithmetic (AVX512-BF16, AMX)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (the first ``flags`` line); empty where the file is absent or has none."""
    try:
        text = Path(path).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


def resolve_precision(precision: str, accelerator: str) -> str:
    """Lightning precision for ``train.precision`` and ``train.accelerator``.

    ``"auto"`` is ``"bf16-mixed"`` where bf16 is native: CUDA (``accelerator`` cuda, or auto with a
    visible CUDA device) or a CPU with AVX512-BF16 or AMX; elsewhere ``"32-true"`` (emulated bf16
    is slower than float32). Any other value is returned unchanged.
    """
    if precision != "auto":
        return precision
    cuda = accelerator in ("cuda", "gpu") or (accelerator == "auto" and torch.cuda.is_available())
    native = cuda or bool(BF16_CPU_FLAGS & cpu_flags())
    return "bf16-mixed" if native else "32-true"


@dataclass
class Training:
    """A built training run: the module and loader, and the trainer settings of its config."""

    module: DistillModule
    loader: ResumableLoader
    cfg: TrainConfig
    long_range: int  # long-range slots k of the policy at the budget
    precision: str  # resolved Lightning precision (never "auto")

    @property
    def policy(self) -> Policy:
        return self.module.policy

    @property
    def student(self):
        return self.module.student

    def make_trainer(self, *, callbacks: Iterable[L.Callback] = (), logger: Any = False, **overrides) -> L.Trainer:
        """The Lightning trainer of ``cfg`` (steps, devices, strategy, precision, clipping); ``overrides``
        are further ``L.Trainer`` arguments and win (``max_steps``, ``enable_progress_bar``, ...)."""
        cfg = self.cfg
        layers = decoder_layer_classes(self.student) if cfg.strategy == "fsdp" else None
        strategy = make_strategy(cfg.strategy, layer_classes=layers, checkpoint_format=cfg.checkpoint_format, precision=self.precision)
        kw = dict(
            max_steps=cfg.steps, accelerator=cfg.accelerator, strategy=strategy, devices=cfg.devices, precision=self.precision,
            gradient_clip_val=cfg.grad_clip, log_every_n_steps=cfg.log_every, logger=logger, callbacks=list(callbacks),
            enable_checkpointing=False,  # resume checkpoints are kvpop.resume's (atomic)
            use_distributed_sampler=False,  # the loader shards the global batch itself
            enable_model_summary=False, num_sanity_val_steps=0, deterministic=False,
        )
        return L.Trainer(**{**kw, **overrides})

    def fit(self, *, ckpt_path: str | Path | None = None, **trainer_kw) -> L.Trainer:
        """Train (from ``ckpt_path`` when resuming); returns the trainer (see :meth:`make_trainer`).

        The checkpoint is read with ``weights_only=True`` (tensors and plain containers; never a pickled
        object): one holding anything else raises :class:`CheckpointError` naming it."""
        import pickle

        from kvpop.export import refused_pickle

        trainer = self.make_trainer(**trainer_kw)
        try:
            trainer.fit(self.module, self.loader, ckpt_path=ckpt_path, weights_only=True)
        except pickle.UnpicklingError as err:
            if (refused := refused_pickle(ckpt_path, err)) is None:
                raise
            raise refused from None
        return trainer


def training_policy(name: str, shape: Mapping[str, int], cfg: TrainConfig, **policy_kw: Any) -> Policy:
    """A fresh policy ``name`` for a model of ``shape`` (:func:`kvpop.modeling.model_shape`) with ``cfg``'s
    scorer settings (``scorer_hidden``, ``scorer_recency``, ``scorer_recency_space``, ``scorer_delay``; ``pool_floor``) and
    ``policy_kw`` (e.g. ``scorer_dk``): the policy a training run on ``cfg`` starts from."""
    dims = {k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")}
    policy = make_policy(name, **dims, scorer_hidden=cfg.scorer_hidden, scorer_recency=cfg.scorer_recency,
                         scorer_recency_space=cfg.scorer_recency_space, scorer_delay=cfg.scorer_delay, **policy_kw)
    return policy.with_floor(cfg.pool_floor) if cfg.pool_floor else policy  # trained and run with a per-head floor in its pool


def build_training(
    teacher, policy: str | Policy, data, *, cfg: TrainConfig, layout: CacheLayout, seed: int,
    student=None, policy_kw: Mapping[str, Any] | None = None,
) -> Training:
    """Everything a training run needs, from one config.

    ``teacher`` is the frozen dense model; ``student`` defaults to a trainable copy of it.
    ``policy`` is a name for :func:`kvpop.policies.make_policy` (with ``cfg.scorer_hidden``, ``cfg.scorer_recency``, ``cfg.scorer_recency_space`` and
    ``policy_kw``, e.g. ``scorer_dk``) or a built policy. ``data`` is a :class:`PackedDataset` or
    packed rows (``input_ids``, ``doc_ids``, ``position_ids``, ``loss_mask``, as the pack stage
    writes them). ``seed`` seeds the global RNGs (the scorer's initialization), the data order and
    the boundary loss's query sampling. The policy's long-range slots at the nominal ``layout`` and the resolved
    precision come back with the module and loader; :meth:`Training.fit` trains.
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    L.seed_everything(seed, workers=True)
    shape = model_shape(teacher)
    if isinstance(policy, str):
        policy = training_policy(policy, shape, cfg, **(policy_kw or {}))
    layout = layout.for_policy(policy, head_dim=shape["head_dim"])
    if student is None:  # the teacher may be frozen already (an earlier run on it)
        student = copy.deepcopy(teacher).requires_grad_(True)
    settings = TrainSettings.from_config(cfg, layout=layout, seed=seed)
    module = DistillModule(student, teacher, policy, settings)
    if not isinstance(data, Dataset):
        data = PackedDataset(data.input_ids, data.doc_ids, data.position_ids, data.loss_mask)
    loader = make_loader(data, cfg.batch_size, seed)  # shards itself across ranks, resumable
    precision = resolve_precision(cfg.precision, cfg.accelerator)
    if precision != cfg.precision:
        rank_zero_info(f"train.precision {cfg.precision!r} -> {precision!r} (accelerator {cfg.accelerator!r})")
    return Training(module=module, loader=loader, cfg=cfg, long_range=layout.long_range, precision=precision)
