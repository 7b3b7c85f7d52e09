"""The chunked pool forward (kvpop.pool.pool_chunked) against its twins: the fixed point of
kvpop.evaluate.pool_fixed_point and token-by-token decoding with OnePoolCache; for a one-pool
kvpop_mlp (static priorities) and dbtrimkv (decaying retentions), chunks of every size up to the
window, packed rows, and what it refuses."""

import pytest
import torch

from kvpop.decode import enable, teacher_forced_logits
from kvpop.evaluate import pool_fixed_point
from kvpop.policies import OnePool, make_policy
from kvpop.pool import pool_chunked
from kvpop.selection import global_decaying_eviction_times
from test_dbtrimkv import LAYOUT, WINDOW
from test_one_pool import scorer


@pytest.fixture(scope="module")
def llama(tiny_model):
    return enable(tiny_model("llama"))


def dbtrimkv(seed=0):
    torch.manual_seed(seed)
    policy = make_policy("dbtrimkv", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    with torch.no_grad():
        policy.scorer.w2.normal_(std=2.0)
        policy.scorer.b2.fill_(1.0)  # retentions well below 1: the pool's ranks cross as tokens age
    return policy


POLICIES = {"kvpop_mlp, one pool": lambda: OnePool(scorer(seed=4)), "dbtrimkv": dbtrimkv}


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("chunk", [1, 3, WINDOW])
def test_the_chunked_forward_is_the_fixed_point(llama, name, chunk):
    policy = POLICIES[name]()
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(5))
    want, want_logits = pool_fixed_point(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    got, logits = pool_chunked(llama, policy, ids, layout=LAYOUT, chunk=chunk, keep_logits=True)
    assert torch.equal(got, want.long())
    assert (logits - want_logits).abs().max() < 1e-4
    assert (got < 70).any()  # the pool evicted: the test says something


@pytest.mark.parametrize("name", POLICIES)
def test_the_chunked_forward_is_decoding(llama, name):
    policy = POLICIES[name]()
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(6))
    _, logits = pool_chunked(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    decoded = teacher_forced_logits(llama, policy, ids, layout=LAYOUT, prefill=LAYOUT.budget)
    assert (decoded - logits).abs().max() < 1e-4


def test_the_times_are_the_pools_rule_on_the_priorities_it_recorded(llama):
    """Its recorded priorities, run through the simulation once more, give its times (no stale placeholder)."""
    from kvpop.pool import ChunkContext

    policy = OnePool(scorer(seed=7))
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(8))
    got, _ = pool_chunked(llama, policy, ids, layout=LAYOUT)
    pos = torch.arange(50)[None]
    ctx = ChunkContext(policy, torch.zeros_like(pos), pos, LAYOUT, num_layers=2, evict=got[:, :, :, :])
    with torch.no_grad():
        llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False)  # one chunk of the whole row, under those times
    want = global_decaying_eviction_times(ctx.prio, torch.zeros_like(pos), pos, sinks=LAYOUT.sinks, window=LAYOUT.window,
                                          long_range=LAYOUT.long_range, decays=False)
    assert torch.equal(got, want.long())


def test_packed_rows_start_each_document_with_an_empty_pool(llama):
    """Two documents packed in one row: each gets the times it gets alone."""
    policy = OnePool(scorer(seed=9))
    a = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(10))
    b = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(11))
    row = torch.cat([a, b], 1)
    doc = torch.tensor([[0] * 40 + [1] * 30])
    pos = torch.cat([torch.arange(40), torch.arange(30)])[None]
    got, _ = pool_chunked(llama, policy, row, layout=LAYOUT, doc_ids=doc, pos=pos)
    ea, _ = pool_chunked(llama, policy, a, layout=LAYOUT)
    eb, _ = pool_chunked(llama, policy, b, layout=LAYOUT)
    never_a = ea >= 40
    assert torch.equal(torch.where(never_a, -1, ea), torch.where(got[..., :40] >= 40, -1, got[..., :40]))
    assert torch.equal(torch.where(eb >= 30, -1, eb), torch.where(got[..., 40:] >= 70, -1, got[..., 40:] - 40))


def test_it_refuses_a_chunk_longer_than_the_window_and_a_per_head_policy(llama):
    ids = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk"):
        pool_chunked(llama, OnePool(scorer()), ids, layout=LAYOUT, chunk=WINDOW + 1)
    with pytest.raises(ValueError, match="one_pool"):
        pool_chunked(llama, scorer(), ids, layout=LAYOUT)
