"""``kvpop``: the delayed mLSTM scorer per (layer, KV head), plus a learned decay (the paper's main variant).

A token is scored when it leaves the window, by an mLSTM that has by then read the ``window``
tokens after it (:mod:`kvpop.mlstm`). In training the scores come from the parallel form over
whole documents (:meth:`scores`, the chunkwise form with carried state: linear in the row length); at decode time the recurrent state lives in the cache and a
token is scored at its exit (:meth:`step`, :meth:`exit_scores`), a prompt in closed form
(:meth:`prefill`, :meth:`prefill_chunk`). Its state takes the memory of a few long-range slots
(:func:`kvpop.mlstm.kvpop_k`), so at a nominal budget it costs what ``kvpop_mlp`` costs.

Shapes: B batch, Hk KV heads, S sequence, C chunk, R leavers, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvpop.mlstm import MLSTMScorer, kvpop_k
from kvpop.policies.base import Policy, ScorerSpec, Scores


class Kvpop(Policy):
    """``scores`` needs the document boundaries and the window. They come as keyword arguments
    (``scores(layer, keys, values, pos, doc_ids=..., window=...)``) or, for callers that only pass
    ``(layer, keys, values, pos)``, from :meth:`bind` called before the forward; keywords win."""

    name = "kvpop"
    learned = True
    trained = True
    layer_independent = False
    scores_on_exit = True
    chunked_prefill = True

    def __init__(self, scorer: MLSTMScorer, window: int | None = None):
        super().__init__()
        self.scorer = scorer
        self.window = window
        self.doc_ids: Tensor | None = None

    @classmethod
    def build(cls, spec: ScorerSpec) -> Kvpop:
        return cls(MLSTMScorer(spec.num_layers, spec.num_kv_heads, spec.head_dim, d_k=spec.d_k, d_v=spec.d_v, forget_gate=spec.forget_gate,
                               recency=spec.recency, recency_space=spec.recency_space))

    def long_range_slots(self, layout, *, head_dim):
        return kvpop_k(layout, head_dim, d_k=self.scorer.config["d_k"], d_v=self.scorer.config["d_v"])

    def bind(self, *, doc_ids: Tensor | None, window: int | None = None) -> Kvpop:
        """Set the boundaries (B, S) (and window) for the next forward passes; returns self."""
        self.doc_ids = doc_ids
        if window is not None:
            self.window = window
        return self

    def scores(self, layer, keys, values, pos, *, doc_ids: Tensor | None = None, window: int | None = None):
        doc_ids = doc_ids if doc_ids is not None else self.doc_ids
        window = window if window is not None else self.window
        if window is None:
            raise RuntimeError("Kvpop needs the window: pass window= or call bind(...) first")
        if doc_ids is not None and doc_ids.shape != pos.shape:
            raise RuntimeError(f"bound doc_ids {tuple(doc_ids.shape)} do not match pos {tuple(pos.shape)}")
        r_hat = self.scorer.raw_scores(layer, keys, values, doc_ids=doc_ids, pos=pos, window=window)  # (B, Hk, S)
        log_gamma = self.scorer.decay.log_gamma(layer)  # (Hk,)
        return Scores(prio=self.scorer.decay.priority(layer, r_hat, pos), r_hat=r_hat, log_gamma=log_gamma)

    # --- decode: the recurrent form ------------------------------------------------------------
    def init_state(self, layer, B, device):
        return self.scorer.init_state(B, device)  # MLSTMState (C, n, m)

    def step(self, layer, state, k_t, v_t):
        return self.scorer.step(layer, state, k_t, v_t)

    def exit_scores(self, layer, state, k_t, v_t, pos):
        r_hat = self.scorer.readout(layer, state, k_t, v_t)  # (B, Hk)
        p = torch.as_tensor(pos, dtype=torch.int64, device=r_hat.device).reshape(1, 1).expand(r_hat.shape[0], 1)
        return self.scorer.decay.priority(layer, r_hat[..., None], p)[..., 0]

    def prefill_chunk(self, layer, state, keys, values, rk, rv, rpos, tau):
        r_hat, new = self.scorer.layers[layer].chunk(state, keys, values, rk, rv, tau)  # (B, Hk, R)
        p = rpos.view(1, -1).expand(r_hat.shape[0], -1)
        return self.scorer.decay.priority(layer, r_hat, p), new

    def prefill(self, layer, keys, values, pos, *, window):
        """The prompt's priorities by the parallel (training) form over one document, and the state
        after reading the whole prompt, in closed form."""
        prio = self.scores(layer, keys, values, pos, doc_ids=torch.zeros_like(pos), window=window).prio
        cell = self.scorer.layers[layer]
        return prio, cell.absorb(cell.init_state(keys.shape[0], keys.device), keys, values)
