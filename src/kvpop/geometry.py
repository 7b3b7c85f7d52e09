"""The geometry of a bounded cache, validated once: where each token of a KV head lives.

Per layer and KV head the cache holds ``slots = sinks + window + long_range`` entries::

    slots [0, sinks)                          the first ``sinks`` tokens (kept forever)
    slots [sinks, sinks + window)             a ring over the ``window`` most recent tokens
    slots [sinks + window, slots)             ``long_range`` slots, filled by eviction

``budget`` is the nominal budget. ``CacheLayout(budget, sinks, window)`` is the nominal layout
(``long_range = budget - sinks - window``); :meth:`CacheLayout.for_policy` is the one a policy runs
with (:meth:`kvpop.policies.Policy.long_range_slots`: fewer slots for a policy whose recurrent
state takes memory). The masked forward, the training losses, the reference cache, the fast engine
and its bench all read the geometry from this one object; tokens are placed with
:meth:`CacheLayout.home_slot`.

:func:`check_budget` is the one budget rule, used by ``kvpop.config.Params``, the ``kvpop`` command
line, every :class:`CacheLayout` and the mLSTM's slot count (:func:`kvpop.mlstm.kvpop_k`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

NEG_INF = float("-inf")  # the priority of an empty slot


def check_budget(budget: int, sinks: int, window: int, *, min_long_range: int = 1, state: int = 0) -> None:
    """The one budget rule: ``window >= 1``, ``sinks >= 0`` and ``budget - sinks - window - state >=
    min_long_range``; a ValueError naming ``budget``, ``sinks`` and ``window`` otherwise.

    ``min_long_range=1`` (the default) is the pipeline's rule: a scorer is trained and evaluated, so
    at least one long-range slot must exist. A cache that only decodes may hold sinks and window
    alone (``min_long_range=0``, what every :class:`CacheLayout` checks). ``state``: the slots a
    recurrent state takes out of the budget (:func:`kvpop.mlstm.kvpop_k`)."""
    if window < 1 or sinks < 0:
        raise ValueError(f"need window >= 1 and sinks >= 0; got sinks {sinks}, window {window}")
    if budget - sinks - window - state < min_long_range:
        terms = ["sinks", "window"] + ["state"] * bool(state) + [str(min_long_range)] * bool(min_long_range)
        nums = [sinks, window] + [state] * bool(state) + [min_long_range] * bool(min_long_range)
        why = f" (at least {min_long_range} long-range slot{'s' * (min_long_range > 1)})" if min_long_range else ""
        state_note = f"; state: the {state} slots of the recurrent state" if state else ""
        raise ValueError(f"budget ({budget}) must be >= {' + '.join(terms)} = {' + '.join(map(str, nums))}{why}{state_note}")


@dataclass(frozen=True)
class CacheLayout:
    """Sinks, window and long-range slots of one KV head at a nominal ``budget``; ``long_range``
    defaults to the whole rest, ``budget - sinks - window``."""

    budget: int  # nominal entries per KV head
    sinks: int
    window: int
    long_range: int | None = None  # long-range slots k; None: budget - sinks - window
    floor: int = 0  # one pool (one_pool policies): long-range entries each KV head keeps at least, of its k; per-head caches ignore it

    def __post_init__(self):
        check_budget(self.budget, self.sinks, self.window, min_long_range=0)
        if self.long_range is None:
            object.__setattr__(self, "long_range", self.budget - self.sinks - self.window)
        if self.long_range < 0:
            raise ValueError(f"long_range must be >= 0; got {self.long_range}")
        if not 0 <= self.floor <= self.long_range:
            raise ValueError(f"floor (long-range entries each KV head keeps at least under one pool) must be in [0, long_range = {self.long_range}]; "
                             f"got {self.floor}")

    @classmethod
    def of(cls, *, sinks: int, window: int, long_range: int) -> CacheLayout:
        """The layout of ``long_range`` slots with no state: budget ``sinks + window + long_range``."""
        return cls(sinks + window + long_range, sinks, window, long_range)

    def for_policy(self, policy, *, head_dim: int) -> CacheLayout:
        """The layout a policy decodes and trains with at this layout's nominal budget."""
        long_range = policy.long_range_slots(self.nominal, head_dim=head_dim)
        if not 0 <= long_range <= self.budget - self.sinks - self.window:
            raise ValueError(f"policy {policy.name!r} asks for {long_range} long-range slots at budget {self.budget}")
        floor = policy.pool_floor
        if floor > long_range:
            raise ValueError(f"policy {policy.name!r} has a per-head floor of {floor} long-range entries, more than its {long_range} at budget {self.budget}")
        return replace(self, long_range=long_range, floor=floor)

    @property
    def nominal(self) -> CacheLayout:
        """The layout at this budget with every remaining slot long-range (no floor)."""
        return replace(self, long_range=None, floor=0)

    @property
    def slots(self) -> int:
        """Entries stored per layer and KV head."""
        return self.sinks + self.window + self.long_range

    @property
    def first_long_range(self) -> int:
        return self.sinks + self.window

    def home_slot(self, pos: int | Tensor) -> int | Tensor:
        """The slot of a sink or window token at position(s) ``pos``: the sinks first, then the ring
        (``sinks + (pos - sinks) % window``); long-range slots are assigned by eviction."""
        if isinstance(pos, Tensor):
            return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks).remainder(self.window))
        return pos if pos < self.sinks else self.sinks + (pos - self.sinks) % self.window

    def fixed_tokens(self, S: int, device=None) -> Tensor:
        """The sink and window tokens after an ``S``-token prompt, the ones in their home slots: (n,) int64."""
        return torch.cat([torch.arange(min(self.sinks, S), device=device),
                          torch.arange(min(S, max(self.sinks, S - self.window)), S, device=device)])
