"""``tova`` (Oren et al., 2024): drop the token the current query attends to least.

Priority of a slot = attention from the latest query (mean over the KV head's query group); the
window protects the most recent tokens, and the leaver replaces the least-attended long-range slot
iff it got at least as much attention. Decode-only: it needs each step's attention weights.
"""

from __future__ import annotations

from kvpop.policies.base import AttentionRule


class TOVA(AttentionRule):
    name = "tova"

    def slot_scores(self, prio, attn):
        return attn[:, :, -1]  # (B, Hk, T)
