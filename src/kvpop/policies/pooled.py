"""``one_pool``: a per-head scorer's own static priorities, ranked with one pool of slots for the whole model.

``kvpop_mlp`` keeps the ``k`` long-range tokens of highest static priority in each KV head. Ranked
instead with one pool of ``L x Hk x k`` long-range entries, as ``dbtrimkv``'s budget
(:func:`kvpop.selection.global_decaying_eviction_times` with ``decays=False``: when token
``t - window`` leaves every layer's window, its ``L x Hk`` entries and the pool's compete by their
static priorities, and the ``L x Hk`` lowest go), a head whose tokens score high takes slots from
heads whose tokens score low. The total of cached entries is unchanged (``budget x L x Hk``).

The priorities must then mean the same in every head: the boundary loss ranks within a head and
leaves each head's offset free, the calibration term (``train.scorer_calibration``) ties the raw
score to the target's scale. Measured: BENCHMARKS.md, "A fitted KVpop scorer under one pool".

Runs where every ``global_budget`` policy runs: the teacher-forced fixed point
(:func:`kvpop.evaluate.captured_forward`, :func:`kvpop.evaluate.evaluate_fidelity`) and decoding
with :class:`kvpop.decode.pool.SharedPoolCache`. Training stays per head (the wrapped policy's
pattern): the pool's pattern of a training forward would need the fixed point at every step.

Only a scorer whose priority of a token is fixed when the token enters (``kvpop_mlp``) can be
ranked so here: the delayed mLSTM (``kvpop``) scores a token from the keys of its whole window, so
the fixed point's argument (the pattern at query ``t`` reads only scores settled by patterns at
earlier queries) would need its own proof and test; it is refused until then.
"""

from __future__ import annotations

from torch import Tensor

from kvpop.geometry import CacheLayout
from kvpop.policies.base import Policy, Scores


class OnePool(Policy):
    """``policy``'s static priorities under one pool of slots for the whole model (module docstring)."""

    layer_independent = False
    global_budget = True

    def __init__(self, policy: Policy):
        super().__init__()
        if not self.accepts(policy):
            raise ValueError(f"one_pool ranks a learned per-head policy's static priorities (kvpop_mlp), not {policy.name!r}")
        self.policy = policy
        self.name = f"{policy.name}, one pool"  # shadows the class's name: the label of tables and errors

    @staticmethod
    def accepts(policy: Policy) -> bool:
        """Whether ``policy`` has static per-head priorities that one pool can rank (module docstring)."""
        return (policy.learned and not policy.global_budget
                and not any((policy.scores_on_exit, policy.decays, policy.gated, policy.needs_attention)))

    def long_range_slots(self, layout: CacheLayout, *, head_dim: int) -> int:
        return self.policy.long_range_slots(layout, head_dim=head_dim)

    def scores(self, layer: int, keys: Tensor, values: Tensor, pos: Tensor, **kw) -> Scores:
        return Scores(prio=self.policy.scores(layer, keys, values, pos, **kw).prio.detach())  # (B, Hk, S) float64


def one_pool(policy: Policy) -> OnePool:
    """A learned per-head policy (``kvpop_mlp``) ranked with one pool of slots for the whole model."""
    return OnePool(policy)
