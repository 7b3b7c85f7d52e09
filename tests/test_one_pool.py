"""one_pool (kvpop.policies.pooled): a per-head scorer's static priorities ranked with one pool for the whole model.

Twins: the fixed-point forward (:func:`kvpop.evaluate.captured_forward`) against the pool's rule run
literally on the priorities that forward records, and against token-by-token decoding with
:class:`kvpop.decode.pool.SharedPoolCache` (which ranks static priorities for a policy that does not
decay); with one layer and one KV head, the pool is the per-head rule. Plus the budget and its uneven
split, evaluate_fidelity, and the policies it refuses.
"""

import pytest
import torch

from kvpop.attention import SparseContext
from kvpop.decode import enable, teacher_forced_logits
from kvpop.evaluate import Candidate, captured_forward, evaluate_fidelity
from kvpop.policies import OnePool, make_policy, one_pool
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
    policy = one_pool(scorer())
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(2))
    _, evict = captured_forward(llama, policy, ids, layout=LAYOUT)
    prio = recorded_priorities(llama, policy, ids, evict)
    pos = torch.arange(80)[None]
    want = literal_global_eviction_times(prio, torch.zeros_like(pos), pos, SINKS, WINDOW, K, decays=False)
    assert torch.equal(evict.long(), want[:, 0])
    held = (evict > 79).sum(-1)  # (L, Hk) entries attendable by the last query
    assert held.sum() == 2 * 2 * BUDGET and held[1, 1] > BUDGET  # the pool is full; the raised head holds more


def test_decoding_equals_the_fixed_point(llama):
    policy = one_pool(scorer(seed=1))
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
            pooled = global_decaying_eviction_times(prio[None], doc, pos, sinks=SINKS, window=WINDOW, long_range=k, decays=False)
            assert torch.equal(pooled[0].clamp(max=S), per_head.clamp(max=S)), (levels, k)  # at or past S: never, in the trace


def test_evaluate_fidelity_scores_it_as_a_global_budget_policy(llama):
    base = scorer(seed=2)
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(4))
    recs = [{"input_ids": r.tolist(), "loss_mask": [0] + [1] * 69} for r in ids]
    cands = [Candidate("per head", llama, base), Candidate("one pool", llama, one_pool(base))]
    res = evaluate_fidelity(recs, llama, cands, layout=LAYOUT)
    kl, n = 0.0, 0  # by hand: each trace's fixed point, KL over the scored positions
    for rec in recs:
        one = torch.tensor([rec["input_ids"]])
        logits, _ = captured_forward(llama, one_pool(base), one, layout=LAYOUT)
        ref = torch.log_softmax(llama(input_ids=one).logits[0].float(), -1)
        kl += (ref.exp() * (ref - torch.log_softmax(logits, -1))).sum(-1)[:-1].sum().item()
        n += 69
    assert res["one pool"]["kl"] == pytest.approx(kl / n, rel=1e-4)
    assert res["one pool"]["kl"] != pytest.approx(res["per head"]["kl"], rel=1e-3)
    assert len(set(map(tuple, res["one pool"]["occupancy_map"]))) > 1  # the heads hold different shares


@pytest.mark.parametrize("name", ["kvpop", "dbtrimkv", "streaming_llm", "dms"])
def test_it_refuses_what_it_cannot_rank(name):
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16) if name != "streaming_llm" else {}
    policy = make_policy(name, **shape)
    assert not OnePool.accepts(policy)  # the benches ask this before wrapping
    with pytest.raises(ValueError, match="one_pool ranks"):
        one_pool(policy)
    assert OnePool.accepts(scorer()) and not OnePool.accepts(one_pool(scorer()))
