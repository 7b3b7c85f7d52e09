"""The one interface of every eviction policy: declared capabilities plus scoring hooks.

A policy gives every cached token a priority per KV head (higher is kept longer); the shared
selection keeps, per KV head, the ``sinks`` first tokens, the ``window`` most recent ones and the
``k`` long-range tokens of highest (priority, recency). A policy overrides the hooks its
capabilities call for, and orchestration (training, the evaluation, both decode paths) reads the
capabilities, never the concrete class:

============================  ==========================================================================
capability                    meaning
============================  ==========================================================================
``evicts``                    False: dense attention, nothing is ever evicted (``dense``)
``learned``                   has a scorer trained by the boundary loss (``scorer`` attribute)
``trained``                   the student model is fine-tuned under the policy: it needs an export folder
``layer_independent``         the same priorities in every layer (the pattern is computed once)
``needs_attention``           re-scored from each decode step's attention weights (:meth:`slot_scores`);
                              no full-sequence pattern, so decode-only (TOVA, H2O)
``scores_on_exit``            scored from a recurrent state when a token leaves the window (the delayed
                              mLSTM): the recurrent hooks below
``chunked_prefill``           (with ``scores_on_exit``) :meth:`prefill_chunk` reads a chunk in closed form
``gated``                     (with ``learned``) a gate trained through the distillation loss, not the
                              boundary loss: in training, attention adds the bias of :meth:`relax` to tokens
                              past the window, and the trainer adds :meth:`gate_loss` (``dms``, ``trimkv``)
``decays``                    a slot's rank falls with its age: at query t a token scores
                              ``(t - pos) * prio`` (``prio = log beta <= 0``), re-ranked at every step, so
                              no static order exists; its pattern comes from a simulation of the cache
                              (:func:`kvpop.selection.decaying_eviction_times`; ``trimkv``)
``one_pool``                  one pool of ``L x Hk x k`` long-range slots for every layer and KV head
                              instead of ``k`` per head: the pattern is a simulation over all layers at once
                              (:func:`kvpop.selection.global_decaying_eviction_times`), a teacher-forced
                              forward its fixed point, decoding :class:`kvpop.decode.one_pool.OnePoolCache`
                              (:mod:`kvpop.decode.one_pool`); ``dbtrimkv``, ``kvpop_mlp_pool``, ``kvpop_pool``
                              (trained in it), or any policy with static priorities wrapped in
                              :class:`kvpop.policies.OnePool`
============================  ==========================================================================

Hooks:

* :meth:`scores` -- the full-sequence pattern (training, teacher-forced evaluation, prefill):
  ``(layer, keys, values, pos) -> Scores`` with a static priority per token;
* :meth:`token_scores` -- a static rule at decode time, when a token enters the cache
  (``scores(...).prio`` unless overridden);
* :meth:`slot_scores` -- an attention rule, after every decode step;
* :meth:`init_state`, :meth:`step`, :meth:`exit_scores`, :meth:`prefill`, :meth:`prefill_chunk`
  -- a delayed rule;
* :meth:`read_delay`, :meth:`score_stream` -- a static priority that reads ``d < window`` tokens past its
  own (``kvpop_pool``: ready before the token leaves the window; decoded with the recurrent hooks above);
* :meth:`relax`, :meth:`gate_loss` -- ``gated``: the differentiable relaxation of the gate in
  training, and its budget loss;
* :meth:`long_range_slots` -- ``k`` at a nominal budget (a stateful rule spends slots on its state).

Shapes: B batch, Hk KV heads, Q queries, S sequence, T cache slots, D head dim.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from kvpop.geometry import CacheLayout
from kvpop.scorer import layer_view


@dataclass
class Scores:
    prio: Tensor  # (B, Hk, S) static priority, higher is kept longer
    r_hat: Tensor | None = None  # (B, Hk, S) raw learned score, with the scorer's graph
    log_gamma: Tensor | None = None  # (Hk,) with the decay's graph


@dataclass
class GateRelaxation:
    """One layer's relaxed gate in training (``gated`` policies, :meth:`Policy.relax`)."""

    bias: Tensor  # (B, Hk, S) attention-logit bias of a token once it left the window, with the gate's graph
    prio: Tensor | None = None  # (B, Hk, S) float64 detached: the training pattern's priorities (None: no eviction in training)
    age_scaled: bool = False  # the bias counts (q - kv) times (a decay per step of age), else once
    evict_prob: Tensor | None = None  # (B, Hk, S) relaxed eviction probability (dms)
    log_beta: Tensor | None = None  # (B, Hk, S) log retention per step of age (trimkv)


@dataclass(frozen=True)
class ScorerSpec:
    """What a learned policy's scorer is built from: the model's shape and the scorer's sizes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden: int = 64  # kvpop_mlp: hidden width of the MLP
    d_k: int = 16  # kvpop: the mLSTM memory's key dim
    d_v: int = 16  # kvpop: the mLSTM memory's value dim
    forget_gate: str = "sigmoid"  # kvpop: "sigmoid" or "exp"
    recency: float = 0.0  # kvpop_mlp, kvpop: fixed extra age decay per token (kvpop.scorer)
    recency_space: str = "log"  # what it is subtracted from: "log" (r_hat) or "share" (exp(r_hat); kvpop.scorer)
    delay: int | None = None  # kvpop_pool: tokens after j that j's score reads (None: window // 2)


class Policy(nn.Module):
    """Base class: the pattern is sinks + window + top-k of the eligible tokens by priority."""

    name: ClassVar[str] = "policy"
    evicts: ClassVar[bool] = True
    learned: ClassVar[bool] = False
    trained: ClassVar[bool] = False
    layer_independent: ClassVar[bool] = True
    needs_attention: ClassVar[bool] = False
    scores_on_exit: ClassVar[bool] = False
    chunked_prefill: ClassVar[bool] = False
    gated: ClassVar[bool] = False
    decays: ClassVar[bool] = False
    #: the long-range slots of every layer and KV head form one pool: a layer's pattern depends on every
    #: layer's scores (``dbtrimkv``, :class:`kvpop.policies.OnePool`)
    one_pool: ClassVar[bool] = False
    #: False: training leaves the student model frozen (the gate alone learns; ``trimkv``)
    trains_model: ClassVar[bool] = True
    #: priorities from the evaluated trace's own future (a ceiling): teacher-forced evaluation only,
    #: never trained or decoded; :meth:`fit_trace` sees each trace first
    oracle: ClassVar[bool] = False

    #: the capabilities, in the order the registry and the README list them
    CAPABILITIES: ClassVar[tuple[str, ...]] = (
        "evicts", "learned", "trained", "layer_independent", "needs_attention", "scores_on_exit", "gated", "decays", "one_pool", "oracle",
    )

    #: ``one_pool``: long-range entries each (layer, KV head) keeps at least (:attr:`kvpop.geometry.CacheLayout.floor`;
    #: 0: the pool alone decides, ``k``: the per-head rule); set by :meth:`with_floor`
    pool_floor: int = 0

    def with_floor(self, floor: int) -> Policy:
        """This policy (its weights shared) ranked in its pool with a per-head ``floor``: no (layer, KV head)
        pair keeps fewer than ``floor`` long-range entries (:func:`kvpop.selection.global_eviction_times`).
        A ValueError for a policy without one pool, or a negative floor."""
        if not self.one_pool:
            raise ValueError(f"a per-head floor ranks one pool of slots; {self.name!r} keeps k per head already")
        if floor < 0:
            raise ValueError(f"a per-head floor must be >= 0; got {floor}")
        twin = copy.copy(self)  # the modules, parameters and buffers are this policy's own
        twin.pool_floor = int(floor)
        return twin

    @classmethod
    def build(cls, spec: ScorerSpec) -> Policy:
        """A fresh policy for a model (learned ones start from an untrained scorer)."""
        return cls()

    @classmethod
    def capabilities(cls) -> dict[str, bool]:
        return {c: bool(getattr(cls, c)) for c in cls.CAPABILITIES}

    def long_range_slots(self, layout: CacheLayout, *, head_dim: int) -> int:
        """k at the nominal ``layout``: ``budget - sinks - window`` unless the rule spends slots on a state."""
        return layout.long_range

    # --- the full-sequence pattern -----------------------------------------------------------------
    def scores(self, layer: int, keys: Tensor, values: Tensor, pos: Tensor, *, doc_ids: Tensor | None = None, window: int | None = None) -> Scores | None:
        """keys, values (B, Hk, S, D), pos (B, S) -> priorities; None for a policy that never evicts.

        ``doc_ids`` (B, S) and ``window`` are given for scorers that read beyond the token itself
        (the delayed mLSTM); the others ignore them."""
        raise NotImplementedError(f"policy {self.name!r} has no full-sequence pattern (needs_attention: decode only)")

    def teacher_target(self) -> tuple[str, float] | None:
        """``oracle``: the (kind, beta) of :func:`kvpop.target.future_attention_target` (a
        :class:`~kvpop.target.TargetSpec`'s) whose dense-teacher values :meth:`fit_trace` needs, or None."""
        return None

    def fit_trace(self, *, input_ids: Tensor, record: dict, targets: dict) -> bool:
        """``oracle``: look at the evaluated trace (input_ids (1, S), its filter record, the dense
        teacher's targets ``{(kind, beta): per-layer (1, Hk, S)}`` of the kinds the oracles asked
        for) before the forward that scores it; False if the trace lacks what the oracle needs (it
        is then skipped)."""
        raise NotImplementedError(f"policy {self.name!r} is not an oracle")

    def relax(self, x: Tensor, *, tau: float, generator: torch.Generator | None = None, noise: bool = True) -> GateRelaxation:
        """``gated``: gate logits x (B, Hk, S) (``scores(...).r_hat``, with their graph) -> the layer's
        :class:`GateRelaxation` in training."""
        raise NotImplementedError(f"policy {self.name!r} has no gate")

    def gate_loss(self, relaxations: list[GateRelaxation], *, doc_ids: Tensor, pos: Tensor, layout: CacheLayout,
                  weight: float, ramp: float, progress: float) -> tuple[Tensor, dict[str, Tensor]]:
        """``gated``: the gate's budget loss over every layer's relaxation (weighted by ``weight``; ``ramp``:
        the share of training over which it ramps up; ``progress``: the share of training done) and the
        values to log, ``{name: scalar}``."""
        raise NotImplementedError(f"policy {self.name!r} has no gate")

    # --- decode-time hooks -------------------------------------------------------------------------
    def for_layer(self, layer: int) -> Policy | None:
        """This rule's layer ``layer`` as a one-layer rule, to be called with layer index 0; None if it
        has no such form.

        Code compiled once and run for every layer (:class:`kvpop.decode.DecodeEngine`'s per-layer
        compile) must not index the layer by a Python int, or it compiles once per layer. A learned
        rule's view shares everything but its ``scorer``, a one-layer view of it (``scorer.one_layer``:
        parameters are views of this rule's storage, so the view follows in-place updates); a rule
        whose scores do not depend on the layer is its own view."""
        one_layer = getattr(getattr(self, "scorer", None), "one_layer", None)
        if one_layer is not None:
            return layer_view(self, modules={"scorer": one_layer(layer)})
        return self if self.layer_independent else None

    def all_layers(self, graph: bool = False) -> Policy | None:
        """This rule's every layer as one layer of ``L x Hk`` KV heads, layer ``l``'s at ``l Hk .. (l + 1) Hk - 1``,
        to be called with layer index 0 on every layer's keys and values stacked that way (B, L x Hk, S, D); None
        if it has no such form. The chunked pool forward (:mod:`kvpop.pool`) scores a chunk's layers in one call with
        it, and a pool policy's training forward its every layer once the forward has run (``graph``: its gradients
        reach each layer's parameters); a learned rule's view shares everything but its ``scorer``, whose
        ``all_layers`` stacks the layers' networks (:func:`kvpop.scorer.all_layers_scorer`: copies of the parameters)."""
        all_layers = getattr(getattr(self, "scorer", None), "all_layers", None)
        return layer_view(self, modules={"scorer": all_layers(graph)}) if all_layers is not None else None

    def read_delay(self, window: int) -> int | None:
        """How many tokens after token ``j`` its static priority reads, at this ``window``: None (every
        rule but one) when it is fixed from the token's own key and value as it enters; ``d`` for
        ``kvpop_pool``'s delayed mLSTM, which reads the keys and values up to ``j + d`` (``0 <= d < window``),
        so that the score is ready at step ``j + d``, before the token leaves the window. The chunked pool
        forward then runs chunks of ``window - d`` (:mod:`kvpop.pool`), decoding reads token ``p - d``
        out of the recurrent state (:meth:`init_state`, :meth:`step`, :meth:`exit_scores` at step
        ``j + d``, :meth:`prefill`; :class:`kvpop.decode.OnePoolCache`)."""
        return None

    def score_stream(self, layer: int, doc_ids: Tensor, pos: Tensor, *, window: int):
        """``read_delay`` not None: layer ``layer``'s scores in a chunked forward over rows doc_ids, pos (B, S),
        an object whose ``feed(keys, values)`` takes the next chunk (B, Hk, C, D) and returns (priority
        (B, Hk, R) float64 of tokens ``r0 .. r0 + R - 1``, r0, read (B, R) bool: those scored now)."""
        raise NotImplementedError(f"policy {self.name!r} has no delayed static priority")

    def token_scores(self, layer: int, keys: Tensor, values: Tensor, pos: Tensor) -> Tensor:
        """A static rule: entering tokens keys, values (B, Hk, S, D) at absolute positions pos (B, S)
        -> priority (B, Hk, S), fixed from then on."""
        return self.scores(layer, keys, values, pos).prio

    def fused_scorer(self, layer: int) -> FusedScorer | None:
        """A static rule's priority of a token in layer ``layer`` in the form the engine's fused insert
        kernel computes (:class:`FusedScorer`), or None: the engine then runs its tensor code."""
        return None

    def slot_scores(self, prio: Tensor, attn: Tensor) -> Tensor:
        """``needs_attention``: prio (B, Hk, T), attn (B, Hk, Q, T) weights of Q consecutive queries
        (mean over each KV head's query group; zero on future and empty slots) -> priorities (B, Hk, T)."""
        raise NotImplementedError(f"policy {self.name!r} does not re-score from attention")

    def init_state(self, layer: int, B: int, device) -> tuple[Tensor, ...]:
        """``scores_on_exit``: an empty recurrent state of one layer (tensors with leading dim B)."""
        raise NotImplementedError(f"policy {self.name!r} keeps no recurrent state")

    def step(self, layer: int, state: tuple, k_t: Tensor, v_t: Tensor) -> tuple[Tensor, ...]:
        """``scores_on_exit``: write the entering token k_t, v_t (B, Hk, D) -> the new state."""
        raise NotImplementedError(f"policy {self.name!r} keeps no recurrent state")

    def exit_scores(self, layer: int, state: tuple, k_t: Tensor, v_t: Tensor, pos: int | Tensor) -> Tensor:
        """``scores_on_exit``: priority (B, Hk) float64 of token ``pos`` (k_t, v_t (B, Hk, D)) as it
        leaves the window; ``state`` has read tokens ``0 .. pos + window`` (a policy with a ``read_delay``
        ``d``: called at step ``pos + d``, the state having read ``0 .. pos + d``)."""
        raise NotImplementedError(f"policy {self.name!r} keeps no recurrent state")

    def prefill(self, layer: int, keys: Tensor, values: Tensor, pos: Tensor, *, window: int) -> tuple[Tensor, tuple]:
        """``scores_on_exit``: a prompt keys, values (B, Hk, S, D), pos (B, S) -> (priority (B, Hk, S),
        state after token S - 1). Priorities must be exact for tokens ``t <= S - 1 - window``; the
        others are placeholders (finite), scored again when they leave."""
        raise NotImplementedError(f"policy {self.name!r} keeps no recurrent state")

    def prefill_chunk(self, layer: int, state: tuple, keys: Tensor, values: Tensor, rk: Tensor, rv: Tensor, rpos: Tensor, tau: Tensor) -> tuple[Tensor, tuple]:
        """``chunked_prefill``: read C tokens keys, values (B, Hk, C, D) into ``state`` and score the
        R tokens rk, rv (B, Hk, R, D) at positions rpos (R,) that leave the window meanwhile, each
        after the chunk's tokens ``0 .. tau`` (R,) -> (priority (B, Hk, R) float64, new state)."""
        raise NotImplementedError(f"policy {self.name!r} has no chunked prefill")



class FusedScorer(NamedTuple):
    """A static rule's priority of a token in the form of the engine's fused insert kernel
    (:mod:`kvpop.kernels.insert`): ``kind`` "position" (the token's position, ``streaming_llm``) or
    "mlp" (``kvpop_mlp``: per KV head ``w2 . silu(w1^T [k; v] + b1) + b2`` in float32, then
    ``- pos * log_gamma`` in float64)."""

    kind: str
    w1: Tensor | None = None  # (Hk, 2D, F) float32
    b1: Tensor | None = None  # (Hk, F)
    w2: Tensor | None = None  # (Hk, F)
    b2: Tensor | None = None  # (Hk,)
    log_gamma: Tensor | None = None  # (Hk,) float64


class AttentionRule(Policy):
    """Base of the rules re-scored from each decode step's attention (``needs_attention``): a token
    enters with priority 0 and :meth:`slot_scores` folds every later query's weights in."""

    needs_attention = True
    layer_independent = False

    def token_scores(self, layer, keys, values, pos):
        return torch.zeros(keys.shape[:3], dtype=torch.float64, device=keys.device)  # (B, Hk, S)
