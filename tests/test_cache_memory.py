"""A bounded cache never holds more keys and values than dense, on both decode paths: a context shorter
than the budget takes only its own tokens' slots, and from the budget on the cache stays flat.

Bytes per slot, layer, KV head and row (float32, head dim D): keys and values ``2 * 4 * D``; the dense
engine adds an int64 position, transformers' DynamicCache (the reference path's dense) nothing; a
bounded cache adds a float64 priority and an int64 position, a pool entry also its int64 pair, and a
delayed rule (``kvpop``) its recurrent state, a fixed size. The tests count every buffer.
"""

import pytest
import torch

from kvpop.decode import BoundedCache, DecodeEngine, enable, generate, never_evicts
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy, resolve_policy
from kvpop.rollouts import memory_curve

SINKS, WINDOW, K = 4, 16, 12
LAYOUT = CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW)  # 32 slots
B = 2


@pytest.fixture(scope="module")
def model(tiny_model):
    m = enable(tiny_model("llama"))
    m.generation_config.eos_token_id = None  # no early stop: the DynamicCache holds every token fed
    return m


def shape(model) -> dict:
    cfg = model.config
    return dict(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)


def policy(model, name: str):
    torch.manual_seed(3)
    pol = make_policy(name, **shape(model), scorer_hidden=8)
    for p in pol.parameters():  # a scorer that ranks
        torch.nn.init.normal_(p, std=0.3)
    return pol


def kv_bytes(model, tokens: int) -> int:
    """Keys and values of ``tokens`` slots in every layer, KV head and row."""
    s = shape(model)
    return B * s["num_layers"] * s["num_kv_heads"] * tokens * 2 * 4 * s["head_dim"]


def bookkeeping(model, tokens: int, per_slot: int) -> int:
    """``per_slot`` bytes per slot of ``tokens`` slots in every layer, KV head and row."""
    s = shape(model)
    return B * s["num_layers"] * s["num_kv_heads"] * tokens * per_slot


def state_bytes(states) -> int:
    return sum(t.numel() * t.element_size() for s in states for t in s)


def prompt(n: int) -> torch.Tensor:
    return torch.randint(3, 96, (B, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("name", ["streaming_llm", "kvpop_mlp", "kvpop", "dms"])
def test_engine_holds_the_context_up_to_the_budget(model, name):
    """The engine sized for a generation (prompt + new tokens, as kvpop.decode.generate builds it) holds
    min(slots, prompt + new) slots: the dense engine's keys and values below the budget, flat from there."""
    pol = policy(model, name)
    slots = LAYOUT.for_policy(pol, head_dim=shape(model)["head_dim"]).slots  # kvpop: fewer, for its state
    sizes = {}
    for S, N in ((10, 6), (20, 11), (30, 10), (60, 20)):
        eng = DecodeEngine(model, pol, layout=LAYOUT, max_len=S + N, batch_size=B)
        dense = DecodeEngine(model, None, max_len=S + N, batch_size=B)
        assert eng.generate(prompt(S), N).shape == (B, N)
        held = min(slots, S + N)
        assert eng.keys[0].shape[2] == held
        state = state_bytes(eng.state)
        # every buffer: keys, values, an int64 position and a float64 priority per held slot, and the state
        assert eng.cache_bytes() == kv_bytes(model, held) + bookkeeping(model, held, 16) + state
        assert dense.cache_bytes() == kv_bytes(model, S + N) + bookkeeping(model, S + N, 8)
        # never more keys and values than dense; beyond them only the priorities and a delayed rule's state
        assert kv_bytes(model, held) <= kv_bytes(model, S + N)
        assert eng.cache_bytes() <= dense.cache_bytes() + bookkeeping(model, held, 8) + state
        if S + N < slots:
            assert eng.cache_bytes() < DecodeEngine(model, pol, layout=LAYOUT, batch_size=B).cache_bytes()
        sizes[S + N] = eng.cache_bytes()
    # at and after the budget: flat, the budget-sized engine's memory
    assert sizes[40] == sizes[80] == DecodeEngine(model, pol, layout=LAYOUT, batch_size=B).cache_bytes()
    assert sizes[16] < sizes[31] < sizes[40] or slots < 31


def test_the_engine_refuses_tokens_beyond_its_length(model):
    pol = policy(model, "kvpop_mlp")
    eng = DecodeEngine(model, pol, layout=LAYOUT, max_len=12, batch_size=B)
    eng.prefill(prompt(10))
    eng.step(), eng.step()
    with pytest.raises(ValueError, match="holds 12 tokens.*overflow"):
        eng.step()
    eng.reset()
    with pytest.raises(ValueError, match="holds 12 tokens.*overflow"):
        eng.prefill(prompt(13))
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        DecodeEngine(model, pol, layout=LAYOUT, max_len=0)


@pytest.mark.parametrize("path", ["engine", "reference"])
def test_generate_reports_no_more_than_dense(model, tiny_tokenizer, path):
    """The evaluate stage's peak_cache_mb (kvpop.decode.generate's stats): a generation that fits in a
    rule's slots is decoded with dense's cache and costs exactly dense's bytes; from the budget on a
    bounded cache is flat. Every byte is accounted for."""
    rules = ["streaming_llm", "kvpop_mlp", "kvpop"] + (["tova", "dbtrimkv"] if path == "reference" else [])
    flat: dict[str, set] = {name: set() for name in rules}
    for S, N in ((10, 6), (30, 10), (60, 20)):
        ids = prompt(S)
        tokens = S + N if path == "engine" else S + N - 1  # model.generate never feeds the last new token
        _, dense = generate(model, tiny_tokenizer, resolve_policy("dense"), ids, layout=LAYOUT, max_new_tokens=N, path=path)
        dense_bytes = dense.peak_cache_mb * 2**20
        assert dense_bytes == kv_bytes(model, tokens) + (bookkeeping(model, tokens, 8) if path == "engine" else 0)  # engine: a position
        for name in rules:
            pol = policy(model, name)
            _, stats = generate(model, tiny_tokenizer, pol, ids, layout=LAYOUT, max_new_tokens=N, path=path)
            assert stats.path == path
            slots = LAYOUT.for_policy(pol, head_dim=shape(model)["head_dim"]).slots
            held = min(slots, tokens)
            pairs = bookkeeping(model, max(0, held - SINKS - WINDOW), 8) if pol.one_pool else 0  # a pool entry's layer and head
            state = sum(state_bytes([pol.init_state(i, B, "cpu")]) for i in range(shape(model)["num_layers"])) if pol.scores_on_exit else 0
            got = stats.peak_cache_mb * 2**20
            if S + N <= slots and not pol.gated:  # nothing can be evicted (kvpop.decode.never_evicts): dense's cache, dense's bytes
                assert never_evicts(model, pol, LAYOUT, S + N) and got == dense_bytes, (name, S, N)
                continue
            assert not never_evicts(model, pol, LAYOUT, S + N)  # a gate (dbtrimkv) may evict below its budget: its own cache
            assert got == kv_bytes(model, held) + bookkeeping(model, held, 16) + pairs + state, (name, S, N)
            assert kv_bytes(model, held) <= kv_bytes(model, tokens)
            if tokens < slots:  # the reference cache one token short of the budget: dense's bytes plus a priority and a position
                assert got <= dense_bytes + bookkeeping(model, tokens, 16) + pairs + state
            else:
                flat[name].add(got)
    assert all(len(sizes) == 1 for sizes in flat.values()), flat  # at and after the budget: flat


def test_reference_cache_grows_one_slot_per_token_then_stays_flat(model, tiny_tokenizer):
    """The memory rows' curve (kvpop.rollouts.memory_curve, the reference caches, no length given):
    at every point a bounded cache holds as many slots as the dense DynamicCache holds tokens, up to
    its budget, then stays flat; a given max_len allocates once."""
    ids = list(range(3, 13))  # 10 tokens
    lengths = [0, 5, 10, 21, 22, 30, 40]  # 10 .. 50 tokens seen; the budget (32) at 22
    kw = dict(layout=LAYOUT, lengths=lengths, rows=B)
    dense = dict(memory_curve(model, tiny_tokenizer, resolve_policy("dense"), ids, **kw))
    for name in ("streaming_llm", "kvpop_mlp", "tova", "dbtrimkv"):
        pol = policy(model, name)
        curve = dict(memory_curve(model, tiny_tokenizer, pol, ids, **kw))
        for n in lengths:
            seen = 10 + n
            assert dense[n] * 2**20 == kv_bytes(model, seen)
            held = min(seen, LAYOUT.slots)
            pool = 8 * max(0, held - SINKS - WINDOW) if name == "dbtrimkv" else 0
            assert curve[n] * 2**20 == kv_bytes(model, held) + bookkeeping(model, held, 16) + bookkeeping(model, 1, pool), (name, n)
        assert curve[22] == curve[30] == curve[40]
    cache = BoundedCache(model.config, policy(model, "kvpop_mlp"), LAYOUT, max_len=20)
    with torch.no_grad():
        model(input_ids=prompt(10), past_key_values=cache)
        assert cache.layers[0].keys.shape[2] == 20  # allocated at once
        for _ in range(15):
            model(input_ids=prompt(1), past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == 25  # a longer sequence than announced still decodes: it grows
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        BoundedCache(model.config, policy(model, "kvpop_mlp"), LAYOUT, max_len=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["streaming_llm", "kvpop_mlp", "kvpop"])
def test_a_sized_engine_compiles_and_graphs_as_the_budget_sized_one(tiny_model, name):
    """CUDA: an engine sized for a short generation (max_len: fewer 128-slot blocks than its budget)
    compiles, captures its CUDA graph and decodes the logits of the eager engine and of the reference
    cache; its memory is its size's, and one token too many is refused."""
    from kvpop.decode import teacher_forced_logits

    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    model = enable(tiny_model("qwen3").cuda())
    layout, S, pre = CacheLayout(300, 4, 32), 100, 60  # 300 slots (3 blocks of 128) against 100 tokens (1 block)
    pol = policy(model, name).cuda()
    ids = torch.randint(3, 96, (B, S), generator=torch.Generator().manual_seed(5)).cuda()
    ref = teacher_forced_logits(model, pol, ids, layout=layout, prefill=pre)
    got = {}
    for compiled in (False, True):
        eng = DecodeEngine(model, pol, layout=layout, max_len=S, batch_size=B, compile=compiled)
        assert eng.T == 128 and eng.keys[0].shape[2] == 128 and eng.slots == S
        logits = [eng.prefill(ids[:, :pre]).clone()]
        for t in range(pre, S):
            eng.tok.copy_(ids[:, t : t + 1])
            logits.append(eng.step().clone())
        got[compiled] = torch.stack(logits, 1)
        with pytest.raises(ValueError, match="overflow"):
            eng.step()
    assert (got[False] - ref[:, pre - 1 :]).abs().max() < 1e-4
    assert (got[True] - got[False]).abs().max() < 1e-4
