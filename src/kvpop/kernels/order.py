"""The prefix order statistic (a wavelet matrix) in two Triton kernels: the selection's core on the GPU.

:func:`kvpop.order.prefix_kth_smallest_reference` (the tensor twin) builds the wavelet matrix level
by level and descends it for every query in the same loop: about nineteen small tensor operations
per level, 14 levels at 16K tokens, so some 270 kernel launches per layer of a training step, and
the selection spends its time launching kernels (BENCHMARKS.md, the training step). Here:

* ``_build_kernel``, one program per sequence: for each level (most significant bit first), the
  prefix count of zero bits (blocked ``tl.cumsum`` with a carry) is written to the level's row of
  ``zeros`` and the values are stably partitioned (zeros first) into the other half of a
  double buffer, read by the next level;
* ``_query_kernel``, one program per (sequence, block of queries): every query descends the levels
  with two lookups in ``zeros`` per level, as the twin does.

A few long sequences (the pooled prefill's closed form: one sequence of ``F (2 x window + 1)`` values, about
148K at Qwen3-4B) leave all but one SM idle under ``_build_kernel``, which walks its blocks one after another
(2.6 ms a chunk on an H100). There the levels are built by a grid over (sequence, block) instead, two launches a
level: ``_level_count_kernel`` counts each block's zero bits, ``_level_write_kernel`` reads the counts of the
blocks before its own (a sum over at most a few hundred numbers) and writes its block's prefix counts and
partition (:func:`split_build`).

Integers only, the twin's recurrences step for step, so the answers are equal (CPU under Triton's
interpreter and a GPU test).

Shapes: N sequences, n values each, m queries each, ``bits`` levels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _build_kernel(values_ptr, buf_ptr, zeros_ptr, n, bits, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # the sequence
    src0 = buf_ptr + i * 2 * n  # (2, n) int32 double buffer: the values in the current level's order
    zrow0 = zeros_ptr + i * bits * (n + 1)  # (bits, n + 1) int32: zeros[level, j] = zero bits in [0, j)
    ar = tl.arange(0, BLOCK)
    for b0 in range(0, n, BLOCK):
        j = b0 + ar
        tl.store(src0 + j, tl.load(values_ptr + i * n + j, mask=j < n).to(tl.int32), mask=j < n)
    tl.debug_barrier()
    for it in range(0, bits):
        level = bits - 1 - it
        src = src0 + (it % 2) * n
        dst = src0 + ((it + 1) % 2) * n
        zrow = zrow0 + level * (n + 1)
        tl.store(zrow, 0)
        carry = 0
        for b0 in range(0, n, BLOCK):  # the prefix counts of zero bits
            j = b0 + ar
            zero = tl.where(j < n, 1 - ((tl.load(src + j, mask=j < n, other=0) >> level) & 1), 0)
            tl.store(zrow + 1 + j, carry + tl.cumsum(zero, 0), mask=j < n)
            carry += tl.sum(zero, 0)
        n_zeros = carry
        seen = 0
        for b0 in range(0, n, BLOCK):  # the stable partition, zeros first
            j = b0 + ar
            x = tl.load(src + j, mask=j < n, other=0)
            zero = tl.where(j < n, 1 - ((x >> level) & 1), 0)
            before = seen + tl.cumsum(zero, 0) - zero  # zero bits in [0, j)
            dest = tl.where(zero == 1, before, n_zeros + j - before)
            tl.store(dst + dest, x, mask=j < n)
            seen += tl.sum(zero, 0)
        tl.debug_barrier()  # the next level reads what every thread of this one wrote


@triton.jit
def _level_count_kernel(buf_ptr, cnt_ptr, n, src_half, level, nblk, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # the sequence
    b = tl.program_id(1)  # its block
    j = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(buf_ptr + i * 2 * n + src_half * n + j, mask=j < n, other=0)
    zero = tl.where(j < n, 1 - ((x >> level) & 1), 0)
    tl.store(cnt_ptr + i * nblk + b, tl.sum(zero, 0))


@triton.jit
def _level_write_kernel(buf_ptr, cnt_ptr, zeros_ptr, n, src_half, level, bits, nblk, BLOCK: tl.constexpr, NB: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    blk = tl.arange(0, NB)
    cnt = tl.load(cnt_ptr + i * nblk + blk, mask=blk < nblk, other=0)
    carry = tl.sum(tl.where(blk < b, cnt, 0), 0)  # zero bits in the blocks before this one
    n_zeros = tl.sum(cnt, 0)
    j = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(buf_ptr + i * 2 * n + src_half * n + j, mask=j < n, other=0)
    zero = tl.where(j < n, 1 - ((x >> level) & 1), 0)
    upto = carry + tl.cumsum(zero, 0)  # zero bits in [0, j]
    zrow = zeros_ptr + (i * bits + level) * (n + 1)
    tl.store(zrow + 1 + j, upto, mask=j < n)
    if b == 0:
        tl.store(zrow, 0)
    before = upto - zero  # zero bits in [0, j)
    dest = tl.where(zero == 1, before, n_zeros + j - before)
    tl.store(buf_ptr + i * 2 * n + (1 - src_half) * n + dest, x, mask=j < n)


@triton.jit
def _query_kernel(zeros_ptr, prefix_ptr, kth_ptr, out_ptr, n, m, bits, BQ: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * BQ + tl.arange(0, BQ)
    real = q < m
    p = tl.load(prefix_ptr + i * m + q, mask=real, other=0)  # int64
    k = tl.load(kth_ptr + i * m + q, mask=real, other=0)
    valid = (k >= 1) & (k <= p)
    k = tl.maximum(k, 1)
    lo = tl.zeros([BQ], tl.int64)
    hi = tl.minimum(tl.maximum(p, 0), n)
    out = tl.zeros([BQ], tl.int64)
    for it in range(0, bits):
        level = bits - 1 - it
        zrow = zeros_ptr + (i * bits + level) * (n + 1)
        n_zeros = tl.load(zrow + n).to(tl.int64)
        z_lo = tl.load(zrow + lo, mask=real, other=0).to(tl.int64)
        z_hi = tl.load(zrow + hi, mask=real, other=0).to(tl.int64)
        z = z_hi - z_lo
        right = k > z
        k = tl.where(right, k - z, k)
        lo = tl.where(right, n_zeros + lo - z_lo, z_lo)
        hi = tl.where(right, n_zeros + hi - z_hi, z_hi)
        out = out | (right.to(tl.int64) << level)
    tl.store(out_ptr + i * m + q, tl.where(valid, out, -1), mask=real)


def launch_config(n: int) -> dict[str, int]:
    """Block sizes and warps of the two kernels for sequences of ``n`` values."""
    return {"BLOCK": min(triton.next_power_of_2(max(n, 16)), 4096), "BQ": 1024, "num_warps": 8}


def split_build(N: int, n: int, block: int) -> bool:
    """Whether ``N`` sequences of ``n`` values build their levels by a grid over blocks (two launches a level) rather
    than one program per sequence: few sequences (fewer than 32, so that one program each leaves most of a GPU idle)
    of at least 16 blocks each (64K values: the pooled prefill's, not a training row's of at most 16K tokens, whose
    selection keeps its one launch)."""
    return N < 32 and n >= 16 * block


def wavelet_kth_smallest(values: torch.Tensor, prefix: torch.Tensor, kth: torch.Tensor, bits: int, *, split: bool | None = None) -> torch.Tensor:
    """:func:`kvpop.order.prefix_kth_smallest_reference`'s answers in two launches (or ``2 x bits + 1`` where the
    levels are built by a grid over blocks).

    Args:
        values: (N, n) non-negative integers below ``2 ** bits`` (and below 2**31).
        prefix: (N, m) prefix lengths in [0, n]; kth: (N, m) 1-based ranks.
        split: build the levels by blocks (True) or one program per sequence (False); None: :func:`split_build`.

    Returns:
        (N, m) int64, -1 for invalid queries (``kth < 1`` or ``kth > prefix``).
    """
    N, n = values.shape
    m = prefix.shape[1]
    dev = values.device
    cfg = launch_config(n)
    buf = torch.empty(N, 2, n, dtype=torch.int32, device=dev)
    zeros = torch.empty(N, bits, n + 1, dtype=torch.int32, device=dev)
    out = torch.empty(N, m, dtype=torch.int64, device=dev)
    if N == 0 or m == 0:
        return out
    if n and (split_build(N, n, cfg["BLOCK"]) if split is None else split):
        nblk = triton.cdiv(n, cfg["BLOCK"])
        cnt = torch.empty(N, nblk, dtype=torch.int32, device=dev)
        buf[:, 0].copy_(values)
        for it in range(bits):  # most significant bit first, as _build_kernel
            level, half = bits - 1 - it, it % 2
            _level_count_kernel[(N, nblk)](buf, cnt, n, half, level, nblk, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
            _level_write_kernel[(N, nblk)](buf, cnt, zeros, n, half, level, bits, nblk, BLOCK=cfg["BLOCK"], NB=triton.next_power_of_2(nblk),
                                           num_warps=cfg["num_warps"])
    elif n:
        _build_kernel[(N,)](values.to(torch.int64).contiguous(), buf, zeros, n, bits, BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    else:
        zeros.zero_()
    _query_kernel[(N, triton.cdiv(m, cfg["BQ"]))](zeros, prefix.to(torch.int64).contiguous(), kth.to(torch.int64).contiguous(), out, n, m,
                                                  bits, BQ=cfg["BQ"], num_warps=cfg["num_warps"])
    return out
