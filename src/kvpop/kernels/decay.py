"""The decaying cache's eviction times in one Triton kernel (``trimkv``'s pattern on the GPU).

:func:`kvpop.selection.decaying_eviction_times_reference` runs the rule query by query as tensor
operations: about fifteen kernel launches per query, so some 60,000 per layer of a 4,096-token
trace, and the evaluation of a decaying policy spends its time launching kernels. Here one program
per (row, KV head) runs the whole query loop with its ``k`` long-range slots in registers (their
token index and log beta): per query a few scalar loads, two block reductions and at most two
scalar stores. The float64 products ``(q - i) * log_beta_i`` are the twin's, so ties resolve
identically and the results are equal (a GPU test).

Shapes: B batch, Hk KV heads, S sequence, k long-range slots, K the next power of two >= k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decaying_times_kernel(lb_ptr, doc_ptr, pos_ptr, e_ptr, S, Hk, sinks, window, k, K: tl.constexpr):
    pid = tl.program_id(0)  # b * Hk + h
    b = pid // Hk
    lb_row = lb_ptr + pid.to(tl.int64) * S  # (S,) float64
    e_row = e_ptr + pid.to(tl.int64) * S  # (S,) int64
    doc_row = doc_ptr + b.to(tl.int64) * S
    pos_row = pos_ptr + b.to(tl.int64) * S
    lane = tl.arange(0, K)
    real = lane < k  # lanes past k are padding and never chosen
    slot_tok = tl.full([K], -1, tl.int64)  # the token in each slot, -1: empty
    slot_lb = tl.zeros([K], tl.float64)  # its log beta
    for q in range(window, S):
        slot_tok = tl.where(tl.load(pos_row + q) == 0, -1, slot_tok)  # a new document: its cache starts empty
        j = q - window  # the token leaving the window at query q
        doc_q = tl.load(doc_row + q)
        leaves = (tl.load(doc_row + j) == doc_q) & (doc_q >= 0) & (tl.load(pos_row + j) >= sinks)
        lb_j = tl.load(lb_row + j)
        score = tl.where(slot_tok >= 0, (q - slot_tok).to(tl.float64) * slot_lb, float("-inf"))
        score = tl.where(real, score, float("inf"))
        low = tl.min(score, axis=0)
        lowest = real & (score == low)
        oldest = tl.min(tl.where(lowest, slot_tok, 9223372036854775807), axis=0)  # empty (-1) first, then the oldest
        victim = tl.min(tl.where(lowest & (slot_tok == oldest), lane, K), axis=0)  # its lane
        wins = leaves & (window * lb_j >= low)  # the leaver is the newest: it wins ties
        tl.store(e_row + oldest, q, mask=wins & (oldest >= 0))
        tl.store(e_row + j, q, mask=leaves & ~wins)
        take = (lane == victim) & wins
        slot_tok = tl.where(take, j, slot_tok)
        slot_lb = tl.where(take, lb_j, slot_lb)


def run_decaying_cache(log_beta: torch.Tensor, doc_ids: torch.Tensor, pos: torch.Tensor, *, sinks: int, window: int,
                       long_range: int, never: int) -> torch.Tensor:
    """The rule of :func:`kvpop.selection.decaying_eviction_times_reference` on CUDA tensors, in one
    kernel launch: the query at which each token is evicted, ``never`` where it is not (sinks and
    padding included; :func:`kvpop.selection.decaying_eviction_times` masks them, as the reference does).

    Args:
        log_beta: ``(B, Hk, S)`` float, ``<= 0``, on a CUDA device.
        doc_ids, pos: ``(B, S)``.

    Returns:
        ``(B, Hk, S)`` int64.
    """
    B, Hk, S = log_beta.shape
    lb = log_beta.double().contiguous()
    e = torch.full((B, Hk, S), never, dtype=torch.int64, device=lb.device)
    if S > window:
        K = triton.next_power_of_2(max(long_range, 1))
        _decaying_times_kernel[(B * Hk,)](lb, doc_ids.long().contiguous(), pos.long().contiguous(), e, S, Hk, sinks, window,
                                          long_range, K=K, num_warps=4 if K <= 1024 else 8)
    return e
