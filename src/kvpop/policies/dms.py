"""``dms``: Dynamic Memory Sparsification (Łańcucki et al., 2025), a trained baseline.

A binary keep/evict gate per token and KV head, decided when the token enters the cache and
carried out when it leaves the window (*delayed eviction*): a token marked for eviction stays
attendable for ``window`` queries, then it is gone, even while slots are free. The gate is trained
end to end through the distillation loss: no attention-derived label, no boundary loss.

* **Gate.** A linear map per (layer, KV head) of the token's key and value, ``x = w . [k; v] + b``
  (:class:`GateScorer`, ``2 D + 1`` parameters per head: 11,610 for SmolLM2-135M, 30 x 3 heads,
  D = 64; 74,016 for Qwen3-4B, 36 x 8, D = 128). NVIDIA's recipe instead borrows one query channel
  per KV group; a separate gate keeps the student's attention untouched at initialization. The gate
  reads detached keys and values, as the kvpop scorers do. ``x > 0`` evicts.
* **Training** (:meth:`Dms.relax`): a Gumbel-sigmoid relaxation at temperature ``tau`` (0.1) with a
  straight-through hard decision at 0.5: noise ``g ~ Logistic(0, 1)``, ``alpha = sigmoid((x + g) /
  tau)``; forward, a token past the window gets the attention-logit bias ``-1e4`` if ``x + g > 0``
  (weight exactly 0) else 0; backward, the gradient of ``log(1 - alpha)`` (the relaxed mask). The
  trainer adds the one-sided compression loss ``max(0, target_ratio - mean alpha)`` over the tokens
  that leave the window (:meth:`Dms.gate_loss`, :func:`compression_loss`), with the target ramped up
  to the ratio that the budget implies (:func:`budget_evict_ratio`).
* **Budget.** Memory is the same fixed pool as every policy's: ``budget`` entries per KV head.
  Tokens the gate keeps compete for the ``k`` long-range slots by priority ``-x`` (the surest keeps
  stay; ties go to the newer), so a head that keeps more than ``k`` is capped at the budget; a head
  whose gate evicts more holds fewer (the evaluation reports the measured ``occupancy``). The gated
  out tokens get priority ``-inf``, which the selection and both caches read as "leaves with the
  window" (:mod:`kvpop.selection`). Training runs the same capped pattern, so the trained forward,
  the evaluation and decoding agree token for token.

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from kvpop.geometry import CacheLayout
from kvpop.policies.base import GateRelaxation, Policy, ScorerSpec, Scores
from kvpop.scorer import layer_view
from kvpop.selection import document_spans, eligible_tokens

#: the forward attention-logit bias of a gated-out token in training: exp(-1e4) is exactly 0 in float32
EVICTED_BIAS = -1.0e4


class GateScorer(nn.Module):
    """Per (layer, KV head): ``x = w . [k; v] + b``. ``w`` starts at zero, so every token starts with
    the same logit ``init_bias`` (keep, for the default) and ties go to recency."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, init_bias: float = -2.0):
        super().__init__()
        self.config = dict(kind="gate", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        self.w = nn.Parameter(torch.zeros(num_layers, num_kv_heads, 2 * head_dim))
        self.b = nn.Parameter(torch.full((num_layers, num_kv_heads), init_bias))

    def logits(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """k, v (B, Hk, S, D) -> gate logits x (B, Hk, S); > 0 evicts. Inputs are detached here."""
        x = torch.cat([k.detach(), v.detach()], dim=-1).to(self.w.dtype)  # (B, Hk, S, 2D)
        return torch.einsum("bhsi,hi->bhs", x, self.w[layer]) + self.b[layer][:, None]

    def one_layer(self, layer: int) -> GateScorer:
        """Layer ``layer`` as the only layer (index 0) of a view (:func:`kvpop.scorer.layer_view`)."""
        view = layer_view(self, parameters={"w": self.w[layer : layer + 1], "b": self.b[layer : layer + 1]})
        view.config = {**self.config, "num_layers": 1}
        return view


def gate_priority(x: Tensor) -> Tensor:
    """Gate logits (B, Hk, S) -> static priorities float64: ``-x`` where the gate keeps, ``-inf``
    where it evicts (``x > 0``: the token leaves with the window)."""
    x = x.detach().double()
    return torch.where(x > 0, float("-inf"), -x)


class Dms(Policy):
    name = "dms"
    learned = True
    trained = True
    layer_independent = False
    gated = True

    def __init__(self, gate: GateScorer):
        super().__init__()
        self.scorer = gate  # the export saves ``scorer.config`` and the state dict, as for every learned policy

    @classmethod
    def build(cls, spec: ScorerSpec) -> Dms:
        return cls(GateScorer(spec.num_layers, spec.num_kv_heads, spec.head_dim))

    def scores(self, layer, keys, values, pos, **_):
        x = self.scorer.logits(layer, keys, values)  # (B, Hk, S)
        return Scores(prio=gate_priority(x), r_hat=x)

    def relax(self, x: Tensor, *, tau: float, generator: torch.Generator | None = None, noise: bool = True) -> GateRelaxation:
        """Gate logits x (B, Hk, S) with their graph -> the straight-through Gumbel-sigmoid relaxation.

        ``noise=False`` drops the logistic noise (then ``tau -> 0`` gives the hard gate of :meth:`scores`)."""
        if noise:
            u = torch.rand(x.shape, generator=generator, dtype=torch.float32).to(x.device)
            u = u.clamp(1e-6, 1 - 1e-6)
            x = x + (torch.log(u) - torch.log1p(-u)).to(x.dtype)  # + Logistic(0, 1)
        z = x / tau
        hard = torch.where(z > 0, EVICTED_BIAS, 0.0).to(z.dtype)
        soft = F.logsigmoid(-z)  # log(1 - alpha)
        bias = soft + (hard - soft).detach()  # forward: the hard decision; backward: the relaxed mask's gradient
        # the capped pattern ranks by -(x + g), finite: the gate acts through the bias
        return GateRelaxation(bias=bias, prio=(-x).detach().double(), evict_prob=torch.sigmoid(z))

    def gate_loss(self, relaxations, *, doc_ids, pos, layout, weight, ramp, progress):
        """The compression loss toward the budget's eviction ratio, its target ramped up over the first
        ``ramp`` of training; logs the loss, the target and the relaxed eviction rate."""
        target = budget_evict_ratio(doc_ids, pos, layout=layout) * ramp_factor(progress, ramp)
        comp, evicted = compression_loss([r.evict_prob for r in relaxations], leaving_tokens(doc_ids, pos, layout=layout), target)
        logs = {"compression_loss": comp.detach(), "gate_evicted": evicted.detach(), "compression_target": torch.tensor(target)}
        return weight * comp, logs


def compression_loss(evict_probs: list[Tensor], leaves: Tensor, target: float) -> tuple[Tensor, Tensor]:
    """A gate's one-sided compression loss ``max(0, target - evicted)`` and ``evicted``: the mean
    relaxed eviction probability over every layer and KV head of the tokens that leave the window.

    evict_probs: per layer (B, Hk, S); leaves (B, S) bool (:func:`leaving_tokens`)."""
    m = leaves[:, None, :].to(evict_probs[0].dtype)  # (B, 1, S)
    per_layer = torch.stack([(p * m).sum() for p in evict_probs])  # (L,)
    evicted = per_layer.sum() / (m.sum() * evict_probs[0].shape[1] * len(evict_probs)).clamp(min=1.0)
    return torch.relu(target - evicted), evicted


def ramp_factor(progress: float, fraction: float) -> float:
    """A linear ramp over training: 0 at the start, 1 once ``progress`` (the share of the steps done)
    reaches ``fraction``, then 1 (``fraction`` 0: always 1)."""
    return 1.0 if fraction <= 0 else min(1.0, progress / fraction)


def leaving_tokens(doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout) -> Tensor:
    """(B, S) bool: the tokens a gate decides on, those that leave the window before their document
    ends (not sinks, not padding)."""
    B, S = doc_ids.shape
    _, end = document_spans(doc_ids)
    idx = torch.arange(S, device=doc_ids.device)
    return eligible_tokens(doc_ids, pos, layout.sinks) & (idx + layout.window < end)


def budget_evict_ratio(doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout) -> float:
    """The share of the leaving tokens (:func:`leaving_tokens`) a gate must evict for every document
    of the rows to end within the budget: ``1 - sum_d min(k, n_d) / sum_d n_d``, n_d the leaving
    tokens of document d (0.0 when none leaves)."""
    leaves = leaving_tokens(doc_ids, pos, layout=layout)
    start, _ = document_spans(doc_ids)
    n = torch.zeros(doc_ids.shape, dtype=torch.long, device=doc_ids.device).scatter_add_(1, start, leaves.long())  # (B, S): n_d at d's start
    total = int(n.sum())
    return 0.0 if total == 0 else 1.0 - int(n.clamp(max=layout.long_range).sum()) / total
