"""The BlockMask's block lists in one Triton kernel: the other half of the training selection.

:func:`kvpop.masks.block_lists_reference` (the twin) classifies every (query block i, KV block j)
as empty, partial or full with whole-tensor comparisons over (B, Hk, nb, nb), repeats them for each
query head and orders each row with a stable argsort: some sixty small kernel launches per layer.
Here one program per (row, KV head, query block i) classifies its row of nb KV blocks in registers
and writes, for each of its ``group`` query heads, the counts and the ordered index lists (the
flagged blocks in increasing j, then the others in increasing j: what the twin's stable
descending argsort gives) as an exclusive prefix count and a scatter.

Shapes: B batch, Hk KV heads, H = Hk * group query heads, nb blocks, NB the next power of two >= nb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ordered_store(flag, real, j, num_ptr, idx_ptr, b, hk, i, H, nb, group):
    """Count ``flag`` over the real lanes and write the ordered list of KV blocks (flagged ones first,
    each part in increasing j) to row (b, h, i) of every query head h of KV head ``hk``."""
    t = (flag & real).to(tl.int32)
    f = ((~flag) & real).to(tl.int32)
    count = tl.sum(t, 0)
    dest = tl.where(t == 1, tl.cumsum(t, 0) - t, count + tl.cumsum(f, 0) - f)
    for g in range(0, group):
        out_row = (b * H + hk * group + g) * nb + i
        tl.store(num_ptr + out_row, count)
        tl.store(idx_ptr + out_row * nb + dest, j, mask=real)


@triton.jit
def _block_lists_kernel(d_min_ptr, d_max_ptr, e_min_ptr, e_max_ptr, kv_num_ptr, kv_idx_ptr, full_num_ptr, full_idx_ptr,
                        Hk, nb, S, block_size, group, NB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * Hk + hk) * nb + i
    i = row % nb
    bh = row // nb
    hk = bh % Hk
    b = bh // Hk
    j = tl.arange(0, NB)
    real = j < nb
    dmin_j = tl.load(d_min_ptr + b * nb + j, mask=real, other=0)
    dmax_j = tl.load(d_max_ptr + b * nb + j, mask=real, other=0)
    dmin_i = tl.load(d_min_ptr + b * nb + i)
    dmax_i = tl.load(d_max_ptr + b * nb + i)
    emin_j = tl.load(e_min_ptr + bh * nb + j, mask=real, other=0)
    emax_j = tl.load(e_max_ptr + bh * nb + j, mask=real, other=0)
    q_first = i * block_size
    q_last = tl.minimum((i + 1) * block_size - 1, S - 1)
    overlap = (dmax_j >= dmin_i) & (j <= i)  # documents are contiguous and increasing along a row
    nonempty = (overlap & (emax_j > q_first)) | (j == i)
    same_single_doc = (dmin_j == dmax_j) & (dmin_i == dmax_i) & (dmin_j == dmin_i)
    full = (j < i) & same_single_doc & (emin_j > q_last)
    partial = nonempty & ~full
    H = Hk * group
    _ordered_store(partial, real, j, kv_num_ptr, kv_idx_ptr, b, hk, i, H, nb, group)
    _ordered_store(full, real, j, full_num_ptr, full_idx_ptr, b, hk, i, H, nb, group)


def block_lists(d_min: torch.Tensor, d_max: torch.Tensor, e_min: torch.Tensor, e_max: torch.Tensor, *, S: int, block_size: int,
                group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kvpop.masks.block_lists_reference`'s four tensors (kv_num, kv_idx, full_num, full_idx;
    int32) in one launch, from :func:`kvpop.masks.block_bounds` (d_min, d_max (B, nb), e_min, e_max
    (B, Hk, nb), int64)."""
    B, Hk, nb = e_min.shape
    H = Hk * group
    dev = e_min.device
    kv_num = torch.empty(B, H, nb, dtype=torch.int32, device=dev)
    kv_idx = torch.empty(B, H, nb, nb, dtype=torch.int32, device=dev)
    full_num, full_idx = torch.empty_like(kv_num), torch.empty_like(kv_idx)
    if B * Hk * nb:
        NB = triton.next_power_of_2(max(nb, 16))
        _block_lists_kernel[(B * Hk * nb,)](
            d_min.to(torch.int64).contiguous(), d_max.to(torch.int64).contiguous(), e_min.to(torch.int64).contiguous(),
            e_max.to(torch.int64).contiguous(), kv_num, kv_idx, full_num, full_idx, Hk, nb, S, block_size, group, NB=NB,
            num_warps=4 if NB <= 512 else 8,
        )
    return kv_num, kv_idx, full_num, full_idx
