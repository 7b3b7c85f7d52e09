"""Generation with a policy's cache, on whichever decode path supports it.

Two paths decode the same policy to the same tokens (``tests/test_engine.py`` proves them equal):

* ``engine`` -- :class:`kvpop.decode.engine.DecodeEngine`: chunked prefill and a static-shape
  step over preallocated buffers (compiled and CUDA-graphed on request). It decodes ``dense``
  (a static cache of prompt + new tokens), every static or delayed rule and the ``one_pool`` policies
  (its pooled kind, :mod:`kvpop.decode.pooled`) on the Llama family;
* ``reference`` -- ``model.generate`` over :class:`kvpop.decode.cache.BoundedCache` (or a
  ``DynamicCache`` for dense): the slow twin, and the only path of the rules that need each
  step's attention (TOVA, H2O) and of architectures the engine does not support.

On both paths a bounded cache is sized once per call, ``min(budget, tokens)`` slots per layer and KV
head for the call's tokens (prompt + new); a generation that fits in a rule's slots (nothing can be
evicted: :func:`never_evicts`) is decoded with dense's cache, the same tokens without a bounded cache's
priorities or a delayed rule's state, so it never costs more than dense.

``path="auto"`` takes the engine wherever it supports the policy: it is the faster path on the
CPU as well as on CUDA (``bench/bench_generate.py`` measures both side by side against
transformers' own ``generate``). Sampling follows transformers' ``generate``: the same warpers in
the same order (temperature, top-k, top-p), one ``torch.multinomial`` draw per step from the
global generator, padding after EOS; so a seed gives the same tokens on both paths.

Shapes: B batch, S prompt, N new tokens, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvpop.decode.cache import BoundedCache, cache_bytes, enable
from kvpop.decode.engine import DecodeEngine, engine_refusal
from kvpop.decode.one_pool import OnePoolCache
from kvpop.geometry import CacheLayout
from kvpop.modeling import head_dim_of
from kvpop.policies import Dense, Policy

Path = Literal["auto", "engine", "reference"]


def new_cache(model, policy: Policy, layout: CacheLayout, max_len: int | None = None):
    """The reference cache of a policy: a DynamicCache for dense, a OnePoolCache for a ``one_pool`` policy
    (``dbtrimkv``, ``OnePool(...)``), else a BoundedCache (``layout`` nominal: the cache takes the policy's k).
    ``max_len``: the tokens it will hold, if known (a bounded cache then allocates ``min(slots, max_len)``
    slots at once; else it grows with the context, as the DynamicCache does)."""
    from transformers import DynamicCache

    if not policy.evicts:
        return DynamicCache(config=model.config)
    if policy.one_pool:
        return OnePoolCache(model.config, policy, layout, max_len=max_len)
    return BoundedCache(model.config, policy, layout, max_len=max_len)


def feed(model, cache, input_ids: Tensor, *, prefill: int) -> Tensor:
    """Feed ``input_ids`` (B, S) into an empty reference cache: the first ``prefill`` tokens at once,
    then one at a time -> logits (B, S, V). ``prefill`` is capped at the cache's ``max_prefill``
    (:class:`kvpop.decode.one_pool.OnePoolCache`: its budget)."""
    prefill = min(prefill, getattr(cache, "max_prefill", None) or prefill)
    B, S = input_ids.shape
    first = model(input_ids=input_ids[:, :prefill], past_key_values=cache).logits
    logits = first.new_empty(B, S, first.shape[-1])
    logits[:, :prefill] = first
    for t in range(prefill, S):
        logits[:, t] = model(input_ids=input_ids[:, t : t + 1], past_key_values=cache).logits[:, 0]
    return logits


def model_device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def teacher_forced_logits(model, policy: Policy, input_ids: Tensor, *, layout: CacheLayout, prefill: int = 1,
                          cache: BoundedCache | None = None) -> Tensor:
    """Logits (B, S, V) of decoding ``input_ids`` (B, S) through the reference cache: ``prefill``
    tokens at once, then one at a time (the attention rules' teacher-forced path). ``cache``: an
    empty one of this geometry to decode into (the caller reads it afterwards), else a new one."""
    enable(model)
    policy.to(model_device(model))
    if cache is None:
        cache = new_cache(model, policy, layout)
    return feed(model, cache, input_ids, prefill=prefill)


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int  # decode steps x rows (rows that stopped early count their padding)
    seconds: float
    tokens_per_s: float
    peak_cache_mb: float  # allocated cache bytes at the end: a bounded cache holds min(budget, its tokens) slots, no more keys and values than dense
    path: str = "reference"  # the decode path that ran: "engine" or "reference"


def never_evicts(model, policy: Policy, layout: CacheLayout, tokens: int) -> bool:
    """Whether ``policy`` keeps every one of ``tokens`` tokens: it evicts only from a full cache (a rule or
    a pool; not a gate, ``dms``, ``trimkv``, which evicts below its budget) and ``tokens`` fit in its slots
    per layer and KV head. Its generation then attends to everything, as dense does: ``generate`` decodes
    it with dense's cache, so a generation shorter than the budget costs what dense costs."""
    if not policy.evicts or policy.gated:
        return False
    return tokens <= layout.for_policy(policy, head_dim=head_dim_of(model.config)).slots


def choose_path(model, policy: Policy, path: Path = "auto") -> Literal["engine", "reference"]:
    """The decode path for ``policy`` on ``model``: the engine wherever it supports them."""
    if policy.oracle:
        raise ValueError(f"policy {policy.name!r} is an oracle (it reads the trace's future): it cannot be decoded")
    refusal = engine_refusal(model, policy)
    if path == "engine" and refusal is not None:
        raise NotImplementedError(refusal)
    if path == "reference":
        return "reference"
    return "engine" if refusal is None else "reference"


def _warpers(temperature: float, top_p: float, top_k: int):
    """transformers' sampling warpers, in ``generate``'s order (skipped where they change nothing)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p))
    return out


def _eos_ids(model, tokenizer) -> Tensor:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return torch.tensor(eos, dtype=torch.long, device=model_device(model))


@torch.no_grad()
def engine_generate(
    engine: DecodeEngine, ids: Tensor, *, max_new_tokens: int, eos: Tensor, pad: int, temperature: float = 0.0, top_p: float = 1.0,
    top_k: int = 0, streamer=None,
) -> Tensor:
    """Decode up to ``max_new_tokens`` after ids (B, S) on a fresh engine state -> new tokens (B, N),
    N <= max_new_tokens (all rows stopped at EOS: the loop ends; stopped rows are padded)."""
    engine.reset()
    logits = engine.prefill(ids)  # (B, V) float32
    if streamer is not None:
        streamer.put(ids.cpu())
    return _decode(engine, ids, logits, max_new_tokens=max_new_tokens, eos=eos, pad=pad, temperature=temperature, top_p=top_p, top_k=top_k,
                   streamer=streamer)


def _decode(engine: DecodeEngine, seq: Tensor, logits: Tensor, *, max_new_tokens: int, eos: Tensor, pad: int, temperature: float = 0.0,
            top_p: float = 1.0, top_k: int = 0, streamer=None) -> Tensor:
    """The new tokens (B, N) after a prefill that left ``logits`` (B, V) of the prompt seq (B, S)'s last token."""
    sample = temperature > 0
    warp = _warpers(temperature, top_p, top_k) if sample else None
    unfinished = torch.ones(seq.shape[0], dtype=torch.long, device=seq.device)
    new = []
    for i in range(max_new_tokens):
        if sample:
            nxt = torch.multinomial(torch.softmax(warp(seq, logits), -1), num_samples=1).squeeze(1)  # (B,)
        else:
            nxt = logits.argmax(-1)
        nxt = nxt * unfinished + pad * (1 - unfinished)
        new.append(nxt)
        seq = torch.cat([seq, nxt[:, None]], 1)
        if streamer is not None:
            streamer.put(nxt.cpu())
        unfinished = unfinished & ~torch.isin(nxt, eos)
        if i == max_new_tokens - 1 or not unfinished.any():
            break
        engine.tok.copy_(nxt[:, None])
        logits = engine.step().clone()
    if streamer is not None:
        streamer.end()
    return torch.stack(new, 1)


@torch.no_grad()
def engine_generate_ragged(batch: DecodeEngine, single: DecodeEngine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
                           eos: Tensor, pad: int) -> list[list[int]]:
    """Greedy answers of prompts of different lengths, ``batch.B`` prompts at a time: the first ``m`` tokens of each
    (``m``: the shortest prompt's length) prefilled together on ``batch``, then each row's cache loaded into ``single``
    (batch 1, :meth:`DecodeEngine.load_row`), the row's own remaining prompt tokens prefilled there and its answer
    decoded. ``max_new_tokens``: one for all, or one per prompt. Groups are formed in order of length (so that each
    row's own remainder stays short); a group of fewer than ``batch.B`` prompts repeats its last one. Each answer is
    the one :func:`engine_generate` gives the prompt alone (the rows of a batch are computed apart; only the rounding
    of batched products may differ): what the batch saves is the prompts' prefill, which for a long prompt and a
    short answer is most of a generation's time.

    Prompts of equal lengths would decode together too (:func:`engine_generate`); prompts of different lengths
    share no position after the first ``m`` tokens, and the engine's step advances every row by the same position."""
    if single.B != 1:
        raise ValueError(f"engine_generate_ragged finishes each prompt on an engine of batch 1, got one of batch {single.B}")
    lens = [len(p) for p in prompts]
    if any(n == 0 for n in lens):
        raise ValueError("empty prompt")
    limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
    if any(n < 1 for n in limits):
        raise ValueError(f"max_new_tokens must be >= 1 for every prompt, got {min(limits)}")
    device = batch.device
    order = sorted(range(len(prompts)), key=lambda i: lens[i])  # groups of similar lengths: short own remainders
    out: list[list[int]] = [[] for _ in prompts]
    for g0 in range(0, len(order), batch.B):
        idx = order[g0 : g0 + batch.B]
        group = [torch.as_tensor(prompts[i], dtype=torch.long) for i in idx]
        m = min(lens[i] for i in idx)
        rows = group + [group[-1]] * (batch.B - len(group))
        batch.reset()
        logits = batch.prefill(torch.stack([p[:m] for p in rows]).to(device))  # (B, V)
        for r, (i, p) in enumerate(zip(idx, group)):
            single.load_row(batch, r)
            row_logits = single.prefill(p[None, m:].to(device)) if len(p) > m else logits[r : r + 1]
            out[i] = _decode(single, p[None].to(device), row_logits, max_new_tokens=limits[i], eos=eos, pad=pad)[0].tolist()
    return out


@torch.no_grad()
def generate(
    model,
    tokenizer,
    policy: Policy,
    prompt_ids: Tensor | list[int],
    *,
    layout: CacheLayout,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    streamer=None,
    path: Path = "auto",
    compile: bool = False,
) -> tuple[Tensor, GenerationStats]:
    """Generate under ``policy`` -> (new token ids (B, N), stats).

    ``prompt_ids``: (B, S) or a list of ids (one row); rows share one length (no padding).
    ``temperature == 0`` is greedy; ``seed`` seeds torch's global generator for sampling.
    ``path``: see the module docstring; ``compile`` compiles the engine's step (CUDA only; its
    artifacts are kept in :func:`kvpop.decode.engine.use_compile_cache`'s folder for the next process)."""
    device = model_device(model)
    policy.to(device)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chosen = choose_path(model, policy, path)
    if never_evicts(model, policy, layout, ids.shape[1] + max_new_tokens):
        policy = Dense()  # nothing can be evicted: the same tokens from dense's cache, without a bounded cache's bookkeeping
    sample = temperature > 0
    t0 = time.perf_counter()
    if chosen == "engine":
        engine = DecodeEngine(model, policy, layout=layout, max_len=ids.shape[1] + max_new_tokens,
                              batch_size=ids.shape[0], compile=compile)
        torch.manual_seed(seed)
        new = engine_generate(engine, ids, max_new_tokens=max_new_tokens, eos=_eos_ids(model, tokenizer), pad=pad,
                              temperature=temperature, top_p=top_p, top_k=top_k, streamer=streamer)
        nbytes = engine.cache_bytes()
    else:
        enable(model)
        # model.generate feeds the prompt and every new token but the last
        cache = new_cache(model, policy, layout, max_len=max(1, ids.shape[1] + max_new_tokens - 1))
        limit = getattr(cache, "max_prefill", None)  # a DynamicCache (dense) has none
        if limit is not None and ids.shape[1] > limit:  # the cache takes the prompt's rest one token at a time
            feed(model, cache, ids[:, :-1], prefill=limit)  # generate then feeds the last prompt token
        torch.manual_seed(seed)
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=top_p if sample else None,
            top_k=top_k if sample else None,
            pad_token_id=pad,
            streamer=streamer,
        )
        new = out[:, ids.shape[1] :]
        nbytes = cache_bytes(cache)
    seconds = time.perf_counter() - t0
    n = new.numel()
    stats = GenerationStats(
        prompt_tokens=ids.shape[1], new_tokens=n, seconds=seconds, tokens_per_s=n / max(seconds, 1e-9),
        peak_cache_mb=nbytes / 2**20, path=chosen,
    )
    return new, stats
