"""Fast decoding: one static-shape decode step over a preallocated KV cache, CUDA-graphed.

gpt-fast's split: :meth:`DecodeEngine.prefill` (chunked, eager, any length) and
:meth:`DecodeEngine.step` (one token for every row; on CUDA compiled with ``torch.compile`` and
captured once as a CUDA graph that every later step replays) are separate functions. Two cache layouts run through the same engine and the same step:

* ``bounded`` -- the :class:`kvpop.geometry.CacheLayout` per layer ``(B, Hk, T, D)``:
  ``sinks`` slots, a ring of ``window`` slots, ``k`` long-range slots. Eviction happens inside the
  step with tensor indices only (no host synchronization, no data-dependent shapes): the token
  at position ``p`` goes to ring slot ``sinks + (p - sinks) % window``; the occupant it replaces
  (token ``p - window``) competes for the long-range slot of lowest (priority, position) and
  takes it iff it ranks at least as high. Same rule, same tie-break, same results as
  :class:`kvpop.decode.cache.BoundedLayer` (the slow twin that tests compare against);
* ``dense`` -- a static cache of ``max_len`` slots (the dense baseline in the same engine);
* ``pooled`` -- the ``one_pool`` policies (``dbtrimkv``, ``OnePool(...)``, ``kvpop_mlp_pool``, ``kvpop_pool``): one pool of
  ``L x Hk x k`` long-range entries for the whole model (:mod:`kvpop.decode.pooled`,
  :class:`kvpop.decode.pooled.PoolStore`): every layer's rings and the pool's pages in one store per row
  (B, NS, D), each layer's entries dense on its own pages. The step's head runs the pool's competition for
  the token leaving every window (its ``L x Hk`` priorities scored from the ring's keys and values, the
  lowest of pool and leavers go, swap-with-last compaction, static shapes); each layer writes the token
  into its ring and attends to its own pages (FlexAttention's decoding kernel with the layer's ``H`` query
  heads as the queries of one head, a block mask of the layer's pages per row). Prefill of any length in
  chunks of at most ``window`` tokens, exact (:meth:`DecodeEngine._pool_prefill_chunk`; a static rule's
  chunk of competitions in closed form, a decaying rule's on a candidate list, its queries one CUDA graph:
  :mod:`kvpop.decode.pooled`); each layer's chunk attends with SDPA to its heads' entries gathered apart
  (every pair's entries grouped once per chunk), its projections, MLP and the leavers' scores compiled on
  CUDA. A delayed rule (``kvpop_pool``, :meth:`Policy.read_delay` ``d``) keeps each layer's recurrent state: the
  step reads the token into it and reads token ``p - d`` out into its ring slot's priority
  (:meth:`DecodeEngine._pool_read_out`), a prefill chunk of at most ``window - d`` tokens does the same in the
  chunkwise form (:meth:`DecodeEngine._pool_chunk_read_out`). Same results as
  :class:`kvpop.decode.one_pool.OnePoolCache` (tests/test_pooled.py).

Attention of the step is FlexAttention's decoding kernel on CUDA (split over the KV length,
fp32 accumulation, GQA), and SDPA with the same mask evaluated densely on CPU; one
``mask_mod`` (``slot filled and not in the future``) serves both layouts. Every rule scores a
token inside the step when it leaves the window (a static rule, ``streaming_llm`` or
``kvpop_mlp``, from the ring's stored key and value: the number it would have had on entry); a
delayed rule (``kvpop``, the mLSTM) also writes every entering token into its recurrent state.

Prefill takes a prompt in chunks: each chunk attends, under the training pattern, to the cache's
current contents plus itself, with exact eviction times over that candidate set
(:func:`kvpop.selection.candidate_eviction_times`), and the cache then keeps the tokens that the
chunk's last query attends. The bounded cache therefore evicts as chunks arrive and its memory
stays flat, so prompts that would not fit densely work too. A delayed rule (the mLSTM) reads the
chunk into its state in closed form (:meth:`kvpop.mlstm.HeadwiseMLSTM.chunk`) and scores, each at
its exit time, the tokens that leave the window during the chunk; a delayed rule without such a
form goes through the decode step token by token (exact, slower). Rules that need the attention
weights (TOVA, H2O) decode through :class:`kvpop.decode.cache.BoundedCache` instead.

Memory: a bounded engine sized for a generation (``max_len``: prompt + new tokens, as
:func:`kvpop.decode.generate` builds it) holds ``min(layout.slots, max_len)`` slots per layer and KV
head (on CUDA padded to the 128-wide block), never more than the dense engine of the same length;
without ``max_len`` it holds the layout's slots and decodes for ever. The slots it leaves out would
stay empty anyway (sinks and ring fill in position order, an empty long-range slot is always the
first victim, so no token of a sequence of at most ``max_len`` sits at or beyond slot ``max_len``),
so the results do not depend on it. The buffers are sized once, at construction: the step's shapes
stay static and a CUDA graph captured for them stays valid; a compiled step is compiled once per
distinct size (each new length up to the budget, as for the dense engine; a budget-sized engine
always reuses the same one). Tokens beyond ``max_len`` are refused with an error.

On the CPU: prefill chunks default to about the cache's size (``chunk=None``: the slots rounded up to
a multiple of 128, from 256 to 2048), so that a long prompt's attention costs (cache + chunk) per
query rather than the whole prompt; a first chunk that fits in the cache (no token can be evicted
inside it) attends with SDPA's causal kernel, no mask. The eager step runs the rule's per-token
arithmetic (its score, the victim, the two-slot write: tensors of a few hundred numbers) on one
intra-op thread: with two threads every small matmul or reduction opens an OpenMP parallel region
that costs 10x the work on two free cores, and milliseconds when another process holds one
(``bench/bench_generate.py``, BENCHMARKS.md). The model's matrix products keep every thread.

Supported architectures: the Llama family as implemented by transformers (``llama``,
``mistral`` without sliding windows, ``qwen2``, ``qwen3``); the step calls the model's own
modules (norms, projections, MLP, rotary embedding), so the arithmetic is the model's. Each
layer's q/k/v and gate/up weights are packed into one matrix (:func:`pack_linears`, the modules
keep views of it): at batch 1 one wide GEMM reads the weights faster than several narrow ones.

Compiling (``compile_mode``): ``"layer"`` (the default) compiles one decoder layer whose every
per-layer input is an argument -- the layer's modules, packed weights and cache buffers, and its
rule as a one-layer view (:meth:`kvpop.policies.Policy.for_layer`, called with layer index 0) -- so
the compiler traces one layer and every layer runs the same code; the step's head (embedding,
rotary, the first norm) and tail (head GEMM, argmax) are compiled apart, and the whole step is still
captured as one CUDA graph. Each layer's output is normed for the next layer inside it, so the
residual add and the next norm stay one kernel as in a whole-step graph. ``"step"`` compiles the
whole step as one graph. On an H200 with Qwen3-4B both decode at 4.44-4.45 ms/step, while the
first compile takes 9 s against 97-111 s (``bench/bench_ttft.py``, ``bench/bench_decode.py
--compile-modes``). The compiled artifacts go to one folder (:func:`use_compile_cache`,
``$KVPOP_COMPILE_CACHE``, default ``~/.cache/kvpop/compile``) that later processes reuse, and
``compile=False`` (``kvpop generate`` without ``--compile``) starts at once, slower per token.

Shapes: B batch, H query heads, Hk KV heads, G = H / Hk, C chunk, N candidates, T cache slots
(on CUDA padded to a multiple of the 128-wide attention block), D head dim, V vocabulary.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import record_function
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvpop.decode.pooled import PoolStore
from kvpop.geometry import NEG_INF, CacheLayout
from kvpop.kernels import triton_available
from kvpop.masks import dense_mask
from kvpop.modeling import head_dim_of
from kvpop.policies import Policy
from kvpop.selection import NEVER, candidate_eviction_times

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
BLOCK = 128  # FlexAttention block width; cache slots are padded to a multiple of it
I64_MAX = torch.iinfo(torch.int64).max

#: how DecodeEngine compiles its step: "layer" compiles one decoder layer (every layer's modules,
#: weights, buffers and one-layer rule are its arguments, so all layers run the same compiled code)
#: plus the step's head and tail; "step" compiles the whole step as one graph (the compiler can fuse
#: across layers, but traces and compiles every layer: minutes on a fresh machine)
CompileMode = Literal["layer", "step"]
COMPILE_MODES: tuple[str, ...] = ("layer", "step")
# the pooled prefill's attention on CUDA: SDPA's backends but cuDNN's, which builds a plan for every new shape
_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
POOL_LIST_STEPS = 8  # the pooled step's candidate list serves this many steps per refresh (kvpop.decode.pooled)
#: the pooled step's FlexAttention decode: how many parts each layer's block list is split into (``SPLIT_KV``; None:
#: inductor's, ``2 x SMs / (B x 1)`` with the layer's query heads as one head, where the per-head step has ``2 x SMs /
#: (B x Hk)``: each part writes a partial output of every query head, read back by the combining kernel). Read when the
#: step compiles (``bench/kernels/profile_decode.py --split-kv``)
POOL_SPLIT_KV: int | None = None
#: the pooled prefill chunk's attention on CUDA (:meth:`DecodeEngine._pool_chunk_attend`): "flex" (FlexAttention
#: compiled for any length, the visibility rule as a mask_mod: no mask in memory) or "sdpa" (its twin: a boolean
#: mask of every query head's rows, G x C x (n + C) per KV head, built and read in each layer). The uncompiled engine
#: (the CPU's, the twin) runs "sdpa".
POOL_CHUNK_ATTENTION: Literal["flex", "sdpa"] = "flex"
#: a static pooled rule's leavers (the step's ``F``, a prefill chunk's ``F x C``) scored by one call of the rule's
#: :meth:`~kvpop.policies.Policy.all_layers` view, where it has one (True), or layer by layer (False: the twin; ``L``
#: small networks a step, each some kernels the compiled step cannot fuse across layers). Read when an engine is built.
STACKED_LEAVERS = True

#: the environment variable naming the folder of compiled decode steps (default: COMPILE_CACHE_DEFAULT)
COMPILE_CACHE_ENV = "KVPOP_COMPILE_CACHE"
COMPILE_CACHE_DEFAULT = Path("~/.cache/kvpop/compile")


def use_compile_cache(folder: str | Path | None = None) -> Path:
    """Keep compiled decode steps in one documented folder, so that a fresh process reuses them.

    ``folder``, else ``$KVPOP_COMPILE_CACHE``, else ``~/.cache/kvpop/compile``: inductor's caches
    (FX graphs, generated kernels, autotuning) go to ``<folder>/inductor`` and Triton's compiled
    kernels to ``<folder>/triton``, unless ``TORCHINDUCTOR_CACHE_DIR`` / ``TRITON_CACHE_DIR`` are set
    already (the user's choice, or an earlier call in this process, wins). Without this they
    live in ``/tmp``, which a reboot or a fresh container empties. Returns the parent of the inductor
    cache folder in use (the chosen folder, unless a ``TORCHINDUCTOR_CACHE_DIR`` was set before).

    Importing ``torch._dynamo`` (which transformers and this module do) writes torch's default
    folder (``/tmp/torchinductor_<user>``) into ``TORCHINDUCTOR_CACHE_DIR``, so that value counts
    as unset here: otherwise every process would compile into ``/tmp`` whatever this folder says."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = Path(folder or os.environ.get(COMPILE_CACHE_ENV) or COMPILE_CACHE_DEFAULT).expanduser()
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent


@contextmanager
def one_thread():
    """Run the block on one intra-op thread, then restore the thread count (a toggle costs about a
    microsecond): for tensors so small that a parallel region costs more than their arithmetic."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def slot_mask_mod(kv_pos: Tensor, q_pos0: Tensor | int, group: int, sinks: int = 0, evict: Tensor | None = None):
    """The attention pattern over cache slots / chunk candidates, as a FlexAttention ``mask_mod``.

    kv_pos (B, Hk, N) position of the token in each candidate slot (-1: empty); queries are
    positions ``q_pos0 + q_idx``; with ``evict`` (B, Hk, N) a token is attended only before its
    eviction time (sinks always) -- the training pattern of :mod:`kvpop.masks` over a candidate set."""

    def mask_mod(b, h, q_idx, kv_idx):
        kp = kv_pos[b, h // group, kv_idx]
        qp = q_pos0 + q_idx
        ok = (kp >= 0) & (kp <= qp)
        if evict is not None:
            ok = ok & ((kp < sinks) | (qp < evict[b, h // group, kv_idx]))
        return ok

    return mask_mod


def block_mask(mask_mod, kv_blocks: Tensor, Q: int, N: int, kv_indices: Tensor | None = None, block: int = BLOCK):
    """A forward-only BlockMask whose query block ``i`` visits KV blocks ``[0, kv_blocks[i])``, all
    as partial blocks (the mask_mod decides per element): kv_blocks (Qb,) int32; ``kv_indices``
    the int32 row ``arange(Kb)`` (any shape holding just it, e.g. (1, 1, 1, Kb)), if already at hand;
    blocks of ``block`` queries and keys (FlexAttention's on CUDA)."""
    from torch.nn.attention.flex_attention import BlockMask

    Qb, Kb = kv_blocks.shape[0], -(-N // block)
    row = torch.arange(Kb, device=kv_blocks.device, dtype=torch.int32) if kv_indices is None else kv_indices.reshape(Kb)
    kv_indices = row.expand(1, 1, Qb, Kb)  # (1, 1, Qb, Kb): one layout whatever the caller had (compiled code guards on strides)
    return BlockMask.from_kv_blocks(
        kv_blocks.view(1, 1, Qb).to(torch.int32), kv_indices, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(Q, N), compute_q_blocks=False
    )


def chunk_attention_sdpa(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, qpos: Tensor, scale: float) -> Tensor:
    """A pooled prefill chunk's attention: queries q (B, H, C, D) at positions qpos (C,) over k, v (B, Hk, N, D), place
    ``x`` of KV head ``kh`` visible to a query at position ``p`` iff ``lo[b, kh, x] <= p < hi[b, kh, x]`` (lo, hi
    (B, Hk, N)) -> (B, H, C, D). SDPA under a boolean mask, each KV head's G query heads as one head of G x C queries;
    on CUDA not cuDNN's kernel, which plans anew for every new shape (62 ms a call on the H200, 2026-12-04). The twin
    of :func:`chunk_attention_flex`."""
    B, H, C, D = q.shape
    Hk, N = k.shape[1], k.shape[2]
    G = H // Hk
    ok = (lo[:, :, None] <= qpos[:, None]) & (qpos[:, None] < hi[:, :, None])  # (B, Hk, C, N)
    mask = ok[:, :, None].expand(B, Hk, G, C, N).reshape(B, Hk, G * C, N)
    qg = q.reshape(B, Hk, G * C, D)  # query head h = kv * G + g: each KV head's queries, (g, t) major to minor
    with sdpa_kernel(_NO_CUDNN) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # (B, Hk, G C, D)
    return out.reshape(B, H, C, D)


def chunk_attention_flex(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, qpos: Tensor, scale: float, *, entries: int | None = None,
                         block: int = BLOCK) -> Tensor:
    """:func:`chunk_attention_sdpa` through FlexAttention: the visibility rule as the mask_mod (two comparisons per
    score, no mask in memory). CUDA: compiled once for any length (the entries' count changes from layer to layer
    and chunk to chunk, :func:`kvpop.attention.flex_any_length`); the CPU: eagerly.

    ``entries``: the places before the chunk's own ``C`` (each KV head's entries, a prefix of its row, then padding;
    :meth:`DecodeEngine._pool_chunk_entries`): where a multiple of ``block``, :func:`chunk_block_mask` visits only each
    head's blocks of entries and the chunk's blocks up to the query block's own; else every block, all partial."""
    from torch.nn.attention.flex_attention import flex_attention

    from kvpop.attention import flex_any_length

    C, G = q.shape[2], q.shape[1] // k.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        p = qpos[q_idx]
        return (lo[b, h // G, kv_idx] <= p) & (p < hi[b, h // G, kv_idx])

    bm = chunk_block_mask(mask_mod, lo, entries if entries is not None and entries % block == 0 else None, C, G, block)
    if q.is_cuda:
        return flex_any_length(q, k, v, bm, scale)
    return flex_attention(q, k, v, block_mask=bm, scale=scale, enable_gqa=True)


def chunk_block_mask(mask_mod, lo: Tensor, entries: int | None, C: int, G: int, block: int = BLOCK):
    """The BlockMask of a pooled prefill chunk's attention (:func:`chunk_attention_flex`) over places lo (B, Hk, N):
    ``entries`` entry places per KV head (a multiple of ``block``), then the chunk's ``C`` tokens. Query block ``i``
    of query head ``h`` visits the blocks holding its KV head's entries (those with ``lo < NEVER``, a prefix:
    padding skipped) and the chunk's blocks ``0 .. i`` (later ones are in its future); all partial, the mask_mod
    decides within. ``entries`` None: every block for every query block (:func:`block_mask`, broadcast over rows and
    heads). Built on the device, no host sync: kv_num_blocks (B, H, Qb), kv_indices (B, H, Qb, Kb), H = Hk x G."""
    from torch.nn.attention.flex_attention import BlockMask

    B, Hk, N = lo.shape
    dev = lo.device
    Qb, Kb = -(-C // block), -(-N // block)
    if entries is None:
        return block_mask(mask_mod, torch.full((Qb,), Kb, dtype=torch.int32, device=dev), C, N, block=block)
    j = torch.arange(Kb, device=dev)
    held = (lo[:, :, :entries] < NEVER).sum(-1)  # (B, Hk) each head's entries
    ne = (-(-held // block))[:, :, None, None]  # (B, Hk, 1, 1) their blocks
    idx = torch.where(j < ne, j, entries // block + j - ne).clamp(max=Kb - 1).expand(B, Hk, Qb, Kb)  # entries, then the chunk's
    num = ne[..., 0] + torch.arange(1, Qb + 1, device=dev)  # (B, Hk, Qb): the chunk's blocks up to the query block's own
    num, idx = (t.repeat_interleave(G, 1).to(torch.int32) for t in (num, idx))  # each KV head's G query heads
    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(C, N), compute_q_blocks=False)


def engine_refusal(model, policy: Policy | None) -> str | None:
    """Why :class:`DecodeEngine` cannot decode ``policy`` on ``model`` (None: it can)."""
    cfg = model.config.get_text_config(decoder=True)
    if cfg.model_type not in SUPPORTED:
        return f"DecodeEngine supports {SUPPORTED}, not {cfg.model_type!r}; decode it with kvpop.decode.BoundedCache"
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []) or getattr(cfg, "sliding_window", None) and cfg.model_type == "mistral":
        return "DecodeEngine does not support sliding-window attention layers"
    if policy is not None and policy.oracle:
        return f"policy {policy.name!r} is an oracle (it reads the trace's future): teacher-forced evaluation only"
    if policy is not None and policy.needs_attention:
        return f"policy {policy.name!r} needs attention weights: decode it with kvpop.decode.BoundedCache"
    if policy is not None and policy.one_pool and policy.scores_on_exit:
        return f"policy {policy.name!r} ranks with one pool and scores a token when it leaves: decode it with kvpop.decode.OnePoolCache"
    if policy is not None and policy.one_pool and policy.pool_floor:
        return (f"policy {policy.name!r} ranks with one pool under a per-head floor ({policy.pool_floor}), which the pooled engine does not keep: "
                "decode it with kvpop.decode.OnePoolCache")
    if policy is not None and policy.one_pool:
        return None  # the pooled kind: kvpop.decode.pooled
    if policy is not None and policy.decays:
        return f"policy {policy.name!r} re-ranks its slots by age at every step: decode it with kvpop.decode.BoundedCache"
    return None


class DecodeEngine:
    """A model, a cache layout and a policy, with preallocated buffers for ``batch_size`` rows.

    ``DecodeEngine(model, policy, layout=CacheLayout(2048, 4, 256), batch_size=1)`` -- a bounded
    cache (``policy``: any static or delayed :class:`kvpop.policies.Policy`; ``layout`` is
    nominal, as in BoundedCache; ``max_len``: the most tokens it will hold, if known, which sizes it
    ``min(slots, max_len)``, see the module docstring); ``DecodeEngine(model, None, max_len=L,
    batch_size=1)`` (or a policy that never evicts) -- the dense static cache; a ``one_pool`` policy
    -- the pooled store (:mod:`kvpop.decode.pooled`; ``page``: its page, 128 on CUDA (the compiled step
    needs FlexAttention's block), 16 on the CPU; its prefill chunks are at most ``window``; ``list_steps``:
    its step competes over a candidate list refreshed every that many steps, 0: over the whole pool). ``chunk``:
    prefill chunk (a multiple of 128; None: 2048 on CUDA, about the cache's size on the CPU).

    ``fused``: a static rule's token arrival (the leaver's score, the victim, the two-slot write)
    runs as one Triton kernel per layer (:mod:`kvpop.kernels.insert`) instead of the tensor code,
    which stays its twin (tests/test_kernels.py under Triton's interpreter; tests/test_gpu.py on
    CUDA). ``None`` (the default) fuses on CUDA where the rule has a fused form (``streaming_llm``,
    ``kvpop_mlp``) and Triton is installed: 3.88 against 4.35 ms per Qwen3-4B step on an H200
    (BENCHMARKS.md); ``False`` keeps the tensor code.

    ``prefill(ids)`` then ``step()`` repeatedly: the step reads the token in :attr:`tok` (B, 1),
    writes the greedy next token back into it (or the caller copies its own sample in) and
    returns the logits (B, V) float32. ``compile=None`` compiles on CUDA only.
    """

    def __init__(
        self, model, policy: Policy | None = None, *, layout: CacheLayout | None = None,
        max_len: int | None = None, batch_size: int = 1, chunk: int | None = None, compile: bool | None = None,
        compile_mode: CompileMode = "layer", fused: bool | None = None, page: int | None = None,
        list_steps: int = POOL_LIST_STEPS, chunk_graphs: bool = False,
    ):
        cfg = model.config.get_text_config(decoder=True)
        if (refusal := engine_refusal(model, policy)) is not None:
            raise NotImplementedError(refusal)
        if chunk is not None and (chunk < 1 or chunk % BLOCK):
            raise ValueError(f"chunk must be a positive multiple of {BLOCK}, got {chunk}")
        if max_len is not None and max_len < 1:
            raise ValueError(f"max_len must be >= 1 (the most tokens the engine will hold), got {max_len}")
        if list_steps < 0:
            raise ValueError(f"list_steps must be >= 0 (steps per refresh of the pooled step's candidate list; 0: none), got {list_steps}")
        self.model = model.eval()
        self.layers = model.model.layers
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.B = batch_size
        self.H, self.Hk = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = head_dim_of(cfg)
        self.G = self.H // self.Hk
        self.scale = self.layers[0].self_attn.scaling
        self.policy = policy if policy is not None and policy.evicts else None
        if self.policy is None:
            if max_len is None:
                raise ValueError("a dense engine needs max_len >= 1 (the static cache length)")
            self.kind: Literal["bounded", "dense"] = "dense"
            self.layout = CacheLayout(budget=max_len, sinks=0, window=max_len, long_range=0)
        else:
            if layout is None:
                raise ValueError("a bounded engine needs a layout (its budget, sinks and window)")
            self.kind = "pooled" if self.policy.one_pool else "bounded"  # pooled: kvpop.decode.pooled
            self.layout = layout.for_policy(self.policy, head_dim=self.D)
        self.sinks, self.window, self.long_range = self.layout.sinks, self.layout.window, self.layout.long_range
        self.max_len = max_len  # the most tokens it holds (None: bounded, any number)
        # slots held per layer and KV head: the layout's, or fewer for a shorter generation (module docstring)
        self.slots = min(self.layout.slots, max_len or self.layout.slots)
        if chunk is None:  # CPU: about the cache's size (module docstring)
            chunk = 2048 if self.device.type == "cuda" else min(2048, max(2 * BLOCK, -(-self.slots // BLOCK) * BLOCK))
        self.chunk = chunk
        self.delayed = self.policy is not None and self.policy.scores_on_exit
        # the pooled kind's delayed rule (kvpop_pool): token j's score read out of each layer's recurrent state at j + d,
        # d < window (Policy.read_delay); its prefill chunks are window - d tokens (kvpop.policies.kvpop_pool)
        self.pool_delay = self.policy.read_delay(self.window) if self.kind == "pooled" else None
        self.pool_chunk = self.window - (self.pool_delay or 0)  # the pooled prefill's whole chunk
        # a static pooled rule scores the leavers of every layer in one call (Policy.all_layers: each layer's network stacked,
        # copies taken now, as the projections below are packed now); None: layer by layer (the twin, and rules without that view)
        self._stacked = self.policy.all_layers() if self.kind == "pooled" and self.pool_delay is None and STACKED_LEAVERS else None
        # (weight, bias) of each layer's q/k/v and gate/up projections, packed into one matrix each
        # (after every check above: a refused engine leaves the model as it was)
        self._wqkv = [pack_linears(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj) for l in self.layers]
        self._wgu = [pack_linears(l.mlp.gate_proj, l.mlp.up_proj) for l in self.layers]
        self.first_long_range = self.layout.first_long_range
        pad = BLOCK if self.device.type == "cuda" else 1  # FlexAttention's blocks; SDPA (CPU) takes any length
        self.T = -(-self.slots // pad) * pad
        B, Hk, T, D, dev = self.B, self.Hk, self.T, self.D, self.device
        L = len(self.layers)
        per_head = self.kind != "pooled"  # the pooled kind keeps every layer in one store (self.store)
        self.keys = [torch.zeros(B, Hk, T, D, dtype=self.dtype, device=dev) for _ in range(L)] if per_head else []
        self.values = [torch.zeros(B, Hk, T, D, dtype=self.dtype, device=dev) for _ in range(L)] if per_head else []
        self.pos = [torch.full((B, Hk, T), -1, dtype=torch.int64, device=dev) for _ in range(L)] if per_head else []
        self.prio = [torch.full((B, Hk, T), NEG_INF, dtype=torch.float64, device=dev) for _ in range(L)] if self.kind == "bounded" else []
        self.state = [self.policy.init_state(i, B, dev) for i in range(L)] if self.delayed or self.pool_delay is not None else []
        self.p = torch.zeros((), dtype=torch.int64, device=dev)  # tokens seen = position of the next token
        self.tok = torch.zeros(B, 1, dtype=torch.int64, device=dev)  # the step's input token
        self.seen = 0  # host mirror of p (the step never reads it)
        self.read = [0] * len(self.layers)  # delayed rule, eager: tokens each layer's state has read (it may lag behind)
        self._bh = (torch.arange(B, device=dev).repeat_interleave(Hk), torch.arange(Hk, device=dev).repeat(B))  # (B * Hk,) each
        self._bh2 = tuple(torch.cat([x, x]) for x in self._bh)  # (2 * B * Hk,): the victims' rows, then the new token's
        self._unscored = torch.full((B * Hk,), float("nan"), dtype=torch.float64, device=dev)  # an entering token's priority
        self._full_blocks = torch.full((1,), T // BLOCK, dtype=torch.int32, device=dev)
        self._kv_indices = torch.arange(T // BLOCK, dtype=torch.int32, device=dev).view(1, 1, 1, -1)
        if compile is None:
            compile = dev.type == "cuda"
        self.store: PoolStore | None = None
        if self.kind == "pooled":
            if page is None:  # CUDA: FlexAttention's block; CPU: smaller pages waste fewer slots
                page = BLOCK if dev.type == "cuda" else 16
            if compile and page != BLOCK:
                raise ValueError(f"the compiled pooled step reads pages of FlexAttention's block ({BLOCK}), not {page}")
            self.store = PoolStore(batch=B, layers=L, kv_heads=Hk, head_dim=self.D, layout=self.layout, dtype=self.dtype, device=dev,
                                   page=page, decays=self.policy.decays, max_len=max_len, flex=bool(compile), list_steps=list_steps)
            self._layer_index = [torch.tensor(i, dtype=torch.int64, device=dev) for i in range(L)]
        # a prefill chunk's competitions without per-query store updates (PoolStore.compete_static: a static
        # rule in closed form; compete_decaying: a candidate list); False: replayed on the store (PoolStore.update), the twin
        self.pool_closed_form = True
        if compile and dev.type != "cuda":
            raise ValueError("compile=True needs a CUDA device (the step is replayed as a CUDA graph)")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
        self.compiled = compile
        # each layer's rule and the layer index it is called with: the policy and i, or (per-layer
        # compile) the layer's one-layer view and 0, so that no Python int tells the layers apart
        per_layer_rule = self.kind == "bounded" or self.pool_delay is not None
        views = [self.policy.for_layer(i) for i in range(L)] if per_layer_rule and compile_mode == "layer" else None
        if views is not None and any(v is None for v in views):
            compile_mode, views = "step", None  # a rule without one-layer views: the whole step is compiled
        self.compile_mode: CompileMode | None = compile_mode if compile else None
        self._rules = views if views is not None else [self.policy] * L
        self._rule_index = [0] * L if views is not None else list(range(L))
        # the step's pieces as functions of the engine (not bound methods: an engine that held its own
        # bound methods would be a reference cycle, its cache freed only by the cyclic collector)
        cls = type(self)
        pooled = self.kind == "pooled"
        self._step_head, self._layer_step, self._step_tail = (cls._pool_head, cls._pool_layer, cls._tail) if pooled else (cls._head, cls._layer, cls._tail)
        self._eager_step = cls._pool_decode_step if pooled else cls._decode_step
        self._compiled_step = None
        # the token's arrival as one Triton kernel per layer (kvpop.kernels.insert) where the rule has a fused form
        # (the kernel's lanes over the head dim are a Triton arange: a power of two)
        can_fuse = self.kind == "bounded" and not self.delayed and self.D & (self.D - 1) == 0 and all(
            r.fused_scorer(li) is not None for r, li in zip(self._rules, self._rule_index, strict=True))
        if fused is None:
            fused = can_fuse and dev.type == "cuda" and triton_available()
        if fused and not can_fuse:
            raise ValueError(f"fused=True: policy {getattr(self.policy, 'name', None)!r} has no fused form here (a static rule's "
                             f"fused_scorer, and a head dim that is a power of two: {self.D})")
        elif fused and not triton_available():
            raise ValueError("fused=True needs Triton (CUDA builds of torch ship it)")
        elif fused and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("fused=True needs a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1)")
        self.fused = fused
        # a pooled prefill chunk of `window` tokens (every chunk but a prompt's last): its leavers' scores, each layer's
        # projections and MLP compiled (the chunk's attention and bookkeeping stay eager: their shapes change)
        self._chunk_fns: dict[str, object] = {}
        if compile:
            use_compile_cache()
            comp = lambda fn: torch.compile(fn, fullgraph=True, dynamic=False)  # noqa: E731
            if self.kind == "pooled":
                self._chunk_fns = {"prio": torch.compile(self._leaver_prio, dynamic=False), "qkv": comp(self._chunk_qkv),
                                   "finish": comp(self._finish_layer)}
            if compile_mode == "layer":  # the step runs in Python over three compiled pieces, captured as one graph
                self._step_head, self._layer_step, self._step_tail = (comp(fn) for fn in (self._step_head, self._layer_step, self._step_tail))
                self._compiled_step = self._eager_step
            else:
                self._compiled_step = torch.compile(self._eager_step, fullgraph=True, dynamic=False)
        self._graphs: dict[bool | None, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # the step's CUDA graph and its output, by mode
        self._warm: set[bool | None] = set()  # modes whose first (compiling) call has run
        self._chunk_shared: dict[str, Tensor] | None = None
        self._compete_graph: torch.cuda.CUDAGraph | None = None  # pooled, compiled: a prefill chunk's competition
        # pooled: a full prefill chunk's layers on static buffers, each layer one CUDA graph per width bucket (compiled);
        # on the CPU the same buffers and padding run eagerly (the twin). Opt-in until measured on a GPU (issue 33)
        if chunk_graphs and (self.kind != "pooled" or self.pool_delay is not None):
            raise ValueError("chunk_graphs serves the pooled kind's prefill (a one_pool policy with static priorities, not a delayed one)")
        self.chunk_graphs = chunk_graphs
        #: the pooled prefill chunk's attention: "flex" in the compiled engine (:data:`POOL_CHUNK_ATTENTION`), else "sdpa"
        self.chunk_attention: Literal["flex", "sdpa"] = POOL_CHUNK_ATTENTION if self.compiled else "sdpa"
        self.chunk_bucket = 4 * self.store.page if self.store is not None else 0  # entry places of a layer's head: a multiple of this
        self._layer_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._cg: dict | None = None  # the static buffers of the chunk's layers

    # --- buffers --------------------------------------------------------------------------------
    def cache_bytes(self) -> int:
        """Bytes of the cache: keys, values, positions, priorities and recurrent states."""
        bufs = [*self.keys, *self.values, *self.pos, *self.prio, *(t for s in self.state for t in s)]
        return sum(t.numel() * t.element_size() for t in bufs) + (self.store.nbytes() if self.store is not None else 0)

    @torch.no_grad()
    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()
        for i in range(len(self.keys)):
            self.keys[i].zero_()
            self.values[i].zero_()
            self.pos[i].fill_(-1)
            if self.prio:
                self.prio[i].fill_(NEG_INF)
            if self.state:
                for buf, x in zip(self.state[i], self.policy.init_state(i, self.B, self.device), strict=True):
                    buf.copy_(x)
        self.p.zero_()
        self.seen = 0
        self.read = [0] * len(self.layers)

    @torch.no_grad()
    def load_row(self, src: DecodeEngine, r: int) -> None:
        """Take row ``r`` of ``src``'s cache, recurrent state, position and next token into this engine of batch 1
        (the same model, policy, layout and ``max_len``): prompts prefilled together in a batch, then each row
        continued apart (:func:`kvpop.decode.generate.engine_generate_ragged`). Copies into this engine's own
        buffers, so a CUDA graph captured on them stays valid."""
        if self.B != 1:
            raise ValueError(f"load_row fills an engine of batch 1, this one has {self.B} rows")
        if not 0 <= r < src.B:
            raise ValueError(f"row {r} is not a row of an engine of batch {src.B}")
        if not (src.model is self.model and src.policy is self.policy and src.layout == self.layout and src.max_len == self.max_len):
            raise ValueError("load_row needs an engine of the same model, policy, layout and max_len")
        for mine, theirs in zip((*self.keys, *self.values, *self.pos, *self.prio), (*src.keys, *src.values, *src.pos, *src.prio), strict=True):
            mine.copy_(theirs[r : r + 1])
        for mine, theirs in zip(self.state, src.state, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                a.copy_(b[r : r + 1])
        if self.store is not None:
            self.store.load_row(src.store, r)
        self.p.copy_(src.p)
        self.tok.copy_(src.tok[r : r + 1])
        self.seen, self.read = src.seen, list(src.read)

    # --- shared pieces ----------------------------------------------------------------------------
    def home_slot(self, pos: Tensor) -> Tensor:
        """The slot of a sink or window token at position(s) ``pos`` (int64): :meth:`CacheLayout.home_slot`."""
        return self.layout.home_slot(pos)

    def _qkv(self, layer, wqkv: tuple[Tensor, Tensor | None], h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """h (B, S, hidden) normed -> q (B, H, S, D), k, v (B, Hk, S, D), rotary applied; one GEMM
        (``wqkv``: the layer's packed q/k/v weight and bias)."""
        attn = layer.self_attn
        B, S, _ = h.shape
        w, b = wqkv
        q, k, v = F.linear(h, w, b).split([self.H * self.D, self.Hk * self.D, self.Hk * self.D], -1)
        q, k = q.view(B, S, self.H, self.D), k.view(B, S, self.Hk, self.D)
        v = v.view(B, S, self.Hk, self.D).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # the Llama-family rotary, shared by all SUPPORTED
        return q, k, v

    def _chunk_qkv(self, layer, wqkv: tuple[Tensor, Tensor | None], x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The layer's input norm, then :meth:`_qkv`: x (B, S, hidden) -> q (B, H, S, D), k, v (B, Hk, S, D)."""
        return self._qkv(layer, wqkv, layer.input_layernorm(x), cos, sin)

    def _finish_layer(self, layer, wgu: tuple[Tensor, Tensor | None], x: Tensor, out: Tensor) -> Tensor:
        """x (B, S, hidden), attention out (B, H, S, D) -> the layer's output (the MLP's gate and up in
        one GEMM, ``wgu``: the layer's packed weight and bias)."""
        B, _, S, _ = out.shape
        x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(B, S, self.H * self.D))
        mlp = layer.mlp
        w, b = wgu
        gate, up = F.linear(layer.post_attention_layernorm(x), w, b).chunk(2, -1)
        return x + mlp.down_proj(mlp.act_fn(gate) * up)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask_mod, kv_blocks: Tensor, kv_indices: Tensor | None = None, allowed: Tensor | None = None
    ) -> Tensor:
        """q (B, H, Q, D) over k, v (B, Hk, N, D) under mask_mod -> (B, H, Q, D); on the CPU ``allowed``
        (B, H, Q, N) is mask_mod's dense mask if already at hand."""
        B, H, Q, _ = q.shape
        N = k.shape[2]
        if q.is_cuda:
            from torch.nn.attention.flex_attention import flex_attention

            from kvpop.attention import _compiled_flex

            if torch.compiler.is_compiling():  # the compiled step: compiled as a whole
                return flex_attention(q, k, v, block_mask=block_mask(mask_mod, kv_blocks, Q, N, kv_indices), scale=self.scale, enable_gqa=True)
            if Q < self.chunk and not (Q == 1 and not self.compiled):  # a prompt's last chunk: a new length from prompt to prompt
                return self._attend_any_length(q, k, v, mask_mod, kv_blocks, kv_indices)
            bm = block_mask(mask_mod, kv_blocks, Q, N, kv_indices)
            return _compiled_flex()(q, k, v, block_mask=bm, scale=self.scale, enable_gqa=True)  # full chunks; the uncompiled step
        if allowed is None:
            allowed = dense_mask(mask_mod, B, H, Q, q.device, kv_len=N, group=self.G)  # (B, H, Q, N)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale, enable_gqa=True)

    def _attend_any_length(self, q: Tensor, k: Tensor, v: Tensor, mask_mod, kv_blocks: Tensor, kv_indices: Tensor | None) -> Tensor:
        """A chunk of Q < ``chunk`` queries q (B, H, Q, D) (a prompt's last; its length changes from prompt to prompt) over
        k, v (B, Hk, N, D) -> (B, H, Q, D), through FlexAttention compiled with symbolic lengths
        (:func:`kvpop.attention.flex_any_length`). Its queries are padded with zero rows to the full chunk's count and the
        padded rows' outputs dropped (the mask_mod reads a query only as the position ``q_pos0 + q_idx``; the padded
        query blocks visit the last real block's KV blocks), so the compiled function sees one query length: else a
        length of 1 and one query block compile apart (dynamo specializes sizes 0 and 1) and, on CUDA, so do fewer than
        128 queries (the decoding kernel's guard; the H200 recompiled for last chunks of 1 and of 128 queries before)."""
        from kvpop.attention import flex_any_length

        Q, N, C = q.shape[2], k.shape[2], self.chunk
        qb = -(-C // BLOCK)
        q = F.pad(q, (0, 0, 0, C - Q))  # (B, H, C, D)
        kv_blocks = torch.cat([kv_blocks, kv_blocks[-1:].expand(qb - kv_blocks.shape[0])])  # (qb,)
        return flex_any_length(q, k, v, block_mask(mask_mod, kv_blocks, C, N, kv_indices), self.scale)[:, :, :Q]

    # --- the decode step ----------------------------------------------------------------------
    def step(self) -> Tensor:
        """One token per row: reads :attr:`tok`, writes the greedy next token into it; -> logits (B, V).

        Compiled on CUDA: the first call compiles (``compile_mode``: the whole step, or one layer that
        every layer then reuses) and runs it on a side stream, the second captures the step as one
        CUDA graph (every buffer it touches is preallocated, so the graph's addresses stay valid),
        every call replays it. The returned tensor then lives in the graph's memory and is
        overwritten by the next step: copy what you keep."""
        if self.max_len is not None and self.seen >= self.max_len:
            raise ValueError(f"the engine holds {self.max_len} tokens (max_len); one more would overflow it")
        self.seen += 1
        if self.store is not None:  # the pooled kind: its candidate list, refreshed every few steps (PoolStore.before_step)
            self.store.before_step(self.p)
        if not self.compiled:
            return self._eager_step(self)
        mode = self.store.listed if self.store is not None else None  # a graph for each: over the list, over the whole pool
        if mode in self._graphs:
            graph, out = self._graphs[mode]
            graph.replay()
            return out
        if mode not in self._warm:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                out = self._compiled_step(self)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._warm.add(mode)
            return out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records, does not run
            out = self._compiled_step(self)
        self._graphs[mode] = (graph, out)
        graph.replay()
        return out

    @torch.no_grad()
    def _decode_step(self) -> Tensor:
        x, h, cos, sin, at = self._step_head(self)
        # eager (not captured): the filled slots are a prefix (sinks and ring fill in order, an empty
        # long-range slot is always the first victim), every stored token is visible to the new
        # query, so attention reads that prefix without a mask; the graphed step masks the whole buffer,
        # and so does a gate's (dms), whose gated-out leavers leave long-range slots empty anywhere
        gaps = self.policy is not None and self.policy.gated
        filled = None if self.compiled or gaps else min(self.seen, self.slots)
        # eager and p < sinks + window: no token leaves the window yet, so no competition is written
        # (no long-range slot held, as in a short generation's engine: none ever is)
        evicting = self.kind == "bounded" and self.slots > self.first_long_range and (self.compiled or self.seen > self.first_long_range)
        lazy = self._lazy_state()
        advance = self.delayed and not (lazy and self.seen <= self.first_long_range)  # a delayed rule's state reads the token now
        L = len(self.layers)
        for i, layer in enumerate(self.layers):
            if advance and lazy:
                self._catch_up(i, self.seen - 1)  # eager: the state may lag behind
            nxt = self.layers[i + 1].input_layernorm if i + 1 < L else self.model.model.norm
            x, h = self._layer_step(
                self, layer, nxt, self._rules[i], self._rule_index[i], self._wqkv[i], self._wgu[i], self.keys[i], self.values[i],
                self.pos[i], self.prio[i] if self.prio else None, self.state[i] if self.state else (), x, h, cos, sin, at,
                filled, evicting, advance,
            )
            if advance and lazy:
                self.read[i] = self.seen
        return self._step_tail(self, h)

    def _head(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """The step's input: the token's embedding x (B, 1, hidden), the first layer's normed input h,
        the rotary cos, sin (B, 1, D) and (bounded) the token's home slot ``at`` (B * Hk,)."""
        p, B = self.p, self.B
        x = self.model.model.embed_tokens(self.tok)  # (B, 1, hidden)
        cos, sin = self.model.model.rotary_emb(x, p.view(1, 1).expand(B, 1))  # (B, 1, D)
        at = self.home_slot(p).expand(B * self.Hk) if self.kind == "bounded" else None  # token p's slot in every layer
        return x, self.layers[0].input_layernorm(x), cos, sin, at

    def _tail(self, h: Tensor) -> Tensor:
        """The last layer's output, normed, h (B, 1, hidden) -> logits (B, V) float32; the greedy token
        goes to :attr:`tok` and the position advances."""
        logits = self.model.lm_head(h)[:, -1].float()  # (B, V)
        self.tok.copy_(logits.argmax(-1, keepdim=True))
        self.p.add_(1)
        return logits

    def _layer(
        self, layer, nxt, rule: Policy | None, li: int, wqkv, wgu, keys: Tensor, values: Tensor, pos: Tensor, prio: Tensor | None,
        state: tuple[Tensor, ...], x: Tensor, h: Tensor, cos: Tensor, sin: Tensor, at: Tensor | None, filled: int | None,
        evicting: bool, advance: bool,
    ) -> tuple[Tensor, Tensor]:
        """One decoder layer of the step: the residual x (B, 1, hidden) and its normed input h ->
        (the layer's output x, its norm ``nxt`` for the next layer, or the final norm).

        Everything that differs between layers is an argument: the layer's modules, its packed
        weights, its buffers and its rule (``rule``, called with layer index ``li``: the policy and
        the layer's index, or the layer's one-layer view, :meth:`Policy.for_layer`, and 0), so one
        compiled function serves every layer (``compile_mode="layer"``). ``filled``: eager, the filled
        slot prefix to attend without a mask (None: masked); ``evicting``: a leaver may compete;
        ``advance``: a delayed rule's state reads the token."""
        p = self.p
        q, k, v = self._qkv(layer, wqkv, h, cos, sin)  # (B, H, 1, D), (B, Hk, 1, D)
        if self.kind == "bounded" and self.compiled:
            self._insert(rule, li, keys, values, pos, prio, state, k, v, p, at, evicting, advance)
            kv_blocks = self._full_blocks
        elif self.kind == "bounded":
            with one_thread() if self.device.type == "cpu" else nullcontext():  # tiny tensors (module docstring)
                self._insert(rule, li, keys, values, pos, prio, state, k, v, p, at, evicting, advance)
            kv_blocks = self._full_blocks
        else:
            self._write_dense(keys, values, pos, k, v, p)
            kv_blocks = (p // BLOCK + 1).to(torch.int32).view(1)  # only the filled blocks
        if filled is not None:
            out = F.scaled_dot_product_attention(q, keys[:, :, :filled], values[:, :, :filled], scale=self.scale, enable_gqa=True)  # (B, H, 1, D)
        else:
            out = self._attend(q, keys, values, slot_mask_mod(pos, p, self.G), kv_blocks, self._kv_indices)
        x = self._finish_layer(layer, wgu, x, out)
        return x, nxt(x)

    def _write_dense(self, keys: Tensor, values: Tensor, pos: Tensor, k: Tensor, v: Tensor, p: Tensor) -> None:
        idx = p.view(1)
        keys.index_copy_(2, idx, k)
        values.index_copy_(2, idx, v)
        pos.index_copy_(2, idx, p.view(1, 1, 1).expand(self.B, self.Hk, 1))

    def _insert(
        self, rule: Policy, li: int, keys: Tensor, values: Tensor, pos: Tensor, prio: Tensor, state: tuple[Tensor, ...], k: Tensor, v: Tensor,
        p: Tensor, at: Tensor, evicting: bool, advance: bool,
    ) -> None:
        """The bounded cache's arrival of token p (k, v (B, Hk, 1, D)) into its home slot ``at`` (B * Hk,), all in tensor ops.

        Every buffer changes in at most two slots per (row, head): the ring slot that takes the new
        token and the long-range slot of the victim. Both are written by one ``index_put_`` on the
        buffer itself (indices (row, head, slot)), which the compiler does in place; a ``scatter_``,
        or a write through a reshaped view, made it rebuild and copy back the whole cache in every
        layer (measured on an H200: 1.9x slower steps at batch 16, 2.9x at batch 64)."""
        B, Hk = self.B, self.Hk
        bi, hi = self._bh  # (B * Hk,) row and head of each (row, head)
        if self.fused:  # the same in one kernel (no delayed rule here)
            from kvpop.kernels.insert import fused_insert

            fused_insert(keys, values, pos, prio, k, v, p, at, rule.fused_scorer(li), lr=self.first_long_range, slots=self.slots, sinks=self.sinks,
                         window=self.window, evict=evicting)
            return
        if advance:
            for buf, s in zip(state, rule.step(li, state, k[:, :, 0], v[:, :, 0]), strict=True):
                buf.copy_(s)
        new = (k.reshape(B * Hk, -1), v.reshape(B * Hk, -1), p.expand(B * Hk), self._unscored)  # scored when it leaves
        bufs = (keys, values, pos, prio)
        if not evicting:
            for buf, n in zip(bufs, new, strict=True):
                buf.index_put_((bi, hi, at), n)
            return
        leaving = p >= self.sinks + self.window  # the occupant of `slot` (token p - window) leaves the window
        # every rule scores a token as it leaves the window (a static rule's priority depends only on its
        # own key, value and position, so that is the number it would have had on entry)
        occ_k, occ_v = keys[bi, hi, at].view(B, Hk, -1), values[bi, hi, at].view(B, Hk, -1)  # (B, Hk, D)
        if self.delayed:
            cand_prio = rule.exit_scores(li, state, occ_k, occ_v, p - self.window)  # (B, Hk)
        else:
            cand_prio = rule.token_scores(li, occ_k[:, :, None], occ_v[:, :, None], (p - self.window).view(1, 1).expand(B, 1))
        cand_prio = cand_prio.double().reshape(B * Hk)
        lr_prio, lr_pos = prio[:, :, self.first_long_range : self.slots], pos[:, :, self.first_long_range : self.slots]  # (B, Hk, k)
        low = lr_prio.amin(-1, keepdim=True)  # (B, Hk, 1); empty slots are -inf
        victim = (torch.where(lr_prio == low, lr_pos, I64_MAX).argmin(-1) + self.first_long_range).view(B * Hk)  # (B * Hk,)
        # (B * Hk,); the leaver is newer than every slot: it wins ties; a gated-out one (-inf, dms) leaves
        wins = leaving & (cand_prio >= low.view(-1)) & (cand_prio > NEG_INF)
        src = torch.where(wins, at, victim)  # the victim slot then holds the leaver, or keeps its own token
        moved = (keys[bi, hi, src], values[bi, hi, src], pos[bi, hi, src], torch.where(wins, cand_prio, prio[bi, hi, victim]))
        rows = (*self._bh2, torch.cat([victim, at]))  # distinct slots: a long-range one, a sink/ring one
        for buf, m, n in zip(bufs, moved, new, strict=True):
            buf.index_put_(rows, torch.cat([m, n]))

    # --- the pooled kind: one pool for every layer and KV head (kvpop.decode.pooled) -------------------
    @torch.no_grad()
    def _pool_decode_step(self) -> Tensor:
        x, h, cos, sin, at = self._step_head(self)
        L, st = len(self.layers), self.store
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < L else self.model.model.norm
            x, h = self._layer_step(self, layer, nxt, self._wqkv[i], self._wgu[i], self._layer_index[i], st.bm_num[i], st.bm_idx[i],
                                    x, h, cos, sin, at, self._rules[i], self._rule_index[i], self.state[i] if self.state else ())
        return self._step_tail(self, h)

    def _leaver_prio(self, j: Tensor) -> Tensor:
        """Priorities (B, F, n) float64 of tokens j (n,) (non-sinks, in their rings) in every layer and KV
        head, scored from their stored keys and values: the number they got when they entered (a static rule);
        a delayed one's (kvpop_pool) were read out into their ring slots' priorities at ``j + d``."""
        st, B = self.store, self.B
        if self.pool_delay is not None:
            return st.prio[:, st.pair_slots(j)]  # (B, F, n)
        if self._stacked is not None:  # every layer's leavers in one call: pair f = layer * Hk + head is head f of the stacked view
            slots = st.pair_slots(j)  # (F, n)
            k, v = (t.view(B, *slots.shape, self.D) for t in st.read_kv(slots.reshape(1, -1).expand(B, -1)))  # (B, F, n, D)
            return self._stacked.token_scores(0, k, v, j.expand(B, -1)).double()  # (B, F, n)
        out = []
        for i in range(len(self.layers)):
            slots = st.ring_slots(i, j)  # (Hk, n)
            k, v = (t.view(B, *slots.shape, self.D) for t in st.read_kv(slots.reshape(1, -1).expand(B, -1)))  # (B, Hk, n, D)
            out.append(self.policy.token_scores(i, k, v, j.expand(B, -1)).double())  # (B, Hk, n)
        return torch.cat(out, 1)

    def _pool_head(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The pooled step's input (as :meth:`_head`), after the pool's competition for the token that
        leaves the window now (before any layer overwrites its ring slot); ``at`` (Hk,): the new
        token's ring slot in each head, relative to its layer's first ring slot."""
        p, B, st = self.p, self.B, self.store
        x = self.model.model.embed_tokens(self.tok)  # (B, 1, hidden)
        cos, sin = self.model.model.rotary_emb(x, p.view(1, 1).expand(B, 1))
        # eager: no competition before the first token leaves (the graphed step runs it always; nothing changes then)
        if self.compiled or self.seen - 1 - self.window >= self.sinks:
            j = p - self.window
            prio = self._leaver_prio(j.clamp(min=self.sinks).view(1))[:, :, 0]  # (B, F)
            if self.device.type == "cpu":
                with one_thread():  # a selection among a few hundred entries (module docstring)
                    st.update(p, prio)
            else:
                st.update(p, prio)
        at = torch.arange(self.Hk, device=self.device) * st.R + st.home_slot(p)  # (Hk,)
        return x, self.layers[0].input_layernorm(x), cos, sin, at

    def _pool_layer(self, layer, nxt, wqkv, wgu, li: Tensor, bm_num: Tensor, bm_idx: Tensor, x: Tensor, h: Tensor, cos: Tensor,
                    sin: Tensor, at: Tensor, rule: Policy | None = None, ri: int = 0, state: tuple[Tensor, ...] = ()) -> tuple[Tensor, Tensor]:
        """One decoder layer of the pooled step (as :meth:`_layer`): the token enters its ring slot in
        every head of layer ``li`` (0-d int64), then the layer's H query heads attend to its ring and pool
        entries. Compiled: FlexAttention's decoding kernel over the layer's pages (``bm_num`` (B, 1, 1),
        ``bm_idx`` (B, 1, 1, NB): :class:`kvpop.decode.pooled.PoolStore`'s block mask of the layer), one call per row
        group of the store (:data:`kvpop.decode.pooled.GROUP_ELEMENTS`: one group up to batch 28 at Qwen3-4B, budget
        2,048); eager: the layer's slots gathered, SDPA under the same mask."""
        st, B, Hk, H, G = self.store, self.B, self.Hk, self.H, self.G
        q, k, v = self._qkv(layer, wqkv, h, cos, sin)  # (B, H, 1, D), (B, Hk, 1, D)
        bi, hi = self._bh  # (B * Hk,)
        slot = (li * st.RS + at)[hi]  # (B * Hk,)
        st.write_kv(slot.view(B, Hk), k.reshape(B, Hk, -1), v.reshape(B, Hk, -1))
        st.pos.index_put_((bi, slot), self.p.expand(B * Hk))
        st.tag.index_put_((bi, slot), li * Hk + hi)
        if self.pool_delay is not None:  # kvpop_pool: layer li's state reads the token, then token p - d is read out
            self._pool_read_out(rule, ri, li, state, k[:, :, 0], v[:, :, 0])
        if self.compiled:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention

            first, opts = li * Hk, {"kernel_options": {"SPLIT_KV": POOL_SPLIT_KV}} if POOL_SPLIT_KV else {}
            outs = []
            for (r0, r1), kg, vg in zip(st.groups, st.key_groups, st.value_groups, strict=True):  # each group's store its own input

                def mask_mod(b, hh, q_idx, kv_idx, tag=st.tag[r0:r1]):  # the query heads are the queries of one head: pair of query q_idx
                    return tag[b, kv_idx] == first + q_idx // G

                bm = BlockMask.from_kv_blocks(bm_num[r0:r1], bm_idx[r0:r1], BLOCK_SIZE=st.page, mask_mod=mask_mod, seq_lengths=(H, st.NS),
                                              compute_q_blocks=False)
                outs.append(flex_attention(q[r0:r1].transpose(1, 2), kg.view(r1 - r0, 1, st.NS, -1), vg.view(r1 - r0, 1, st.NS, -1), block_mask=bm,
                                           scale=self.scale, **opts))
            out = (outs[0] if len(outs) == 1 else torch.cat(outs)).transpose(1, 2)  # (B, 1, H, D) -> (B, H, 1, D)
        else:
            i = int(li)
            slots, mine = st.layer_slots(i)  # (B, N)
            ks, vs = (buf.gather(1, slots[..., None].expand(-1, -1, self.D))[:, None] for buf in (st.keys, st.values))  # (B, 1, N, D)
            heads = i * Hk + torch.arange(H, device=self.device) // G  # (H,) the pair each query head reads
            ok = mine[:, None, None, :] & (st.tag.gather(1, slots)[:, None, None, :] == heads[None, :, None, None])  # (B, H, 1, N)
            out = F.scaled_dot_product_attention(q, ks, vs, attn_mask=ok, scale=self.scale, enable_gqa=True)
        x = self._finish_layer(layer, wgu, x, out)
        return x, nxt(x)

    def _pool_read_out(self, rule: Policy, ri: int, li: Tensor, state: tuple[Tensor, ...], k: Tensor, v: Tensor) -> None:
        """A delayed pooled rule's step in layer ``li`` (0-d): its state (``rule`` called with index ``ri``) reads the
        token's k, v (B, Hk, D), then token ``j = p - d`` (still in the ring: ``d < window``) gets its priority from
        it, into its ring slots' priorities, ``window - d`` steps before it leaves (as
        :meth:`kvpop.decode.one_pool.PoolLayer._read_out`). A ``j`` below ``sinks`` (which never compete) writes
        to the dump slot."""
        st, B, Hk = self.store, self.B, self.Hk
        for buf, new in zip(state, rule.step(ri, state, k, v), strict=True):
            buf.copy_(new)
        j = self.p - self.pool_delay  # 0-d
        slot = st.ring_slots(li, j.clamp(min=0).view(1))[:, 0]  # (Hk,)
        slot = torch.where(j >= self.sinks, slot, st.dump)[self._bh[1]]  # (B * Hk,)
        kj, vj = st.read_kv(slot.view(B, Hk))  # (B, Hk, D) each
        st.prio.index_put_((self._bh[0], slot), rule.exit_scores(ri, state, kj, vj, j).reshape(-1).double())

    def _pool_chunk_read_out(self, i: int, k: Tensor, v: Tensor, c0: int, rpos: Tensor) -> Tensor:
        """A delayed pooled rule in a prefill chunk: layer i's state reads the chunk's k, v (B, Hk, C, D) and the
        tokens ``rpos`` (R,), those ``j`` with ``j + d`` in the chunk, are read out at ``j + d`` (the chunked form
        of :meth:`_pool_read_out`, :meth:`Policy.prefill_chunk`) -> their priorities (B, Hk, R) float64, which enter
        their ring slots once the chunk has (:meth:`_pool_prefill_chunk`). Their keys: the ring's for ``j < c0``
        (written by earlier chunks: ``j > c0 - window``), else the chunk's."""
        st, d = self.store, self.pool_delay
        ring = st.ring_slots(i, rpos)  # (Hk, R)
        old = (rpos < c0)[None, None, :, None]
        idx = (rpos - c0).clamp(min=0)
        rk, rv = (torch.where(old, buf[:, ring], new[:, :, idx]) for buf, new in ((st.keys, k), (st.values, v)))  # (B, Hk, R, D)
        prio, state = self._rules[i].prefill_chunk(self._rule_index[i], self.state[i], k, v, rk, rv, rpos, rpos + d - c0)
        for buf, new in zip(self.state[i], state, strict=True):
            buf.copy_(new)
        return prio.double()

    def _pool_prefill_chunk(self, ids: Tensor) -> Tensor:
        """A chunk ids (B, C) of at most ``window`` tokens into the pooled cache -> logits (B, V) of its last.

        Its queries' competitions read only tokens of earlier chunks (:mod:`kvpop.pool`), so they all run
        first, on the bookkeeping only, recording when each entry present at the chunk's start goes: while
        :attr:`pool_closed_form`, a static rule's in one pass (:meth:`PoolStore.compete_static`), decaying
        ranks' on a candidate list (:meth:`PoolStore.compete_decaying`); else (their twin) replayed query by
        query on the store (:meth:`PoolStore.update` with ``move_kv=False``); every layer's queries then attend, under those
        eviction times, to the layer's entries as they were at the start and to the chunk causally; last,
        the pool's keys and values follow the bookkeeping (one gather) and the chunk enters the rings."""
        st, B, (_, C), dev = self.store, self.B, ids.shape, self.device
        st.forget_list()  # the chunk moves entries outside the step: the next step lists afresh
        c0 = self.seen
        c1 = c0 + C
        snap = (st.tag.clone(), st.pos.clone())  # the tags and positions at the chunk's start
        q0 = max(c0, self.sinks + self.window)  # the first query whose leaver competes
        orig = e = None
        fns = self._chunk_fns if C == self.pool_chunk else {}
        with record_function("kvpop.prefill.compete"):  # the phases a profile names (bench/kernels/profile_pool_prefill.py)
            if q0 < c1:
                leaver_prio = fns["prio"] if c1 - q0 == self.pool_chunk and fns else self._leaver_prio
                prio = leaver_prio(torch.arange(q0 - self.window, c1 - self.window, device=dev))  # (B, F, c1 - q0)
                if self.pool_closed_form:  # static priorities: the chunk's competitions in one pass; decaying: on a candidate list
                    orig, e = st.compete_decaying(q0, prio) if st.decays else st.compete_static(q0, prio)
                else:
                    orig = torch.arange(st.NS, device=dev).expand(B, -1).clone()  # (B, NS) the chunk-start slot of each slot's entry
                    e = torch.full((B, st.NS), NEVER, dtype=torch.int64, device=dev)  # (B, NS) eviction time by chunk-start slot
                    self._pool_competitions(q0, prio, orig, e)
        with record_function("kvpop.prefill.entries"):
            pos = torch.arange(c0, c1, device=dev)
            x = self.model.model.embed_tokens(ids)
            cos, sin = self.model.model.rotary_emb(x, pos.expand(B, C))
            static = self.chunk_graphs and C == self.pool_chunk
            entries = self._pool_chunk_entries(snap, e, pos, bucket=self.chunk_bucket if static else st.page, doubling=static)
        with record_function("kvpop.prefill.layers"):
            if static:  # every layer on static buffers (one CUDA graph each when compiled)
                x, kv = self._pool_chunk_layers_static(x, cos, sin, entries)
                knew, vnew = kv[:, 0], kv[:, 1]  # (L, B, Hk, C, D) each
            else:
                ks, vs, read = [], [], []
                if self.pool_delay is not None:  # the tokens whose j + d the chunk holds (sinks never compete)
                    d = self.pool_delay
                    rpos = torch.arange(max(self.sinks, c0 - d), max(self.sinks, c1 - d), device=dev)  # (R,)
                for i in range(len(self.layers)):
                    x, k, v = self._pool_chunk_layer(i, x, cos, sin, self._layer_entries(entries, i), entries["qpos"], fns)
                    ks.append(k)
                    vs.append(v)
                    if self.pool_delay is not None:
                        read.append(self._pool_chunk_read_out(i, k, v, c0, rpos))
                knew, vnew = torch.stack(ks), torch.stack(vs)  # (L, B, Hk, C, D) each
        with record_function("kvpop.prefill.store"):
            if orig is not None:  # the pool's entries where the bookkeeping put them
                idx = orig[..., None].expand(-1, -1, self.D)
                st.keys.copy_(st.keys.gather(1, idx))
                st.values.copy_(st.values.gather(1, idx))
            # the chunk enters every layer's rings at once: pair f = layer * Hk + head, its slots (F, C)
            slots = st.pair_slots(pos).view(-1)  # (F C,)
            st.keys[:, slots] = knew.transpose(0, 1).reshape(B, -1, self.D)  # (L, B, Hk, C, D) -> (B, F C, D)
            st.values[:, slots] = vnew.transpose(0, 1).reshape(B, -1, self.D)
            st.pos[:, slots] = pos.repeat(st.F)
            st.tag[:, slots] = st.pair.repeat_interleave(C)
            if self.pool_delay is not None and rpos.numel():  # the read-out priorities into their ring slots, every layer's
                st.prio[:, st.pair_slots(rpos).view(-1)] = torch.stack(read, 1).view(B, -1)  # (B, L, Hk, R)
            st._sync_block_masks()
        self.seen = c1
        self.p.fill_(c1)
        return self.model.lm_head(self.model.model.norm(x[:, -1:]))[:, -1].float()

    def _pool_competitions(self, q0: int, prio: Tensor, orig: Tensor, e: Tensor) -> None:
        """The pool's competitions at queries ``q0, q0 + 1, ...`` (one per column of prio (B, F, n)) on the
        bookkeeping, tracking ``orig`` and ``e`` (:meth:`PoolStore.update`). Compiled (CUDA): one compiled
        competition captured as a CUDA graph once per engine and replayed per query (static buffers)."""
        st, dev = self.store, self.device
        if not self.compiled:
            with one_thread() if dev.type == "cpu" else nullcontext():
                for t in range(prio.shape[2]):
                    st.update(torch.tensor(q0 + t, device=dev), prio[:, :, t], move_kv=False, track=(orig, e))
            return
        if self._compete_graph is None:
            self._cq = torch.zeros((), dtype=torch.int64, device=dev)  # q = 0: no leaver, the warm-up changes nothing
            self._cprio = torch.zeros(self.B, st.F, dtype=torch.float64, device=dev)
            self._corig, self._ce = torch.zeros_like(orig), torch.zeros_like(e)
            fn = torch.compile(type(self)._pool_compete, fullgraph=True, dynamic=False)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                fn(self)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(self)
            self._compete_graph = graph
        self._corig.copy_(orig)
        self._ce.copy_(e)
        for t in range(prio.shape[2]):
            self._cq.fill_(q0 + t)
            self._cprio.copy_(prio[:, :, t])
            self._compete_graph.replay()
        orig.copy_(self._corig)
        e.copy_(self._ce)

    def _pool_compete(self) -> None:
        """One competition of a prefill chunk from the static buffers (compiled, CUDA-graphed)."""
        self.store.update(self._cq, self._cprio, move_kv=False, track=(self._corig, self._ce))

    def _pool_chunk_entries(self, snap: tuple[Tensor, Tensor], e: Tensor | None, pos: Tensor, bucket: int, doubling: bool = False) -> dict:
        """What every layer's chunk attends to, for all layers at once: the entries at the chunk's start (``snap``:
        the store's tags and positions then, (B, NS) each; a slot's tag is the only mark of its owner: removals
        clear it), their eviction times e (B, NS) (None: nothing leaves in the chunk) and the chunk's positions
        pos (C,) -> ``{"ehl", "at", "width", "qpos"}``.

        Flat layout over ``T`` places: layer ``l``'s block ``[at[l], at[l + 1])`` holds its ``Hk`` heads, each a
        row of ``width[l]`` entry places (the layer's fullest head, rounded up to a multiple of ``bucket``, or with
        ``doubling`` to ``bucket`` times a power of two: few distinct shapes, each a CUDA graph with the static
        buffers; the attention skips a head's padding block by block), then ``C`` places for the chunk's own tokens. ``ehl`` (3, B, T) int64:
        the store slot of each entry place (garbage elsewhere), and ``lo``, ``hi``: place ``x`` is visible to a
        query at position ``p`` iff ``lo[x] <= p < hi[x]`` (an entry from its position to its eviction, a sink
        always, a chunk token from its position on, padding never), so each layer's mask is two comparisons
        with ``qpos`` (1, 1, C, 1). One sort and one host synchronization per chunk (the widths), for every layer."""
        st, B, L, Hk, dev = self.store, self.B, len(self.layers), self.Hk, self.device
        tag0, pos0 = snap
        C = pos.shape[0]
        key = torch.where(tag0 >= 0, tag0, st.F)  # (B, NS); F: empty
        order = key.argsort(dim=1, stable=True)  # (B, NS) the slots by pair (slot order within one), empty slots last
        cnt = torch.zeros(B, st.F + 1, dtype=torch.int64, device=dev).scatter_add_(1, key, torch.ones_like(key))[:, : st.F]  # (B, F)
        start = cnt.cumsum(1) - cnt
        need = (-(-cnt.view(B, L, Hk).amax(dim=(0, 2)) // bucket)).tolist()  # (L,) buckets of the fullest head: the one host sync
        width = [bucket * ((1 << (u - 1).bit_length()) if doubling and u else u) for u in need]
        row = [w + C for w in width]  # places per head of each layer
        at = [0]
        for w in row:
            at.append(at[-1] + Hk * w)
        T = at[-1]
        row_t = torch.tensor(row, device=dev)
        lay = torch.repeat_interleave(torch.arange(L, device=dev), Hk * row_t, output_size=T)  # (T,) each place's layer
        off = torch.arange(T, device=dev) - torch.tensor(at[:-1], device=dev)[lay]
        rl = row_t[lay]
        f, a = lay * Hk + off // rl, off % rl  # (T,) each place's pair and place in its head's row
        entry = a < rl - C  # (T,) an entry place (else the chunk's token a - width)
        slots = order.gather(1, (start[:, f] + a).clamp(max=st.NS - 1))  # (B, T)
        valid = entry & (a < cnt[:, f])  # (B, T)
        p0 = pos0.gather(1, slots)
        ev = e.gather(1, slots) if e is not None else torch.full_like(p0, NEVER)
        chunk_pos = pos[(a - (rl - C)).clamp(min=0)]  # (T,)
        lo = torch.where(valid, p0, torch.where(entry, NEVER, chunk_pos))  # (B, T)
        hi = torch.where(valid & (p0 >= self.sinks), ev, NEVER)
        return {"ehl": torch.stack([slots, lo, hi]), "at": at, "width": width, "qpos": pos.view(1, 1, C, 1)}

    def _layer_entries(self, entries: dict, i: int) -> Tensor:
        """Layer i's part of :meth:`_pool_chunk_entries`'s ``ehl``: (3, B, Hk, width + C), a view."""
        return entries["ehl"][:, :, entries["at"][i] : entries["at"][i + 1]].view(3, self.B, self.Hk, -1)

    def _pool_chunk_layer(self, i: int, x: Tensor, cos: Tensor, sin: Tensor, ehl: Tensor, qpos: Tensor, fns: dict) -> tuple[Tensor, Tensor, Tensor]:
        """Decoder layer i of a prefill chunk: x (B, C, hidden) -> (x, k, v), the layer's output and the chunk's
        keys and values (B, Hk, C, D); ``ehl``: :meth:`_layer_entries`, ``fns``: the compiled pieces, if any."""
        layer = self.layers[i]
        q, k, v = fns.get("qkv", self._chunk_qkv)(layer, self._wqkv[i], x, cos, sin)  # (B, H, C, D), (B, Hk, C, D)
        out = self._pool_chunk_attend(q, k, v, ehl, qpos)
        return fns.get("finish", self._finish_layer)(layer, self._wgu[i], x, out), k, v

    def _pool_chunk_attend(self, q: Tensor, k: Tensor, v: Tensor, ehl: Tensor, qpos: Tensor) -> Tensor:
        """A layer's chunk q (B, H, C, D), k, v (B, Hk, C, D) over the layer's entries at the chunk's start under
        their eviction times, and over the chunk itself causally (``ehl`` (3, B, Hk, n + C): :meth:`_layer_entries`;
        ``qpos`` (1, 1, C, 1) the chunk's positions) -> (B, H, C, D).

        Each KV head's entries are gathered apart, (B, Hk, n, D) padded to the layer's fullest head (whole
        pages), so that a query head reads only its own KV head's entries (GQA), as in the per-head cache;
        then :func:`chunk_attention_flex` (:attr:`chunk_attention`; the compiled engine's), else its twin
        :func:`chunk_attention_sdpa`."""
        st, B = self.store, self.B
        C = k.shape[2]
        n = ehl.shape[-1] - C
        rows = torch.arange(B, device=self.device).view(B, 1, 1)
        hs = ehl[0, :, :, :n]  # (B, Hk, n) store slots
        ks, vs = (torch.cat([buf[rows, hs], new], 2) for buf, new in ((st.keys, k), (st.values, v)))  # (B, Hk, n + C, D)
        if self.chunk_attention == "flex":  # blocks of FlexAttention's kernel on CUDA; of the store's pages elsewhere (the twin's tests)
            return chunk_attention_flex(q, ks, vs, ehl[1], ehl[2], qpos.reshape(C), self.scale, entries=n, block=BLOCK if q.is_cuda else st.page)
        return chunk_attention_sdpa(q, ks, vs, ehl[1], ehl[2], qpos.reshape(C), self.scale)

    def _pool_chunk_layers_static(self, x: Tensor, cos: Tensor, sin: Tensor, entries: dict) -> tuple[Tensor, Tensor]:
        """A full prefill chunk's layers on static buffers: x (B, C, hidden) -> (x, kv), the last layer's output
        and every layer's new keys and values kv (L, 2, B, Hk, C, D) (views of the buffers: used before the next
        chunk). Layer ``i`` reads x from one of two buffers and writes the other, its entries from a buffer per
        width (:meth:`_pool_chunk_entries` with ``bucket`` :attr:`chunk_bucket`). Compiled (CUDA): each
        (layer, width) is one CUDA graph, captured at its first use and replayed, all sharing one memory pool
        (a graph's outputs go to the static buffers, so no replay order matters); else the same calls eagerly."""
        L, C = len(self.layers), x.shape[1]
        if self._cg is None:
            self._cg = {"x": torch.empty(2, *x.shape, dtype=x.dtype, device=x.device), "cos": torch.empty_like(cos), "sin": torch.empty_like(sin),
                        "qpos": torch.empty_like(entries["qpos"]), "ehl": {},
                        "kv": torch.empty(L, 2, self.B, self.Hk, C, self.D, dtype=self.dtype, device=x.device),
                        "pool": torch.cuda.graph_pool_handle() if self.compiled else None}
        cg = self._cg
        cg["x"][0].copy_(x)
        cg["cos"].copy_(cos)
        cg["sin"].copy_(sin)
        cg["qpos"].copy_(entries["qpos"])
        for i in range(L):
            w = entries["width"][i]
            if w not in cg["ehl"]:
                cg["ehl"][w] = torch.empty(3, self.B, self.Hk, w + C, dtype=torch.int64, device=x.device)
            cg["ehl"][w].copy_(self._layer_entries(entries, i))
            if not self.compiled:
                self._static_layer(i, w)
                continue
            if (i, w) not in self._layer_graphs:
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._static_layer(i, w)  # warm-up (compiles): the graph captures what it launched
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=cg["pool"]):
                    self._static_layer(i, w)
                self._layer_graphs[(i, w)] = graph
            self._layer_graphs[(i, w)].replay()
        return cg["x"][L % 2], cg["kv"]

    def _static_layer(self, i: int, w: int) -> None:
        """Layer i of :meth:`_pool_chunk_layers_static` on its buffers (entries of width w)."""
        cg = self._cg
        x, k, v = self._pool_chunk_layer(i, cg["x"][i % 2], cg["cos"], cg["sin"], cg["ehl"][w], cg["qpos"], self._chunk_fns)
        cg["x"][(i + 1) % 2].copy_(x)
        cg["kv"][i, 0].copy_(k)
        cg["kv"][i, 1].copy_(v)

    # --- prefill ----------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, ids: Tensor) -> Tensor:
        """Append a prompt ids (B, S) to the cache, chunk by chunk -> logits (B, V) float32 of its
        last token. :attr:`tok` is set to the greedy next token."""
        if ids.dim() != 2 or ids.shape[0] != self.B:
            raise ValueError(f"prefill takes ids of shape ({self.B}, S), got {tuple(ids.shape)}")
        if self.max_len is not None and self.seen + ids.shape[1] > self.max_len:
            raise ValueError(f"the engine holds {self.max_len} tokens (max_len); {self.seen} + {ids.shape[1]} would overflow it")
        ids = ids.to(self.device)
        if self.delayed and not self.policy.chunked_prefill:  # a recurrence without a chunk form: one token at a time
            for t in range(ids.shape[1]):
                self.tok.copy_(ids[:, t : t + 1])
                logits = self.step().clone()
            return logits
        if self.kind == "pooled":  # chunks of at most `window` tokens (a delayed rule's: window - d): exact (kvpop.pool)
            chunk = min(self.chunk, self.pool_chunk)
            for c0 in range(0, ids.shape[1], chunk):
                logits = self._pool_prefill_chunk(ids[:, c0 : c0 + chunk])
            self.tok.copy_(logits.argmax(-1, keepdim=True))
            return logits
        for c0 in range(0, ids.shape[1], self.chunk):
            logits = self._prefill_chunk(ids[:, c0 : c0 + self.chunk])
        self.tok.copy_(logits.argmax(-1, keepdim=True))
        return logits

    def _prefill_chunk(self, ids: Tensor) -> Tensor:
        B, C = ids.shape
        self._chunk_shared = None  # priorities, eviction times (and the CPU mask) of a layer-independent rule, shared by the layers
        c0 = self.seen
        pos = torch.arange(c0, c0 + C, device=self.device).expand(B, C)
        x = self.model.model.embed_tokens(ids)
        cos, sin = self.model.model.rotary_emb(x, pos)
        # CPU: while the cache is the prefix [0, c1) in position order (dense, or no token leaves the
        # window before c1), the chunk attends causally over that prefix and nothing is evicted
        prefix = self.device.type != "cuda" and (self.kind == "dense" or c0 + C <= self.first_long_range)
        causal = torch.arange(c0 + C, device=self.device) <= pos[0][:, None] if prefix and c0 else None  # (C, c0 + C); c0 = 0: is_causal
        # the chunk's first position as a 0-d tensor of its own: a view pos[0, 0] carries pos's length C into the symbolic
        # compile's guards (dynamo specializes a size of 1), so a last chunk of one token recompiled (H100, 2026-12-06)
        q0 = pos[0, 0].clone()
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._wqkv[i], layer.input_layernorm(x), cos, sin)  # (B, H, C, D), (B, Hk, C, D)
            if prefix:
                out = self._prefix_chunk(i, q, k, v, pos, causal)
            elif self.kind == "dense":
                sl = slice(c0, c0 + C)
                self.keys[i][:, :, sl], self.values[i][:, :, sl] = k, v
                self.pos[i][:, :, sl] = pos[:, None]
                qb = torch.arange(-(-C // BLOCK), device=self.device)
                kv_blocks = ((c0 + (qb + 1) * BLOCK + BLOCK - 1) // BLOCK).clamp(max=self.T // BLOCK).to(torch.int32)
                out = self._attend(q, self.keys[i], self.values[i], slot_mask_mod(self.pos[i], q0, self.G), kv_blocks)
            else:
                out = self._bounded_chunk(i, q, k, v, pos, q0)
            x = self._finish_layer(layer, self._wgu[i], x, out)
        self.seen = c0 + C
        self.p.fill_(self.seen)
        return self.model.lm_head(self.model.model.norm(x[:, -1:]))[:, -1].float()

    def _prefix_chunk(self, i: int, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, causal: Tensor | None) -> Tensor:
        """Chunk q (B, H, C, D), k, v (B, Hk, C, D) at positions pos (B, C) = [c0, c1) stored at slots
        [c0, c1) (its home slots: no token has left the window), attending causally -> (B, H, C, D)."""
        c0, c1 = self.seen, self.seen + k.shape[2]
        sl = slice(c0, c1)
        self.keys[i][:, :, sl], self.values[i][:, :, sl] = k, v
        self.pos[i][:, :, sl] = pos[:, None]
        if self.kind == "bounded":
            # scored when they leave the window; a delayed rule's state reads them when one first leaves
            self.prio[i][:, :, sl] = float("nan")
        keys, values = self.keys[i][:, :, :c1], self.values[i][:, :, :c1]  # (B, Hk, c1, D)
        # c0 = 0: plain causal, SDPA's own (faster) path
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal, is_causal=causal is None, scale=self.scale, enable_gqa=True)

    def _bounded_chunk(self, i: int, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, q0: Tensor) -> Tensor:
        """Chunk q (B, H, C, D), k, v (B, Hk, C, D) at positions pos (B, C) (q0: pos[0, 0], a 0-d tensor of its own) over the cache's
        survivors plus itself, under exact eviction times; then keep what its last query attends.

        CPU, a first chunk of at most ``layout.slots`` tokens and no gate: at most ``k`` tokens have left
        the window before its last query, so none is evicted (every token has fewer than ``k``
        outrankers) and the chunk attends causally: SDPA's causal kernel, no eviction times, no mask."""
        B, Hk, C, _ = k.shape
        c0 = self.seen
        c1 = c0 + C
        causal = not q.is_cuda and c0 == 0 and c1 <= self.layout.slots and not self.policy.gated
        if c0 == 0:  # an empty cache: the chunk's tokens are the only candidates (N = C)
            cand_k, cand_v, cand_pos = k, v, pos[:, None].expand(B, Hk, C)
        else:
            cand_k = torch.cat([self.keys[i], k], 2)  # (B, Hk, N = T + C, D)
            cand_v = torch.cat([self.values[i], v], 2)
            cand_pos = torch.cat([self.pos[i], pos[:, None].expand(B, Hk, C)], 2)  # (B, Hk, N)
        N = cand_k.shape[2]
        shared = self._chunk_shared
        if shared is not None:  # a layer-independent rule: every layer holds the same tokens
            cand_prio, evict = shared["prio"], shared["evict"]
        else:
            if self.delayed:
                cand_prio = self._delayed_chunk_priorities(i, k, v, cand_k, cand_v, c0, c1)
            else:
                cand_prio = self.policy.token_scores(i, k, v, pos).double()  # (B, Hk, C)
                if c0:
                    cand_prio = torch.cat([self._scored_prio(i), cand_prio], 2)  # (B, Hk, N)
            evict = None if causal else candidate_eviction_times(
                cand_prio, cand_pos, sinks=self.sinks, window=self.window, long_range=self.long_range, bits=max(1, c1.bit_length())
            ).clamp(max=NEVER)
            if self.policy.layer_independent:
                shared = self._chunk_shared = {"prio": cand_prio, "evict": evict}
        if causal:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            self._scatter_survivors(i, cand_pos >= 0, cand_k, cand_v, cand_pos, cand_prio, c1)
            return out
        mm = slot_mask_mod(cand_pos, q0, self.G, sinks=self.sinks, evict=evict)  # a tensor: no recompilation per chunk
        full = torch.full((-(-C // BLOCK),), -(-N // BLOCK), dtype=torch.int32, device=q.device)
        allowed = None
        if not q.is_cuda:  # the dense mask of mm, once per chunk for a layer-independent rule
            allowed = shared.get("mask") if shared is not None else None
            if allowed is None:
                allowed = dense_mask(mm, B, q.shape[1], C, q.device, kv_len=N, group=self.G)  # (B, H, C, N)
                if shared is not None:
                    shared["mask"] = allowed
        out = self._attend(q, cand_k, cand_v, mm, full, allowed=allowed)
        # survivors at query c1 - 1: sinks, the window, and the long-range tokens not yet evicted
        self._scatter_survivors(i, (cand_pos >= 0) & ((cand_pos < self.sinks) | (evict >= c1)), cand_k, cand_v, cand_pos, cand_prio, c1)
        return out

    def _scatter_survivors(self, i: int, keep: Tensor, k: Tensor, v: Tensor, pos: Tensor, prio: Tensor, c1: int) -> None:
        """Layer i keeps the candidates ``keep`` (B, Hk, N) after query ``c1 - 1``: the sinks and the window at
        their home slots, the others in the long-range slots in candidate order."""
        fixed = keep & ((pos < self.sinks) | (pos >= c1 - self.window))
        long = keep & ~fixed
        rank = long.long().cumsum(-1) - 1
        dest = torch.where(fixed, self.home_slot(pos), torch.where(long, self.first_long_range + rank, self.T))  # T: discarded
        self._scatter_layout(i, dest, k, v, pos, prio)

    def _scored_prio(self, i: int) -> Tensor:
        """Layer i's slot priorities (B, Hk, T) with the sink and window tokens scored (a static rule:
        the decode step stores them unscored, NaN, and scores each as it leaves the window)."""
        prio, fixed = self.prio[i], slice(0, self.first_long_range)
        if not prio[:, :, fixed].isnan().any():
            return prio
        pos = self.pos[i][:, 0, fixed]  # (B, sinks + window): sink and ring slots hold the same token in every head
        scored = self.policy.token_scores(i, self.keys[i][:, :, fixed], self.values[i][:, :, fixed], pos.clamp(min=0)).double()
        prio = prio.clone()
        prio[:, :, fixed] = torch.where(self.pos[i][:, :, fixed] >= 0, scored, NEG_INF)
        return prio

    def _lazy_state(self) -> bool:
        """May a delayed rule's state lag behind the cache? Eager only (a graphed step runs no Python),
        and only with a closed form to catch up with."""
        return self.delayed and not self.compiled and self.policy.chunked_prefill

    def _catch_up(self, i: int, upto: int) -> None:
        """Read the stored tokens ``[read[i], upto)`` into layer i's state in closed form (a delayed
        rule's eager step and prefix chunks let it lag while no token leaves the window: they are then
        all at their home slots, which are their positions)."""
        a = self.read[i]
        if not self._lazy_state() or a >= upto:
            return
        none = self.keys[i][:, :, :0]
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        _, state = self.policy.prefill_chunk(i, self.state[i], self.keys[i][:, :, a:upto], self.values[i][:, :, a:upto], none, none, empty, empty)
        for buf, x in zip(self.state[i], state, strict=True):
            buf.copy_(x)
        self.read[i] = upto

    def _delayed_chunk_priorities(self, i: int, k: Tensor, v: Tensor, cand_k: Tensor, cand_v: Tensor, c0: int, c1: int) -> Tensor:
        """Candidate priorities (B, Hk, N) for a delayed rule, and its state advanced over the chunk.

        The tokens that leave the window during the chunk (positions ``[max(sinks, c0 - window),
        c1 - window)``: the ring's oldest, then the chunk's own) are scored after reading up to
        ``t + window``, exactly as the decode step would; the long-range slots keep their scores;
        every other token is not yet eligible before ``c1``, and ``-inf`` as a placeholder changes
        no eviction before ``c1`` (it only ranks last), so it is scored when it leaves later."""
        off = cand_k.shape[2] - k.shape[2]  # stored slots ahead of the chunk among the candidates (T, or 0: empty cache)
        self._catch_up(i, c0)
        a = max(self.sinks, c0 - self.window)
        rpos = torch.arange(a, max(a, c1 - self.window), device=k.device)  # (R,) positions of the leavers
        idx = torch.where(rpos < c0, self.home_slot(rpos), off + rpos - c0)  # candidate index (rpos >= sinks: a ring slot)
        prio, state = self.policy.prefill_chunk(i, self.state[i], k, v, cand_k[:, :, idx], cand_v[:, :, idx], rpos, rpos + self.window - c0)
        for buf, x in zip(self.state[i], state, strict=True):
            buf.copy_(x)
        if self._lazy_state():
            self.read[i] = c1
        B, Hk = k.shape[:2]
        cand_prio = torch.full((B, Hk, off + k.shape[2]), NEG_INF, dtype=torch.float64, device=k.device)
        if off:
            cand_prio[:, :, self.first_long_range : self.slots] = self.prio[i][:, :, self.first_long_range : self.slots]
        return cand_prio.index_copy_(2, idx, prio.double())

    def _scatter_layout(self, i: int, dest: Tensor, k: Tensor, v: Tensor, pos: Tensor, prio: Tensor) -> None:
        """Rewrite layer i's buffers: candidate n goes to slot dest[n] (T = dropped)."""
        T = self.T
        for buf, src, empty in ((self.keys[i], k, 0.0), (self.values[i], v, 0.0), (self.pos[i], pos, -1), (self.prio[i], prio, NEG_INF)):
            shape = (*buf.shape[:2], T + 1, *buf.shape[3:])
            new = torch.full(shape, empty, dtype=buf.dtype, device=buf.device)
            idx = dest if buf.dim() == 3 else dest[..., None].expand(-1, -1, -1, buf.shape[-1])
            new.scatter_(2, idx, src)
            buf.copy_(new[:, :, :T])

    # --- generation ------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, ids: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy continuation of ids (B, S) -> new tokens (B, max_new_tokens)."""
        self.reset()
        self.prefill(ids)
        out = [self.tok.clone()]
        for _ in range(max_new_tokens - 1):
            self.step()
            out.append(self.tok.clone())
        return torch.cat(out, 1)


def pack_linears(*mods: torch.nn.Linear) -> tuple[Tensor, Tensor | None]:
    """One (weight, bias) for several Linears on the same input, stacked along the output dim.

    At batch 1 a decode step is a row of matrix-vector products; one GEMM over the stacked matrix
    reads the same bytes at a higher bandwidth than separate small ones (gpt-fast's ``wqkv``). The
    modules are repointed in place at views of the packed storage, so the model computes exactly
    as before and no weight is held twice; packing an already packed group returns the same
    storage (engines built one after another on a model share it)."""
    biased = [m.bias is not None for m in mods]
    if any(biased) and not all(biased):
        raise ValueError("pack_linears: either all or none of the projections have a bias")
    return _pack(mods, "weight"), _pack(mods, "bias") if biased[0] else None


def _pack(mods, name: str) -> Tensor:
    """The parameters ``name`` of ``mods`` stacked along dim 0, the modules repointed at views of it."""
    ts = [getattr(m, name) for m in mods]
    whole = _adjacent(ts)
    if whole is None:
        whole = torch.cat([t.detach() for t in ts], 0)
        for m, t, part in zip(mods, ts, whole.split([t.shape[0] for t in ts], 0), strict=True):
            setattr(m, name, torch.nn.Parameter(part, requires_grad=t.requires_grad))
    return whole.detach()


def _adjacent(ts: list[Tensor]) -> Tensor | None:
    """The tensor stacking ``ts`` along dim 0 if they already lie back to back in one storage, else None."""
    t0 = ts[0]
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() for t in ts):
        return None
    off = t0.storage_offset()
    for t in ts:
        if t.storage_offset() != off or t.shape[1:] != t0.shape[1:] or t.dtype != t0.dtype:
            return None
        off += t.numel()
    whole = torch.empty(0, dtype=t0.dtype, device=t0.device)
    return whole.set_(t0.untyped_storage(), t0.storage_offset(), (sum(t.shape[0] for t in ts), *t0.shape[1:])).detach()


def weight_bytes(model) -> int:
    """Bytes of the model's distinct parameters (tied embeddings counted once): what a decode step reads."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(model) -> int:
    """Keys and values of one token in every layer."""
    cfg = model.config.get_text_config(decoder=True)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim_of(cfg) * next(model.parameters()).element_size()


__all__ = ["DecodeEngine", "chunk_attention_flex", "chunk_attention_sdpa", "chunk_block_mask", "engine_refusal", "kv_bytes_per_token", "pack_linears",
           "weight_bytes"]
