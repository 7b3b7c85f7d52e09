"""Ceilings, not policies one can deploy: ``oracle_target`` and ``oracle_sources``.

Both rank tokens by something only the evaluated trace's *future* reveals, so they exist for
teacher-forced evaluation alone (``oracle = True``: never trained, never decoded). Reported beside
the trained policies they separate the two limits of a learned policy: what the training target
would give if the scorer fitted it perfectly, and what the budget allows at all.

* ``oracle_target``: the dense teacher's own ranking by the training target (``train.target``, a
  :class:`kvpop.target.TargetSpec`: :func:`kvpop.target.future_attention_target` of its kind,
  widened to its scope by :func:`kvpop.target.scope_targets`), computed on the evaluated trace
  itself. Per layer and KV head, priority = the target ``r_tgt`` (no decay; with ``recency``,
  ``r_tgt + recency * pos``, the
  fixed age decay of :mod:`kvpop.scorer`, or with ``space="share"`` ``exp(r_tgt) + recency * pos``,
  the decay against the attention share itself): the best a perfectly fitted scorer of that target
  could do.
* ``oracle_sources``: on synthetic traces, keeps the recorded source tokens of every long-range
  quote (the definition digits, ``quote_source_positions`` of the filter's records; with ``lead``,
  also that many tokens before each, e.g. the name) ahead of every other token, the others by
  recency. The same pattern in every layer and KV head.

Their priorities are fixed per trace, so either ranks with one pool of ``L x Hk x k`` slots for the
whole model as :class:`kvpop.policies.OnePool` (``OnePool(oracle)``, as ``dbtrimkv``'s budget): the
ceiling of the same ranking under one budget.

:meth:`Policy.fit_trace` hands each one the trace before its forward pass, with the dense
teacher's targets that :meth:`Policy.teacher_target` asked for, recorded during the evaluation's
reference forward (:func:`kvpop.evaluate.evaluate_fidelity`).

Shapes: B batch (1 here), Hk KV heads, S sequence, L layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.policies.base import Policy, Scores
from kvpop.scorer import check_recency, check_space
from kvpop.target import TargetSpec, scope_targets


class _Oracle(Policy):
    oracle = True

    def _check(self, pos: Tensor, S: int) -> None:
        if pos.shape[-1] != S:
            raise RuntimeError(f"{self.name}: fitted to a {S}-token trace, asked to score {pos.shape[-1]} tokens (call fit_trace first)")


class OracleTarget(_Oracle):
    """Priority = the dense teacher's training target on the evaluated trace (a ceiling)."""

    name = "oracle_target"
    layer_independent = False

    def __init__(self, target: TargetSpec | str | None = None, recency: float = 0.0, space: str = "log"):
        super().__init__()
        self.configure(target=TargetSpec() if target is None else target, recency=recency, space=space)
        self.r_tgt: list[Tensor] = []  # per layer (1, Hk, S)

    def configure(self, *, target: TargetSpec | str, recency: float = 0.0, space: str = "log") -> OracleTarget:
        """The training target to rank by (``train.target``: a :class:`~kvpop.target.TargetSpec` or its
        compact form, ``"max.model"``), the fixed age decay per token on top (``train.scorer_recency``)
        and what it is added to: ``"log"``, the target (a log attention share), or ``"share"``, its exp;
        returns self. (With one pool for the whole model: ``OnePool(oracle)``, module docstring.)"""
        self.target = TargetSpec.model_validate(target)  # checked at configure time, not at the first trace
        check_space(space)
        self.recency, self.space = check_recency(recency), space
        return self

    def teacher_target(self) -> tuple[str, float]:
        return self.target.kind, self.target.beta

    def fit_trace(self, *, input_ids: Tensor, record: dict, targets: dict) -> bool:
        self.r_tgt = scope_targets(targets[self.teacher_target()], self.target.scope, self.target.blend)
        return True

    def scores(self, layer, keys, values, pos, **_):
        if not self.r_tgt:
            raise RuntimeError("oracle_target: no trace fitted (call fit_trace first)")
        r = self.r_tgt[layer]  # (1, Hk, S)
        self._check(pos, r.shape[-1])
        if self.target.value:  # weighed by the values this forward hands the scorer (its own; training's are the teacher's)
            r = self.target.weigh(r.expand(values.shape[0], -1, -1), values)  # (B, Hk, S)
        r = r.to(torch.float64)
        prio = (r if self.space == "log" else r.exp()) + self.recency * pos[:, None, :].to(torch.float64)  # (B, Hk, S)
        return Scores(prio=prio.expand(keys.shape[0], -1, -1))


class OracleSources(_Oracle):
    """Priority: the recorded quote sources first, then recency (a ceiling on synthetic traces)."""

    name = "oracle_sources"

    def __init__(self, lead: int = 4):
        super().__init__()
        # also keep this many tokens before each run of source digits: 4 covers the synthetic format's
        # "Let comet = " (SmolLM2 tokens "Let", " comet", " =", " "); without the name a quote finds no value
        self.lead = lead
        self.sources: Tensor | None = None  # (S,) bool

    def configure(self, *, lead: int) -> OracleSources:
        """Keep ``lead`` tokens before each source run too; returns self."""
        self.lead = lead
        return self

    def fit_trace(self, *, input_ids: Tensor, record: dict, targets: dict) -> bool:
        src = record.get("quote_source_positions") or []
        if not src:
            self.sources = None
            return False  # no recorded sources (not a synthetic trace): nothing to measure
        S = input_ids.shape[-1]
        mask = torch.zeros(S, dtype=torch.bool, device=input_ids.device)
        src = sorted(i for i in set(src) if i < S)
        starts = [i for i in src if i - 1 not in src]  # first token of each contiguous run
        keep = set(src) | {j for i in starts for j in range(max(0, i - self.lead), i)}
        mask[torch.tensor(sorted(keep), dtype=torch.long, device=input_ids.device)] = True
        self.sources = mask
        return True

    def scores(self, layer, keys, values, pos, **_):
        if self.sources is None:
            raise RuntimeError("oracle_sources: no trace with quote sources fitted (call fit_trace first)")
        self._check(pos, self.sources.shape[0])
        B, Hk, S = keys.shape[:3]
        # sources outrank everything (priority >= S); among equals, newer first
        prio = pos.to(torch.float64) + self.sources.to(torch.float64) * (S + 1)  # (B, S)
        return Scores(prio=prio[:, None, :].expand(B, Hk, S))
