"""The scorer's training signal: a logistic loss at the eviction boundary.

At query q exactly one token, t_new = q - window, leaves the protected window and joins the
eligible set E(q) = {t : pos_t >= sinks, t <= q - window} of its document. The *teacher* policy
ranks E(q) by the target r_tgt plus the age decay; it keeps t_new iff t_new outranks t_bnd, the
k-th best token of E(q) without t_new (the one t_new competes with for the last slot). The label
is y = +1 (keep) or -1 (drop), and the student's margin Delta = r_eff(t_new) - r_eff(t_bnd) is
pushed to the label's side by ``softplus(-y * Delta / tau)``. Queries whose E(q) holds at most k
tokens decide nothing and are skipped.

t_bnd for every q at once is a prefix order statistic: in token order, the prefix before t_new
holds exactly E(q) without t_new (plus earlier documents, which all rank better because ranks
sort by document first), so t_bnd has the (c0 + k)-th smallest teacher rank in that prefix, c0
being the number of eligible tokens of earlier documents (:func:`kvpop.order.prefix_kth_smallest`).

Shapes: B batch, Hk KV heads, S sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch
from torch import Tensor
from torch.nn import functional as F

from kvpop.geometry import CacheLayout
from kvpop.order import prefix_kth_smallest
from kvpop.scorer import static_priority
from kvpop.selection import document_spans, eligible_tokens, eviction_times, priority_order

BoundaryWeight = Literal["tie", "regret", "uniform"]  # the weights omega of boundary_loss (see there)
BOUNDARY_WEIGHTS: tuple[str, ...] = get_args(BoundaryWeight)


@dataclass
class BoundaryLabels:
    """Teacher decisions at every decided query, flattened over (B, Hk, candidates)."""

    row: Tensor  # (M,) flat (b * Hk + h) index
    t_new: Tensor  # (M,) token leaving the window
    t_bnd: Tensor  # (M,) its competitor, the k-th best of E(q) without t_new
    y: Tensor  # (M,) +1 keep, -1 drop


def teacher_ranks(prio: Tensor, doc_ids: Tensor, pos: Tensor, sinks: int) -> Tensor:
    """Rank of every token in :func:`kvpop.selection.priority_order`; (B, Hk, S) int64."""
    B, Hk, S = prio.shape
    order, _ = priority_order(prio, doc_ids, pos, sinks=sinks)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(S, device=prio.device).expand(B, Hk, S))
    return ranks


@torch.no_grad()
def boundary_labels(
    r_tgt: Tensor,  # (B, Hk, S) teacher scores (detached)
    log_gamma: Tensor,  # (Hk,)
    doc_ids: Tensor,  # (B, S)
    pos: Tensor,  # (B, S)
    *,
    layout: CacheLayout,
    share: float = 0.0,
) -> BoundaryLabels:
    """The teacher's keep/drop decision for t_new at every decided query, and its competitor."""
    prio = static_priority(r_tgt, pos, log_gamma.detach(), share)
    return priority_labels(prio, doc_ids, pos, sinks=layout.sinks, window=layout.window, k=layout.long_range)


@torch.no_grad()
def priority_labels(prio: Tensor, doc_ids: Tensor, pos: Tensor, *, sinks: int, window: int, k: int) -> BoundaryLabels:
    """:func:`boundary_labels` of the teacher's static priorities ``prio`` (B, Hk, S): each head's top-``k`` rule."""
    B, Hk, S = prio.shape
    dev = prio.device
    ok = eligible_tokens(doc_ids, pos, sinks)  # (B, S)
    ranks = teacher_ranks(prio, doc_ids, pos, sinks)  # (B, Hk, S)
    t = torch.arange(S, device=dev)
    q = t + window
    q_c = q.clamp(max=S - 1)
    same_doc = (q < S)[None] & (doc_ids.gather(1, q_c.expand(B, S)) == doc_ids)
    before = F.pad(ok.long().cumsum(-1), (1, 0))[:, :-1]  # eligible tokens in [0, t)
    in_doc_before = (pos - sinks).clamp(min=0)  # eligible tokens of t's document before t
    decided = ok & same_doc & (in_doc_before >= k) & (k > 0)  # |E(q)| - 1 >= k
    c0 = before - in_doc_before
    kth = (c0 + k)[:, None].expand(B, Hk, S).reshape(B * Hk, S)
    prefix = t.expand(B * Hk, S)
    bnd_rank = prefix_kth_smallest(ranks.reshape(B * Hk, S), prefix, kth, bits=max(1, S.bit_length()))
    inv = torch.empty_like(ranks).reshape(B * Hk, S)
    inv.scatter_(-1, ranks.reshape(B * Hk, S), t.expand(B * Hk, S))  # rank -> token
    dec = decided[:, None].expand(B, Hk, S).reshape(B * Hk, S) & (bnd_rank >= 0)
    row, t_new = dec.nonzero(as_tuple=True)
    br = bnd_rank[row, t_new]
    t_bnd = inv[row, br]
    y = torch.where(ranks.reshape(B * Hk, S)[row, t_new] < br, 1.0, -1.0)
    return BoundaryLabels(row=row, t_new=t_new, t_bnd=t_bnd, y=y)


def boundary_loss(
    r_hat: Tensor,  # (B, Hk, S) student raw scores (carries the scorer's graph)
    r_tgt: Tensor,  # (B, Hk, S) targets (detached)
    log_gamma: Tensor,  # (Hk,) carries the decay's graph
    doc_ids: Tensor,
    pos: Tensor,
    *,
    layout: CacheLayout,
    tau: float = 1.0,
    tie_margin: float = 0.5,
    query_samples: int = 0,
    generator: torch.Generator | None = None,
    weighting: BoundaryWeight = "tie",
    share: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted logistic loss at the eviction boundary; returns (loss, detached stats).

    ``weighting="tie"`` (the paper's): omega = (near-tie discount) x (per-head class balance): a
    decision whose teacher margin |Delta_tgt| is small says little and gets weight
    1 - exp(-|Delta_tgt| / tie_margin); keep and drop labels each carry half the weight of their head.

    ``weighting="regret"``: omega = what a wrong decision costs in the target's own units, not in
    log space: |exp(r_tgt(t_new)) - exp(r_tgt(t_bnd))| (decay included), divided by its mean over the
    head's decisions. The logistic loss on labels alone ranks a token by how *often* it beats its
    competitor, so a token that a later step needs badly but rarely (a definition that may be
    recalled) loses to one that is always mildly useful; weighting by regret ranks by the expected
    attention mass the decision keeps. No class balance (the regret already prices both errors).

    ``weighting="uniform"``: omega = 1, every decision counts the same (no tie discount, no class
    balance). Under the target of scope model (``max.model``) it fitted the long-range sources best on
    the CPU scorer fit (BENCHMARKS.md, scorer fit).

    ``share > 0``: teacher and student rank on the attention share's scale with that age decay
    (:func:`kvpop.scorer.static_priority`; the learned decay unused), and the margins are differences
    of those priorities: the decisions then depend on ``r_hat``'s level, which the loss calibrates.
    """
    B, Hk, S = r_hat.shape
    lab = boundary_labels(r_tgt, log_gamma, doc_ids, pos, layout=layout, share=share)
    if query_samples > 0 and lab.row.numel() > query_samples * B * Hk:
        keep = torch.randperm(lab.row.numel(), generator=generator, device="cpu")[: query_samples * B * Hk]
        keep = keep.to(lab.row.device)
        lab = BoundaryLabels(lab.row[keep], lab.t_new[keep], lab.t_bnd[keep], lab.y[keep])
    if lab.row.numel() == 0:
        zero = r_hat.sum() * 0.0 + log_gamma.sum() * 0.0
        return zero, {"decisions": torch.tensor(0.0), "keep_rate": torch.tensor(0.0), "agreement": torch.tensor(0.0)}
    h = lab.row % Hk
    gap = (lab.t_bnd - lab.t_new).to(torch.float64)  # < 0: t_bnd is older
    flat_hat = r_hat.reshape(B * Hk, S)
    flat_tgt = r_tgt.reshape(B * Hk, S)
    if share > 0:  # differences of the share-space priorities (log_gamma unused)
        flat_hat = static_priority(r_hat, pos, log_gamma, share).reshape(B * Hk, S)
        flat_tgt = static_priority(r_tgt, pos, log_gamma, share).reshape(B * Hk, S)
        gap = torch.zeros_like(gap)
    delta = (flat_hat[lab.row, lab.t_new] - flat_hat[lab.row, lab.t_bnd]).double() + gap * log_gamma[h]
    with torch.no_grad():
        delta_tgt = (flat_tgt[lab.row, lab.t_new] - flat_tgt[lab.row, lab.t_bnd]).double() + gap * log_gamma[h].detach()
        omega = decision_weights(weighting, delta_tgt, lab.y, h, Hk, tie_margin=tie_margin, r_new=flat_tgt[lab.row, lab.t_new])
        pos_lab = (lab.y > 0).double()
    loss = (omega * F.softplus(-lab.y.double() * delta / tau)).mean().float()
    stats = {
        "decisions": torch.tensor(float(lab.row.numel())),
        "keep_rate": pos_lab.mean().float(),
        "agreement": ((delta.detach() > 0) == (lab.y > 0)).float().mean(),
    }
    return loss, stats


@dataclass
class PoolLabels:
    """The teacher's decisions under one pool, flattened over (B, leavers): each leaver's (layer, head)
    pair and its competitor's, both as (row, pair, token)."""

    row: Tensor  # (M,) batch row
    pair: Tensor  # (M,) the leaver's pair f = layer * Hk + head
    t_new: Tensor  # (M,) its token, leaving the window (under a floor also: dropped by its pair's own best, joining the shared places)
    bnd_pair: Tensor  # (M,) its competitor's pair
    t_bnd: Tensor  # (M,) its competitor's token
    y: Tensor  # (M,) +1 keep, -1 drop


@torch.no_grad()
def pool_boundary_labels(prio_tgt: Tensor, doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout) -> PoolLabels:
    """The teacher's keep/drop decision for every leaver under one pool of ``P = F x k`` long-range entries
    (:mod:`kvpop.decode.one_pool`), and its competitor: ``prio_tgt`` (B, F, S) the teacher's static priorities
    of every (layer, head) pair ``f = layer * Hk + head``.

    With static priorities the pool after query ``q = j + window`` holds the best ``P`` entries of
    E(q) = every eligible (pair, token) of the document up to ``j``: the ``F`` leavers of token ``j`` enter
    together. A leaver is kept iff it is among them; its competitor is the ``P``-th best of E(q) without it:
    the first dropped entry if it is kept, the last kept one if not. The order is the simulation's
    (:func:`kvpop.selection.pool_leavers`): priority, then the newer token, then the lower pair index; in
    the flat sequence ``n = t * F + (F - 1 - f)`` that is :func:`kvpop.selection.priority_order`'s rule
    (newer index wins), and E(q) is a prefix of it, so the two order statistics per token come from one
    :func:`kvpop.order.prefix_kth_smallest` over the teacher's ranks, as in :func:`boundary_labels`."""
    sinks, window, k = layout.sinks, layout.window, layout.long_range
    if layout.floor:
        return _floored_pool_labels(prio_tgt, doc_ids, pos, layout=layout)
    B, Fp, S = prio_tgt.shape
    P, N, dev = Fp * k, Fp * S, prio_tgt.device
    flat = prio_tgt.flip(1).transpose(1, 2).reshape(B, 1, N)  # (B, 1, N): n = t * F + (F - 1 - f)
    ranks = teacher_ranks(flat, doc_ids.repeat_interleave(Fp, 1), pos.repeat_interleave(Fp, 1), sinks)[:, 0]  # (B, N)
    t = torch.arange(S, device=dev)
    q = t + window
    same_doc = (q < S)[None] & (doc_ids.gather(1, q.clamp(max=S - 1).expand(B, S)) == doc_ids)
    ok = eligible_tokens(doc_ids, pos, sinks)  # (B, S)
    before = F.pad(ok.long().cumsum(-1), (1, 0))[:, :-1]  # eligible tokens in [0, t)
    in_doc = (pos - sinks).clamp(min=0)  # eligible tokens of t's document before t
    decided = ok & same_doc & ((in_doc + 1) * Fp > P) & (k > 0)  # (B, S): E(q) holds more than P entries
    c0 = (before - in_doc) * Fp  # eligible entries of earlier documents: they rank first
    prefix = ((t + 1) * Fp).expand(B, S)
    kth = torch.stack([c0 + P, c0 + P + 1], 1).reshape(B * 2, S)  # the last kept, the first dropped (1-based)
    vals = prefix_kth_smallest(ranks.repeat_interleave(2, 0), prefix.repeat_interleave(2, 0), kth, bits=max(1, N.bit_length()))
    last_kept, first_drop = vals.view(B, 2, S).unbind(1)  # (B, S) rank values, -1 where undecided
    inv = torch.empty_like(ranks).scatter_(1, ranks, torch.arange(N, device=dev).expand(B, N))  # rank -> n
    row, j = (decided & (first_drop >= 0)).nonzero(as_tuple=True)  # (m,) decided tokens
    f = torch.arange(Fp, device=dev)
    row, j, pair = row[:, None].expand(-1, Fp).reshape(-1), j[:, None].expand(-1, Fp).reshape(-1), f.repeat(j.numel())
    r_x = ranks[row, j * Fp + (Fp - 1 - pair)]
    kept = r_x <= last_kept[row, j]
    n_bnd = inv[row, torch.where(kept, first_drop[row, j], last_kept[row, j])]
    return PoolLabels(row=row, pair=pair, t_new=j, bnd_pair=Fp - 1 - n_bnd % Fp, t_bnd=n_bnd // Fp, y=torch.where(kept, 1.0, -1.0))


@torch.no_grad()
def _floored_pool_labels(prio_tgt: Tensor, doc_ids: Tensor, pos: Tensor, *, layout: CacheLayout) -> PoolLabels:
    """:func:`pool_boundary_labels` under a per-head floor ``f`` (``layout.floor``): the two competitions in a row of
    :func:`kvpop.selection.global_eviction_times`, each decision against its competitor.

    1. *Each pair's own top f.* When token ``j`` leaves the window, its entry in pair ``p`` is kept there iff it is
       among the pair's best ``f`` (:func:`priority_labels` with ``k = f``; the competitor in the same pair).
    2. *The shared places.* An entry its pair's top ``f`` drops (its per-head eviction time ``a``: at once, or when a
       better one arrives) joins the ``M = F x (k - f)`` shared places: it is kept iff among the best ``M`` of every
       entry that has joined by ``a``; its competitor is the ``M``-th best of them without it, in any pair. In join
       order (ties by the entry index ``n``) the entries joined by ``a`` are a prefix, and those of earlier
       documents come first (a join time past its document is the document's end), so both order statistics come
       from one :func:`kvpop.order.prefix_kth_smallest` over the teacher's ranks, as in the pool without a floor.

    ``f = k`` leaves step 1 alone (the per-head labels of every pair)."""
    sinks, window, k, f = layout.sinks, layout.window, layout.long_range, layout.floor
    B, Fp, S = prio_tgt.shape
    M, N, dev = Fp * (k - f), Fp * S, prio_tgt.device
    own = priority_labels(prio_tgt, doc_ids, pos, sinks=sinks, window=window, k=f)  # rows b * F + pair
    pair = own.row % Fp
    labels = [PoolLabels(row=own.row // Fp, pair=pair, t_new=own.t_new, bnd_pair=pair, t_bnd=own.t_bnd, y=own.y)]
    if M > 0:
        start, end = document_spans(doc_ids)  # (B, S)
        join = torch.minimum(eviction_times(prio_tgt, doc_ids, pos, sinks=sinks, window=window, long_range=f).long(), end[:, None])  # (B, F, S)
        ok = eligible_tokens(doc_ids, pos, sinks)[:, None, :].expand(B, Fp, S)
        joins = ok & (join < end[:, None])  # dropped by its pair inside its document

        def flat(x: Tensor) -> Tensor:  # (B, F, S) -> (B, N), entry n = t * F + (F - 1 - pair)
            return x.flip(1).transpose(1, 2).reshape(B, N)

        ranks = teacher_ranks(flat(prio_tgt)[:, None], doc_ids.repeat_interleave(Fp, 1), pos.repeat_interleave(Fp, 1), sinks)[:, 0]  # (B, N)
        key = flat(torch.where(ok, join, S + 1))  # join times; never eligible: after every prefix
        order = key.argsort(dim=1, stable=True)  # (B, N) join order, ties by n
        key_seq = key.gather(1, order)
        prefix = torch.searchsorted(key_seq, key, right=True)  # (B, N) entries joined by the entry's join time
        c0 = torch.searchsorted(key_seq, flat(start[:, None].expand(B, Fp, S)).contiguous(), right=True)  # those of earlier documents
        decided = flat(joins) & (prefix - c0 > M)
        kth = torch.stack([c0 + M, c0 + M + 1], 1).reshape(B * 2, N)  # the last kept, the first dropped (1-based)
        vals = prefix_kth_smallest(ranks.gather(1, order).repeat_interleave(2, 0), prefix.repeat_interleave(2, 0), kth,
                                   bits=max(1, N.bit_length()))
        last_kept, first_drop = vals.view(B, 2, N).unbind(1)
        inv = torch.empty_like(ranks).scatter_(1, ranks, torch.arange(N, device=dev).expand(B, N))  # rank -> n
        row, n = (decided & (first_drop >= 0)).nonzero(as_tuple=True)
        kept = ranks[row, n] <= last_kept[row, n]
        n_bnd = inv[row, torch.where(kept, first_drop[row, n], last_kept[row, n])]
        labels.append(PoolLabels(row=row, pair=Fp - 1 - n % Fp, t_new=n // Fp, bnd_pair=Fp - 1 - n_bnd % Fp, t_bnd=n_bnd // Fp,
                                 y=torch.where(kept, 1.0, -1.0)))
    return PoolLabels(**{fl.name: torch.cat([getattr(lab, fl.name) for lab in labels]) for fl in fields(PoolLabels)})


def pool_boundary_loss(
    prio_hat: Tensor,  # (B, F, S) the student's static priorities, with the scorer's graph
    prio_tgt: Tensor,  # (B, F, S) the teacher's (detached)
    doc_ids: Tensor,
    pos: Tensor,
    *,
    layout: CacheLayout,
    tau: float = 1.0,
    tie_margin: float = 0.5,
    weighting: BoundaryWeight = "tie",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The logistic loss at the boundary of one pool for the whole model (:func:`pool_boundary_labels`):
    each leaver's margin over its competitor, which may sit in another layer or head, pushed to the
    teacher's side; the scorer so learns priorities that compare across heads, the decision it makes
    when it runs. Weights as :func:`boundary_loss`'s, grouped by (layer, head) pair. Returns (loss,
    detached stats)."""
    B, Fp, S = prio_hat.shape
    lab = pool_boundary_labels(prio_tgt.detach(), doc_ids, pos, layout=layout)
    if lab.row.numel() == 0:
        return prio_hat.sum() * 0.0, {"decisions": torch.tensor(0.0), "keep_rate": torch.tensor(0.0), "agreement": torch.tensor(0.0)}
    delta = (prio_hat[lab.row, lab.pair, lab.t_new] - prio_hat[lab.row, lab.bnd_pair, lab.t_bnd]).double()
    with torch.no_grad():
        delta_tgt = (prio_tgt[lab.row, lab.pair, lab.t_new] - prio_tgt[lab.row, lab.bnd_pair, lab.t_bnd]).double()
        omega = decision_weights(weighting, delta_tgt, lab.y, lab.pair, Fp, tie_margin=tie_margin, r_new=prio_tgt[lab.row, lab.pair, lab.t_new])
    loss = (omega * F.softplus(-lab.y.double() * delta / tau)).mean().float()
    stats = {
        "decisions": torch.tensor(float(lab.row.numel())),
        "keep_rate": (lab.y > 0).double().mean().float(),
        "agreement": ((delta.detach() > 0) == (lab.y > 0)).float().mean(),
    }
    return loss, stats


@torch.no_grad()
def decision_weights(weighting: BoundaryWeight, delta_tgt: Tensor, y: Tensor, group: Tensor, groups: int, *, tie_margin: float,
                     r_new: Tensor) -> Tensor:
    """The weights omega (M,) float64 of M boundary decisions (:func:`boundary_loss` describes each kind):
    ``delta_tgt`` (M,) the teacher's margins, ``y`` (M,) the labels, ``group`` (M,) in ``[0, groups)`` the
    group of each decision for the class balance and the regret's mean (a KV head; the pool's (layer,
    head) pair), ``r_new`` (M,) the leaver's target (regret)."""
    pos_lab = (y > 0).double()
    n_all = torch.zeros(groups, dtype=torch.float64, device=group.device).index_add_(0, group, torch.ones_like(pos_lab))
    if weighting == "regret":
        # both scores at the leaver's age: exp(r_new) - exp(r_new - delta_tgt)
        regret = (r_new.double().exp() * -torch.expm1(-delta_tgt)).abs()  # (M,)
        mean = torch.zeros(groups, dtype=torch.float64, device=group.device).index_add_(0, group, regret) / n_all.clamp(min=1)
        return regret / mean[group].clamp(min=1e-30)
    if weighting == "uniform":
        return torch.ones_like(delta_tgt)
    if weighting == "tie":
        w_tie = 1.0 - torch.exp(-delta_tgt.abs() / tie_margin) if tie_margin > 0 else torch.ones_like(delta_tgt)
        n_pos = torch.zeros(groups, dtype=torch.float64, device=group.device).index_add_(0, group, pos_lab)
        n_cls = torch.where(y > 0, n_pos[group], n_all[group] - n_pos[group])
        return w_tie * 0.5 * n_all[group] / n_cls
    raise ValueError(f"unknown weighting {weighting!r}: 'tie', 'regret' or 'uniform'")


def calibration_loss(
    r_hat: Tensor,  # (B, Hk, S) student raw scores (carries the scorer's graph)
    r_tgt: Tensor,  # (B, Hk, S) targets (detached), -inf where a token has none
    doc_ids: Tensor,
    pos: Tensor,
    *,
    sinks: int,
) -> Tensor:
    """Mean squared error of ``r_hat`` against the target, over the eligible tokens that have one.

    The boundary loss sees only differences of scores, so on the log scale ``r_hat``'s level is free;
    a ranking on the share's scale (``share > 0``, :func:`kvpop.scorer.static_priority`) reads its level,
    and this term ties the level (and the slope) to the target's."""
    ok = eligible_tokens(doc_ids, pos, sinks)[:, None, :] & torch.isfinite(r_tgt)  # (B, Hk, S)
    if not bool(ok.any()):
        return r_hat.sum() * 0.0
    return (r_hat.float()[ok] - r_tgt.float()[ok]).square().mean()
