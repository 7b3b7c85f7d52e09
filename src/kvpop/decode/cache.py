"""A bounded KV cache for decoding: at most ``budget`` entries per layer and KV head, forever.

The reference (slow, obviously right) twin of :class:`kvpop.decode.engine.DecodeEngine`, and the
decode path of the rules that need attention weights (TOVA, H2O). Every layer's buffers are
``(B, Hk, T, D)`` in the :class:`kvpop.geometry.CacheLayout` geometry.

Memory: a bounded cache never holds more entries than a dense one. Its buffers hold ``T =
min(layout.slots, tokens)`` slots: a context shorter than the budget takes only its own tokens'
slots (sinks and ring fill in position order, and an empty long-range slot is always the first
victim, so every stored token sits below slot ``tokens``), and from the budget on the cache stays
flat at ``layout.slots``. With ``max_len`` (the prompt plus the new tokens, when the caller knows
them: :func:`kvpop.decode.generate`) the buffers are allocated once at ``min(slots, max_len)``;
without it they grow with the context one slot per token, as transformers' ``DynamicCache`` does,
so that a memory curve (:func:`kvpop.rollouts.memory_curve`) never shows more than dense. The
unallocated slots would be empty, so the results do not depend on ``T``. Beside the keys and values
each slot carries a float64 priority and an int64 position, and a delayed rule its state.

Token ``t >= sinks`` is written into ring slot ``sinks + (t - sinks) % window``. When token ``q``
arrives it overwrites token ``q - window``, which leaves the window and competes for the
long-range slots by its priority: a free slot takes it; otherwise it replaces the lowest-ranked
slot iff it outranks it (rank = priority, then recency: it is newer than every slot, so it wins
ties); a loser is gone for good. A priority of ``-inf`` is a gate's eviction (``dms``): that token
leaves with the window even when a slot is free. With static priorities this is exactly the top-k of the eligible
set that :func:`kvpop.selection.eviction_times` describes, so decoding reproduces the training
pattern token for token. Keys keep the rotary positions they were written with, and
:meth:`BoundedCache.get_seq_length` reports the number of tokens *seen*, so new positions keep
counting from the true sequence length.

Priorities come from a :class:`kvpop.policies.Policy`, through the hooks its capabilities declare:

* a static rule scores tokens once, when they enter (:meth:`Policy.token_scores`, i.e.
  ``Scores.prio`` with ``pos`` = absolute position, which is the position inside the single
  document being generated, as in training);
* a delayed rule (``scores_on_exit = True``, the ``kvpop`` mLSTM)
  keeps a recurrent state per layer in the cache (preallocated, counted by
  :meth:`BoundedCache.cache_bytes`). Every entering token is written into it
  (:meth:`Policy.step`); a token is scored when it *leaves* the window, at the arrival of
  token ``t + window`` (:meth:`Policy.exit_scores`): the state has then read exactly tokens
  ``0 .. t + window``, the training-time read-out time ``tau_t``. Its static priority is fixed from
  then on, so the competition below is unchanged; sinks and window tokens carry no score (NaN).
  The ring holds the keys and values of the window tokens until they leave, so scoring at exit
  needs no extra storage. Such a policy may also spend slots on its state: the cache asks it for
  ``k`` (:meth:`Policy.long_range_slots`), so ``budget`` is the *nominal* budget;
* an attention rule (``needs_attention = True``, TOVA, H2O) re-scores the
  stored slots after every attention step from the current query's attention
  (:meth:`Policy.slot_scores`). Its decisions at step ``q`` use statistics up to query
  ``q - 1``, so the cache never holds more than ``budget`` entries.

Attention runs through the cache itself (:meth:`BoundedCache.attend`, the same protocol as
:class:`kvpop.attention.SparseContext`), reached via the ``kvpop_cache`` attention
implementation that :func:`enable` installs: every stored slot carries its own validity and, per
KV head, its own token, which the standard SDPA mask ``(B, 1, q, kv)`` cannot express, and the
attention rules need the attention weights. Without a ``kvpop_ctx`` the implementation is plain
SDPA, so an enabled model still decodes densely with a ``DynamicCache``.

Prefill (the first forward on an empty cache, any length): the prompt attends under the training
pattern (eviction times from :func:`kvpop.selection.eviction_times`, mask from :mod:`kvpop.masks`,
SDPA on CPU, FlexAttention on CUDA); then exactly the tokens kept at the last prompt query stay.
A delayed rule scores the prompt with its training-time parallel form (one document, read-out
times clipped at the prompt's end: only the tokens ``t <= S - 1 - window`` that it scores exactly
can be evicted inside the prompt or compete for a slot after it) and starts decoding from the
state after the whole prompt.
Attention rules prefill densely (causal) and keep sinks, window and the top-k of their statistic.
A multi-token forward on a non-empty cache is not supported (feed tokens one at a time).

Batch rows evict independently (every op is vectorized over ``B`` and ``Hk``); all rows share one
length: left padding is not supported and is rejected with an error.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, S sequence, T = layout.slots, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpop.attention import SparseContext, flex_execute, sdpa_execute
from kvpop.geometry import NEG_INF, CacheLayout
from kvpop.masks import block_mask_from_eviction_times, dense_mask, make_eviction_mask_mod
from kvpop.modeling import head_dim_of
from kvpop.policies import Policy
from kvpop.pool import ChunkContext
from kvpop.selection import decaying_eviction_times, eviction_times

ATTN_IMPLEMENTATION = "kvpop_cache"


class BoundedLayer(CacheLayerMixin):
    """One layer: keys and values (B, Hk, T, D) plus per-slot priority and position (B, Hk, T),
    and, for a delayed policy, its recurrent state (``policy.init_state``, preallocated);
    ``T = min(layout.slots, max(tokens, max_len))`` (the module docstring: memory)."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, layer_idx: int, policy: Policy, layout: CacheLayout, max_len: int | None = None):
        super().__init__()
        self.layer_idx, self.policy, self.layout = layer_idx, policy, layout
        self.max_len = max_len  # the tokens it will hold, if known: allocated at once
        self.slots, self.sinks, self.window = layout.slots, layout.sinks, layout.window
        self.long_range = layout.long_range
        self.first_long_range = layout.first_long_range
        self.seen = 0  # tokens seen (not stored): the next token's position
        self.prio: Tensor | None = None  # (B, Hk, T) float64, -inf on empty slots
        self.pos: Tensor | None = None  # (B, Hk, T) int64 absolute position, -1 on empty slots
        self.state: tuple[Tensor, ...] = ()  # delayed policies: recurrent state, (B, ...) buffers updated in place
        self._pending: tuple | None = None  # written by update, consumed by attend

    # --- transformers' layer interface ---------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        B, Hk, S, Dk = key_states.shape
        T, dev = min(self.slots, max(S, self.max_len or 0)), key_states.device
        self.dtype, self.device = key_states.dtype, dev
        self.keys = key_states.new_zeros(B, Hk, T, Dk)
        self.values = value_states.new_zeros(B, Hk, T, value_states.shape[-1])
        self.prio = torch.full((B, Hk, T), NEG_INF, dtype=torch.float64, device=dev)
        self.pos = torch.full((B, Hk, T), -1, dtype=torch.int64, device=dev)
        if self.policy.scores_on_exit:
            self.state = self.policy.init_state(self.layer_idx, B, dev)
        self.is_initialized = True

    def _buffers(self) -> tuple[Tensor, ...]:
        return (self.keys, self.values, self.prio, self.pos, *self.state)

    def _reserve(self, tokens: int) -> None:
        """Hold at least ``min(slots, tokens)`` slots: the new ones are empty (the module docstring: memory)."""
        self.keys, self.values, self.prio, self.pos = grow_slots((self.keys, self.values, self.prio, self.pos),
                                                                 min(self.slots, tokens), (0.0, 0.0, NEG_INF, -1))

    @torch.no_grad()
    def _set_state(self, new: tuple) -> None:
        """Copy a new recurrent state into the preallocated buffers."""
        for buf, x in zip(self.state, new, strict=True):
            buf.copy_(x)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store the new token(s); returns the keys/values that :meth:`attend` will attend over."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError(
                "BoundedCache: the previous step's attention did not run through the cache; "
                "call kvpop.decode.enable(model) before decoding with it"
            )
        if key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"BoundedCache holds batch {self.keys.shape[0]}, got {key_states.shape[0]}")
        S = key_states.shape[-2]
        if self.seen == 0:
            self._reserve(S)
            self._pending = ("prefill", key_states, value_states)
            self.seen = S
            return key_states, value_states
        if S != 1:
            raise NotImplementedError(
                f"BoundedCache: a {S}-token forward on a non-empty cache is not supported; feed new tokens one at a time"
            )
        self._reserve(self.seen + 1)
        self._insert(key_states, value_states)
        self._pending = ("decode",)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0  # as a dense cache: lets SDPA's mask logic see padding

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1  # the sequence may grow without bound; storage stays within `budget`

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
            self.prio.fill_(NEG_INF)
            self.pos.fill_(-1)
            if self.state:
                self._set_state(self.policy.init_state(self.layer_idx, self.keys.shape[0], self.keys.device))
        self.seen, self._pending = 0, None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            for buf in self._buffers():
                buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in self._buffers())

    # --- storage --------------------------------------------------------------------------------
    @torch.no_grad()
    def _insert(self, k: Tensor, v: Tensor) -> None:
        """One token k, v (B, Hk, 1, D) at position p = seen - the ring's leaver competes first.

        A delayed policy first writes the token into its state (which has then read tokens
        ``0 .. p``), then scores the leaver ``p - window`` from it; the new token stays unscored."""
        p = self.seen
        B = k.shape[0]
        delayed = self.policy.scores_on_exit
        if delayed:
            self._set_state(self.policy.step(self.layer_idx, self.state, k[:, :, 0], v[:, :, 0]))
            prio = torch.full_like(self.prio[:, :, :1], float("nan"))  # scored when it leaves the window
        else:
            prio = self.policy.token_scores(self.layer_idx, k, v, torch.full((B, 1), p, device=k.device))  # (B, Hk, 1)
        slot = self.layout.home_slot(p)
        if p >= self.first_long_range:  # the occupant of the ring slot (token p - window) leaves the window
            if delayed and self.long_range > 0:
                self.prio[:, :, slot] = self.policy.exit_scores(
                    self.layer_idx, self.state, self.keys[:, :, slot], self.values[:, :, slot], p - self.window
                )
            self._compete(slot, p)
        self.keys[:, :, slot] = k[:, :, 0]
        self.values[:, :, slot] = v[:, :, 0]
        self.prio[:, :, slot] = prio[:, :, 0]
        self.pos[:, :, slot] = p
        self.seen = p + 1

    def _compete(self, src: int, p: int) -> None:
        """The token in slot ``src`` takes the lowest-ranked long-range slot iff it outranks it, at the
        arrival of token ``p``. A ``decays`` policy ranks by ``(p - pos) * prio`` (its retention at ``p``,
        in log; :func:`kvpop.selection.decaying_eviction_times`), every other by ``prio``. The slots
        held (at least ``min(slots, p + 1)``) include the first empty long-range slot, if there is one."""
        if self.long_range == 0:
            return
        lr = slice(self.first_long_range, self.slots)  # the held ones
        prio, pos = self.prio[:, :, lr], self.pos[:, :, lr]  # (B, Hk, k)
        leaver = self.prio[:, :, src : src + 1]
        if self.policy.decays:  # the same float64 products as the simulation
            prio = torch.where(pos >= 0, (p - pos).double() * prio, NEG_INF)
            leaver = self.window * leaver  # its age: it arrived `window` tokens ago
        low = prio.amin(-1, keepdim=True)  # (B, Hk, 1); empty slots are -inf
        # lowest-ranked slot: lowest priority, and the oldest among equal priorities
        victim = torch.where(prio == low, pos, torch.iinfo(torch.int64).max).argmin(-1, keepdim=True)  # (B, Hk, 1)
        wins = (leaver >= low) & (leaver > NEG_INF)  # the candidate is the newest: it wins ties; gated out (-inf, dms): it leaves
        dst = victim + self.first_long_range  # (B, Hk, 1)
        for buf in (self.keys, self.values, self.prio, self.pos):  # not the state
            idx = dst if buf.dim() == 3 else dst[..., None].expand(-1, -1, -1, buf.shape[-1])
            cand = buf[:, :, src : src + 1]
            keep = wins if buf.dim() == 3 else wins[..., None]
            buf.scatter_(2, idx, torch.where(keep, cand, buf.gather(2, idx)))

    @torch.no_grad()
    def _keep_survivors(self, k: Tensor, v: Tensor, prio: Tensor, evict: Tensor | None = None) -> None:
        """After a prompt k, v (B, Hk, S, D): keep the tokens attended by its last query.

        Sinks, the last ``window`` tokens, and of the eligible tokens ``[sinks, S - window)``: with the
        prompt's eviction times ``evict`` (B, Hk, S) (a pattern policy, whose prefill ran under them),
        those the last query still attends (one definition of the pattern, gates and decaying ranks
        included); without them (an attention rule), the top-k by (priority, recency)."""
        S = k.shape[2]
        self.reset()
        self.seen = S
        dev = k.device
        fixed = self.layout.fixed_tokens(S, dev)  # token indices, head-independent
        slots = self.layout.home_slot(fixed)
        self.keys[:, :, slots] = k[:, :, fixed]
        self.values[:, :, slots] = v[:, :, fixed]
        self.prio[:, :, slots] = prio[:, :, fixed]
        self.pos[:, :, slots] = fixed
        lo, hi = self.sinks, S - self.window  # eligible tokens
        n = min(self.long_range, hi - lo)
        if n <= 0:
            return
        if evict is not None:  # survivors first (in token order), evicted ones after: the first n are kept
            alive = (evict[:, :, lo:hi] > S - 1).to(torch.uint8)
            top = lo + alive.sort(dim=-1, descending=True, stable=True).indices[..., :n]  # (B, Hk, n) token index
            top_prio = torch.where(alive.gather(2, top - lo) > 0, prio.gather(2, top), NEG_INF)  # evicted: an empty slot
            self._store_long_range(k, v, top, top_prio)
            return
        flipped = prio[:, :, lo:hi].flip(-1)  # newest first, so a stable sort lets ties go to the newer
        top = (hi - 1) - flipped.sort(dim=-1, descending=True, stable=True).indices[..., :n]  # (B, Hk, n) token index
        self._store_long_range(k, v, top, prio.gather(2, top))

    def _store_long_range(self, k: Tensor, v: Tensor, top: Tensor, top_prio: Tensor) -> None:
        """Write tokens ``top`` (B, Hk, n) into the first n long-range slots; priority ``-inf`` (not a
        survivor) leaves the slot empty."""
        n = top.shape[-1]
        dst = slice(self.first_long_range, self.first_long_range + n)
        self.keys[:, :, dst] = k.gather(2, top[..., None].expand(-1, -1, -1, k.shape[-1]))
        self.values[:, :, dst] = v.gather(2, top[..., None].expand(-1, -1, -1, v.shape[-1]))
        self.prio[:, :, dst] = top_prio
        self.pos[:, :, dst] = torch.where(top_prio > NEG_INF, top, -1)

    # --- attention ------------------------------------------------------------------------------
    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q (B, H, S, D) and what :meth:`update` returned -> attention output (B, S, H, D)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("BoundedCache.attend without a preceding update")
        if pending[0] == "prefill":
            return self._prefill(q, k, v, scale)
        return self._decode(q, scale)

    def _decode(self, q: Tensor, scale: float) -> Tensor:
        """One query over the stored slots: q (B, H, 1, D) -> (B, 1, H, D)."""
        B, H, _, D = q.shape
        Hk = self.keys.shape[1]
        qg = q.reshape(B, Hk, H // Hk, D).float()  # query head h reads KV head h // G
        logits = torch.einsum("bhgd,bhtd->bhgt", qg, self.keys.float()) * scale  # (B, Hk, G, T)
        logits = logits.masked_fill(self.pos[:, :, None, :] < 0, NEG_INF)
        attn = logits.softmax(-1)
        out = torch.einsum("bhgt,bhtd->bhgd", attn, self.values.float()).to(q.dtype)  # (B, Hk, G, D)
        if self.policy.needs_attention:
            self._rescore(attn.mean(2, keepdim=True))  # (B, Hk, 1, T): one query, group mean
        return out.reshape(B, 1, H, -1)

    @torch.no_grad()
    def _rescore(self, attn: Tensor) -> None:
        """attn (B, Hk, Q, T) -> slot priorities through the policy; empty slots stay -inf."""
        new = self.policy.slot_scores(self.prio, attn.double())
        self.prio.copy_(torch.where(self.pos >= 0, new, NEG_INF))

    def _prefill(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """The prompt q (B, H, S, D), k, v (B, Hk, S, D) from an empty cache -> (B, S, H, D)."""
        B, H, S, _ = q.shape
        pos = torch.arange(S, device=q.device).expand(B, S)
        state = None
        with torch.no_grad():
            if self.policy.scores_on_exit:
                prio, state = self.policy.prefill(self.layer_idx, k, v, pos, window=self.window)
                prio = prio.double()
            else:
                prio = self.policy.token_scores(self.layer_idx, k, v, pos).double()  # (B, Hk, S)
        evict = None
        if self.policy.needs_attention:
            out, prio = self._dense_prefill(q, k, v, scale, prio)
        else:
            out, evict = self._pattern_prefill(q, k, v, scale, prio, pos)
        self._keep_survivors(k, v, prio, evict)
        if state is not None:
            self._set_state(state)
            fixed = self.prio[:, :, : self.first_long_range]  # sinks and window: stored unscored (NaN), scored when they leave
            fixed.copy_(torch.where(self.pos[:, :, : self.first_long_range] >= 0, float("nan"), NEG_INF))
        return out.transpose(1, 2)

    def _pattern_prefill(self, q, k, v, scale, prio, pos) -> tuple[Tensor, Tensor]:
        """The training pattern over the prompt (one document): (out (B, H, S, D), eviction times (B, Hk, S))."""
        B, H, S, _ = q.shape
        doc = torch.zeros_like(pos)
        times = decaying_eviction_times if self.policy.decays else eviction_times
        evict = times(prio, doc, pos, sinks=self.sinks, window=self.window, long_range=self.long_range)
        if q.is_cuda:
            bm = block_mask_from_eviction_times(doc, pos, evict, sinks=self.sinks, num_heads=H)
            return flex_execute(q, k, v, bm, scale, need_lse=False)[0], evict
        mm = make_eviction_mask_mod(doc, pos, evict, sinks=self.sinks, group=H // k.shape[1])
        return sdpa_execute(q, k, v, dense_mask(mm, B, H, S, q.device), scale, need_lse=False)[0], evict

    def _dense_prefill(self, q, k, v, scale, prio, chunk: int = 256) -> tuple[Tensor, Tensor]:
        """Causal attention in query chunks, folding each chunk's weights into the policy's statistic."""
        B, H, S, D = q.shape
        Hk = k.shape[1]
        G = H // Hk
        kf, vf = k.float(), v.float()
        out = q.new_empty(B, H, S, v.shape[-1])
        t = torch.arange(S, device=q.device)
        for s in range(0, S, chunk):
            qc = q[:, :, s : s + chunk].float()
            C = qc.shape[2]
            logits = torch.einsum("bhgqd,bhtd->bhgqt", qc.view(B, Hk, G, C, D), kf) * scale  # (B, Hk, G, C, S)
            logits = logits.masked_fill(t > (s + torch.arange(C, device=q.device))[:, None], NEG_INF)
            attn = logits.softmax(-1)
            out[:, :, s : s + C] = torch.einsum("bhgqt,bhtd->bhgqd", attn, vf).reshape(B, H, C, -1).to(q.dtype)
            with torch.no_grad():
                prio = self.policy.slot_scores(prio, attn.mean(2).double())
        return out, prio


class BoundedCache(Cache):
    """The bounded cache of a decoder-only model: one :class:`BoundedLayer` per layer.

    ``BoundedCache(model.config, policy, CacheLayout(budget, sinks, window))`` with any evicting
    :class:`kvpop.policies.Policy`; pass it as ``past_key_values`` to a model prepared by
    :func:`enable` (``model.generate`` included). The layout is nominal: each layer keeps at most
    ``layout.slots`` entries per KV head (:class:`kvpop.geometry.CacheLayout`). ``max_len``: the
    tokens it will hold (prompt + new tokens), if known: the buffers are then allocated once at
    ``min(slots, max_len)`` instead of growing with the context (the module docstring: memory).
    """

    #: the prompt tokens one forward on an empty cache may take (None: any number)
    max_prefill: int | None = None

    def __init__(self, config, policy: Policy, layout: CacheLayout, max_len: int | None = None):
        cfg = config.get_text_config(decoder=True)
        if not policy.evicts:
            raise ValueError(f"policy {policy.name!r} never evicts: decode it with a DynamicCache")
        if policy.oracle:
            raise ValueError(f"policy {policy.name!r} is an oracle (it reads the trace's future): teacher-forced evaluation only")
        if policy.one_pool and not self.one_pool:
            raise ValueError(f"policy {policy.name!r} ranks with one pool for all layers: decode it with kvpop.decode.OnePoolCache")
        if self.one_pool and not policy.one_pool:
            raise ValueError(f"policy {policy.name!r} has a per-head budget: decode it with kvpop.decode.BoundedCache")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
            raise NotImplementedError(f"{type(self).__name__} does not support sliding-window attention layers")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1 (the tokens the cache will hold), got {max_len}")
        self.policy, self.max_len = policy, max_len
        self.layout = layout.for_policy(policy, head_dim=head_dim_of(cfg))
        self.budget, self.sinks, self.window = layout.budget, layout.sinks, layout.window
        self.long_range, self.slots = self.layout.long_range, self.layout.slots
        super().__init__(layers=self._make_layers(cfg))

    #: one pool of long-range entries for every layer (:class:`kvpop.decode.one_pool.OnePoolCache`)
    one_pool = False

    def _make_layers(self, cfg) -> list[CacheLayerMixin]:
        return [BoundedLayer(i, self.policy, self.layout, self.max_len) for i in range(cfg.num_hidden_layers)]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """The :class:`kvpop.attention.SparseContext` protocol: -> attention output (B, S, H, D)."""
        return self.layers[layer].attend(q, k, v, scale)

    def cache_bytes(self) -> int:
        """Bytes allocated by the cache: keys, values, priorities, positions and the recurrent
        state (delayed policies) of every layer."""
        return sum(layer.nbytes() for layer in self.layers)


def grow_slots(bufs: tuple[Tensor, ...], n: int, empty: tuple[float, ...], dim: int = 2) -> tuple[Tensor, ...]:
    """Buffers with at least ``n`` entries along ``dim``: the same tensors if they hold that many,
    else copies whose new entries hold ``empty`` (one fill value per buffer)."""
    have = bufs[0].shape[dim]
    if have >= n:
        return bufs
    out = []
    for buf, fill in zip(bufs, empty, strict=True):
        shape = list(buf.shape)
        shape[dim] = n - have
        out.append(torch.cat([buf, buf.new_full(shape, fill)], dim))
    return tuple(out)


def cache_bytes(cache: Cache) -> int:
    """Allocated bytes of a BoundedCache or of any transformers cache (keys and values)."""
    if isinstance(cache, BoundedCache):
        return cache.cache_bytes()
    return sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if isinstance(t, Tensor)
    )


# --- the attention implementation ---------------------------------------------------------------
def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kvpop_ctx=None, **kwargs):
    """``attn_implementation="kvpop_cache"``: a context (BoundedCache, SparseContext or ChunkContext) attends;
    without one, plain SDPA (dense decoding with a DynamicCache)."""
    if kvpop_ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if isinstance(kvpop_ctx, BoundedCache):
        if attention_mask is not None:
            raise NotImplementedError("BoundedCache: padded batches are not supported (all rows must have one length)")
        if kwargs.get("sliding_window"):
            raise NotImplementedError("BoundedCache does not support sliding-window attention layers")
    elif not isinstance(kvpop_ctx, (SparseContext, ChunkContext)):
        raise TypeError(f"kvpop_ctx must be a BoundedCache, a SparseContext or a ChunkContext, got {type(kvpop_ctx).__name__}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kvpop_ctx.attend(module.layer_idx, query, key, value, scale), None


def register() -> str:
    """Register the ``kvpop_cache`` attention (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def _cache_as_context(module, args, kwargs):
    """Forward pre-hook: a BoundedCache given as ``past_key_values`` is also the attention context."""
    cache = kwargs.get("past_key_values")
    if isinstance(cache, BoundedCache) and kwargs.get("kvpop_ctx") is None:
        kwargs["kvpop_ctx"] = cache
    return args, kwargs


def enable(model):
    """Prepare a model (in place, idempotent) for BoundedCache decoding; returns it.

    Sets ``attn_implementation="kvpop_cache"`` (SDPA unless a context is given, so dense
    decoding and ``kvpop_ctx=SparseContext(...)`` forwards keep working) and installs a forward
    pre-hook that hands ``past_key_values`` to the attention when it is a BoundedCache, so
    ``model(..., past_key_values=cache)`` and ``model.generate(..., past_key_values=cache)`` work."""
    model.set_attn_implementation(register())
    if getattr(model, "_kvpop_cache_hook", None) is None:
        model._kvpop_cache_hook = model.register_forward_pre_hook(_cache_as_context, with_kwargs=True)
    return model
