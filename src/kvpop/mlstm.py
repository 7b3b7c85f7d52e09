"""KVpop (main variant): a *delayed* mLSTM scorer per (layer, KV head), plus the learned decay.

A token needs a score only when it leaves the protected window, at query ``q = t + window``. By then
the ``window`` tokens that followed it are known, so a stateful scorer may read them first. Per
layer and KV head an mLSTM cell (xLSTM's matrix memory) runs over the detached keys and values of a
document; token ``t`` is scored against the memory at time ``tau_t = min(t + window, end_t - 1)``
(``end_t``: exclusive end of its document), i.e. after having read tokens ``start_t .. tau_t``.

Per token ``s`` with features ``x_s = [k_s; v_s]`` (2D, detached) and per KV head::

    q~_s = W_q x_s (d_k)      k~_s = W_k x_s / sqrt(d_k) (d_k)      v~_s = W_v x_s (d_v)
    i~_s = w_i . x_s + b_i    (exponential input gate:  i_s = exp(i~_s))
    log f_s = logsigmoid(w_f . x_s + b_f)    or, with forget_gate="exp",   w_f . x_s + b_f

Recurrent form (state C (d_k x d_v), n (d_k), stabilizer m; all zero / -inf at a document start)::

    m_s = max(log f_s + m_{s-1}, i~_s)
    C_s = exp(log f_s + m_{s-1} - m_s) C_{s-1} + exp(i~_s - m_s) k~_s v~_s^T
    n_s = exp(log f_s + m_{s-1} - m_s) n_{s-1} + exp(i~_s - m_s) k~_s

Read-out of token t (``readout``), with the state at ``tau_t``::

    h_t = C^T q~_t / max(|n^T q~_t|, exp(-m))          (d_v; xLSTM normalization)
    r_hat_t = w_o . h_t + w_p . x_t + b

Parallel form (``parallel``: the reference twin of the chunkwise form), with ``F_j = sum_{u <= j} log f_u`` and
``log D[t, s] = F_{tau_t} - F_s + i~_s`` for ``start_t <= s <= tau_t`` (else ``-inf``)::

    m_t = max_s log D[t, s],   D'[t, s] = exp(log D[t, s] - m_t),   W[t, s] = D'[t, s] (q~_t . k~_s)
    h_t = sum_s W[t, s] v~_s / max(|sum_s W[t, s]|, exp(-m_t))

Both forms compute ``exp(-m) C~^T q / max(|n~^T q| exp(-m), exp(-m))`` for the unstabilized
``C~, n~``, so they agree for any stabilizer; the parallel one runs chunked over t (memory
O(chunk x S) per head, with activation checkpointing per chunk when gradients are needed). Its
cost is quadratic in the document length: a read-out touches every key from its document's start.

Chunkwise form (``chunkwise``, what ``raw_scores`` runs in training; linear in S): the time axis
is cut into chunks ``[c0, c1)`` of ``Lc`` tokens, run in order, carrying the stabilized state ``(C, n, m)`` of the
document of token ``c0 - 1`` (built from tokens ``start_{c0-1} .. c0 - 1``) into the chunk. With
``G_j = sum_{c0 <= u <= j} log f_u`` (float64, local to the chunk), every token t whose
``tau_t`` falls in the chunk is read out there, with::

    log D0[t]   = G_{tau_t} + m                      if start_t < c0 (its document crosses c0), else -inf
    log D[t, s] = G_{tau_t} - G_s + i~_s             for max(start_t, c0) <= s <= tau_t, else -inf
    m_t = max(log D0[t], max_s log D[t, s])
    h_t = (exp(log D0 - m_t) C^T q~_t + sum_s exp(log D[t, s] - m_t) (q~_t . k~_s) v~_s)
          / max(|exp(log D0 - m_t) n^T q~_t + sum_s exp(log D[t, s] - m_t) (q~_t . k~_s)|, exp(-m_t))

i.e. the parallel form's sum split at ``c0`` (the carried state holds ``exp(-m)`` times the
terms ``s < c0``, decayed to ``c0 - 1``). The state then moves to the chunk's end, restarting where
a document starts inside the chunk (``e = c1 - 1``)::

    m' = max(G_e + m [if start_e < c0], max_{s >= max(start_e, c0)} G_e - G_s + i~_s)
    C' = exp(G_e + m - m') C [if start_e < c0] + sum_{s >= max(start_e, c0)} exp(G_e - G_s + i~_s - m') k~_s v~_s^T

(likewise ``n'``). A chunk reads out at most ``Lc + window`` tokens (``Lc`` inside a document; the
last ``window`` tokens of a document all read at its end) against at most ``Lc`` keys each, so the
cost per head is O(S Lc (d_k + d_v) + S d_k d_v), plus O(window Lc (d_k + d_v)) per document end,
and the memory O((Lc + window) Lc) per chunk, with activation checkpointing per chunk when
gradients are needed. The stabilizers carry no gradient (h does not depend on them). Scores are
bitwise blind to the tokens after ``tau_t`` (masked terms are exact zeros), as the parallel form's.

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers; d_k, d_v the memory's dims; Lc the
chunkwise form's chunk length.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from kvpop.geometry import CacheLayout, check_budget
from kvpop.scorer import LearnedDecay, all_layers_scorer, one_layer_scorer
from kvpop.selection import document_spans

ForgetGate = Literal["sigmoid", "exp"]
TrainingForm = Literal["chunkwise", "parallel"]
CHUNK_CUDA, CHUNK_CPU = 2048, 256  # MLSTMScorer's default chunk per device (see its __init__)


class MLSTMState(NamedTuple):
    """Recurrent state of one layer's cells (all KV heads)."""

    C: Tensor  # (B, Hk, d_k, d_v) matrix memory (stabilized: true memory * exp(-m))
    n: Tensor  # (B, Hk, d_k) normalizer (stabilized likewise)
    m: Tensor  # (B, Hk) log-space stabilizer; -inf for an empty state


class Features(NamedTuple):
    """Per-token projections of one layer; the leading dims are those of the input (B, Hk, ...)."""

    q: Tensor  # (..., d_k) read-out query
    k: Tensor  # (..., d_k) memory key, already scaled by 1 / sqrt(d_k)
    v: Tensor  # (..., d_v) memory value
    i_pre: Tensor  # (...) input-gate pre-activation i~ (log of the exponential input gate)
    log_f: Tensor  # (...) log forget gate
    direct: Tensor  # (...) w_p . x + b, the read-out's direct term


class HeadwiseMLSTM(nn.Module):
    """Per KV head, one mLSTM cell on the concatenated key and value (2D) and its read-out head.

    Initialization follows xLSTM: gate weights zero, forget-gate bias spread over [3, 6] across
    heads (memory horizons of roughly 20..400 tokens), input-gate bias N(0, 0.1).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, d_k: int = 16, d_v: int = 16, forget_gate: ForgetGate = "sigmoid"):
        super().__init__()
        if forget_gate not in ("sigmoid", "exp"):
            raise ValueError(f"forget_gate must be 'sigmoid' or 'exp', got {forget_gate!r}")
        Hk, fan_in = num_kv_heads, 2 * head_dim
        self.d_k, self.d_v, self.forget_gate = d_k, d_v, forget_gate
        self.w_q = nn.Parameter(torch.randn(Hk, fan_in, d_k) / math.sqrt(fan_in))
        self.w_k = nn.Parameter(torch.randn(Hk, fan_in, d_k) / math.sqrt(fan_in))
        self.w_v = nn.Parameter(torch.randn(Hk, fan_in, d_v) / math.sqrt(fan_in))
        self.w_gate = nn.Parameter(torch.zeros(Hk, fan_in, 2))  # [..., 0] input, [..., 1] forget
        f_bias = torch.linspace(3.0, 6.0, Hk) if forget_gate == "sigmoid" else torch.zeros(Hk)
        self.b_gate = nn.Parameter(torch.stack([0.1 * torch.randn(Hk), f_bias], dim=-1))  # (Hk, 2)
        self.w_o = nn.Parameter(torch.randn(Hk, d_v) / math.sqrt(d_v))
        self.w_p = nn.Parameter(torch.randn(Hk, fan_in) / math.sqrt(fan_in))
        self.b = nn.Parameter(torch.zeros(Hk))

    # ------------------------------------------------------------------ features
    def features(self, k: Tensor, v: Tensor) -> Features:
        """k, v (B, Hk, S, D) or (B, Hk, D) -> :class:`Features` (inputs are detached here)."""
        single = k.dim() == 3
        if single:
            k, v = k[:, :, None], v[:, :, None]
        x = torch.cat([k.detach(), v.detach()], dim=-1).to(self.w_q.dtype)  # (B, Hk, S, 2D)
        q = torch.einsum("bhsi,hid->bhsd", x, self.w_q)  # (B, Hk, S, d_k)
        kk = torch.einsum("bhsi,hid->bhsd", x, self.w_k) / math.sqrt(self.d_k)  # (B, Hk, S, d_k)
        vv = torch.einsum("bhsi,hid->bhsd", x, self.w_v)  # (B, Hk, S, d_v)
        g = torch.einsum("bhsi,hig->bhsg", x, self.w_gate) + self.b_gate[:, None]  # (B, Hk, S, 2)
        log_f = F.logsigmoid(g[..., 1]) if self.forget_gate == "sigmoid" else g[..., 1]
        direct = torch.einsum("bhsi,hi->bhs", x, self.w_p) + self.b[:, None]  # (B, Hk, S)
        out = Features(q, kk, vv, g[..., 0], log_f, direct)
        return Features(*(t[:, :, 0] for t in out)) if single else out

    def head(self, h: Tensor, direct: Tensor) -> Tensor:
        """Read-out head: h (B, Hk, ..., d_v), direct (B, Hk, ...) -> r_hat (B, Hk, ...)."""
        w_o = self.w_o.view(self.w_o.shape[0], *([1] * (h.dim() - 3)), -1)
        return (h * w_o).sum(-1) + direct

    # ------------------------------------------------------------------ recurrent form
    def init_state(self, B: int, device=None, dtype=None) -> MLSTMState:
        """Empty state (document start): C = 0, n = 0, m = -inf."""
        Hk, dtype = self.w_q.shape[0], dtype or self.w_q.dtype
        return MLSTMState(
            C=torch.zeros(B, Hk, self.d_k, self.d_v, device=device, dtype=dtype),
            n=torch.zeros(B, Hk, self.d_k, device=device, dtype=dtype),
            m=torch.full((B, Hk), float("-inf"), device=device, dtype=dtype),
        )

    def step(self, state: MLSTMState, k_t: Tensor, v_t: Tensor, reset: Tensor | None = None) -> MLSTMState:
        """Write one token: k_t, v_t (B, Hk, D); reset (B,) bool restarts those rows first."""
        if reset is not None:
            r = reset.view(-1, 1)
            state = MLSTMState(
                C=state.C.masked_fill(r[..., None, None], 0.0),
                n=state.n.masked_fill(r[..., None], 0.0),
                m=state.m.masked_fill(r, float("-inf")),
            )
        f = self.features(k_t, v_t)  # each (B, Hk, ...)
        m_new = torch.maximum(f.log_f + state.m, f.i_pre)  # (B, Hk), finite
        fp = torch.exp(f.log_f + state.m - m_new)  # (B, Hk), 0 on an empty state
        ip = torch.exp(f.i_pre - m_new)  # (B, Hk)
        C = fp[..., None, None] * state.C + ip[..., None, None] * f.k[..., :, None] * f.v[..., None, :]
        n = fp[..., None] * state.n + ip[..., None] * f.k
        return MLSTMState(C, n, m_new)

    def readout(self, state: MLSTMState, k_t: Tensor, v_t: Tensor) -> Tensor:
        """Score token t (k_t, v_t (B, Hk, D)) against ``state`` (at tau_t) -> r_hat (B, Hk)."""
        f = self.features(k_t, v_t)
        num = torch.einsum("bhkv,bhk->bhv", state.C, f.q)  # (B, Hk, d_v)
        den = torch.maximum(torch.einsum("bhk,bhk->bh", state.n, f.q).abs(), torch.exp(-state.m))  # (B, Hk)
        return self.head(num / den[..., None], f.direct)

    def chunk(self, state: MLSTMState, k: Tensor, v: Tensor, rk: Tensor, rv: Tensor, tau: Tensor) -> tuple[Tensor, MLSTMState]:
        """Read ``C`` tokens into ``state`` at once, scoring ``R`` tokens on the way (chunked prefill).

        k, v (B, Hk, C, D) the new tokens; rk, rv (B, Hk, R, D) the tokens to score, each at its
        read-out time ``tau`` (R,) int in [0, C) (after reading new tokens ``0 .. tau``). With
        ``F_j = sum_{u <= j} log f_u`` over the new tokens and ``C~ = C exp(m)`` the unstabilized
        memory, ``C~_tau = exp(F_tau) C~_0 + sum_{s <= tau} exp(F_tau - F_s + i~_s) k~_s v~_s^T``
        (likewise ``n``): the parallel form plus one term for the carried state. Returns
        (r_hat (B, Hk, R), the state after all C tokens), equal to :meth:`step` token by token
        followed by :meth:`readout`, up to rounding.
        """
        f, fr = self.features(k, v), self.features(rk, rv)
        dt = f.k.dtype
        cum = f.log_f.double().cumsum(-1)  # (B, Hk, C)
        m0 = state.m.double()[..., None]  # (B, Hk, 1); -inf for an empty state
        C = k.shape[2]
        # read-outs: log-weights of the carried state (B, Hk, R) and of the new tokens (B, Hk, R, C)
        f_tau = cum[..., tau]  # (B, Hk, R)
        lw0 = f_tau + m0
        lw = f_tau[..., None] - cum[..., None, :] + f.i_pre.double()[..., None, :]
        lw = lw.masked_fill(torch.arange(C, device=k.device) > tau[:, None], float("-inf"))
        m = torch.maximum(lw.amax(-1), lw0)  # (B, Hk, R), finite: s = tau is always valid
        w = torch.exp(lw - m[..., None]).to(dt) * torch.einsum("bhrd,bhcd->bhrc", fr.q, f.k)  # (B, Hk, R, C)
        w0 = torch.exp(lw0 - m).to(dt)  # (B, Hk, R)
        num = torch.einsum("bhrc,bhcv->bhrv", w, f.v) + w0[..., None] * torch.einsum("bhkv,bhrk->bhrv", state.C, fr.q)
        den = w.sum(-1) + w0 * torch.einsum("bhk,bhrk->bhr", state.n, fr.q)
        den = torch.maximum(den.abs(), torch.exp(-m).to(dt))
        r_hat = self.head(num / den[..., None], fr.direct)  # (B, Hk, R)
        return r_hat, self._absorb(state, f, cum)

    def absorb(self, state: MLSTMState, k: Tensor, v: Tensor) -> MLSTMState:
        """The state after reading k, v (B, Hk, C, D) into ``state``, in closed form (what
        :meth:`step` reaches token by token, up to rounding)."""
        f = self.features(k, v)
        return self._absorb(state, f, f.log_f.double().cumsum(-1))

    @staticmethod
    def _absorb(state: MLSTMState, f: Features, cum: Tensor) -> MLSTMState:
        """``C~_end = exp(F_end) C~_0 + sum_s exp(F_end - F_s + i~_s) k~_s v~_s^T`` (likewise n),
        stabilized by its largest log-weight; cum (B, Hk, C) float64 = F."""
        dt = f.k.dtype
        le = cum[..., -1:] - cum + f.i_pre.double()  # (B, Hk, C)
        le0 = cum[..., -1] + state.m.double()  # (B, Hk); -inf for an empty state
        m_end = torch.maximum(le.amax(-1), le0)
        we, we0 = torch.exp(le - m_end[..., None]).to(dt), torch.exp(le0 - m_end).to(dt)
        C_end = we0[..., None, None] * state.C + torch.einsum("bhs,bhsk,bhsv->bhkv", we, f.k, f.v)
        n_end = we0[..., None] * state.n + torch.einsum("bhs,bhsk->bhk", we, f.k)
        return MLSTMState(C_end, n_end, m_end.to(state.m.dtype))

    # ------------------------------------------------------------------ parallel form
    def parallel(self, k: Tensor, v: Tensor, start: Tensor, tau: Tensor, chunk: int = 256, use_checkpoint: bool | None = None) -> Tensor:
        """k, v (B, Hk, S, D); start, tau (B, S) int -> r_hat (B, Hk, S).

        Token t reads the memory built from tokens ``start_t .. tau_t`` (its document's start, and
        its read-out time). Runs over chunks of ``chunk`` read-out tokens; each chunk touches only the
        key range ``[min start, max tau]`` of its tokens, so memory is O(B Hk chunk S) at most.
        """
        B, Hk, S, _ = k.shape
        f = self.features(k, v)
        # F_j = sum_{u <= j} log f_u in float64: long rows would lose precision in float32.
        cum = f.log_f.double().cumsum(-1)  # (B, Hk, S)
        if use_checkpoint is None:
            use_checkpoint = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        outs = []
        for t0 in range(0, S, chunk):
            t1 = min(S, t0 + chunk)
            st, ta = start[:, t0:t1], tau[:, t0:t1]  # (B, c)
            lo, hi = int(st.min()), int(ta.max()) + 1  # key range [lo, hi)
            args = (f.q[:, :, t0:t1], f.k[:, :, lo:hi], f.v[:, :, lo:hi], f.i_pre[:, :, lo:hi], cum[:, :, lo:hi],
                    cum.gather(-1, ta[:, None].expand(B, Hk, -1)), st - lo, ta - lo)
            fn = _parallel_chunk
            outs.append(checkpoint(fn, *args, use_reentrant=False) if use_checkpoint else fn(*args))
        h = torch.cat(outs, dim=2)  # (B, Hk, S, d_v)
        return self.head(h, f.direct)

    # ------------------------------------------------------------------ chunkwise form
    def chunkwise(self, k: Tensor, v: Tensor, start: Tensor, tau: Tensor, chunk: int = 256, use_checkpoint: bool | None = None) -> Tensor:
        """k, v (B, Hk, S, D); start, tau (B, S) int64 -> r_hat (B, Hk, S): :meth:`parallel`'s result, linear in S.

        Runs over chunks of ``chunk`` tokens of the time axis, in order, carrying the stabilized
        state across chunk boundaries (module docstring, "Chunkwise form"); token t is read out in
        the chunk that holds ``tau_t``. ``start, tau`` must be laid out as :func:`readout_times`
        makes them: ``start`` is the first token of each contiguous document (so it is non-decreasing
        and ``start[start_t] = start_t``), ``start_t <= tau_t`` in t's document (``start[tau_t] =
        start_t``), and ``tau`` is non-decreasing; a ``ValueError`` says otherwise. The readers of a
        chunk are a contiguous range of t per row (their union over the batch is processed, the
        others masked), at most ``chunk + window`` of them. One host sync (the readers' ranges).
        """
        B, Hk, S, _ = k.shape
        Lc = max(1, int(chunk))
        f = self.features(k, v)
        if use_checkpoint is None:
            use_checkpoint = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        start, tau = start.to(k.device, torch.int64), tau.to(k.device, torch.int64)
        edges = torch.cat([torch.arange(0, S, Lc, device=k.device), torch.tensor([S], device=k.device)])  # (N + 1,) chunk edges
        # bounds[b, c] = #{t : tau[b, t] < edges[c]}: the readers of chunk c in row b are bounds[b, c] .. bounds[b, c + 1] - 1
        bounds = torch.searchsorted(tau.contiguous(), edges.expand(B, -1).contiguous())  # (B, N + 1)
        meta = torch.cat([bounds[:, :-1].amin(0), bounds[:, 1:].amax(0), _spans_ok(start, tau).long().view(1)]).tolist()
        N = len(edges) - 1
        lo, hi, ok = meta[:N], meta[N : 2 * N], meta[-1]
        if not ok:
            raise ValueError("chunkwise needs readout_times' layout: contiguous documents, start_t <= tau_t in t's document, tau non-decreasing")
        # the memory and its normalizer as one matrix [C | n] (d_k x (d_v + 1)), written with [v~; 1]
        vn = torch.cat([f.v, torch.ones_like(f.v[..., :1])], dim=-1)  # (B, Hk, S, d_v + 1)
        state = (
            f.k.new_zeros(B, Hk, self.d_k, self.d_v + 1),  # [C | n] (B, Hk, d_k, d_v + 1), stabilized
            torch.full((B, Hk), float("-inf"), device=k.device, dtype=torch.float64),  # m (B, Hk): empty state
        )
        hs = []
        for c in range(N):
            c0, c1, r0, r1 = c * Lc, min(S, c * Lc + Lc), lo[c], hi[c]
            args = (*state, f.q[:, :, r0:r1], f.k[:, :, c0:c1], vn[:, :, c0:c1], f.i_pre[:, :, c0:c1], f.log_f[:, :, c0:c1],
                    tau[:, r0:r1] - c0, start[:, r0:r1] - c0, start[:, c1 - 1] - c0)
            fn = _chunkwise_chunk
            h, *state = checkpoint(fn, *args, use_reentrant=False) if use_checkpoint else fn(*args)
            hs.append(h)  # (B, Hk, r1 - r0, d_v); zero where tau_t is not in this chunk
        # every (b, t) is read out in exactly one chunk and is zero in the others: the sum is exact
        idx = torch.cat([torch.arange(lo[c], hi[c]) for c in range(N)]).to(k.device)  # (sum of r1 - r0,)
        h = f.v.new_zeros(B, Hk, S, self.d_v).index_add(2, idx, torch.cat(hs, dim=2))  # (B, Hk, S, d_v)
        return self.head(h, f.direct)


class ChunkwiseStream:
    """The chunkwise form fed one chunk of keys and values at a time, as a chunked forward writes them
    (``kvpop_pool`` in :func:`kvpop.pool.pool_chunked`): the same per-chunk step as
    :meth:`HeadwiseMLSTM.chunkwise` with its chunk edges at the fed chunks' edges, the stabilized state
    ``[C | n], m`` carried from one feed to the next.

    ``start, tau`` (B, S) int64 of the whole rows, laid out as :func:`readout_times` makes them (with the
    read-out delay as its ``window``). :meth:`feed` takes the next chunk and reads out the tokens whose
    ``tau`` falls in it, each exactly once, so a token's score is ready once the chunk that holds its
    ``tau`` has been fed. Keeps every fed token's read-out side (q~, the direct term): a reader may sit
    in an earlier chunk.

    ``delay``: the read-out delay ``d`` that laid ``tau`` out (``t <= tau_t <= t + d``, :func:`readout_times`), if
    known: a feed then reads out tokens ``[c0 - d, c1)``, a range fixed by the chunk alone, with no host
    synchronization (so that the pass can be captured in a CUDA graph, :class:`kvpop.pool.ChunkedGraphs`); the
    tokens not read in it are masked as always. Without it, the readers' union over the rows, from the read-out
    times copied to the host once per stream (one host synchronization)."""

    def __init__(self, cell: HeadwiseMLSTM, start: Tensor, tau: Tensor, delay: int | None = None):
        self.cell, self.start, self.tau = cell, start.to(torch.int64), tau.to(torch.int64).contiguous()
        self.delay = delay
        self.tau_host = self.tau.cpu() if delay is None else None  # (B, S): the readers' ranges without a sync per feed
        self.seen = 0  # tokens fed
        self.q: Tensor | None = None  # (B, Hk, seen, d_k) read-out queries of every fed token
        self.direct: Tensor | None = None  # (B, Hk, seen) their direct terms
        self.state: tuple[Tensor, Tensor] | None = None  # [C | n] (B, Hk, d_k, d_v + 1), m (B, Hk) float64

    def feed(self, k: Tensor, v: Tensor) -> tuple[Tensor, int, Tensor]:
        """k, v (B, Hk, C, D) of tokens ``[seen, seen + C)`` -> (r_hat (B, Hk, R), r0, read (B, R) bool) of
        tokens ``r0 .. r0 + R - 1``: ``read`` marks the ones whose ``tau`` is in this chunk (their r_hat is
        final); the others' r_hat is not a score and must be ignored (another row's readers)."""
        B, Hk, C, _ = k.shape
        c0, c1 = self.seen, self.seen + C
        if c1 > self.tau.shape[1]:
            raise ValueError(f"ChunkwiseStream: fed {c1} tokens of rows of {self.tau.shape[1]}")
        f = self.cell.features(k, v)
        self.q = f.q if self.q is None else torch.cat([self.q, f.q], 2)
        self.direct = f.direct if self.direct is None else torch.cat([self.direct, f.direct], 2)
        if self.state is None:  # the empty state, as chunkwise starts
            self.state = (f.k.new_zeros(B, Hk, self.cell.d_k, self.cell.d_v + 1),
                          torch.full((B, Hk), float("-inf"), device=k.device, dtype=torch.float64))
        # readers: tau in [c0, c1), a contiguous range of t per row (tau is non-decreasing); their union over rows, or
        # [c0 - d, c1), which holds it (t <= tau_t <= t + d)
        if self.delay is not None:
            r0, r1 = max(0, c0 - self.delay), c1
        else:
            bounds = torch.searchsorted(self.tau_host, torch.tensor([c0, c1]).expand(B, 2).contiguous())  # (B, 2)
            r0, r1 = int(bounds[:, 0].min()), int(bounds[:, 1].max())
        vn = torch.cat([f.v, torch.ones_like(f.v[..., :1])], dim=-1)  # (B, Hk, C, d_v + 1)
        ta, st = self.tau[:, r0:r1] - c0, self.start[:, r0:r1] - c0  # (B, R) relative to the chunk
        h, Cn, m = _chunkwise_chunk(*self.state, self.q[:, :, r0:r1], f.k, vn, f.i_pre, f.log_f, ta, st, self.start[:, c1 - 1] - c0)
        self.state, self.seen = (Cn, m), c1
        return self.cell.head(h, self.direct[:, :, r0:r1]), r0, (ta >= 0) & (ta < C)


def _parallel_chunk(q: Tensor, k: Tensor, v: Tensor, i_pre: Tensor, cum: Tensor, cum_tau: Tensor, st: Tensor, ta: Tensor) -> Tensor:
    """One chunk of the parallel form; returns h (B, Hk, c, d_v).

    q (B, Hk, c, d_k) read-out queries; k (B, Hk, R, d_k), v (B, Hk, R, d_v), i_pre (B, Hk, R),
    cum (B, Hk, R) float64 (F over the key range); cum_tau (B, Hk, c) float64 (F at each tau_t);
    st, ta (B, c) start and tau relative to the key range.
    """
    R = k.shape[2]
    # log D = (F_tau - F_ref) + (F_ref - F_s + i~_s), both halves formed in float64 and rounded
    # once, so rounding is relative to each half (O(chunk + window) terms), not to |F| itself.
    # ref = the chunk's earliest read-out time: F_ref depends on no token after any tau_t, so the
    # scores are exactly (bitwise) blind to later tokens.
    B, Hk = q.shape[:2]
    ref = cum.gather(-1, ta.min(-1).values.view(B, 1, 1).expand(B, Hk, 1))  # (B, Hk, 1)
    a = (cum_tau - ref).to(q.dtype)  # (B, Hk, c)
    b = (ref - cum + i_pre.double()).to(q.dtype)  # (B, Hk, R)
    s = torch.arange(R, device=q.device)
    valid = (s >= st[..., None]) & (s <= ta[..., None])  # (B, c, R)
    log_d = (a[..., None] + b[..., None, :]).masked_fill(~valid[:, None], float("-inf"))  # (B, Hk, c, R)
    m = log_d.amax(-1).detach()  # (B, Hk, c); finite: s = t is always valid. m cancels exactly.
    w = torch.exp(log_d - m[..., None]) * torch.einsum("bhcd,bhrd->bhcr", q, k)  # (B, Hk, c, R)
    num = torch.einsum("bhcr,bhrv->bhcv", w, v)  # (B, Hk, c, d_v)
    den = torch.maximum(w.sum(-1).abs(), torch.exp(-m))  # (B, Hk, c)
    return num / den[..., None]


def _chunkwise_chunk(Cn0: Tensor, m0: Tensor, q: Tensor, k: Tensor, vn: Tensor, i_pre: Tensor, log_f: Tensor,
                     ta: Tensor, st: Tensor, st_end: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of the chunkwise form: read out its readers, then move the state to the chunk's end.

    Cn0 (B, Hk, d_k, d_v + 1) the carried state [C | n], stabilized by m0 (B, Hk) float64 (-inf:
    empty); q (B, Hk, R, d_k) the readers' queries; k (B, Hk, Lc, d_k), vn (B, Hk, Lc, d_v + 1) = [v~; 1],
    i_pre, log_f (B, Hk, Lc) the chunk's tokens; ta, st (B, R) the readers' tau and start, st_end (B,)
    the start of the chunk's last token, all relative to the chunk's start (st < 0: the document
    crosses into the chunk and uses the carried state). Readers whose tau is not in [0, Lc) are
    computed on a clamped tau (finite, so no NaN reaches the gradients) and returned as zero.
    Returns (h (B, Hk, R, d_v), [C | n] and m after the chunk). The stabilizers are detached: h and
    the unstabilized state do not depend on them, so they carry no gradient.
    """
    B, Hk, Lc = log_f.shape
    dt, j = k.dtype, torch.arange(Lc, device=k.device)
    lt = torch.promote_types(dt, torch.float32)  # dtype of the (R, Lc) log-weights: at least float32
    reads = (ta >= 0) & (ta < Lc)  # (B, R): tau_t in this chunk
    ta = ta.clamp(0, Lc - 1)
    st = torch.minimum(st, ta)
    G = log_f.double().cumsum(-1)  # (B, Hk, Lc) float64: G_j = sum_{u <= j} log f_u within the chunk
    ib = i_pre.double() - G  # (B, Hk, Lc): i~_s - G_s
    # read-outs: log-weights of the carried state (B, Hk, R) and of the chunk's tokens (B, Hk, R, Lc)
    Ga = G.gather(-1, ta[:, None].expand(B, Hk, -1))  # (B, Hk, R)
    lw0 = (Ga + m0[..., None]).masked_fill((st >= 0)[:, None], float("-inf"))  # no carried state if start_t >= c0
    keys = (j >= st[..., None]) & (j <= ta[..., None])  # (B, R, Lc): max(start_t, c0) <= s <= tau_t
    # log D = G_tau + (i~_s - G_s): both halves are sums over this chunk only, formed in float64 and
    # rounded once to lt, so the (R, Lc) matrix and its exp run in lt at a rounding relative to them.
    lw = (Ga.to(lt)[..., None] + ib.to(lt)[..., None, :]).masked_fill(~keys[:, None], float("-inf"))
    m = torch.maximum(lw.amax(-1), lw0.to(lt)).detach()  # (B, Hk, R); finite: s = tau_t is always a key
    w = torch.exp(lw - m[..., None]).to(dt) * torch.einsum("bhrd,bhld->bhrl", q, k)  # (B, Hk, R, Lc)
    w0 = torch.exp(lw0 - m.double()).to(dt)  # (B, Hk, R); the same stabilizer m as w
    nd = torch.einsum("bhrl,bhlv->bhrv", w, vn) + w0[..., None] * torch.einsum("bhkv,bhrk->bhrv", Cn0, q)  # (B, Hk, R, d_v + 1)
    den = torch.maximum(nd[..., -1].abs(), torch.exp(-m).to(dt))  # (B, Hk, R)
    h = torch.where(reads[:, None, :, None], nd[..., :-1] / den[..., None], 0.0)
    # the state at the chunk's end, restarted where a document starts inside the chunk
    le = (G[..., -1:] + ib).masked_fill((j < st_end[:, None])[:, None], float("-inf"))  # (B, Hk, Lc)
    le0 = (G[..., -1] + m0).masked_fill((st_end >= 0)[:, None], float("-inf"))  # (B, Hk)
    m1 = torch.maximum(le.amax(-1), le0).detach()  # (B, Hk); finite: the last token is always in
    we, we0 = torch.exp(le - m1[..., None]).to(dt), torch.exp(le0 - m1).to(dt)
    Cn1 = we0[..., None, None] * Cn0 + torch.einsum("bhl,bhlk,bhlv->bhkv", we, k, vn)
    return h, Cn1, m1


def _spans_ok(start: Tensor, tau: Tensor) -> Tensor:
    """() bool tensor (no host sync): ``start, tau`` (B, S) have :func:`readout_times`' layout
    (contiguous documents; see :meth:`HeadwiseMLSTM.chunkwise`)."""
    S = start.shape[1]
    t = torch.arange(S, device=start.device)
    ok = (start >= 0).all() & (start <= t).all() & (start <= tau).all() & (tau < S).all()
    s_in, t_in = start.clamp(0, S - 1), tau.clamp(0, S - 1)  # in range for the gathers (ok is False otherwise)
    ok = ok & (start[:, 1:] >= start[:, :-1]).all() & (tau[:, 1:] >= tau[:, :-1]).all()
    return ok & (start.gather(1, s_in) == start).all() & (start.gather(1, t_in) == start).all()


def readout_times(doc_ids: Tensor | None, B: int, S: int, window: int, device=None) -> tuple[Tensor, Tensor]:
    """(start, tau), both (B, S) int64: document start of every token and its read-out time.

    ``tau_t = min(t + window, end_t - 1)``. Documents are maximal runs of equal ``doc_ids``
    (padding runs included: their scores are finite and unused); ``doc_ids=None``: one document.
    """
    if doc_ids is None:
        t = torch.arange(S, device=device).expand(B, S)
        return torch.zeros_like(t), (t + window).clamp(max=S - 1)
    start, end = document_spans(doc_ids)
    t = torch.arange(S, device=doc_ids.device).expand(B, S)
    return start, torch.minimum(t + window, end - 1)


class MLSTMScorer(nn.Module):
    """KVpop: the delayed mLSTM scorers of every layer and the decay (interface of ``MLPScorer``)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, d_k: int = 16, d_v: int = 16, forget_gate: ForgetGate = "sigmoid",
                 chunk: int | None = None, form: TrainingForm = "chunkwise", recency: float = 0.0, recency_space: str = "log"):
        super().__init__()
        if form not in ("chunkwise", "parallel"):
            raise ValueError(f"form must be 'chunkwise' or 'parallel', got {form!r}")
        self.config = dict(
            kind="mlstm", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            d_k=d_k, d_v=d_v, forget_gate=forget_gate, recency=recency, recency_space=recency_space,
        )
        # how raw_scores computes (speed/memory, not model settings; both forms give the same scores):
        # form "chunkwise" (linear in S): chunk = tokens of the time axis per chunk (Lc); None: by device,
        # CHUNK_CUDA on CUDA, where the chunk loop is launch-bound (an H200, forward + backward of one
        # layer at S = 4,096: 0.131 s at Lc = 256, 0.017 s at 2,048; bench/kernels/bench_mlstm.py), CHUNK_CPU on
        # the CPU, where it is compute-bound and the work grows as S (Lc + window); memory O((Lc + window) Lc);
        # form "parallel" (the quadratic reference twin): chunk = read-out tokens per chunk
        self.form, self.chunk = form, chunk
        self.layers = nn.ModuleList(HeadwiseMLSTM(num_kv_heads, head_dim, d_k, d_v, forget_gate) for _ in range(num_layers))
        self.decay = LearnedDecay(num_layers, num_kv_heads, recency=recency, space=recency_space)

    def state_numbers(self) -> int:
        """Numbers of recurrent state per (layer, KV head): C + n + m."""
        return state_numbers(self.config["d_k"], self.config["d_v"])

    def raw_scores(self, layer: int, k: Tensor, v: Tensor, *, doc_ids: Tensor | None = None, pos: Tensor | None = None, window: int) -> Tensor:
        """(B, Hk, S, D) keys and values -> r_hat (B, Hk, S), each token read out at its tau_t.

        ``doc_ids`` (B, S) restarts the memory at every document (``None``: one document per row).
        ``pos`` is accepted for interface symmetry and unused: boundaries come from ``doc_ids``.
        Computed by the chunkwise form (``self.form``; ``"parallel"``: the quadratic reference twin).
        """
        B, _, S, _ = k.shape
        start, tau = readout_times(doc_ids, B, S, window, device=k.device)
        cell = self.layers[layer]
        form = cell.chunkwise if self.form == "chunkwise" else cell.parallel
        chunk = self.chunk or (CHUNK_CUDA if k.is_cuda else CHUNK_CPU)
        return form(k, v, start, tau, chunk=chunk)

    # recurrent API for the decode cache (one layer's state; same layout in every layer)
    def init_state(self, B: int, device=None) -> MLSTMState:
        return self.layers[0].init_state(B, device)

    def step(self, layer: int, state: MLSTMState, k_t: Tensor, v_t: Tensor, reset: Tensor | None = None) -> MLSTMState:
        """Write token t (k_t, v_t (B, Hk, D)) into ``state``; call it for every token, in order."""
        return self.layers[layer].step(state, k_t, v_t, reset)

    def readout(self, layer: int, state: MLSTMState, k_t: Tensor, v_t: Tensor) -> Tensor:
        """r_hat (B, Hk) of token t when it leaves the window: ``state`` has read tokens up to t + window."""
        return self.layers[layer].readout(state, k_t, v_t)

    def one_layer(self, layer: int) -> MLSTMScorer:
        """Layer ``layer`` as the only layer (index 0) of a view (:func:`kvpop.scorer.layer_view`)."""
        return one_layer_scorer(self, layer)

    def all_layers(self, graph: bool = False) -> MLSTMScorer:
        """Every layer as one layer of ``L x Hk`` heads (:func:`kvpop.scorer.all_layers_scorer`)."""
        return all_layers_scorer(self, graph)


def state_numbers(d_k: int, d_v: int) -> int:
    """Recurrent state per (layer, KV head): C (d_k x d_v) + n (d_k) + m (1) numbers."""
    return d_k * d_v + d_k + 1


def kvpop_k(layout: CacheLayout, head_dim: int, d_k: int = 16, d_v: int = 16) -> int:
    """Long-range slots of the mLSTM variant at the same memory as the MLP variant's ``layout.budget``.

    Accounting per (layer, KV head), in numbers of the cache's dtype:

    * a cached KV entry costs ``2 * head_dim`` (its key and its value);
    * the MLP variant keeps ``budget = sinks + window + k_mlp`` entries and no state, so it costs
      ``2 * head_dim * budget``;
    * the mLSTM variant adds its recurrent state, ``d_k * d_v + d_k + 1`` numbers (C, n, m), i.e.
      ``ceil(state / (2 * head_dim))`` entries' worth, rounded up so it never exceeds the budget.

    Hence ``k = budget - sinks - window - ceil((d_k d_v + d_k + 1) / (2 head_dim))``. (The keys and
    values of the window tokens awaiting their read-out are in the cache already: no extra cost.
    Scorer parameters are shared across sequences and not counted, as for the MLP.)
    """
    state = math.ceil(state_numbers(d_k, d_v) / (2 * head_dim))
    check_budget(layout.budget, layout.sinks, layout.window, state=state)  # at least one long-range slot besides the state
    return layout.budget - layout.sinks - layout.window - state
