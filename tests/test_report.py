"""What the final table and the compact metrics say of each row: kvpop.summary, pipeline/report.py, and
the figures of kvpop.evaluate they read (``fill``, ``kl`` clamped at 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpop.evaluate import Candidate, _Acc, evaluate_fidelity
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.summary import SUMMARY_METRICS, row_notes, summary, summary_name

ROOT = Path(__file__).resolve().parents[1]


def fake_eval(**overrides) -> dict:
    """An evaluate result shaped as the stage writes it: 8 traces, tova decoded on 3, dms's gate under its budget."""
    row = {"kl": 0.03, "top1_agreement": 0.9, "quote_accuracy": 0.5, "quote_tokens": 96, "occupancy": 1.0, "fill": 1.0, "traces": 8,
           "tokens": 5824, "pass_at_1": 0.25, "pass_at_1_relative": 0.6, "peak_cache_mb": 34.8, "tokens_per_s": 3.1}
    policies = {
        "dense": {**row, "kl": 0.0, "occupancy": 2.06, "pass_at_1_relative": 1.0, "peak_cache_mb": 84.4},
        "tova": {**row, "traces": 3, "tokens": 2560, "quote_tokens": 36},
        "kvpop_mlp": {**row, "occupancy_map": [[1.0, 1.0]]},
        "kvpop_mlp, one pool": dict(row),
        "dms": {**row, "occupancy": 0.79, "fill": 0.79},
        "oracle_target": {k: v for k, v in row.items() if k not in ("pass_at_1", "pass_at_1_relative", "peak_cache_mb", "tokens_per_s")},
    }
    ev = {"policies": policies, "budget": 384, "eval_tokens": 5824, "eval_traces": 8, "mean_trace_tokens": 790.0,
          "rollout_problems": 6, "rollouts_per_problem": 2}
    return {**ev, **overrides}


def test_summary_keeps_the_few_numbers_per_policy():
    ev = fake_eval()
    got = summary(ev)
    assert set(got) == {"dense", "tova", "kvpop_mlp", "kvpop_mlp.one_pool", "dms", "oracle_target"}
    assert got["kvpop_mlp"] == {"budget": 384, **{k: ev["policies"]["kvpop_mlp"][k] for k in SUMMARY_METRICS}}
    assert "occupancy_map" not in got["kvpop_mlp"] and got["tova"]["traces"] == 3
    assert set(got["oracle_target"]) == {"budget", "quote_accuracy", "kl", "top1_agreement", "traces"}  # never decoded
    assert summary_name("kvpop_mlp, one pool") == "kvpop_mlp.one_pool"
    clash = fake_eval(policies={"a b": {}, "a_b": {}})
    with pytest.raises(ValueError, match="a_b"):
        summary(clash)


def test_row_notes_mark_fewer_traces_and_a_gate_below_its_budget():
    names, occupancy, notes = row_notes(fake_eval())
    assert names == {"tova": "*"} and occupancy == {"dms": "†"}
    assert notes[0].startswith("* scored on the first 3 of the 8 held-out traces") and notes[0].endswith(": tova")
    assert notes[1].startswith("† a gate that evicts below the budget") and notes[1].endswith("(fill): dms 0.79")
    # nothing to say: every row on every trace, every cache full (fill 1, whatever the occupancy)
    ev = fake_eval()
    ev["policies"] = {n: {**m, "traces": 8, "fill": 1.0, "occupancy": 0.19} for n, m in ev["policies"].items()}
    assert row_notes(ev) == ({}, {}, [])


def test_report_prints_the_marks_and_what_they_mean(tmp_path):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(fake_eval(policies={**fake_eval()["policies"], "h2o": {**fake_eval()["policies"]["tova"]}})))
    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / "report.py"), str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any("tova*" in line for line in lines) and any("h2o*" in line for line in lines)
    assert any("dms " in line and "0.79†" in line for line in lines)
    assert any(line.startswith("* scored on the first 3 of the 8 held-out traces") and line.endswith("tova, h2o") for line in lines)
    assert any(line.startswith("† a gate that evicts below the budget") for line in lines)
    md = subprocess.run([sys.executable, str(ROOT / "pipeline" / "report.py"), str(path), "--md"], capture_output=True, text=True).stdout
    assert "| tova\\* | 0.500 | 0.0300 |" in md and "| 0.79† |" in md and "\n\\* scored on the first 3 of the 8" in md
    assert "| oracle_target | 0.500 | 0.0300 | 0.900 | 1.00 | - | - | - | - |" in md


def test_kl_is_clamped_at_zero():
    """KL(p || q) >= 0: a sum of float rounding below 0 (a policy that evicts nothing) reads 0."""
    assert _Acc(kl=-2.4e-9 * 100, tokens=100).result()["kl"] == 0.0
    assert _Acc(kl=0.5, tokens=100).result()["kl"] == 0.005


def test_fill_tells_a_gate_that_evicts_below_its_budget(tiny_model):
    """``fill``: held at a trace's end over what a cache that evicts only when full holds, min(S, slots):
    1 for dense, a top-k rule and an attention rule, whether the trace is longer than the budget or not
    (where ``occupancy`` is below 1); below 1 for a gate that evicts more than it must. KL of a policy
    that evicts nothing is never below 0."""
    from kvpop.attention import register

    model = tiny_model(attn_implementation=register())
    S, sinks, window = 60, 2, 6
    rec = {"input_ids": torch.randint(0, model.config.vocab_size, (S,), generator=torch.Generator().manual_seed(0)).tolist(),
           "loss_mask": [1] * S}
    evicting = make_policy("dms", num_layers=2, num_kv_heads=2, head_dim=16)
    with torch.no_grad():
        evicting.scorer.b.fill_(5.0)  # every token gated out: only sinks and the window stay
    cands = [Candidate(n, model, make_policy(n)) for n in ("dense", "streaming_llm", "h2o")] + [Candidate("gate_out", model, evicting)]
    for budget in (13, 100):  # below and above the trace's length
        res = evaluate_fidelity([rec], model, cands, layout=CacheLayout(budget, sinks, window))
        for name in ("dense", "streaming_llm", "h2o"):
            assert res[name]["fill"] == pytest.approx(1.0), (budget, name)
            assert res[name]["kl"] >= 0.0
        assert res["gate_out"]["fill"] == pytest.approx((sinks + window) / min(S, budget))
        assert res["streaming_llm"]["occupancy"] == pytest.approx(min(S, budget) / budget)
    assert res["dense"]["kl"] == 0.0 and res["streaming_llm"]["kl"] < 1e-6  # budget 100 > S: nothing evicted
