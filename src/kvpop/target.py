"""Training target of the eviction scorer: how much future queries need a token.

For a token ``t`` of KV head ``h`` and a query head ``g`` of its group, the attention that a
later query ``u`` pays to ``t`` (under the student's normalizer) is::

    p^(g)_{u -> t} = exp(scale * q^(g)_u . k_t - lse^(g)_u),     u in U_t = {t + w, ..., S_d - 1},
    N_t = max(1, S_d - t - w),

where ``S_d`` is the exclusive end of ``t``'s document (not of the packed row), ``w`` the
recent window and ``lse`` the log-normalizer of each query's attention (as returned by the
student's sparse attention).  ``N_t = |U_t|`` whenever ``U_t`` is not empty.  A *kind* of
target aggregates the column ``p_{. -> t}`` into one importance ``m_t^(g)``:

* ``"mean"`` (the paper's)::

      m_t = (1 / N_t) * sum_{u in U_t} p_{u -> t}

* ``"power"`` (power mean of order ``beta > 0``)::

      m_t = ((1 / N_t) * sum_{u in U_t} p_{u -> t}^beta)^(1 / beta)

* ``"max"``::

      m_t = max_{u in U_t} p_{u -> t}

``power`` with ``beta = 1`` is ``mean``; ``power`` grows with ``beta`` (power-mean inequality)
and ``log max - log(N_t) / beta <= log m_t^power <= log max``, so it tends to ``max``.  The mean
dilutes a token that a few later queries need badly; ``power`` and ``max`` do not.

The target is the maximum over the ``G`` query heads sharing KV head ``h`` (query heads
``h*G .. h*G + G-1``)::

    r_tgt(h, t) = max_j log(eps + m_t^(h*G + j)).

Padding tokens and tokens with an empty ``U_t`` get ``log(eps)``.

The *scope* (:func:`scope_targets`, ``train.target.scope``) widens that maximum beyond the
query group: ``"group"`` (the paper's) keeps ``r_tgt(h, t)`` per KV head; ``"layer"`` takes the
maximum over every KV head of the layer; ``"model"`` over every layer and KV head, so that each
token gets one label, the strongest need any head of the model has for it (every head then learns
to keep what some head will need: a copy needs the source in the heads that find it and in the
heads that read it, which the per-head target splits apart); ``"blend"`` weighs the group's and
the model's (log) targets, ``(1 - w) r_tgt(h, t) + w max_{l, g} r_tgt(l, g, t)`` with ``w =
train.target.blend`` (0.5: their mean; 0 is ``"group"``, 1 is ``"model"``): a head ranks what it
reads itself and what any head needs (scope model keeps more far facts at more KL;
BENCHMARKS.md).

*Value weighting* (``train.target.value``, :meth:`TargetSpec.weigh`) scales each need by the size of
what the token would deliver: a token's contribution to a query head's output is ``p_{u -> t} v_t``,
so a head that attends to a token with a small value vector needs it less than its attention says
(the value-aware importance of token-pruning work, e.g. VATP). In log space::

    r_tgt(h, t) + log(||v_t^(h)|| / sqrt(D)),

with ``v_t^(h)`` the token's value at KV head ``h`` (shared by the group) and ``sqrt(D)`` keeping the
term near 0 for unit-scale entries. It ranks tokens across heads and layers (one pool) by what their
eviction removes from the output rather than by attention alone. Only with scope ``group``: a wider
scope's maximum would mix one head's attention with another head's values.

:class:`TargetSpec` holds the five choices (kind, beta, scope, blend, value) as one value, written
compactly as ``max``, ``power:16``, ``max.model``, ``max.blend:0.75``, ``max.value`` (``train.target``).

Shapes: ``B`` batch, ``H`` query heads, ``Hk`` KV heads, ``G = H / Hk``,
``S`` sequence length, ``D`` head dim.

Every kind is computed from one log-space column statistic ``L_t`` (float64, ``-inf`` for an
empty column), never from an ``S x S`` map::

    mean:   L_t = log sum_u p_{u -> t}          log m_t = L_t - log N_t
    power:  L_t = log sum_u p_{u -> t}^beta     log m_t = (L_t - log N_t) / beta
    max:    L_t = log max_u p_{u -> t}          log m_t = L_t

and ``log(eps + m_t) = logaddexp(log eps, log m_t)``.  ``sum_u p^beta`` underflows in linear
space (``p = 1e-3``, ``beta = 16``: ``1e-48``, below float32's range), so ``power`` and ``max``
stay in log space throughout.  Two executors compute ``L_t``:

* ``"chunked"``: plain torch, loops over chunks of query rows ``u``; memory ``O(chunk * S)``
  per head.  The CPU path.  ``mean`` sums ``p`` linearly (float32 within a chunk, float64
  across chunks); ``power`` takes a float32 ``logsumexp`` of ``beta * log p`` within a chunk
  and ``logaddexp`` across chunks in float64; ``max`` an ``amax`` of ``log p`` per chunk and
  ``maximum`` across chunks.
* ``"flex"``: one *transposed* FlexAttention pass where the keys act as queries and the
  student's queries act as keys; ``score_mod`` returns ``score - lse_u`` (``= log p_{u -> t}``;
  ``beta * (score - lse_u)`` for ``power``), so the pass's log-sum-exp at row ``t`` is ``L_t``
  for ``mean`` and ``power``.  For ``max`` the pass returns ``AuxRequest(max_scores=True)``:
  the row maximum of ``score_mod``'s output over the unmasked entries (``-inf`` for a row with
  none), in natural-log units, i.e. ``log max_u p_{u -> t}``.  Compiled on CUDA.  Torch
  refuses ``max_scores`` for CPU inputs, so ``max`` with the flex executor needs CUDA (on the
  CPU, ``impl="auto"`` takes the chunked executor).
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpop.selection import document_spans

__all__ = ["TARGET_KINDS", "TARGET_SCOPES", "TargetKind", "TargetScope", "TargetSpec", "future_attention_target", "scope_targets"]

#: How the future attention a token receives is aggregated (see the module docstring).
TargetKind = Literal["mean", "power", "max"]
TARGET_KINDS: tuple[str, ...] = get_args(TargetKind)
#: Over which heads the target takes its maximum (see the module docstring).
TargetScope = Literal["group", "layer", "model", "blend"]
TARGET_SCOPES: tuple[str, ...] = get_args(TargetScope)

_GRAMMAR = ("KIND[.SCOPE][.value], KIND one of mean, max, power[:BETA] and SCOPE one of group, layer, model, blend[:W] "
            "(e.g. max, power:16, max.model, max.blend:0.75, max.value)")


def _number(x: float) -> str:
    """The shortest text that reads back as ``x``, without a trailing ``.0`` (``16.0`` -> ``16``)."""
    r = repr(float(x))
    return r[:-2] if r.endswith(".0") else r


class TargetSpec(BaseModel):
    """The scorer's training target, one immutable value: its kind, beta, scope, blend and value weighting.

    Fields (module docstring for the formulas):

    * ``kind``: ``"mean"`` (the paper's), ``"power"`` (power mean of order ``beta``) or ``"max"``;
    * ``beta``: the power mean's order, finite and ``> 0`` (read by kind ``power`` only);
    * ``scope``: over which heads the target takes its maximum, ``"group"`` (the paper's: the
      KV head's query group), ``"layer"``, ``"model"`` or ``"blend"``;
    * ``blend``: the weight ``w`` in [0, 1] of the model-wide target (read by scope ``blend`` only);
    * ``value``: weigh each need by the token's value norm (module docstring; scope ``group`` only).

    The default, ``TargetSpec()``, is ``max`` (kind max, beta 8, scope group, blend 0.5, no value weighting).

    Compact form, read by :meth:`parse` and written by ``str(spec)``::

        KIND[.SCOPE][.value]      KIND  = mean | max | power[:BETA]
                                  SCOPE = group | layer | model | blend[:W]

    ``BETA`` and ``W`` are decimal numbers (``16``, ``0.75``, ``1e-3``); a missing ``BETA`` is
    8 and a missing ``W`` 0.5 (the defaults). Canonical rules of ``str(spec)``: the kind always;
    ``:BETA`` only for kind ``power``, always there; the scope only when it is not ``group``;
    ``:W`` only for scope ``blend``, always there; ``.value`` last, only when set; numbers as the shortest text that reads back
    exactly, with no trailing ``.0`` (``power:16``, ``max.blend:0.75``, ``power:4.blend:0.5``).
    So ``str`` drops the fields the target does not read: two specs of the same ``str`` compute
    the same target, and ``parse(str(spec)) == spec`` whenever the unread fields hold their
    defaults. Bad text raises a ValueError naming the bad part and the accepted forms.

    Anywhere pydantic validates a ``TargetSpec`` (``train.target`` in params), the compact
    string is accepted as well as the mapping of fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: TargetKind = Field("max", description="'mean' (the paper's), 'power' (power mean of order beta) or 'max'")
    beta: float = Field(8.0, gt=0, allow_inf_nan=False, description="order of the power mean (kind 'power' only; "
                        "1: the mean; large: toward the max)")
    scope: TargetScope = Field("group", description="over which heads the target is maximized: 'group' (the paper's: "
                               "each KV head's query group), 'layer' (every KV head of the layer), 'model' (every layer "
                               "and KV head: one label per token) or 'blend' (the group's and the model's, weighed by blend)")
    blend: float = Field(0.5, ge=0, le=1, allow_inf_nan=False, description="scope 'blend': the weight of the model-wide "
                         "target (0.5: the mean of the two log targets; 0 is 'group', 1 is 'model')")
    value: bool = Field(False, description="weigh each token's need by its value norm, log(||v|| / sqrt(D)) added to the "
                        "target (what its eviction removes from the head's output); scope 'group' only")

    @model_validator(mode="after")
    def _value_needs_group(self) -> TargetSpec:
        if self.value and self.scope != "group":
            raise ValueError(f"value weighting needs scope 'group' (a wider scope's maximum would mix one head's attention "
                             f"with another head's values), got scope {self.scope!r}")
        return self

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        return cls._fields_of(data) if isinstance(data, str) else data

    @classmethod
    def parse(cls, text: str) -> TargetSpec:
        """The spec written ``text`` in the compact form (class docstring); a ValueError naming the bad part."""
        return cls(**cls._fields_of(text))

    @staticmethod
    def _fields_of(text: str) -> dict[str, Any]:
        if not isinstance(text, str):
            raise ValueError(f"a target spec is text, got {type(text).__name__}; {_GRAMMAR}")
        raw = text.strip()
        if not raw:
            raise ValueError(f"empty target spec; {_GRAMMAR}")
        parts = re.split(r"\.(?=[A-Za-z])", raw)  # a dot before a letter ends a part; a number's dot does not
        fields: dict[str, Any] = {}
        if len(parts) > 1 and parts[-1] == "value":
            fields["value"] = True
            parts = parts[:-1]
        if len(parts) > 2:
            raise ValueError(f"target spec {raw!r} has {len(parts)} parts {parts} before any '.value', at most two; {_GRAMMAR}")
        for part, what, names, numbered, number_field in (
            (parts[0], "kind", TARGET_KINDS, "power", "beta"),
            (parts[1] if len(parts) > 1 else None, "scope", TARGET_SCOPES, "blend", "blend"),
        ):
            if part is None:
                continue
            name, colon, arg = part.partition(":")
            if name not in names:
                raise ValueError(f"unknown target {what} {name!r} in {raw!r}; {_GRAMMAR}")
            fields[what] = name
            if not colon:
                continue
            if name != numbered:
                raise ValueError(f"{what} {name!r} takes no number, got {part!r} in {raw!r}; {_GRAMMAR}")
            try:
                value = float(arg)
            except ValueError:
                raise ValueError(f"{number_field} of {part!r} in {raw!r} is not a number; {_GRAMMAR}") from None
            if number_field == "beta" and not (math.isfinite(value) and value > 0):
                raise ValueError(f"beta of {part!r} in {raw!r} must be a finite number > 0; {_GRAMMAR}")
            if number_field == "blend" and not 0.0 <= value <= 1.0:
                raise ValueError(f"blend weight of {part!r} in {raw!r} must lie in [0, 1]; {_GRAMMAR}")
            fields[number_field] = value
        return fields

    def __str__(self) -> str:
        text = f"power:{_number(self.beta)}" if self.kind == "power" else self.kind
        if self.scope == "blend":
            text = f"{text}.blend:{_number(self.blend)}"
        elif self.scope != "group":
            text = f"{text}.{self.scope}"
        return f"{text}.value" if self.value else text

    def weigh(self, r_tgt: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """One layer's target ``r_tgt`` (B, Hk, S) under this spec's value weighting: unchanged without it, else
        plus ``log(||v|| / sqrt(D))`` of ``values`` (B, Hk, S, D), the layer's values the target was taken on."""
        if not self.value:
            return r_tgt
        if values.shape[:3] != r_tgt.shape:
            raise ValueError(f"value weighting: values {tuple(values.shape)} do not match the target {tuple(r_tgt.shape)}")
        v = values.detach().float()
        return r_tgt + (v.norm(dim=-1) / math.sqrt(v.shape[-1])).clamp_min(1e-12).log().to(r_tgt.dtype)

    @property
    def spans_layers(self) -> bool:
        """Whether a layer's scoped target needs every layer's (the loss then waits for the whole forward)."""
        return self.scope in ("model", "blend")


def scope_targets(targets: list[torch.Tensor], scope: TargetScope, blend: float = 0.5) -> list[torch.Tensor]:
    """Per-layer targets ``(B, Hk, S)`` -> the same list widened to ``scope`` (module docstring).

    ``"group"`` returns the targets as they are; ``"layer"`` the maximum over each layer's KV heads;
    ``"model"`` the maximum over every layer and KV head (layers must agree in ``(B, Hk, S)``);
    ``"blend"`` ``(1 - blend) * target + blend * that model-wide maximum``. A ``scope`` or ``blend``
    that no :class:`TargetSpec` accepts raises its ValueError (a pydantic ValidationError)."""
    TargetSpec(scope=scope, blend=blend)  # the spec's checks, naming the bad field
    if scope == "group":
        return list(targets)
    if scope == "layer":
        return [t.amax(dim=1, keepdim=True).expand_as(t) for t in targets]
    m = torch.stack(list(targets)).amax(dim=(0, 2), keepdim=True)[0]  # (B, 1, S)
    if scope == "blend":
        return [(1 - blend) * t + blend * m for t in targets]
    return [m.expand_as(t) for t in targets]

_compiled_flex_attention = None


def _flex_attention_fn(device: torch.device):
    """``flex_attention``, compiled once per process on CUDA, eager elsewhere."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def _column_stats_chunked(q, k, lse, doc_ids, *, window: int, scale: float, chunk: int, kind: str, beta: float) -> torch.Tensor:
    """Column statistic ``L_t`` over ``u >= t + w`` of the same document, plain torch.

    Args:
        q: ``(B, H, S, D)``; k: ``(B, Hk, S, D)``; lse: ``(B, H, S)``; doc_ids: ``(B, S)``.

    Returns:
        ``(B, H, S)`` float64 ``L_t`` (``-inf`` for an empty column).
    """
    B, H, S, D = q.shape
    Hk = k.shape[1]
    G = H // Hk
    q = (scale * q.float()).reshape(B, Hk, G, S, D)
    k_t = k.float().transpose(-1, -2)  # (B, Hk, D, S)
    lse = lse.float().reshape(B, Hk, G, S)
    idx = torch.arange(S, device=q.device)
    doc_start = document_spans(doc_ids)[0].amin(dim=0).tolist()  # (S,) min over the batch
    if kind == "mean":
        acc = torch.zeros(B, Hk, G, S, dtype=torch.float64, device=q.device)  # sum_u p
    else:
        acc = torch.full((B, Hk, G, S), -math.inf, dtype=torch.float64, device=q.device)  # L_t so far
    for u0 in range(window, S, chunk):
        u1 = min(u0 + chunk, S)
        # Keys receiving attention from this chunk: same document (t >= start of
        # u0's document) and t <= u - w.
        t0, t1 = doc_start[u0], u1 - window
        u, t = idx[u0:u1], idx[t0:t1]
        # (B, cu, ct): causal-with-window, same document, key not padding.
        allowed = (u[:, None] >= t[None, :] + window) & (doc_ids[:, u0:u1, None] == doc_ids[:, None, t0:t1])
        allowed &= doc_ids[:, None, t0:t1] >= 0
        logp = q[:, :, :, u0:u1] @ k_t[..., t0:t1].unsqueeze(2)  # (B, Hk, G, cu, ct) logits
        logp.sub_(lse[:, :, :, u0:u1, None]).masked_fill_(~allowed[:, None, None], -math.inf)  # log p, -inf if not allowed
        part = acc[..., t0:t1]  # (B, Hk, G, ct) view
        if kind == "mean":
            part += logp.exp_().sum(dim=-2)  # float32 within a chunk, float64 across chunks
        elif kind == "power":
            part.copy_(torch.logaddexp(part, logp.mul_(beta).logsumexp(dim=-2).double()))  # log sum p^beta
        else:
            part.copy_(torch.maximum(part, logp.amax(dim=-2).double()))  # log max p
    if kind == "mean":
        acc = acc.log()
    return acc.view(B, H, S)


def _column_stats_flex(q, k, lse, doc_ids, *, window: int, scale: float, kind: str, beta: float) -> torch.Tensor:
    """Column statistic ``L_t`` via one transposed FlexAttention pass (see module doc).

    Returns:
        ``(B, H, S)`` float64 ``L_t`` (``-inf`` for an empty column).
    """
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    if kind == "max" and q.device.type != "cuda":
        raise ValueError(
            f"kind='max' with impl='flex' needs CUDA: torch refuses flex_attention's max_scores on {q.device.type} inputs; use impl='chunked'"
        )
    B, H, S, D = q.shape
    G = H // k.shape[1]
    doc = doc_ids.to(torch.int32).contiguous()
    lse = lse.float().contiguous()

    # Transposed roles: "query" index = key token t, "kv" index = query token u.
    def mask_mod(b, h, t, u):
        return (u >= t + window) & (doc[b, u] == doc[b, t]) & (doc[b, t] >= 0)

    def log_p(score, b, h, t, u):  # mean, max: log p_{u -> t}
        return score - lse[b, h, u]

    def beta_log_p(score, b, h, t, u):  # power: log p_{u -> t}^beta
        return beta * (score - lse[b, h, u])

    block_mask = create_block_mask(mask_mod, B, None, S, S, device=q.device)
    # Inputs keep their dtype: flex multiplies bf16/fp16 operands exactly and
    # accumulates scores, the LSE and the row maximum in float32 (an fp32 upcast
    # would only make the kernel much slower on CUDA).
    keys_as_queries = k.repeat_interleave(G, dim=1)  # (B, H, S, D)
    values = q.new_zeros(B, H, S, 16)  # only the LSE / row maximum is used
    flex = _flex_attention_fn(q.device)
    _, aux = flex(
        keys_as_queries,
        q,
        values,
        score_mod=beta_log_p if kind == "power" else log_p,
        block_mask=block_mask,
        scale=scale,
        return_aux=AuxRequest(lse=True) if kind != "max" else AuxRequest(max_scores=True),
    )
    # Natural-log statistics, (B, H, S); rows with no allowed u give -inf.
    stat = (aux.max_scores if kind == "max" else aux.lse).double()
    return torch.where(stat.isnan(), -math.inf, stat)


@torch.no_grad()
def future_attention_target(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    window: int,
    scale: float,
    eps: float = 1e-6,
    impl: str = "auto",
    chunk: int = 1024,
    kind: TargetKind = "mean",
    beta: float = 8.0,
) -> torch.Tensor:
    """Log future attention received by every token (mean, power mean or max), max over each GQA group.

    Args:
        q: ``(B, H, S, D)`` student queries.
        k: ``(B, Hk, S, D)`` student keys.
        lse: ``(B, H, S)`` natural-log normalizer of each query's attention.
        doc_ids: ``(B, S)`` int document ids (contiguous runs, ``-1`` = padding).
        window: recent window ``w``; query ``u`` counts for token ``t`` iff ``u >= t + w``.
        scale: softmax scale applied to ``q . k``.
        eps: floor inside the log.
        impl: ``"flex"``, ``"chunked"`` or ``"auto"`` (flex on CUDA, chunked otherwise).
        chunk: query rows per step of the chunked executor.
        kind: ``"mean"`` (the paper's), ``"power"`` or ``"max"`` (module docstring).
        beta: order of the power mean, ``> 0`` (only used by ``"power"``).

    Returns:
        ``(B, Hk, S)`` float32 targets ``r_tgt``.
    """
    B, H, S, _ = q.shape
    Hk = k.shape[1]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target kind {kind!r}; one of {', '.join(TARGET_KINDS)}")
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if impl == "auto":
        impl = "flex" if q.is_cuda else "chunked"
    if impl == "chunked":
        stat = _column_stats_chunked(q, k, lse, doc_ids, window=window, scale=scale, chunk=chunk, kind=kind, beta=beta)
    elif impl == "flex":
        stat = _column_stats_flex(q, k, lse, doc_ids, window=window, scale=scale, kind=kind, beta=beta)
    else:
        raise ValueError(f"unknown impl {impl!r}")

    _, end = document_spans(doc_ids)
    idx = torch.arange(S, device=q.device)
    n_queries = (end - idx - window).clamp(min=1)  # (B, S)
    if kind == "max":
        log_m = stat
    else:
        log_m = stat - n_queries.double().log()[:, None, :]  # (B, H, S)
        if kind == "power":
            log_m = log_m / beta
    log_m = torch.where((doc_ids >= 0)[:, None, :], log_m, -math.inf)
    r = torch.logaddexp(log_m, torch.tensor(math.log(eps), dtype=torch.float64, device=q.device))  # log(eps + m)
    return r.view(B, Hk, H // Hk, S).amax(dim=2).float()
