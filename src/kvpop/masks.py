"""The attention pattern, defined once, and its two materializations.

Every policy (dense, StreamingLLM, learned top-k) is described by one integer per KV head and
token: its *eviction time* ``evict[b, h, t]``, the first query index at which token ``t`` is no
longer attended (``selection.NEVER`` for tokens that are never evicted). With packed rows, the
pattern is

    allowed(b, h, q, kv) = (kv <= q  &  doc[q] == doc[kv] >= 0  &  (pos[kv] < sinks  |  q < evict[kv]))
                           | (q == kv)

(the diagonal keeps padding queries well defined; for real tokens it is already allowed because a
token is always inside its own window). :func:`make_eviction_mask_mod` is that predicate as a
FlexAttention ``mask_mod``. Two executors consume it:

* :func:`dense_mask` evaluates it on the full (S x S) grid: the boolean mask for SDPA on CPU
  and the reference in tests;
* :func:`block_mask_from_eviction_times` builds a FlexAttention ``BlockMask`` from per-block bounds
  of ``evict`` in O((S/128)^2) per head, never materializing S x S, and keeps the same ``mask_mod``
  for the partial blocks;
* :class:`ChunkRows` evaluates it on the rows of a chunk of queries, factored into what every layer
  shares (documents, causality, sinks, the diagonal), once per chunk, and one comparison per layer
  with that layer's ``evict`` (the chunked pool forward, :mod:`kvpop.pool`, whose 30-odd layers would
  otherwise evaluate the whole predicate each).

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, S sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def make_eviction_mask_mod(
    doc_ids: Tensor,  # (B, S) int, -1 on padding
    pos: Tensor,  # (B, S) int, position inside the document
    evict: Tensor,  # (B, Hk, S) int, eviction time per KV head and token
    *,
    sinks: int,
    group: int,  # G = H / Hk
) -> MaskMod:
    """The pattern as a ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over query heads ``h``."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        doc_kv = doc_ids[b, kv_idx]
        same_doc = (doc_ids[b, q_idx] == doc_kv) & (doc_kv >= 0)
        kept = (pos[b, kv_idx] < sinks) | (q_idx < evict[b, h // group, kv_idx])
        return ((kv_idx <= q_idx) & same_doc & kept) | (q_idx == kv_idx)

    return mask_mod


def dense_mask(
    mask_mod: MaskMod, B: int, H: int, S: int, device: torch.device | str, kv_len: int | None = None, group: int = 1
) -> Tensor:
    """Evaluate ``mask_mod`` on the full grid: (B, H, S, N) bool (True = attend), N = ``kv_len`` or S.

    ``group`` > 1: for a pattern shared by each group of ``group`` consecutive query heads (one per KV
    head), evaluate it once per group, at the group's first head, and repeat it (``group`` times less work)."""
    N = S if kv_len is None else kv_len
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = (torch.arange(H // group, device=device) * group).view(1, H // group, 1, 1)
    q = torch.arange(S, device=device).view(1, 1, S, 1)
    kv = torch.arange(N, device=device).view(1, 1, 1, N)
    mask = mask_mod(b, h, q, kv).expand(B, H // group, S, N)
    if group == 1:
        return mask
    return mask[:, :, None].expand(B, H // group, group, S, N).reshape(B, H, S, N)


class ChunkRows:
    """The pattern's rows of queries ``[start, start + length)`` over keys ``[0, kv_len)`` of packed rows
    doc_ids, pos (B, S), factored (module docstring): ``allowed = (q < evict[kv] & live) | always`` with

        live   = kv <= q  &  doc[q] == doc[kv] >= 0                       (what eviction can remove)
        always = (live  &  pos[kv] < sinks)  |  q == kv                   (what it cannot)

    both (B, 1, length, kv_len), built once; :meth:`allowed` adds one layer's eviction times. The same
    predicate as :func:`make_eviction_mask_mod` (tests prove it equal to :func:`dense_mask` of it)."""

    def __init__(self, doc_ids: Tensor, pos: Tensor, *, start: int, length: int, kv_len: int, sinks: int):
        dev = doc_ids.device
        self.kv_len = kv_len
        self.q = torch.arange(start, start + length, device=dev).view(1, 1, length, 1)  # (1, 1, C, 1)
        kv = torch.arange(kv_len, device=dev).view(1, 1, 1, kv_len)
        doc_kv = doc_ids[:, None, None, :kv_len]  # (B, 1, 1, N)
        self.live = (kv <= self.q) & (doc_ids[:, None, start : start + length, None] == doc_kv) & (doc_kv >= 0)  # (B, 1, C, N)
        self.always = (self.live & (pos[:, None, None, :kv_len] < sinks)) | (self.q == kv)

    def allowed(self, evict: Tensor, group: int) -> Tensor:
        """evict (B, Hk, S) of one layer -> (B, Hk x group, C, N) bool (True = attend), each KV head's rows repeated
        for its ``group`` query heads."""
        m = ((self.q < evict[:, :, None, : self.kv_len]) & self.live) | self.always  # (B, Hk, C, N)
        B, Hk, C, N = m.shape
        return m if group == 1 else m[:, :, None].expand(B, Hk, group, C, N).reshape(B, Hk * group, C, N)


def block_mask_from_eviction_times(
    doc_ids: Tensor,  # (B, S)
    pos: Tensor,  # (B, S)
    evict: Tensor,  # (B, Hk, S)
    *,
    sinks: int,
    num_heads: int,  # H
    block_size: int = 128,
):
    """A FlexAttention ``BlockMask`` for the eviction pattern, from per-block bounds.

    For query block i and KV block j <= i (per batch row and KV head):

    * *empty* when the blocks share no document, or when no token of block j is a sink and its
      latest eviction time is at most the first query of block i;
    * *full* when j < i, both blocks lie inside one document (no padding), and the earliest
      eviction time in block j exceeds the last query of block i (sinks count as never evicted);
    * *partial* otherwise; the diagonal block is always partial.

    Cost: O(B * Hk * (S / block)^2); nothing of size S x S is built. On CUDA with the selection kernels
    enabled (:func:`kvpop.kernels.selection_kernels_enabled`) the block lists come from one kernel
    launch (:mod:`kvpop.kernels.blockmask`), elsewhere from :func:`block_lists_reference`, its twin.
    """
    from torch.nn.attention.flex_attention import BlockMask

    from kvpop.kernels import selection_kernels_enabled

    B, Hk, S = evict.shape
    G = num_heads // Hk
    bounds = block_bounds(doc_ids, pos, evict, sinks=sinks, block_size=block_size)
    if evict.is_cuda and selection_kernels_enabled():
        from kvpop.kernels.blockmask import block_lists
    else:
        block_lists = block_lists_reference
    kv_num, kv_idx, full_num, full_idx = block_lists(*bounds, S=S, block_size=block_size, group=G)
    mask_mod = make_eviction_mask_mod(doc_ids, pos, evict, sinks=sinks, group=G)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(S, S),
    )


def block_bounds(doc_ids: Tensor, pos: Tensor, evict: Tensor, *, sinks: int, block_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per block of ``block_size`` tokens: the first and last document (d_min, d_max (B, nb) int64;
    padding is its own document after every real one) and the earliest and latest eviction time
    per KV head (e_min, e_max (B, Hk, nb) int64; a sink counts as never evicted, padding as never kept)."""
    B, Hk, S = evict.shape
    nb = (S + block_size - 1) // block_size
    pad = nb * block_size - S
    big = torch.iinfo(torch.int32).max
    doc = doc_ids.to(torch.int64)
    doc = torch.where(doc < 0, torch.full_like(doc, 1 << 40), doc)  # padding: its own, last "document"
    e = evict.to(torch.int64)
    is_sink = (pos < sinks) & (doc_ids >= 0)  # (B, S)
    e_hi = torch.where(is_sink[:, None], torch.full_like(e, big), e)  # (B, Hk, S)
    e_hi = torch.where((doc_ids < 0)[:, None], torch.full_like(e, -1), e_hi)  # padding: never kept
    if pad:
        doc = torch.nn.functional.pad(doc, (0, pad), value=1 << 41)
        e_hi = torch.nn.functional.pad(e_hi, (0, pad), value=-1)
    doc_blk = doc.view(B, nb, block_size)
    e_blk = e_hi.view(B, Hk, nb, block_size)
    return doc_blk.amin(-1), doc_blk.amax(-1), e_blk.amin(-1), e_blk.amax(-1)


def block_lists_reference(
    d_min: Tensor, d_max: Tensor, e_min: Tensor, e_max: Tensor, *, S: int, block_size: int, group: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The partial and full KV blocks of every query block, from :func:`block_bounds`, as tensor
    operations: ``kv_num`` (B, H, nb) int32 partial blocks per query block, ``kv_idx`` (B, H, nb, nb)
    int32 their indices first (increasing), then the other blocks (increasing); ``full_num``,
    ``full_idx`` the same for full blocks; H = Hk * ``group`` (each KV head's lists repeated for its
    query heads). The twin of :func:`kvpop.kernels.blockmask.block_lists`."""
    B, Hk, nb = e_min.shape
    i = torch.arange(nb, device=e_min.device).view(nb, 1)  # query block
    j = torch.arange(nb, device=e_min.device).view(1, nb)  # kv block
    q_first = (i * block_size).view(1, 1, nb, 1)
    q_last = ((i + 1) * block_size - 1).clamp(max=S - 1).view(1, 1, nb, 1)
    below = (j <= i).view(1, 1, nb, nb)
    # documents are contiguous and increasing along a row, so blocks j <= i overlap iff
    # the last document of block j reaches the first document of block i
    overlap = (d_max[:, None, None, :] >= d_min[:, None, :, None]) & below  # (B, 1, nb, nb)
    any_kept = e_max[:, :, None, :] > q_first  # (B, Hk, nb, nb)
    diagonal = (i == j).view(1, 1, nb, nb)
    nonempty = (overlap & any_kept) | diagonal
    one_doc = (d_min == d_max)  # (B, nb)
    same_single_doc = (
        one_doc[:, None, :] & one_doc[:, :, None] & (d_min[:, None, :] == d_min[:, :, None])
    )[:, None]  # (B, 1, nb, nb)
    full = (j < i).view(1, 1, nb, nb) & same_single_doc & (e_min[:, :, None, :] > q_last)
    partial = nonempty & ~full
    # expand KV heads to query heads (the mask_mod indexes evict by h // G)
    full = full.expand(B, Hk, nb, nb).repeat_interleave(group, dim=1)
    partial = partial.expand(B, Hk, nb, nb).repeat_interleave(group, dim=1)

    def ordered(m: Tensor) -> tuple[Tensor, Tensor]:
        m = m.to(torch.int32)
        return m.sum(-1).to(torch.int32), torch.argsort(m, dim=-1, descending=True, stable=True).to(torch.int32)

    return (*ordered(partial), *ordered(full))
