"""``kvpop_pool``: the delayed mLSTM scorer (``kvpop``'s) under one pool of slots for the whole model, trained in it.

What it reads
-------------
Per (layer, KV head) the mLSTM of :mod:`kvpop.mlstm` over the detached keys and values of a document;
token ``j`` is scored against the memory after it has read tokens ``start_j .. j + d`` (clipped at its
document's last token), with a **delay** ``0 <= d < window`` (``train.scorer_delay``; default
``window // 4``, the best of 0, 64 and 128 in a frozen-teacher fit, BENCHMARKS.md), not ``kvpop``'s
``d = window``. Its priority (with the learned decay) is static
from then on, and ranked as ``kvpop_mlp_pool``'s: one pool of ``L x Hk x k`` long-range entries, the
``L x Hk`` leavers of query ``p`` (token ``p - window``) against the pool's entries, the lowest go
(:mod:`kvpop.decode.one_pool`). Its state costs slots as ``kvpop``'s (:func:`kvpop.mlstm.kvpop_k`).

Why the delay must be below the window (and what it buys)
----------------------------------------------------------
Under one pool, layer 0's pattern at query ``p`` depends on every layer's priorities of the tokens
``<= p - window``. With ``d = window`` the leaver ``p - window`` is scored from the keys up to ``p``,
i.e. from the keys of the current chunk in every layer, while those keys depend on the pattern at
``p`` in the layers below: a chunked forward could not know its pattern before running it. With
``d < window``:

* *Chunked forward* (:func:`kvpop.pool.pool_chunked`, chunks of at most ``window - d`` queries,
  the default): a query ``p`` of chunk ``[c0, c1)`` with ``c1 - c0 <= window - d`` competes over the
  tokens ``j <= p - window <= c1 - 1 - window``, whose scores read tokens up to
  ``j + d <= c1 - 1 - (window - d) < c0``: written, and read out, by earlier chunks
  (:class:`kvpop.mlstm.ChunkwiseStream` carries each layer's mLSTM state from chunk to chunk and reads
  token ``j`` out in the chunk that holds ``j + d``). So the chunk's eviction times are known before
  it runs, exactly, and by induction over the chunks every query attends to the fixed point's pattern.
* *Fixed point* (:func:`kvpop.evaluate.pool_fixed_point`): if an iteration's times are right for
  queries ``< T``, its forward scores right every token with ``j + d < T`` and its simulation gives
  the right times for queries ``< T + window - d``: the ``(window - d)``-step version of
  :mod:`kvpop.decode.one_pool`'s argument, within ``ceil((S - budget) / (window - d)) + 1`` forwards.
* *Decoding* (:class:`kvpop.decode.OnePoolCache`): each layer's mLSTM state reads every token as it
  enters; at step ``p`` it reads out token ``p - d`` (still in the ring: ``d < window``), whose score
  is then ready ``window - d`` steps before the token leaves the window at ``p - d + window``.

Reading the state at ``j + d`` *is* this definition (the chunkwise, parallel and recurrent forms
compute the same read-out, :mod:`kvpop.mlstm`); any ``d < window`` is exact, ``d = 0`` scores a
token from its prefix alone. A larger ``d`` lets the score see more of what follows the token; the
chunked forward then takes ``S / (window - d)`` model calls instead of ``S / window``.

Trained as ``kvpop_mlp_pool`` (:mod:`kvpop.policies.kvpop_mlp_pool`): each step a no-grad
:func:`kvpop.pool.pool_chunked` gives every layer's eviction times under the current scorer, the
differentiable forward runs under them (the model's KL under the pool's pattern), and the scorer's
loss is the pool's boundary loss (:func:`kvpop.boundary.pool_boundary_loss`).

Shapes: B batch, Hk KV heads, S sequence, R read-out tokens, D head dim.
"""

from __future__ import annotations

from torch import Tensor

from kvpop.mlstm import ChunkwiseStream, MLSTMScorer, readout_times
from kvpop.policies.base import ScorerSpec
from kvpop.policies.kvpop import Kvpop


def check_delay(delay: int, window: int, *, key: str = "delay") -> int:
    """``delay`` if ``0 <= delay < window`` (a score ready before its token leaves the window), else a
    ValueError naming ``key``, the delay and the window."""
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < window:
        raise ValueError(
            f"{key} {delay!r} is not in [0, window - 1 = {window - 1}] (window {window}): the delayed mLSTM under one pool must "
            "score a token before it leaves the window (kvpop.policies.kvpop_pool)"
        )
    return delay


def resolve_delay(delay: int | None, window: int, *, key: str = "delay") -> int:
    """The read-out delay at ``window``: ``delay``, or ``window // 4`` for None; checked by :func:`check_delay`."""
    return check_delay(window // 4 if delay is None else delay, window, key=key)


class PoolScoreStream:
    """One layer's scores in a chunked forward (:meth:`KvpopPool.score_stream`): :meth:`feed` the chunks
    in order, get the priorities of the tokens read out in each."""

    def __init__(self, policy: KvpopPool, layer: int, stream: ChunkwiseStream, pos: Tensor):
        self.policy, self.layer, self.stream, self.pos = policy, layer, stream, pos

    def feed(self, keys: Tensor, values: Tensor) -> tuple[Tensor, int, Tensor]:
        """The next chunk's keys, values (B, Hk, C, D) -> (priority (B, Hk, R) float64 of tokens
        ``r0 .. r0 + R - 1``, r0, read (B, R) bool: which of them were scored now; the others' values
        are placeholders)."""
        r_hat, r0, read = self.stream.feed(keys, values)
        prio = self.policy.scorer.decay.priority(self.layer, r_hat, self.pos[:, r0 : r0 + r_hat.shape[-1]])
        return prio, r0, read


class KvpopPool(Kvpop):
    """``delay``: tokens after ``j`` that token ``j``'s score reads (None: a quarter of the window it runs at)."""

    name = "kvpop_pool"
    one_pool = True
    scores_on_exit = False  # scored at j + d, before it leaves (read_delay), from the same recurrent hooks
    chunked_prefill = False

    def __init__(self, scorer: MLSTMScorer, delay: int | None = None):
        super().__init__(scorer)
        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, int) or delay < 0):
            raise ValueError(f"kvpop_pool: the delay must be an int >= 0 (tokens read after the scored one), got {delay!r}")
        self.delay = delay

    @classmethod
    def build(cls, spec: ScorerSpec) -> KvpopPool:
        return cls(MLSTMScorer(spec.num_layers, spec.num_kv_heads, spec.head_dim, d_k=spec.d_k, d_v=spec.d_v, forget_gate=spec.forget_gate,
                               recency=spec.recency, recency_space=spec.recency_space), delay=spec.delay)

    def read_delay(self, window: int) -> int:
        return resolve_delay(self.delay, window, key="kvpop_pool's delay")

    def scores(self, layer, keys, values, pos, *, doc_ids: Tensor | None = None, window: int | None = None):
        """As ``kvpop``'s, each token read out at ``min(j + d, end_j - 1)``; ``window`` is the layout's (d from it)."""
        window = window if window is not None else self.window
        if window is None:
            raise RuntimeError("KvpopPool needs the window: pass window= or call bind(...) first")
        return super().scores(layer, keys, values, pos, doc_ids=doc_ids, window=self.read_delay(window))

    def score_stream(self, layer: int, doc_ids: Tensor, pos: Tensor, *, window: int) -> PoolScoreStream:
        B, S = doc_ids.shape
        d = self.read_delay(window)
        start, tau = readout_times(doc_ids, B, S, d, device=doc_ids.device)
        return PoolScoreStream(self, layer, ChunkwiseStream(self.scorer.layers[layer], start, tau, delay=d), pos)
