"""One pattern, three executors: the dense boolean mask, the BlockMask and a chunk's factored rows agree, and the budget holds."""

import pytest
import torch

from kvpop.masks import ChunkRows, block_mask_from_eviction_times, dense_mask, make_eviction_mask_mod
from kvpop.selection import NEVER, eviction_times

from conftest import packed_toy


def _evict(B, Hk, S, doc, pos, sinks, window, k, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    prio = torch.randint(0, 3, (B, Hk, S), generator=g).double() if ties else torch.randn(B, Hk, S, generator=g, dtype=torch.float64)
    return eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k)


@pytest.mark.parametrize("start,length", [(0, 7), (13, 5), (40, 8)])
@pytest.mark.parametrize("group", [1, 2])
def test_a_chunks_factored_rows_are_the_dense_masks(start, length, group):
    """ChunkRows (what every layer shares, once; each layer's eviction times added) against the predicate on the
    chunk's rows, for packed rows with padding, sinks, evicted and never-evicted tokens and several layers' times."""
    B, Hk, S = 2, 2, 48
    _, doc, pos = packed_toy(B, S)
    rows = ChunkRows(doc, pos, start=start, length=length, kv_len=start + length, sinks=2)
    for seed in range(3):  # three layers' times on the same rows
        evict = _evict(B, Hk, S, doc, pos, sinks=2, window=5, k=4, seed=seed)
        mm = make_eviction_mask_mod(doc, pos, evict, sinks=2, group=group)
        want = dense_mask(lambda b, h, q, kv, mm=mm: mm(b, h, q + start, kv), B, Hk * group, length, "cpu", kv_len=start + length, group=group)
        got = rows.allowed(evict, group)
        assert got.shape == want.shape and torch.equal(got, want)
        assert (~got).any() and (evict < S).any()  # the rows hold refused pairs and evicted tokens


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("ties", [False, True])
def test_block_mask_equals_dense_mask(block, ties):
    B, H, Hk, S = 2, 4, 2, 48
    _, doc, pos = packed_toy(B, S)
    evict = _evict(B, Hk, S, doc, pos, sinks=2, window=5, k=4, ties=ties)
    ref = dense_mask(make_eviction_mask_mod(doc, pos, evict, sinks=2, group=H // Hk), B, H, S, "cpu")
    bm = block_mask_from_eviction_times(doc, pos, evict, sinks=2, num_heads=H, block_size=block)
    # every allowed pair lies in a listed block (partial or full) ...
    listed = bm.to_dense().bool()  # (B, H, nb, nb): partial or full
    nb = listed.shape[-1]
    pad = nb * block - S
    ref_p = torch.nn.functional.pad(ref, (0, pad, 0, pad))
    blocks_with_any = ref_p.view(B, H, nb, block, nb, block).any(-1).any(-2)
    assert not (blocks_with_any & ~listed).any(), "an allowed pair falls in a skipped block"
    # ... and every "full" block is entirely allowed (flex skips the mask_mod there)
    full = torch.zeros_like(listed)
    for b in range(B):
        for h in range(H):
            for i in range(nb):
                n = bm.full_kv_num_blocks[b, h, i]
                full[b, h, i, bm.full_kv_indices[b, h, i, :n].long()] = True
    all_allowed = ref_p.view(B, H, nb, block, nb, block).all(-1).all(-2)
    assert not (full & ~all_allowed).any(), "a block marked full holds a masked pair"
    if block == 4:
        assert full.any()  # the bounds do find full blocks


def test_sdpa_and_flex_executors_agree_forward():
    from kvpop.attention import flex_execute, sdpa_execute

    torch.manual_seed(0)
    B, H, Hk, S, D = 2, 4, 2, 48, 16
    _, doc, pos = packed_toy(B, S)
    evict = _evict(B, Hk, S, doc, pos, sinks=2, window=5, k=4)
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, Hk, S, D), torch.randn(B, Hk, S, D)
    allowed = dense_mask(make_eviction_mask_mod(doc, pos, evict, sinks=2, group=2), B, H, S, "cpu")
    o1, l1 = sdpa_execute(q, k, v, allowed, 0.25, need_lse=True)
    bm = block_mask_from_eviction_times(doc, pos, evict, sinks=2, num_heads=H, block_size=16)
    o2, l2 = flex_execute(q, k, v, bm, 0.25, need_lse=True)
    assert torch.allclose(o1, o2, atol=1e-5)
    assert torch.allclose(l1, l2, atol=1e-5)


@pytest.mark.parametrize("k", [0, 1, 7])
def test_no_head_attends_to_more_than_budget(k):
    B, H, Hk, S, sinks, window = 2, 4, 2, 96, 3, 6
    doc = torch.zeros(B, S, dtype=torch.long)
    doc[1, 50:] = 1
    pos = torch.arange(S).repeat(B, 1)
    pos[1, 50:] -= 50
    evict = _evict(B, Hk, S, doc, pos, sinks, window, k, ties=True)
    allowed = dense_mask(make_eviction_mask_mod(doc, pos, evict, sinks=sinks, group=2), B, H, S, "cpu")
    per_query = allowed.sum(-1)
    assert per_query.max() == sinks + window + k
    dense = dense_mask(make_eviction_mask_mod(doc, pos, torch.full_like(evict, NEVER), sinks=sinks, group=2), B, H, S, "cpu")
    assert (per_query == dense.sum(-1).clamp(max=sinks + window + k)).all()  # full budget used once reached
