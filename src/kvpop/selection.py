"""Exact eviction times of a static-priority top-k KV-cache policy.

Setting (independently per KV head and per document of a packed row): at query
``q`` the cache keeps

* the *sinks*: tokens whose in-document position is ``< sinks`` (forever),
* the *window*: tokens ``t`` with ``q - t < window``,
* the *long-range slots*: the top-``k`` tokens of the eligible set
  ``E(q) = {t : pos_t >= sinks, t <= q - window}`` ranked by a static
  per-token priority.

Ties are broken by recency: among equal priorities the token with the larger
index (newer) outranks the older one. A priority of ``-inf`` is a *gate's
eviction* (``dms``): the token leaves with the window (``e_t = t + window``)
even while slots are free; it outranks no other token, so it changes no other
token's eviction time.  Because priorities are static and
``E(q)`` only grows with ``q``, an evicted token never comes back, so every
token has a single *eviction time* ``e_t``: the first query index at which it is
no longer kept.  Writing ``O_t`` for the eligible tokens of ``t``'s document
that outrank ``t``::

    e_t = NEVER                                   if |O_t| < k
    e_t = max(t + window, window + s_k(O_t))      otherwise,

where ``s_k`` is the ``k``-th smallest index of ``O_t`` (for ``k = 0``,
``e_t = t + window``).  Sinks and padding get ``e_t = NEVER``.  The attention
mask of the policy for KV head ``h`` is then::

    kv <= q  &  doc[q] == doc[kv]  &  doc[kv] >= 0
             &  (pos[kv] < sinks  |  q < e[h, kv])

Shapes: ``B`` batch, ``Hk`` KV heads, ``S`` sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpop.kernels import triton_available
from kvpop.order import prefix_kth_smallest

__all__ = [
    "NEVER",
    "candidate_eviction_times",
    "decaying_eviction_times",
    "decaying_eviction_times_reference",
    "document_spans",
    "eviction_times",
    "global_decaying_eviction_times",
    "pool_leavers",
    "recency_priority",
]

#: Eviction time of tokens that are never evicted (sinks, padding, tokens with
#: fewer than ``k`` outrankers).
NEVER: int = torch.iinfo(torch.int32).max


def document_spans(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Start (inclusive) and end (exclusive) index of every token's document.

    Documents are maximal contiguous runs of equal ``doc_ids``; padding runs
    (``-1``) are treated like any other run here.

    Args:
        doc_ids: ``(B, S)`` integer document ids.

    Returns:
        ``(start, end)``, both ``(B, S)`` int64.
    """
    B, S = doc_ids.shape
    idx = torch.arange(S, device=doc_ids.device).expand(B, S)
    first = torch.ones_like(doc_ids, dtype=torch.bool)
    first[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last = torch.ones_like(first)
    last[:, :-1] = first[:, 1:]
    start = torch.where(first, idx, 0).cummax(dim=-1).values
    end = torch.where(last, idx + 1, S).flip(-1).cummin(dim=-1).values.flip(-1)
    return start, end


def run_starts(keys: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` keys sorted into runs of equal values along the last dim -> ``(..., n)`` int64: the index of the
    first element of each element's run (in a document-sorted order: the elements of earlier documents before it)."""
    idx = torch.arange(keys.shape[-1], device=keys.device)
    first = torch.ones_like(keys, dtype=torch.bool)
    first[..., 1:] = keys[..., 1:] != keys[..., :-1]
    return torch.where(first, idx, 0).cummax(dim=-1).values


def recency_priority(B: int, Hk: int, S: int, device=None) -> torch.Tensor:
    """StreamingLLM-like priority (newer tokens win): ``(B, Hk, S)`` float32 index."""
    return torch.arange(S, device=device, dtype=torch.float32).expand(B, Hk, S)


def eligible_tokens(doc_ids: torch.Tensor, pos: torch.Tensor, sinks: int) -> torch.Tensor:
    """``(B, S)`` bool: tokens that ever compete for long-range slots (not sinks, not padding)."""
    return (doc_ids >= 0) & (pos >= sinks)


def priority_order(prio: torch.Tensor, doc_ids: torch.Tensor, pos: torch.Tensor, *, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ordered by (document asc, priority desc, index desc), ineligible ones last.

    The one ordering (and tie rule: the newer token wins) shared by the selection and the
    teacher's boundary labels. The document key is the start index of the document (monotone in
    the token index, independent of how ids are labelled), ``S`` for ineligible tokens.

    Returns:
        ``order`` (B, Hk, S) token indices in that order, and ``doc_key`` (B, Hk, S) per token.
    """
    B, Hk, S = prio.shape
    start, _ = document_spans(doc_ids)
    doc_key = torch.where(eligible_tokens(doc_ids, pos, sinks), start, S).unsqueeze(1).expand(B, Hk, S)
    order = torch.arange(S - 1, -1, -1, device=prio.device).expand(B, Hk, S)  # index desc
    order = order.gather(-1, prio.flip(-1).sort(dim=-1, descending=True, stable=True).indices)
    order = order.gather(-1, doc_key.gather(-1, order).sort(dim=-1, stable=True).indices)
    return order, doc_key


@torch.no_grad()
def eviction_times(
    prio: torch.Tensor,
    doc_ids: torch.Tensor,
    pos: torch.Tensor,
    *,
    sinks: int,
    window: int,
    long_range: int,
) -> torch.Tensor:
    """Exact eviction time of every token under the static top-k policy.

    Fully vectorized over ``B``, ``Hk`` and ``S`` with ``O(S log S)`` work per
    head: tokens are ordered by (document, priority desc, index desc) with the
    ineligible ones (sinks, padding) last; in that order the prefix before a
    token of document ``d`` is ``c0_d`` eligible tokens of earlier documents
    (all with smaller indices) followed by exactly its outrankers ``O_t``, so the
    ``k``-th smallest index of ``O_t`` is the ``(c0_d + k)``-th smallest index of
    the prefix, answered for all prefixes at once by a wavelet matrix.

    Args:
        prio: ``(B, Hk, S)`` float priorities (higher is kept first).
        doc_ids: ``(B, S)`` int document ids, contiguous runs, ``-1`` = padding.
        pos: ``(B, S)`` int position inside the document (0 at its start).
        sinks: number of always-kept tokens at the start of each document.
        window: size ``w`` of the recent window (token ``t`` protected while ``q - t < w``).
        long_range: number of long-range slots ``k``.

    Returns:
        ``(B, Hk, S)`` int32 eviction times (``NEVER`` if never evicted).
    """
    B, Hk, S = prio.shape
    device = prio.device
    k = long_range
    idx = torch.arange(S, device=device)
    eligible = eligible_tokens(doc_ids, pos, sinks)  # (B, S)
    never = torch.full((B, Hk, S), NEVER, dtype=torch.int64, device=device)
    if k == 0:
        e = torch.where(eligible[:, None, :], idx + window, never)
        return e.clamp(max=NEVER).to(torch.int32)

    order, doc_key = priority_order(prio, doc_ids, pos, sinks=sinks)

    # c0[r] = order position of the first token of r's document (= eligible
    # tokens of earlier documents).
    c0 = run_starts(doc_key.gather(-1, order))

    r = idx.expand(B, Hk, S)
    n_outrank = r - c0  # |O_t| for the token at order position r
    kth = prefix_kth_smallest(
        order.reshape(B * Hk, S), r.reshape(B * Hk, S), (c0 + k).reshape(B * Hk, S), bits=max(1, (S - 1).bit_length())
    ).reshape(B, Hk, S)

    e_sorted = torch.maximum(order + window, kth + window)
    e_sorted = torch.where(n_outrank >= k, e_sorted, NEVER)
    e = torch.empty_like(e_sorted).scatter_(-1, order, e_sorted)
    e = torch.where(prio == float("-inf"), torch.minimum(e, idx + window), e)  # gated out: leaves with the window
    e = torch.where(eligible[:, None, :], e, never)
    return e.clamp(max=NEVER).to(torch.int32)


@torch.no_grad()
def candidate_eviction_times(
    prio: torch.Tensor,
    pos: torch.Tensor,
    *,
    sinks: int,
    window: int,
    long_range: int,
    bits: int | None = None,
) -> torch.Tensor:
    """:func:`eviction_times` of one document's *candidates*, each head with its own token set.

    A bounded cache that takes a prompt in chunks holds, per KV head, a different set of earlier
    tokens (the survivors so far) next to the chunk's new ones. Since the top-k of a growing
    eligible set only ever drops tokens outranked by ``k`` others,
    ``topk(E(q)) = topk(topk(E(c0 - 1)) | {tokens that become eligible in [c0, q]})``: the
    survivors at the chunk start plus the new tokens decide every eviction from then on, and the
    formula of :func:`eviction_times` holds over that set with positions in place of indices::

        e_t = NEVER                                                       if |O_t| < k
        e_t = max(pos_t + window, window + (k-th smallest position in O_t))  otherwise

    with ``O_t`` the eligible candidates (``pos >= sinks``) that outrank ``t`` by (priority,
    position), the newer winning ties. The candidates need not be sorted.

    Args:
        prio: ``(B, Hk, N)`` float priorities; ``-inf`` marks empty slots (with ``pos = -1``) and,
            on a real token, a gate's eviction (it leaves with the window).
        pos: ``(B, Hk, N)`` int positions in the document, ``-1`` on empty slots.
        bits: bits of the largest position (inferred, with one host sync, if omitted).

    Returns:
        ``(B, Hk, N)`` int64 eviction times in position units (``NEVER`` for sinks, empty slots
        and tokens with fewer than ``k`` outrankers).
    """
    B, Hk, N = prio.shape
    k = long_range
    eligible = pos >= sinks
    never = torch.full_like(pos, NEVER, dtype=torch.int64)
    if k == 0:
        return torch.where(eligible, pos + window, never)
    # order: eligible first, then priority desc, then position desc (three stable sorts, last key first)
    order = pos.sort(dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, prio.gather(-1, order).sort(dim=-1, descending=True, stable=True).indices)
    order = order.gather(-1, (~eligible).gather(-1, order).to(torch.uint8).sort(dim=-1, stable=True).indices)
    pos_sorted = pos.gather(-1, order).clamp(min=0)  # (B, Hk, N); ineligible ones come last and are never read
    r = torch.arange(N, device=pos.device).expand(B, Hk, N)  # |O_t| for the token at order position r
    if bits is None:
        bits = max(1, int(pos_sorted.max().item()).bit_length()) if pos.numel() else 1
    kth = prefix_kth_smallest(
        pos_sorted.reshape(B * Hk, N), r.reshape(B * Hk, N), torch.full_like(r, k).reshape(B * Hk, N), bits=bits
    ).reshape(B, Hk, N)
    e_sorted = torch.where(r >= k, torch.maximum(pos_sorted, kth) + window, NEVER)
    e = torch.empty_like(e_sorted).scatter_(-1, order, e_sorted)
    e = torch.where(prio == float("-inf"), torch.minimum(e, pos + window), e)  # gated out: leaves with the window
    return torch.where(eligible, e, never)


@torch.no_grad()
def decaying_eviction_times(
    log_beta: torch.Tensor,
    doc_ids: torch.Tensor,
    pos: torch.Tensor,
    *,
    sinks: int,
    window: int,
    long_range: int,
) -> torch.Tensor:
    """Eviction times of a cache whose ranks fall with age (``trimkv``); see
    :func:`decaying_eviction_times_reference`, the definition.

    On CUDA with Triton the rule runs in one kernel launch (:func:`kvpop.kernels.decay.run_decaying_cache`,
    tested equal to the reference); elsewhere this is the reference. ``(B, Hk, S)`` log beta, ``(B, S)``
    doc_ids and pos -> ``(B, Hk, S)`` int32.
    """
    if log_beta.is_cuda and triton_available():
        from kvpop.kernels.decay import run_decaying_cache

        e = run_decaying_cache(log_beta, doc_ids, pos, sinks=sinks, window=window, long_range=long_range, never=NEVER)
        return _only_eligible(e, doc_ids, pos, sinks)
    return decaying_eviction_times_reference(log_beta, doc_ids, pos, sinks=sinks, window=window, long_range=long_range)


def _leaves_window(doc_ids: torch.Tensor, pos: torch.Tensor, q: int, window: int, sinks: int) -> torch.Tensor:
    """(B,) bool: whether token ``q - window`` leaves the window at query ``q`` into the long-range
    competition (same document as ``q``, ``q`` no padding, no sink). The simulations' rule."""
    j = q - window
    return (doc_ids[:, j] == doc_ids[:, q]) & (doc_ids[:, q] >= 0) & (pos[:, j] >= sinks)


def _only_eligible(e: torch.Tensor, doc_ids: torch.Tensor, pos: torch.Tensor, sinks: int) -> torch.Tensor:
    """Eviction times (B, Hk, S) int64 -> int32, ``NEVER`` for the tokens never eligible (sinks, padding)."""
    eligible = eligible_tokens(doc_ids, pos, sinks)[:, None, :]
    return torch.where(eligible, e, NEVER).clamp(max=NEVER).to(torch.int32)


def decaying_eviction_times_reference(
    log_beta: torch.Tensor,
    doc_ids: torch.Tensor,
    pos: torch.Tensor,
    *,
    sinks: int,
    window: int,
    long_range: int,
) -> torch.Tensor:
    """Eviction times of a cache whose ranks fall with age (``trimkv``): a simulation, query by query.

    Token ``i`` scores ``(t - i) * log_beta_i`` at query ``t`` (``log_beta <= 0``: its retention
    ``beta_i ** (t - i)``, in log). Sinks and the window are kept as always. When token ``t - window``
    leaves the window it takes a free long-range slot; with all ``k`` taken, the lowest-scoring of
    the slots and the leaver is evicted at query ``t`` (among equal scores the older token; the
    leaver is the newest, so it wins ties). Scores cross as tokens age, so no static order (and no
    closed form like :func:`eviction_times`) exists: this runs the rule itself, vectorized over rows
    and heads, sequential over queries (``O(S * k)`` per head). It is what
    :class:`kvpop.decode.BoundedCache` does token by token, and a test proves them equal.

    Args:
        log_beta: ``(B, Hk, S)`` float, ``<= 0``.
        doc_ids, pos: ``(B, S)`` as for :func:`eviction_times` (documents restart the cache).

    Returns:
        ``(B, Hk, S)`` int32 eviction times (``NEVER`` if never evicted).
    """
    B, Hk, S = log_beta.shape
    dev = log_beta.device
    lb = log_beta.double()
    e = torch.full((B, Hk, S), NEVER, dtype=torch.int64, device=dev)
    k = long_range
    slot_pos = torch.full((B, Hk, max(k, 1)), -1, dtype=torch.int64, device=dev)  # the token in each long-range slot, -1: empty
    rows = torch.arange(B, device=dev)[:, None].expand(B, Hk)
    heads = torch.arange(Hk, device=dev)[None, :].expand(B, Hk)
    big = torch.iinfo(torch.int64).max
    for q in range(window, S):
        start = (pos[:, q] == 0)[:, None, None]  # a new document: its cache starts empty
        slot_pos = torch.where(start, -1, slot_pos)
        j = q - window  # the token leaving the window at query q
        leaves = _leaves_window(doc_ids, pos, q, window, sinks)[:, None].expand(B, Hk)
        if k == 0:
            e[:, :, j] = torch.where(leaves, q, e[:, :, j])
            continue
        filled = slot_pos >= 0
        score = torch.where(filled, (q - slot_pos).double() * lb.gather(2, slot_pos.clamp(min=0)), float("-inf"))  # (B, Hk, k)
        low = score.amin(-1)  # (B, Hk)
        victim = torch.where(score == low[..., None], slot_pos, big).argmin(-1)  # (B, Hk): empty first, then the oldest
        wins = leaves & (window * lb[:, :, j] >= low)  # the leaver is the newest: it wins ties
        old = slot_pos[rows, heads, victim]  # (B, Hk), -1 for an empty slot
        e[rows, heads, old.clamp(min=0)] = torch.where(wins & (old >= 0), q, e[rows, heads, old.clamp(min=0)])
        e[:, :, j] = torch.where(leaves & ~wins, q, e[:, :, j])
        slot_pos[rows, heads, victim] = torch.where(wins, j, old)
    return _only_eligible(e, doc_ids, pos, sinks)


@torch.no_grad()
def global_eviction_times(prio: torch.Tensor, doc_ids: torch.Tensor, pos: torch.Tensor, *, sinks: int, window: int, long_range: int,
                          floor: int = 0) -> torch.Tensor:
    """:func:`global_decaying_eviction_times` with ``decays=False`` (static priorities under one pool), in
    closed form: ``(L, B, Hk, S)`` float -> ``(L, B, Hk, S)`` int32, the same times without the simulation's
    sequential loop.

    With static priorities the pool after query ``q`` holds the best ``P = L x Hk x k`` entries of everything
    that has left the window, so the pool is the per-head top-k rule of :func:`eviction_times` run on one
    "head" whose sequence is every (pair, token) entry, ``n = t x F + (F - 1 - f)`` for ``F = L x Hk`` pairs
    ``f = layer x Hk + head``: its order (priority, then the newer index) is the simulation's tie rule
    (newer token, then lower pair). An entry ``x`` joins the competition at ``a_x`` (its token leaves the
    window: ``t + window``) and, once there, is kept while fewer than ``P`` entries that outrank it have
    joined; so ``e_x = max(a_x, P-th smallest a_o over its outrankers o)``, the formula of
    :func:`eviction_times` with join times in place of ``index + window``, one
    :func:`kvpop.order.prefix_kth_smallest` over the entries in priority order.

    ``floor`` (``0 <= floor <= k``): no (layer, head) pair keeps fewer than ``floor`` long-range entries
    (the simulation's rule: the lowest entries of the pairs above their floor go). With static priorities
    that is two competitions in a row: each pair keeps its own top ``floor`` (the per-head rule of
    :func:`eviction_times` with ``k = floor``); an entry it drops joins the model-wide competition for
    the other ``F x (k - floor)`` places then, so ``a_x`` is its per-head eviction time. (Why the two agree:
    the simulation only ever takes entries outside their pair's top ``floor``, the lowest first, and a
    pair's top ``floor`` only changes by a newcomer pushing one out, as in the per-head rule; every pair's
    window lets one token go per query, so every pair has the same number of entries and the rest hold
    ``F x (k - floor)`` once the pool is full.) ``floor = k`` is the per-head rule; ``floor = 0`` one pool.

    A join time past the token's document is its document's end (it never joins; the value keeps earlier
    documents' entries below every later one, as :func:`eviction_times`'s indices do), and an eviction time
    past the row or the token's document is ``NEVER``, as in the simulation. The tests check it against
    the simulation (ties, packed rows, floors included).

    Queries before ``c + window`` read only priorities of tokens before ``c``: whatever the others hold,
    those queries' times are right (what :func:`kvpop.pool.pool_chunked` relies on; a pair's top ``floor``
    at such a query reads the same tokens)."""
    L, B, Hk, S = prio.shape
    Fp = L * Hk
    if not 0 <= floor <= long_range:
        raise ValueError(f"floor must be in [0, long_range = {long_range}]; got {floor}")
    M = Fp * (long_range - floor)  # the places the pairs compete for
    per_pair = prio.permute(1, 0, 2, 3).reshape(B, Fp, S)  # (B, F, S), pair f = layer * Hk + head
    idx = torch.arange(S, device=prio.device)
    _, end = document_spans(doc_ids)  # (B, S)
    if floor:  # leaves its pair's own top `floor`
        join = eviction_times(per_pair, doc_ids, pos, sinks=sinks, window=window, long_range=floor).long()
    else:  # leaves the window
        join = (idx + window).expand(B, Fp, S)
    join = torch.minimum(join, end[:, None, :])  # (B, F, S): past its document, never (the document's end)
    if M == 0:
        e = join
    else:
        N = S * Fp
        flat = per_pair.flip(1).transpose(1, 2).reshape(B, 1, N)  # (B, 1, N): n = t * F + (F - 1 - f)
        join_flat = join.flip(1).transpose(1, 2).reshape(B, N)
        pos_f = (pos[:, :, None] * Fp + torch.arange(Fp, device=prio.device)).reshape(B, N)  # a document's entries, pos 0 first
        order, doc_key = priority_order(flat, doc_ids.repeat_interleave(Fp, 1), pos_f, sinks=sinks * Fp)
        order, doc_key = order[:, 0], doc_key[:, 0]  # (B, N)
        r = torch.arange(N, device=prio.device).expand(B, N)
        c0 = run_starts(doc_key.gather(-1, order))  # entries of earlier documents, all before (and below) this one's
        join_sorted = join_flat.gather(-1, order)  # (B, N) values <= S
        kth = prefix_kth_smallest(join_sorted, r, c0 + M, bits=max(1, S.bit_length()))
        e_sorted = torch.where(r - c0 >= M, torch.maximum(join_sorted, kth), NEVER)
        e = torch.empty_like(e_sorted).scatter_(-1, order, e_sorted).view(B, S, Fp).transpose(1, 2).flip(1)  # (B, F, S)
    q_doc = doc_ids.gather(1, e.clamp(max=S - 1).flatten(1)).view(B, Fp, S)
    e = torch.where((e < S) & (q_doc == doc_ids[:, None, :]), e, NEVER)  # past the row or its document: never, as the simulation says
    e = torch.where(eligible_tokens(doc_ids, pos, sinks)[:, None, :], e, NEVER)
    return e.reshape(B, L, Hk, S).permute(1, 0, 2, 3).contiguous().to(torch.int32)


@dataclass
class PoolRun:
    """One run of :func:`global_decaying_eviction_times`, kept so that a later run whose scores differ
    only from some token on can start there (``previous=``): its scores, its raw eviction times and the
    pool at every ``window``-th query."""

    log_beta: torch.Tensor  # (B, F, S) float64, the run's scores
    e: torch.Tensor  # (B, F, S + 1) int64, raw eviction times (column S: discarded writes)
    pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # query -> (pool_pos, pool_f) before it
    floor: int = 0  # the run's per-pair floor


@torch.no_grad()
def global_decaying_eviction_times(
    log_beta: torch.Tensor,
    doc_ids: torch.Tensor,
    pos: torch.Tensor,
    *,
    sinks: int,
    window: int,
    long_range: int,
    previous: PoolRun | None = None,
    keep_run: bool = False,
    decays: bool = True,
    until: int | None = None,
    floor: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, PoolRun]:
    """Eviction times of one pool of long-range slots for every layer and KV head (``one_pool``: ``dbtrimkv``, ``OnePool``).

    The rule of :func:`decaying_eviction_times_reference`, with the ``k`` slots of each of the ``F = L
    x Hk`` (layer, head) pairs in one pool of ``P = F x k``: at query ``q`` token ``j = q - window``
    leaves the window of every pair at once; the ``F`` leavers and the pool's entries compete by
    their retention at ``q``, ``(q - i) * log_beta[f, i]``, and the ``F`` lowest go (empty entries
    first), so the pool never holds more than ``P``. Ties: among equal retentions the older token
    goes, and among entries of one token the pair of higher index ``f = layer * Hk + head``. With
    ``F = 1`` this is exactly :func:`decaying_eviction_times_reference`. A simulation, vectorized
    over rows, sequential over queries (a selection among ``P + F`` entries per query, :func:`pool_leavers`).

    Queries before ``j0 + window`` read only scores of tokens before ``j0``; so with ``previous`` (a
    :class:`PoolRun` of the same rows, from ``keep_run=True``) whose scores equal these before token
    ``j0``, the run starts from the previous pool at the last kept query at or before ``j0 + window``
    (the fixed point of :mod:`kvpop.decode.one_pool` re-simulates only what changed).

    ``until``: simulate only the queries before it (default: all ``S``). The times are then right for every
    decision at a query ``< until`` and ``NEVER`` for the rest; with ``keep_run`` the run also keeps the
    pool before query ``until``, so a later run with ``previous=`` (whose scores changed from token
    ``until - window`` on) continues there. :func:`kvpop.pool.pool_chunked` runs it so, a chunk at a time.

    ``decays=False``: ``log_beta`` holds static priorities (any real; higher is kept), compared as they
    are instead of as retentions; with ``F = 1`` this is :func:`eviction_times`'s rule (a pool of one
    head's ``k`` slots; among equal priorities the older token goes).

    Args:
        log_beta: ``(L, B, Hk, S)`` float, ``<= 0``.
        doc_ids, pos: ``(B, S)`` as for :func:`eviction_times` (a new document empties the row's pool).

    Returns:
        ``(L, B, Hk, S)`` int32 eviction times (``NEVER`` if never evicted); with ``keep_run``, also the
        :class:`PoolRun`.
    """
    L, B, Hk, S = log_beta.shape
    F = L * Hk
    P = F * long_range
    if not 0 <= floor <= long_range:
        raise ValueError(f"floor must be in [0, long_range = {long_range}]; got {floor}")
    dev = log_beta.device
    lb = log_beta.double().permute(1, 0, 2, 3).reshape(B, F, S)  # (B, F, S), pair f = layer * Hk + head
    flat = torch.arange(F, device=dev).expand(B, F)
    rows = torch.arange(B, device=dev)[:, None]
    spare = torch.full((B, 1), -1, dtype=torch.int64, device=dev)  # entry P: where leavers that do not stay are written
    run = PoolRun(lb, torch.full((B, F, S + 1), NEVER, dtype=torch.int64, device=dev), floor=floor)  # e's column S: where empty entries write
    start = window
    pool_pos = torch.full((B, P), -1, dtype=torch.int64, device=dev)  # token of each entry, -1: empty
    pool_f = torch.zeros((B, P), dtype=torch.int64, device=dev)  # its (layer, head) pair
    if previous is not None:
        if previous.log_beta.shape != lb.shape:
            raise ValueError(f"previous run has scores of shape {tuple(previous.log_beta.shape)}, these are {tuple(lb.shape)}")
        if previous.floor != floor:
            raise ValueError(f"previous run has floor {previous.floor}, this one {floor}")
        changed = (previous.log_beta != lb).flatten(0, 1).any(0).nonzero()  # tokens whose score changed in some row or pair
        j0 = int(changed[0]) if len(changed) else S
        start = max([q for q in previous.pools if q <= j0 + window], default=window)
        if start > window:
            pool_pos, pool_f = (t.clone() for t in previous.pools[start])
            run.e = torch.where(previous.e < start, previous.e, NEVER)  # evictions before start stand
        run.pools = {q: p for q, p in previous.pools.items() if q <= start}
    e = run.e
    stop = S if until is None else min(S, until)
    for q in range(start, stop):
        if keep_run and (q - window) % window == 0:
            run.pools[q] = (pool_pos.clone(), pool_f.clone())
        pool_pos = torch.where((pos[:, q] == 0)[:, None], -1, pool_pos)  # a new document: its pool starts empty
        j = q - window  # the token leaving the window at query q
        leaves = _leaves_window(doc_ids, pos, q, window, sinks)  # (B,)
        cand_pos = torch.cat([pool_pos, torch.where(leaves[:, None], j, -1).expand(B, F)], 1)  # (B, P + F)
        cand_f = torch.cat([pool_f, flat], 1)
        out = pool_leavers(cand_pos, cand_f, lb[rows, cand_f, cand_pos.clamp(min=0)], q, F, F, decays=decays, floor=floor)  # (B, P + F)
        e[rows, cand_f, torch.where(out & (cand_pos >= 0), cand_pos, S)] = q  # the rest write to column S
        # the k-th pool entry to go makes room for the k-th leaver to stay (as many of each: F go in all)
        gone, stays = out[:, :P], ~out[:, P:]  # (B, P), (B, F)
        by_rank = torch.full((B, F + 1), P, dtype=torch.int64, device=dev)  # rank -> emptied entry; column F, index P: discarded
        by_rank.scatter_(1, torch.where(gone, gone.cumsum(1) - 1, F), torch.arange(P, device=dev).expand(B, P))
        by_rank[:, F] = P  # the entries that stay wrote there
        dst = by_rank.gather(1, torch.where(stays, stays.cumsum(1) - 1, F))  # (B, F) the entry each leaver takes, P: none
        pool_pos = torch.cat([pool_pos, spare], 1).scatter_(1, dst, cand_pos[:, P:])[:, :P]
        pool_f = torch.cat([pool_f, spare], 1).scatter_(1, dst, flat)[:, :P]
    if keep_run and stop < S:
        run.pools[max(stop, start)] = (pool_pos.clone(), pool_f.clone())
    times = _only_eligible(e[:, :, :S], doc_ids, pos, sinks).reshape(B, L, Hk, S).permute(1, 0, 2, 3).contiguous()  # (L, B, Hk, S)
    return (times, run) if keep_run else times


def pool_leavers(pos: torch.Tensor, pair: torch.Tensor, log_beta: torch.Tensor, q: int, pairs: int, n: int, *,
                 decays: bool = True, floor: int = 0) -> torch.Tensor:
    """Which ``n`` candidates of one pool go at query ``q``: their token positions ``pos`` (B, N)
    (``-1``: an empty entry, which goes first), pairs ``pair`` (B, N) (``layer * Hk + head`` of
    ``pairs``) and ``log_beta`` (B, N) float64 -> (B, N) bool, ``n`` True per row. The lowest retention
    ``(q - pos) * log_beta`` goes; among equal retentions the older token, then the higher pair. The
    rule of :func:`global_decaying_eviction_times` and of :class:`kvpop.decode.one_pool.OnePoolCache`.

    ``floor``: no pair is left with fewer than ``floor`` candidates; the ``n`` lowest of the candidates
    that may go then go (a pair of ``c`` candidates offers its ``c - floor`` lowest: taking the lowest
    one at a time, with the floor, takes exactly these). There are ``n`` of them while ``pairs x floor``
    is at most the candidates that stay.

    A selection, not a sort: the ``n``-th lowest retention ``v``; every candidate below it goes, and
    of those at ``v`` the ones first by the tie order make up the ``n``."""
    valid = pos >= 0
    score = torch.where(valid, (q - pos).double() * log_beta if decays else log_beta.double(), float("-inf"))  # decays=False: static
    tie = torch.where(valid, pos * pairs + (pairs - 1 - pair), -1)  # lower goes first: older, then the higher pair
    if floor:
        score = torch.where(_above_floor(score, tie, torch.where(valid, pair, pairs), pairs, floor), score, float("inf"))
    v = score.kthvalue(n, dim=1, keepdim=True).values  # (B, 1)
    out = score < v
    at_v = torch.where(score == v, tie, torch.iinfo(torch.int64).max).topk(n, dim=1, largest=False, sorted=True).indices  # (B, n)
    take = torch.arange(n, device=pos.device)[None] < n - out.sum(1, keepdim=True)  # the first n - |below| of them
    return out.scatter_(1, at_v, take | out.gather(1, at_v))


def _above_floor(score: torch.Tensor, tie: torch.Tensor, group: torch.Tensor, pairs: int, floor: int) -> torch.Tensor:
    """(B, N) bool: the candidates that may go under a per-pair ``floor`` (:func:`pool_leavers`): each pair's
    ``count - floor`` lowest by (score, tie); ``group`` (B, N) the pair, ``pairs`` for empty entries (all may go)."""
    B, N = score.shape
    order = tie.argsort(dim=1, stable=True)  # three stable sorts, the last key first: pair, then score, then tie
    order = order.gather(1, score.gather(1, order).argsort(dim=1, stable=True))
    order = order.gather(1, group.gather(1, order).argsort(dim=1, stable=True))
    g = group.gather(1, order)  # (B, N) pairs in runs, each run lowest first
    rank = torch.arange(N, device=score.device) - run_starts(g)  # (B, N) place in its pair's run, from the lowest
    count = torch.zeros(B, pairs + 1, dtype=torch.int64, device=score.device).scatter_add_(1, group, torch.ones_like(group))
    cap = (count - floor).clamp(min=0)
    cap[:, pairs] = N  # empty entries
    return torch.empty_like(g, dtype=torch.bool).scatter_(1, order, rank < cap.gather(1, g))
