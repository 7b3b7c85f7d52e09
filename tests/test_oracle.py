"""The ceilings ``oracle_target`` and ``oracle_sources``: what they rank by, and where they may run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvpop.attention import SparseContext, register
from kvpop.decode import BoundedCache, generate
from kvpop.decode.engine import engine_refusal
from kvpop.evaluate import Candidate, evaluate_fidelity, teacher_targets
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy, names
from kvpop.selection import NEVER
from kvpop.target import TargetSpec

EPS = 1e-6


def test_oracles_are_registered_as_evaluation_only():
    assert names(oracle=True) == ("oracle_target", "oracle_sources")
    for name in names(oracle=True):
        p = make_policy(name)
        assert p.oracle and not p.trained and not p.learned and not p.needs_attention


def _literal_target(probs: torch.Tensor, Hk: int, window: int, kind: str, beta: float) -> torch.Tensor:
    """probs (1, H, S, S) float64 dense attention (query u, key t) -> (1, Hk, S), from the definition."""
    _, H, S, _ = probs.shape
    out = torch.full((1, H, S), math.log(EPS), dtype=torch.float64)
    for t in range(S):
        p = probs[0, :, t + window :, t]  # (H, N): queries u >= t + window
        if p.shape[1] == 0:
            continue
        if kind == "mean":
            m = p.mean(-1)
        elif kind == "power":
            m = (p**beta).mean(-1) ** (1 / beta)
        else:
            m = p.amax(-1)
        out[0, :, t] = torch.log(EPS + m)
    return out.view(1, Hk, H // Hk, S).amax(2)


@pytest.mark.parametrize("kind, beta", [("mean", 8.0), ("power", 4.0), ("max", 8.0)])
def test_teacher_targets_equal_the_definition_on_eager_attention(tiny_model, kind, beta):
    """The oracle's priorities equal the target computed literally from the dense attention
    probabilities that transformers' eager attention returns (an independent executor)."""
    torch.set_default_dtype(torch.float64)
    try:
        kv = tiny_model(attn_implementation=register())
        eager = tiny_model(attn_implementation="eager")
    finally:
        torch.set_default_dtype(torch.float32)
    ids = torch.randint(0, kv.config.vocab_size, (1, 40))
    window = 5
    got = teacher_targets(kv, ids, window=window, kind=kind, beta=beta)
    att = eager(input_ids=ids, output_attentions=True).attentions  # per layer (1, H, S, S)
    Hk = kv.config.num_key_value_heads
    assert len(got) == len(att) == kv.config.num_hidden_layers
    for layer, probs in enumerate(att):
        want = _literal_target(probs.double(), Hk, window, kind, beta)
        torch.testing.assert_close(got[layer].double(), want, atol=1e-5, rtol=1e-5)


def test_oracle_target_takes_one_target_spec():
    """configure(target=...) takes a TargetSpec or its compact form; the teacher's targets it asks for are the
    spec's (kind, beta), its scope applied on top; a bad spec is refused at configure time, naming the bad part."""
    pol = make_policy("oracle_target")
    assert pol.target == TargetSpec() and pol.teacher_target() == ("max", 8.0)  # the canonical default
    spec = TargetSpec(kind="power", beta=4.0, scope="blend", blend=0.25)
    assert pol.configure(target="power:4.blend:0.25").target == spec
    assert pol.configure(target=spec).target is spec and pol.teacher_target() == ("power", 4.0)
    ts = [torch.randn(1, 2, 9) for _ in range(3)]  # per layer (1, Hk, S)
    assert pol.fit_trace(input_ids=torch.zeros(1, 9, dtype=torch.long), record={}, targets={("power", 4.0): ts})
    model_max = torch.stack(ts).amax(dim=(0, 2))[:, None]  # (1, 1, S)
    for r, t in zip(pol.r_tgt, ts, strict=True):
        torch.testing.assert_close(r, 0.75 * t + 0.25 * model_max)
    with pytest.raises(ValueError, match="unknown target scope 'pool'"):
        pol.configure(target="max.pool")
    with pytest.raises(ValueError, match="beta"):
        pol.configure(target={"kind": "power", "beta": 0.0})


def test_teacher_targets_ignore_right_padding(tiny_model):
    """Padding after the trace (``length``) sends no attention: the trace's targets are those of the
    unpadded trace."""
    model = tiny_model(attn_implementation=register())
    ids = torch.randint(0, model.config.vocab_size, (1, 30))
    padded = torch.cat([ids, torch.zeros(1, 10, dtype=torch.long)], 1)
    plain = teacher_targets(model, ids, window=4, kind="max")
    pad = teacher_targets(model, padded, window=4, kind="max", length=30)
    for a, b in zip(plain, pad, strict=True):
        torch.testing.assert_close(b[..., :30], a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scope", ["group", "model"])
def test_oracle_target_keeps_the_tokens_the_target_ranks_first(tiny_model, scope):
    model = tiny_model(attn_implementation=register())
    S, sinks, window, k = 48, 2, 6, 5
    ids = torch.randint(0, model.config.vocab_size, (1, S))
    pol = make_policy("oracle_target").configure(target=TargetSpec(kind="max", scope=scope))
    raw = teacher_targets(model, ids, window=window, kind="max", beta=8.0)
    assert pol.fit_trace(input_ids=ids, record={}, targets={pol.teacher_target(): raw})
    if scope == "model":  # one ranking for every layer and head: the max over all of them
        best_of_all = torch.stack(raw).amax(dim=(0, 2))  # (1, S)
        for r in pol.r_tgt:
            assert torch.equal(r, best_of_all[:, None].expand_as(r))
    pos = torch.arange(S)[None]
    ctx = SparseContext.for_rows(pol, torch.zeros_like(pos), pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k))
    for layer in range(model.config.num_hidden_layers):
        keys = torch.zeros(1, model.config.num_key_value_heads, S, 8)
        evict, _ = ctx.evictions(layer, keys, keys)
        r = pol.r_tgt[layer][0]  # (Hk, S)
        for h in range(r.shape[0]):
            # at the last query, the kept long-range tokens are the k best by the target among
            # the eligible ones (sinks and the window excluded)
            q = S - 1
            eligible = torch.arange(sinks, q - window + 1)
            kept = eligible[evict[0, h, eligible] > q]
            assert kept.numel() == k
            best = eligible[r[h, eligible].argsort(descending=True, stable=True)[:k]]
            assert set(kept.tolist()) == set(best.tolist())


def test_oracle_sources_keeps_every_source_token(tiny_model):
    S, sinks, window, k = 60, 2, 8, 6
    src = [10, 11, 12, 30, 31]  # fewer than k: all kept to the end
    pol = make_policy("oracle_sources").configure(lead=0)
    ids = torch.zeros(1, S, dtype=torch.long)
    assert not pol.fit_trace(input_ids=ids, record={}, targets={})  # nothing recorded
    assert pol.fit_trace(input_ids=ids, record={"quote_source_positions": src}, targets={})
    pos = torch.arange(S)[None]
    ctx = SparseContext.for_rows(pol, torch.zeros_like(pos), pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k))
    evict, _ = ctx.evictions(0, torch.zeros(1, 2, S, 4), torch.zeros(1, 2, S, 4))
    assert (evict[0, :, src] == NEVER).all()
    others = [t for t in range(sinks, S - window) if t not in src]
    kept_others = [t for t in others if evict[0, 0, t] > S - 1]  # still held at the last query
    assert kept_others == others[-(k - len(src)):]  # the spare slot goes to the newest others


def test_oracle_sources_lead_keeps_the_tokens_before_each_source_run():
    S = 40
    pol = make_policy("oracle_sources")  # lead 4 by default: "Let comet = " before the digits
    pol.fit_trace(input_ids=torch.zeros(1, S, dtype=torch.long), record={"quote_source_positions": [10, 11, 12, 30, 31, 2]},
                  targets={})
    assert pol.sources.nonzero().squeeze(-1).tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11, 12, 26, 27, 28, 29, 30, 31]


def test_oracles_are_never_decoded(tiny_model):
    model = tiny_model(attn_implementation=register())
    pol = make_policy("oracle_sources")
    assert "oracle" in engine_refusal(model, pol)
    with pytest.raises(ValueError, match="oracle"):
        BoundedCache(model.config, pol, layout=CacheLayout(16, 2, 4))
    tok = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    for path in ("auto", "engine", "reference"):
        with pytest.raises(ValueError, match="oracle"):
            generate(model, tok, pol, torch.zeros(1, 20, dtype=torch.long), layout=CacheLayout(16, 2, 4), max_new_tokens=2, path=path)


def test_evaluation_reports_oracles_only_where_they_apply(tiny_model):
    """Teacher-forced evaluation runs both oracles; one without recorded sources is left out, and at a
    budget above the trace both equal dense."""
    model = tiny_model(attn_implementation=register())
    ids = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    rec = {"input_ids": ids, "loss_mask": [1] * 40, "quote_positions": [30, 31], "quote_source_positions": [5, 6]}
    # h2o first: its token-by-token decoding switches the shared model to the cache attention
    cands = [Candidate("dense", model, make_policy("dense")), Candidate("h2o", model, make_policy("h2o")),
             Candidate("oracle_target", model, make_policy("oracle_target")), Candidate("oracle_sources", model, make_policy("oracle_sources"))]
    res = evaluate_fidelity([rec], model, cands, layout=CacheLayout(64, 2, 4))
    assert set(res) == {"dense", "h2o", "oracle_target", "oracle_sources"}
    for name in ("oracle_target", "oracle_sources"):
        assert res[name]["kl"] == pytest.approx(0.0, abs=1e-6) and res[name]["top1_agreement"] == 1.0
    per = res["dense"]["per_trace"]  # the one trace's own sums: its two quote tokens, the totals
    assert per["trace"] == [0] and per["quote_tokens"] == [2] and per["tokens"] == [res["dense"]["tokens"]]
    assert per["quote_hits"] == [round(2 * res["dense"]["quote_accuracy"])]
    res = evaluate_fidelity([{**rec, "quote_source_positions": []}], model, cands, layout=CacheLayout(12, 2, 4))
    assert set(res) == {"dense", "h2o", "oracle_target"}


def test_oracle_target_with_value_weighting_ranks_by_target_plus_log_value_norm(tiny_model):
    """``max.value``: the kept long-range tokens are the k best by r + log(||v|| / sqrt(D)) of the values the
    forward hands the scorer, not by r alone (values chosen so that the two orders differ)."""
    model = tiny_model(attn_implementation=register())
    S, sinks, window, k, D = 48, 2, 6, 5, 8
    ids = torch.randint(0, model.config.vocab_size, (1, S))
    raw = teacher_targets(model, ids, window=window, kind="max", beta=8.0)
    plain = make_policy("oracle_target").configure(target="max")
    weighted = make_policy("oracle_target").configure(target="max.value")
    for pol in (plain, weighted):
        assert pol.fit_trace(input_ids=ids, record={}, targets={pol.teacher_target(): raw})
    pos = torch.arange(S)[None]
    layout = CacheLayout.of(sinks=sinks, window=window, long_range=k)
    g = torch.Generator().manual_seed(3)
    differ = 0
    for layer in range(model.config.num_hidden_layers):
        Hk = model.config.num_key_value_heads
        keys = torch.zeros(1, Hk, S, D)
        values = torch.randn(1, Hk, S, D, generator=g) * torch.logspace(-2, 2, S)[torch.randperm(S, generator=g)][None, None, :, None]
        kept = {}
        for pol in (plain, weighted):
            ctx = SparseContext.for_rows(pol, torch.zeros_like(pos), pos, layout=layout)
            evict, _ = ctx.evictions(layer, keys, values)
            kept[pol.target.value] = evict
        r = raw[layer][0]  # (Hk, S)
        w = r + (values[0].norm(dim=-1) / D**0.5).log()
        q = S - 1
        eligible = torch.arange(sinks, q - window + 1)
        for h in range(Hk):
            for value, prio in ((False, r[h]), (True, w[h])):
                got = eligible[kept[value][0, h, eligible] > q]
                best = eligible[prio[eligible].argsort(descending=True, stable=True)[:k]]
                assert set(got.tolist()) == set(best.tolist())
            differ += set(eligible[kept[True][0, h, eligible] > q].tolist()) != set(eligible[kept[False][0, h, eligible] > q].tolist())
    assert differ > 0  # the weighting changed what some head keeps
