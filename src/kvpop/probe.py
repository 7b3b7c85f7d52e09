"""The scorer-fit probe: what a target allows against what a scorer fits of it, with the model frozen.

Training (:mod:`kvpop.train`) fine-tunes the student *and* fits the scorer, so a poor result can be
the target's or the fit's. The probe separates them. The dense teacher runs once per training trace
and its keys, values and targets (every layer; :class:`kvpop.evaluate.TargetCapture`) are cached
(:func:`teacher_cache`); each *variant* then fits a fresh scorer on the cache alone (:func:`fit_scorer`),
with training's own loss path (:meth:`kvpop.attention.SparseContext.add_scorer_loss`: the target's
scope, :func:`kvpop.boundary.boundary_loss`, :func:`kvpop.boundary.calibration_loss`), optimizer
settings and schedule (:func:`kvpop.train.scorer_schedule`). The model is never fine-tuned. On the same
held-out traces (:func:`evaluate`, through :func:`kvpop.evaluate.evaluate_fidelity`) stand:

* the baselines ``dense``, ``streaming_llm`` and ``oracle_sources`` (keeps what the quotes copy);
* each variant's ceiling ``oracle_target (<target>)``: the teacher's own ranking by the variant's
  target on the evaluated trace (with its ``scorer_recency``), what a perfect fit would give;
* each fitted scorer, ``<policy> [<variant>]``;
* with ``one_pool``, the one-pool twin of every row that has one (:func:`kvpop.evaluate.one_pool_twin`).

A variant is not a label: it is the pipeline's params with dotted overrides, as ``dvc exp run -S``
takes them (``train.target=max.model``, ``train.boundary_weight=regret``,
``train.scorer_calibration=1``, ``train.policies=[kvpop_mlp]``), validated by
:func:`kvpop.config.parse_params` (:func:`make_variant`): every knob has its params.yaml name, and a
bad one is refused before any work with the key named. Variants differ only in ``train.*`` and
``seed``: budget, sinks and window are the comparison's geometry and the cache's, the data come from
the files. A variant fits every policy of its ``train.policies`` that trains a scorer by the boundary
loss (learned, not gated: ``kvpop_mlp``, ``kvpop``).

Where the probe differs from training, on purpose: the targets are the dense teacher's (the
normalizer of ``train.target_normalizer: dense``, as ``oracle_target``'s ceiling; training's default
``sparse`` uses the student's own sparse attention, which a frozen cache cannot give), one trace per
step (traces are not packed), and the cached keys and values are bfloat16 (half the memory; the
scorer reads them as float32).

Shapes: L layers, Hk KV heads, S sequence, D head dim.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

from kvpop.attention import SparseContext
from kvpop.config import Params, ParamsError, parse_params
from kvpop.evaluate import Candidate, TargetCapture, evaluate_fidelity, evaluate_other_text, one_pool_twin
from kvpop.filter import iter_jsonl
from kvpop.geometry import CacheLayout
from kvpop.policies import Dense, Policy, make_policy, policy_class
from kvpop.train import EpochBatches, TrainSettings, scorer_schedule, training_policy

#: what the cache file says it is, and the layout of its contents; a file of another version is refused
CACHE_FORMAT = "kvpop.probe teacher cache"
CACHE_VERSION = 2
#: training-free rows beside the ceilings and the fits
BASELINES = ("dense", "streaming_llm", "oracle_sources")
#: the only params a variant may override: what one fit depends on (the rest is the comparison's and the cache's)
VARIANT_KEYS = ("train", "seed")

TargetKey = tuple[str, float]  # (kind, beta) of a target before its scope (kvpop.evaluate.TargetKey)


class ProbeError(ValueError):
    """A bad variant, override or input; the message names the key or the file."""


class CacheError(RuntimeError):
    """A teacher cache that cannot be used (unreadable, not a cache, another version); names the file."""


# --- variants --------------------------------------------------------------------------------------


def split_overrides(text: str) -> list[str]:
    """``"a=1,b.c=[x, y]"`` -> ``["a=1", "b.c=[x, y]"]``: commas inside brackets, braces or quotes stay."""
    out, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return [o for o in out if o]


def parse_override(item: str) -> tuple[str, Any]:
    """``"train.target=max.model"`` -> ``("train.target", "max.model")``; the value is read as YAML, as
    ``dvc exp run -S`` reads it (``1`` an int, ``[kvpop_mlp]`` a list, ``{kind: max}`` a mapping)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ProbeError(f"override {item!r}: expected KEY=VALUE with KEY a dotted params.yaml key (e.g. train.target=max.model)")
    if key.split(".")[0] not in VARIANT_KEYS:
        raise ProbeError(f"override {item!r}: {key} is not a variant's to set (only {', '.join(k + '.*' if k == 'train' else k for k in VARIANT_KEYS)}: "
                         "budget, sinks and window are the comparison's geometry, set them in the params file)")
    try:
        return key, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ProbeError(f"override {key}: the value {raw!r} is not valid YAML ({err})") from None


@dataclass(frozen=True)
class Variant:
    """The pipeline's params with overrides: what one fit reads (``params.train``, ``params.seed``)."""

    overrides: tuple[str, ...]
    params: Params

    @property
    def name(self) -> str:
        """``"train.target=max.model, train.boundary_weight=regret"``; ``"params"`` without overrides."""
        return ", ".join(self.overrides) or "params"


def make_variant(params: Params, overrides: Iterable[str] = ()) -> Variant:
    """``params`` with dotted ``overrides`` applied and validated by :func:`kvpop.config.parse_params`;
    a :class:`ProbeError` naming the key otherwise (an unknown key, a bad value, a key of another section)."""
    overrides = tuple(overrides)
    raw = params.model_dump(mode="json")
    for item in overrides:
        key, value = parse_override(item)
        *parents, last = key.split(".")
        node = raw
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ProbeError(f"override {item!r}: {'.'.join(parents[: i + 1])} is a value, not a section")
            node = child
        node[last] = value
    try:
        merged = parse_params(raw)
    except ParamsError as err:
        raise ProbeError(f"variant {', '.join(overrides)!r}: {err}") from None
    if not fitted_policies(merged):
        raise ProbeError(f"variant {', '.join(overrides) or 'params'!r}: train.policies {merged.train.policies} has no policy with a scorer "
                         "the boundary loss trains (kvpop_mlp, kvpop)")
    return Variant(overrides, merged)


def fitted_policies(params: Params) -> list[str]:
    """The policies of ``train.policies`` whose scorer the boundary loss trains (learned, not gated)."""
    return [n for n in params.train.policies if policy_class(n).learned and not policy_class(n).gated]


def target_key(params: Params) -> TargetKey:
    """The (kind, beta) of ``train.target`` that the teacher records; its scope is applied at the loss."""
    t = params.train.target
    return t.kind, float(t.beta)


# --- data ------------------------------------------------------------------------------------------


def read_records(path: str | Path, n: int) -> list[dict]:
    """The first ``n`` records of a filter-stage JSONL file (:func:`kvpop.filter.iter_jsonl`); a
    :class:`ProbeError` naming the file if it holds none."""
    recs = list(islice(iter_jsonl(path), n))
    if not recs:
        raise ProbeError(f"{path}: no records")
    return recs


def mix_records(tokenizer, n: int, *, max_tokens: int) -> list[dict]:
    """Up to ``n`` pieces each of code and prose (:mod:`kvpop.data.other_text`, as the filter stage's
    ``filter.other_text``), each at most ``max_tokens`` tokens, as training records."""
    from kvpop.data.other_text import KINDS, other_text_records, token_ids

    return [r for kind in KINDS for r in other_text_records(token_ids(tokenizer), kind, n, max_tokens=max_tokens)]


# --- the teacher cache -----------------------------------------------------------------------------


@dataclass
class CachedTrace:
    """One training trace as the dense teacher saw it."""

    k: Tensor  # (L, Hk, S, D) bfloat16 keys, as the attention receives them
    v: Tensor  # (L, Hk, S, D) bfloat16 values
    targets: dict[TargetKey, Tensor]  # (kind, beta) -> (L, Hk, S) float32, before any scope
    source: str = ""  # where the trace came from (a record's id or source)

    def to(self, device) -> CachedTrace:
        return CachedTrace(self.k.to(device), self.v.to(device), {key: t.to(device) for key, t in self.targets.items()}, self.source)


def _key_name(key: TargetKey) -> str:
    return f"{key[0]}:{key[1]!r}"


def _key_of(name: str) -> TargetKey:
    kind, _, beta = name.partition(":")
    return kind, float(beta)


@torch.no_grad()
def capture_trace(teacher, input_ids: Tensor, *, window: int, kinds: Sequence[TargetKey]) -> CachedTrace:
    """One dense teacher forward of a trace ``input_ids`` (1, S) that records every layer's keys and
    values and the targets of ``kinds`` (:class:`kvpop.evaluate.TargetCapture`)."""
    kv: dict[int, tuple[Tensor, Tensor]] = {}

    class _Capture(TargetCapture):
        def attend(self, layer, q, k, v, scale):  # q (1, H, S, D); k, v (1, Hk, S, D)
            kv[layer] = (k[0].to(torch.bfloat16), v[0].to(torch.bfloat16))
            return super().attend(layer, q, k, v, scale)

    S = input_ids.shape[1]
    pos = torch.arange(S, device=input_ids.device)[None]  # (1, S)
    doc = torch.zeros_like(pos)
    ctx = _Capture.for_rows(Dense(), doc, pos, CacheLayout.of(sinks=0, window=window, long_range=S), executor="sdpa", kinds=tuple(kinds))
    teacher(input_ids=input_ids, position_ids=pos, kvpop_ctx=ctx)
    L = len(kv)
    return CachedTrace(
        k=torch.stack([kv[i][0] for i in range(L)]).cpu(),  # (L, Hk, S, D)
        v=torch.stack([kv[i][1] for i in range(L)]).cpu(),
        targets={key: torch.cat([t[i] for i in range(L)]).float().cpu() for key, t in ctx.targets.items()},  # L x (1, Hk, S) -> (L, Hk, S)
    )


def teacher_fingerprint(model) -> str:
    """A content fingerprint of a model's weights: names, shapes, dtypes and two moments of every
    parameter, computed where the parameters live (no copy of the weights)."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            x = p.detach().double().flatten()
            ramp = torch.linspace(-1.0, 1.0, x.numel(), dtype=torch.float64, device=x.device)
            h.update(f"{name}|{tuple(p.shape)}|{p.dtype}|{float(x.sum()):.12g}|{float((x * ramp).sum()):.12g}\n".encode())
    return h.hexdigest()


def cache_ident(teacher_fp: str, records: Sequence[dict], *, window: int) -> dict:
    """What a cache's contents depend on: the teacher, the traces' tokens (in order) and the window."""
    h = hashlib.sha256()
    for r in records:
        h.update(json.dumps(r["input_ids"]).encode() + b"\n")
    return {"teacher": teacher_fp, "traces": h.hexdigest(), "count": len(records), "window": window}


def save_cache(path: str | Path, ident: dict, traces: Sequence[CachedTrace]) -> Path:
    """Write the cache atomically (a temporary file, then a rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "ident": ident,
           "traces": [{"k": t.k, "v": t.v, "targets": {_key_name(key): x for key, x in t.targets.items()}, "source": t.source}
                      for t in traces]}
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(doc, tmp)
    tmp.replace(path)
    return path


def load_cache(path: str | Path) -> tuple[dict, list[CachedTrace]]:
    """(ident, traces) of a cache file; a :class:`CacheError` naming the file if it is unreadable, not a
    probe cache, of another format version, or malformed."""
    path = Path(path)
    try:
        doc = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many kinds (pickle, zip, EOF) for a damaged file
        raise CacheError(f"teacher cache {path} cannot be read ({type(err).__name__}: {err}); delete it or give another --cache") from None
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT:
        raise CacheError(f"{path} is not a kvpop probe teacher cache; delete it or give another --cache")
    if doc.get("version") != CACHE_VERSION:
        raise CacheError(f"teacher cache {path} has format version {doc.get('version')!r}, this code reads version {CACHE_VERSION}; "
                         "delete it (it is rebuilt) or give another --cache")
    try:
        traces = [CachedTrace(t["k"], t["v"], {_key_of(n): x for n, x in t["targets"].items()}, t["source"]) for t in doc["traces"]]
        ident = dict(doc["ident"])
    except (KeyError, TypeError, ValueError) as err:
        raise CacheError(f"teacher cache {path} is malformed ({type(err).__name__}: {err}); delete it or give another --cache") from None
    return ident, traces


def teacher_cache(
    teacher, records: Sequence[dict], *, window: int, kinds: Iterable[TargetKey], path: str | Path | None = None,
    device: str | torch.device = "cpu", log: Callable[[str], None] = lambda s: None,
) -> list[CachedTrace]:
    """The teacher's keys, values and targets of ``kinds`` for every record, in order.

    With ``path``: reused from there when the file was written for the same teacher, traces and window
    and holds every kind asked for; otherwise (no file, other inputs, fewer kinds) rebuilt and written
    there. A file that cannot be used raises :class:`CacheError` (:func:`load_cache`); it is never read
    past its checks."""
    kinds = tuple(sorted(set(kinds)))
    ident = cache_ident(teacher_fingerprint(teacher), records, window=window)
    if path is not None and Path(path).is_file():
        have, traces = load_cache(path)
        missing = [k for k in kinds if traces and k not in traces[0].targets]
        if have == ident and not missing:
            log(f"teacher cache {path}: reused ({len(traces)} traces)")
            return traces
        why = "targets " + ", ".join(map(_key_name, missing)) + " missing" if have == ident else "written for other inputs"
        log(f"teacher cache {path}: {why}, rebuilt")
        if have == ident:
            kinds = tuple(sorted(set(kinds) | set(traces[0].targets)))
    out, t0 = [], time.monotonic()
    for i, r in enumerate(records):
        trace = capture_trace(teacher, torch.tensor([r["input_ids"]], device=device), window=window, kinds=kinds)
        trace.source = str(r.get("id", r.get("source", i)))
        out.append(trace)
        log(f"teacher trace {i + 1}/{len(records)} ({time.monotonic() - t0:.0f} s)")
    if path is not None:
        save_cache(path, ident, out)
    return out


# --- fitting ---------------------------------------------------------------------------------------


def scorer_loss(policy: Policy, trace: CachedTrace, settings: TrainSettings, *, target: TargetKey) -> tuple[Tensor, dict[str, float]]:
    """Training's scorer loss of ``policy`` on one cached trace: the mean over layers of each layer's
    boundary loss (plus calibration) against the target of ``target`` under ``settings``' scope, as
    :class:`kvpop.train.DistillModule` computes it; (loss, {decisions, agreement}). ``trace`` on the
    policy's device."""
    L, Hk, S, D = trace.k.shape
    pos = torch.arange(S, device=trace.k.device)[None]  # (1, S)
    doc = torch.zeros_like(pos)
    ctx = SparseContext.for_rows(policy, doc, pos, settings.layout, executor="sdpa", scorer_training=settings.scorer_training)
    tgt = trace.targets[target]  # (L, Hk, S)
    for layer in range(L):
        with torch.autocast(device_type=trace.k.device.type, enabled=False):  # scorers compute in fp32, as in training
            sc = policy.scores(layer, trace.k[layer][None].float(), trace.v[layer][None].float(), pos, doc_ids=doc,
                               window=settings.layout.window)  # r_hat (1, Hk, S), log_gamma (Hk,)
        ctx.add_scorer_loss(sc.r_hat, settings.scorer_training.target.weigh(tgt[layer][None], trace.v[layer][None]), sc.log_gamma)
    ctx.finish_scorer_losses()
    stats = {"decisions": sum(float(s["decisions"]) for s in ctx.stats),
             "agreement": float(torch.stack([s["agreement"].float().cpu() for s in ctx.stats]).mean())}
    return ctx.mean_scorer_loss(), stats


@dataclass
class Fit:
    """A scorer fitted on the cache: its row name, the policy (eval mode) and what the fit did."""

    name: str
    policy: Policy
    log: dict = field(default_factory=dict)


def _mean_loss(policy: Policy, traces: Sequence[CachedTrace], settings: TrainSettings, key: TargetKey) -> float:
    with torch.no_grad():
        return sum(float(scorer_loss(policy, t, settings, target=key)[0]) for t in traces) / len(traces)


def fit_scorer(
    variant: Variant, policy_name: str, traces: Sequence[CachedTrace], *, shape: Mapping[str, int], epochs: int = 1,
    device: str | torch.device = "cpu", log: Callable[[str], None] = lambda s: None,
) -> Fit:
    """A fresh ``policy_name`` scorer (seeded by ``seed``, as :func:`kvpop.train.build_training` seeds it)
    fitted on the cached ``traces`` for ``epochs`` passes, one trace per optimizer step in a seeded order
    per epoch (:class:`kvpop.train.EpochBatches`), with training's settings of ``variant.params``: the loss
    (:func:`scorer_loss`), AdamW at ``train.scorer_lr`` without weight decay, :func:`kvpop.train.scorer_schedule`
    (``train.scorer_warmup``) and ``train.grad_clip``. ``shape``: :func:`kvpop.modeling.model_shape` of the teacher."""
    p, cfg = variant.params, variant.params.train
    if epochs < 1 or not traces:
        raise ProbeError(f"a fit needs at least one epoch and one trace (epochs {epochs}, traces {len(traces)})")
    torch.manual_seed(p.seed)
    policy = training_policy(policy_name, shape, cfg).to(device)
    settings = TrainSettings.from_config(cfg, layout=p.layout.for_policy(policy, head_dim=shape["head_dim"]), seed=p.seed)
    key = target_key(p)
    traces = [t.to(device) for t in traces]
    params = [x for x in policy.parameters() if x.requires_grad]
    opt = torch.optim.AdamW([{"params": params, "lr": cfg.scorer_lr, "weight_decay": 0.0}])
    steps = epochs * len(traces)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, scorer_schedule(cfg.scorer_warmup, steps))
    order = EpochBatches(len(traces), 1, p.seed, rank=0, world_size=1)
    t0 = time.monotonic()
    before = _mean_loss(policy, traces, settings, key)
    policy.train()
    for epoch in range(epochs):
        for i in order.permutation(epoch).tolist():
            loss, _ = scorer_loss(policy, traces[i], settings, target=key)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
        log(f"fit {policy_name} [{variant.name}]: epoch {epoch + 1}/{epochs} ({time.monotonic() - t0:.0f} s)")
    policy.eval()
    after = _mean_loss(policy, traces, settings, key)
    info = {"policy": policy_name, "variant": variant.name, "overrides": list(variant.overrides), "target": str(cfg.target),
            "boundary_weight": cfg.boundary_weight, "scorer_calibration": cfg.scorer_calibration, "long_range": settings.layout.long_range,
            "epochs": epochs, "traces": len(traces), "steps": steps, "score_loss_before": round(before, 6),
            "score_loss_after": round(after, 6), "seconds": round(time.monotonic() - t0, 1)}
    return Fit(f"{policy_name} [{variant.name}]", policy, info)


# --- evaluation ------------------------------------------------------------------------------------


def ceiling(params: Params) -> tuple[str, Policy]:
    """(row name, policy) of ``params``' ceiling: ``oracle_target`` ranking by ``train.target`` with the
    scorer's fixed age decay (``train.scorer_recency`` in ``train.scorer_recency_space``)."""
    t, cfg = params.train.target, params.train
    name = f"oracle_target ({t})"
    if cfg.scorer_recency:
        name += f" recency {cfg.scorer_recency:g}" + (" on the share" if cfg.scorer_recency_space == "share" else "")
    pol = make_policy("oracle_target").configure(target=t, recency=cfg.scorer_recency, space=cfg.scorer_recency_space)
    return name, pol


def candidates(teacher, variants: Sequence[Variant], fits: Sequence[Fit], *, one_pool: bool = False) -> list[Candidate]:
    """The probe's rows on the frozen teacher: :data:`BASELINES`, each distinct ceiling of ``variants``
    (:func:`ceiling`), the ``fits``; with ``one_pool`` the one-pool twin of every row that has one."""
    out = [Candidate(n, teacher, make_policy(n)) for n in BASELINES]
    seen = set()
    for v in variants:
        name, pol = ceiling(v.params)
        if name not in seen:
            seen.add(name)
            out.append(Candidate(name, teacher, pol))
    out += [Candidate(f.name, teacher, f.policy) for f in fits]
    if one_pool:
        out += [twin for c in list(out) if (twin := one_pool_twin(c)) is not None]
    return out


#: the metrics a probe row keeps of :func:`kvpop.evaluate.evaluate_fidelity`'s
ROW_KEYS = ("kl", "top1_agreement", "quote_accuracy", "quote_tokens", "occupancy", "traces", "tokens")


def evaluate(teacher, records: Sequence[dict], cands: Sequence[Candidate], params: Params, *, device: str | torch.device = "cpu",
             progress: Callable[[int, int], None] | None = None) -> dict[str, dict]:
    """Every candidate's teacher-forced fidelity on ``records`` at ``params``' budget, sinks and window;
    {row name: {:data:`ROW_KEYS`}}."""
    res = evaluate_fidelity(records, teacher, cands, layout=params.layout, device=device, progress=progress)
    return {name: {k: m[k] for k in ROW_KEYS} for name, m in res.items()}


def run_probe(
    teacher, params: Params, variants: Sequence[Variant], train_records: Sequence[dict], eval_records: Sequence[dict], *,
    epochs: int = 1, one_pool: bool = False, cache: str | Path | None = None, device: str | torch.device = "cpu",
    log: Callable[[str], None] = lambda s: None, other_text: Mapping[str, Sequence[dict]] | None = None,
) -> dict:
    """The whole probe on a loaded, frozen ``teacher``: cache the teacher on ``train_records`` (traces and
    any pieces of other text), fit every variant's scorers, evaluate every row on ``eval_records``; the
    result document (geometry, fits, rows). ``other_text`` ``{kind: records}``: held-out pieces of code and prose
    (:func:`kvpop.data.other_text.held_out_records`), on which every row but ``oracle_sources`` is also scored against the
    dense teacher (:func:`kvpop.evaluate.evaluate_other_text`: ``"other_text": {kind: {row: {"kl", "top1_agreement",
    "pieces"}}}``)."""
    from kvpop.modeling import model_shape

    teacher.eval().requires_grad_(False)
    shape = model_shape(teacher)
    kinds = {target_key(v.params) for v in variants}
    traces = teacher_cache(teacher, train_records, window=params.window, kinds=kinds, path=cache, device=device, log=log)
    fits = [fit_scorer(v, name, traces, shape=shape, epochs=epochs, device=device, log=log) for v in variants for name in fitted_policies(v.params)]
    cands = candidates(teacher, variants, fits, one_pool=one_pool)
    t0 = time.monotonic()
    rows = evaluate(teacher, eval_records, cands, params, device=device,
                    progress=lambda i, n: log(f"eval trace {i}/{n} ({time.monotonic() - t0:.0f} s)"))
    other = {}
    if other_text:
        other = {"other_text": evaluate_other_text(other_text, teacher, cands, layout=params.layout, device=device,
                                                   progress=lambda kind, i, n: log(f"{kind} piece {i}/{n} ({time.monotonic() - t0:.0f} s)"))}
    return {
        "model": "frozen dense teacher (no fine-tune)", "budget": params.budget, "sinks": params.sinks, "window": params.window,
        "train_traces": len(train_records), "eval_traces": len(eval_records), "epochs": epochs,
        "train_sources": [t.source for t in traces],
        "variants": [{"name": v.name, "overrides": list(v.overrides)} for v in variants],
        "fits": {f.name: f.log for f in fits}, "rows": rows, **other,
    }
