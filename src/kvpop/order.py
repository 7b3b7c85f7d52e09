"""Batched order statistics over prefixes: "the k-th smallest of values[:p]" for many (p, k) at once.

The learned top-k selection is a running order statistic (the k-th best token among those that
have left the window so far). A Fenwick tree answers it sequentially, one query position after
another. A *wavelet matrix* answers every prefix query independently, which vectorizes over
rows, heads and positions with no loop over S: ``ceil(log2(max value + 1))`` levels, each one a
stable partition of the values by one bit plus a prefix count of zeros, then each query descends
the levels with two lookups per level. Work O((n + m) log V), all of it tensor ops, so it runs
unchanged on CPU and CUDA without host synchronization.

Shapes: N independent sequences (e.g. B * Hk), n values each, m queries each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.kernels import selection_kernels_enabled


def prefix_kth_smallest(values: Tensor, prefix: Tensor, kth: Tensor, *, bits: int | None = None) -> Tensor:
    """k-th smallest (1-based) element of ``values[i, :prefix[i, j]]`` for every query.

    On CUDA with the selection kernels enabled (:func:`kvpop.kernels.selection_kernels_enabled`): two
    kernel launches (:func:`kvpop.kernels.order.wavelet_kth_smallest`); otherwise the tensor twin,
    :func:`prefix_kth_smallest_reference`. The answers are equal.

    Args:
        values: (N, n) non-negative integers, each below ``2 ** bits``.
        prefix: (N, m) prefix lengths in [0, n].
        kth: (N, m) ranks, 1-based. Queries with ``kth < 1`` or ``kth > prefix`` are invalid.
        bits: bits per value; inferred from the maximum when omitted (which syncs once).

    Returns:
        (N, m) int64: the answers; -1 for invalid queries.
    """
    if bits is None:
        bits = max(1, int(values.max().item()).bit_length()) if values.numel() else 1
    if values.is_cuda and bits < 32 and selection_kernels_enabled():
        from kvpop.kernels.order import wavelet_kth_smallest

        return wavelet_kth_smallest(values, prefix, kth, bits)
    return prefix_kth_smallest_reference(values, prefix, kth, bits=bits)


def prefix_kth_smallest_reference(values: Tensor, prefix: Tensor, kth: Tensor, *, bits: int | None = None) -> Tensor:
    """:func:`prefix_kth_smallest` as tensor operations: every level of the wavelet matrix built and
    descended by a few whole-tensor ops (CPU and CUDA alike; the twin of the Triton kernels)."""
    N, n = values.shape
    values = values.to(torch.int64)
    if bits is None:
        bits = max(1, int(values.max().item()).bit_length()) if values.numel() else 1
    prefix = prefix.to(torch.int64)
    k = kth.to(torch.int64)
    valid = (k >= 1) & (k <= prefix)
    k = k.clamp(min=1)
    lo = torch.zeros_like(prefix)
    hi = prefix.clamp(0, n)
    out = torch.zeros_like(prefix)
    cur = values
    idx = torch.arange(n, device=values.device).expand(N, n)
    for level in range(bits - 1, -1, -1):
        bit = (cur >> level) & 1  # (N, n)
        zeros = torch.nn.functional.pad((1 - bit).cumsum(-1), (1, 0))  # (N, n + 1): zeros in [0, i)
        n_zeros = zeros[:, -1:]  # (N, 1)
        # descend: count zeros of this level inside [lo, hi)
        z_lo, z_hi = zeros.gather(1, lo), zeros.gather(1, hi)
        z = z_hi - z_lo
        go_right = k > z
        k = torch.where(go_right, k - z, k)
        lo = torch.where(go_right, n_zeros + (lo - z_lo), z_lo)
        hi = torch.where(go_right, n_zeros + (hi - z_hi), z_hi)
        out = out | (go_right.to(torch.int64) << level)
        # next level: stable partition, zeros first
        dest = torch.where(bit == 0, zeros[:, :-1], n_zeros + idx - zeros[:, :-1])
        cur = torch.empty_like(cur).scatter_(1, dest, cur)
    return torch.where(valid, out, torch.full_like(out, -1))
