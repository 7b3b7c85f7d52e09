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

``recency_space`` says what the fixed decay is subtracted from. ``"log"`` (the default) is the
above, on the log scale of ``r_hat``. ``"share"`` subtracts it from the attention share ``exp(r_hat)``
instead, and the learned decay is then unused: ``exp(r_hat_t) - recency * (q - t)``, static priority
``exp(r_hat_t) + recency * t`` (:func:`static_priority`). On the log scale a decay costs every token
the same factor per token of age, so a decay strong enough to rank near-ties by recency also
pushes out the rare token the target ranks far above the rest. On the share's scale the same
decay hardly moves such a token, but it reads ``r_hat``'s level, which the boundary loss alone
leaves free; ``train.scorer_calibration`` ties it to the target's (:func:`kvpop.boundary.calibration_loss`).

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers.
"""

from __future__ import annotations

import copy
import math
from typing import Literal, get_args

import torch
from torch import Tensor, nn

RecencySpace = Literal["log", "share"]  # what the fixed age decay is subtracted from (module docstring)
RECENCY_SPACES: tuple[str, ...] = get_args(RecencySpace)

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


def check_space(space: str) -> str:
    """A recency space (module docstring); a ValueError unless it is one of RECENCY_SPACES."""
    if space not in RECENCY_SPACES:
        raise ValueError(f"recency space must be one of {', '.join(RECENCY_SPACES)}, got {space!r}")
    return space


def has_recency(policy: nn.Module) -> bool:
    """Whether a policy's scorer has the learned age decay that ``recency`` adds to (``kvpop_mlp``, ``kvpop``)."""
    return isinstance(getattr(getattr(policy, "scorer", None), "decay", None), LearnedDecay)


def layer_view(module: nn.Module, *, parameters: dict[str, Tensor] | None = None, modules: dict[str, nn.Module] | None = None,
               graph: bool = False) -> nn.Module:
    """A shallow copy of ``module`` whose own parameters and children are replaced by the given ones
    (the others are shared): the one-layer views below and :meth:`kvpop.policies.Policy.for_layer`, whose parameters are views of the original's
    storage (no copy; they follow in-place updates such as ``load_state_dict``) and carry no gradient.
    ``graph``: the given tensors stay as they are, with their autograd graph (a training forward's view whose
    gradients reach the original's parameters: :func:`all_layers_scorer`); they are then not ``nn.Parameter``s."""
    given = {k: t if graph else nn.Parameter(t.detach(), requires_grad=False) for k, t in (parameters or {}).items()}
    view = copy.copy(module)
    object.__setattr__(view, "_parameters", {**module._parameters, **given})
    object.__setattr__(view, "_modules", {**module._modules, **(modules or {})})
    return view


class LearnedDecay(nn.Module):
    """gamma per (layer, KV head), constrained to [GAMMA_MIN, GAMMA_MAX] by a sigmoid."""

    def __init__(self, num_layers: int, num_kv_heads: int, init: float = 0.9999, recency: float = 0.0, space: RecencySpace = "log"):
        super().__init__()
        self.recency = check_recency(recency)  # fixed extra decay per token of age (module docstring)
        self.space = check_space(space)
        frac = (init - GAMMA_MIN) / (GAMMA_MAX - GAMMA_MIN)
        self.logit = nn.Parameter(torch.full((num_layers, num_kv_heads), math.log(frac / (1 - frac))))

    @property
    def share(self) -> float:
        """The decay on the share's scale (``static_priority``'s ``share``): ``recency`` in space "share", else 0."""
        return self.recency if self.space == "share" else 0.0

    def log_gamma(self, layer: int) -> Tensor:
        """(Hk,) log(gamma_h) - recency < 0 (space "log"; in space "share" the decay is not on this scale
        and ``priority`` does not read it), in float64 for a precise age term at long positions."""
        gamma = GAMMA_MIN + (GAMMA_MAX - GAMMA_MIN) * torch.sigmoid(self.logit[layer].double())
        return torch.log(gamma) - (self.recency if self.space == "log" else 0.0)

    def one_layer(self, layer: int) -> LearnedDecay:
        """Layer ``layer`` as the only layer (index 0) of a view: :func:`layer_view`."""
        return layer_view(self, parameters={"logit": self.logit[layer : layer + 1]})

    def all_layers(self, graph: bool = False) -> LearnedDecay:
        """Every layer as one layer of ``L x Hk`` heads (layer ``l``'s at ``l Hk .. (l + 1) Hk - 1``): :func:`all_layers_scorer`."""
        return layer_view(self, parameters={"logit": self.logit.reshape(1, -1)}, graph=graph)

    def priority(self, layer: int, r_hat: Tensor, pos: Tensor) -> Tensor:
        """The static priority (B, Hk, S) float64 of raw scores r_hat (B, Hk, S) at positions pos (B, S),
        detached: what the selection, the masks and the caches rank by."""
        return static_priority(r_hat.detach(), pos, self.log_gamma(layer).detach(), self.share)


class MLPScorer(nn.Module):
    """KVpop_mlp: the scorer networks of every layer and the decay."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden: int = 64, recency: float = 0.0,
                 recency_space: RecencySpace = "log"):
        super().__init__()
        self.config = dict(
            kind="mlp", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, hidden=hidden, recency=recency,
            recency_space=recency_space,
        )
        self.layers = nn.ModuleList(HeadwiseMLP(num_kv_heads, head_dim, hidden) for _ in range(num_layers))
        self.decay = LearnedDecay(num_layers, num_kv_heads, recency=recency, space=recency_space)

    def raw_scores(self, layer: int, k: Tensor, v: Tensor) -> Tensor:
        """(B, Hk, S, D) keys and values -> r_hat (B, Hk, S)."""
        return self.layers[layer](k, v)

    def one_layer(self, layer: int) -> MLPScorer:
        """Layer ``layer`` as the only layer (index 0) of a view: :func:`layer_view`."""
        return one_layer_scorer(self, layer)

    def all_layers(self, graph: bool = False) -> MLPScorer:
        """Every layer as one layer of ``L x Hk`` heads: :func:`all_layers_scorer`."""
        return all_layers_scorer(self, graph)


def one_layer_scorer(scorer: nn.Module, layer: int) -> nn.Module:
    """A scorer of per-layer ``layers`` and a :class:`LearnedDecay` (``MLPScorer``, ``MLSTMScorer``) as a
    one-layer view: its layer ``layer`` is the view's layer 0 (:func:`layer_view`)."""
    view = layer_view(scorer, modules={"layers": nn.ModuleList([scorer.layers[layer]]), "decay": scorer.decay.one_layer(layer)})
    view.config = {**scorer.config, "num_layers": 1}
    return view


def stack_heads(modules: list[nn.Module], graph: bool = False) -> nn.Module:
    """Per-head modules of every layer (parameters with the KV head as their first dim: :class:`HeadwiseMLP`,
    :class:`kvpop.mlstm.HeadwiseMLSTM`) as one module of ``L x Hk`` heads, layer ``l``'s at ``l Hk .. (l + 1) Hk - 1``:
    a :func:`layer_view` of the first whose parameters are the layers' concatenated along dim 0 (copies, built once
    per pass; ``graph``: with the graph back to each layer's parameters, else without gradient)."""
    first = modules[0]
    return layer_view(first, parameters={name: torch.cat([m._parameters[name] for m in modules]) for name in first._parameters}, graph=graph)


def all_layers_scorer(scorer: nn.Module, graph: bool = False) -> nn.Module:
    """A scorer of per-layer ``layers`` (and a :class:`LearnedDecay`, if it has one) as a view of one layer of
    ``L x Hk`` KV heads, layer ``l``'s heads at ``l Hk .. (l + 1) Hk - 1`` (:func:`stack_heads`): its layer 0 scores
    the keys and values (B, L x Hk, S, D) of every layer stacked that way in one call, each head with its own layer's
    network, as layer ``l`` would score its own (the chunked pool forward, :mod:`kvpop.pool`; with ``graph``, the
    training forward's pool loss, :class:`kvpop.attention.SparseContext`, whose gradients reach every layer's network)."""
    modules = {"layers": nn.ModuleList([stack_heads(list(scorer.layers), graph)])}
    if isinstance(getattr(scorer, "decay", None), LearnedDecay):
        modules["decay"] = scorer.decay.all_layers(graph)
    view = layer_view(scorer, modules=modules)
    view.config = {**scorer.config, "num_layers": 1, "num_kv_heads": scorer.config["num_layers"] * scorer.config["num_kv_heads"]}
    return view


def with_recency(policy: nn.Module, recency: float, space: RecencySpace | None = None) -> nn.Module:
    """A copy of a learned policy (``kvpop_mlp``, ``kvpop``) whose scorer's fixed age decay (module
    docstring) is ``recency``, in ``space`` (None: the scorer's own), in its config too (exports); the
    original is left as it is."""
    if not has_recency(policy):
        raise ValueError(f"policy {getattr(policy, 'name', policy)!r} has no learned age decay to add recency to")
    recency = check_recency(recency)
    out = copy.deepcopy(policy)
    out.scorer.decay.recency = out.scorer.config["recency"] = recency
    if space is not None:
        out.scorer.decay.space = out.scorer.config["recency_space"] = check_space(space)
    return out


def static_priority(r_hat: Tensor, pos: Tensor, log_gamma: Tensor, share: float = 0.0) -> Tensor:
    """r_hat (B, Hk, S), pos (B, S), log_gamma (Hk,) -> priority (B, Hk, S) float64.

    ``r_hat_t - pos_t * log(gamma_h)``: ranking by it at query q equals ranking by the effective score.

    ``share > 0``: the age decay on the attention share's scale instead, ``exp(r_hat_t) - share * (q -
    t)`` at query q (``log_gamma`` unused): its static priority is ``exp(r_hat_t) + share * pos_t``,
    returned as its log, ``logaddexp(r_hat_t, log(share * pos_t))`` (same order, no overflow). A token
    whose share is far above ``share`` times its age keeps its rank against a newer one; among tokens
    whose shares are all small the older goes first. Unlike the log-space decay it does not discount
    a large share, so it cannot push out a token the target ranks high (BENCHMARKS.md, "Falling back
    to recency"); and unlike there, ``r_hat``'s level matters: the scorer must be calibrated to the target.
    """
    if share > 0:
        return torch.logaddexp(r_hat.double(), math.log(share) + pos[:, None, :].double().log())
    return r_hat.double() - pos[:, None, :].double() * log_gamma.view(1, -1, 1)
