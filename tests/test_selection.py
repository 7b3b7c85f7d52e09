"""Tests of kvpop.selection against a brute-force per-query top-k simulation."""

import time

import pytest
import torch

from kvpop.selection import NEVER, document_spans, eviction_times, recency_priority


def random_packing(B, S, doc_lens_choices, pad_max, gen):
    """Random packed rows: several documents per row then padding at the end.

    Returns ``doc_ids (B, S)`` (``-1`` = padding) and ``pos (B, S)``.
    """
    doc_ids = torch.full((B, S), -1, dtype=torch.long)
    pos = torch.zeros((B, S), dtype=torch.long)
    for b in range(B):
        pad = int(torch.randint(0, pad_max + 1, (1,), generator=gen))
        t, d = 0, 0
        while t < S - pad:
            n = doc_lens_choices[int(torch.randint(len(doc_lens_choices), (1,), generator=gen))]
            n = min(n, S - pad - t)
            doc_ids[b, t : t + n] = d
            pos[b, t : t + n] = torch.arange(n)
            t, d = t + n, d + 1
    return doc_ids, pos


def brute_force_kept(prio, doc_ids, pos, sinks, window, k):
    """Kept sets of every query by literally running the policy.

    Returns a dict ``(b, h, q) -> set of kept token indices`` (causal, same
    document, non-padding queries only).
    """
    B, Hk, S = prio.shape
    kept = {}
    for b in range(B):
        for h in range(Hk):
            p = prio[b, h].tolist()
            for q in range(S):
                d = int(doc_ids[b, q])
                if d < 0:
                    continue
                same = [t for t in range(q + 1) if int(doc_ids[b, t]) == d]
                # a -inf priority is a gate's eviction: never a long-range token, even with free slots
                eligible = [t for t in same if pos[b, t] >= sinks and t <= q - window and p[t] > float("-inf")]
                top = sorted(eligible, key=lambda t: (-p[t], -t))[:k]
                keep = {t for t in same if pos[b, t] < sinks or q - t < window} | set(top)
                kept[(b, h, q)] = keep
    return kept


CASES = [
    # (B, Hk, S, sinks, window, k, doc lengths, max padding, priority levels or None)
    (2, 3, 97, 2, 4, 3, [10, 30, 60], 9, 3),
    (2, 3, 120, 0, 1, 1, [5, 40, 120], 7, 3),
    (2, 3, 64, 1, 3, 0, [7, 25], 5, 3),
    (2, 3, 80, 4, 8, 100, [80], 0, None),  # budget > S
    (2, 3, 150, 3, 5, 6, [2, 3, 12, 50], 11, None),  # many documents shorter than the budget
    (2, 3, 300, 4, 16, 12, [40, 90, 300], 20, 3),
    (1, 2, 50, 0, 0, 4, [50], 0, 2),  # window 0: a query may keep itself only via top-k
    (2, 3, 150, 2, 6, 8, [30, 150], 9, "gated"),  # dms: -inf (gated out) among ties and free slots
    (2, 3, 120, 1, 4, 0, [40, 120], 5, "gated"),
]


def case_priorities(B, Hk, S, levels, gen):
    if levels is None:
        return torch.randn(B, Hk, S, generator=gen)
    if levels == "gated":  # about half the tokens gated out, the rest in three tied levels
        prio = torch.randint(0, 3, (B, Hk, S), generator=gen).float()
        return prio.masked_fill(torch.rand(B, Hk, S, generator=gen) < 0.5, float("-inf"))
    return torch.randint(0, levels, (B, Hk, S), generator=gen).float()  # many exact ties


@pytest.mark.parametrize("case_id", range(len(CASES)))
def test_eviction_times_match_brute_force(case_id):
    B, Hk, S, sinks, window, k, lens, pad_max, levels = CASES[case_id]
    gen = torch.Generator().manual_seed(case_id)
    doc_ids, pos = random_packing(B, S, lens, pad_max, gen)
    prio = case_priorities(B, Hk, S, levels, gen)

    e = eviction_times(prio, doc_ids, pos, sinks=sinks, window=window, long_range=k)
    assert e.shape == (B, Hk, S)
    kept = brute_force_kept(prio, doc_ids, pos, sinks, window, k)

    budget = sinks + window + k
    for (b, h, q), keep in kept.items():
        assert len(keep) <= budget
        d = doc_ids[b, q]
        for t in range(q + 1):
            if doc_ids[b, t] != d:
                continue
            expected = t in keep
            got = bool(pos[b, t] < sinks) or (q - t < window) or (q < int(e[b, h, t]))
            assert got == expected, (b, h, q, t, int(e[b, h, t]))

    # Sinks and padding are never evicted.
    never = (doc_ids < 0) | (pos < sinks)
    assert (e[never.unsqueeze(1).expand_as(e)] == NEVER).all()


@pytest.mark.parametrize("case", CASES[:3])
def test_brute_force_is_monotone(case):
    """Sanity check of the reformulation: an evicted token never returns."""
    B, Hk, S, sinks, window, k, lens, pad_max, levels = case
    gen = torch.Generator().manual_seed(1)
    doc_ids, pos = random_packing(B, S, lens, pad_max, gen)
    prio = torch.randint(0, levels, (B, Hk, S), generator=gen).float()
    kept = brute_force_kept(prio, doc_ids, pos, sinks, window, k)
    for b in range(B):
        for h in range(Hk):
            evicted = set()
            for q in range(S):
                if (b, h, q) not in kept:
                    continue
                if q > 0 and doc_ids[b, q] != doc_ids[b, q - 1]:
                    evicted = set()
                keep = kept[(b, h, q)]
                assert not (evicted & keep)
                evicted |= {t for t in range(q + 1) if doc_ids[b, t] == doc_ids[b, q]} - keep


def test_recency_priority_is_streaming_llm():
    """Priority = index keeps exactly the k tokens just before the window.

    The last k tokens have fewer than k (newer) outrankers, so they are never evicted.
    """
    S, sinks, window, k = 40, 2, 4, 5
    doc_ids = torch.zeros(1, S, dtype=torch.long)
    pos = torch.arange(S)[None]
    e = eviction_times(recency_priority(1, 1, S), doc_ids, pos, sinks=sinks, window=window, long_range=k)
    t = torch.arange(S)
    expected = torch.where((t < sinks) | (t >= S - k), NEVER, t + window + k)
    assert torch.equal(e[0, 0].long(), expected)


def test_document_spans():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, -1], [5, 3, 3, 3, 3, 3]])
    start, end = document_spans(doc_ids)
    assert start.tolist() == [[0, 0, 2, 2, 2, 5], [0, 1, 1, 1, 1, 1]]
    assert end.tolist() == [[2, 2, 5, 5, 5, 6], [1, 6, 6, 6, 6, 6]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    B, Hk, S = 2, 8, 16384
    gen = torch.Generator().manual_seed(0)
    doc_ids, pos = random_packing(B, S, [1000, 5000, 16384], 100, gen)
    prio = torch.randint(0, 50, (B, Hk, S), generator=gen).float()
    kw = dict(sinks=4, window=64, long_range=512)
    e_cpu = eviction_times(prio, doc_ids, pos, **kw)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e_gpu = eviction_times(prio.cuda(), doc_ids.cuda(), pos.cuda(), **kw)
        torch.cuda.synchronize()
    print(f"eviction_times CUDA S={S} Hk={Hk} B={B}: {time.perf_counter() - t0:.4f}s")
    assert torch.equal(e_gpu.cpu(), e_cpu)
