"""``OnePool``: a policy's static per-head priorities ranked with one pool of slots for the whole model.

A per-head policy keeps the ``k`` long-range tokens of highest static priority in each KV head.
Ranked instead with one pool of ``L x Hk x k`` long-range entries, as ``dbtrimkv``'s budget
(:func:`kvpop.selection.global_decaying_eviction_times` with ``decays=False``: when token
``t - window`` leaves every layer's window, its ``L x Hk`` entries and the pool's compete by their
static priorities, and the ``L x Hk`` lowest go), a head whose tokens score high takes slots from
heads whose tokens score low. The total of cached entries is unchanged (``budget x L x Hk``).

This wrapper is the one door to the pool for a policy that was not trained in it: the learned
``kvpop_mlp`` and the ceilings ``oracle_target`` and ``oracle_sources`` (whose priorities are fixed
per trace: ``OnePool(oracle)`` is the ceiling of the same ranking under one budget).
``dbtrimkv``, whose gate decays and is trained in the pool, declares the capability itself
(``one_pool = True``). Readers ask the capability ``one_pool``, never the class.

For a learned scorer the priorities must mean the same in every head: the boundary loss ranks
within a head and leaves each head's offset free, the calibration term
(``train.scorer_calibration``) ties the raw score to the target's scale. Measured: BENCHMARKS.md,
"A fitted KVpop scorer under one pool".

Runs where every ``one_pool`` policy runs: the teacher-forced fixed point and decoding with
:class:`kvpop.decode.one_pool.OnePoolCache` (why the two agree: :mod:`kvpop.decode.one_pool`);
an oracle, teacher-forced only. Training stays per head (the wrapped policy's pattern): the
pool's pattern of a training forward would need the fixed point at every step.

Only priorities fixed when a token enters (or, for an oracle, fixed per trace) can be ranked so:
the delayed mLSTM (``kvpop``) scores a token from the keys of its whole window, which the pool's
chunked forward cannot know in time; it is refused, as are rules that decay, gate or read attention
(:meth:`OnePool.accepts`). Its pool form is ``kvpop_pool`` (:mod:`kvpop.policies.kvpop_pool`): the
mLSTM read out ``d < window`` tokens after the token, trained in the pool.
"""

from __future__ import annotations

from torch import Tensor

from kvpop.geometry import CacheLayout
from kvpop.policies.base import Policy, Scores
from kvpop.scorer import layer_view

#: what a policy ranked with one pool adds to its name (``"kvpop_mlp, one pool"``)
ONE_POOL_SUFFIX = ", one pool"


class OnePool(Policy):
    """``policy``'s static priorities under one pool of slots for the whole model (module docstring).

    The instance declares ``oracle`` and ``trained`` as its policy does (an oracle stays
    teacher-forced only; a trained one runs on its export's model)."""

    layer_independent = False
    one_pool = True

    def __init__(self, policy: Policy):
        super().__init__()
        if not self.accepts(policy):
            raise ValueError(
                f"OnePool ranks static per-head priorities (a learned kvpop_mlp, oracle_target, oracle_sources), not {policy.name!r}: "
                f"{self.refusal(policy)}"
            )
        self.policy = policy
        self.name = policy.name + ONE_POOL_SUFFIX  # shadows the class's name: the label of tables and errors
        self.oracle, self.trained = policy.oracle, policy.trained  # shadow the class's False

    @staticmethod
    def refusal(policy: Policy) -> str | None:
        """Why one pool cannot rank ``policy``'s priorities (None: it can)."""
        if policy.one_pool:
            return "it already ranks with one pool"
        for cap, why in (("needs_attention", "it re-scores from attention at decode time"),
                         ("scores_on_exit", "it scores a token when it leaves the window, from a recurrent state"),
                         ("decays", "its ranks fall with age"), ("gated", "a gate trained through the distillation loss decides")):
            if getattr(policy, cap):
                return f"{why} ({cap})"
        if not (policy.learned or policy.oracle):
            return "it has no learned or oracle priorities (a fixed rule ranks the same in every head)"
        return None

    @classmethod
    def accepts(cls, policy: Policy) -> bool:
        """Static per-head priorities, learned or an oracle's: not ``one_pool`` already, and none of
        ``scores_on_exit``, ``decays``, ``gated``, ``needs_attention`` (works on a class too)."""
        return cls.refusal(policy) is None

    def long_range_slots(self, layout: CacheLayout, *, head_dim: int) -> int:
        return self.policy.long_range_slots(layout, head_dim=head_dim)

    def all_layers(self, graph: bool = False) -> Policy | None:
        inner = self.policy.all_layers(graph)
        return None if inner is None else layer_view(self, modules={"policy": inner})

    def scores(self, layer: int, keys: Tensor, values: Tensor, pos: Tensor, **kw) -> Scores:
        return Scores(prio=self.policy.scores(layer, keys, values, pos, **kw).prio.detach())  # (B, Hk, S) float64

    def teacher_target(self) -> tuple[str, float] | None:
        return self.policy.teacher_target()

    def fit_trace(self, *, input_ids: Tensor, record: dict, targets: dict) -> bool:
        return self.policy.fit_trace(input_ids=input_ids, record=record, targets=targets)
