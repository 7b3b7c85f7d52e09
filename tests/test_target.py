"""Tests of kvpop.target against a float64 dense reference."""

import math
import time

import pytest
import torch

from kvpop.target import future_attention_target

B, H, HK, S, D = 2, 6, 2, 70, 16
WINDOW = 5
SCALE = 0.6
EPS = 1e-6


def packed_docs():
    """Two rows: several documents (one shorter than the window) then padding."""
    lens = [[20, 3, 30, 10], [45, 4, 15]]  # rows sum to 63 and 64: 7 and 6 padding tokens
    doc_ids = torch.full((B, S), -1, dtype=torch.long)
    for b, row in enumerate(lens):
        t = 0
        for d, n in enumerate(row):
            doc_ids[b, t : t + n] = d
            t += n
    return doc_ids


def true_lse(q, k, doc_ids, scale):
    """Natural-log normalizer of causal same-document attention, ``(B, H, S)``."""
    G = q.shape[1] // k.shape[1]
    logits = scale * q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2)
    i = torch.arange(q.shape[2])
    mask = (i[None, :, None] >= i[None, None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    lse = torch.where(mask[:, None], logits, -math.inf).logsumexp(-1)
    return lse.float()


def dense_reference(q, k, lse, doc_ids, window, scale, eps):
    """Obviously-right float64 target: full probability matrix, explicit doc ends."""
    Bq, Hq, Sq, _ = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    logits = scale * q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2)
    p = torch.exp(logits - lse.double()[..., None])  # (B, H, u, t)
    out = torch.empty(Bq, Hk, Sq, dtype=torch.float64)
    for b in range(Bq):
        for t in range(Sq):
            d = int(doc_ids[b, t])
            end = t
            while end < Sq and int(doc_ids[b, end]) == d:
                end += 1
            n = max(1, end - t - window)
            for h in range(Hk):
                best = -math.inf
                for g in range(h * G, (h + 1) * G):
                    total = 0.0
                    if d >= 0:
                        total = sum(float(p[b, g, u, t]) for u in range(t + window, end))
                    best = max(best, math.log(eps + total / n))
                out[b, h, t] = best
    return out


def make_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen)
    k = torch.randn(B, HK, S, D, generator=gen)
    return q, k, packed_docs()


@pytest.mark.parametrize("impl", ["chunked", "flex"])
@pytest.mark.parametrize("lse_kind", ["random", "true"])
def test_matches_dense_reference(impl, lse_kind):
    q, k, doc_ids = make_inputs(0)
    if lse_kind == "true":
        lse = true_lse(q, k, doc_ids, SCALE)
    else:
        lse = 2.0 + torch.randn(B, H, S, generator=torch.Generator().manual_seed(1))
    ref = dense_reference(q, k, lse, doc_ids, WINDOW, SCALE, EPS)
    got = future_attention_target(
        q, k, lse, doc_ids, window=WINDOW, scale=SCALE, eps=EPS, impl=impl, chunk=16
    )
    assert got.shape == (B, HK, S) and got.dtype == torch.float32
    # The targets are informative (not all at the floor) ...
    assert (ref > math.log(EPS) + 1.0).float().mean() > 0.5
    # ... and match the reference.
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)
    # Padding and empty sums sit at the floor.
    assert torch.all(got[(doc_ids < 0)[:, None].expand_as(got)] == torch.tensor(math.log(EPS)).float())


@pytest.mark.parametrize("window", [0, 1, 80])
def test_executors_agree_edge_windows(window):
    q, k, doc_ids = make_inputs(2)
    lse = true_lse(q, k, doc_ids, SCALE)
    a = future_attention_target(q, k, lse, doc_ids, window=window, scale=SCALE, impl="chunked", chunk=7)
    b = future_attention_target(q, k, lse, doc_ids, window=window, scale=SCALE, impl="flex")
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if window == 0:
        ref = dense_reference(q, k, lse, doc_ids, window, SCALE, 1e-6)
        torch.testing.assert_close(a.double(), ref, atol=1e-5, rtol=0)
    if window == 80:
        assert torch.all(a == torch.tensor(math.log(1e-6)).float())


def test_chunked_timing():
    """S = 2048, H = 9 on CPU (no speed assertion)."""
    gen = torch.Generator().manual_seed(0)
    Bt, Ht, Hkt, St, Dt = 1, 9, 3, 2048, 64
    q = torch.randn(Bt, Ht, St, Dt, generator=gen)
    k = torch.randn(Bt, Hkt, St, Dt, generator=gen)
    doc_ids = torch.zeros(Bt, St, dtype=torch.long)
    doc_ids[:, 1500:] = 1
    lse = torch.randn(Bt, Ht, St, generator=gen) + 5
    t0 = time.perf_counter()
    r = future_attention_target(q, k, lse, doc_ids, window=64, scale=Dt**-0.5, impl="chunked")
    print(f"chunked target S={St} H={Ht}: {time.perf_counter() - t0:.3f}s")
    assert r.shape == (Bt, Hkt, St) and torch.isfinite(r).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "shape", [(2, 6, 2, 300, 16, torch.float32), (1, 8, 2, 4096, 64, torch.bfloat16), (2, 32, 8, 2048, 128, torch.bfloat16)]
)
def test_cuda_flex_matches_chunked(shape):
    """Compiled flex executor on CUDA agrees with the chunked one (and with CPU)."""
    Bc, Hc, Hkc, Sc, Dc, dtype = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(Bc, Hc, Sc, Dc, generator=gen).to("cuda", dtype)
    k = torch.randn(Bc, Hkc, Sc, Dc, generator=gen).to("cuda", dtype)
    doc_ids = torch.zeros(Bc, Sc, dtype=torch.long)
    doc_ids[:, Sc // 3 :] = 1
    doc_ids[:, Sc // 3 + 7 :] = 2  # a 7-token document, shorter than the window
    doc_ids[0, Sc - 50 :] = -1
    doc_ids = doc_ids.cuda()
    lse = (torch.randn(Bc, Hc, Sc, generator=gen) + 3).cuda()
    kw = dict(window=16, scale=Dc**-0.5)
    for _ in range(2):  # the first call compiles
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flex = future_attention_target(q, k, lse, doc_ids, impl="flex", **kw)
        torch.cuda.synchronize()
        t_flex = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    chunked = future_attention_target(q, k, lse, doc_ids, impl="chunked", **kw)
    torch.cuda.synchronize()
    t_chunked = time.perf_counter() - t0
    cpu = future_attention_target(q.cpu(), k.cpu(), lse.cpu(), doc_ids.cpu(), impl="chunked", **kw)
    print(f"{shape}: flex {t_flex:.4f}s chunked {t_chunked:.4f}s")
    torch.testing.assert_close(flex, chunked, atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked.cpu(), cpu, atol=1e-4, rtol=0)
