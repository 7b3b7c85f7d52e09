"""``dense``: no eviction, the teacher's own pattern (causal within each document)."""

from __future__ import annotations

from kvpop.policies.base import Policy


class Dense(Policy):
    name = "dense"
    evicts = False

    def scores(self, layer, keys, values, pos, **_):
        return None
