"""The model-wide pool at engine speed: :class:`PoolStore`, the buffers and the in-step competition of
``DecodeEngine``'s ``pooled`` kind (``one_pool`` policies: ``dbtrimkv``, ``OnePool(...)``, ``kvpop_mlp_pool``).

The rule is :class:`kvpop.decode.one_pool.OnePoolCache`'s (the slow twin the tests compare against):
per layer and KV head the ``sinks`` first tokens and a ring of the ``window`` most recent ones; the
long-range entries of every layer and KV head in one pool of ``P = L x Hk x k``. At query ``q`` token
``j = q - window`` leaves every window; the ``F = L x Hk`` leavers and the pool's entries compete by
their rank at ``q`` (a retention ``(q - i) * log beta`` that decays, else a static priority) and the
lowest go, as many as the candidates exceed ``P``; ties: the older token, then the higher pair
``f = layer * Hk + head`` (:func:`kvpop.selection.pool_leavers`).

Layout: one store per row, pages of ``page`` slots (the attention block, 128 on CUDA)
-----------------------------------------------------------------------------------------------
Every slot of the store holds one entry: keys and values ``(B, NS, D)``, its position, priority, pair
``tag`` (``-1``: empty) and, in the pool, its index in its layer's list. The compiled step touches keys and values
only through views of row groups (:func:`row_groups`, :meth:`PoolStore.read_kv`, :meth:`PoolStore.write_kv`), each
under int32's range of elements, which torch's FlexAttention templates need (:data:`GROUP_ELEMENTS`). A slot's pair says whose
entry it is, so one page may hold entries of every head of *one* layer::

    [ layer 0's rings | layer 1's rings | ... | pool pages ............................ | dump page ]
      Hk x R slots, padded to whole pages      a layer's long-range entries: its own pages

* the rings: layer ``l``, head ``h``, ring slot ``r`` at ``l * RS + h * R + r`` (``R = sinks + window``;
  ``RS``: ``Hk x R`` rounded up to whole pages), written as the bounded engine writes its ring;
* the pool: layer ``l`` keeps its ``n_l`` long-range entries (every head's) dense at logical indices
  ``[0, n_l)`` of its page list ``ptab[l]`` (logical ``s``: page ``ptab[l, s // page]``, offset
  ``s % page``). A removal fills its hole swap-with-last style: entering leavers of the layer first,
  then the layer's last live entries; a page past ``ceil(n_l / page)`` goes back to the free pages, a
  layer that grows past its pages takes the lowest free one (at most one per step: ``Hk <= page``).
  Pages hold at most ``P + F`` entries plus one partial page per layer: ``ceil((P + F) / page) + L``
  pages, and one dump page where the writes that change nothing go. The memory is fixed at
  construction (flat in the context) and exceeds a per-head cache of the same budget by a page or two
  per layer (Qwen3-4B at budget 2,048: 598,400 slots per row against 589,824, 1.5%; and 32 bytes of
  bookkeeping per slot, position, priority, tag and list index, against the per-head cache's 16; 4 more with
  the candidate list below).

Attention of layer ``l`` then reads only its own pages: its ring pages and ``ptab[l][:ceil(n_l / page)]``.
On CUDA the compiled step runs FlexAttention's decoding kernel with the layer's ``H`` query heads as
``H`` queries of *one* head over the store viewed as ``(B, 1, NS, D)``, a block mask per row whose
block list is the layer's pages (``kv_num_blocks (B, 1, 1)``, ``kv_indices (B, 1, 1, NB)``), and the
``mask_mod`` ``tag == layer * Hk + query // G``: the bytes read are the layer's entries, as in the
per-head cache (a per-KV-head block list would need a block mask per head, which the decoding kernel
refuses under GQA). Eager (CPU, or ``compile=False``), the layer's slots are gathered and attended with
SDPA under the same boolean mask.

The competition (:meth:`PoolStore.update`): static shapes, no host synchronization
------------------------------------------------------------------------------------
The candidates are the pool's slots, the ``F`` leavers and ``F`` virtual empty entries, of which ``F - r``
rank lowest (``r``: the candidates beyond ``P``); :func:`select_lowest_set` takes the ``F`` lowest by (rank,
tie) with two unsorted ``topk`` and pairwise ranks (:func:`select_lowest`, sorted, is its twin, and
:func:`kvpop.selection.pool_leavers` theirs, tested equal). So ``r`` real candidates go, exactly the
reference's. Everything after is gathers, cumsums and ``index_put_`` over ``O(F + L x F)`` entries: the
step's CUDA graph holds it. With ``list_steps = T`` the pool's part of the candidates is a list
(:meth:`PoolStore.refresh_list`, every ``T`` steps: the entries whose rank can be among the lowest in those
steps, at most ``C0 = 2 (F + F T)``, plus the leavers that enter meanwhile: ``C = C0 + F T`` places, each
entry's place in ``lpos``) instead of the pool's ``NP`` slots; the engine captures a graph for each kind of
step and runs the whole pool's where a refresh overflows.

A prefill chunk's competitions (at most ``window`` queries, every leaver from an earlier chunk) run on the
bookkeeping before the chunk attends: with a static rule in one pass, :meth:`PoolStore.compete_static`
(the top-``P`` of a growing set, in closed form, over the ``F (n + 1)`` lowest pool entries and the leavers);
with decaying ranks query by query, :meth:`PoolStore.compete_decaying`, in blocks of :attr:`decay_block`
queries, each on a candidate list (the candidates that can go within the block, by rank bounds); both then
lay the survivors out afresh. Their twin: query by query on the store, :meth:`PoolStore.update` with
``move_kv=False`` (tests/test_pooled.py).

Shapes: B batch, L layers, Hk KV heads, F = L x Hk pairs, D head dim, NS store slots, NP pool slots,
NPP pool pages, R ring slots per head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.geometry import CacheLayout
from kvpop.order import prefix_kth_smallest
from kvpop.selection import NEVER

I64_MAX = torch.iinfo(torch.int64).max


#: the most store elements (rows x NS x D keys) one FlexAttention call of the compiled step reads. Past int32's range
#: Inductor indexes the kernel in 64 bits (``TritonScheduling.can_use_32bit_indexing``; the store at batch 64, Qwen3-4B,
#: budget 2,048: 4.9e9), and torch 2.11's FlexAttention decoding template does not compile that way, whatever the block
#: masks' dtypes (an H200 and an H100, 2026-12-04 and 12-07): int32 ``kv_num_blocks`` fail in a ternary that mixes them
#: with the int64 program id, int64 ``kv_indices`` in the KV loop (``kv_offset`` starts int32 and turns int64), and with
#: both fixed (int64 counts, int32 indices) a block pointer refuses 64-bit offsets. So the step reads the store in row
#: groups (:func:`row_groups`), each a view of at most this many elements that the compiled step takes as its own input.
GROUP_ELEMENTS = 2**31 - 1


def row_groups(batch: int, row_elements: int, limit: int | None = None) -> list[tuple[int, int]]:
    """Rows ``[r0, r1)`` of each group of a store whose row holds ``row_elements`` elements: as few groups as keep each
    under ``limit`` (default :data:`GROUP_ELEMENTS`), of near-equal sizes, a multiple of 4 rows where a group holds 4 or
    more (the block masks' rows of 4 bytes then start each group on 16 bytes, as Inductor's inputs want)."""
    limit = GROUP_ELEMENTS if limit is None else limit
    per = max(1, limit // row_elements)
    size = -(-batch // -(-batch // per))  # near-equal groups
    if per >= 4:
        size = min(per // 4 * 4, -(-size // 4) * 4)
    return [(r0, min(batch, r0 + size)) for r0 in range(0, batch, size)]


def can_go(pos: Tensor, prio: Tensor, present: Tensor, arrive: Tensor | None, q0: int | Tensor, n: int, *, F: int, decays: bool) -> Tensor:
    """The candidates that can be among the lowest-ranked at some query of ``q0 .. q0 + n - 1``: pos, prio (B, N)
    (a static priority, or ``log beta`` of a decaying rank ``(q - pos) * log beta``), present (B, N) bool (there
    at some of those queries), arrive (B, N) the first query each competes at (None: every one from ``q0``)
    -> (B, N) bool; the others stay through those queries, whatever enters.

    Over the queries candidate ``y``'s rank lies in ``[lo_y, hi_y]``, its ranks at its first query there
    (``max(q0, arrive)``) and at the last (a decaying rank is linear in ``q``; float64 rounding is monotone,
    so the bounds hold as computed), or its static priority. At most ``F`` candidates go at a query, ``F n`` in
    all; with ``tau`` the ``(F + F n)``-th smallest ``hi`` of those present from ``q0`` on, a candidate with
    ``lo > tau`` has, at every one of those queries, at least ``F`` of them still there that rank strictly
    below it, so it stays. Used by the decode step's list (:meth:`PoolStore.refresh_list`, the pool from ``q0``)
    and the decaying prefill's blocks (:meth:`PoolStore.compete_decaying`, pool and leavers)."""
    B, N = pos.shape
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=pos.device)
    if decays:
        first = q0 - pos if arrive is None else arrive.clamp(min=q0) - pos  # (B, N) its age at its first query there
        r0, r1 = first.double() * prio, (q0 + n - 1 - pos).double() * prio  # (B, N)
        lo, hi = torch.minimum(r0, r1), torch.maximum(r0, r1)
    else:
        lo = hi = prio.double()
    lo, hi = torch.where(present, lo, inf), torch.where(present if arrive is None else present & (arrive <= q0), hi, inf)
    k = F + F * n
    tau = hi.topk(k, dim=1, largest=False, sorted=False).values.amax(1, keepdim=True) if k <= N else inf.expand(B, 1)  # (B, 1) the k-th
    return present & (lo <= tau)


def list_width(m: int, limit: int, device: torch.device) -> int:
    """The places a candidate list of ``m`` entries takes out of ``limit``: on CUDA ``m`` padded to a power of two (at
    least 1024, at most ``limit``), so that few list shapes occur, each a CUDA graph of the decaying queries and a
    compile of their body (:meth:`PoolStore._decaying_queries`); elsewhere ``m`` itself (at least 1)."""
    if device.type == "cuda":
        return min(limit, max(1024, 1 << max(0, m - 1).bit_length()))
    return max(1, m)


def listed_first(can: Tensor, m: int) -> Tensor:
    """The places of a list can (B, N) bool, first ``m`` of them: (B, m) int64, the listed in order, then the
    unlisted as ``N + place`` (distinct: ``% N`` names them) where a row lists fewer than ``m``: the first ``m`` of
    ``where(can, place, N + place)`` sorted, by two running counts and one scatter (a decaying prefill block's list out
    of the pool's ~600K places, where a sort of them all is a radix sort of eight passes; tests/test_pooled.py)."""
    B, N = can.shape
    if not 0 <= m <= N:
        raise ValueError(f"listed_first: the first m of {N} places, got m = {m}")
    ar = torch.arange(N, device=can.device)
    c = can.long()
    listed = c.cumsum(1)  # (B, N) listed places up to each, itself included
    place = torch.where(can, listed - 1, listed[:, -1:] + ar - listed)  # (B, N) each place's rank in the sorted order
    out = torch.zeros(B, m + 1, dtype=torch.int64, device=can.device)  # column m: those beyond the first m
    return out.scatter_(1, place.clamp(max=m), torch.where(can, ar, N + ar).expand(B, N))[:, :m]


def select_lowest(score: Tensor, tie: Tensor, n: int) -> Tensor:
    """The ``n`` lowest candidates of every row by (score, tie), both ascending: score (B, N) float,
    tie (B, N) int64 (distinct within a row among equal scores) -> their indices (B, n).

    The selection of :func:`kvpop.selection.pool_leavers` with ``topk`` in place of ``kthvalue`` (on
    CUDA ``kthvalue`` runs one thread block per row): the ``n``-th lowest score ``v``; every candidate
    below it goes, and of those at ``v`` the ones of lowest tie make up the ``n``."""
    vals, idx = score.topk(n, dim=1, largest=False, sorted=True)  # (B, n) ascending: those below v come first
    v = vals[:, -1:]
    below = (vals < v).sum(1, keepdim=True)  # every candidate below v is among the n lowest
    at_v = torch.where(score == v, tie, I64_MAX).topk(n, dim=1, largest=False, sorted=True).indices  # (B, n)
    i = torch.arange(n, device=score.device)
    return torch.where(i < below, idx, at_v.gather(1, (i - below).clamp(min=0)))


def small_ranks(key: Tensor) -> Tensor:
    """Each entry's place in its row sorted by key, equal keys by index: key (B, n) -> (B, n) int64, a permutation
    of ``0 .. n - 1`` per row (a stable sort's inverse). By pairwise comparison, ``O(n^2)`` per row in one fused
    pass: for the few hundred entries of a decode step's competition this is one kernel where a sort of so few
    is a radix sort of one thread block per row (tests/test_pooled.py: equal to ``sort(stable=True)``)."""
    n = key.shape[1]
    i = torch.arange(n, device=key.device)
    a, b = key[:, :, None], key[:, None, :]  # (B, n, 1) this entry, (B, 1, n) the others
    return ((b < a) | ((b == a) & (i[None, :] < i[:, None])[None])).sum(2)


def order_of(key: Tensor) -> Tensor:
    """The indices that sort each row of key (B, n) ascending, equal keys by index (``key.sort(stable=True).indices``)
    from :func:`small_ranks`: one scatter of the ranks."""
    n = key.shape[1]
    return torch.empty_like(key, dtype=torch.int64).scatter_(1, small_ranks(key), torch.arange(n, device=key.device).expand_as(key))


def select_lowest_set(score: Tensor, tie: Tensor, n: int) -> Tensor:
    """:func:`select_lowest`'s ``n`` candidates (the ``n`` lowest by (score, tie)) in no particular order: score (B, N)
    float, tie (B, N) int64 (distinct within a row among equal scores) -> (B, n) indices.

    Its decode-step form: both ``topk`` unsorted (a sorted ``topk`` adds a radix sort of its ``n`` results), and the
    ties at the ``n``-th lowest score ``v`` ordered among the ``n`` lowest of them by :func:`small_ranks`."""
    B = score.shape[0]
    dev = score.device
    vals, idx = score.topk(n, dim=1, largest=False, sorted=False)  # (B, n) the n lowest scores, any of those at v
    v = vals.max(1, keepdim=True).values  # (B, 1) the n-th lowest score
    is_below = vals < v  # (B, n) every candidate below v is among the n lowest
    below = is_below.sum(1, keepdim=True)  # (B, 1)
    tv, ti = torch.where(score == v, tie, I64_MAX).topk(n, dim=1, largest=False, sorted=False)  # (B, n) the lowest ties at v
    rt = small_ranks(tv)  # (B, n)
    take = rt < n - below  # (B, n) the n - below lowest of them (at least that many are at v)
    place = torch.where(is_below, is_below.cumsum(1) - 1, n)  # (B, n): the below-v ones first, then the ties taken
    out = torch.zeros(B, n + 1, dtype=torch.int64, device=dev).scatter_(1, place, idx)  # column n: the ones not taken
    return out.scatter_(1, torch.where(take, below + rt, n), ti)[:, :n]


#: the decode step's and a decaying prefill query's selection: :func:`select_lowest_set` and :func:`order_of` (True), or
#: their sorted twins :func:`select_lowest` and ``sort`` (False; the same decisions: ``bench/kernels/profile_decode.py
#: --sorted`` measures both)
RANKED_SELECTION = True

#: a decaying prefill chunk's query (:meth:`PoolStore._decaying_query`) compiled (torch.compile) inside its CUDA graph (True):
#: its some 30 elementwise operations, gathers and scatters fused into a few kernels around the two ``topk``, where eagerly
#: each is a kernel of its own; False: the eager body, its twin (tests/test_pooled.py, tests/test_gpu.py)
COMPILED_QUERIES = True


class PoolStore:
    """The rings and the pool of a ``pooled`` :class:`kvpop.decode.DecodeEngine` (module docstring).

    ``max_len``: the most tokens the engine holds, if known: the rings then hold ``min(R, max_len)``
    slots and the pool ``min(P, F x (max_len - R))`` entries (no more can ever have left the windows),
    which changes no decision."""

    def __init__(self, *, batch: int, layers: int, kv_heads: int, head_dim: int, layout: CacheLayout, dtype, device,
                 page: int, decays: bool, max_len: int | None = None, flex: bool = False, list_steps: int = 0, decay_block: int = 64):
        if decay_block < 1:
            raise ValueError(f"pooled engine: decay_block (queries per candidate list of a decaying prefill chunk) must be >= 1, got {decay_block}")
        if kv_heads > page:
            raise ValueError(f"pooled engine: a page ({page} slots) must hold one entry per KV head ({kv_heads})")
        B, L, Hk, D = batch, layers, kv_heads, head_dim
        self.B, self.L, self.Hk, self.D, self.F, self.page = B, L, Hk, D, L * Hk, page
        self.sinks, self.window, self.decays = layout.sinks, layout.window, decays
        full_ring = layout.sinks + layout.window
        self.R = min(full_ring, max_len) if max_len is not None else full_ring  # ring slots per head
        P = self.F * layout.long_range
        if max_len is not None:
            P = min(P, self.F * max(0, max_len - full_ring))
        self.P = P
        self.RP = -(-(Hk * self.R) // page)  # ring pages per layer
        self.RS = self.RP * page  # ring slots per layer
        self.NPP = (-(-(P + self.F) // page) + L if P else 0) + 1  # pool pages, the last the dump page
        self.PS0 = L * self.RS  # first pool slot
        self.NP = (self.NPP - 1) * page  # pool slots that can hold entries
        self.NS = self.PS0 + self.NPP * page
        self.dump = self.NS - 1
        self.device, self.flex = device, flex
        # the candidate list of the decode step (module docstring): T steps per refresh, C0 entries at a refresh, C in all
        if list_steps < 0:
            raise ValueError(f"list_steps must be >= 0 (steps per refresh of the step's candidate list; 0: none), got {list_steps}")
        T = int(list_steps)
        self.C0 = 2 * (self.F + self.F * T)
        self.C = self.C0 + self.F * T
        self.list_steps = T if T and self.C < self.NP else 0  # a list as long as the pool saves nothing
        self.list_left = 0  # steps the list still serves (host); 0: refresh before the next step
        self._query_graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = {}  # compete_decaying's loops
        self._query_fn = None  # the compiled query body of those loops (COMPILED_QUERIES), made at its first use
        self.decay_block = decay_block  # compete_decaying's queries per candidate list
        #: the last prefill chunk's candidate lists, (listed, of) each (a diagnostic, bench_pool_prefill.py): the static closed
        #: form's one (pool entries listed, of the pool's slots; every leaver is listed too); decaying ranks' chunk list (candidates
        #: listed, of all), then one per block (candidates listed, of those of the chunk's list present in it)
        self.chunk_lists: list[tuple[int, int]] = []
        self.listed = False  # the next step's candidates: the list (True) or the whole pool
        nc = self.C if self.list_steps else 0
        self.cand = torch.zeros(B, nc + 1, dtype=torch.int64, device=device)  # store slots of the listed entries; column C: junk
        self.ccount = torch.zeros(B, dtype=torch.int64, device=device)  # the list's length
        self.keys = torch.zeros(B, self.NS, D, dtype=dtype, device=device)
        self.values = torch.zeros(B, self.NS, D, dtype=dtype, device=device)
        # the compiled step reads and writes keys and values only through these views of row groups (GROUP_ELEMENTS)
        self.groups = row_groups(B, self.NS * D)
        self.key_groups = [self.keys[r0:r1] for r0, r1 in self.groups]
        self.value_groups = [self.values[r0:r1] for r0, r1 in self.groups]
        self.pos = torch.full((B, self.NS), -1, dtype=torch.int64, device=device)  # -1: empty
        self.tag = torch.full((B, self.NS), -1, dtype=torch.int64, device=device)  # pair layer * Hk + head, -1: empty
        self.prio = torch.zeros(B, self.NS, dtype=torch.float64, device=device)  # a pool entry's priority (log beta, dbtrimkv)
        self.lidx = torch.zeros(B, self.NS, dtype=torch.int64, device=device)  # a pool entry's index in its layer's list
        # a listed entry's place in cand, -1: none (int32: 4 bytes a slot, only where the step lists)
        self.lpos = torch.full((B, self.NS if self.list_steps else 0), -1, dtype=torch.int32, device=device)
        self.count = torch.zeros(B, L, dtype=torch.int64, device=device)  # n_l: entries of each layer's pool list
        self.ptab = torch.zeros(B, L, self.NPP + 1, dtype=torch.int64, device=device)  # logical page -> pool page; column NPP: junk
        self.used = torch.zeros(B, self.NPP + 1, dtype=torch.bool, device=device)  # pool page in use (the dump page always); NPP: junk
        f = torch.arange(self.F, device=device)
        self.pair = f  # (F,)
        self.ring_base = (f // Hk) * self.RS + (f % Hk) * self.R  # (F,) ring slot 0 of each pair
        # the compiled step's block masks, one per layer: its ring pages, then its pool pages
        nb = -(-(self.RP + self.NPP - 1) // 4) * 4  # rows a multiple of 16 bytes: every layer's view stays aligned
        self.bm_idx = torch.zeros(L, B, 1, 1, nb, dtype=torch.int32, device=device)
        self._bm_num = torch.zeros(L, -(-B // 4) * 4, dtype=torch.int32, device=device)  # rows of 16 bytes: aligned views
        self.bm_num = [self._bm_num[i, :B].view(B, 1, 1) for i in range(L)]  # kv_num_blocks (B, 1, 1) of each layer
        ring_pages = torch.arange(L, device=device)[:, None] * self.RP + torch.arange(self.RP, device=device)  # (L, RP)
        self.bm_idx[:, :, 0, 0, : self.RP] = ring_pages.to(torch.int32)[:, None]
        self.reset()

    # --- bookkeeping ------------------------------------------------------------------------------
    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()
        self.pos.fill_(-1)
        self.tag.fill_(-1)
        self.prio.zero_()
        self.lidx.zero_()
        self.lpos.fill_(-1)
        self.cand.fill_(self.dump)
        self.ccount.zero_()
        self.forget_list()
        self.count.zero_()
        self.ptab.zero_()
        self.used.zero_()
        self.used[:, self.NPP - 1] = True  # the dump page
        self._sync_block_masks()

    def load_row(self, src: PoolStore, r: int) -> None:
        """This store of one row takes row ``r`` of ``src`` (the same geometry): every per-row buffer, the step's
        candidate list and how many steps it still serves (:meth:`kvpop.decode.engine.DecodeEngine.load_row`)."""
        if self.B != 1 or (self.NS, self.NPP, self.R, self.P, self.C, self.list_steps) != (src.NS, src.NPP, src.R, src.P, src.C, src.list_steps):
            raise ValueError("PoolStore.load_row: a store of one row and the same geometry as the source")
        for name in ("keys", "values", "pos", "tag", "prio", "lidx", "lpos", "cand", "ccount", "count", "ptab", "used"):
            getattr(self, name).copy_(getattr(src, name)[r : r + 1])
        self.bm_idx.copy_(src.bm_idx[:, r : r + 1])
        self._bm_num[:, 0].copy_(src._bm_num[:, r])
        self.list_left, self.listed = src.list_left, src.listed

    def nbytes(self) -> int:
        bufs = (self.keys, self.values, self.pos, self.tag, self.prio, self.lidx, self.lpos, self.cand, self.ccount, self.count, self.ptab,
                self.used, self.bm_idx, self._bm_num)
        return sum(t.numel() * t.element_size() for t in bufs)

    def read_kv(self, slot: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values (B, n, D) of each row's slots slot (B, n), read group by group (:attr:`key_groups`: what the
        compiled step may touch)."""
        out = []
        for bufs in (self.key_groups, self.value_groups):
            parts = [g.gather(1, slot[r0:r1, :, None].expand(-1, -1, self.D)) for g, (r0, r1) in zip(bufs, self.groups, strict=True)]
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        return out[0], out[1]

    def write_kv(self, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Keys and values k, v (B, n, D) into each row's slots slot (B, n) (distinct within a row, but for the dump
        slot), group by group."""
        for bufs, val in ((self.key_groups, k), (self.value_groups, v)):
            for g, (r0, r1) in zip(bufs, self.groups, strict=True):
                g.scatter_(1, slot[r0:r1, :, None].expand(-1, -1, self.D), val[r0:r1])

    def home_slot(self, pos: Tensor | int) -> Tensor | int:
        """Ring slot of a sink or window token at position(s) pos (:meth:`CacheLayout.home_slot`)."""
        if isinstance(pos, int):
            return pos if pos < self.sinks else self.sinks + (pos - self.sinks) % self.window
        return torch.where(pos < self.sinks, pos, self.sinks + (pos - self.sinks) % self.window)

    def ring_slots(self, layer: int, pos: Tensor) -> Tensor:
        """Store slots of positions pos (C,) in every head of ``layer``'s ring -> (Hk, C)."""
        heads = torch.arange(self.Hk, device=pos.device)[:, None]
        return layer * self.RS + heads * self.R + self.home_slot(pos)[None]

    def pair_slots(self, pos: Tensor) -> Tensor:
        """Store slots of positions pos (n,) in every pair's ring (sinks and window tokens) -> (F, n), pair
        ``f = layer * Hk + head`` (:meth:`ring_slots` of every layer at once)."""
        return self.ring_base[:, None] + self.home_slot(pos)[None, :]

    def pages(self, layer: int) -> Tensor:
        """Pages in use by layer's pool list (B,) int64."""
        return (self.count[:, layer] + self.page - 1) // self.page

    def layer_slots(self, layer: int, count: Tensor | None = None, ptab: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Store slots of layer's rings and pool pages (B, N) and whether each is the layer's (B, N) bool
        (a page past a row's own count is another row's length: not its); eager (one host sync)."""
        count = self.count if count is None else count
        ptab = self.ptab if ptab is None else ptab
        pg = (count[:, layer] + self.page - 1) // self.page  # (B,)
        n = int(pg.max())
        ring = layer * self.RS + torch.arange(self.RS, device=self.device).expand(self.B, -1)  # (B, RS)
        j = torch.arange(n, device=self.device)
        pool = self.PS0 + ptab[:, layer, :n, None] * self.page + torch.arange(self.page, device=self.device)  # (B, n, page)
        mine = (j < pg[:, None])[:, :, None].expand(-1, -1, self.page)
        return torch.cat([ring, pool.flatten(1)], 1), torch.cat([torch.ones_like(ring, dtype=torch.bool), mine.flatten(1)], 1)

    def occupancy(self) -> Tensor:
        """Entries held per layer and KV head (rings and pool), per row: (B, L, Hk) int64."""
        t = torch.where(self.tag >= 0, self.tag, self.F)
        return torch.zeros(self.B, self.F + 1, dtype=torch.int64, device=self.device).scatter_add_(1, t, torch.ones_like(t))[:, : self.F].view(
            self.B, self.L, self.Hk)

    def _sync_block_masks(self) -> None:
        """The compiled step's block masks from the page tables: layer l reads its ring pages and its pages."""
        if not self.flex:
            return
        npp = self.NPP - 1
        self._bm_num[:, : self.B] = (self.RP + (self.count + self.page - 1) // self.page).t().to(torch.int32)
        self.bm_idx[:, :, 0, 0, self.RP : self.RP + npp] = (self.PS0 // self.page + self.ptab[:, :, :npp]).transpose(0, 1).to(torch.int32)

    # --- the competition -----------------------------------------------------------------------------
    def leaver_slots(self, j: Tensor) -> Tensor:
        """Ring slots (F,) of token j (0-d int64, a non-sink) in every layer and head."""
        return self.ring_base + self.home_slot(j.clamp(min=self.sinks))

    def update(self, q: Tensor, prio: Tensor, *, move_kv: bool = True, track: tuple[Tensor, Tensor] | None = None) -> None:
        """The competition at query ``q`` (0-d int64): token ``j = q - window`` leaves every ring, its
        priorities prio (B, F) float64 (pair ``f = layer * Hk + head``); the ``r`` lowest candidates go
        and the layers' lists are compacted (module docstring). A ``j`` below ``sinks`` changes nothing.

        ``move_kv=False`` moves the bookkeeping only (a prefill chunk reads the keys and values as they
        were at its start); ``track = (orig, e)`` (B, NS) int64 each: ``orig`` the chunk-start slot of each
        slot's entry, moved along with it; ``e`` indexed by chunk-start slot, set to ``q`` where the entry
        goes (its eviction time)."""
        B, F, Hk, L, NP, PS0, pg = self.B, self.F, self.Hk, self.L, self.NP, self.PS0, self.page
        dev = self.device
        rows = torch.arange(B, device=dev)[:, None]
        j = q - self.window
        leaves = j >= self.sinks  # 0-d
        src_ring = self.leaver_slots(j)  # (F,)
        # candidates: the pool's slots (or the listed ones: refresh_list), the F leavers, F virtual empty entries (the F - r lowest of all)
        if self.listed:
            cs = self.cand[:, : self.C]  # (B, NC) store slots, the dump slot where empty
            ppos, pprio, ptag = self.pos.gather(1, cs), self.prio.gather(1, cs), self.tag.gather(1, cs)  # (B, NC)
        else:
            cs = None
            ppos, pprio, ptag = self.pos[:, PS0 : PS0 + NP], self.prio[:, PS0 : PS0 + NP], self.tag[:, PS0 : PS0 + NP]  # (B, NP)
        NC = ppos.shape[1]
        valid = ptag >= 0
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
        rank = (q - ppos).double() * pprio if self.decays else pprio
        score = torch.where(valid, rank, inf)
        tie = torch.where(valid, ppos * F + (F - 1 - ptag), I64_MAX)
        lrank = self.window * prio if self.decays else prio  # (B, F): a leaver is window old
        lscore = torch.where(leaves, lrank, inf)
        ltie = (j * F + (F - 1 - self.pair)).expand(B, F)
        r = (self.count.sum(1) + F * leaves.long() - self.P).clamp(min=0)  # (B,) real candidates beyond P
        vi = torch.arange(F, device=dev)
        vscore = torch.where(vi < F - r[:, None], -inf, inf)  # (B, F)
        vtie = (-1 - vi).expand(B, F)
        pick = select_lowest_set if RANKED_SELECTION else select_lowest
        gone = pick(torch.cat([score, lscore, vscore], 1), torch.cat([tie, ltie, vtie], 1), F)  # (B, F), any order
        # removed pool entries (holes) and leavers that do not stay
        is_hole = gone < NC
        hole = torch.where(is_hole, PS0 + gone if cs is None else cs.gather(1, gone.clamp(max=NC - 1)), self.dump)  # (B, F) store slots
        is_lv = (gone >= NC) & (gone < NC + F)
        lv_gone = torch.zeros(B, F + 1, dtype=torch.bool, device=dev).scatter_(1, torch.where(is_lv, gone - NC, F), True)[:, :F]
        stays = leaves & ~lv_gone  # (B, F)
        h_layer = torch.where(is_hole, self.tag.gather(1, hole) // Hk, L)  # (B, F); L: not a hole
        h_lidx = torch.where(is_hole, self.lidx.gather(1, hole), 0)
        hcount = torch.zeros(B, L + 1, dtype=torch.int64, device=dev).scatter_add_(1, h_layer, torch.ones_like(h_layer))[:, :L]  # (B, L)
        acount = stays.view(B, L, Hk).sum(-1)  # (B, L) leavers that enter each layer's list
        n = self.count
        n2 = n - hcount + acount
        start = hcount.cumsum(1) - hcount  # (B, L) a layer's first hole in the sorted list
        hkey = h_layer * (NP + 1) + h_lidx  # (B, F)
        order = order_of(hkey) if RANKED_SELECTION else hkey.sort(1).indices  # holes by (layer, index), non-holes last
        s_slot, s_lidx = hole.gather(1, order), h_lidx.gather(1, order)  # (B, F)
        # the entering leavers: the layer's first holes, then appended at n_l, n_l + 1, ...
        lay = self.pair // Hk  # (F,)
        rk = (stays.view(B, L, Hk).cumsum(-1) - 1).view(B, F)
        hl, st, nl = hcount[:, lay], start[:, lay], n[:, lay]  # (B, F)
        use_hole = rk < hl
        at = (st + rk).clamp(0, F - 1)
        new_lidx = torch.where(use_hole, s_lidx.gather(1, at), nl + rk - hl)
        # the layers' last live entries fill the holes left below n2 (swap with last)
        t = torch.arange(F, device=dev)
        s_tail = n2[:, :, None] + t  # (B, L, F) logical indices [n2, n)
        in_tail = t < (n - n2)[:, :, None]
        tail = self._slot(torch.arange(L, device=dev)[None, :, None], s_tail, in_tail)  # (B, L, F)
        marked = torch.zeros(B, self.NS, dtype=torch.bool, device=dev).scatter_(1, hole, True)
        live = in_tail & ~marked.gather(1, tail.view(B, -1)).view(B, L, F)
        mrank = live.cumsum(-1) - 1
        fill = (start + acount)[:, :, None] + mrank  # sorted-hole index each mover fills
        mv_dst = torch.where(live, s_slot.gather(1, fill.clamp(0, F - 1).view(B, -1)).view(B, L, F), self.dump).view(B, -1)
        mv_lidx = s_lidx.gather(1, fill.clamp(0, F - 1).view(B, -1))
        mv_src = torch.where(live, tail, self.dump).view(B, -1)  # (B, L * F)
        # pages: a layer that grows past its pages takes the lowest page free before this step; pages past ceil(n2 / page) go back
        pg_old, pg_new = (n + pg - 1) // pg, (n2 + pg - 1) // pg  # (B, L)
        grow = pg_new > pg_old
        free = ~self.used[:, : self.NPP]
        frank = free.cumsum(1) - 1
        fmap = torch.full((B, L + 1), self.NPP - 1, dtype=torch.int64, device=dev)
        fmap.scatter_(1, torch.where(free & (frank < L), frank, L), torch.arange(self.NPP, device=dev).expand(B, -1))
        newpage = fmap.gather(1, torch.where(grow, grow.cumsum(1) - 1, L))  # (B, L)
        mf = F // pg + 2
        fp = pg_new[:, :, None] + torch.arange(mf, device=dev)  # (B, L, mf) logical pages that may be freed
        freed = torch.where(fp < pg_old[:, :, None], self.ptab.gather(2, fp.clamp(max=self.NPP)), self.NPP).view(B, -1)
        self.ptab.scatter_(2, torch.where(grow, pg_old, self.NPP)[:, :, None], newpage[:, :, None])
        self.used.scatter_(1, torch.where(grow, newpage, self.NPP), True)
        self.used.scatter_(1, freed, False)
        new_dst = torch.where(stays, torch.where(use_hole, s_slot.gather(1, at), self._slot(lay[None], new_lidx, stays)), self.dump)  # (B, F)
        # gather every source, then clear the holes and the tails, then write
        src = torch.cat([src_ring.expand(B, F), mv_src], 1)  # (B, F + L F)
        dst = torch.cat([new_dst, mv_dst], 1)
        moved = {
            "pos": torch.cat([j.expand(B, F), self.pos.gather(1, mv_src)], 1),
            "tag": torch.cat([self.pair.expand(B, F), self.tag.gather(1, mv_src)], 1),
            "prio": torch.cat([prio.to(torch.float64), self.prio.gather(1, mv_src)], 1),
            "lidx": torch.cat([new_lidx, mv_lidx], 1),
        }
        if self.list_steps:  # the list follows its entries: holes leave it, movers keep their place, entering leavers join at its end
            lp_hole = self.lpos.gather(1, hole).long()  # (B, F)
            app = self.ccount[:, None] + stays.long().cumsum(1) - 1  # (B, F)
            lp_new = torch.cat([torch.where(stays & (app < self.C), app, -1), self.lpos.gather(1, mv_src).long()], 1)  # (B, F + L F)
            moved["lpos"] = lp_new.to(torch.int32)
            self.ccount.add_(stays.sum(1))
        if move_kv:
            kv = self.read_kv(src)  # (B, F + L F, D) each
        if track is not None:
            orig, e = track
            o_src = orig.gather(1, src)
            gone_origin = torch.cat([torch.where(is_hole, orig.gather(1, hole), self.dump),
                                     torch.where(lv_gone & leaves, orig.gather(1, src_ring.expand(B, F)), self.dump)], 1)
            e.scatter_(1, gone_origin, q.expand(B, 2 * F))
        cleared = torch.cat([hole, torch.where(in_tail, tail, self.dump).view(B, -1)], 1)
        self.tag.scatter_(1, cleared, -1)
        self.pos.scatter_(1, cleared, -1)
        if self.list_steps:
            self.lpos.scatter_(1, cleared, -1)
            self.cand.scatter_(1, torch.where(lp_hole >= 0, lp_hole, self.C), self.dump)
            self.cand.scatter_(1, torch.where((lp_new >= 0) & (dst != self.dump), lp_new, self.C), dst)
        for name, val in moved.items():
            getattr(self, name).index_put_((rows, dst), val)
        if move_kv:
            self.write_kv(dst, *kv)
        if track is not None:
            orig.index_put_((rows, dst), o_src)
        # the dump slot stays empty
        self.tag[:, self.dump] = -1
        self.pos[:, self.dump] = -1
        if self.list_steps:
            self.lpos[:, self.dump] = -1
            self.cand[:, self.C] = self.dump
        self.count.copy_(n2)
        self._sync_block_masks()

    def refresh_list(self, q0: Tensor) -> bool:
        """The candidate list for the decode steps at queries ``q0 .. q0 + T - 1`` (``T = list_steps``; q0 0-d
        int64) -> whether it holds every pool entry that can go in them (one host synchronization; False:
        the steps compete over the whole pool, :attr:`listed` False).

        The list holds the entries that can go in those steps (:meth:`can_go`; at most ``C0``, more: False), and every
        leaver that enters the pool in those steps joins it (:meth:`update`), so each step's selection over
        the list, the leavers and the virtual entries is the whole pool's (tests/test_pooled.py)."""
        B, NP, PS0, dev = self.B, self.NP, self.PS0, self.device
        can = self.can_go(q0, self.list_steps)  # (B, NP)
        n = can.sum(1)  # (B,)
        pick = listed_first(can, self.C0)  # (B, C0) pool places, the listed first (C0 < NP: list_steps)
        self.cand.fill_(self.dump)  # the places past the listed, and those the step's leavers take later
        self.cand[:, : self.C0] = torch.where(pick < NP, PS0 + pick, self.dump)
        self.ccount.copy_(n.clamp(max=self.C0))
        self.lpos.fill_(-1)
        self.lpos.scatter_(1, self.cand[:, : self.C], torch.arange(self.C, dtype=torch.int32, device=dev).expand(B, -1))
        self.lpos[:, self.dump] = -1
        return bool((n <= self.C0).all())

    def can_go(self, q0: Tensor | int, n: int) -> Tensor:
        """The pool's entries that can be among the lowest-ranked at some query of ``q0 .. q0 + n - 1`` -> (B, NP)
        bool over the pool's slots (the others stay through those queries, whatever enters): :func:`can_go` over
        the pool, every entry present from ``q0``."""
        pool = slice(self.PS0, self.PS0 + self.NP)
        return can_go(self.pos[:, pool], self.prio[:, pool], self.tag[:, pool] >= 0, None, q0, n, F=self.F, decays=self.decays)

    def before_step(self, q: Tensor) -> None:
        """Before the decode step at query ``q`` (0-d int64): a fresh candidate list every ``list_steps`` steps
        (:meth:`refresh_list`), which sets :attr:`listed` for the steps it serves."""
        if not self.list_steps:
            return
        if self.list_left == 0:
            self.listed = self.refresh_list(q)
            self.list_left = self.list_steps
        self.list_left -= 1

    def forget_list(self) -> None:
        """The store changed outside the decode step (a prefill, a relayout): the next step refreshes the list."""
        self.list_left, self.listed = 0, False

    def compete_static(self, q0: int, prio: Tensor) -> tuple[Tensor, Tensor]:
        """The competitions at queries ``q0 .. q0 + n - 1`` (``n <= window``, every leaver ``j = q - window``
        a non-sink) of a *static* rule in closed form: prio (B, F, n) float64, the leavers' priorities (column
        ``t``: token ``q0 + t - window``) -> ``(orig, e)`` (B, NS) int64 each, as :meth:`update` with
        ``move_kv=False`` and ``track`` records them over the same queries: ``orig`` the chunk-start slot of
        each slot's entry, ``e`` the eviction time by chunk-start slot (``NEVER``: it stays).

        With static priorities and one total order (priority, then the tie key ``pos * F + (F - 1 - f)``:
        newer, then the lower pair, wins), the pool after query ``q`` is the top-``P`` of the pool at the
        start and the leavers up to ``q`` (a set that only grows; an entry once dropped has ``P`` entries above
        it that never leave before it). The tie key is also the arrival order: the pool's entries left their
        windows before ``q0 - window``, the leavers arrive by token. So an entry goes when the ``P``-th of its
        outrankers, by arrival, has arrived (and a leaver at its own arrival at the earliest): the formula of
        :func:`kvpop.selection.eviction_times`, one ``prefix_kth_smallest`` over the candidates ordered by
        (priority, key) descending, on their arrival ranks.

        Only the chunk's candidate list takes part (:meth:`_static_list`): the ``M = F (n + 1)`` lowest pool
        entries by that order and the ``F n`` leavers. At most ``F`` entries go at a query, ``F n`` in the
        chunk, so at every query at least ``F`` listed entries remain; every entry above the ``M``-th (the
        ``U`` unlisted pool entries, and the leavers above it) has them strictly below it and stays. Each of
        the ``U`` outranks every candidate below the ``M``-th and arrived before every leaver, so for those the
        ``P``-th outranker by arrival is the ``(P - U)``-th among the listed (for a leaver above the ``M``-th the
        count is too high, but ``P - U >= M`` exceeds the ``F n`` leavers, its only listed outrankers: it stays,
        as it must). The survivors are then laid out
        afresh: each layer's list dense from logical 0 (its old entries first), the layers' pages consecutive
        from pool page 0. The layout differs from the replay's, the decisions do not (tests/test_pooled.py)."""
        F, P, dev = self.F, self.P, self.device
        c = self._candidates(q0, prio)
        n = prio.shape[2]
        pick, extra = self._static_list(c, n)  # (B, S) candidate indices, (B, 1) U
        key, score, valid = (c[name].gather(1, pick) for name in ("key", "score", "valid"))  # (B, S) each
        B, S = key.shape
        arrival = key.sort(dim=1, stable=True).indices  # (B, S) by arrival (the invalid, key -1, first)
        arank = torch.empty_like(arrival).scatter_(1, arrival, torch.arange(S, device=dev).expand(B, S))  # (B, S) arrival rank
        # (score, key) descending, the invalid last: the arrival order reversed (the invalid at its end), then by score, stable
        order = arrival.flip(1)
        inv = torch.tensor(float("-inf"), dtype=score.dtype, device=dev)
        order = order.gather(1, torch.where(valid, score, inv).gather(1, order).sort(dim=1, descending=True, stable=True).indices)  # (B, S)
        ks = arank.gather(1, order)  # (B, S) arrival ranks in rank order
        r = torch.arange(S, device=dev).expand(B, S)  # outrankers among the listed of the candidate at rank r
        if P:
            need = P - extra  # (B, 1) the listed outrankers that make P with the U unlisted
            kth = prefix_kth_smallest(ks, r, need.expand(B, S), bits=max(1, S.bit_length()))  # (B, S) arrival rank; -1: fewer
            erank = torch.where(r >= need, torch.maximum(ks, kth), -1)
        else:
            erank = ks  # no pool: every leaver goes at once
        ekey = key.gather(1, arrival.gather(1, erank.clamp(min=0)))  # (B, S) the arrival key of that moment
        e_sorted = torch.where(valid.gather(1, order) & (erank >= 0), ekey // F + self.window, NEVER)
        e_list = torch.empty_like(e_sorted).scatter_(1, order, e_sorted)  # (B, S) by list place
        ec = torch.full_like(c["key"], NEVER).scatter_(1, pick, e_list)  # pick is distinct per row; the unlisted stay
        return self._relayout(c, ec)

    def _static_list(self, c: dict[str, Tensor], n: int) -> tuple[Tensor, Tensor]:
        """:meth:`compete_static`'s candidate list from a chunk's candidates ``c`` (:meth:`_candidates`, ``n``
        queries) -> ``(pick, extra)``: pick (B, S) the listed candidates' indices (the ``M = F (n + 1)`` lowest
        pool slots by (priority, key), empty ones counting as highest, then the ``F n`` leavers), extra (B, 1)
        ``U``, the valid pool entries left out (every one above the ``M``-th). Static shapes, no host
        synchronization; where the pool has no more than ``M`` slots, all of them."""
        F, NP, dev = self.F, self.NP, self.device
        key, score, valid = c["key"], c["score"], c["valid"]
        B = key.shape[0]
        M = F * (n + 1)
        leavers = NP + torch.arange(F * n, device=dev).expand(B, -1)  # (B, F n)
        if M >= NP:
            self.chunk_lists = [(NP, NP)]
            pick = torch.cat([torch.arange(NP, device=dev).expand(B, -1), leavers], 1)
            return pick, torch.zeros(B, 1, dtype=torch.int64, device=dev)
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=dev)
        pvalid = valid[:, :NP]
        slot = torch.arange(NP, device=dev)
        # empty slots rank highest: priority inf, distinct ties above every key (select_lowest's ties must be distinct)
        low = select_lowest(torch.where(pvalid, score[:, :NP], inf), torch.where(pvalid, key[:, :NP], I64_MAX - 1 - NP + slot), M)  # (B, M), its M-th last
        extra = (pvalid.sum(1, keepdim=True) - M).clamp(min=0)  # (B, 1) U
        self.chunk_lists = [(M, NP)]  # the chunk's one list: pool entries listed, of the pool's slots (chunk_lists)
        return torch.cat([low, leavers], 1), extra

    def compete_decaying(self, q0: int, prio: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`compete_static`'s contract for decaying ranks ``(q - i) * log beta`` (dbtrimkv): the chunk's
        competitions query by query, on candidate lists instead of the store (no compaction, no pages), then
        the survivors laid out afresh as there. prio (B, F, n): the leavers' ``log beta``.

        The queries run in blocks of :attr:`decay_block`; each block's list holds the candidates that can go
        within it, by :func:`can_go`'s argument over the candidates present then (the pool's entries and
        the leavers not yet gone, the leavers that arrive within the block): a rank is linear in ``q``, so over
        the block it lies between its values at the candidate's first query there (a leaver's arrival, ``window``
        old) and the block's last; with ``tau`` the ``(F + F b)``-th smallest highest rank among those present at
        the block's first query, a candidate whose lowest rank is above ``tau`` keeps ``F`` of them strictly below
        it at every query of the block, and stays. Each query's selection over the list (:func:`select_lowest`,
        the ranks and ties of :meth:`update`) then takes what the whole pool's would (tests/test_pooled.py: the
        replay's times). The blocks' lists come out of the chunk's own (the same argument over the whole chunk: one
        pass over all candidates). Shorter blocks, shorter lists; each block costs a pass over the chunk's list and a
        host synchronization (the list's length)."""
        F, NP, dev = self.F, self.NP, self.device
        n = prio.shape[2]
        c = self._candidates(q0, prio)
        key, lb, valid, pos = c["key"], c["score"], c["valid"], c["pos"]
        B, N = key.shape
        arrive = torch.cat([torch.full((B, NP), q0, dtype=torch.int64, device=dev), pos[:, NP:] + self.window], 1)  # (B, N) first query
        # the chunk's own list first (the candidates that can go at some query of it; the others stay through it), and each
        # block's out of it: a block's tau is at most the chunk's (of the F + F n lowest highest ranks present at q0, at most
        # F (qb - q0) are gone by qb, and each rank's highest over the block is at most its highest over the chunk), and every
        # candidate left out has its lowest rank, so its highest over any block, above the chunk's tau: the same block lists
        # as out of all N candidates, each block's pass over the chunk's list instead of the whole pool
        can0 = can_go(pos, lb, valid, arrive, q0, n, F=F, decays=True)  # (B, N)
        m0, total = (int(x) for x in torch.stack([can0.sum(1).max(), valid.sum(1).max()]).tolist())  # one host sync per chunk
        self.chunk_lists = [(m0, total)]  # the chunk's list, then (listed, present) per block (chunk_lists)
        sub = listed_first(can0, list_width(m0, N, dev))  # (B, M) the chunk's list: places among the N candidates, then padding
        inlist = sub < N
        sub = sub % N
        pos, lb, key, arrive = (t.gather(1, sub) for t in (pos, lb, key, arrive))  # (B, M) each
        M = sub.shape[1]
        e_sub = torch.full((B, M), NEVER, dtype=torch.int64, device=dev)  # eviction times by place in the chunk's list
        count = self.count.sum(1)  # (B,) the pool's entries before the block's first query
        for qb in range(q0, q0 + n, self.decay_block):
            nb = min(self.decay_block, q0 + n - qb)
            here = inlist & (e_sub == NEVER) & (arrive < qb + nb)  # (B, M) present at some query of the block
            can = can_go(pos, lb, here, arrive, qb, nb, F=F, decays=True)  # (B, M)
            m, present = (int(x) for x in torch.stack([can.sum(1).max(), here.sum(1).max()]).tolist())  # one host sync per block
            self.chunk_lists.append((m, present))
            pick = listed_first(can, list_width(m, M, dev))  # (B, m) the listed, then padding (unlisted ones: distinct)
            listed = pick < M
            pick = pick % M
            cand = {"pos": pos.gather(1, pick), "lb": lb.gather(1, pick), "key": key.gather(1, pick), "arrive": arrive.gather(1, pick),
                    "listed": listed}
            e_b = self._decaying_queries(qb, nb, cand, count)  # (B, m)
            gone = listed & (e_b < NEVER)
            e_sub.scatter_(1, pick, torch.where(gone, e_b, e_sub.gather(1, pick)))  # pick is distinct per row
            count = count + F * nb - gone.sum(1)  # every query's F leavers enter, the gone leave
        e = torch.full((B, N), NEVER, dtype=torch.int64, device=dev).scatter_(1, sub, torch.where(inlist, e_sub, NEVER))  # sub: distinct
        return self._relayout(c, torch.where(valid, e, NEVER))

    def _decaying_queries(self, q0: int, n: int, cand: dict[str, Tensor], count: Tensor) -> Tensor:
        """:meth:`compete_decaying`'s queries ``q0 .. q0 + n - 1`` over its list ``cand`` (``pos``, ``lb``, ``key``,
        ``arrive`` (B, S), ``listed`` (B, S) bool: padding False) with ``count`` (B,) pool entries before the
        first -> each candidate's eviction time (B, S) (``NEVER``: it stays).

        On CUDA the ``n`` queries run as one CUDA graph per list shape ``(S, n)``, captured once per store and
        replayed, each query the body compiled (:data:`COMPILED_QUERIES`; eagerly it launches some 60 kernels a query);
        eager elsewhere, the same loop body."""
        B, S, dev = count.shape[0], cand["pos"].shape[1], self.device
        consts = {"inf": torch.tensor(float("inf"), dtype=torch.float64, device=dev), "vi": torch.arange(self.F, device=dev)}
        if dev.type != "cuda":
            bufs = {**cand, **consts, "count": count.clone(), "q": torch.tensor(q0, device=dev),
                    "e": torch.full((B, S + 1), NEVER, dtype=torch.int64, device=dev)}
            for _ in range(n):
                self._decaying_query(bufs)
            return bufs["e"][:, :S]
        key = (B, S, n)
        if key not in self._query_graphs:
            query = type(self)._decaying_query
            if COMPILED_QUERIES:
                if self._query_fn is None:
                    self._query_fn = torch.compile(query, fullgraph=True)  # a second list length makes it dynamic: one more compile
                query = self._query_fn
            bufs = {name: torch.empty_like(t) for name, t in cand.items()}
            bufs.update(consts, count=torch.empty_like(count), q=torch.zeros((), dtype=torch.int64, device=dev),
                        e=torch.empty(B, S + 1, dtype=torch.int64, device=dev))
            bufs["listed"].fill_(False)  # the warm-up changes nothing
            bufs["count"].zero_()
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                query(self, bufs)  # compiles (a new list shape: once)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(n):
                    query(self, bufs)
            self._query_graphs[key] = (graph, bufs)
        graph, bufs = self._query_graphs[key]
        for name, t in cand.items():
            bufs[name].copy_(t)
        bufs["count"].copy_(count)
        bufs["q"].fill_(q0)
        bufs["e"].fill_(NEVER)
        graph.replay()
        return bufs["e"][:, :S].clone()

    def _decaying_query(self, b: dict[str, Tensor]) -> None:
        """One query ``b["q"]`` (0-d, then advanced by one) of :meth:`_decaying_queries`, on its buffers: the
        candidates present at it (listed, not yet gone, arrived) compete with ranks ``(q - i) * log beta`` and
        :meth:`update`'s ties against ``F`` virtual entries, of which ``F - r`` rank lowest; the gone get
        ``e = q``; the pool's count follows."""
        F, P = self.F, self.P
        e, q, count, inf, vi = b["e"], b["q"], b["count"], b["inf"], b["vi"]  # vi (F,): the virtual entries
        B, S = b["pos"].shape
        here = b["listed"] & (e[:, :S] == NEVER) & (b["arrive"] <= q)  # (B, S) the candidates at q
        score = torch.where(here, (q - b["pos"]).double() * b["lb"], inf)  # as update: (q - i) * log beta
        tie = torch.where(here, b["key"], I64_MAX)
        r = (count + F - P).clamp(min=0)  # (B,) real candidates beyond P
        vscore = torch.where(vi < F - r[:, None], -inf, inf)
        pick = select_lowest_set if RANKED_SELECTION else select_lowest
        gone = pick(torch.cat([score, vscore], 1), torch.cat([tie, (-1 - vi).expand(B, F)], 1), F)  # (B, F), any order
        e.scatter_(1, torch.where(gone < S, gone, S), q.expand(B, F))
        count.add_(F - r)
        q.add_(1)

    def _candidates(self, q0: int, prio: Tensor) -> dict[str, Tensor]:
        """A prefill chunk's candidates: the pool's slots (empty ones invalid), then its leavers ``(f, t) ->
        f * n + t`` (token ``q0 + t - window``): each (B, N) ``key`` (the tie key ``pos * F + (F - 1 - f)``,
        -1: invalid), ``score`` (priority or log beta), ``pos``, ``tag``, ``valid`` and ``src`` (N,), the
        chunk-start slot."""
        B, F, NP, PS0, dev = self.B, self.F, self.NP, self.PS0, self.device
        n = prio.shape[2]
        j = torch.arange(q0 - self.window, q0 - self.window + n, device=dev)  # (n,) the leavers
        ptag = self.tag[:, PS0 : PS0 + NP]  # (B, NP)
        lkey = (j[None, :] * F + (F - 1 - self.pair)[:, None]).reshape(1, F * n)  # (1, F n)
        key = torch.cat([torch.where(ptag >= 0, self.pos[:, PS0 : PS0 + NP] * F + (F - 1 - ptag), -1), lkey.expand(B, -1)], 1)  # (B, N)
        return {
            "key": key, "valid": key >= 0,
            "score": torch.cat([self.prio[:, PS0 : PS0 + NP], prio.reshape(B, F * n).to(torch.float64)], 1),
            "pos": torch.cat([self.pos[:, PS0 : PS0 + NP], j.repeat(F).expand(B, -1)], 1),
            "tag": torch.cat([ptag, self.pair.repeat_interleave(n).expand(B, -1)], 1),
            "src": torch.cat([PS0 + torch.arange(NP, device=dev), self.pair_slots(j).reshape(F * n)]),
        }

    def _relayout(self, c: dict[str, Tensor], ec: Tensor) -> tuple[Tensor, Tensor]:
        """The store after a chunk's competitions from its candidates ``c`` (:meth:`_candidates`) and their
        eviction times ec (B, N) (``NEVER``: stays) -> ``(orig, e)`` (:meth:`compete_static`). The survivors
        are laid out afresh: layer by layer, each list dense (its old entries first), the pages consecutive."""
        B, Hk, L, NP, PS0, pg, dev = self.B, self.Hk, self.L, self.NP, self.PS0, self.page, self.device
        rows = torch.arange(B, device=dev)[:, None]
        src, N = c["src"], ec.shape[1]
        e = torch.full((B, self.NS), NEVER, dtype=torch.int64, device=dev).scatter_(1, src.expand(B, N), ec)
        layer = torch.where(c["valid"] & (ec == NEVER), c["tag"] // Hk, L)  # (B, N); L: not kept
        cnt = torch.zeros(B, L + 1, dtype=torch.int64, device=dev).scatter_add_(1, layer, torch.ones_like(layer))[:, :L]  # (B, L)
        by = (layer * N + torch.arange(N, device=dev)).sort(1).indices  # (B, N) survivors by layer, old entries first
        sl = layer.gather(1, by)
        kept = sl < L
        slc = sl.clamp(max=L - 1)
        lidx = torch.arange(N, device=dev) - (cnt.cumsum(1) - cnt).gather(1, slc)  # (B, N) logical index in the layer's list
        npg = (cnt + pg - 1) // pg  # (B, L)
        pbase = npg.cumsum(1) - npg
        dst = torch.where(kept, PS0 + (pbase.gather(1, slc) + lidx // pg) * pg + lidx % pg, self.dump)  # (B, N) store slots
        vals = {name: c[name].gather(1, by) for name in ("pos", "tag", "score")}
        for name in ("tag", "pos"):
            getattr(self, name)[:, PS0 : PS0 + NP] = -1
        for name, buf in (("pos", self.pos), ("tag", self.tag), ("score", self.prio)):
            buf.index_put_((rows, dst), vals[name])
        self.lidx.index_put_((rows, dst), lidx)
        orig = torch.arange(self.NS, device=dev).expand(B, -1).clone()
        orig.index_put_((rows, dst), src[by])
        orig[:, self.dump] = self.dump
        self.tag[:, self.dump] = -1
        self.pos[:, self.dump] = -1
        col = torch.arange(self.NPP + 1, device=dev)
        self.ptab.copy_(torch.where(col < npg[..., None], pbase[..., None] + col, 0))
        self.used.copy_(col < npg.sum(1, keepdim=True))
        self.used[:, self.NPP - 1] = True  # the dump page
        self.count.copy_(cnt)
        self.forget_list()
        self._sync_block_masks()
        return orig, e

    def _slot(self, layer: Tensor, s: Tensor, ok: Tensor) -> Tensor:
        """Store slot of logical index s in layer's list (broadcast shapes); the dump slot where not ``ok``."""
        B = self.B
        pg = (s // self.page).clamp(0, self.NPP)
        shape = torch.broadcast_shapes(layer.shape, s.shape)
        rows = torch.arange(B, device=self.device).view(B, *([1] * (len(shape) - 1)))
        page = self.ptab[rows, layer.expand(shape), pg.expand(shape)]
        return torch.where(ok, self.PS0 + page * self.page + s % self.page, self.dump)

    # --- the benchmark's state --------------------------------------------------------------------
    @torch.no_grad()
    def fill(self, ctx: int, generator: torch.Generator) -> None:
        """The state after ``ctx`` tokens, at random: rings full, the pool's ``P`` entries spread over the
        layers and heads as a per-head cache would hold them (``k`` each), random keys, values and
        priorities. A step does the same work whatever the entries hold (``kvpop.benchmarking.fill_cache``)."""
        self.reset()
        B, L, Hk, dev = self.B, self.L, self.Hk, self.device
        fixed = torch.cat([torch.arange(min(ctx, self.sinks), device=dev), torch.arange(max(self.sinks, ctx - self.window), ctx, device=dev)])
        for l in range(L):
            slots = self.ring_slots(l, fixed)  # (Hk, m)
            self.pos[:, slots] = fixed
            self.tag[:, slots] = (l * Hk + torch.arange(Hk, device=dev))[:, None]
        older = max(0, ctx - self.window - self.sinks)
        per = min(older, self.P // self.F)  # entries per pair
        for l in range(L):
            n = per * Hk
            pgs = -(-n // self.page)
            if not pgs:
                continue
            pages = torch.arange(l * pgs, (l + 1) * pgs, device=dev)
            self.ptab[:, l, :pgs] = pages
            self.used[:, pages] = True
            s = torch.arange(n, device=dev)
            slot = self.PS0 + pages[s // self.page] * self.page + s % self.page
            self.pos[:, slot] = self.sinks + torch.randint(0, max(1, older), (n,), generator=generator, device=dev)
            self.tag[:, slot] = l * Hk + s % Hk
            self.lidx[:, slot] = s
            self.prio[:, slot] = -torch.rand(B, n, generator=generator, device=dev, dtype=torch.float64) * 1e-3
            self.count[:, l] = n
        live = self.tag >= 0
        for buf in (self.keys, self.values):
            for b in range(B):  # a row at a time: no float32 copy of the whole store
                buf[b] = torch.randn(buf.shape[1:], generator=generator, device=dev, dtype=torch.float32).to(buf.dtype) * live[b, :, None]
        self._sync_block_masks()


__all__ = ["GROUP_ELEMENTS", "NEVER", "PoolStore", "order_of", "row_groups", "select_lowest", "select_lowest_set", "small_ranks"]
