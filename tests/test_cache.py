"""The bounded cache: decoding reproduces the training pattern, memory is flat, generate works."""

import pytest
import torch
from transformers import DynamicCache

from kvpop.attention import SparseContext
from kvpop.decode import BoundedCache, BoundedLayer, CacheLayout, enable, teacher_forced_logits
from kvpop.policies import Dense, StreamingLLM, make_policy
from kvpop.selection import eviction_times

SINKS, WINDOW, K = 2, 8, 6
BUDGET = SINKS + WINDOW + K
LAYOUT = CacheLayout(BUDGET, SINKS, WINDOW)  # K long-range slots


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_model):
    return enable(tiny_model(request.param))


def policies():
    torch.manual_seed(1)
    mlp = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    dms = make_policy("dms", num_layers=2, num_kv_heads=2, head_dim=16)
    for p in dms.parameters():  # a gate that evicts some tokens and keeps others
        torch.nn.init.normal_(p, std=0.3)
    tilted = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8, scorer_recency=0.05)
    for p in tilted.scorer.layers.parameters():  # a scorer that ranks, and an age decay that competes with it
        torch.nn.init.normal_(p, std=0.5)
    share = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8, scorer_recency=0.5,
                        scorer_recency_space="share")
    for p in share.scorer.layers.parameters():  # the decay on the share's scale, against shares exp(r_hat) of about 0.1-100
        torch.nn.init.normal_(p, std=0.5)
    return {"recency": StreamingLLM(), "mlp": mlp, "dms": dms, "mlp+recency": tilted, "mlp+share": share}


def training_logits(model, policy, ids, *, sinks=SINKS, window=WINDOW, k=K):
    """The training-time masked forward: one document, pos = arange, SDPA executor."""
    B, S = ids.shape
    pos = torch.arange(S).expand(B, S)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), executor="sdpa")
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits


@pytest.mark.parametrize("policy_name", ["recency", "mlp", "dms", "mlp+recency", "mlp+share"])
@pytest.mark.parametrize("prefill", [1, 30])
def test_decoding_equals_training_pattern(model, policy_name, prefill):
    policy = policies()[policy_name]
    ids = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(2))
    ref = training_logits(model, policy, ids)
    got = teacher_forced_logits(model, policy, ids, layout=LAYOUT, prefill=prefill)
    assert (got - ref).abs().max() < 1e-4
    # the pattern matters: dense attention gives other logits
    assert (training_logits(model, Dense(), ids) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("prefill", [1, 30])
def test_budget_above_length_is_dense(model, prefill):
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        cache = DynamicCache(config=model.config)
        dense = torch.cat([model(input_ids=ids[:, :prefill], past_key_values=cache).logits]
                          + [model(input_ids=ids[:, t : t + 1], past_key_values=cache).logits for t in range(prefill, 40)], 1)
    for policy in policies().values():
        if policy.gated:  # a gate evicts at the window whatever the budget (covered by the other tests)
            continue
        got = teacher_forced_logits(model, policy, ids, layout=CacheLayout(48, SINKS, WINDOW), prefill=prefill)
        assert (got - dense).abs().max() < 1e-4
    assert (dense - plain).abs().max() < 1e-4


@pytest.mark.parametrize("prefill", [1, 13, 40])
@pytest.mark.parametrize("sinks,window,k", [(2, 4, 3), (0, 1, 2), (3, 5, 0)])
def test_stored_tokens_follow_eviction_times(prefill, sinks, window, k, tie_policy):
    """After every step, each (row, KV head) stores exactly the tokens the selection keeps at that query."""
    B, Hk, S, D = 2, 2, 40, 4
    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(B, Hk, S, D, generator=g), torch.randn(B, Hk, S, D, generator=g)
    # ties: priorities (pos + KV head) mod 3, different per head, exercise the newer-wins rule
    for policy in (tie_policy(per_head_shift=True, name="ties"), StreamingLLM()):
        pos = torch.arange(S).expand(B, S)
        evict = eviction_times(policy.scores(0, keys, values, pos).prio, torch.zeros_like(pos), pos, sinks=sinks, window=window, long_range=k)
        layer = BoundedLayer(0, policy, CacheLayout(sinks + window + k, sinks, window, k))
        q = torch.randn(B, 2 * Hk, 1, D)
        kk, vv = layer.update(keys[:, :, :prefill], values[:, :, :prefill])
        layer.attend(q.expand(-1, -1, prefill, -1), kk, vv, 1.0)
        for t in range(prefill - 1, S):
            if t >= prefill:
                kk, vv = layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
                layer.attend(q, kk, vv, 1.0)
            assert layer.get_seq_length() == t + 1
            idx = torch.arange(t + 1)
            for b in range(B):
                for h in range(Hk):
                    kept = idx[(idx < sinks) | (evict[b, h, : t + 1] > t)]
                    stored = layer.pos[b, h][layer.pos[b, h] >= 0].sort().values
                    assert stored.tolist() == kept.tolist(), (policy.name, b, h, t)
                    assert torch.equal(layer.keys[b, h][layer.pos[b, h] >= 0][layer.pos[b, h][layer.pos[b, h] >= 0].argsort()], keys[b, h, stored])


def test_memory_is_flat(model):
    cache = BoundedCache(model.config, StreamingLLM(), layout=LAYOUT)
    ids = torch.randint(0, 96, (2, 4))
    sizes = {}
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        for step in range(1, 301):
            model(input_ids=ids[:, :1], past_key_values=cache)
            if step in (50, 300):
                sizes[step] = cache.cache_bytes()
    assert sizes[50] == sizes[300] > 0
    assert cache.get_seq_length() == 304
    # (B, Hk, T, D) keys and values in float32, (B, Hk, T) float64 priorities and int64 positions
    assert sizes[50] == 2 * (2 * 2 * 2 * BUDGET * 16 * 4 + 2 * 2 * 2 * BUDGET * 8)


def test_model_generate_batch2_greedy(model):
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(5))
    policy = policies()["mlp"]
    cache = BoundedCache(model.config, policy, layout=LAYOUT)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=20,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape == (2, 50) and cache.get_seq_length() == 49
    # the generated tokens are the greedy choices under the same cache, token by token
    logits = teacher_forced_logits(model, policy, out[:, :-1], layout=LAYOUT, prefill=30)
    assert torch.equal(logits[:, 29:].argmax(-1), out[:, 30:])
    # with budget >= length the bounded cache generates exactly what the dense cache does
    big = BoundedCache(model.config, policy, layout=CacheLayout(64, SINKS, WINDOW))
    a = model.generate(ids, past_key_values=big, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    b = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(a, b)


def test_unsupported_uses_fail_clearly(model):
    ids = torch.randint(0, 96, (2, 12))
    cache = BoundedCache(model.config, StreamingLLM(), layout=LAYOUT)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(NotImplementedError, match="padded"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    cache = BoundedCache(model.config, StreamingLLM(), layout=LAYOUT)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        with pytest.raises(NotImplementedError, match="one at a time"):
            model(input_ids=ids[:, :2], past_key_values=cache)
    with pytest.raises(ValueError, match=r"budget \(5\) must be >= sinks \+ window = 2 \+ 8"):
        BoundedCache(model.config, StreamingLLM(), layout=CacheLayout(5, 2, 8))
    with pytest.raises(ValueError, match="never evicts"):
        BoundedCache(model.config, Dense(), layout=LAYOUT)


def test_model_without_enable_is_rejected(tiny_model):
    plain = tiny_model("llama")  # sdpa, no hook
    cache = BoundedCache(plain.config, StreamingLLM(), layout=LAYOUT)
    ids = torch.randint(0, 96, (1, 5))
    with torch.no_grad():
        plain(input_ids=ids, past_key_values=cache)
        with pytest.raises(RuntimeError, match="enable"):
            plain(input_ids=ids[:, :1], past_key_values=cache)


# --- kvpop: the delayed mLSTM scorer, scored when a token leaves the window ----------------------
KVPOP_BUDGET = BUDGET + 9  # nominal: its state (16 x 16 + 16 + 1 numbers) costs 9 slots at head_dim 16


def kvpop_policy():
    torch.manual_seed(3)
    policy = make_policy("kvpop", num_layers=2, num_kv_heads=2, head_dim=16)
    with torch.no_grad():  # data-dependent gates of moderate spread (float32 read-out, see test_mlstm)
        for cell in policy.scorer.layers:
            cell.w_gate.normal_(0.0, 0.2)
    return policy


@pytest.mark.parametrize("prefill", [1, 30])  # 30 > KVPOP_BUDGET: the prompt already evicts
def test_kvpop_decoding_equals_training_pattern(model, prefill):
    policy = kvpop_policy()
    k = policy.long_range_slots(layout=CacheLayout(KVPOP_BUDGET, SINKS, WINDOW), head_dim=16)
    assert k == K
    ids = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(2))
    ref = training_logits(model, policy, ids, k=k)
    got = teacher_forced_logits(model, policy, ids, layout=CacheLayout(KVPOP_BUDGET, SINKS, WINDOW), prefill=prefill)
    assert (got - ref).abs().max() < 1e-4
    # the learned scores matter: recency at the same k gives other logits
    assert (training_logits(model, StreamingLLM(), ids, k=k) - ref).abs().max() > 1e-2
