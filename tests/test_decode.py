"""Decode-time policies: TOVA and H2O evict the token their rule names; the generation helper."""

import math

import pytest
import torch

from kvpop.decode import BoundedCache, BoundedLayer, CacheLayout, GenerationStats, generate
from kvpop.policies import H2O, TOVA, Dense, StreamingLLM, make_policy, resolve_policy

# One KV head, one query head, head dim 1, scale 1: the logit of token t is q * key_t.
KEYS = [2.0, -2.0, 0.0, 0.0, 0.0]
QUERIES = [1.0, 1.0, -1.0, 1.0, 1.0]


def run(policy, steps: int) -> tuple[BoundedLayer, list[list[int]]]:
    """Prefill token 0, then decode tokens 1.. ; the layer and its stored positions after every step."""
    layer = BoundedLayer(0, policy, CacheLayout(3, 0, 1, 2))  # window 1 + 2 long-range slots
    kv = torch.tensor(KEYS).view(1, 1, -1, 1)
    q = torch.tensor(QUERIES).view(1, 1, -1, 1)
    stored = []
    for t in range(steps):
        keys, values = layer.update(kv[:, :, t : t + 1], kv[:, :, t : t + 1])
        layer.attend(q[:, :, t : t + 1], keys, values, 1.0)
        stored.append(sorted(p for p in layer.pos[0, 0].tolist() if p >= 0))
    return layer, stored


def weights(t: int) -> list[float]:
    """Attention of query t over tokens 0..t (dense; the cache holds all of them up to t = 2)."""
    e = [math.exp(QUERIES[t] * k) for k in KEYS[: t + 1]]
    return [x / sum(e) for x in e]


def test_tova_evicts_the_least_attended_by_the_latest_query():
    # query 2 (q = -1) attends token 1 most and token 0 least: at step 3, token 2 leaves the window
    # and replaces token 0, the long-range slot with the lowest weight
    w2 = weights(2)
    assert w2[0] < w2[2] < w2[1]
    _, stored = run(TOVA(), 4)
    assert stored == [[0], [0, 1], [0, 1, 2], [1, 2, 3]]


def test_h2o_keeps_the_heavy_hitters():
    # accumulated attention after query 2: token 0 ~ 2.0, token 1 ~ 0.88, token 2 ~ 0.12; at
    # step 3 the leaver (token 2) is below both long-range slots and is dropped
    acc = [sum(weights(q)[t] for q in range(t, 3)) for t in range(3)]
    assert acc[2] < acc[1] < acc[0]
    assert stored_at(H2O(), 3) == pytest.approx(dict(enumerate(acc)))  # the statistic is the accumulated weight
    _, stored = run(H2O(), 4)
    assert stored == [[0], [0, 1], [0, 1, 2], [0, 1, 3]]


def stored_at(policy, steps: int) -> dict[int, float]:
    """Position -> priority of the stored tokens after ``steps`` steps."""
    layer, _ = run(policy, steps)
    return {p: s for p, s in zip(layer.pos[0, 0].tolist(), layer.prio[0, 0].tolist()) if p >= 0}


def test_h2o_prefill_accumulates_prompt_attention():
    """A 3-token prompt into 1 long-range slot + window 1: the most-attended prompt token survives."""
    layer = BoundedLayer(0, H2O(), CacheLayout(2, 0, 1, 1))
    kv = torch.tensor(KEYS[:3]).view(1, 1, 3, 1)
    q = torch.tensor(QUERIES[:3]).view(1, 1, 3, 1)
    keys, values = layer.update(kv, kv)
    out = layer.attend(q, keys, values, 1.0)
    assert out.shape == (1, 3, 1, 1)
    assert sorted(layer.pos[0, 0].tolist()) == [0, 2]  # token 0 (~2.0) beats token 1 (~0.88)
    tova = BoundedLayer(0, TOVA(), CacheLayout(2, 0, 1, 1))
    tova.update(kv, kv)
    tova.attend(q, kv, kv, 1.0)
    assert sorted(tova.pos[0, 0].tolist()) == [1, 2]  # the last query attends token 1 most


def test_policy_names_and_errors():
    assert isinstance(resolve_policy("dense"), Dense) and not resolve_policy("dense").evicts
    assert resolve_policy("tova").needs_attention and resolve_policy("h2o").needs_attention
    assert resolve_policy("streaming_llm").name == "streaming_llm"
    mlp = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    assert resolve_policy("kvpop_mlp", mlp) is mlp
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        resolve_policy("nope")
    with pytest.raises(ValueError, match="needs an export"):
        resolve_policy("kvpop_mlp")
    with pytest.raises(ValueError, match="needs an export"):
        resolve_policy("streaming_llm_plus", mlp)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


def test_generate_helper(model, tiny_tokenizer):
    prompt = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    kw = dict(layout=CacheLayout(16, 2, 8), max_new_tokens=30, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    outs = {}
    for name in ("dense", "streaming_llm", "tova", "h2o"):
        new, stats = generate(model, tiny_tokenizer, resolve_policy(name), prompt, **kw)
        assert isinstance(stats, GenerationStats) and new.shape == (2, 30)
        assert stats.tokens_per_s > 0 and stats.peak_cache_mb > 0
        outs[name] = (new, stats)
    # bounded caches are smaller than the dense one at 54 tokens
    assert outs["streaming_llm"][1].peak_cache_mb < outs["dense"][1].peak_cache_mb
    # sampling is reproducible from the seed
    a, _ = generate(model, tiny_tokenizer, TOVA(), prompt[0].tolist(), **dict(kw, temperature=0.8, top_p=0.9, top_k=20, seed=7))
    b, _ = generate(model, tiny_tokenizer, TOVA(), prompt[0].tolist(), **dict(kw, temperature=0.8, top_p=0.9, top_k=20, seed=7))
    assert torch.equal(a, b) and a.shape[0] == 1 and 1 <= a.shape[1] <= 30  # may stop at EOS


def test_attention_rules_decode_a_real_model(model):
    """TOVA and H2O run inside a model: flat memory and a valid cache after a long decode."""
    from kvpop.decode import enable

    enable(model)
    for policy in (TOVA(), H2O()):
        cache = BoundedCache(model.config, policy, layout=CacheLayout(12, 1, 4))
        ids = torch.randint(0, 96, (2, 20))
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
            size = cache.cache_bytes()
            for _ in range(30):
                model(input_ids=ids[:, :1], past_key_values=cache)
        assert cache.cache_bytes() == size and cache.get_seq_length() == 50
        pos = cache.layers[1].pos
        assert (pos >= 0).all() and (pos[..., :1] == 0).all()  # full, sink kept
        assert sorted(pos[0, 0, 1:5].tolist()) == [46, 47, 48, 49]  # the window
        assert torch.isfinite(cache.layers[1].prio).all()


def test_recency_policy_instance_is_accepted(model):
    cache = BoundedCache(model.config, StreamingLLM(), layout=CacheLayout(10, 2, 4))
    assert cache.policy.name == "streaming_llm" and not cache.policy.needs_attention


def kvpop_policy():
    torch.manual_seed(1)
    policy = make_policy("kvpop", num_layers=2, num_kv_heads=2, head_dim=16, scorer_dk=4, scorer_dv=4)
    with torch.no_grad():
        for cell in policy.scorer.layers:
            cell.w_gate.normal_(0.0, 0.2)
    return policy


def test_kvpop_policy_and_generate(model, tiny_tokenizer):
    """kvpop decodes from an export's policy: delayed scoring, its own k at the nominal budget."""
    from kvpop.decode import teacher_forced_logits

    kvpop = kvpop_policy()
    policy = resolve_policy("kvpop", kvpop)
    assert policy is kvpop and policy.scores_on_exit
    with pytest.raises(ValueError, match="needs an export"):
        resolve_policy("kvpop")
    with pytest.raises(ValueError, match="needs an export"):
        resolve_policy("kvpop", make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16))
    prompt = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    kw = dict(layout=CacheLayout(16, 2, 8), max_new_tokens=30, temperature=0.0, seed=0)
    new, stats = generate(model, tiny_tokenizer, policy, prompt, **kw)
    assert new.shape == (2, 30) and stats.new_tokens == 60 and stats.peak_cache_mb > 0 and stats.path == "engine"
    # the engine's tokens are the greedy choices under the reference cache, token by token
    ids = torch.cat([prompt, new], 1)
    logits = teacher_forced_logits(model, policy, ids[:, :-1], layout=CacheLayout(16, 2, 8), prefill=24)
    assert torch.equal(logits[:, 23:].argmax(-1), new)
    # cache + state at the nominal budget: about the kvpop_mlp cache (state 4 x 4 + 4 + 1 = 21 numbers = 1 slot),
    # on the reference cache (the engine pads its slots to the attention block)
    _, stats = generate(model, tiny_tokenizer, policy, prompt, path="reference", **dict(kw, max_new_tokens=2))
    mlp = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16)
    _, mlp_stats = generate(model, tiny_tokenizer, mlp, prompt, path="reference", **dict(kw, max_new_tokens=2))
    assert 0.9 * mlp_stats.peak_cache_mb < stats.peak_cache_mb <= mlp_stats.peak_cache_mb


def test_the_documented_transformers_snippet_decodes_with_the_bounded_cache(tiny_llama_dir):
    """The documentation's ``model.generate`` snippet (docs/decoding.md) runs as written (a tiny model, a small context so that
    eviction happens) and gives the tokens of the library's reference path at the same budget."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "docs" / "decoding.md").read_text()
    code = re.search(r"```python\n(# a bounded KV cache in model\.generate\n.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 12
    code = code.replace('path = "models/base"', f"path = {str(tiny_llama_dir)!r}")
    code = code.replace("compression, context = 0.88, 8192", "compression, context = 0.75, 48").replace("sinks=4, window=256", "sinks=2, window=6")
    ns: dict = {}
    exec(compile(code, "docs/decoding.md", "exec"), ns)
    ids, out, cache, model, tok = ns["ids"], ns["out"], ns["cache"], ns["model"], ns["tok"]
    assert isinstance(cache, BoundedCache) and cache.budget == 12 and out.shape[1] > cache.budget
    pos = cache.layers[0].pos  # (B, Hk, slots): generate wrote through the cache, and it evicted
    assert (pos >= 0).all() and pos.max() == out.shape[1] - 2 and pos.shape[-1] == cache.slots
    want, _ = generate(model, tok, make_policy("tova"), ids, layout=CacheLayout(12, 2, 6), max_new_tokens=32, path="reference")  # new tokens
    new = out[:, ids.shape[1] :]
    n = min(new.shape[1], want.shape[1])
    assert n > 0 and torch.equal(new[:, :n], want[:, :n])
