"""``kvpop_mlp``: an MLP per (layer, KV head) on the token's key and value, plus a learned decay."""

from __future__ import annotations

from kvpop.policies.base import FusedScorer, Policy, ScorerSpec, Scores
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

    def fused_scorer(self, layer):
        mlp, decay = self.scorer.layers[layer], self.scorer.decay
        two_d, hidden = mlp.w1.shape[1:]
        if decay.share > 0 or not all(n & (n - 1) == 0 for n in (two_d // 2, hidden)):  # the share's scale; Triton's powers of two
            return None
        return FusedScorer("mlp", mlp.w1, mlp.b1, mlp.w2, mlp.b2, decay.log_gamma(layer))
