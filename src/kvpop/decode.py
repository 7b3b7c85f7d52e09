"""Decode-time eviction policies and generation with the bounded cache.

Every policy is a :class:`kvpop.cache.DecodePolicy` with one scoring hook; its declared
capabilities drive the orchestration:

* ``evicts = False`` (``dense``): a plain ``DynamicCache``, nothing is evicted;
* static priorities (``streaming_llm``, ``streaming_llm_plus``, ``kvpop_mlp``): the training-time
  policies of :mod:`kvpop.policies` through :class:`kvpop.cache.StaticPolicy`, scored once when a
  token enters the cache (the trained ones come from export folders, :func:`kvpop.export.load_export`);
* delayed priorities (``kvpop``, ``scores_on_exit = True``): the mLSTM scorer through
  :class:`kvpop.cache.DelayedPolicy`; its recurrent state lives in the cache and a token is scored
  when it leaves the window. At a nominal ``budget`` its cache keeps fewer long-range slots
  (:func:`kvpop.policies.long_range_slots`), so cache + state ~ the ``kvpop_mlp`` cache;
* ``needs_attention = True`` (``tova``, ``h2o``): re-scored from the attention of every query
  over the cache, computed in the cache's attention path. The statistic is per KV head, the mean
  of the weights of the query heads of its group.

A new rule is a dozen lines: subclass ``DecodePolicy``, override ``token_scores`` or
``slot_scores`` (or the recurrent hooks, with ``scores_on_exit = True``), add it to :data:`RULES`.

Shapes: B batch, Hk KV heads, Q queries, S sequence, T cache slots, V vocabulary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpop.cache import BoundedCache, DecodePolicy, StaticPolicy, as_decode_policy, cache_bytes, enable
from kvpop.policies import Policy, Recency


class Dense(DecodePolicy):
    """No eviction: a DynamicCache grows with the sequence."""

    name = "dense"
    evicts = False


class TOVA(DecodePolicy):
    """TOVA (Oren et al., 2024): drop the token the current query attends to least.

    Priority of a slot = attention from the latest query (mean over the KV head's query group);
    the window protects the most recent tokens, the leaver replaces the least-attended long-range
    slot iff it got at least as much attention."""

    name = "tova"
    needs_attention = True

    def slot_scores(self, prio, attn):
        return attn[:, :, -1]  # (B, Hk, T)


class H2O(DecodePolicy):
    """H2O (Zhang et al., 2023): the recent window plus the heavy hitters, the tokens with the
    largest attention accumulated over all queries since they entered the cache."""

    name = "h2o"
    needs_attention = True

    def slot_scores(self, prio, attn):
        return prio + attn.sum(2)  # (B, Hk, T)


RULES: dict[str, type[DecodePolicy]] = {"dense": Dense, "tova": TOVA, "h2o": H2O}
TRAINED = ("streaming_llm_plus", "kvpop_mlp", "kvpop")  # need the policy of an export folder
POLICIES = ("dense", "streaming_llm", *TRAINED, "tova", "h2o")


def make_decode_policy(name: str, trained: Policy | None = None) -> DecodePolicy:
    """A decode policy by name; ``trained`` is the export's policy (``load_export``) for trained ones."""
    if name in RULES:
        return RULES[name]()
    if name == "streaming_llm":
        return StaticPolicy(Recency(name))
    if name in TRAINED:
        if trained is None or trained.name != name:
            have = "none" if trained is None else repr(trained.name)
            raise ValueError(f"policy {name!r} needs an export folder trained with it (the checkpoint has {have})")
        return as_decode_policy(trained)  # StaticPolicy, or DelayedPolicy for a delayed scorer (kvpop)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def new_cache(model, policy: DecodePolicy, *, budget: int, sinks: int, window: int):
    """The cache a policy decodes with: a DynamicCache for dense, else a BoundedCache (``budget``
    nominal: the cache takes the policy's k)."""
    from transformers import DynamicCache

    if not policy.evicts:
        return DynamicCache(config=model.config)
    return BoundedCache(model.config, policy, budget=budget, sinks=sinks, window=window)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def teacher_forced_logits(model, policy: DecodePolicy, input_ids: Tensor, *, budget: int, sinks: int, window: int, prefill: int = 1) -> Tensor:
    """Logits (B, S, V) of decoding ``input_ids`` (B, S): ``prefill`` tokens at once, then one at a time."""
    enable(model)
    policy.to(_device(model))
    cache = new_cache(model, policy, budget=budget, sinks=sinks, window=window)
    B, S = input_ids.shape
    first = model(input_ids=input_ids[:, :prefill], past_key_values=cache).logits
    logits = first.new_empty(B, S, first.shape[-1])
    logits[:, :prefill] = first
    for t in range(prefill, S):
        logits[:, t] = model(input_ids=input_ids[:, t : t + 1], past_key_values=cache).logits[:, 0]
    return logits


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int  # decode steps x rows (rows that stopped early count their padding)
    seconds: float
    tokens_per_s: float
    peak_cache_mb: float  # allocated cache bytes at the end (the bounded cache never grows)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    policy: DecodePolicy,
    prompt_ids: Tensor | list[int],
    *,
    budget: int,
    sinks: int,
    window: int,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    streamer=None,
) -> tuple[Tensor, GenerationStats]:
    """Generate with ``model.generate`` over the policy's cache -> (new token ids (B, N), stats).

    ``prompt_ids``: (B, S) or a list of ids (one row); rows share one length (no padding).
    ``temperature == 0`` is greedy; ``seed`` seeds torch's global generator for sampling."""
    enable(model)
    device = _device(model)
    policy.to(device)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    cache = new_cache(model, policy, budget=budget, sinks=sinks, window=window)
    torch.manual_seed(seed)
    sample = temperature > 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
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
    seconds = time.perf_counter() - t0
    new = out[:, ids.shape[1] :]
    n = new.numel()
    stats = GenerationStats(
        prompt_tokens=ids.shape[1], new_tokens=n, seconds=seconds, tokens_per_s=n / max(seconds, 1e-9),
        peak_cache_mb=cache_bytes(cache) / 2**20,
    )
    return new, stats
