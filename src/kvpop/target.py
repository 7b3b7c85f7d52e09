"""Training target of the eviction scorer: the future attention a token receives.

For a token ``t`` of KV head ``h`` and a query head ``g`` of its group, the mean
future attention is::

    m_t^(g) = (1 / N_t) * sum_{u = t + w}^{S_d - 1} p^(g)_{u -> t},
    p^(g)_{u -> t} = exp(scale * q^(g)_u . k_t - lse^(g)_u),
    N_t = max(1, S_d - t - w),

where ``S_d`` is the exclusive end of ``t``'s document (not of the packed row),
``w`` the recent window and ``lse`` the log-normalizer of each query's attention
(as returned by the student's sparse attention).  The target is the maximum over
the ``G`` query heads sharing KV head ``h`` (query heads ``h*G .. h*G + G-1``)::

    r_tgt(h, t) = max_j log(eps + m_t^(h*G + j)).

Padding tokens and tokens with an empty sum get ``log(eps)``.

Shapes: ``B`` batch, ``H`` query heads, ``Hk`` KV heads, ``G = H / Hk``,
``S`` sequence length, ``D`` head dim.

Two executors compute the column sums ``sum_u p_{u -> t}``:

* ``"chunked"``: plain torch, loops over chunks of query rows ``u``; memory
  ``O(chunk * S)`` per head.  The CPU path.
* ``"flex"``: one *transposed* FlexAttention pass where the keys act as queries
  and the student's queries act as keys; ``score_mod`` subtracts ``lse_u``, so the
  pass's log-sum-exp at row ``t`` is ``log sum_u p_{u -> t}``.  Compiled on CUDA.
"""

from __future__ import annotations

import math

import torch

from kvpop.selection import document_spans

__all__ = ["future_attention_target"]

_compiled_flex_attention = None


def _flex_attention_fn(device: torch.device):
    """``flex_attention``, compiled once per process on CUDA, eager elsewhere."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention


def _column_sums_chunked(q, k, lse, doc_ids, *, window: int, scale: float, chunk: int) -> torch.Tensor:
    """``sum_u p_{u -> t}`` over ``u >= t + w`` of the same document, plain torch.

    Args:
        q: ``(B, H, S, D)``; k: ``(B, Hk, S, D)``; lse: ``(B, H, S)``; doc_ids: ``(B, S)``.

    Returns:
        ``(B, H, S)`` float64.
    """
    B, H, S, D = q.shape
    Hk = k.shape[1]
    G = H // Hk
    q = (scale * q.float()).reshape(B, Hk, G, S, D)
    k_t = k.float().transpose(-1, -2)  # (B, Hk, D, S)
    lse = lse.float().reshape(B, Hk, G, S)
    idx = torch.arange(S, device=q.device)
    doc_start = document_spans(doc_ids)[0].amin(dim=0).tolist()  # (S,) min over the batch
    sums = torch.zeros(B, Hk, G, S, dtype=torch.float64, device=q.device)
    for u0 in range(window, S, chunk):
        u1 = min(u0 + chunk, S)
        # Keys receiving attention from this chunk: same document (t >= start of
        # u0's document) and t <= u - w.
        t0, t1 = doc_start[u0], u1 - window
        u, t = idx[u0:u1], idx[t0:t1]
        # (B, cu, ct): causal-with-window, same document, key not padding.
        allowed = (u[:, None] >= t[None, :] + window) & (doc_ids[:, u0:u1, None] == doc_ids[:, None, t0:t1])
        allowed &= doc_ids[:, None, t0:t1] >= 0
        p = q[:, :, :, u0:u1] @ k_t[..., t0:t1].unsqueeze(2)  # (B, Hk, G, cu, ct) logits
        p.sub_(lse[:, :, :, u0:u1, None]).masked_fill_(~allowed[:, None, None], -math.inf).exp_()
        sums[..., t0:t1] += p.sum(dim=-2)  # float32 within a chunk, float64 across chunks
    return sums.view(B, H, S)


def _column_sums_flex(q, k, lse, doc_ids, *, window: int, scale: float) -> torch.Tensor:
    """``sum_u p_{u -> t}`` via one transposed FlexAttention pass (see module doc).

    Returns:
        ``(B, H, S)`` float32.
    """
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask

    B, H, S, D = q.shape
    G = H // k.shape[1]
    doc = doc_ids.to(torch.int32).contiguous()
    lse = lse.float().contiguous()

    # Transposed roles: "query" index = key token t, "kv" index = query token u.
    def mask_mod(b, h, t, u):
        return (u >= t + window) & (doc[b, u] == doc[b, t]) & (doc[b, t] >= 0)

    def score_mod(score, b, h, t, u):
        return score - lse[b, h, u]

    block_mask = create_block_mask(mask_mod, B, None, S, S, device=q.device)
    # Inputs keep their dtype: flex multiplies bf16/fp16 operands exactly and
    # accumulates scores and the LSE in float32 (an fp32 upcast would only make
    # the kernel much slower on CUDA).
    keys_as_queries = k.repeat_interleave(G, dim=1)  # (B, H, S, D)
    values = q.new_zeros(B, H, S, 16)  # only the LSE is used
    flex = _flex_attention_fn(q.device)
    _, aux = flex(
        keys_as_queries,
        q,
        values,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        return_aux=AuxRequest(lse=True),
    )
    # aux.lse is the natural-log LSE; rows with no allowed u give -inf (-> 0).
    return torch.nan_to_num(aux.lse.exp(), nan=0.0)


@torch.no_grad()
def future_attention_target(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    window: int,
    scale: float,
    eps: float = 1e-6,
    impl: str = "auto",
    chunk: int = 1024,
) -> torch.Tensor:
    """Log mean future attention received by every token, max over each GQA group.

    Args:
        q: ``(B, H, S, D)`` student queries.
        k: ``(B, Hk, S, D)`` student keys.
        lse: ``(B, H, S)`` natural-log normalizer of each query's attention.
        doc_ids: ``(B, S)`` int document ids (contiguous runs, ``-1`` = padding).
        window: recent window ``w``; query ``u`` counts for token ``t`` iff ``u >= t + w``.
        scale: softmax scale applied to ``q . k``.
        eps: floor inside the log.
        impl: ``"flex"``, ``"chunked"`` or ``"auto"`` (flex on CUDA, chunked otherwise).
        chunk: query rows per step of the chunked executor.

    Returns:
        ``(B, Hk, S)`` float32 targets ``r_tgt``.
    """
    B, H, S, _ = q.shape
    Hk = k.shape[1]
    if H % Hk:
        raise ValueError(f"H={H} is not a multiple of Hk={Hk}")
    if impl == "auto":
        impl = "flex" if q.is_cuda else "chunked"
    if impl == "chunked":
        sums = _column_sums_chunked(q, k, lse, doc_ids, window=window, scale=scale, chunk=chunk)
    elif impl == "flex":
        sums = _column_sums_flex(q, k, lse, doc_ids, window=window, scale=scale)
    else:
        raise ValueError(f"unknown impl {impl!r}")

    _, end = document_spans(doc_ids)
    idx = torch.arange(S, device=q.device)
    n_queries = (end - idx - window).clamp(min=1)  # (B, S)
    m = sums.double() / n_queries[:, None, :]
    m = torch.where((doc_ids >= 0)[:, None, :], m, 0.0)
    r = torch.log(eps + m).view(B, Hk, H // Hk, S).amax(dim=2)
    return r.float()
