"""dbtrimkv (kvpop.policies.dbtrimkv): one pool of long-range slots shared by every layer and KV head.

Twins: :func:`kvpop.selection.global_decaying_eviction_times` against a plain-Python run of the pool's
rule, and (one layer, one head) against the per-head rule
:func:`kvpop.selection.decaying_eviction_times_reference`; the fixed-point forward
(:func:`kvpop.evaluate.captured_forward`) against token-by-token decoding with the pool
(:class:`kvpop.decode.one_pool.OnePoolCache`), and ``kvpop.decode.generate`` against a greedy loop
over the fixed-point forward; :func:`kvpop.policies.dbtrimkv.global_capacity_loss` against a loop
and (one layer, one head) against trimkv's per-head capacity loss. Plus the pool's budget and its
uneven split, the fixed point's number of forwards, the cache's size, the tied gate, training and export.
"""

import copy
import math
from collections import Counter

import pytest
import torch

from kvpop.attention import SparseContext
from kvpop.decode import BoundedCache, enable, engine_refusal, generate, new_cache, teacher_forced_logits
from kvpop.decode.one_pool import OnePoolCache
from kvpop.evaluate import Candidate, captured_forward, evaluate_fidelity, pool_fixed_point
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.policies.dbtrimkv import global_capacity_loss
from kvpop.policies.trimkv import INIT_LOGIT, capacity_loss
from kvpop.selection import NEVER, decaying_eviction_times_reference, eviction_times, global_decaying_eviction_times
from test_selection import random_packing
from test_train import tiny_pair

from conftest import packed_toy

SINKS, WINDOW, K = 2, 6, 5
BUDGET = SINKS + WINDOW + K
LAYOUT = CacheLayout(BUDGET, SINKS, WINDOW)  # K long-range slots


def literal_global_eviction_times(log_beta, doc_ids, pos, sinks, window, k, decays=True, floor=0):
    """The pool's rule run literally, one row at a time, with a Python list of (token, pair) entries
    (``decays=False``: ``log_beta`` holds static priorities, compared as they are; ``floor``: only the
    entries of pairs that hold more than ``floor`` may go)."""
    L, B, Hk, S = log_beta.shape
    F = L * Hk
    e = torch.full((L, B, Hk, S), NEVER, dtype=torch.int64)
    for b in range(B):
        rate = [log_beta[f // Hk, b, f % Hk].double().tolist() for f in range(F)]  # rate[f][i]: log beta of pair f, token i
        pool: list[tuple[int, int]] = []
        for q in range(S):
            if pos[b, q] == 0:
                pool = []
            j = q - window
            if j < 0 or doc_ids[b, q] < 0 or doc_ids[b, j] != doc_ids[b, q] or pos[b, j] < sinks:
                continue
            pool += [(j, f) for f in range(F)]
            while len(pool) > F * k:  # the lowest retention goes; ties: the older token, then the higher pair
                held = Counter(f for _, f in pool)
                i, f = min((entry for entry in pool if held[entry[1]] > floor),
                           key=lambda entry: ((q - entry[0]) * rate[entry[1]][entry[0]] if decays else rate[entry[1]][entry[0]], entry[0], -entry[1]))
                pool.remove((i, f))
                e[f // Hk, b, f % Hk, i] = q
    return e


def tied_log_beta(L, B, Hk, S, g, levels):
    """Random log beta (L, B, Hk, S) float64. ``levels`` None: continuous values, and a third of the tokens
    with rates for every pair that differ by a relative 1e-12 only (equal in float32: only float64 ranks
    them); else multiples of -1/8 in ``-levels/8 .. 0`` (zeros included: they keep forever, tying at 0),
    and a third of the tokens with one rate for every pair (exact ties between the entries of one token)."""
    if levels is None:
        lb = -torch.rand(L, B, Hk, S, generator=g, dtype=torch.float64) * 0.3
        near = lb[:1, :, :1] * (1 + 1e-12 * torch.randn(L, B, Hk, S, generator=g, dtype=torch.float64))
    else:
        lb = -torch.randint(0, levels + 1, (L, B, Hk, S), generator=g).double() / 8
        near = lb[:1, :, :1].expand_as(lb)
    same = torch.rand(B, S, generator=g) < 1 / 3  # these tokens: one rate for every (layer, head), or nearly
    return torch.where(same[None, :, None], near, lb)


@pytest.mark.parametrize("shape", [(2, 2), (3, 1)])
@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("levels", [None, 3])
def test_global_eviction_times_match_the_literal_rule(shape, k, levels):
    L, Hk = shape
    S = 70
    g = torch.Generator().manual_seed(100 * k + L + (levels or 0))
    doc_ids, pos = random_packing(2, S, [9, 25, S], 6, g)
    log_beta = tied_log_beta(L, 2, Hk, S, g, levels)
    got = global_decaying_eviction_times(log_beta, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=k)
    assert got.dtype == torch.int32 and got.shape == (L, 2, Hk, S)
    want = literal_global_eviction_times(log_beta, doc_ids, pos, SINKS, WINDOW, k)
    assert torch.equal(got.long(), want)
    assert (want < NEVER).any() and (want == NEVER).any()


@pytest.mark.parametrize("j0", [0, 7, 21, 40, 69, 70])
@pytest.mark.parametrize("levels", [None, 3])
def test_a_run_continued_where_the_scores_change_equals_a_fresh_run(j0, levels):
    """``previous=``: scores equal before token j0 (70: none changed), changed from there (ties included)."""
    L, Hk, S, k = 2, 2, 70, 3
    g = torch.Generator().manual_seed(j0 + (levels or 0))
    doc_ids, pos = random_packing(2, S, [9, 25, S], 6, g)
    first = tied_log_beta(L, 2, Hk, S, g, levels)
    second = torch.cat([first[..., :j0], tied_log_beta(L, 2, Hk, S, g, levels)[..., j0:]], -1)
    kw = dict(sinks=SINKS, window=WINDOW, long_range=k)
    _, run = global_decaying_eviction_times(first, doc_ids, pos, **kw, keep_run=True)
    assert len(run.pools) > 2  # the run kept pools to continue from
    got, run2 = global_decaying_eviction_times(second, doc_ids, pos, **kw, previous=run, keep_run=True)
    fresh, fresh_run = global_decaying_eviction_times(second, doc_ids, pos, **kw, keep_run=True)
    assert torch.equal(got, fresh)
    assert torch.equal(got.long(), literal_global_eviction_times(second, doc_ids, pos, SINKS, WINDOW, k))
    assert sorted(run2.pools) == sorted(fresh_run.pools)  # and it can be continued again
    for q in run2.pools:
        assert all(torch.equal(a, b) for a, b in zip(run2.pools[q], fresh_run.pools[q], strict=True))
    with pytest.raises(ValueError, match="previous run has scores of shape"):
        global_decaying_eviction_times(second[:, :1], doc_ids[:1], pos[:1], **kw, previous=run)


@pytest.mark.parametrize("k", [0, 2, 5])
@pytest.mark.parametrize("levels", [None, 3])
def test_a_pool_of_static_priorities_matches_the_literal_rule(k, levels):
    """``decays=False`` (one pool ranked by static priorities: ``OnePool``), ties
    included, against the literal rule; with one pair it is :func:`eviction_times`'s per-head rule."""
    L, Hk, S = 2, 2, 70
    g = torch.Generator().manual_seed(200 + k + (levels or 0))
    doc_ids, pos = random_packing(2, S, [9, 25, S], 6, g)
    prio = tied_log_beta(L, 2, Hk, S, g, levels) * 40 + 3  # any real: static priorities
    got = global_decaying_eviction_times(prio, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=k, decays=False)
    want = literal_global_eviction_times(prio, doc_ids, pos, SINKS, WINDOW, k, decays=False)
    assert torch.equal(got.long(), want)
    assert not torch.equal(got, global_decaying_eviction_times(prio, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=k)) or k == 0
    doc, p1 = torch.zeros(2, S, dtype=torch.long), torch.arange(S).expand(2, S)  # one document per row (eviction_times
    for h in range(Hk):  # dates evictions past a document's end, the pool does not): one pair is the per-head rule
        one = global_decaying_eviction_times(prio[:1, :, h : h + 1], doc, p1, sinks=SINKS, window=WINDOW, long_range=k, decays=False)
        ref = eviction_times(prio[0, :, h : h + 1], doc, p1, sinks=SINKS, window=WINDOW, long_range=k)
        assert torch.equal(one[0].long().clamp(max=S), ref.long().clamp(max=S)), h  # a time >= S: never evicted in the row


def test_one_pair_is_the_per_head_rule():
    """L = Hk = 1: the pool of k entries is one head's k slots; so each head of the per-head rule is a pool of its own."""
    g = torch.Generator().manual_seed(7)
    S = 120
    doc_ids, pos = random_packing(3, S, [10, 40, S], 7, g)
    for levels in (None, 3):
        for k in (0, 1, 4):
            lb = tied_log_beta(1, 3, 3, S, g, levels)[0]  # (B, Hk, S)
            ref = decaying_eviction_times_reference(lb, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=k)
            for h in range(3):
                got = global_decaying_eviction_times(lb[None, :, h : h + 1], doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=k)
                assert torch.equal(got[0], ref[:, h : h + 1]), (levels, k, h)


def held_long_range(evict, doc_ids, pos, b, q, sinks, window):
    """Long-range entries of row b held at query q, per pair: (L, Hk) eligible tokens past the window not yet evicted."""
    i = torch.arange(q + 1)
    eligible = (doc_ids[b, : q + 1] == doc_ids[b, q]) & (pos[b, : q + 1] >= sinks) & (i <= q - window)
    return ((evict[:, b, :, : q + 1] > q) & eligible).sum(-1)


def test_the_pool_budget_holds_and_is_shared_unevenly():
    g = torch.Generator().manual_seed(3)
    L, Hk, S = 2, 2, 90
    F = L * Hk
    doc_ids, pos = random_packing(2, S, [20, 50, S], 5, g)
    lb = tied_log_beta(L, 2, Hk, S, g, None)
    evict = global_decaying_eviction_times(lb, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=K)
    most = 0
    for b in range(2):
        for q in range(S):
            if doc_ids[b, q] >= 0:
                most = max(most, held_long_range(evict, doc_ids, pos, b, q, SINKS, WINDOW).sum().item())
    assert most == F * K  # the pool fills and never overflows

    # layer 0 retains (log beta near 0), layer 1 decays fast: layer 0 takes the pool
    doc1, pos1 = torch.zeros(1, S, dtype=torch.long), torch.arange(S)[None]
    lb = torch.empty(L, 1, Hk, S, dtype=torch.float64)
    lb[0] = -torch.rand(1, Hk, S, generator=g, dtype=torch.float64) * 1e-4
    lb[1] = -1.0 - torch.rand(1, Hk, S, generator=g, dtype=torch.float64)
    evict = global_decaying_eviction_times(lb, doc1, pos1, sinks=SINKS, window=WINDOW, long_range=K)
    held = held_long_range(evict, doc1, pos1, 0, S - 1, SINKS, WINDOW)  # (L, Hk)
    assert held.sum() == F * K
    assert (held[0] > K).all() and (held[1] < K).all()


def random_gate(seed=0, tied=False):
    """A dbtrimkv policy on the tiny llama whose retention differs per token, more in layer 1 than in layer 0.
    ``tied``: the other way round, and layer 1's w1 is 0, so both its heads retain every token at one rate
    (sigmoid(2)): which of them keeps a token is then the pair tie rule's choice."""
    torch.manual_seed(seed)
    policy = make_policy("dbtrimkv", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    gate = policy.scorer
    torch.nn.init.normal_(gate.w2, std=0.5)
    gate.b2.data.fill_(2.0)
    gate.w1.data[0] *= 3.0 if tied else 0.3  # near b2: retains; spread: some tokens decay fast
    gate.w1.data[1] *= 0.0 if tied else 3.0
    return policy


@pytest.fixture(scope="module")
def llama(tiny_model):
    return enable(tiny_model("llama"))


@pytest.mark.parametrize("tied", [False, True])
def test_decoding_equals_the_fixed_point(llama, tied):
    policy = random_gate(seed=1, tied=tied)
    ids = torch.randint(0, 96, (1, 80), generator=torch.Generator().manual_seed(2))
    ref, evict = captured_forward(llama, policy, ids, layout=LAYOUT)
    for prefill in (1, 13, 30):  # 30: the cache takes the first budget tokens at once, the rest one at a time
        got = teacher_forced_logits(llama, policy, ids, layout=LAYOUT, prefill=prefill)
        assert (got[0] - ref).abs().max() < 1e-4, prefill
    recency, _ = captured_forward(llama, make_policy("streaming_llm"), ids, layout=LAYOUT)
    assert (recency - ref).abs().max() > 1e-3  # not recency
    held = (evict > ids.shape[1] - 1).sum(-1)  # (L, Hk) entries attendable by the last query
    assert held.sum() == 2 * 2 * BUDGET and held.max() > BUDGET  # the pool is full and split unevenly


def counted_fixed_point(model, policy, ids):
    """(pool_fixed_point's eviction times (L, Hk, S) of the one trace, one entry per forward it ran)."""
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return pool_fixed_point(model, policy, ids, layout=LAYOUT)[0][:, 0], calls
    finally:
        hook.remove()


def test_the_fixed_point_is_reached_in_few_forwards_and_is_one(llama):
    policy = random_gate(seed=1)
    S = 80
    ids = torch.randint(0, 96, (1, S), generator=torch.Generator().manual_seed(2))
    evict, calls = counted_fixed_point(llama, policy, ids)
    logits, captured = captured_forward(llama, policy, ids, layout=LAYOUT)
    assert torch.equal(captured, evict)
    assert 2 <= len(calls) <= math.ceil((S - BUDGET) / WINDOW) + 1
    pos = torch.arange(S)[None]
    doc = torch.zeros_like(pos)
    evict_n, forwards = None, 0  # the iteration, by hand: forward under E_n, simulate E_n+1, until E_n+1 = E_n
    while True:
        ctx = SparseContext.for_rows(policy, doc, pos, layout=LAYOUT, global_evict=evict_n)
        with torch.no_grad():
            llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
        forwards += 1
        prio = torch.stack([ctx.global_prio[i] for i in sorted(ctx.global_prio)])
        new = global_decaying_eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
        if evict_n is not None and torch.equal(new, evict_n):
            break
        evict_n = new
    assert torch.equal(evict_n[:, 0], evict) and len(calls) == forwards > 2  # no forward more than the iteration needs
    ctx = SparseContext.for_rows(policy, doc, pos, layout=LAYOUT, global_evict=evict[:, None])
    with torch.no_grad():
        again = llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits[0]
    prio = torch.stack([ctx.global_prio[i] for i in sorted(ctx.global_prio)])  # (L, 1, Hk, S)
    assert torch.equal(global_decaying_eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)[:, 0], evict)
    assert (again - logits).abs().max() < 1e-5
    assert (evict < NEVER).any()


def test_a_trace_within_the_budget_takes_one_forward(llama):
    """Nothing is evicted before query ``budget``: the first forward (no eviction) is already the fixed point,
    and the bound ``ceil((S - budget) / window) + 1`` of the docstrings is 1."""
    policy = random_gate(seed=1)
    ids = torch.randint(0, 96, (1, BUDGET), generator=torch.Generator().manual_seed(2))
    evict, calls = counted_fixed_point(llama, policy, ids)
    assert (evict == NEVER).all()
    assert len(calls) <= max(0, math.ceil((BUDGET - BUDGET) / WINDOW)) + 1


def test_the_batched_fixed_point_equals_one_trace_at_a_time(llama):
    """pool_fixed_point on B traces at once (one pool per row, the simulation vectorized over rows), and
    evaluate_fidelity's batched patterns, equal each trace's own fixed point."""
    policy = random_gate(seed=3, tied=True)
    ids = torch.randint(0, 96, (3, 72), generator=torch.Generator().manual_seed(7))
    batched, _ = pool_fixed_point(llama, policy, ids, layout=LAYOUT)  # (L, 3, Hk, S)
    singles = [captured_forward(llama, policy, ids[r : r + 1], layout=LAYOUT) for r in range(3)]
    for r, (_, evict) in enumerate(singles):
        assert torch.equal(batched[:, r], evict), r
    assert not torch.equal(batched[:, 0], batched[:, 1])  # the rows' patterns are their own
    recs = [{"input_ids": row.tolist(), "loss_mask": [0] + [1] * (ids.shape[1] - 1)} for row in ids]
    recs.append({"input_ids": ids[0, :50].tolist(), "loss_mask": [0] + [1] * 49})  # another length: its own batch
    cand = [Candidate("dbtrimkv", llama, policy)]
    got = {b: evaluate_fidelity(recs, llama, cand, layout=LAYOUT, pool_batch=b)["dbtrimkv"] for b in (1, 2, 8)}
    for b in (2, 8):
        for key in ("kl", "quote_accuracy", "top1_agreement", "occupancy"):
            assert got[b][key] == pytest.approx(got[1][key], rel=1e-5, abs=1e-7), (b, key)
    kls = []
    for rec, (logits, _) in zip(recs, singles + [captured_forward(llama, policy, ids[:1, :50], layout=LAYOUT)]):
        ref = torch.log_softmax(llama(input_ids=torch.tensor([rec["input_ids"]])).logits[0].float(), -1)
        kls.append((ref.exp() * (ref - torch.log_softmax(logits, -1))).sum(-1)[:-1].sum().item())
    assert got[8]["kl"] == pytest.approx(sum(kls) / sum(len(r["input_ids"]) - 1 for r in recs), rel=1e-4)
    # each trace's own sums, kept apart (bench/quality_report.py's paired intervals)
    per = got[8]["per_trace"]
    assert per["trace"] == [0, 1, 2, 3] and per["tokens"] == [len(r["input_ids"]) - 1 for r in recs]
    assert per["kl_sum"] == pytest.approx(kls, rel=1e-4) and per["quote_tokens"] == [0] * 4 and per["quote_hits"] == [0] * 4


def test_generate_equals_a_greedy_loop_over_the_fixed_point(llama, tiny_tokenizer):
    policy = random_gate(seed=4)
    prompt = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    new, _ = generate(llama, tiny_tokenizer, policy, prompt, layout=LAYOUT, max_new_tokens=6, path="reference")
    seq = prompt[0].tolist()
    for _ in range(6):
        logits, _ = captured_forward(llama, policy, torch.tensor([seq]), layout=LAYOUT)
        seq.append(int(logits[-1].argmax()))
    assert new[0].tolist() == seq[40:]


def test_the_one_pool_cache(llama):
    policy = random_gate(seed=1)
    ids = torch.randint(0, 96, (2, 60), generator=torch.Generator().manual_seed(6))
    cache = new_cache(llama, policy, layout=LAYOUT)
    assert isinstance(cache, OnePoolCache)
    with pytest.raises(NotImplementedError, match=rf"budget \({BUDGET}\)"), torch.no_grad():
        llama(input_ids=ids[:, : BUDGET + 1], past_key_values=cache)
    cache = new_cache(llama, policy, layout=LAYOUT)
    got = teacher_forced_logits(llama, policy, ids, layout=LAYOUT, prefill=BUDGET, cache=cache)
    for row in range(2):  # each row has its own pool
        ref, _ = captured_forward(llama, policy, ids[row : row + 1], layout=LAYOUT)
        assert (got[row] - ref).abs().max() < 1e-4
    occ = cache.occupancy()  # (L, Hk)
    L, Hk, D = 2, 2, 16
    assert occ.shape == (L, Hk) and occ.sum().item() == L * Hk * BUDGET
    assert (occ != BUDGET).any()  # not the per-head split
    B, P, R = 2, L * Hk * K, SINKS + WINDOW
    es = torch.empty((), dtype=torch.float32).element_size()
    f64, i64 = (torch.empty((), dtype=d).element_size() for d in (torch.float64, torch.int64))
    kv = B * L * Hk * BUDGET * 2 * D * es  # keys and values of the budget's entries
    meta = B * L * Hk * R * (f64 + i64) + B * P * (f64 + 2 * i64)  # log beta and position per ring entry; log beta, position, pair per pool entry
    assert cache.cache_bytes() == kv + meta
    assert engine_refusal(llama, policy) is None  # the engine serves the pool (kvpop.decode.pooled)


def test_the_per_head_cache_is_not_offered_for_the_pool(llama):
    """The engine decodes the pool (its pooled kind); the per-head BoundedCache refuses the policy (as
    OnePoolCache refuses a per-head one) instead of decoding it as trimkv."""
    policy = random_gate(seed=1)
    assert engine_refusal(llama, policy) is None
    with pytest.raises((ValueError, NotImplementedError)):
        BoundedCache(llama.config, policy, layout=LAYOUT)
    with pytest.raises(ValueError, match="per-head budget"):
        OnePoolCache(llama.config, make_policy("streaming_llm"), layout=LAYOUT)


def loop_capacity_loss(log_beta, doc, pos, sinks, window, k):
    B, S = doc.shape
    P = len(log_beta) * log_beta[0].shape[1] * k
    total, n = 0.0, 0
    for b in range(B):
        for t in range(S):
            if doc[b, t] < 0:
                continue
            n += 1
            mass = sum(
                math.exp((t - i) * lb[b, h, i].item())
                for lb in log_beta
                for h in range(lb.shape[1])
                for i in range(t + 1)
                if t - i >= window and doc[b, i] == doc[b, t] and pos[b, i] >= sinks
            )
            total += max(0.0, mass - P) / max(P, 1)
    return total / n


def test_global_capacity_loss_matches_a_loop():
    g = torch.Generator().manual_seed(4)
    _, doc, pos = packed_toy(2, 40, seed=5)
    k = 2
    scale = torch.tensor([[0.02, 0.8], [0.05, 0.3]], dtype=torch.float64)  # per (layer, head): some retain more than k, some less
    lbs = [(-torch.rand(2, 2, 40, generator=g, dtype=torch.float64) * scale[layer, :, None]).requires_grad_(True) for layer in range(2)]
    got = global_capacity_loss(lbs, doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k), chunk=7)
    want = loop_capacity_loss(lbs, doc, pos, SINKS, WINDOW, k)
    assert want > 0 and math.isclose(got.item(), want, rel_tol=1e-9)
    per_head = torch.stack([capacity_loss(lb, doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)) for lb in lbs]).mean()
    assert per_head.item() > want * 1.05  # the pool lets the heads that retain less make room for the others
    got.backward()
    assert all((lb.grad >= 0).all() for lb in lbs) and sum(lb.grad.sum() for lb in lbs) > 0  # more retention costs more

    policy = make_policy("dbtrimkv", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    x = [torch.special.logit(lb.detach().exp()) for lb in lbs]  # gate logits whose log beta are lbs
    loss, logs = policy.gate_loss(
        [policy.relax(xi) for xi in x], doc_ids=doc, pos=pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k),
        weight=0.5, ramp=0.5, progress=1.0,
    )
    assert math.isclose(loss.item(), 0.5 * want, rel_tol=1e-6) and math.isclose(logs["capacity_loss"].item(), want, rel_tol=1e-6)

    one = [lbs[0][:, :1].detach()]  # one layer, one head: trimkv's per-head loss
    assert math.isclose(
        global_capacity_loss(one, doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)).item(),
        capacity_loss(one[0], doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)).item(),
        rel_tol=1e-12,
    )
    assert capacity_loss(one[0], doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)) > 0


def test_one_head_may_hold_more_than_k_if_the_pool_has_room():
    S, k = 24, 9
    doc, pos = torch.zeros(1, S, dtype=torch.long), torch.arange(S)[None]
    lb = torch.stack([torch.zeros(1, S), torch.full((1, S), -30.0)], 1).double()  # (1, 2, S): head 0 keeps all, head 1 nothing
    # head 0 holds up to S - WINDOW - SINKS = 16 tokens: more than k, within the pool of 2k
    assert k < S - WINDOW - SINKS <= 2 * k
    assert global_capacity_loss([lb], doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)).item() == 0
    assert capacity_loss(lb, doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)) > 0


def test_the_tied_gate():
    L, Hk, D, F = 3, 2, 16, 8
    policy = make_policy("dbtrimkv", num_layers=L, num_kv_heads=Hk, head_dim=D, scorer_hidden=F)
    assert sum(p.numel() for p in policy.parameters()) == L * Hk * (2 * D * F + F) + F + 1
    assert (policy.gated, policy.decays, policy.one_pool, policy.trains_model) == (True, True, True, False)
    gate = policy.scorer
    assert gate.w2.shape == (F,)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, Hk, 10, D, generator=g)
    pos = torch.arange(10)[None].expand(2, 10)
    for layer in range(L):  # at init beta = sigmoid(10) for every token
        beta = policy.scores(layer, k, v, pos).prio.exp()
        assert beta.shape == (2, Hk, 10) and torch.allclose(beta, torch.sigmoid(torch.tensor(INIT_LOGIT, dtype=torch.float64)), rtol=0, atol=1e-15)
    torch.nn.init.normal_(gate.w2, std=0.5, generator=g)
    with torch.no_grad():
        before = [gate.logits(layer, k, v) for layer in range(L)]
        gate.w2.add_(0.1)
        after = [gate.logits(layer, k, v) for layer in range(L)]
    assert all((a - b).abs().min() > 0 for a, b in zip(after, before))  # one w2 scales every layer and head


def test_training_updates_the_gate_only_and_exports(tmp_path, tiny_tokenizer):
    from kvpop.config import TrainConfig
    from kvpop.export import export, load_export
    from kvpop.train import PackedDataset, build_training

    teacher, _ = tiny_pair()
    ids, doc, pos = packed_toy(4, 64)
    cfg = TrainConfig(steps=2, batch_size=2, top_logits=16, scorer_hidden=8, model_lr=1e-3, precision="32-true", accelerator="cpu")
    training = build_training(teacher, "dbtrimkv", PackedDataset(ids, doc, pos, (doc >= 0).long()), cfg=cfg, layout=CacheLayout(13, SINKS, WINDOW), seed=0)
    before = copy.deepcopy(training.student.state_dict())
    gate_before = copy.deepcopy(training.policy.state_dict())
    trainer = training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    assert all(torch.equal(before[k], v) for k, v in training.student.state_dict().items())  # the base model is frozen
    assert any(not torch.equal(gate_before[k], v) for k, v in training.policy.state_dict().items())
    m = trainer.callback_metrics
    assert "train/capacity_loss" in m and 0 < float(m["train/beta_mean"]) <= 1 and "train/score_loss" not in m

    policy = training.policy
    export(training.student, tiny_tokenizer, policy, tmp_path / "export", layout=CacheLayout(13, SINKS, WINDOW))
    _, _, loaded, meta = load_export(tmp_path / "export")
    assert meta["policy"] == "dbtrimkv" and type(loaded) is type(policy)
    k, v = torch.randn(2, 1, 2, 9, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer in range(2):
            assert torch.equal(loaded.scorer.logits(layer, k, v), policy.scorer.logits(layer, k, v))

