"""Training: KL distillation of the student toward its dense self, plus the detached scorer loss.

The student starts as a copy of the teacher and runs under a policy's sparse pattern; the frozen
teacher runs densely (causal within each packed document). The loss is

    KL(teacher || student) on the teacher's top-``top_logits`` tokens   -> student model only
  + boundary loss of the learned scorer (if any), mean over layers       -> scorer and decay only

The two never mix: the pattern is built from detached priorities, and the scorer reads detached
keys and values. Optimizer groups: a fixed learning rate for the model, a cosine schedule for
the scorer.

Shapes: B batch, S sequence, V vocabulary, K kept teacher logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from kvpop.attention import ScorerTraining, SparseContext
from kvpop.policies import Dense, Policy


def topk_kl(student_logits: Tensor, top_vals: Tensor, top_idx: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked tokens of KL(p_T || p_S) on the teacher's top-K support.

    student_logits (B, S, V); top_vals, top_idx (B, S, K) teacher logits and their token ids,
    renormalized over the K; mask (B, S) 1 where the token's next-token prediction is distilled.
    """
    t_logp = torch.log_softmax(top_vals.float(), dim=-1)  # (B, S, K)
    s_logp = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, top_idx)  # (B, S, K)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # (B, S)
    m = mask.to(kl.dtype)
    return (kl * m).sum() / m.sum().clamp(min=1.0)


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
    k: int
    steps: int
    model_lr: float
    scorer_lr: float
    scorer_warmup: int = 0
    weight_decay: float = 0.0
    top_logits: int = 256
    scorer_training: ScorerTraining | None = None


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

    def on_fit_start(self) -> None:
        self.teacher.to(self.device)

    def _ctx(self, policy: Policy, batch, scorer_training=None) -> SparseContext:
        return SparseContext.for_rows(
            policy, batch["doc_ids"], batch["position_ids"], sinks=self.s.sinks, window=self.s.window, k=self.s.k,
            executor="flex" if batch["input_ids"].is_cuda else "sdpa", scorer_training=scorer_training,
        )

    def training_step(self, batch, batch_idx):
        ids, pos = batch["input_ids"], batch["position_ids"]
        mask = prediction_mask(batch["loss_mask"], batch["doc_ids"])
        with torch.no_grad():
            t_logits = self.teacher(input_ids=ids, position_ids=pos, kvpop_ctx=self._ctx(self._dense, batch)).logits
            top_vals, top_idx = t_logits.float().topk(self.s.top_logits, dim=-1)  # (B, S, K)
            del t_logits
        ctx = self._ctx(self.policy, batch, self.s.scorer_training if self.policy.learned else None)
        s_logits = self.student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
        kl = topk_kl(s_logits, top_vals, top_idx, mask)
        loss = kl
        logs = {"train/kl": kl.detach()}
        if ctx.losses:
            score_loss = torch.stack(ctx.losses).mean()
            loss = loss + score_loss
            logs["train/score_loss"] = score_loss.detach()
            for key in ("agreement", "keep_rate"):
                logs[f"train/boundary_{key}"] = torch.stack([s[key] for s in ctx.stats]).mean()
            logs["train/decisions"] = torch.stack([s["decisions"] for s in ctx.stats]).sum()
            log_g = torch.stack([self.policy.scorer.decay.log_gamma(i) for i in range(len(ctx.losses))])
            logs["train/gamma_mean"] = log_g.exp().mean().float()
        self.log_dict(logs, prog_bar=True, on_step=True, batch_size=ids.shape[0])
        return loss

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


def make_loader(ds: PackedDataset, batch_size: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(ds, batch_size=batch_size, shuffle=True, generator=g, drop_last=len(ds) >= batch_size)
