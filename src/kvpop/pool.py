"""The model-wide pool's exact teacher-forced forward, a chunk at a time (``one_pool`` policies).

Under one pool (:mod:`kvpop.decode.one_pool`) a layer's pattern depends on every layer's priorities,
so a single full-sequence forward cannot know its pattern; :func:`kvpop.evaluate.pool_fixed_point`
iterates full forwards until the eviction times stop changing (up to ``ceil((S - budget) / window) + 1``
of them). This module reaches the same times in one pass over the sequence.

Why a chunk's pattern is known before it runs
---------------------------------------------
At query ``p`` the token leaving the window is ``p - window``, and the pool's competition at ``p``
reads only the priorities of tokens ``<= p - window``. For a chunk of queries ``[c, c + C)`` with
``C <= window``, every such token is ``< c + C - window <= c``: written by an earlier chunk. A
priority fixed when its token enters (read from the token's own key and value: ``kvpop_mlp``,
``dbtrimkv``, :class:`kvpop.policies.OnePool`) is therefore known for all of them once the earlier
chunks have run, and the pool's rule gives exactly the eviction times of the chunk's queries: in closed
form for static priorities (:func:`kvpop.selection.global_eviction_times`, right for queries before
``c + window`` whatever the later tokens' placeholders hold), else by the simulation
(:func:`kvpop.selection.global_decaying_eviction_times`, continued from the previous chunk's pool with
``until=c + C``). The chunk then attends under them over the keys of every earlier chunk
(kept per layer, post-RoPE) and its own, and its keys give the next priorities. By induction over
the chunks every query attends to the pattern of the fixed point, which is unique
(:mod:`kvpop.decode.one_pool`, "The fixed point"), so the two agree; the tests check it against the
fixed point and against token-by-token decoding with :class:`kvpop.decode.OnePoolCache`.

A delayed score (``kvpop_pool``: the mLSTM reads token ``j`` out after tokens ``.. j + d``, ``d =``
:meth:`~kvpop.policies.Policy.read_delay` ``< window``) is fixed at ``j + d``, not when ``j`` enters. The
same argument holds with chunks of at most ``window - d`` queries (the default then): the tokens the
chunk's queries compete over are ``< c + C - window``, their scores read tokens ``< c + C - window + d
<= c``, so they were read out by earlier chunks. Each layer's scorer runs as a stream over the chunks
(:meth:`~kvpop.policies.Policy.score_stream`, :class:`kvpop.mlstm.ChunkwiseStream`: its recurrent
state carried from chunk to chunk), and a token's priority is written when the chunk holding ``j + d``
runs; until then its entry is a placeholder, which no query of a chunk that reads it can see (the
closed form is right for queries ``< c - d + window``, at least ``c + C``). A longer chunk is refused.

No query of a chunk reads the priorities its own tokens fix, so a chunk's keys and values are scored after
the chunk, every layer's in one call (:meth:`~kvpop.policies.Policy.all_layers`: each layer's scorer network
stacked along the heads; the mLSTM streamed as one stream of ``L x Hk`` heads) instead of one call per layer:
a chunk's scorer operations no longer grow with the layers. ``stack_layers=False`` scores each layer as it runs
(the twin the tests hold it equal to).

The forward is ``S / C`` model calls of ``C`` tokens (one forward's work plus the prefix's keys, and the
simulation once over the sequence), against the fixed point's up to ``(S - budget) / window + 1`` full
forwards. It runs without gradients: training takes its eviction times and runs one differentiable
forward under them (``global_evict`` of :class:`kvpop.attention.SparseContext`), the same pattern.

Attention of a chunk runs through SDPA with the boolean mask of the one definition of the pattern
(:func:`kvpop.masks.make_eviction_mask_mod`), evaluated as :class:`kvpop.masks.ChunkRows`: ``C x (c + C)`` per head,
what the layers share built once per chunk, one comparison per layer.

Shapes: B batch, H query heads, Hk KV heads, L layers, S sequence, C chunk, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.profiler import record_function

from kvpop.geometry import CacheLayout
from kvpop.masks import ChunkRows
from kvpop.modeling import model_shape
from kvpop.policies import Policy
from kvpop.selection import NEVER, global_decaying_eviction_times, global_eviction_times


@dataclass
class ChunkContext:
    """The attention hook's context for one chunked pass (``kvpop_ctx`` of the model's forward): every
    layer's keys and values so far, the policy's priorities of every token written, and the chunk's
    eviction times. :func:`pool_chunked` drives it; ``attend`` is what each layer calls.

    ``stacked``: the policy's :meth:`~kvpop.policies.Policy.all_layers` view, or None. With it each layer
    only keeps its chunk's keys and values, and :meth:`score_chunk` scores every layer's after the chunk in
    one call (no query of the chunk reads them: module docstring); without it (or ``stack_layers=False``,
    the reference twin) each layer scores its own as it runs."""

    policy: Policy
    doc_ids: Tensor  # (B, S) int, -1 on padding
    pos: Tensor  # (B, S) position inside the document
    layout: CacheLayout
    num_layers: int
    stacked: Policy | None = None
    start: int = 0  # the chunk's first query
    evict: Tensor | None = None  # (L, B, Hk, S) eviction times, right for the chunk's queries
    prio: Tensor | None = None  # (L, B, Hk, S) float64 priorities of the tokens written so far (0 beyond)
    keys: dict[int, Tensor] = field(default_factory=dict)  # layer -> (B, Hk, start + C, D)
    values: dict[int, Tensor] = field(default_factory=dict)
    streams: dict[int, object] = field(default_factory=dict)  # a delayed scorer (read_delay): layer -> its score stream (-1: the stacked one)
    pending: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # stacked: layer -> the chunk's (k, v) (B, Hk, C, D)
    rows: ChunkRows | None = None  # the chunk's mask, factored (kvpop.masks.ChunkRows); None until its first layer

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q (B, H, C, D), k, v (B, Hk, C, D) of the chunk -> attention output (B, C, H, D)."""
        B, H, C, _ = q.shape
        Hk, c = k.shape[1], self.start
        S = self.doc_ids.shape[1]
        if self.prio is None:
            self.prio = torch.zeros(self.num_layers, B, Hk, S, dtype=torch.float64, device=k.device)
        if self.stacked is not None:
            self.pending[layer] = (k, v)
        else:
            with torch.autocast(device_type=k.device.type, enabled=False), record_function("pool/scores"):  # scorers compute in fp32
                p, r0, read = self._score(self.policy, layer, k.float(), v.float())
                self._write(self.prio[layer], p, r0, read)
        if c:
            k = torch.cat([self.keys[layer], k], 2)
            v = torch.cat([self.values[layer], v], 2)
        self.keys[layer], self.values[layer] = k, v  # (B, Hk, c + C, D)
        evict = self.evict[layer] if self.evict is not None else torch.full((B, Hk, S), NEVER, dtype=torch.int64, device=k.device)
        with record_function("pool/mask"):
            if self.rows is None:  # the chunk's first layer: what every layer shares
                self.rows = ChunkRows(self.doc_ids, self.pos, start=c, length=C, kv_len=c + C, sinks=self.layout.sinks)
            allowed = self.rows.allowed(evict, H // Hk)  # (B, H, C, c + C)
        with record_function("pool/attention"):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()

    def score_chunk(self) -> None:
        """``stacked``: score the chunk's keys and values of every layer in one call (module docstring), into ``prio``."""
        if self.stacked is None:
            return
        L = self.num_layers
        B, Hk, C, D = self.pending[0][0].shape
        with torch.autocast(device_type=self.prio.device.type, enabled=False), record_function("pool/scores"):
            k = torch.stack([self.pending[i][0] for i in range(L)], 1).view(B, L * Hk, C, D).float()  # (B, L x Hk, C, D), layer by layer
            v = torch.stack([self.pending[i][1] for i in range(L)], 1).view(B, L * Hk, C, D).float()
            p, r0, read = self._score(self.stacked, -1, k, v)  # (B, L x Hk, R)
            self._write(self.prio.permute(1, 0, 2, 3), p.view(B, L, Hk, -1), r0, read)  # prio as (B, L, Hk, S)
        self.pending.clear()

    def _score(self, policy: Policy, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, int, Tensor | None]:
        """The priorities that the chunk's keys and values k, v (B, h, C, D) fix: (prio (B, h, R) float64 of tokens
        ``r0 .. r0 + R - 1``, r0, read (B, R) bool or None: all of them). A score fixed from the token itself: the
        chunk's tokens; a delayed one: the tokens whose read-out time falls in the chunk, ``read`` (module docstring).
        ``layer`` -1: the stacked view (its layer 0, every layer's heads)."""
        c, C, index = self.start, k.shape[2], max(layer, 0)
        if self.policy.read_delay(self.layout.window) is None:  # fixed from the token itself
            p = policy.scores(index, k, v, self.pos[:, c : c + C], doc_ids=self.doc_ids[:, c : c + C], window=self.layout.window).prio
            return p.detach().double(), c, None
        if layer not in self.streams:
            self.streams[layer] = policy.score_stream(index, self.doc_ids, self.pos, window=self.layout.window)
        p, r0, read = self.streams[layer].feed(k, v)
        return p.detach().double(), r0, read

    @staticmethod
    def _write(prio: Tensor, p: Tensor, r0: int, read: Tensor | None) -> None:
        """prio (B, ..., S) a view of the priorities; p (B, ..., R) those of tokens ``r0 ..``; read (B, R): which to write (None: all)."""
        dst = prio[..., r0 : r0 + p.shape[-1]]
        if read is not None:
            p = torch.where(read.view(read.shape[0], *[1] * (p.dim() - 2), read.shape[1]), p, dst)
        dst.copy_(p)


def check_policy_layout(policy: Policy, layout: CacheLayout, *, head_dim: int) -> None:
    """A ValueError where ``layout`` is not the one ``policy`` runs with (:meth:`kvpop.geometry.CacheLayout.for_policy`:
    its long-range slots, fewer for a recurrent state, and its per-head floor): a nominal layout passed for such a
    policy would rank its pool with the wrong slot count or floor, silently."""
    if (want := layout.for_policy(policy, head_dim=head_dim)) != layout:
        raise ValueError(f"policy {policy.name!r} runs with long_range {want.long_range} and floor {want.floor}, the layout has "
                         f"{layout.long_range} and {layout.floor}: pass layout.for_policy(policy, head_dim=...)")


# A 4-D ``attention_mask`` that transformers passes through as it is (``masking_utils``: a 4-D mask is taken as already
# prepared), and the chunk context ignores: the pattern is the context's. Without one, the model looks for packed rows in
# ``position_ids`` and reads the answer on the host (``find_packed_sequence_indices``): a synchronization per chunk, which
# CUDA-graph capture skips (transformers checks for a capture), so the captured pass would differ from the eager one.
PATTERN_IN_CONTEXT = torch.ones(1, 1, 1, 1, dtype=torch.bool)


@torch.no_grad()
def pool_chunked(model, policy: Policy, input_ids: Tensor, *, layout: CacheLayout, doc_ids: Tensor | None = None,
                 pos: Tensor | None = None, chunk: int | None = None, keep_logits: bool = False, stack_layers: bool = True) -> tuple[Tensor, Tensor | None]:
    """(Eviction times (L, B, Hk, S) int64, logits (B, S, V) float32 under them if ``keep_logits``, else None)
    of a ``one_pool`` policy whose priorities are fixed when a token enters (or ``d < window`` tokens later,
    :meth:`~kvpop.policies.Policy.read_delay`), on B rows (B, S): the fixed
    point of :func:`kvpop.evaluate.pool_fixed_point`, reached in ``S / chunk`` chunks (module docstring).

    ``doc_ids``, ``pos`` (B, S): packed rows (a new document empties its row's pool); default one
    document per row. ``chunk``: at most ``layout.window - d`` (the default), ``d`` the policy's
    :meth:`~kvpop.policies.Policy.read_delay` (0 for a score fixed when its token enters). ``stack_layers``: score
    a chunk's layers in one call where the policy has an :meth:`~kvpop.policies.Policy.all_layers` view (False: layer
    by layer, the reference twin; the same priorities)."""
    if not policy.one_pool:
        raise ValueError(f"pool_chunked runs one_pool policies, not {policy.name!r}")
    if policy.scores_on_exit or policy.needs_attention:
        raise ValueError(f"{policy.name!r} does not fix a token's priority when it enters: the chunked pool forward does not apply")
    check_policy_layout(policy, layout, head_dim=model_shape(model)["head_dim"])
    B, S = input_ids.shape
    delay = policy.read_delay(layout.window)
    reach = layout.window - (delay or 0)  # the longest exact chunk
    C = reach if chunk is None else chunk
    if not 0 < C <= reach:
        raise ValueError(f"chunk {C} must be in [1, window - delay = {layout.window} - {delay or 0} = {reach}]: a longer chunk would hold "
                         "a query whose leaver's score it writes itself")
    if pos is None:
        pos = torch.arange(S, device=input_ids.device).expand(B, S)
    if doc_ids is None:
        doc_ids = torch.zeros_like(pos)
    ctx = ChunkContext(policy, doc_ids, pos, layout, num_layers=model_shape(model)["num_layers"], stacked=policy.all_layers() if stack_layers else None)
    run, logits = None, []
    geo = dict(sinks=layout.sinks, window=layout.window, long_range=layout.long_range, floor=layout.floor)

    def times(until: int | None) -> Tensor:  # static priorities: the closed form; retentions that decay: the simulation, continued
        nonlocal run
        with record_function("pool/times"):
            if not policy.decays:
                return global_eviction_times(ctx.prio, doc_ids, pos, **geo)
            e, run = global_decaying_eviction_times(ctx.prio, doc_ids, pos, previous=run, until=until, keep_run=True, decays=True, **geo)
            return e

    for c in range(0, S, C):
        if ctx.prio is not None:  # the chunk's queries compete over tokens < c only: their priorities are in
            ctx.evict = times(c + C)
        ctx.start, ctx.rows = c, None
        out = model(input_ids=input_ids[:, c : c + C], position_ids=pos[:, c : c + C], kvpop_ctx=ctx, use_cache=False,
                    attention_mask=PATTERN_IN_CONTEXT, **({} if keep_logits else {"logits_to_keep": 1}))
        ctx.score_chunk()
        if keep_logits:
            logits.append(out.logits.float())
    return times(None).long(), (torch.cat(logits, 1) if keep_logits else None)  # every query's (the last ones included)


class ChunkedGraphs:
    """:func:`pool_chunked`'s eviction times replayed from one CUDA graph per input shape (training's pool pass).

    At the embedded model's size the chunked pass is bound by kernel launches, not arithmetic: about 2,000
    eager operations per chunk (the model's layers, the closed form's times, the scorers), each a launch of
    some 24 microseconds, 16 chunks per 4,096-token row (BENCHMARKS.md, "Training step of the pool's
    policies"). The pass is the same sequence of operations on the same shapes for every row of one shape
    (its Python decides nothing from tensor values), so it is captured once into a CUDA graph and replayed:
    the row is copied into the graph's own input buffers, the replay re-reads the model's and scorer's
    weights where they live (the optimizer updates them in place), and the times are copied out.

    Before capturing, two eager runs on a side stream (the warm-up CUDA graphs need): the first as it comes (lazy
    initialisations, the selection kernels' compiles and autotuning, which synchronize), the second under
    ``torch.cuda.set_sync_debug_mode("error")``: an operation of the steady pass that waits for the host
    (``.item()``, a mask with a data-dependent size) raises there, and this object then says why and runs the
    eager pass from then on (:attr:`fallback`), the same times. Autocast's weight cache is off inside the capture (a cached
    cast would be captured once, its memory outside the graph). Off the GPU, it is :func:`pool_chunked`.

    The graphs read the weights where they were captured: where they have moved since (a module sent to another device
    and back), the graphs are captured again. The eager pass is the twin: ``tests/test_gpu.py -k chunked_graphs`` holds
    the replayed times equal to it on new rows and after the weights change."""

    def __init__(self, model, policy: Policy, *, layout: CacheLayout, chunk: int | None = None, graphs: bool = True, say=None):
        self.model, self.policy, self.layout, self.chunk = model, policy, layout, chunk
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}
        #: why the eager pass runs (``graphs`` False: asked so; else a capture that failed), or None
        self.fallback: str | None = None if graphs else "graphs off"
        self.say = say or (lambda msg: print(msg))
        self._captured_on: tuple[int, ...] = ()  # where the weights were when the graphs were captured

    def _weights(self) -> tuple[int, ...]:
        """The addresses of the model's and the policy's weights (and buffers), which a replay reads."""
        tensors = [*self.model.parameters(), *self.model.buffers(), *self.policy.parameters(), *self.policy.buffers()]
        return tuple(t.data_ptr() for t in tensors)

    def eager(self, input_ids: Tensor, doc_ids: Tensor, pos: Tensor) -> Tensor:
        return pool_chunked(self.model, self.policy, input_ids, layout=self.layout, doc_ids=doc_ids, pos=pos, chunk=self.chunk)[0]

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, *, doc_ids: Tensor, pos: Tensor) -> Tensor:
        """Eviction times (L, B, Hk, S) int64 of rows ``input_ids`` (B, S) with ``doc_ids``, ``pos`` (B, S), as
        :func:`pool_chunked` gives them."""
        if not input_ids.is_cuda or self.fallback is not None:
            return self.eager(input_ids, doc_ids, pos)
        ptrs = self._weights()
        if ptrs != self._captured_on:  # weights moved (a module sent to another device and back): the graphs read the old memory
            self.graphs.clear()
            self._captured_on = ptrs
        amp = torch.is_autocast_enabled("cuda")
        key = (tuple(input_ids.shape), amp, torch.get_autocast_dtype("cuda") if amp else None)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._capture(input_ids, doc_ids, pos, amp)
            except RuntimeError as err:  # a host synchronization in the warm-up, or the capture refused
                self.fallback = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                self.say(f"pool pass: no CUDA graph ({self.fallback}); the eager pass runs")
                return self.eager(input_ids, doc_ids, pos)
        graph, static, out = self.graphs[key]
        static["ids"].copy_(input_ids)
        static["doc"].copy_(doc_ids)
        static["pos"].copy_(pos)
        graph.replay()
        return out.clone()

    def _capture(self, input_ids: Tensor, doc_ids: Tensor, pos: Tensor, amp: bool):
        static = {"ids": input_ids.clone(), "doc": doc_ids.clone(), "pos": pos.clone()}
        dtype = torch.get_autocast_dtype("cuda")

        def run() -> Tensor:
            with torch.autocast("cuda", dtype=dtype, enabled=amp, cache_enabled=False):
                return self.eager(static["ids"], static["doc"], static["pos"])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # lazy initialisations, kernel compiles and autotuning (these may synchronize)
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                run()  # the steady pass: a host synchronization raises here, before anything is captured
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # the loader's pin-memory thread may use CUDA meanwhile
            out = run()
        return graph, static, out
