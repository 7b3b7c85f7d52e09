"""The bounded cache with a delayed policy (``kvpop``): the mLSTM state lives in the cache, a token is
scored when it leaves the window, the stored tokens follow the training pattern, memory is flat."""

import pytest
import torch

from kvpop.decode import BoundedCache, BoundedLayer, CacheLayout, enable
from kvpop.mlstm import state_numbers
from kvpop.modeling import tiny_config
from kvpop.policies import make_policy
from kvpop.selection import eviction_times


def kvpop_policy(head_dim, *, gate_std, dtype=torch.float32, d=4, seed=0, **kw):
    torch.manual_seed(seed)
    policy = make_policy("kvpop", num_layers=2, num_kv_heads=2, head_dim=head_dim, scorer_dk=d, scorer_dv=d, **kw)
    with torch.no_grad():
        for cell in policy.scorer.layers:
            cell.w_gate.normal_(0.0, gate_std)
    return policy.to(dtype)


def test_capabilities():
    kvpop = kvpop_policy(16, gate_std=0.2)
    mlp = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    assert kvpop.scores_on_exit and kvpop.chunked_prefill and not kvpop.layer_independent
    assert not mlp.scores_on_exit and not mlp.chunked_prefill
    with pytest.raises(NotImplementedError, match="no recurrent state"):
        mlp.init_state(0, 1, "cpu")  # a static rule has no delayed hooks
    cfg = tiny_config("llama")
    with pytest.raises(ValueError, match="never evicts"):
        BoundedCache(cfg, make_policy("dense"), layout=CacheLayout(20, 2, 8))
    # the cache takes the policy's k at the nominal budget
    assert BoundedCache(cfg, kvpop, layout=CacheLayout(20, 2, 8)).long_range == kvpop.long_range_slots(layout=CacheLayout(20, 2, 8), head_dim=16) == 9
    assert BoundedCache(cfg, mlp, layout=CacheLayout(20, 2, 8)).long_range == 10
    with pytest.raises(ValueError, match="at least 1 long-range slot"):
        BoundedCache(cfg, kvpop, layout=CacheLayout(11, 2, 8))


def test_prompt_state_equals_stepping():
    """The closed-form state after a prompt equals the recurrent state stepped token by token."""
    policy = kvpop_policy(8, gate_std=1.0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 30, 8, generator=g, dtype=torch.float64)
    for layer in (0, 1):
        state = policy.init_state(layer, 2, "cpu")
        for t in range(30):
            state = policy.step(layer, state, k[:, :, t], v[:, :, t])
        _, closed = policy.prefill(layer, k, v, torch.arange(30).expand(2, 30), window=4)
        for a, b in zip(state, closed, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("prefill", [1, 13, 40])
@pytest.mark.parametrize("sinks,window,k,space", [(2, 4, 3, None), (0, 1, 2, None), (3, 5, 0, None), (1, 6, 4, None), (2, 4, 3, "share")])
def test_stored_tokens_follow_eviction_times(prefill, sinks, window, k, space):
    """After every step each (row, KV head) stores exactly the tokens that the training pattern (the
    parallel-form priorities over the whole sequence) keeps at that query; long-range slots carry
    those priorities, sinks and window tokens none (NaN). ``space="share"``: with an age decay on the
    share's scale (kvpop.scorer)."""
    B, Hk, S, D = 2, 2, 40, 8
    kw = {} if space is None else dict(scorer_recency=0.02, scorer_recency_space=space)
    policy = kvpop_policy(D, gate_std=1.0, dtype=torch.float64, **kw)  # float64: exact ranking comparisons
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    values = torch.randn(B, Hk, S, D, generator=g, dtype=torch.float64)
    pos = torch.arange(S).expand(B, S)
    doc = torch.zeros_like(pos)
    layer_idx = 1
    prio = policy.scores(layer_idx, keys, values, pos, doc_ids=doc, window=window).prio
    evict = eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k)
    layer = BoundedLayer(layer_idx, policy, CacheLayout(sinks + window + k, sinks, window, k))
    q = torch.randn(B, 2 * Hk, 1, D, dtype=torch.float64)
    kk, vv = layer.update(keys[:, :, :prefill], values[:, :, :prefill])
    layer.attend(q.expand(-1, -1, prefill, -1), kk, vv, 1.0)
    idx = torch.arange(S)
    for t in range(prefill - 1, S):
        if t >= prefill:
            kk, vv = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
            layer.attend(q, kk, vv, 1.0)
        for b in range(B):
            for h in range(Hk):
                kept = idx[: t + 1][(idx[: t + 1] < sinks) | (evict[b, h, : t + 1] > t)]
                p = layer.pos[b, h]
                stored = p[p >= 0].sort().values
                assert stored.tolist() == kept.tolist(), (b, h, t)
                lr = p[layer.first_long_range :]
                lr_prio = layer.prio[b, h, layer.first_long_range :][lr >= 0]
                torch.testing.assert_close(lr_prio, prio[b, h, lr[lr >= 0]], rtol=0, atol=1e-9)
                assert layer.prio[b, h, : layer.first_long_range][p[: layer.first_long_range] >= 0].isnan().all()
    assert all(s.shape[0] == B for s in layer.state)


def test_reorder_and_reset_carry_the_state():
    policy = kvpop_policy(4, gate_std=0.5)
    layer = BoundedLayer(0, policy, CacheLayout(6, 1, 2, 3))
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 2, 9, 4, generator=g)
    k, v = layer.update(kv, kv)
    layer.attend(torch.randn(2, 4, 9, 4, generator=g), k, v, 1.0)
    C = layer.state.C.clone()
    assert C.abs().sum() > 0 and not torch.equal(C[0], C[1])
    layer.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.state.C, C.flip(0))
    layer.reset()
    assert (layer.state.C == 0).all() and (layer.state.m == float("-inf")).all() and layer.get_seq_length() == 0


def test_memory_is_flat_and_matches_the_mlp_variant(tiny_model):
    """kvpop at a nominal budget: fewer slots plus the state ~ the kvpop_mlp cache; flat over 50 vs 300 tokens."""
    model = enable(tiny_model("llama"))
    budget, sinks, window = 25, 2, 8
    kvpop = kvpop_policy(16, gate_std=0.2, d=16)  # state 16 x 16 + 16 + 1 = 273 numbers = 9 slots' worth
    mlp = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    cache = BoundedCache(model.config, kvpop, layout=CacheLayout(budget, sinks, window))
    ref = BoundedCache(model.config, mlp, layout=CacheLayout(budget, sinks, window))
    ids = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(0))
    sizes = {}
    with torch.no_grad():
        model(input_ids=ids, past_key_values=ref)
        model(input_ids=ids, past_key_values=cache)
        for step in range(1, 301):
            model(input_ids=ids[:, step % 4 : step % 4 + 1], past_key_values=cache)
            if step in (50, 300):
                sizes[step] = cache.cache_bytes()
            if step < 30:  # past its budget too: a bounded cache holds no more slots than tokens seen
                model(input_ids=ids[:, step % 4 : step % 4 + 1], past_key_values=ref)
    assert sizes[50] == sizes[300] and cache.get_seq_length() == 304
    L, B, Hk, D = 2, 2, 2, 16
    T = sinks + window + cache.long_range
    assert cache.long_range == 6 and ref.long_range == 15
    # keys + values float32, priorities float64, positions int64 per slot; the float32 state
    assert sizes[50] == L * B * Hk * (T * (2 * D * 4 + 8 + 8) + state_numbers(16, 16) * 4)
    assert ref.cache_bytes() == L * B * Hk * budget * (2 * D * 4 + 8 + 8)
    # close: the state costs at most the keys and values of the slots given up; the bookkeeping
    # (priority, position) of those slots is saved too
    assert 0.9 * ref.cache_bytes() < sizes[50] <= ref.cache_bytes()
    assert torch.isfinite(cache.layers[1].prio[..., cache.layers[1].first_long_range :]).all()  # long-range slots all scored
