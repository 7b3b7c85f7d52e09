"""The geometry of a bounded cache, validated once: where each token of a KV head lives.

Per layer and KV head the cache holds ``slots = sinks + window + long_range`` entries::

    slots [0, sinks)                          the first ``sinks`` tokens (kept forever)
    slots [sinks, sinks + window)             a ring over the ``window`` most recent tokens
    slots [sinks + window, slots)             ``long_range`` slots, filled by eviction

``budget`` is the nominal budget; ``long_range`` is what the policy takes at it
(:meth:`kvpop.policies.Policy.long_range_slots`: ``budget - sinks - window``, fewer for a policy
whose recurrent state takes memory). The reference cache, the fast engine and its bench all place
tokens with :meth:`CacheLayout.home_slot`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")  # the priority of an empty slot


def check_geometry(budget: int, sinks: int, window: int) -> None:
    """A ValueError naming the numbers unless ``window >= 1``, ``sinks >= 0`` and ``budget >= sinks + window``."""
    if window < 1 or sinks < 0 or budget < sinks + window:
        raise ValueError(f"need window >= 1, sinks >= 0 and budget >= sinks + window; got budget={budget}, sinks={sinks}, window={window}")


@dataclass(frozen=True)
class CacheLayout:
    budget: int  # nominal entries per KV head
    sinks: int
    window: int
    long_range: int  # long-range slots k

    @classmethod
    def for_policy(cls, policy, *, budget: int, sinks: int, window: int, head_dim: int) -> CacheLayout:
        """The layout a policy decodes with at a nominal budget."""
        check_geometry(budget, sinks, window)
        long_range = policy.long_range_slots(budget=budget, sinks=sinks, window=window, head_dim=head_dim)
        if not 0 <= long_range <= budget - sinks - window:
            raise ValueError(f"policy {policy.name!r} asks for {long_range} long-range slots at budget {budget}")
        return cls(budget, sinks, window, long_range)

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
