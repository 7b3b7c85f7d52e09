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

Parallel form (``raw_scores``, training), with ``F_j = sum_{u <= j} log f_u`` and
``log D[t, s] = F_{tau_t} - F_s + i~_s`` for ``start_t <= s <= tau_t`` (else ``-inf``)::

    m_t = max_s log D[t, s],   D'[t, s] = exp(log D[t, s] - m_t),   W[t, s] = D'[t, s] (q~_t . k~_s)
    h_t = sum_s W[t, s] v~_s / max(|sum_s W[t, s]|, exp(-m_t))

Both forms compute ``exp(-m) C~^T q / max(|n~^T q| exp(-m), exp(-m))`` for the unstabilized
``C~, n~``, so they agree for any stabilizer; the parallel one runs chunked over t (memory
O(chunk x S) per head, with activation checkpointing per chunk when gradients are needed).

Shapes: B batch, Hk KV heads, S sequence, D head dim, L layers; d_k, d_v the memory's dims.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from kvpop.scorer import LearnedDecay
from kvpop.selection import document_spans

ForgetGate = Literal["sigmoid", "exp"]


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

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, d_k: int = 16, d_v: int = 16, forget_gate: ForgetGate = "sigmoid", chunk: int = 256):
        super().__init__()
        self.config = dict(
            kind="mlstm", num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            d_k=d_k, d_v=d_v, forget_gate=forget_gate,
        )
        self.chunk = chunk  # parallel form: read-out tokens per chunk (speed/memory, not a model setting)
        self.layers = nn.ModuleList(HeadwiseMLSTM(num_kv_heads, head_dim, d_k, d_v, forget_gate) for _ in range(num_layers))
        self.decay = LearnedDecay(num_layers, num_kv_heads)

    def state_numbers(self) -> int:
        """Numbers of recurrent state per (layer, KV head): C + n + m."""
        return state_numbers(self.config["d_k"], self.config["d_v"])

    def raw_scores(self, layer: int, k: Tensor, v: Tensor, *, doc_ids: Tensor | None = None, pos: Tensor | None = None, window: int) -> Tensor:
        """(B, Hk, S, D) keys and values -> r_hat (B, Hk, S), each token read out at its tau_t.

        ``doc_ids`` (B, S) restarts the memory at every document (``None``: one document per row).
        ``pos`` is accepted for interface symmetry and unused: boundaries come from ``doc_ids``.
        """
        B, _, S, _ = k.shape
        start, tau = readout_times(doc_ids, B, S, window, device=k.device)
        return self.layers[layer].parallel(k, v, start, tau, chunk=self.chunk)

    # recurrent API for the decode cache (one layer's state; same layout in every layer)
    def init_state(self, B: int, device=None) -> MLSTMState:
        return self.layers[0].init_state(B, device)

    def step(self, layer: int, state: MLSTMState, k_t: Tensor, v_t: Tensor, reset: Tensor | None = None) -> MLSTMState:
        """Write token t (k_t, v_t (B, Hk, D)) into ``state``; call it for every token, in order."""
        return self.layers[layer].step(state, k_t, v_t, reset)

    def readout(self, layer: int, state: MLSTMState, k_t: Tensor, v_t: Tensor) -> Tensor:
        """r_hat (B, Hk) of token t when it leaves the window: ``state`` has read tokens up to t + window."""
        return self.layers[layer].readout(state, k_t, v_t)


def state_numbers(d_k: int, d_v: int) -> int:
    """Recurrent state per (layer, KV head): C (d_k x d_v) + n (d_k) + m (1) numbers."""
    return d_k * d_v + d_k + 1


def kvpop_k(budget: int, sinks: int, window: int, head_dim: int, d_k: int = 16, d_v: int = 16) -> int:
    """Long-range slots of the mLSTM variant at the same memory as the MLP variant's ``budget``.

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
    k = budget - sinks - window - math.ceil(state_numbers(d_k, d_v) / (2 * head_dim))
    if k < 1:
        raise ValueError(f"budget {budget} leaves no long-range slot after sinks {sinks}, window {window} and the mLSTM state")
    return k
