"""``dbtrimkv``: retention gates under one global budget (DBTrimKV), a trained baseline.

:mod:`kvpop.policies.trimkv` gives every (layer, KV head) its own ``k`` long-range slots. Here
the long-range slots of every layer and KV head form **one pool** of ``P = L x Hk x k`` entries
(total entries, sinks and windows included: ``budget x L x Hk``, as for every other policy), and
all of them compete in it, so a layer whose heads keep more can hold more than ``k`` while
another holds fewer.

* **Gate** (:class:`TiedRetentionGate`). Per (layer, KV head) a hidden layer on the token's
  detached key and value, ``h = silu(W1 [k; v] + b1)``; then **one** output projection ``x = w2 .
  h + b2`` shared by every layer and head (weight-tied), so that every head's retention
  ``log beta = logsigmoid(x)`` is on one scale. ``L Hk (2 D F + F) + F + 1`` parameters at hidden
  width F = ``train.scorer_hidden`` (743,105 on SmolLM2-135M at F = 64, against trimkv's 748,890).
* **Training**: as ``trimkv`` (the base model frozen, retention-gated attention with no eviction),
  with the capacity loss taken over the whole pool (:func:`global_capacity_loss`): at query ``t``
  the retained mass of every layer and head summed, against ``P``.
* **The pattern.** When token ``t - window`` leaves the window of every layer and head at query
  ``t``, the ``L x Hk`` leavers and the pool's entries compete by their retention at ``t``,
  ``(t - i) log beta``; the lowest go (:func:`kvpop.selection.global_decaying_eviction_times`).
  A layer's pattern then depends on the later layers' gates, which depend on the earlier layers'
  patterns: a teacher-forced forward is a fixed point (:func:`kvpop.evaluate.pool_fixed_point`).
* **Decoding**: :class:`kvpop.decode.DecodeEngine`'s pooled kind (:mod:`kvpop.decode.pooled`: chunked
  prefill, a static step with the competition inside), and its twin
  :class:`kvpop.decode.one_pool.OnePoolCache`, the pool itself (entries tagged with their layer and head),
  token by token; why it equals the fixed point: :mod:`kvpop.decode.one_pool`.

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers, F hidden width.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from kvpop.geometry import CacheLayout
from kvpop.policies.base import ScorerSpec
from kvpop.policies.trimkv import INIT_LOGIT, TrimKV, retained_mass
from kvpop.scorer import layer_view


class TiedRetentionGate(nn.Module):
    """A hidden layer per (layer, KV head) and one output projection shared by all of them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int = 64):
        super().__init__()
        self.config = dict(kind="tied_retention", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, hidden=hidden)
        fan_in = 2 * head_dim
        self.w1 = nn.Parameter(torch.randn(num_layers, num_kv_heads, fan_in, hidden) / math.sqrt(fan_in))
        self.b1 = nn.Parameter(torch.zeros(num_layers, num_kv_heads, hidden))
        self.w2 = nn.Parameter(torch.zeros(hidden))  # tied: every layer's and head's scale
        self.b2 = nn.Parameter(torch.full((), INIT_LOGIT))  # beta = sigmoid(10) at the start: nearly standard attention

    def logits(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """k, v (B, Hk, S, D) -> x (B, Hk, S); ``log beta = logsigmoid(x)``. Inputs are detached here."""
        x = torch.cat([k.detach(), v.detach()], dim=-1).to(self.w1.dtype)  # (B, Hk, S, 2D)
        h = F.silu(torch.einsum("bhsi,hif->bhsf", x, self.w1[layer]) + self.b1[layer][:, None])  # (B, Hk, S, F)
        return h @ self.w2 + self.b2

    def all_layers(self, graph: bool = False) -> TiedRetentionGate:
        """Every layer as one layer of ``L x Hk`` heads, layer ``l``'s at ``l Hk .. (l + 1) Hk - 1`` (a view: the
        hidden layers reshaped, the tied output shared), as :func:`kvpop.scorer.all_layers_scorer` makes them."""
        L, Hk, fan_in, hidden = self.w1.shape
        view = layer_view(self, parameters={"w1": self.w1.reshape(1, L * Hk, fan_in, hidden), "b1": self.b1.reshape(1, L * Hk, hidden)}, graph=graph)
        view.config = {**self.config, "num_layers": 1, "num_kv_heads": L * Hk}
        return view


class DBTrimKV(TrimKV):
    name = "dbtrimkv"
    one_pool = True

    def __init__(self, gate: TiedRetentionGate):
        super().__init__(gate)

    @classmethod
    def build(cls, spec: ScorerSpec) -> DBTrimKV:
        return cls(TiedRetentionGate(spec.num_layers, spec.num_kv_heads, spec.head_dim, hidden=spec.hidden))

    def gate_loss(self, relaxations, *, doc_ids, pos, layout, weight, ramp, progress):
        log_beta = [r.log_beta for r in relaxations]
        loss = global_capacity_loss(log_beta, doc_ids, pos, layout=layout)
        beta = torch.stack([lb.detach().exp().mean() for lb in log_beta]).mean()
        return weight * loss, {"capacity_loss": loss.detach(), "beta_mean": beta}


def global_capacity_loss(log_beta: list[Tensor], doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout, chunk: int = 512) -> Tensor:
    """The capacity penalty of one pool: every layer's log_beta (B, Hk, S) -> scalar.

    At query ``t`` the pool retains ``M_t = sum over layers and heads of m_t`` (:func:`kvpop.policies.trimkv.retained_mass`);
    the loss is the mean over (rows, real queries) of ``relu(M_t - P) / P`` with ``P = L x Hk x k``
    (1 if 0): a head may retain more than ``k`` as long as the others retain less."""
    mass = sum(retained_mass(lb, doc_ids, pos, layout=layout, chunk=chunk).sum(1) for lb in log_beta)  # (B, S)
    cap = len(log_beta) * log_beta[0].shape[1] * layout.long_range
    return (torch.relu(mass - cap) / max(cap, 1)).sum() / (doc_ids >= 0).sum().clamp(min=1)
