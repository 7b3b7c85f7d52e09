"""Teacher-forced fidelity of eviction policies against the dense teacher.

For every held-out trace (one per row, unpacked) and every policy, the model runs under the
policy's pattern at the run's budget and is compared with the dense teacher on the same text:

* ``kl``: mean over scored positions of KL(p_dense || p_policy), full vocabulary, clamped at 0 (a
  policy that evicts nothing can sum to a tiny negative by float rounding);
* ``top1_agreement``: how often the argmax tokens agree;
* ``quote_accuracy``: top-1 accuracy on the recorded long-range quote tokens (the digits a later
  step copies from a definition many hundreds of tokens back);
* ``occupancy``: the entries held at the trace's last token, over the capacity ``sinks + window + k``
  (mean over layers, KV heads and traces): 1 for a top-k rule on a trace longer than its budget,
  below 1 for a gate that evicts more than the budget needs (``dms``), ``S / budget`` for dense;
* ``fill``: the entries held at the trace's last token over ``min(S, capacity)``, what a rule that
  evicts only when its cache is full holds (mean over traces): 1 for dense and every top-k rule, also
  on traces shorter than the budget; below 1 for a gate that evicts below its budget (``dms``);
* ``occupancy_map`` (policies with a full-sequence pattern): the same per layer and KV head,
  ``[layer][head]``, mean over traces (its mean is ``occupancy``): 1 everywhere for a top-k rule, below 1
  where a gate evicts more than it must (``dms``), above 1 where a ``one_pool`` policy
  (``dbtrimkv``) gave a head more of its one pool than the per-head budget;
* ``per_trace``: each scored trace's record index, quote hits and quote tokens, KL sum and scored tokens
  (:data:`PER_TRACE_KEYS`, one list entry per trace), for paired intervals between policies on the same rows
  (``bench/quality_report.py``).

Scored positions are the next-token predictions of assistant tokens (the trace's loss mask).

Oracle policies (``oracle_target``, ``oracle_sources``: ceilings that read the trace's future) see
each trace first (:meth:`kvpop.policies.Policy.fit_trace`); ``oracle_target`` ranks by the dense
teacher's own training target on the trace, recorded during the dense reference forward that every
trace runs anyway (:class:`TargetCapture`, no extra forward).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpop.attention import SparseContext
from kvpop.geometry import CacheLayout
from kvpop.modeling import model_shape
from kvpop.policies import Dense, OnePool, Policy
from kvpop.policies.one_pool import ONE_POOL_SUFFIX
from kvpop.pool import check_policy_layout, pool_chunked
from kvpop.selection import NEVER, global_decaying_eviction_times
from kvpop.target import TargetKind, future_attention_target

#: what a per-head floor adds to a one-pool row's name, before the floor (``"kvpop_mlp_pool, floor 32"``)
FLOOR_SUFFIX = ", floor "

TargetKey = tuple[str, float]  # (kind, beta) of a TargetSpec (train.target): what future_attention_target computes


@dataclass
class Candidate:
    """A policy with the model it runs on.

    A policy with a full-sequence pattern runs one masked forward per trace (fast); rules that
    exist only at decode time (``needs_attention``: TOVA, H2O) are scored by teacher-forced
    decoding through the reference cache.
    """

    name: str
    model: object
    policy: Policy
    max_traces: int | None = None  # score only the first records (token-by-token decoding is slow)


def one_pool_twin(c: Candidate) -> Candidate | None:
    """``c``'s policy ranked with one pool of slots for the whole model (:class:`kvpop.policies.OnePool`),
    on the same model, named ``"<name>, one pool"``; None if its priorities cannot be ranked so
    (:meth:`~kvpop.policies.OnePool.accepts`: a learned ``kvpop_mlp`` or an oracle, whose twin is a ceiling)."""
    return Candidate(c.name + ONE_POOL_SUFFIX, c.model, OnePool(c.policy), c.max_traces) if OnePool.accepts(c.policy) else None


def floor_twin(c: Candidate, floor: int) -> Candidate:
    """``c``'s ``one_pool`` policy ranked with a per-head ``floor`` (:meth:`kvpop.policies.Policy.with_floor`: no layer's KV
    head keeps fewer than ``floor`` long-range entries), on the same model, named ``"<name>, floor <floor>"``."""
    return Candidate(f"{c.name}{FLOOR_SUFFIX}{floor}", c.model, c.policy.with_floor(floor), c.max_traces)


def ranked_policy(name: str) -> str:
    """The policy a candidate ranks: ``name`` itself, or the policy of a one-pool or floor twin (``"kvpop_mlp, one pool"``:
    ``kvpop_mlp``; ``"kvpop_mlp_pool, floor 32"``: ``kvpop_mlp_pool``), whose export, training and weights it shares."""
    return re.sub(rf"{FLOOR_SUFFIX}\d+$", "", name).removesuffix(ONE_POOL_SUFFIX)


#: the lists of a policy's ``per_trace`` result (:func:`evaluate_fidelity`), one entry per scored trace
PER_TRACE_KEYS = ("trace", "quote_hits", "quote_tokens", "kl_sum", "tokens")


@dataclass
class _Acc:
    kl: float = 0.0
    agree: int = 0
    tokens: int = 0
    quote_hit: int = 0
    quotes: int = 0
    occupancy: float = 0.0  # summed over traces
    fill: float = 0.0  # summed over traces
    occupancy_map: Tensor | None = None  # (L, Hk) summed over traces (policies with a full-sequence pattern)
    #: each scored trace's own sums, for paired comparisons on the same rows (bench/quality_report.py's intervals):
    #: {"trace": record index, "quote_hits", "quote_tokens", "kl_sum", "tokens": one list entry per trace}
    per_trace: dict[str, list] = field(default_factory=lambda: {k: [] for k in PER_TRACE_KEYS})

    traces: int = 0

    def add_trace(self, n: int, *, kl_sum: float, tokens: int, quote_hits: int, quotes: int) -> None:
        """Record index ``n``'s sums: added to the totals and kept apart in :attr:`per_trace`."""
        self.kl += kl_sum
        self.tokens += tokens
        self.quote_hit += quote_hits
        self.quotes += quotes
        for key, value in zip(PER_TRACE_KEYS, (n, quote_hits, quotes, round(kl_sum, 9), tokens), strict=True):
            self.per_trace[key].append(value)

    def result(self) -> dict[str, float]:
        extra = {}
        if self.occupancy_map is not None:
            extra["occupancy_map"] = [[round(x, 4) for x in row] for row in (self.occupancy_map / max(1, self.traces)).tolist()]
        return {
            "traces": self.traces,
            "tokens": self.tokens,
            "kl": max(0.0, self.kl / max(1, self.tokens)),  # KL >= 0: a negative is float rounding
            "top1_agreement": self.agree / max(1, self.tokens),
            "quote_accuracy": self.quote_hit / max(1, self.quotes),
            "quote_tokens": self.quotes,  # 0: the records mark no quote (quote_accuracy then says nothing)
            "occupancy": self.occupancy / max(1, self.traces),
            "fill": self.fill / max(1, self.traces),
            "per_trace": self.per_trace,
            **extra,
        }


@dataclass
class TargetCapture(SparseContext):
    """The dense forward (``policy`` Dense) that also records, in every layer, the training target
    (:func:`kvpop.target.future_attention_target`) of each requested kind: ``targets[key][layer]``
    (B, Hk, S). ``target_doc_ids`` (B, S) marks right padding with -1 for the target alone (padding
    sends no attention); the forward itself sees ``doc_ids``, as every other candidate does."""

    kinds: tuple[TargetKey, ...] = ()
    target_doc_ids: Tensor | None = None
    targets: dict[TargetKey, dict[int, Tensor]] = field(default_factory=dict)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        never = torch.full(k.shape[:3], NEVER, dtype=torch.int64, device=k.device)
        out, lse = self.run(q, k, v, never, scale, need_lse=bool(self.kinds), layer_key="dense", keep=True)
        doc = self.doc_ids if self.target_doc_ids is None else self.target_doc_ids
        for kind, beta in self.kinds:
            self.targets.setdefault((kind, beta), {})[layer] = future_attention_target(
                q, k, lse, doc, window=self.layout.window, scale=scale, kind=kind, beta=beta, impl="flex" if self.executor == "flex" else "chunked",
            )
        return out.transpose(1, 2).contiguous()


def _forward(model, policy: Policy, input_ids: Tensor, *, layout: CacheLayout, kinds: tuple[TargetKey, ...] = (),
             length: int | None = None) -> tuple[Tensor, dict[TargetKey, list[Tensor]]]:
    """(logits (S, V) float32, {key: per-layer (1, Hk, S) targets}) of one trace (1, S); targets only
    for ``kinds`` (then ``policy`` must be dense). ``length``: tokens of the trace before right padding."""
    S = input_ids.shape[1]
    pos = torch.arange(S, device=input_ids.device)[None]
    doc = torch.zeros_like(pos)
    kw = dict(layout=layout, executor="flex" if input_ids.is_cuda else "sdpa")
    if not kinds:
        ctx = SparseContext.for_rows(policy, doc, pos, **kw)
        return model(input_ids=input_ids, position_ids=pos, kvpop_ctx=ctx).logits[0].float(), {}
    if policy.evicts:
        raise ValueError(f"targets come from the dense forward, not from {policy.name!r}")
    tdoc = torch.where(pos < (S if length is None else length), 0, -1)
    ctx = TargetCapture.for_rows(policy, doc, pos, kinds=tuple(kinds), target_doc_ids=tdoc, **kw)
    logits = model(input_ids=input_ids, position_ids=pos, kvpop_ctx=ctx).logits[0].float()
    return logits, {key: [t[i] for i in sorted(t)] for key, t in ctx.targets.items()}


@dataclass
class EvictionCapture(SparseContext):
    """A policy's forward that also records each layer's eviction times ``evict[layer]`` (B, Hk, S):
    token ``j`` is attendable by queries ``j .. evict - 1`` (``NEVER``: to the end)."""

    evict: dict[int, Tensor] = field(default_factory=dict)

    def evictions(self, layer: int, k: Tensor, v: Tensor):
        evict, scores = super().evictions(layer, k, v)
        self.evict[layer] = evict
        return evict, scores


def held_map(evict: Tensor, capacity: int) -> Tensor:
    """Eviction times (L, Hk, S) of one trace -> (L, Hk) float64: the entries each layer's KV head holds
    at the last query (attendable by it; sinks have ``NEVER``), over ``capacity``."""
    return (evict > evict.shape[-1] - 1).sum(-1).double().cpu() / capacity


@torch.no_grad()
def captured_forward(model, policy: Policy, input_ids: Tensor, *, layout: CacheLayout) -> tuple[Tensor, Tensor]:
    """One trace (1, S) under a policy's full-sequence pattern -> (logits (S, V) float32, every layer's
    eviction times (L, Hk, S); dense: ``NEVER``).

    A ``one_pool`` policy's pattern in one layer depends on every layer's scores: it is the fixed point
    of :func:`pool_fixed_point`, reached in one chunked pass (:func:`kvpop.pool.pool_chunked`; an oracle, whose
    priorities are fixed per trace rather than per token, by the fixed point itself)."""
    S = input_ids.shape[1]
    if not policy.one_pool:
        pos = torch.arange(S, device=input_ids.device)[None]
        ctx = EvictionCapture.for_rows(policy, torch.zeros_like(pos), pos, layout, executor="flex" if input_ids.is_cuda else "sdpa")
        logits = model(input_ids=input_ids, position_ids=pos, kvpop_ctx=ctx).logits[0].float()
        return logits, torch.stack([ctx.evict[i][0] for i in sorted(ctx.evict)])
    if policy.oracle:
        evict, logits = pool_fixed_point(model, policy, input_ids, layout=layout, keep_logits=True)
    else:
        evict, logits = pool_chunked(model, policy, input_ids, layout=layout, keep_logits=True)
    return logits[0], evict[:, 0]


def _pool_forward(model, policy: Policy, input_ids: Tensor, evict: Tensor | None, *, layout: CacheLayout, logits: bool) -> tuple[SparseContext, Tensor | None]:
    """One forward of B traces (B, S), one document per row, under a ``one_pool`` policy's eviction
    times (L, B, Hk, S) (None: no eviction); (its context, which recorded every layer's scores, and the
    logits (B, S, V) float32, or None: ``logits=False`` computes the last position's only)."""
    B, S = input_ids.shape
    pos = torch.arange(S, device=input_ids.device).expand(B, S)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout, global_evict=evict, executor="flex" if input_ids.is_cuda else "sdpa")
    out = model(input_ids=input_ids, position_ids=pos, kvpop_ctx=ctx, **({} if logits else {"logits_to_keep": 1}))
    return ctx, out.logits.float() if logits else None


@torch.no_grad()
def pool_fixed_point(model, policy: Policy, input_ids: Tensor, *, layout: CacheLayout, keep_logits: bool = False) -> tuple[Tensor, Tensor | None]:
    """(Eviction times (L, B, Hk, S), logits (B, S, V) under them if ``keep_logits``, else None) of a
    ``one_pool`` policy on B traces of one length (B, S) at once, one trace per row: the fixed point of
    "forward under E, simulate the pool on the recorded priorities", started from no eviction (why it
    is unique, reached within ``ceil((S - budget) / window) + 1`` forwards and equal to decoding:
    :mod:`kvpop.decode.one_pool`; a score read ``d`` tokens late, ``window - d`` for ``window``:
    :mod:`kvpop.policies.kvpop_pool`), with the pool's simulation vectorized over the rows.
    The simulation is sequential over queries and costs about as much for 16 rows as for one, so
    batching the traces divides the fixed point's cost by about B (without ``keep_logits`` the
    forwards skip the vocabulary projection but the last position's: :func:`forward_under` then)."""
    check_policy_layout(policy, layout, head_dim=model_shape(model)["head_dim"])
    B, S = input_ids.shape
    pos = torch.arange(S, device=input_ids.device).expand(B, S)
    doc = torch.zeros_like(pos)
    evict, run = None, None  # (L, B, Hk, S); the last simulation, which the next one continues where the scores changed
    step = layout.window - (policy.read_delay(layout.window) or 0)  # queries each forward settles (kvpop.policies.kvpop_pool: window - delay)
    for _ in range(max(0, -(-(S - layout.slots) // step)) + 2):
        ctx, logits = _pool_forward(model, policy, input_ids, evict, layout=layout, logits=keep_logits)  # records each layer's scores
        prio = torch.stack([ctx.global_prio[i] for i in sorted(ctx.global_prio)])  # (L, B, Hk, S) log beta
        new, run = global_decaying_eviction_times(prio, doc, pos, sinks=layout.sinks, window=layout.window, long_range=layout.long_range, previous=run,
                                                  keep_run=True, decays=policy.decays, floor=layout.floor)
        unchanged = bool((new >= S).all()) if evict is None else torch.equal(new, evict)  # first pass: nothing was evicted
        if unchanged:
            return new, logits  # the last forward ran under exactly these times
        evict = new
    raise RuntimeError(f"the pool's pattern of {policy.name!r} did not reach its fixed point; its scores are not causal")


@torch.no_grad()
def forward_under(model, policy: Policy, input_ids: Tensor, evict: Tensor, *, layout: CacheLayout) -> Tensor:
    """Logits (B, S, V) float32 of B traces (B, S) under a ``one_pool`` policy's eviction times (L, B, Hk, S)."""
    return _pool_forward(model, policy, input_ids, evict, layout=layout, logits=True)[1]


@torch.no_grad()
def keep_map(model, policy: Policy, input_ids: Tensor, *, layout: CacheLayout) -> Tensor:
    """Which positions each layer's KV heads keep over one trace (1, S) under ``policy``, from the
    training forward's own eviction times: (L, Hk, S) float in [0, 1], the share of its remaining
    trace that token ``j`` stayed attendable, ``(min(evict_j, S) - j) / (S - j)``; 1 = kept to the end."""
    S = input_ids.shape[1]
    _, evict = captured_forward(model, policy, input_ids, layout=layout)
    evict = evict.clamp(max=S).float().cpu()  # (L, Hk, S)
    j = torch.arange(S, dtype=torch.float32)
    keep = ((evict - j) / (S - j)).clamp(0, 1)
    keep[..., : layout.sinks] = 1.0  # sinks are never evicted, whatever their eviction time says
    return keep


@torch.no_grad()
def teacher_targets(model, input_ids: Tensor, *, window: int, kind: TargetKind = "max", beta: float = 8.0, length: int | None = None) -> list[Tensor]:
    """The training target of ``kind`` (and ``beta``, kind power; a TargetSpec's, before its scope) of every
    layer from the dense ``model`` on one trace (1, S): a list of (1, Hk, S) float32; ``length``: tokens of
    the trace proper, the rest right padding."""
    key = (kind, float(beta))
    _, t = _forward(model, Dense(), input_ids, layout=CacheLayout.of(sinks=0, window=window, long_range=input_ids.shape[1]), kinds=(key,), length=length)
    return t[key]


def _pool_patterns(records, candidates, layouts: dict[str, CacheLayout], *, device, pool_batch: int | None) -> dict[tuple[str, int], Tensor]:
    """(candidate name, record index) -> eviction times (L, Hk, S) of every ``one_pool`` candidate,
    from batched chunked pool forwards (:func:`kvpop.pool.pool_chunked`, the fixed point's twin) over records of equal length."""
    out = {}
    for c in candidates:
        if c.policy.needs_attention or not c.policy.one_pool or c.policy.oracle:  # an oracle reads one trace at a time
            continue
        by_len: dict[int, list[int]] = {}
        for n, rec in enumerate(records[: c.max_traces]):
            by_len.setdefault(len(rec["input_ids"]), []).append(n)
        for S, idx in by_len.items():
            batch = pool_batch or (16 if torch.device(device).type == "cuda" else max(1, 2**27 // (S * S)))
            for i in range(0, len(idx), batch):
                chunk = idx[i : i + batch]
                ids = torch.tensor([records[n]["input_ids"] for n in chunk], device=device)
                evict, _ = pool_chunked(c.model, c.policy, ids, layout=layouts[c.name])  # (L, B, Hk, S)
                out.update({(c.name, n): evict[:, b] for b, n in enumerate(chunk)})
    return out


def score_positions(record: dict) -> tuple[Tensor, Tensor]:
    """Prediction positions i (predicting token i + 1) of assistant tokens, and of quote tokens."""
    lm = torch.tensor(record["loss_mask"])
    scored = (lm[1:] > 0).nonzero().squeeze(-1)  # predicts token i + 1
    quotes = torch.tensor([q - 1 for q in record.get("quote_positions", []) if q >= 1], dtype=torch.long)
    return scored, quotes


def pad_records(records: Sequence[dict], length: int, pad_id: int) -> list[dict]:
    """Records right-padded to ``length`` tokens: one shape for every trace, so that a compiled
    FlexAttention on CUDA compiles once (a compile per length would run into dynamo's recompile
    limit). The padding is never scored (``loss_mask`` 0) and causal attention keeps it out of every
    real position; ``trace_tokens`` tells the target and the oracles where the trace ends. A record
    longer than ``length`` is a ValueError naming it."""
    out = []
    for r in records:
        n = len(r["input_ids"])
        if n > length:
            raise ValueError(f"record {r.get('id', '?')!r} has {n} tokens, more than the padded length {length}")
        pad = length - n
        out.append({**r, "input_ids": r["input_ids"] + [pad_id] * pad, "loss_mask": r["loss_mask"] + [0] * pad, "trace_tokens": n})
    return out


@torch.no_grad()
def evaluate_fidelity(
    records: Sequence[dict],
    teacher,
    candidates: Iterable[Candidate],
    *,
    layout: CacheLayout,
    device: str | torch.device = "cpu",
    progress: Callable[[int, int], None] | None = None,
    pool_batch: int | None = None,
) -> dict[str, dict[str, float]]:
    """Per-policy fidelity metrics over the records at one nominal ``layout`` (see module docstring).

    A ``one_pool`` policy's eviction times come first, from :func:`pool_fixed_point` on up to
    ``pool_batch`` traces of one length at a time (default: 16 on CUDA; on the CPU, whose attention
    mask is dense, as many as keep ``B x S x S`` under 2**27); its logits then from one forward per trace.

    A policy that scored no trace (an oracle whose input no record has) is left out of the result."""
    candidates = list(candidates)
    layouts = {
        c.name: layout.for_policy(c.policy, head_dim=model_shape(c.model)["head_dim"])
        for c in candidates
        if not c.policy.needs_attention
    }
    acc = {c.name: _Acc() for c in candidates}
    dense = Dense()
    pool_times = _pool_patterns(records, candidates, layouts, device=device, pool_batch=pool_batch)
    # the oracles' teacher targets come with the reference forward
    kinds = tuple(sorted({k for c in candidates if (k := c.policy.teacher_target()) is not None}))
    for n, rec in enumerate(records):
        ids = torch.tensor(rec["input_ids"], device=device)[None]
        scored, quotes = score_positions(rec)
        scored, quotes = scored.to(device), quotes.to(device)
        ref, tgts = _forward(teacher, dense, ids, layout=layout, kinds=kinds,
                             length=rec.get("trace_tokens"))  # (S, V); trace_tokens: where a right-padded trace ends
        # the softmaxes over the vocabulary only at the scored rows (row-wise, so equal to slicing a full one): a
        # RULER sample scores its few answer tokens, and (S, V) float copies of a 4K prompt are 0.8 GB each
        ref_s = ref[scored]  # (N, V) float32
        ref_logp, ref_top = torch.log_softmax(ref_s, -1), ref_s.argmax(-1)  # (N, V), (N,)
        del ref_s
        targets = ids[0, 1:]
        for c in candidates:
            if c.max_traces is not None and n >= c.max_traces:
                continue
            if c.policy.oracle and not c.policy.fit_trace(input_ids=ids, record=rec, targets=tgts):
                continue  # the trace lacks what this oracle reads (e.g. no recorded quote sources)
            acc[c.name].traces += 1
            if c.policy.needs_attention:
                from kvpop.decode import teacher_forced_logits
                from kvpop.decode.generate import new_cache

                prefill = min(layout.budget, ids.shape[1])  # nothing is evicted before the cache is full
                cache = new_cache(c.model, c.policy, layout)
                logits = teacher_forced_logits(c.model, c.policy, ids, layout=layout, prefill=prefill, cache=cache)[0].float()
                held = torch.stack([(layer.pos >= 0).sum(-1).double().mean() for layer in cache.layers]).mean().item()
                occupancy, fill = held / cache.slots, held / min(ids.shape[1], cache.slots)
            elif c.policy.name == "dense" and c.model is teacher:
                logits, occupancy, fill = ref, ids.shape[1] / layout.budget, 1.0
            else:
                if (c.name, n) in pool_times:
                    evict = pool_times[c.name, n]  # (L, Hk, S)
                    logits = forward_under(c.model, c.policy, ids, evict[:, None], layout=layouts[c.name])[0]
                else:
                    logits, evict = captured_forward(c.model, c.policy, ids, layout=layouts[c.name])
                m = held_map(evict, layouts[c.name].slots)  # (L, Hk)
                occupancy = m.mean().item()
                slots = layouts[c.name].slots
                fill = occupancy * slots / min(ids.shape[1], slots) if c.policy.evicts else 1.0
                acc[c.name].occupancy_map = m if acc[c.name].occupancy_map is None else acc[c.name].occupancy_map + m
            at = logits[scored].float()  # (N, V): each row gathered once
            kl = (ref_logp.exp() * (ref_logp - torch.log_softmax(at, -1))).sum(-1)  # (N,)
            a = acc[c.name]
            a.agree += (at.argmax(-1) == ref_top).sum().item()
            a.occupancy += occupancy
            a.fill += fill
            hits = (logits.argmax(-1)[quotes] == targets[quotes]).sum().item() if quotes.numel() else 0
            a.add_trace(n, kl_sum=kl.sum().item(), tokens=scored.numel(), quote_hits=hits, quotes=quotes.numel())
        if progress:
            progress(n + 1, len(records))
    # an oracle that no trace could serve (e.g. oracle_sources without recorded sources) reports nothing
    return {name: a.result() for name, a in acc.items() if a.traces}


#: which oracles score other text: ``oracle_target`` ranks each piece by the dense teacher's own target on it (the
#: ceiling of a perfectly fitted scorer there: does a target that serves the traces serve code?); ``oracle_sources``
#: reads the quotes' recorded sources, which other text has none of
OTHER_TEXT_ORACLES = ("oracle_target: the ceiling of the training target on each piece; oracle_sources: none "
                      "(it reads recorded quote sources, which other text has none of)")


@torch.no_grad()
def evaluate_other_text(
    pieces: Mapping[str, Sequence[dict]],
    teacher,
    candidates: Iterable[Candidate],
    *,
    layout: CacheLayout,
    device: str | torch.device = "cpu",
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, dict[str, dict[str, float]]]:
    """Does a policy harm text unlike its training rows? ``{kind: {policy: {"kl", "top1_agreement",
    "pieces"}}}`` of every candidate on each kind's pieces (``{kind: records}``, e.g. from
    :func:`kvpop.data.other_text.held_out_records`; every next-token prediction scored), teacher-forced
    against ``teacher``'s dense attention (:func:`evaluate_fidelity`: a trained export is compared with
    the base model, so fine-tuning and eviction count together, as a user sees them).

    Candidates as for fidelity: a decode-only rule (``needs_attention``: TOVA, H2O) scores its first
    ``max_traces`` pieces by token-by-token decoding (``pieces`` says how many); an oracle gets a row
    where it applies to the pieces (:data:`OTHER_TEXT_ORACLES`). A kind without pieces is left out."""
    out = {}
    for kind, records in pieces.items():
        if not records:
            continue
        tick = (lambda i, n, kind=kind: progress(kind, i, n)) if progress else None
        res = evaluate_fidelity(records, teacher, candidates, layout=layout, device=device, progress=tick)
        out[kind] = {name: {"kl": m["kl"], "top1_agreement": m["top1_agreement"], "pieces": m["traces"]} for name, m in res.items()
                     if m["traces"]}  # an oracle that applies to none of the pieces has no row
    return out
