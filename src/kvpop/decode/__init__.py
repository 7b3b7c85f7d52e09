"""Decoding under an eviction policy, in the geometry of :class:`kvpop.geometry.CacheLayout`.

* :mod:`~kvpop.decode.cache` -- :class:`BoundedCache`, the reference (slow twin) cache for
  ``model.generate``, and the only path of the attention rules (TOVA, H2O);
* :mod:`~kvpop.decode.one_pool` -- :class:`OnePoolCache`, the reference cache of one pool of long-range
  entries for every layer and KV head (``one_pool``: ``dbtrimkv``, ``OnePool(...)``), and why decoding
  with it equals the teacher-forced fixed point;
* :mod:`~kvpop.decode.engine` -- :class:`DecodeEngine`, the fast path (chunked prefill, static
  step, CUDA graphs); :mod:`~kvpop.decode.pooled` its store and competition for the one-pool policies;
* :mod:`~kvpop.decode.generate` -- :func:`generate` on the fastest path that supports the policy.
"""

from kvpop.decode.cache import BoundedCache, BoundedLayer, cache_bytes, enable
from kvpop.decode.engine import DecodeEngine, engine_refusal
from kvpop.decode.generate import GenerationStats, choose_path, feed, generate, model_device, never_evicts, new_cache, teacher_forced_logits
from kvpop.decode.one_pool import OnePoolCache
from kvpop.geometry import CacheLayout

__all__ = [
    "BoundedCache", "BoundedLayer", "CacheLayout", "DecodeEngine", "GenerationStats", "cache_bytes", "choose_path", "enable",
    "OnePoolCache", "engine_refusal", "feed", "generate", "model_device", "never_evicts", "new_cache", "teacher_forced_logits",
]
