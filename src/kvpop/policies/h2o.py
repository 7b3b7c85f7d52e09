"""``h2o`` (Zhang et al., 2023): the recent window plus the heavy hitters, the tokens with the
largest attention accumulated over all queries since they entered the cache. Decode-only."""

from __future__ import annotations

from kvpop.policies.base import AttentionRule


class H2O(AttentionRule):
    name = "h2o"

    def slot_scores(self, prio, attn):
        return prio + attn.sum(2)  # (B, Hk, T)
