"""Learned eviction scorers: one small network per (layer, KV head), plus a learned age decay.

The effective score of token t at query q is ``r_hat_t + (q - t) * log(gamma_h)``. With gamma fixed
during a forward pass, ranking by it at every q equals ranking by one *static priority*
``r_hat_t - t * log(gamma_h)`` (the ``q * log(gamma_h)`` term is common to all candidates), which is
what the selection consumes.

``recency`` (a setting, not learned; 0 by default) adds a fixed age decay to the learned one:
``log(gamma_h) - recency``. A token's rank then falls by ``recency`` per token of age, so it
outlives a newer token only while its raw score is higher by ``recency`` times their distance: a
scorer whose scores barely differ (on text unlike its training rows) falls back to the recency rule,
and a large ``recency`` *is* the recency rule (``streaming_llm_plus``'s pattern), with the raw score
breaking ties only.

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import Tensor, nn

GAMMA_MIN = 0.999
GAMMA_MAX = 0.999999


class HeadwiseMLP(nn.Module):
    """Per KV head, a two-layer MLP with SiLU on the concatenated key and value: (2D) -> F -> 1.

    The output layer starts at zero, so an untrained scorer gives every token the same raw score
    and the decay alone ranks them: training starts from the recency (StreamingLLM) pattern.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int):
        super().__init__()
        fan_in = 2 * head_dim
        self.w1 = nn.Parameter(torch.randn(num_kv_heads, fan_in, hidden) / math.sqrt(fan_in))
        self.b1 = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.w2 = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.b2 = nn.Parameter(torch.zeros(num_kv_heads))

    def forward(self, k: Tensor, v: Tensor) -> Tensor:
        """k, v: (B, Hk, S, D) -> raw scores r_hat (B, Hk, S). Inputs are detached here."""
        x = torch.cat([k.detach(), v.detach()], dim=-1).to(self.w1.dtype)  # (B, Hk, S, 2D)
        h = torch.nn.functional.silu(torch.einsum("bhsi,hif->bhsf", x, self.w1) + self.b1[:, None])
        return torch.einsum("bhsf,hf->bhs", h, self.w2) + self.b2[:, None]  # (B, Hk, S)


def check_recency(recency: float) -> float:
    """A fixed age decay (module docstring) as a float; a ValueError unless it is a number >= 0."""
    if not recency >= 0:
        raise ValueError(f"recency must be >= 0 (a decay per token of age), got {recency}")
    return float(recency)


def has_recency(policy: nn.Module) -> bool:
    """Whether a policy's scorer has the learned age decay that ``recency`` adds to (``kvpop_mlp``, ``kvpop``)."""
    return isinstance(getattr(getattr(policy, "scorer", None), "decay", None), LearnedDecay)


class LearnedDecay(nn.Module):
    """gamma per (layer, KV head), constrained to [GAMMA_MIN, GAMMA_MAX] by a sigmoid."""

    def __init__(self, num_layers: int, num_kv_heads: int, init: float = 0.9999, recency: float = 0.0):
        super().__init__()
        self.recency = check_recency(recency)  # fixed extra decay per token of age (module docstring)
        frac = (init - GAMMA_MIN) / (GAMMA_MAX - GAMMA_MIN)
        self.logit = nn.Parameter(torch.full((num_layers, num_kv_heads), math.log(frac / (1 - frac))))

    def log_gamma(self, layer: int) -> Tensor:
        """(Hk,) log(gamma_h) - recency < 0, in float64 for a precise age term at long positions."""
        gamma = GAMMA_MIN + (GAMMA_MAX - GAMMA_MIN) * torch.sigmoid(self.logit[layer].double())
        return torch.log(gamma) - self.recency


class MLPScorer(nn.Module):
    """KVpop_mlp: the scorer networks of every layer and the decay."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int = 64, recency: float = 0.0):
        super().__init__()
        self.config = dict(
            kind="mlp", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, hidden=hidden, recency=recency
        )
        self.layers = nn.ModuleList(HeadwiseMLP(num_kv_heads, head_dim, hidden) for _ in range(num_layers))
        self.decay = LearnedDecay(num_layers, num_kv_heads, recency=recency)

    def raw_scores(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """(B, Hk, S, D) keys and values -> r_hat (B, Hk, S)."""
        return self.layers[layer](k, v)


def with_recency(policy: nn.Module, recency: float) -> nn.Module:
    """A copy of a learned policy (``kvpop_mlp``, ``kvpop``) whose scorer's fixed age decay (module
    docstring) is ``recency``, in its config too (exports); the original is left as it is."""
    if not has_recency(policy):
        raise ValueError(f"policy {getattr(policy, 'name', policy)!r} has no learned age decay to add recency to")
    recency = check_recency(recency)
    out = copy.deepcopy(policy)
    out.scorer.decay.recency = out.scorer.config["recency"] = recency
    return out


def static_priority(r_hat: Tensor, pos: Tensor, log_gamma: Tensor) -> Tensor:
    """r_hat (B, Hk, S), pos (B, S), log_gamma (Hk,) -> priority (B, Hk, S) float64.

    ``r_hat_t - pos_t * log(gamma_h)``: ranking by it at query q equals ranking by the effective score.
    """
    return r_hat.double() - pos[:, None, :].double() * log_gamma.view(1, -1, 1)
