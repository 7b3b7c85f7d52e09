"""``streaming_llm`` (Xiao et al., 2024) and ``streaming_llm_plus``: sinks plus the most recent tokens.

Priority = position, so the newest tokens rank first and the pattern is sinks + the last
``budget - sinks`` tokens. ``streaming_llm`` runs on the base model; ``streaming_llm_plus`` is the
same pattern with a student fine-tuned under it (the trained recency baseline).
"""

from __future__ import annotations

import torch

from kvpop.policies.base import FusedScorer, Policy, Scores


class StreamingLLM(Policy):
    name = "streaming_llm"

    def scores(self, layer, keys, values, pos, **_):
        B, Hk = keys.shape[:2]
        return Scores(prio=pos[:, None, :].expand(B, Hk, -1).to(torch.float64))  # (B, Hk, S)

    def fused_scorer(self, layer):
        return FusedScorer("position")


class StreamingLLMPlus(StreamingLLM):
    name = "streaming_llm_plus"
    trained = True
