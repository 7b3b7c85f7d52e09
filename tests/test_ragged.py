"""Prompts of different lengths on the engine (:func:`kvpop.decode.generate.engine_generate_ragged`): their common
length prefilled as one batch, each row's cache then moved into an engine of batch 1
(:meth:`kvpop.decode.engine.DecodeEngine.load_row`) to finish its own prompt and decode. Twins: every prompt
generated alone (:func:`kvpop.decode.generate.engine_generate`), for every kind of engine (dense, bounded static,
the delayed mLSTM, pooled static and decaying). CUDA: tests/test_gpu.py."""

import pytest
import torch

from kvpop.decode import DecodeEngine, enable
from kvpop.decode.generate import engine_generate, engine_generate_ragged
from kvpop.geometry import CacheLayout
from kvpop.policies import OnePool, make_policy
from test_engine import engine_logits

SINKS, WINDOW, K = 4, 16, 12
LAYOUT = CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW)
NAMES = ["dense", "streaming_llm", "kvpop_mlp", "kvpop", "dbtrimkv", "kvpop_mlp_pool", "kvpop_pool", "one_pool_mlp"]
EOS = torch.tensor([], dtype=torch.long)  # no EOS: every answer runs to its max_new_tokens


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_model):
    return enable(tiny_model(request.param))


def make(name: str):
    """The policy (None: dense) with random weights, on the tiny models (2 layers, 2 KV heads, head dim 16)."""
    if name == "dense":
        return None
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    policy = make_policy("kvpop_mlp" if name == "one_pool_mlp" else name, **shape)
    torch.manual_seed(5)
    for p in policy.parameters():
        torch.nn.init.normal_(p, std=0.5)
    if name == "dbtrimkv":
        policy.scorer.b2.data.fill_(2.0)  # retention around logsigmoid(2): some tokens decay fast, some slowly
    return OnePool(policy) if name == "one_pool_mlp" else policy


def engines(model, policy, batch: int, max_len: int) -> tuple[DecodeEngine, DecodeEngine]:
    kw = dict(layout=LAYOUT, max_len=max_len, chunk=128)
    return DecodeEngine(model, policy, batch_size=batch, **kw), DecodeEngine(model, policy, batch_size=1, **kw)


def prompts(lengths, seed=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", NAMES)
def test_a_loaded_row_continues_as_if_prefilled_alone(model, name):
    """Three prompts of one length prefilled together; row 1 loaded into an engine of batch 1 and teacher-forced on:
    the logits of an engine that prefilled row 1 alone (one chunk into the cache's eviction, 70 > budget 32)."""
    policy = make(name)
    many, single = engines(model, policy, 3, 100)
    tokens = torch.tensor(prompts([90, 90, 90]))
    many.prefill(tokens[:, :70])
    single.load_row(many, 1)
    got = engine_logits_from(single, tokens[1:2, 70:])
    alone = DecodeEngine(model, policy, layout=LAYOUT, max_len=100, batch_size=1, chunk=128)
    want = engine_logits(alone, tokens[1:2], 70)[:, 1:]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def engine_logits_from(eng: DecodeEngine, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-force ``tokens`` (1, n) one step at a time on an engine already holding a prefix -> (1, n, V)."""
    out = []
    for t in range(tokens.shape[1]):
        eng.tok.copy_(tokens[:, t : t + 1])
        out.append(eng.step().clone())
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", [2, 8])
def test_ragged_prompts_get_the_answers_they_get_alone(model, name, batch):
    """Five prompts of 45-90 tokens (two of equal length), answers of 3-12 tokens: each answer equals the prompt's
    own engine_generate; batch 2 forms groups by length, batch 8 repeats the last prompt in its one group."""
    policy = make(name)
    lengths, new = [70, 45, 90, 45, 61], [12, 5, 3, 9, 7]
    ps = prompts(lengths)
    many, single = engines(model, policy, batch, 102)
    got = engine_generate_ragged(many, single, ps, max_new_tokens=new, eos=EOS, pad=0)
    alone = DecodeEngine(model, policy, layout=LAYOUT, max_len=102, batch_size=1, chunk=128)
    want = [engine_generate(alone, torch.tensor([p]), max_new_tokens=n, eos=EOS, pad=0)[0].tolist() for p, n in zip(ps, new)]
    assert got == want
    assert [len(a) for a in got] == new


def test_ragged_stops_at_eos(model):
    """A row stops at its first EOS, as engine_generate's does."""
    policy = make("kvpop_mlp")
    ps = prompts([50, 64])
    many, single = engines(model, policy, 2, 100)
    free = engine_generate_ragged(many, single, ps, max_new_tokens=10, eos=EOS, pad=0)
    stop = free[1][3]  # the fourth token of the second answer ends it
    got = engine_generate_ragged(many, single, ps, max_new_tokens=10, eos=torch.tensor([stop]), pad=0)
    assert got == [a[: a.index(stop) + 1] if stop in a else a for a in free]
    assert len(got[1]) <= 4


def test_bad_use_is_refused(model):
    policy = make("kvpop_mlp")
    many, single = engines(model, policy, 2, 100)
    with pytest.raises(ValueError, match="batch 1"):
        many.load_row(single, 0)
    with pytest.raises(ValueError, match="row 2"):
        single.load_row(many, 2)
    other = DecodeEngine(model, policy, layout=LAYOUT, max_len=90, batch_size=2, chunk=128)
    with pytest.raises(ValueError, match="same model, policy, layout and max_len"):
        single.load_row(other, 0)
    with pytest.raises(ValueError, match="an engine of batch 1, got one of batch 2"):
        engine_generate_ragged(many, many, [[1, 2]], max_new_tokens=2, eos=EOS, pad=0)
    with pytest.raises(ValueError, match="empty prompt"):
        engine_generate_ragged(many, single, [[1, 2], []], max_new_tokens=2, eos=EOS, pad=0)
    with pytest.raises(ValueError, match="2 max_new_tokens for 3 prompts"):
        engine_generate_ragged(many, single, [[1], [2], [3]], max_new_tokens=[2, 2], eos=EOS, pad=0)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1 for every prompt, got 0"):
        engine_generate_ragged(many, single, [[1], [2]], max_new_tokens=[2, 0], eos=EOS, pad=0)
