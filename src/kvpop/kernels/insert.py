"""The bounded cache's arrival of one decoded token in one Triton kernel per layer.

:meth:`kvpop.decode.engine.DecodeEngine._insert` (the tensor twin) does, for every (row, KV head):
score the token leaving the window (the occupant of the new token's ring slot), find the long-range
slot of lowest (priority, position), move the leaver there if it ranks at least as high, and write
the new token into the ring slot. As tensor code that is a dozen small kernels per layer (gathers,
the scorer's two GEMMs, two reductions, four scatters); here it is one program per (row, KV head)
with the long-range slots' priorities and positions in registers.

The leaver's priority is a static rule's (:class:`kvpop.policies.FusedScorer`): its position (``streaming_llm``),
or ``kvpop_mlp``'s MLP on its key and value plus the learned decay, ``r_hat - pos * log(gamma)``
in float64 (:func:`kvpop.scorer.static_priority` on the log scale). The MLP runs in float32 as the
twin's does, summed in another order, so priorities agree to float32 rounding; ties between the
leaver and the lowest slot, and between slots, resolve as in the twin (a GPU test and, under
Triton's interpreter, a CPU test compare the buffers after every step).

Shapes: B batch, Hk KV heads, T slots, D head dim, F scorer hidden width, K the next power of two
>= the long-range slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

I64_MAX = tl.constexpr(9223372036854775807)  # a global a compiled kernel may read
LAUNCH: dict[str, int] = {}  # overrides of launch_config's "block_d" / "num_warps" (bench/kernels/bench_insert.py's grid)


@triton.jit
def _insert_kernel(
    keys_ptr, values_ptr, pos_ptr, prio_ptr, newk_ptr, newv_ptr, p_ptr, at_ptr,
    w1_ptr, b1_ptr, w2_ptr, b2_ptr, lg_ptr,
    Hk, T, lr, k, leave_from, window,
    D: tl.constexpr, F: tl.constexpr, K: tl.constexpr, MLP: tl.constexpr, EVICT: tl.constexpr, BD: tl.constexpr,
):
    pid = tl.program_id(0)  # b * Hk + h
    h = pid % Hk
    row = pid.to(tl.int64) * T  # first slot of this (row, head)
    p = tl.load(p_ptr)  # the new token's position (int64)
    at = tl.load(at_ptr)  # its ring slot, the same in every (row, head)
    d = tl.arange(0, D)
    if EVICT:
        ko = tl.load(keys_ptr + (row + at) * D + d)  # the occupant: token p - window, leaving the window
        vo = tl.load(values_ptr + (row + at) * D + d)
        tok = p - window
        if MLP:
            f = tl.arange(0, F)
            w1 = w1_ptr + h.to(tl.int64) * (2 * D * F)
            hid = tl.load(b1_ptr + h * F + f)
            # [key, value] @ w1 in (BD, F) tiles, the key and value loaded again per tile: converting the
            # ko/vo already loaded instead made the step 0.1 ms slower at batch 1 (3.92 vs 3.82 ms on an
            # H200, alternating runs: results/insert_reuse_ab_h200.json; why was not profiled)
            for d0 in tl.static_range(0, D, BD):
                e = d0 + tl.arange(0, BD)
                ke = tl.load(keys_ptr + (row + at) * D + e).to(tl.float32)
                ve = tl.load(values_ptr + (row + at) * D + e).to(tl.float32)
                hid += tl.sum(ke[:, None] * tl.load(w1 + e[:, None] * F + f[None, :]), axis=0)
                hid += tl.sum(ve[:, None] * tl.load(w1 + (D + e[:, None]) * F + f[None, :]), axis=0)
            hid = hid * tl.sigmoid(hid)  # SiLU
            r = tl.sum(hid * tl.load(w2_ptr + h * F + f), axis=0) + tl.load(b2_ptr + h)
            cand = r.to(tl.float64) - tok.to(tl.float64) * tl.load(lg_ptr + h)
        else:
            cand = tok.to(tl.float64)
        lane = tl.arange(0, K)
        real = lane < k
        lp = tl.load(prio_ptr + row + lr + lane, mask=real, other=float("inf"))  # empty slots hold -inf
        lpos = tl.load(pos_ptr + row + lr + lane, mask=real, other=I64_MAX)
        low = tl.min(lp, axis=0)
        lowest = real & (lp == low)
        vpos = tl.min(tl.where(lowest, lpos, I64_MAX), axis=0)  # among the lowest, the oldest (empty: -1)
        victim = lr + tl.min(tl.where(lowest & (lpos == vpos), lane, K), axis=0)  # the first such slot
        # the leaver is newer than every slot: it wins ties; a -inf one (a gated-out token) never enters
        wins = (p >= leave_from) & (cand >= low) & (cand > float("-inf"))
        tl.store(keys_ptr + (row + victim) * D + d, ko, mask=wins & (d >= 0))
        tl.store(values_ptr + (row + victim) * D + d, vo, mask=wins & (d >= 0))
        tl.store(pos_ptr + row + victim, tl.load(pos_ptr + row + at), mask=wins)  # the occupant's position, token p - window
        tl.store(prio_ptr + row + victim, cand, mask=wins)
    tl.store(keys_ptr + (row + at) * D + d, tl.load(newk_ptr + pid.to(tl.int64) * D + d))
    tl.store(values_ptr + (row + at) * D + d, tl.load(newv_ptr + pid.to(tl.int64) * D + d))
    tl.store(pos_ptr + row + at, p)
    tl.store(prio_ptr + row + at, float("nan"))  # scored when it leaves the window


@torch.library.custom_op("kvpop::insert_token", mutates_args=("keys", "values", "pos", "prio"))
def insert_token(
    keys: Tensor, values: Tensor, pos: Tensor, prio: Tensor, k: Tensor, v: Tensor, p: Tensor, at: Tensor,
    w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, log_gamma: Tensor,
    lr: int, slots: int, leave_from: int, window: int, mlp: bool, evict: bool,
) -> None:
    """Token ``p`` (0-d int64) with key and value k, v (B, Hk, D) into ring slot ``at`` ((1,) int64)
    of one layer's buffers keys, values (B, Hk, T, D), pos (B, Hk, T) int64, prio (B, Hk, T) float64,
    in place (an opaque custom op: a compiled step launches the kernel as it is, and a CUDA graph
    replays it); with ``evict`` its occupant competes for the long-range slots ``[lr, slots)`` (only once
    ``p >= leave_from``, the first position whose occupant leaves the window), scored by the MLP
    (``mlp``: w1 (Hk, 2D, F), b1, w2 (Hk, F), b2 (Hk,), log_gamma (Hk,) float64) or its position."""
    B, Hk, T, D = keys.shape
    F = w1.shape[-1] if mlp else 1
    K = max(16, triton.next_power_of_2(max(slots - lr, 1)))
    _insert_kernel[(B * Hk,)](
        keys, values, pos, prio, k, v, p, at, w1, b1, w2, b2, log_gamma,
        Hk, T, lr, slots - lr, leave_from, window, D=D, F=F, K=K, MLP=mlp, EVICT=evict,
        **launch_config(K, D),
    )


def launch_config(K: int, D: int) -> dict[str, int]:
    """The MLP's key/value tile rows ``BD`` and the warps per program for ``K`` long-range lanes: the
    fastest of bench/kernels/bench_insert.py's grid on an H200 (tiles of 16-128 rows, 4-16 warps; whole-D tiles,
    4 warps up to 2,048 lanes and 8 above: results/bench_insert_h200.json), unless ``LAUNCH`` overrides."""
    return {"BD": min(LAUNCH.get("block_d", D), D), "num_warps": LAUNCH.get("num_warps", 4 if K <= 2048 else 8)}


@insert_token.register_fake
def _(keys, values, pos, prio, k, v, p, at, w1, b1, w2, b2, log_gamma, lr, slots, leave_from, window, mlp, evict) -> None:
    return None  # writes its buffers in place, returns nothing: the compiler keeps it as one opaque call


def fused_insert(keys: Tensor, values: Tensor, pos: Tensor, prio: Tensor, k: Tensor, v: Tensor, p: Tensor, at: Tensor,
                 scorer, *, lr: int, slots: int, sinks: int, window: int, evict: bool) -> None:
    """:func:`insert_token` with a :class:`kvpop.policies.FusedScorer` ``scorer`` (k, v (B, Hk, 1, D)
    as the engine holds them; ``at`` (B * Hk,), the same slot in every entry)."""
    B, Hk = keys.shape[:2]
    mlp = scorer.kind == "mlp"
    if mlp:
        w1, b1, w2, b2, lg = scorer.w1, scorer.b1, scorer.w2, scorer.b2, scorer.log_gamma
    else:  # unread by the kernel (its MLP branch is compiled out): no allocation on the step's path
        w1 = b1 = w2 = b2 = lg = p
    insert_token(keys, values, pos, prio, k.reshape(B, Hk, -1).contiguous(), v.reshape(B, Hk, -1).contiguous(), p, at.reshape(-1)[:1],
                 w1.contiguous(), b1.contiguous(), w2.contiguous(), b2.contiguous(), lg.contiguous(),
                 lr, slots, sinks + window, window, mlp, evict)
