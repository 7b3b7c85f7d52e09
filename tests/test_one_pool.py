"""OnePool (kvpop.policies.one_pool): a policy's static per-head priorities ranked with one pool for the whole model.

Twins: the fixed-point forward (:func:`kvpop.evaluate.captured_forward`) against the pool's rule run
literally on the priorities that forward records, and against token-by-token decoding with
:class:`kvpop.decode.one_pool.OnePoolCache` (which ranks static priorities for a policy that does not
decay); with one layer and one KV head, the pool is the per-head rule; the one-pool oracle against the
pool's rule on the per-head oracle's priorities. Plus the budget and its uneven split,
evaluate_fidelity, and the policies it refuses (by name), decoding an oracle included.
"""

import pytest
import torch

from kvpop.attention import SparseContext
from kvpop.decode import OnePoolCache, choose_path, enable, engine_refusal, new_cache, teacher_forced_logits
from kvpop.evaluate import Candidate, captured_forward, evaluate_fidelity, one_pool_twin, teacher_targets
from kvpop.policies import OnePool, make_policy, policy_class
from kvpop.selection import eviction_times, global_decaying_eviction_times
from test_dbtrimkv import BUDGET, LAYOUT, SINKS, WINDOW, K, literal_global_eviction_times


@pytest.fixture(scope="module")
def llama(tiny_model):
    return enable(tiny_model("llama"))


def scorer(seed=0, lift=3.0):
    """A kvpop_mlp on the tiny llama (2 layers, 2 KV heads) whose scores differ per token, with layer 1
    head 1's raised by ``lift``: under one pool its tokens take slots from the other heads."""
    torch.manual_seed(seed)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for mlp in policy.scorer.layers:
        torch.nn.init.normal_(mlp.w2, std=1.0)
    policy.scorer.layers[1].b2.data[1] += lift
    return policy


def recorded_priorities(model, policy, ids, evict):
    """Every layer's priorities (L, 1, Hk, S) from one forward of ids (1, S) under eviction times (L, Hk, S)."""
    pos = torch.arange(ids.shape[1])[None]
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout=LAYOUT, global_evict=evict[:, None])
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    return torch.stack([ctx.global_prio[i] for i in sorted(ctx.global_prio)])


def test_the_fixed_point_is_the_pools_rule_on_its_own_priorities(llama):
    policy = OnePool(scorer())
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(2))
    _, evict = captured_forward(llama, policy, ids, layout=LAYOUT)
    prio = recorded_priorities(llama, policy, ids, evict)
    pos = torch.arange(80)[None]
    want = literal_global_eviction_times(prio, torch.zeros_like(pos), pos, SINKS, WINDOW, K, decays=False)
    assert torch.equal(evict.long(), want[:, 0])
    held = (evict > 79).sum(-1)  # (L, Hk) entries attendable by the last query
    assert held.sum() == 2 * 2 * BUDGET and held[1, 1] > BUDGET  # the pool is full; the raised head holds more


def test_decoding_equals_the_fixed_point(llama):
    policy = OnePool(scorer(seed=1))
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(3))
    ref, _ = captured_forward(llama, policy, ids, layout=LAYOUT)
    for prefill in (1, 13, BUDGET):  # BUDGET: the cache takes the first budget tokens at once, the rest one at a time
        got = teacher_forced_logits(llama, policy, ids, layout=LAYOUT, prefill=prefill)
        assert (got[0] - ref).abs().max() < 1e-4, prefill
    per_head, _ = captured_forward(llama, policy.policy, ids, layout=LAYOUT)
    assert (per_head - ref).abs().max() > 1e-3  # the pool's pattern is not the per-head one


def test_one_pair_is_the_per_head_rule():
    """One layer and one KV head: a pool of k entries is that head's k slots, ranked by the same priorities."""
    g = torch.Generator().manual_seed(5)
    S = 90
    pos = torch.arange(S)[None].expand(2, S)
    doc = torch.zeros_like(pos)
    for levels in (None, 4):  # continuous priorities; few levels (ties)
        prio = torch.randn(2, 1, S, generator=g, dtype=torch.float64) if levels is None else \
            torch.randint(0, levels, (2, 1, S), generator=g).double()
        for k in (0, 1, 7):
            per_head = eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=k)
            pool = global_decaying_eviction_times(prio[None], doc, pos, sinks=SINKS, window=WINDOW, long_range=k, decays=False)
            assert torch.equal(pool[0].clamp(max=S), per_head.clamp(max=S)), (levels, k)  # at or past S: never, in the trace


def test_evaluate_fidelity_scores_it_as_a_one_pool_policy(llama):
    base = scorer(seed=2)
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(4))
    recs = [{"input_ids": r.tolist(), "loss_mask": [0] + [1] * 69} for r in ids]
    cands = [Candidate("per head", llama, base), Candidate("one pool", llama, OnePool(base))]
    res = evaluate_fidelity(recs, llama, cands, layout=LAYOUT)
    kl, n = 0.0, 0  # by hand: each trace's fixed point, KL over the scored positions
    for rec in recs:
        one = torch.tensor([rec["input_ids"]])
        logits, _ = captured_forward(llama, OnePool(base), one, layout=LAYOUT)
        ref = torch.log_softmax(llama(input_ids=one).logits[0].float(), -1)
        kl += (ref.exp() * (ref - torch.log_softmax(logits, -1))).sum(-1)[:-1].sum().item()
        n += 69
    assert res["one pool"]["kl"] == pytest.approx(kl / n, rel=1e-4)
    assert res["one pool"]["kl"] != pytest.approx(res["per head"]["kl"], rel=1e-3)
    assert len(set(map(tuple, res["one pool"]["occupancy_map"]))) > 1  # the heads hold different shares


@pytest.mark.parametrize(("name", "why"), [("kvpop", "scores_on_exit"), ("dbtrimkv", "already ranks with one pool"), ("trimkv", "decays"),
                                         ("dms", "gated"), ("tova", "needs_attention"), ("streaming_llm", "no learned or oracle")])
def test_it_refuses_what_it_cannot_rank_and_names_it(name, why):
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16) if policy_class(name).learned else {}
    policy = make_policy(name, **shape)
    assert not OnePool.accepts(policy) and not OnePool.accepts(type(policy))  # the benches and the config ask this before wrapping
    with pytest.raises(ValueError, match=rf"not '{name}': .*{why}"):
        OnePool(policy)
    with pytest.raises(ValueError, match=r"not 'kvpop_mlp, one pool': it already ranks with one pool"):
        OnePool(OnePool(scorer()))


def test_what_it_accepts_and_the_flags_it_declares():
    """Static priorities, learned or an oracle's; the wrapper declares one_pool, and oracle and trained as its policy."""
    for name in ("kvpop_mlp", "oracle_target", "oracle_sources"):
        policy = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16)
        pool = OnePool(policy)
        assert OnePool.accepts(policy) and OnePool.accepts(type(policy))
        assert pool.name == f"{name}, one pool" and pool.one_pool and not pool.layer_independent
        assert (pool.oracle, pool.trained) == (policy.oracle, policy.trained)
    assert not OnePool.oracle and not make_policy("oracle_target").one_pool  # instance flags only
    twin = one_pool_twin(Candidate("oracle_target", None, make_policy("oracle_target")))
    assert twin.name == "oracle_target, one pool" and twin.policy.oracle
    assert one_pool_twin(Candidate("streaming_llm", None, make_policy("streaming_llm"))) is None


def test_a_one_pool_oracle_is_never_decoded(llama):
    """An oracle reads the trace's future: under one pool it stays teacher-forced only, and every decode
    path says so, naming it (before any talk of which cache decodes the pool)."""
    pool = OnePool(make_policy("oracle_target"))
    msg = r"policy 'oracle_target, one pool' is an oracle \(it reads the trace's future\)"
    with pytest.raises(ValueError, match=msg):
        OnePoolCache(llama.config, pool, layout=LAYOUT)
    with pytest.raises(ValueError, match=msg):
        new_cache(llama, pool, layout=LAYOUT)
    with pytest.raises(ValueError, match=msg):
        choose_path(llama, pool)
    assert "is an oracle" in engine_refusal(llama, pool)


def one_pool_oracle(**kw):
    """oracle_target ranked with one pool for the whole model (before the one door: ``configure(shared=True)``;
    the same eviction times, logits and metrics to the last bit)."""
    return OnePool(make_policy("oracle_target").configure(**kw))


@pytest.mark.parametrize("kw", [dict(target="max"), dict(target="mean", recency=0.01)])
def test_a_one_pool_oracle_is_the_pools_rule_on_its_per_head_priorities(llama, kw):
    """The one-pool ceiling: the per-head oracle's own priorities (fitted to the same targets) through the
    pool's rule (:func:`kvpop.selection.global_decaying_eviction_times`, ``decays=False``); its scores do
    not depend on the pattern, so the fixed point is the second forward."""
    from kvpop.evaluate import pool_fixed_point

    ids = torch.randint(0, 96, (2, 90), generator=torch.Generator().manual_seed(11))
    pool, per_head = one_pool_oracle(**kw), make_policy("oracle_target").configure(**kw)
    for row in range(2):
        one = ids[row : row + 1]
        t = teacher_targets(llama, one, window=WINDOW, kind=kw["target"])  # a random model's: alike in every head
        t[1] = t[1] + torch.tensor([0.0, 2.0]).view(1, 2, 1)  # so layer 1 head 1's tokens rank higher, by design
        for o in (pool, per_head):
            o.fit_trace(input_ids=one, record={}, targets={(kw["target"], 8.0): t})
        _, evict = captured_forward(llama, pool, one, layout=LAYOUT)
        prio = torch.stack([per_head.scores(layer, torch.zeros(1, 2, 90, 16), None, torch.arange(90)[None]).prio for layer in range(2)])
        pos = torch.arange(90)[None]
        want = global_decaying_eviction_times(prio, torch.zeros_like(pos), pos, sinks=SINKS, window=WINDOW, long_range=K, decays=False)
        assert torch.equal(evict, want[:, 0])
        held = (evict > 89).sum(-1)  # (L, Hk)
        assert held.sum() == 2 * 2 * BUDGET and held[1, 1] > BUDGET  # the pool is full; the raised head holds more
        fixed, _ = pool_fixed_point(llama, pool, one, layout=LAYOUT)
        assert torch.equal(fixed[:, 0], evict)


def test_evaluate_fidelity_fits_a_one_pool_oracle_per_trace(llama):
    """evaluate_fidelity hands the one-pool oracle each trace's own targets (through the wrapper) and scores
    it one trace at a time: its KL by hand, each trace fitted, then its fixed point."""
    ids = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(8))
    pool = one_pool_oracle(target="max")
    recs = [{"input_ids": r.tolist(), "loss_mask": [0] + [1] * 79} for r in ids]
    res = evaluate_fidelity(recs, llama, [Candidate("per head", llama, make_policy("oracle_target").configure(target="max")),
                                          Candidate("one pool", llama, pool)], layout=LAYOUT)
    kl, n = 0.0, 0
    for rec in recs:
        one = torch.tensor([rec["input_ids"]])
        pool.fit_trace(input_ids=one, record={}, targets={("max", 8.0): teacher_targets(llama, one, window=WINDOW, kind="max")})
        logits, _ = captured_forward(llama, pool, one, layout=LAYOUT)
        ref = torch.log_softmax(llama(input_ids=one).logits[0].float(), -1)
        kl += (ref.exp() * (ref - torch.log_softmax(logits, -1))).sum(-1)[:-1].sum().item()
        n += 79
    assert res["one pool"]["traces"] == 2 and res["one pool"]["kl"] == pytest.approx(kl / n, rel=1e-4)
