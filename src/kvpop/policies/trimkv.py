"""``trimkv`` and ``trimkv_joint``: per-token retention gates (TrimKV, Bui et al., 2025), trained baselines.

A gate per (layer, KV head) predicts a retention ``beta_i`` in (0, 1) for every token as it enters
the cache; the token's retention at query ``t`` is ``beta_i ** (t - i)``. Like ``dms`` it learns
from the distillation loss itself, with no attention-derived label.

* **Gate.** A two-layer SiLU MLP on the token's detached key and value (:class:`RetentionGate`,
  ``2 D F + 2 F + 1`` parameters per head at hidden width F = ``train.scorer_hidden``, 748,890 on
  SmolLM2-135M at F = 64; TrimKV reads the token's hidden state instead, which the attention hook
  does not see), ``log beta = logsigmoid(x)``. Its output starts at ``x = 10`` for every token (``beta = 0.99995``), so training
  starts from nearly standard attention.
* **Training** (:meth:`TrimKV.relax`): retention-gated attention, no eviction: the logit of token
  ``i`` at query ``t`` gets ``(t - i) * log beta_i`` once ``i`` has left the window (``beta = 1`` is
  standard attention; sinks and the window carry no bias, as they are never evicted). Plus the
  capacity loss (:func:`capacity_loss`): per head and query, the retained mass ``sum_i beta_i **
  (t - i)`` of the tokens past the window above the ``k`` long-range slots, ``mean(relu(mass - k) /
  k)``, weighted by ``train.compression_weight``.
* **Base model.** TrimKV freezes it: ``trimkv`` trains the gate alone (``trains_model = False``);
  ``trimkv_joint`` fine-tunes the student with it, as KVpop does, for a like-for-like comparison.
* **Decoding** (``decays``): each KV head holds ``budget`` entries as every policy does; attention
  is standard. When a token leaves the window and the ``k`` long-range slots are full, the entry
  of lowest ``beta_i ** (t - i)`` (the leaver included) is evicted. Ranks cross as tokens age, so
  the full-sequence pattern is a simulation of that rule (:func:`kvpop.selection.decaying_eviction_times`),
  which the reference cache reproduces token by token; the fast engine does not serve it.

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers, F hidden width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from kvpop.geometry import CacheLayout
from kvpop.policies.base import GateRelaxation, Policy, ScorerSpec, Scores
from kvpop.scorer import HeadwiseMLP
from kvpop.selection import eligible_tokens

#: the gate's starting logit: beta = sigmoid(10) = 0.99995, so a token 4,096 steps old keeps exp(-0.19) of its logit weight
INIT_LOGIT = 10.0


class RetentionGate(nn.Module):
    """Per layer, a :class:`kvpop.scorer.HeadwiseMLP` per KV head whose output starts at ``INIT_LOGIT``."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int = 64):
        super().__init__()
        self.config = dict(kind="retention", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, hidden=hidden)
        self.layers = nn.ModuleList(HeadwiseMLP(num_kv_heads, head_dim, hidden) for _ in range(num_layers))
        with torch.no_grad():
            for mlp in self.layers:
                mlp.b2.fill_(INIT_LOGIT)

    def logits(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """k, v (B, Hk, S, D) -> x (B, Hk, S); ``log beta = logsigmoid(x)``."""
        return self.layers[layer](k, v)


class TrimKV(Policy):
    name = "trimkv"
    learned = True
    trained = True
    layer_independent = False
    gated = True
    decays = True
    trains_model = False  # TrimKV: the gate alone learns, the base model stays frozen

    def __init__(self, gate: RetentionGate):
        super().__init__()
        self.scorer = gate

    @classmethod
    def build(cls, spec: ScorerSpec) -> TrimKV:
        return cls(RetentionGate(spec.num_layers, spec.num_kv_heads, spec.head_dim, hidden=spec.hidden))

    def scores(self, layer, keys, values, pos, **_):
        x = self.scorer.logits(layer, keys, values)  # (B, Hk, S)
        return Scores(prio=F.logsigmoid(x.detach().double()), r_hat=x)  # prio: log beta, the decay per step of age

    def relax(self, x: Tensor, *, tau: float = 1.0, generator=None, noise: bool = True) -> GateRelaxation:
        """Retention-gated attention: bias ``log beta`` per step of age past the window, no eviction (the
        Gumbel settings do not apply)."""
        log_beta = F.logsigmoid(x)  # (B, Hk, S), with the gate's graph
        return GateRelaxation(bias=log_beta, prio=None, age_scaled=True, log_beta=log_beta)

    def gate_loss(self, relaxations, *, doc_ids, pos, layout, weight, ramp, progress):
        loss = torch.stack([capacity_loss(r.log_beta, doc_ids, pos, layout=layout) for r in relaxations]).mean()
        beta = torch.stack([r.log_beta.detach().exp().mean() for r in relaxations]).mean()
        return weight * loss, {"capacity_loss": loss.detach(), "beta_mean": beta}


class TrimKVJoint(TrimKV):
    name = "trimkv_joint"
    trains_model = True  # the student is fine-tuned with the gate, as kvpop's is


def retained_mass(log_beta: Tensor, doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout, chunk: int = 512) -> Tensor:
    """What one layer's heads would need to hold past the window: log_beta (B, Hk, S) -> (B, Hk, S).

    At query ``t`` a head retains ``m_t = sum_i beta_i ** (t - i)`` over the tokens ``i`` of ``t``'s
    document that left the window (``t - i >= window``, no sink); 0 on padding queries. Chunked over
    queries: no (S x S) tensor per head at once."""
    B, Hk, S = log_beta.shape
    dev = log_beta.device
    idx = torch.arange(S, device=dev)
    sinks, window = layout.sinks, layout.window
    past = eligible_tokens(doc_ids, pos, sinks)  # (B, S) keys that can be long-range tokens
    out = []
    for s in range(0, S, chunk):
        q = idx[s : s + chunk]  # (C,)
        age = (q[:, None] - idx[None, :]).to(log_beta.dtype)  # (C, S)
        ok = (age >= window)[None] & (doc_ids[:, q, None] == doc_ids[:, None, :]) & past[:, None, :]  # (B, C, S)
        ok = ok & (doc_ids[:, q] >= 0)[:, :, None]
        # mask the exponent, not the power: a future key's (negative age) term would overflow to inf,
        # and the gradient of a discarded inf is NaN
        terms = torch.exp(torch.where(ok[:, None], age * log_beta[:, :, None, :], float("-inf")))  # (B, Hk, C, S)
        out.append(terms.sum(-1))  # (B, Hk, C)
    return torch.cat(out, -1)


def capacity_loss(log_beta: Tensor, doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout, chunk: int = 512) -> Tensor:
    """TrimKV's capacity penalty for one layer: log_beta (B, Hk, S) -> scalar.

    The mean over (rows, heads, real queries) of ``relu(m_t - k) / k`` for the retained mass ``m_t``
    of :func:`retained_mass` (``k`` = ``long_range``, 1 if 0): each head's own long-range slots."""
    Hk = log_beta.shape[1]
    mass = retained_mass(log_beta, doc_ids, pos, layout=layout, chunk=chunk)  # (B, Hk, S), 0 on padding
    k = layout.long_range
    total = (torch.relu(mass - k) / max(k, 1)).sum()
    return total / ((doc_ids >= 0).sum() * Hk).clamp(min=1)
