"""``kvpop_mlp_pool``: KVpop's MLP scorer trained in the pool it runs in, one pool of slots for the whole model.

The scorer is ``kvpop_mlp``'s (an MLP per (layer, KV head) on the token's key and value, a learned
decay per head, the priority fixed when the token enters). What differs is the budget and the
training, which now match:

* **One pool** (``one_pool``): the ``L x Hk x k`` long-range entries of every layer and KV head
  compete together (:mod:`kvpop.decode.one_pool`): when a token leaves the window, its ``L x Hk``
  entries and the pool's compete by their static priorities and the ``L x Hk`` lowest go.
* **Trained as it runs.** Each step first runs the student, without gradients, through the pool's
  exact chunked forward (:func:`kvpop.pool.pool_chunked`) to get every layer's eviction times under
  the current scorer; the differentiable forward then runs under exactly those times, so the model's
  KL is taken under the pool's pattern. The scorer's loss is the pool's boundary loss
  (:func:`kvpop.boundary.pool_boundary_loss`): each leaver against its competitor in the model-wide
  competition the teacher's target decides, which may sit in another layer or head, so the scores
  learn to compare across heads and layers (not only within one, as ``kvpop_mlp``'s per-head loss).

``OnePool(kvpop_mlp)`` ranks a per-head-trained scorer in the same pool (its scores were never trained
to compare across heads, and its model was fine-tuned under the per-head pattern); this policy is the
same pool trained for it. Compared in BENCHMARKS.md, "KVpop trained in one pool".
"""

from __future__ import annotations

from kvpop.policies.kvpop_mlp import KvpopMLP


class KvpopMLPPool(KvpopMLP):
    name = "kvpop_mlp_pool"
    one_pool = True

    def fused_scorer(self, layer):
        return None  # the pooled engine scores leavers in the step's head (kvpop.decode.pooled): no fused insert
