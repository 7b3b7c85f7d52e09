"""One pool of long-range entries for every layer and KV head (``one_pool`` policies: ``dbtrimkv``, ``OnePool(...)``).

Per layer and KV head a policy keeps the ``sinks`` first tokens, the ``window`` most recent ones and
``k`` long-range tokens. With one pool, the long-range entries of *all* layers and KV heads live
together: ``P = L x Hk x k`` entries, each tagged with its token's position and its pair ``f = layer
* Hk + head``. Total entries: ``budget x L x Hk``, as for every policy; how they split between layers
and heads is the policy's choice (:meth:`OnePoolCache.occupancy`). At query ``p`` token ``p - window``
leaves the window of every layer and head: the ``L x Hk`` leavers and the pool's entries compete by
their rank at ``p`` (a decaying retention ``(p - i) * log beta``, ``dbtrimkv``; else the static
priority, :class:`kvpop.policies.OnePool`), and the ``L x Hk`` lowest go
(:func:`kvpop.selection.pool_leavers`, with its tie rules).

The fixed point (the argument every other docstring refers to)
---------------------------------------------------------------
A layer's pattern depends on every layer's priorities, and a later layer's priorities on the earlier
layers' patterns, so a teacher-forced forward cannot compute the pattern layer by layer. It is the
fixed point of "forward under eviction times E, recording every layer's priorities; simulate the
pool on them (:func:`kvpop.selection.global_decaying_eviction_times`) to get the next E", started
from no eviction (:func:`kvpop.evaluate.pool_fixed_point`). Why it exists, is unique, is reached and
equals decoding:

1. *Causality.* The priority of token ``i`` reads only the hidden states at positions ``<= i``
   (fixed when the token enters; an oracle's are fixed per trace and read no pattern at all), so it
   depends only on the patterns at queries ``<= i``. The pattern at query ``t`` reads only the
   priorities of tokens that have left the window, ``<= t - window``.
2. *Induction.* If an iteration's times are right for queries ``< T``, its forward gives the right
   priorities for tokens ``< T`` and its simulation the right times for queries ``< T + window``.
   Nothing is evicted before the pool is full (query ``budget = sinks + window + k``), so the first
   iteration (no eviction) is right for queries ``< budget``. Hence the fixed point is unique, and the
   ``ceil((S - budget) / window) + 1``-th forward at the latest finds the times unchanged (a trace of
   at most ``budget`` tokens: the first). A simulation re-runs only from the first token whose
   priority changed (``previous=`` of :func:`kvpop.selection.global_decaying_eviction_times`).
3. *Decoding.* :class:`OnePoolCache` takes the tokens in order: at token ``p`` it runs the
   competition for the leaver ``p - window`` (at layer 0, before any layer writes token ``p``) with
   the rule of the simulation, on the priorities each entry got when it entered, then every layer
   attends over its sinks, ring and pool entries. By induction over ``p`` those priorities are the
   fixed point's (1.), so each query attends to the fixed point's pattern, and the logits agree up to
   float rounding (``tests/test_dbtrimkv.py`` and ``tests/test_one_pool.py`` on the CPU,
   ``tests/test_gpu.py`` with FlexAttention). An oracle reads the trace's future and is never decoded.

The priorities must be computable from the token itself: the delayed mLSTM (``kvpop``) scores a
token from its whole window, which breaks 1., so :class:`kvpop.policies.OnePool` refuses it. A score
that reads ``d < window`` tokens past its own (``kvpop_pool``,
:meth:`~kvpop.policies.Policy.read_delay`) keeps the argument with ``window - d`` for ``window``: the
priority of ``i`` reads positions ``<= i + d``, the pattern at ``t`` the tokens ``<= t - window``, so
an iteration right below ``T`` is right below ``T + window - d`` (:mod:`kvpop.policies.kvpop_pool`).
The cache then keeps each layer's recurrent state, reads every token into it as it enters and reads
token ``p - d`` out at step ``p``, ``window - d`` steps before it leaves (:meth:`PoolLayer._read_out`).

The cache
---------
The reference cache of the pool, the decoding twin of the simulation. Per layer and KV head it keeps
the ``sinks`` first tokens and a ring over the ``window`` most recent ones, as
:class:`kvpop.decode.BoundedCache` does (:class:`PoolLayer`); the long-range entries in the pool.

Prefill: a prompt of at most ``budget`` tokens (a stateful policy's slots: its nominal budget less
the state's, :func:`kvpop.mlstm.kvpop_k`) fills no pool beyond its size, so nothing is evicted
in it: it attends causally and its tokens past the window go to the pool. A longer prompt must be
fed one token at a time after its first ``budget`` (:func:`kvpop.decode.generate` and
:func:`kvpop.decode.teacher_forced_logits` do): a layer's evictions depend on every later layer.

Memory, as :class:`kvpop.decode.BoundedCache` (never more entries than a dense cache): each ring
holds ``min(R, tokens)`` slots (``max_len`` allocates them at once), and the pool holds only the
entries that have left the windows, ``L x Hk`` more per token until it reaches ``P``. A competition
whose pool is not full keeps every candidate; once the candidates outnumber ``P`` the lowest go, as
many as exceed it. That is the selection over a pool of ``P`` entries whose missing ones are empty
(an empty entry goes first), so the order of the entries changes, not which ones are kept.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, R = sinks + window ring slots, P pool
entries, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F
from transformers.cache_utils import CacheLayerMixin

from kvpop.decode.cache import BoundedCache, grow_slots
from kvpop.geometry import NEG_INF
from kvpop.selection import pool_leavers


class PoolLayer(CacheLayerMixin):
    """One layer's sinks and ring, (B, Hk, R, D) keys and values with their log beta and position;
    its long-range entries are in the cache's pool."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, cache: OnePoolCache):
        super().__init__()
        self.layer_idx, self.cache = layer_idx, cache
        self.seen = 0
        self._pending: tuple | None = None
        self.delay: int | None = None  # read_delay of the policy (set with the buffers)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, Hk, S, D = key_states.shape
        R = min(self.cache.sinks + self.cache.window, max(S, self.cache.max_len or 0))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(B, Hk, R, D)
        self.values = value_states.new_zeros(B, Hk, R, value_states.shape[-1])
        self.lb = torch.zeros(B, Hk, R, dtype=torch.float64, device=self.device)  # log beta
        self.pos = torch.full((B, Hk, R), -1, dtype=torch.int64, device=self.device)
        self.delay = self.cache.policy.read_delay(self.cache.window)  # a delayed score (kvpop_pool): its recurrent state
        if self.delay is not None:
            self.state = self.cache.policy.init_state(self.layer_idx, B, self.device)
        self.is_initialized = True
        self.cache._allocate_pool(key_states, value_states)

    def _reserve(self, tokens: int) -> None:
        """Hold at least ``min(R, tokens)`` ring slots (the module docstring: memory)."""
        R = self.cache.sinks + self.cache.window
        self.keys, self.values, self.lb, self.pos = grow_slots((self.keys, self.values, self.lb, self.pos), min(R, tokens), (0.0, 0.0, 0.0, -1))

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError("OnePoolCache: the previous step's attention did not run through the cache; call kvpop.decode.enable(model)")
        S = key_states.shape[-2]
        c = self.cache
        if self.delay is None:
            lb = c.policy.token_scores(self.layer_idx, key_states, value_states, torch.arange(self.seen, self.seen + S, device=self.device)[None])
        elif self.seen == 0:  # the prompt's priorities, exact for j + delay <= S - 1 (the others: read out again at j + delay), and the state
            with torch.no_grad():
                pos = torch.arange(S, device=self.device).expand(key_states.shape[0], S)
                lb, self.state = c.policy.prefill(self.layer_idx, key_states, value_states, pos, window=c.window)
        else:
            lb = torch.full(key_states.shape[:3], float("nan"), dtype=torch.float64, device=self.device)  # read out at p + delay
        if self.seen == 0:
            if S > c.max_prefill:
                raise NotImplementedError(
                    f"OnePoolCache: a {S}-token prompt is longer than the budget ({c.max_prefill}); feed the first {c.max_prefill} "
                    "at once and the rest one at a time (kvpop.decode.feed, generate and teacher_forced_logits do)"
                )
            self._reserve(S)
            self._prefill_store(key_states, value_states, lb)
            self._pending = ("prefill", key_states, value_states)
            return key_states, value_states
        if S != 1:
            raise NotImplementedError(f"OnePoolCache: a {S}-token forward on a non-empty cache is not supported; feed tokens one at a time")
        p = self.seen
        self._reserve(p + 1)
        if self.layer_idx == 0:
            c._compete(p)  # token p - window leaves every layer's window: before any layer overwrites it
        slot = c.layout.home_slot(p)
        self.keys[:, :, slot] = key_states[:, :, 0]
        self.values[:, :, slot] = value_states[:, :, 0]
        self.lb[:, :, slot] = lb[:, :, 0]
        self.pos[:, :, slot] = p
        self.seen = p + 1
        if self.delay is not None:
            self._read_out(p, key_states[:, :, 0], value_states[:, :, 0])
        self._pending = ("decode",)
        return key_states, value_states

    @torch.no_grad()
    def _read_out(self, p: int, k: Tensor, v: Tensor) -> None:
        """A delayed score: the state reads token p (k, v (B, Hk, D)), then token ``j = p - delay`` gets its
        priority from it (still in the ring: ``delay < window``), ``window - delay`` steps before it leaves."""
        c = self.cache
        self.state = c.policy.step(self.layer_idx, self.state, k, v)
        j = p - self.delay
        if j >= c.sinks:  # sinks never compete
            slot = c.layout.home_slot(j)
            self.lb[:, :, slot] = c.policy.exit_scores(self.layer_idx, self.state, self.keys[:, :, slot], self.values[:, :, slot], j)

    @torch.no_grad()
    def _prefill_store(self, k: Tensor, v: Tensor, lb: Tensor) -> None:
        """A prompt k, v (B, Hk, S, D) of at most ``budget`` tokens: sinks and the last ``window`` tokens
        into the ring, the tokens between into the pool (all fit: nothing is evicted). The pool takes
        ``n`` entries per layer and KV head (``L x Hk x n``, layer 0 sizes it), pair ``f`` at ``[f n, (f + 1) n)``."""
        c, S = self.cache, k.shape[2]
        fixed = c.layout.fixed_tokens(S, k.device)  # (m,) sinks and window
        slots = c.layout.home_slot(fixed)
        self.keys[:, :, slots], self.values[:, :, slots], self.lb[:, :, slots] = k[:, :, fixed], v[:, :, fixed], lb[:, :, fixed]
        self.pos[:, :, slots] = fixed
        past = torch.arange(c.sinks, max(c.sinks, S - c.window), device=k.device)  # (n,) tokens that left the window
        n, Hk = past.numel(), k.shape[1]
        if self.layer_idx == 0:
            c._allocate_pool(k, v, entries=c.num_layers * Hk * n)
        if n:
            dst = (self.layer_idx * Hk + torch.arange(Hk, device=k.device))[:, None] * n + torch.arange(n, device=k.device)  # (Hk, n)
            c.pool_keys[:, dst] = k[:, :, past]
            c.pool_values[:, dst] = v[:, :, past]
            c.pool_lb[:, dst] = lb[:, :, past]
            c.pool_pos[:, dst] = past
            c.pool_f[:, dst] = (self.layer_idx * Hk + torch.arange(Hk, device=k.device))[:, None]
        self.seen = S

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("OnePoolCache.attend without a preceding update")
        if pending[0] == "prefill":  # no eviction inside a prompt of at most `budget` tokens
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
        c = self.cache
        B, H, _, D = q.shape
        Hk = self.keys.shape[1]
        qg = q.reshape(B, Hk, H // Hk, D).float()  # query head h reads KV head h // G
        ring = torch.einsum("bhgd,bhtd->bhgt", qg, self.keys.float()) * scale  # (B, Hk, G, R)
        ring = ring.masked_fill(self.pos[:, :, None, :] < 0, NEG_INF)
        pool = torch.einsum("bhgd,bpd->bhgp", qg, c.pool_keys.float()) * scale  # (B, Hk, G, P)
        mine = (c.pool_pos[:, None, :] >= 0) & (c.pool_f[:, None, :] == self.layer_idx * Hk + torch.arange(Hk, device=q.device)[None, :, None])
        pool = pool.masked_fill(~mine[:, :, None, :], NEG_INF)
        attn = torch.cat([ring, pool], -1).softmax(-1)
        R = ring.shape[-1]
        out = torch.einsum("bhgt,bhtd->bhgd", attn[..., :R], self.values.float())
        out = out + torch.einsum("bhgp,bpd->bhgd", attn[..., R:], c.pool_values.float())  # (B, Hk, G, D)
        return out.to(q.dtype).reshape(B, 1, H, -1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            self.pos.fill_(-1)
            if self.delay is not None:
                self.state = self.cache.policy.init_state(self.layer_idx, self.keys.shape[0], self.device)
            if self.layer_idx == 0:
                self.cache._allocate_pool(self.keys, self.values, entries=0)
        self.seen, self._pending = 0, None

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        state = tuple(self.state) if self.delay is not None else ()  # a delayed score's recurrent state
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.lb, self.pos, *state))


class OnePoolCache(BoundedCache):
    """The cache of a ``one_pool`` policy: per layer its sinks and ring (:class:`PoolLayer`), and one
    pool of ``L x Hk x k`` long-range entries for every layer and KV head (see the module docstring)."""

    one_pool = True

    def _make_layers(self, cfg) -> list[PoolLayer]:
        self.num_layers, self.num_kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
        self.pool_size = self.num_layers * self.num_kv_heads * self.long_range
        self.max_prefill = self.slots  # a longer prompt: a layer's evictions would depend on every later layer (slots: the budget less a state's)
        return [PoolLayer(i, self) for i in range(self.num_layers)]

    def _allocate_pool(self, k: Tensor, v: Tensor, entries: int | None = None) -> None:
        """An empty pool of ``entries`` entries for k's batch (None: keep one of this batch, else none yet)."""
        if entries is None and getattr(self, "pool_keys", None) is not None and self.pool_keys.shape[0] == k.shape[0]:
            return
        B, P, dev = k.shape[0], entries or 0, k.device
        self.pool_keys = k.new_zeros(B, P, k.shape[-1])
        self.pool_values = v.new_zeros(B, P, v.shape[-1])
        self.pool_lb = torch.zeros(B, P, dtype=torch.float64, device=dev)
        self.pool_pos = torch.full((B, P), -1, dtype=torch.int64, device=dev)  # -1: empty
        self.pool_f = torch.zeros(B, P, dtype=torch.int64, device=dev)  # pair layer * Hk + head

    @torch.no_grad()
    def _compete(self, p: int) -> None:
        """Token ``p - window`` leaves every layer's window: it and the pool compete; the lowest by rank
        at ``p`` go, as many as the candidates exceed ``P`` (``L x Hk`` once the pool is full; module docstring)."""
        j = p - self.window
        if j < self.sinks:
            return
        L, Hk = self.num_layers, self.num_kv_heads
        Fp = L * Hk
        slot = self.layout.home_slot(j)
        lk = torch.stack([layer.keys[:, :, slot] for layer in self.layers], 1).flatten(1, 2)  # (B, F, D)
        lv = torch.stack([layer.values[:, :, slot] for layer in self.layers], 1).flatten(1, 2)
        llb = torch.stack([layer.lb[:, :, slot] for layer in self.layers], 1).flatten(1, 2)  # (B, F)
        B = lk.shape[0]
        cand_pos = torch.cat([self.pool_pos, torch.full((B, Fp), j, dtype=torch.int64, device=lk.device)], 1)  # (B, P + F)
        cand_f = torch.cat([self.pool_f, torch.arange(Fp, device=lk.device).expand(B, Fp)], 1)
        cand_lb = torch.cat([self.pool_lb, llb], 1)
        held = min(self.pool_size, cand_pos.shape[1])  # entries after the competition
        if held == cand_pos.shape[1]:  # the pool is not full: every candidate stays
            keep = torch.arange(held, device=lk.device).expand(B, held)
        else:
            out = pool_leavers(cand_pos, cand_f, cand_lb, p, Fp, cand_pos.shape[1] - held, decays=self.policy.decays,
                               floor=self.layout.floor)  # (B, C + F); static priorities: OnePool
            keep = out.to(torch.uint8).sort(dim=1, stable=True).indices[:, :held]  # (B, held) the entries that stay
        self.pool_keys = torch.cat([self.pool_keys, lk], 1).gather(1, keep[..., None].expand(-1, -1, lk.shape[-1]))
        self.pool_values = torch.cat([self.pool_values, lv], 1).gather(1, keep[..., None].expand(-1, -1, lv.shape[-1]))
        self.pool_lb, self.pool_pos, self.pool_f = cand_lb.gather(1, keep), cand_pos.gather(1, keep), cand_f.gather(1, keep)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        return self.layers[layer].attend(q, k, v, scale)

    def occupancy(self) -> Tensor:
        """Entries held now per layer and KV head (sinks, ring and pool), mean over rows: (L, Hk) float."""
        L, Hk = self.num_layers, self.num_kv_heads
        ring = torch.stack([(layer.pos >= 0).sum(-1).double().mean(0) for layer in self.layers])  # (L, Hk)
        f = torch.where(self.pool_pos >= 0, self.pool_f, L * Hk)
        pool = torch.zeros(self.pool_pos.shape[0], L * Hk + 1, dtype=torch.float64, device=f.device).scatter_add_(1, f, torch.ones_like(f, dtype=torch.float64))
        return ring + pool[:, :-1].mean(0).view(L, Hk)

    def cache_bytes(self) -> int:
        """Keys, values, log betas, positions and pair tags of the rings and the pool."""
        pool = sum(t.numel() * t.element_size() for t in (self.pool_keys, self.pool_values, self.pool_lb, self.pool_pos, self.pool_f)) \
            if getattr(self, "pool_keys", None) is not None else 0
        return pool + sum(layer.nbytes() for layer in self.layers)
