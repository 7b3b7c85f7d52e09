"""``kvpop_mlp``: an MLP per (layer, KV head) on the token's key and value, plus a learned decay."""

from __future__ import annotations

from kvpop.policies.base import Policy, ScorerSpec, Scores
from kvpop.scorer import MLPScorer


class KvpopMLP(Policy):
    name = "kvpop_mlp"
    learned = True
    trained = True
    layer_independent = False

    def __init__(self, scorer: MLPScorer):
        super().__init__()
        self.scorer = scorer

    @classmethod
    def build(cls, spec: ScorerSpec) -> KvpopMLP:
        return cls(MLPScorer(spec.num_layers, spec.num_kv_heads, spec.head_dim, hidden=spec.hidden, recency=spec.recency,
                             recency_space=spec.recency_space))

    def scores(self, layer, keys, values, pos, **_):
        r_hat = self.scorer.raw_scores(layer, keys, values)  # (B, Hk, S)
        log_gamma = self.scorer.decay.log_gamma(layer)  # (Hk,)
        return Scores(prio=self.scorer.decay.priority(layer, r_hat, pos), r_hat=r_hat, log_gamma=log_gamma)
