"""Eviction policies for the full-sequence (training and teacher-forced) path.

A policy is a small class with one scoring hook, :meth:`Policy.scores`, that gives every token a
static priority per KV head; the shared selection (:func:`kvpop.selection.eviction_times`) turns
priorities into the top-k pattern. Orchestration reads the declared capabilities (``evicts``,
``learned``, ``layer_independent``), never the concrete class. Attention-statistics rules that
only exist at decode time (TOVA, H2O) live with the bounded cache.

Shapes: B batch, Hk KV heads, S sequence, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvpop.scorer import MLPScorer, static_priority


@dataclass
class Scores:
    prio: Tensor  # (B, Hk, S) static priority, higher is kept longer
    r_hat: Tensor | None = None  # (B, Hk, S) raw learned score, with the scorer's graph
    log_gamma: Tensor | None = None  # (Hk,) with the decay's graph


class Policy(nn.Module):
    """Base class: the pattern is sinks + window + top-k of the eligible tokens by priority."""

    name: str = "policy"
    evicts: bool = True  # False: dense attention, nothing is ever evicted
    learned: bool = False  # True: has a scorer trained by the boundary loss
    layer_independent: bool = True  # True: same priorities in every layer (pattern computed once)

    def scores(self, layer: int, k: Tensor, v: Tensor, pos: Tensor, *, doc_ids: Tensor | None = None, window: int | None = None) -> Scores | None:
        """k, v (B, Hk, S, D), pos (B, S) -> priorities; None for a policy that never evicts.

        ``doc_ids`` (B, S) and ``window`` are given for scorers that read beyond the token itself
        (the delayed mLSTM); the others ignore them.
        """
        raise NotImplementedError

    def long_range_slots(self, *, budget: int, sinks: int, window: int, head_dim: int) -> int:
        """k at a nominal budget; a stateful scorer may spend slots on its state."""
        return long_range_slots(self, budget=budget, sinks=sinks, window=window, head_dim=head_dim)


class Dense(Policy):
    """No eviction: the teacher's pattern (causal within each document)."""

    name = "dense"
    evicts = False

    def scores(self, layer, k, v, pos, **_):
        return None


class Recency(Policy):
    """StreamingLLM: sinks plus the most recent ``budget - sinks`` tokens (newest ranks first).

    ``streaming_llm`` runs it on the base model; ``streaming_llm_plus`` is the same pattern with a
    student fine-tuned under it.
    """

    def __init__(self, name: str = "streaming_llm"):
        super().__init__()
        self.name = name

    def scores(self, layer, k, v, pos, **_):
        B, Hk = k.shape[:2]
        return Scores(prio=pos[:, None, :].expand(B, Hk, -1).to(torch.float64))


class LearnedMLP(Policy):
    """KVpop_mlp: an MLP per (layer, KV head) on the token's key and value, plus a learned decay."""

    name = "kvpop_mlp"
    learned = True
    layer_independent = False

    def __init__(self, scorer: MLPScorer):
        super().__init__()
        self.scorer = scorer

    def scores(self, layer, k, v, pos, **_):
        r_hat = self.scorer.raw_scores(layer, k, v)  # (B, Hk, S)
        log_gamma = self.scorer.decay.log_gamma(layer)  # (Hk,)
        return Scores(prio=static_priority(r_hat.detach(), pos, log_gamma.detach()), r_hat=r_hat, log_gamma=log_gamma)


def make_policy(
    name: str, *, num_layers: int, num_kv_heads: int, head_dim: int, scorer_hidden: int = 64, scorer_dk: int = 16, scorer_dv: int = 16,
    scorer_forget_gate: str = "sigmoid",
) -> Policy:
    """A fresh policy by name (learned ones start from an untrained scorer)."""
    if name == "dense":
        return Dense()
    if name in ("streaming_llm", "streaming_llm_plus"):
        return Recency(name)
    if name == "kvpop_mlp":
        return LearnedMLP(MLPScorer(num_layers, num_kv_heads, head_dim, hidden=scorer_hidden))
    if name == "kvpop":
        from kvpop.mlstm import LearnedMLSTM, MLSTMScorer  # mlstm builds on this module

        return LearnedMLSTM(MLSTMScorer(num_layers, num_kv_heads, head_dim, d_k=scorer_dk, d_v=scorer_dv, forget_gate=scorer_forget_gate))
    raise ValueError(f"unknown policy {name!r}; known: dense, streaming_llm, streaming_llm_plus, kvpop_mlp, kvpop")


def long_range_slots(policy: Policy, *, budget: int, sinks: int, window: int, head_dim: int) -> int:
    """k for a policy at a nominal budget: ``budget - sinks - window``, less the slots whose memory
    a stateful scorer spends on its recurrent state (see :func:`kvpop.mlstm.kvpop_k`)."""
    scorer = getattr(policy, "scorer", None)
    if scorer is not None and scorer.config.get("kind") == "mlstm":
        from kvpop.mlstm import kvpop_k

        return kvpop_k(budget, sinks, window, head_dim, d_k=scorer.config["d_k"], d_v=scorer.config["d_v"])
    return budget - sinks - window
