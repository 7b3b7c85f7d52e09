"""Training: KL distillation of the student toward its dense self, plus the detached scorer loss.

The student starts as a copy of the teacher and runs under a policy's sparse pattern; the frozen
teacher runs densely (causal within each packed document). The loss is

    KL(teacher || student) on the teacher's top-``top_logits`` tokens   -> student model only
  + boundary loss of the learned scorer (if any), mean over layers       -> scorer and decay only

The two never mix: the pattern is built from detached priorities, and the scorer reads detached
keys and values. Optimizer groups: a fixed learning rate for the model, a cosine schedule for
the scorer.

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

Shapes: B batch, S sequence, V vocabulary, K kept teacher logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

from kvpop.attention import ScorerTraining, SparseContext
from kvpop.distributed import place_teacher
from kvpop.export import CheckpointError
from kvpop.policies import Dense, Policy


def _kl_rows(student_logits: Tensor, t_logp: Tensor, top_idx: Tensor) -> Tensor:
    """(N, V) student logits, (N, K) teacher log-probs and ids -> (N,) KL(p_T || p_S) on the K."""
    s_logp = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, top_idx)  # (N, K)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def topk_kl(student_logits: Tensor, top_vals: Tensor, top_idx: Tensor, mask: Tensor, denom: Tensor | None = None, chunk: int = 2048) -> Tensor:
    """Mean over masked tokens of KL(p_T || p_S) on the teacher's top-K support.

    student_logits (B, S, V); top_vals, top_idx (B, S, K) teacher logits and their token ids,
    renormalized over the K; mask (B, S) 1 where the token's next-token prediction is distilled.
    ``denom`` replaces the local token count (data parallel: the global count / world size).

    The student's log-softmax over the vocabulary is computed ``chunk`` tokens at a time and
    recomputed in backward (activation checkpointing), so no float32 (B, S, V) tensor is kept: at
    16K tokens and Qwen3's 151,936-token vocabulary that would be ~10 GB for the upcast and as much
    again for the saved log-softmax.
    """
    from torch.utils.checkpoint import checkpoint

    B, S, V = student_logits.shape
    t_logp = torch.log_softmax(top_vals.float(), dim=-1).flatten(0, 1)  # (B * S, K)
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
    sinks: int
    window: int
    long_range: int  # long-range slots k
    steps: int
    model_lr: float
    scorer_lr: float
    scorer_warmup: int = 0
    weight_decay: float = 0.0
    top_logits: int = 256
    scorer_training: ScorerTraining | None = None
    activation_checkpointing: bool = False


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
        if settings.model_lr == 0:
            student.requires_grad_(False)
        if settings.activation_checkpointing:  # recompute each decoder layer in backward
            student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def on_fit_start(self) -> None:
        # after the strategy has set up the student: replicate (single, DDP) or shard (FSDP) the teacher
        self.__dict__["teacher"] = place_teacher(self.teacher, self.trainer.strategy)

    def _generator(self) -> torch.Generator | None:
        st = self.s.scorer_training
        return st.generator if st is not None else None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if (g := self._generator()) is not None:  # the boundary loss's query sampling
            checkpoint["kvpop_query_generator"] = g.get_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if (g := self._generator()) is not None and "kvpop_query_generator" in checkpoint:
            g.set_state(checkpoint["kvpop_query_generator"])

    def _ctx(self, policy: Policy, batch, scorer_training=None) -> SparseContext:
        return SparseContext.for_rows(
            policy, batch["doc_ids"], batch["position_ids"], sinks=self.s.sinks, window=self.s.window, long_range=self.s.long_range,
            executor="flex" if batch["input_ids"].is_cuda else "sdpa", scorer_training=scorer_training,
        )

    def training_step(self, batch, batch_idx):
        ids, pos = batch["input_ids"], batch["position_ids"]
        mask = prediction_mask(batch["loss_mask"], batch["doc_ids"])
        distributed = self.trainer.world_size > 1
        with torch.no_grad():  # on this rank's rows: the (B, S, V) logits never leave the device
            t_logits = self.teacher(input_ids=ids, position_ids=pos, kvpop_ctx=self._ctx(self._dense, batch), use_cache=False).logits
            top_vals, top_idx = t_logits.float().topk(self.s.top_logits, dim=-1)  # (B, S, K)
            del t_logits
            # global distilled-token count / world size: averaged gradients = the global-batch gradient
            denom = self.trainer.strategy.reduce(mask.sum().float(), reduce_op="mean") if distributed else None
        ctx = self._ctx(self.policy, batch, self.s.scorer_training if self.policy.learned else None)
        s_logits = self.student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False).logits
        kl = topk_kl(s_logits, top_vals, top_idx, mask, denom)
        loss = kl
        logs = {"train/kl": kl.detach()}
        if ctx.losses:
            score_loss = torch.stack([x.float() for x in ctx.losses]).mean()  # a layer without decisions gives float64 0
            loss = loss + score_loss
            logs["train/score_loss"] = score_loss.detach()
            for key in ("agreement", "keep_rate"):
                logs[f"train/boundary_{key}"] = torch.stack([s[key].float().to(self.device) for s in ctx.stats]).mean()
            decisions = torch.stack([s["decisions"].float().to(self.device) for s in ctx.stats]).sum()
            log_g = torch.stack([self.policy.scorer.decay.log_gamma(i) for i in range(len(ctx.losses))])
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
        if self.s.model_lr > 0:
            groups.append({"params": [p for p in self.student.parameters() if p.requires_grad], "lr": self.s.model_lr, "weight_decay": self.s.weight_decay})
            lambdas.append(lambda step: 1.0)  # fixed learning rate for the model
        scorer_params = [p for p in self.policy.parameters() if p.requires_grad]
        if scorer_params:
            groups.append({"params": scorer_params, "lr": self.s.scorer_lr, "weight_decay": 0.0})
            warm, total = self.s.scorer_warmup, max(1, self.s.steps)

            def cosine(step: int) -> float:
                if step < warm:
                    return (step + 1) / warm
                return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

            lambdas.append(cosine)
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
