"""Every eviction policy, in one registry.

A policy is one file in this package: a :class:`Policy` subclass that declares its name and
capabilities and overrides the hooks they call for (see :mod:`kvpop.policies.base`). Adding one
means that file plus its line in :data:`REGISTRY`; the config's allowed names, the CLI, the
evaluate stage and both decode paths read the registry and the declared capabilities.

    from kvpop.policies import make_policy, names
    names(trained=True)                      # ('streaming_llm_plus', 'kvpop_mlp', 'kvpop_mlp_pool', 'kvpop', 'kvpop_pool', 'dms', ...)
    make_policy("kvpop_mlp", num_layers=30, num_kv_heads=3, head_dim=64)
"""

from __future__ import annotations

from kvpop.policies.base import FusedScorer, Policy, ScorerSpec, Scores
from kvpop.policies.dbtrimkv import DBTrimKV
from kvpop.policies.dense import Dense
from kvpop.policies.dms import Dms
from kvpop.policies.h2o import H2O
from kvpop.policies.kvpop import Kvpop
from kvpop.policies.kvpop_mlp import KvpopMLP
from kvpop.policies.kvpop_mlp_pool import KvpopMLPPool
from kvpop.policies.kvpop_pool import KvpopPool
from kvpop.policies.one_pool import OnePool
from kvpop.policies.oracle import OracleSources, OracleTarget
from kvpop.policies.streaming_llm import StreamingLLM, StreamingLLMPlus
from kvpop.policies.tova import TOVA
from kvpop.policies.trimkv import TrimKV, TrimKVJoint

#: name -> policy class, in the order tables list them
REGISTRY: dict[str, type[Policy]] = {
    cls.name: cls for cls in (
        Dense, StreamingLLM, TOVA, H2O, StreamingLLMPlus, KvpopMLP, KvpopMLPPool, Kvpop, KvpopPool, Dms, TrimKV, TrimKVJoint, DBTrimKV,
        OracleTarget, OracleSources,
    )
}


def names(**capabilities: bool) -> tuple[str, ...]:
    """Registered names whose declared capabilities match, e.g. ``names(trained=True)``."""
    for cap in capabilities:
        if cap not in Policy.CAPABILITIES:
            raise ValueError(f"unknown capability {cap!r}; known: {', '.join(Policy.CAPABILITIES)}")
    return tuple(n for n, cls in REGISTRY.items() if all(getattr(cls, c) == v for c, v in capabilities.items()))


def policy_class(name: str) -> type[Policy]:
    """The registered class of ``name``; a ValueError naming the known ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(REGISTRY)}") from None


def make_policy(
    name: str, *, num_layers: int = 0, num_kv_heads: int = 0, head_dim: int = 0, scorer_hidden: int = 64, scorer_dk: int = 16,
    scorer_dv: int = 16, scorer_forget_gate: str = "sigmoid", scorer_recency: float = 0.0, scorer_recency_space: str = "log",
    scorer_delay: int | None = None,
) -> Policy:
    """A fresh policy by name; learned ones start from an untrained scorer for a model of this shape
    (``scorer_delay``: ``kvpop_pool``'s read-out delay, None: a quarter of the window it runs at)."""
    cls = policy_class(name)
    if cls.learned and min(num_layers, num_kv_heads, head_dim) < 1:
        raise ValueError(f"policy {name!r} is learned: make_policy needs num_layers, num_kv_heads and head_dim")
    spec = ScorerSpec(num_layers, num_kv_heads, head_dim, hidden=scorer_hidden, d_k=scorer_dk, d_v=scorer_dv, forget_gate=scorer_forget_gate,
                      recency=scorer_recency, recency_space=scorer_recency_space, delay=scorer_delay)
    return cls.build(spec)


def resolve_policy(name: str, exported: Policy | None = None) -> Policy:
    """The policy to run under ``name``: the export's own policy for a trained one (its student and
    scorer were trained together), a fresh one otherwise."""
    if not policy_class(name).trained:
        return make_policy(name)
    if exported is None or exported.name != name:
        have = "none" if exported is None else repr(exported.name)
        raise ValueError(f"policy {name!r} needs an export folder trained with it (the checkpoint has {have})")
    return exported


__all__ = [
    "REGISTRY", "DBTrimKV", "Dense", "Dms", "FusedScorer", "H2O", "Kvpop", "KvpopMLP", "KvpopMLPPool", "KvpopPool", "OnePool", "OracleSources", "OracleTarget",
    "Policy", "Scores", "ScorerSpec", "StreamingLLM", "StreamingLLMPlus", "TOVA", "TrimKV", "TrimKVJoint",
    "make_policy", "names", "policy_class", "resolve_policy",
]
