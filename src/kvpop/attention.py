"""Sparse attention inside a Hugging Face model: the executors and the per-forward context.

The model runs with ``attn_implementation="kvpop"``; every attention layer then calls
:meth:`SparseContext.attend`, handed in as the ``kvpop_ctx`` keyword of the model's forward:

1. the policy scores the layer's keys and values (one hook, :meth:`Policy.scores`);
2. :func:`kvpop.selection.eviction_times` turns priorities into one eviction time per token;
3. an executor runs attention under :func:`kvpop.masks.make_eviction_mask_mod`:
   ``"flex"`` (CUDA: FlexAttention with a BlockMask from per-block bounds) or ``"sdpa"``
   (CPU, where FlexAttention has no backward: SDPA with the dense boolean mask);
4. for a learned policy in training, the target pass (:func:`kvpop.target.future_attention_target`)
   and the boundary loss (:func:`kvpop.boundary.boundary_loss`) run right there, per layer, so
   no per-layer query/key tensors outlive the layer;
5. a ``gated`` policy in training (``dms``) instead runs its relaxed gate (:meth:`Policy.relax`):
   the pattern comes from the relaxation's priorities, and the executor adds the gate's
   differentiable bias to the logits of every token past the window (:func:`gate_bias_mod`,
   :func:`gate_bias_mask`; for ``trimkv`` times the token's age), so the KL reaches the gate; each
   layer's relaxation waits in :attr:`SparseContext.gate_relaxations` for the gate's budget loss.

Activation checkpointing (``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
False})``) runs every decoder layer twice: the forward, then a recomputation during backward. The
context serves one forward pass and records each layer's eviction times on its first call; a
second call for the same layer is that recomputation and only reruns the executor on the
recorded pattern (no scorer, selection, target pass or loss, so the losses hold one entry per
layer and the query-sample generator advances once). The scorer and the boundary loss keep their
saved tensors out of the checkpoint (:func:`_kept_saved_tensors`): their graph, which reaches only
the scorer, is built once and never recomputed, and the tensors the checkpoint saves and
recomputes are exactly the layer's own. Reentrant checkpointing (which runs the first pass without
gradients) is refused.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, S sequence, D head dim.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional as F

from kvpop.boundary import BoundaryWeight, boundary_loss, calibration_loss, pool_boundary_loss
from kvpop.geometry import CacheLayout
from kvpop.masks import block_mask_from_eviction_times, dense_mask, make_eviction_mask_mod
from kvpop.policies import Policy
from kvpop.policies.base import GateRelaxation
from kvpop.scorer import static_priority
from kvpop.selection import NEVER, decaying_eviction_times, eviction_times
from kvpop.target import TargetSpec, future_attention_target, scope_targets

ATTN_IMPLEMENTATION = "kvpop"
Executor = Literal["sdpa", "flex"]


@torch.no_grad()
def masked_lse(q: Tensor, k: Tensor, allowed: Tensor, scale: float, chunk: int = 512) -> Tensor:
    """Log-normalizers of masked attention: q (B, H, S, D), k (B, Hk, S, D), allowed (B, H, S, S) bool, or an additive
    float mask (``-inf`` where not allowed, :func:`gate_bias_mask`) -> (B, H, S)."""
    B, H, S, _ = q.shape
    kk = k.repeat_interleave(H // k.shape[1], dim=1).float()
    out = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    for s in range(0, S, chunk):
        sc = torch.einsum("bhqd,bhkd->bhqk", q[:, :, s : s + chunk].float(), kk) * scale
        m = allowed[:, :, s : s + chunk]
        out[:, :, s : s + chunk] = (sc.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else sc + m.float()).logsumexp(-1)
    return out


def sdpa_execute(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, need_lse: bool) -> tuple[Tensor, Tensor | None]:
    """CPU executor: SDPA with a boolean mask (B, H, S, S). Returns (out (B, H, S, D), lse or None)."""
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out, (masked_lse(q, k, allowed, scale) if need_lse else None)


@functools.cache
def _compiled_flex():
    """FlexAttention compiled for static shapes: each new shape compiles anew (after torch's recompile limit,
    8, it runs eagerly), right for shapes that repeat (training rows, the engine's full prefill chunks)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_gqa(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _flex_gqa_any_length(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    # the main FlexAttention kernel: inductor's decoding kernel (its pick for fewer than 128 queries) has no
    # configuration for symbolic lengths (H200, torch 2.11: "NoValidChoicesError ... flex_decoding")
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options={"FORCE_USE_FLEX_ATTENTION": True})


@functools.cache
def _compiled_flex_any_length():
    """``flex(q, k, v, block_mask, scale)`` (GQA) compiled once with symbolic lengths: for shapes that do not
    repeat (a prompt's last prefill chunk), which would otherwise compile once each, then fall back to eager
    FlexAttention. Its own function, so that its compiled code and guards are apart from :func:`_compiled_flex`'s.
    Dynamo specializes sizes 0 and 1 and inductor guards on fewer / at least 128 queries, so the engine pads a last
    chunk's queries to the full chunk's (:meth:`kvpop.decode.engine.DecodeEngine._attend_any_length`): one query length."""
    return torch.compile(_flex_gqa_any_length, dynamic=True)


#: why :func:`flex_any_length` fell back to the static compile (None: it has not); tests read it
ANY_LENGTH_FAILED: list[str] = []


def flex_any_length(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> Tensor:
    """FlexAttention (GQA) for a shape that does not repeat, on CUDA: :func:`_compiled_flex_any_length`; where
    that compile fails (a torch whose inductor lacks a kernel for symbolic lengths), a warning once and the static
    compile from then on (a compile per new shape, eager past the recompile limit: slower, the same result)."""
    if not ANY_LENGTH_FAILED:
        try:
            return _compiled_flex_any_length()(q, k, v, block_mask, scale)
        except Exception as err:  # noqa: BLE001 - any compile failure: the static compile below computes the same
            if isinstance(err, torch._dynamo.exc.RecompileError):  # error_on_recompile (tests): not a failure to hide
                raise
            ANY_LENGTH_FAILED.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            warnings.warn(f"FlexAttention compiled for any length failed ({ANY_LENGTH_FAILED[0]}); compiling per shape instead", stacklevel=2)
    return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def flex_execute(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float, need_lse: bool, score_mod=None) -> tuple[Tensor, Tensor | None]:
    """CUDA executor: FlexAttention (compiled) under a BlockMask; eager on CPU (forward only)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    fn = _compiled_flex() if q.is_cuda else flex_attention
    if need_lse:
        out, aux = fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True), None


def _gate_applies(pos: Tensor, b, q_idx, kv_idx, *, sinks: int, window: int):
    """Where a gate's bias counts: the key token left the window (``q - kv >= window``) and is no sink."""
    return (q_idx - kv_idx >= window) & (pos[b, kv_idx] >= sinks)


def gate_bias_mod(bias: Tensor, pos: Tensor, *, sinks: int, window: int, group: int, age_scaled: bool = False):
    """A FlexAttention ``score_mod`` adding ``bias[b, h // group, kv]`` (B, Hk, S), times the age ``q - kv``
    if ``age_scaled``, to the logits of tokens past the window (the flex twin of :func:`gate_bias_mask`;
    gradients reach ``bias``)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        add = bias[b, h // group, kv_idx]
        if age_scaled:
            add = add * (q_idx - kv_idx)
        return score + torch.where(_gate_applies(pos, b, q_idx, kv_idx, sinks=sinks, window=window), add, 0.0)

    return score_mod


def gate_bias_mask(allowed: Tensor, bias: Tensor, pos: Tensor, *, sinks: int, window: int, age_scaled: bool = False) -> Tensor:
    """The SDPA twin: allowed (B, H, S, S) bool, bias (B, Hk, S), pos (B, S) -> float mask (B, H, S, S):
    ``-inf`` where not allowed, the bias (times the age ``q - kv`` if ``age_scaled``) on tokens past
    the window, 0 elsewhere."""
    B, H, S, _ = allowed.shape
    b = torch.arange(B, device=pos.device).view(B, 1, 1)
    q = torch.arange(S, device=pos.device).view(1, S, 1)
    kv = torch.arange(S, device=pos.device).view(1, 1, S)
    applies = _gate_applies(pos, b, q, kv, sinks=sinks, window=window)  # (B, S, S)
    add = bias[:, :, None, :].expand(B, bias.shape[1], S, S)  # (B, Hk, S, S), bias's dtype
    if age_scaled:
        add = add * (q - kv).to(bias.dtype)
    add = torch.where(applies[:, None], add, 0.0)
    add = add.repeat_interleave(H // bias.shape[1], dim=1)  # (B, H, S, S)
    return add.masked_fill(~allowed, float("-inf"))


@dataclass
class ScorerTraining:
    """Settings of the boundary loss, when a learned policy is being trained."""

    tau: float = 1.0
    tie_margin: float = 0.5
    query_samples: int = 0
    target_normalizer: Literal["sparse", "dense"] = "sparse"
    target: TargetSpec = field(default_factory=TargetSpec)  # kind, beta, scope and blend of the target (kvpop.target)
    weighting: BoundaryWeight = "tie"  # boundary-loss weights (kvpop.boundary.boundary_loss)
    calibration: float = 0.0  # weight of kvpop.boundary.calibration_loss beside the boundary loss
    #: one-pool policies: the KL's gradient to the scorer, straight through. ``kl_signal * (r_hat - r_hat.detach())``
    #: is added to the logits of every token past the window (exactly 0 in the forward: the pattern and the logits are
    #: unchanged); in the backward each visible token's r_hat gets ``kl_signal`` times the loss's gradient to its
    #: attention logits, summed over the queries (positive where more attention to it would raise the loss)
    kl_signal: float = 0.0
    generator: torch.Generator | None = None


@dataclass
class GateTraining:
    """Settings of a gated policy's relaxation, when it is being trained (``dms``)."""

    tau: float = 0.1  # temperature of the Gumbel-sigmoid (dms)
    noise: bool = True  # logistic noise on the logits (off: the deterministic relaxation)
    generator: torch.Generator | None = None
    loss_weight: float = 1.0  # weight of the gate's budget loss (train.compression_weight)
    loss_ramp: float = 0.5  # share of training over which it ramps up (train.compression_ramp)


def _keep(t: Tensor) -> Tensor:
    return t.detach()


def _unpack(t: Tensor) -> Tensor:
    return t


def _kept_saved_tensors():
    """Saved-tensor hooks that keep tensors as they are, overriding any outer hooks.

    Inside a checkpointed layer, tensors saved for backward go to the checkpoint, which recomputes
    them by rerunning the layer. The scorer's forward and the boundary loss run only on a layer's
    first call, so their saved tensors must stay out of the checkpoint's record (which must match
    between forward and recomputation, tensor for tensor): under these hooks they are stored
    directly, as without checkpointing. ``detach`` avoids a reference cycle through saved outputs.
    """
    return torch.autograd.graph.saved_tensors_hooks(_keep, _unpack)


@dataclass
class _LayerRecord:
    """What a layer's first call leaves for its recomputation under activation checkpointing."""

    evict: Tensor  # (B, Hk, S)
    need_lse: bool
    grad_enabled: bool
    gate_bias: Tensor | None = None  # (B, Hk, S) a gated policy's training bias
    age_scaled: bool = False


@dataclass
class SparseContext:
    """Everything one forward pass needs to run the eviction pattern in every layer.

    One context per forward pass: a second call for a layer is taken as the recomputation of
    activation checkpointing (see the module docstring) and must happen during backward.
    """

    policy: Policy
    doc_ids: Tensor  # (B, S) int, -1 on padding
    pos: Tensor  # (B, S) int, position inside the document
    layout: CacheLayout  # sinks, window and the policy's long-range slots k
    executor: Executor = "sdpa"
    scorer_training: ScorerTraining | None = None
    gate_training: GateTraining | None = None
    losses: list[Tensor] = field(default_factory=list)  # boundary loss per layer (see finish_scorer_losses)
    gate_relaxations: list[GateRelaxation] = field(default_factory=list)  # gated policy in training: one per layer
    stats: list[dict[str, Tensor]] = field(default_factory=list)
    #: ``one_pool`` policies: every layer's eviction times (L, B, Hk, S) from outside (None: no eviction, the
    #: first pass of the fixed point of :func:`kvpop.evaluate.pool_fixed_point`), and each layer's priorities as scored
    global_evict: Tensor | None = None
    global_prio: dict[int, Tensor] = field(default_factory=dict)
    _pending: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)  # (r_hat, r_tgt, log_gamma) awaiting the model-wide pool
    #: a ``one_pool`` policy trained under given times: every layer's scorer runs once, after the forward (:meth:`_deferred_scores`);
    #: False scores each layer as it runs (the twin the tests hold it equal to)
    stack_scorers: bool = True
    _stacked: Policy | None = None  # the policy's all_layers(graph=True) view, once per forward
    _kv: Tensor | None = None  # (2, B, L, Hk, S, D) the deferred layers' keys and values, detached, in the forward's dtype
    _targets: dict[int, Tensor] = field(default_factory=dict)  # deferred layer -> its target r_tgt (B, Hk, S)
    scored_layers: int = 0  # layers whose scorer loss was added (one_pool: one loss for all of them)
    _cache: dict = field(default_factory=dict)
    _layers: dict[int, _LayerRecord] = field(default_factory=dict)  # first call of each layer

    @classmethod
    def for_rows(cls, policy: Policy, doc_ids: Tensor, pos: Tensor, layout: CacheLayout, **kw) -> SparseContext:
        return cls(policy=policy, doc_ids=doc_ids, pos=pos, layout=layout, **kw)

    def evictions(self, layer: int, k: Tensor, v: Tensor):
        """(eviction times (B, Hk, S), Scores or None) for one layer."""
        B, Hk, S, _ = k.shape
        if self.policy.layer_independent and "evict" in self._cache:
            return self._cache["evict"], None
        if self._defers():  # the pool's pattern is given and the scores feed only the pool's loss: scored after the forward
            if self._kv is None:
                L = len(self.global_evict)
                self._kv = torch.empty(2, B, L, Hk, S, k.shape[-1], dtype=k.dtype, device=k.device)  # the forward's dtype: float32 when scored
            self._kv[0, :, layer] = k.detach()
            self._kv[1, :, layer] = v.detach()
            return self.global_evict[layer], None
        with torch.autocast(device_type=k.device.type, enabled=False):  # scorers compute in fp32
            scores = self.policy.scores(layer, k.float(), v.float(), self.pos, doc_ids=self.doc_ids, window=self.layout.window)
        if scores is not None and self.policy.one_pool:  # the pool's pattern needs every layer's scores: given
            self.global_prio[layer] = scores.prio
            if self.global_evict is not None:
                return self.global_evict[layer], scores
        if scores is None or self.policy.one_pool:
            evict = torch.full((B, Hk, S), NEVER, dtype=torch.int64, device=k.device)
        else:
            times = decaying_eviction_times if self.policy.decays else eviction_times  # ranks that fall with age: a simulation
            evict = times(scores.prio, self.doc_ids, self.pos, sinks=self.layout.sinks, window=self.layout.window,
                          long_range=self.layout.long_range)
        if self.policy.layer_independent:
            self._cache["evict"] = evict
        return evict, scores

    def _defers(self) -> bool:
        """Whether the scorers wait for the end of the forward: a ``one_pool`` policy trained under given eviction times
        (``global_evict``), whose scores no layer's pattern reads, with an :meth:`~kvpop.policies.Policy.all_layers` view
        (then one call scores every layer, :meth:`_deferred_scores`, instead of one per layer)."""
        if not (self.stack_scorers and self.policy.one_pool and self.policy.learned and not self.policy.gated
                and self.global_evict is not None and self.scorer_training is not None and not self.scorer_training.kl_signal):
            return False  # (the KL signal needs each layer's scores before its attention)
        if self._stacked is None:
            self._stacked = self.policy.all_layers(graph=True)
            if self._stacked is None:
                self.stack_scorers = False
                return False
        return True

    def _deferred_scores(self) -> None:
        """Every deferred layer's scores in one call of the stacked view (with the graph to each layer's scorer), then
        each layer's loss term as :meth:`add_scorer_loss` takes it and its priorities in :attr:`global_prio`."""
        if self._kv is None:
            return
        _, B, L, Hk, S, D = self._kv.shape
        if sorted(self._targets) != list(range(L)):
            raise RuntimeError(f"a pool policy's training forward scored layers {sorted(self._targets)} of {L}: the pool's loss needs every layer")
        with _kept_saved_tensors(), torch.autocast(device_type=self._kv.device.type, enabled=False):
            k, v = (self._kv[i].view(B, L * Hk, S, D).float() for i in (0, 1))
            self._kv = None  # the scorer keeps what its backward needs; the forward's copy goes before the backward
            sc = self._stacked.scores(0, k, v, self.pos, doc_ids=self.doc_ids, window=self.layout.window)
            del k, v
        r_hat, prio, log_gamma = sc.r_hat.view(B, L, Hk, S), sc.prio.view(B, L, Hk, S), sc.log_gamma.view(L, Hk)
        for layer in range(L):
            self.global_prio[layer] = prio[:, layer]
            self.add_scorer_loss(r_hat[:, layer], self._targets[layer], log_gamma[layer])
        self._targets = {}

    def _pattern(self, evict: Tensor, H: int, layer_key: object, keep: bool):
        """The executor's pattern: a BlockMask (flex) or a dense (B, H, S, S) mask (sdpa).

        ``keep``: cache it under ``layer_key`` (patterns shared by layers, and flex patterns, which
        are small, for the recomputation; dense masks are rebuilt from the eviction times instead).
        """
        key = ("pattern", layer_key)
        if key in self._cache:
            return self._cache[key]
        B, Hk, S = evict.shape
        if self.executor == "flex":
            pat = block_mask_from_eviction_times(self.doc_ids, self.pos, evict, sinks=self.layout.sinks, num_heads=H)
        else:
            mm = make_eviction_mask_mod(self.doc_ids, self.pos, evict, sinks=self.layout.sinks, group=H // Hk)
            pat = dense_mask(mm, B, H, S, evict.device)
        if keep:
            self._cache[key] = pat
        return pat

    def run(self, q: Tensor, k: Tensor, v: Tensor, evict: Tensor, scale: float, need_lse: bool, layer_key: object, keep: bool | None = None,
            gate_bias: Tensor | None = None, age_scaled: bool = False):
        """Attention under the eviction pattern; ``gate_bias`` (B, Hk, S): added to the logits of tokens
        past the window, times their age if ``age_scaled`` (a gated policy in training; a one-pool scorer's
        straight-through KL signal, :attr:`ScorerTraining.kl_signal`)."""
        if keep is None:
            keep = self.policy.layer_independent or self.executor == "flex"
        pat = self._pattern(evict, q.shape[1], layer_key, keep)
        if gate_bias is not None:
            gk = dict(sinks=self.layout.sinks, window=self.layout.window, age_scaled=age_scaled)
            if self.executor == "flex":
                return flex_execute(q, k, v, pat, scale, need_lse, score_mod=gate_bias_mod(gate_bias, self.pos, group=q.shape[1] // k.shape[1], **gk))
            return sdpa_execute(q, k, v, gate_bias_mask(pat, gate_bias, self.pos, **gk), scale, need_lse)
        if self.executor == "flex":
            return flex_execute(q, k, v, pat, scale, need_lse)
        return sdpa_execute(q, k, v, pat, scale, need_lse)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q (B, H, S, D), k, v (B, Hk, S, D) -> attention output (B, S, H, D)."""
        key = "static" if self.policy.layer_independent else layer
        rec = self._layers.get(layer)
        if rec is not None:
            return self._recompute(rec, q, k, v, scale, key)
        if self.gate_training is not None and self.policy.gated:
            return self._attend_gated(layer, q, k, v, scale, key)
        with _kept_saved_tensors():
            evict, scores = self.evictions(layer, k, v)
        deferred = self._kv is not None  # its scores come after the forward (_defers)
        train = self.scorer_training is not None and (deferred or (scores is not None and scores.r_hat is not None))
        bias = None
        if train and not deferred and self.policy.one_pool and self.scorer_training.kl_signal:
            r = scores.r_hat  # (B, Hk, S) with the scorer's graph: 0 in the forward, the KL's gradient in the backward
            bias = (self.scorer_training.kl_signal * (r - r.detach())).to(q.dtype)
        out, lse = self.run(q, k, v, evict, scale, need_lse=train, layer_key=key, gate_bias=bias)
        self._layers[layer] = _LayerRecord(evict=evict, need_lse=train, grad_enabled=torch.is_grad_enabled(), gate_bias=bias)
        if train:
            st = self.scorer_training
            with torch.no_grad():
                if st.target_normalizer == "dense":
                    never = torch.full_like(evict, NEVER)
                    _, lse = self.run(q.detach(), k.detach(), v.detach(), never, scale, True, "dense", keep=self.executor == "flex")
                impl = "flex" if self.executor == "flex" else "chunked"
                r_tgt = future_attention_target(
                    q.detach(), k.detach(), lse.detach(), self.doc_ids, window=self.layout.window, scale=scale, impl=impl,
                    kind=st.target.kind, beta=st.target.beta,
                )
                r_tgt = st.target.weigh(r_tgt, v)  # value weighting (train.target.value), else unchanged
            if deferred:
                self._targets[layer] = r_tgt
            else:
                self.add_scorer_loss(scores.r_hat, r_tgt, scores.log_gamma)
        return out.transpose(1, 2).contiguous()

    def _attend_gated(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, key: object) -> Tensor:
        """A gated policy in training: the relaxed gate's pattern and bias (see the module docstring)."""
        gt = self.gate_training
        with _kept_saved_tensors(), torch.autocast(device_type=k.device.type, enabled=False):
            x = self.policy.scores(layer, k.float(), v.float(), self.pos).r_hat  # (B, Hk, S) gate logits
            relax = self.policy.relax(x, tau=gt.tau, generator=gt.generator, noise=gt.noise)
        if relax.prio is None:  # no eviction in training: the bias alone stands for it (trimkv)
            evict = torch.full(x.shape, NEVER, dtype=torch.int64, device=x.device)
        else:
            evict = eviction_times(relax.prio, self.doc_ids, self.pos, sinks=self.layout.sinks, window=self.layout.window,
                                   long_range=self.layout.long_range)
        bias = relax.bias.to(q.dtype)
        out, _ = self.run(q, k, v, evict, scale, need_lse=False, layer_key=key, gate_bias=bias, age_scaled=relax.age_scaled)
        self._layers[layer] = _LayerRecord(evict=evict, need_lse=False, grad_enabled=torch.is_grad_enabled(), gate_bias=bias,
                                           age_scaled=relax.age_scaled)
        self.gate_relaxations.append(relax)
        return out.transpose(1, 2).contiguous()

    def add_scorer_loss(self, r_hat: Tensor, r_tgt: Tensor, log_gamma: Tensor) -> None:
        """One layer's scorer loss under :attr:`scorer_training`: ``r_hat`` (B, Hk, S) with the scorer's graph,
        ``r_tgt`` (B, Hk, S) the layer's target before its scope, ``log_gamma`` (Hk,) with the decay's graph.
        Computed now, or, where the target's scope spans layers, by :meth:`finish_scorer_losses` (:attr:`losses`)."""
        spec = self.scorer_training.target
        self.scored_layers += 1
        if spec.spans_layers or self.policy.one_pool:  # needs every layer's target (or scores): the loss waits for finish_scorer_losses
            self._pending.append((r_hat, r_tgt, log_gamma))
        else:
            self._scorer_loss(r_hat, scope_targets([r_tgt], spec.scope, spec.blend)[0], log_gamma)

    def mean_scorer_loss(self) -> Tensor:
        """The scorer loss of the forward: the mean over layers of :attr:`losses` (after
        :meth:`finish_scorer_losses`), float32 (a layer without decisions gives float64 0)."""
        return torch.stack([x.float() for x in self.losses]).mean()

    def _scorer_loss(self, r_hat: Tensor, r_tgt: Tensor, log_gamma: Tensor) -> None:
        st = self.scorer_training
        with _kept_saved_tensors():
            loss, stats = boundary_loss(
                r_hat, r_tgt, log_gamma, self.doc_ids, self.pos,
                layout=self.layout, tau=st.tau, tie_margin=st.tie_margin,
                query_samples=st.query_samples, generator=st.generator, weighting=st.weighting, share=self.policy.scorer.decay.share,
            )
            if st.calibration > 0:
                calib = calibration_loss(r_hat, r_tgt, self.doc_ids, self.pos, sinks=self.layout.sinks)
                loss = loss + st.calibration * calib
                stats = {**stats, "calibration": calib.detach()}
        self.losses.append(loss)
        self.stats.append(stats)

    def finish_scorer_losses(self) -> list[Tensor]:
        """The boundary loss of every trained layer, after the forward pass (:attr:`losses`).

        Under target scope ``"model"`` or ``"blend"`` a layer's target depends on every layer's, so those losses are
        computed here, once the forward has seen all layers; call it before reading ``losses``. A ``one_pool``
        policy's loss is one for the whole model (:meth:`_pool_scorer_loss`), its scorers run here where they were deferred
        (:meth:`_defers`)."""
        self._deferred_scores()
        if self._pending:
            spec = self.scorer_training.target
            scoped = scope_targets([t for _, t, _ in self._pending], spec.scope, spec.blend)
            if self.policy.one_pool:
                self._pool_scorer_loss(scoped)
                return self.losses
            for (r_hat, _, log_gamma), r_tgt in zip(self._pending, scoped, strict=True):
                self._scorer_loss(r_hat, r_tgt, log_gamma)
            self._pending.clear()
        return self.losses

    def _pool_scorer_loss(self, targets: list[Tensor]) -> None:
        """The pool's boundary loss over every layer at once (:func:`kvpop.boundary.pool_boundary_loss`):
        the student's and the teacher's static priorities of every (layer, head) pair, (B, L x Hk, S)."""
        st = self.scorer_training
        share = self.policy.scorer.decay.share
        with _kept_saved_tensors():
            hat = torch.cat([static_priority(r, self.pos, g, share) for r, _, g in self._pending], 1)  # (B, L Hk, S)
            with torch.no_grad():
                tgt = torch.cat([static_priority(t, self.pos, g.detach(), share) for (_, _, g), t in zip(self._pending, targets, strict=True)], 1)
            loss, stats = pool_boundary_loss(hat, tgt, self.doc_ids, self.pos, layout=self.layout, tau=st.tau, tie_margin=st.tie_margin,
                                             weighting=st.weighting)
            if st.calibration > 0:
                calib = torch.stack([calibration_loss(r, t, self.doc_ids, self.pos, sinks=self.layout.sinks)
                                     for (r, _, _), t in zip(self._pending, targets, strict=True)]).mean()
                loss = loss + st.calibration * calib
                stats = {**stats, "calibration": calib.detach()}
        self.losses.append(loss)
        self.stats.append(stats)
        self._pending.clear()

    def _recompute(self, rec: _LayerRecord, q: Tensor, k: Tensor, v: Tensor, scale: float, key: object) -> Tensor:
        """A layer's second call: activation checkpointing recomputes it during backward.

        Same pattern (the recorded eviction times, never re-derived from recomputed keys), same
        executor call, so the checkpoint saves the same tensors as in the first call; the scorer,
        the selection, the target pass and the loss are not rerun.
        """
        if torch._C._current_graph_task_id() == -1:
            raise RuntimeError(
                "a SparseContext serves one forward pass: build a new one for every forward "
                "(a second call for a layer is only expected from activation checkpointing, during backward)"
            )
        if torch.is_grad_enabled() and not rec.grad_enabled:
            raise RuntimeError(
                "reentrant activation checkpointing runs the first pass without gradients, so the scorer "
                "would get none: use gradient_checkpointing_kwargs={'use_reentrant': False}"
            )
        need_lse = rec.need_lse and self.executor == "flex"  # flex: the same kernel call as the first pass
        out, _ = self.run(q, k, v, rec.evict, scale, need_lse=need_lse, layer_key=key, gate_bias=rec.gate_bias, age_scaled=rec.age_scaled)
        return out.transpose(1, 2).contiguous()


def kvpop_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kvpop_ctx: SparseContext | None = None, **kwargs):
    """The ``attn_implementation="kvpop"`` entry point that transformers calls in every layer."""
    if kvpop_ctx is None:
        raise RuntimeError(
            "a model with attn_implementation='kvpop' needs `kvpop_ctx=SparseContext(...)` in its forward call"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kvpop_ctx.attend(module.layer_idx, query, key, value, scale), None


def register() -> str:
    """Register the ``kvpop`` attention (idempotent); returns its name.

    No mask function is registered with it: the pattern is the context's, and transformers (``masking_utils``)
    prepares no mask for an implementation without one. With one registered, every forward that passes
    ``position_ids`` without a mask would look for packed rows in them and read the answer on the host
    (``find_packed_sequence_indices``): a synchronization in every training forward and in every chunk of
    :func:`kvpop.pool.pool_chunked`, which CUDA-graph capture skips, so a captured pass would differ from the eager one
    (``train.pool_graphs`` refused both pool policies on an H100 for it, 2026-12-07)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpop_attention_forward)
    return ATTN_IMPLEMENTATION
