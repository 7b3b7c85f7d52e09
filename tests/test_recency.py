"""A scorer's fixed age decay (``recency``, kvpop.scorer): its priority, its limits, its persistence."""

import pytest
import torch

from kvpop.config import TrainConfig
from kvpop.export import export, load_export
from kvpop.policies import StreamingLLM, make_policy
from kvpop.scorer import with_recency
from kvpop.selection import eviction_times

DIMS = dict(num_layers=2, num_kv_heads=2, head_dim=16)
SINKS, WINDOW, K = 2, 8, 6


def scorer_policy(name: str, **kw):
    """A learned policy whose scorer ranks tokens (its output layer no longer zero)."""
    torch.manual_seed(0)
    policy = make_policy(name, **DIMS, scorer_hidden=8, **kw)
    for p in policy.scorer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return policy


def kv(S=64, B=2):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 2, S, 16, generator=g), torch.randn(B, 2, S, 16, generator=g), torch.arange(S).expand(B, S)


@pytest.mark.parametrize("name", ["kvpop_mlp", "kvpop"])
def test_recency_adds_its_age_term_to_the_priority(name):
    policy = scorer_policy(name)
    k, v, pos = kv()
    base = policy.scores(1, k, v, pos, window=WINDOW).prio
    tilted = with_recency(policy, 0.25)
    got = tilted.scores(1, k, v, pos, window=WINDOW).prio
    assert torch.allclose(got, base + 0.25 * pos[:, None].double(), rtol=0, atol=1e-12)
    assert policy.scorer.decay.recency == 0.0 and policy.scorer.config["recency"] == 0.0  # the original is untouched
    assert tilted.scorer.config["recency"] == 0.25


@pytest.mark.parametrize("name", ["kvpop_mlp", "kvpop"])
def test_large_recency_is_the_recency_rule_and_zero_is_the_scorer(name):
    policy = scorer_policy(name)
    k, v, pos = kv()
    doc = torch.zeros_like(pos)

    def times(p):
        return eviction_times(p.scores(0, k, v, pos, window=WINDOW).prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)

    recency = times(StreamingLLM())
    assert not torch.equal(times(policy), recency)  # the scorer ranks otherwise
    assert torch.equal(times(with_recency(policy, 1e3)), recency)


def test_recency_is_exported_and_can_be_overridden(tiny_llama_dir, tiny_tokenizer, tmp_path):
    from kvpop.modeling import load_model

    policy = with_recency(scorer_policy("kvpop_mlp"), 0.125)
    export(load_model(tiny_llama_dir), tiny_tokenizer, policy, tmp_path / "exp", budget=SINKS + WINDOW + K, sinks=SINKS, window=WINDOW)
    k, v, pos = kv()
    want = policy.scores(0, k, v, pos).prio
    _, _, loaded, meta = load_export(tmp_path / "exp")
    assert meta["scorer"]["recency"] == 0.125 and loaded.scorer.decay.recency == 0.125
    assert torch.allclose(loaded.scores(0, k, v, pos).prio, want, rtol=0, atol=1e-9)
    _, _, plain, _ = load_export(tmp_path / "exp", recency=0.0)
    assert torch.allclose(plain.scores(0, k, v, pos).prio, want - 0.125 * pos[:, None].double(), rtol=0, atol=1e-9)


def test_negative_recency_is_refused():
    with pytest.raises(ValueError, match="recency must be >= 0"):
        with_recency(scorer_policy("kvpop_mlp"), -0.1)
    with pytest.raises(ValueError, match="recency must be >= 0"):
        make_policy("kvpop_mlp", **DIMS, scorer_recency=-1.0)
    with pytest.raises(ValueError, match="no learned age decay"):
        with_recency(StreamingLLM(), 0.1)
    with pytest.raises(ValueError, match="scorer_recency"):
        TrainConfig(scorer_recency=-0.5)


def test_training_builds_the_scorer_with_the_configured_recency(tiny_model):
    from kvpop.train import PackedDataset, build_training

    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(2))
    doc, pos = torch.zeros(2, 64, dtype=torch.long), torch.arange(64).expand(2, 64)
    cfg = TrainConfig(steps=1, batch_size=2, top_logits=16, scorer_hidden=8, scorer_recency=0.02, precision="32-true", accelerator="cpu")
    training = build_training(tiny_model("llama"), "kvpop_mlp", PackedDataset(ids, doc, pos, torch.ones_like(doc)), cfg=cfg,
                              budget=SINKS + WINDOW + K, sinks=SINKS, window=WINDOW, seed=0)
    assert training.policy.scorer.decay.recency == 0.02


def test_oracle_target_ranks_by_the_target_plus_the_same_age_term():
    L, Hk, S = 2, 2, 32
    g = torch.Generator().manual_seed(5)
    targets = {("max", 8.0): [torch.randn(1, Hk, S, generator=g) for _ in range(L)]}
    k, v, pos = kv(S, B=1)
    plain = make_policy("oracle_target").configure(target="max")
    tilted = make_policy("oracle_target").configure(target="max", recency=0.3)
    for o in (plain, tilted):
        o.fit_trace(input_ids=torch.zeros(1, S, dtype=torch.long), record={}, targets=targets)
    for layer in range(L):
        want = plain.scores(layer, k, v, pos).prio + 0.3 * pos[:, None].double()
        assert torch.allclose(tilted.scores(layer, k, v, pos).prio, want, rtol=0, atol=1e-12)
    share = make_policy("oracle_target").configure(target="max", recency=0.01, space="share")
    share.fit_trace(input_ids=torch.zeros(1, S, dtype=torch.long), record={}, targets=targets)
    want = targets[("max", 8.0)][1].double().exp() + 0.01 * pos[:, None].double()  # the decay against the share, exp(target)
    assert torch.allclose(share.scores(1, k, v, pos).prio, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="recency must be >= 0"):
        make_policy("oracle_target").configure(target="max", recency=-1.0)
    with pytest.raises(ValueError, match="space must be"):
        make_policy("oracle_target").configure(target="max", space="linear")
