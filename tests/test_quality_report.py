"""bench/quality_report.py: a quality configuration gathered from an evaluate stage's metrics, with the quality
issue's bars for the best ``kvpop*`` policy, written beside the file's other configurations."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from quality_report import bars, kl_difference, paired_interval, quote_ratio  # noqa: E402


def row(q, kl):
    return {"quote_accuracy": q, "kl": kl, "top1_agreement": 0.9}


POLICIES = {"dense": row(0.69, 0.0), "dbtrimkv": row(0.69, 0.0097), "kvpop_mlp_pool": row(0.578, 0.0059), "kvpop_mlp": row(0.083, 0.0257),
            "streaming_llm": row(0.036, 0.064)}
OTHER = {kind: {"dbtrimkv": {"kl": 0.02}, "kvpop_mlp_pool": {"kl": kl}, "streaming_llm": {"kl": 0.09}} for kind, kl in (("code", 0.05), ("prose", 0.1))}


def test_the_bars_of_the_best_kvpop_policy():
    b = bars(POLICIES, OTHER, 0.95)
    assert b["policy"] == "kvpop_mlp_pool" and b["quote_accuracy_vs_dense"] == round(0.578 / 0.69, 4)
    assert b["met"] == {"quotes": False, "kl": True, "code": True, "prose": False}  # prose 0.1 > streaming_llm's 0.09
    assert b["code_aim_dbtrimkv"] == 0.02
    assert bars({"dense": row(0.69, 0)}, {}, 0.95) == {}  # no kvpop policy: no bars


def per_trace(hits, kl, quotes=24, tokens=1000, traces=None):
    return {"trace": list(traces or range(len(hits))), "quote_hits": list(hits), "quote_tokens": [quotes] * len(hits),
            "kl_sum": [k * tokens for k in kl], "tokens": [tokens] * len(hits)}


def test_paired_intervals_over_the_traces():
    """A paired bootstrap over the traces both policies scored: it holds the point ratio, narrows as the traces agree,
    pairs by trace index, and is absent where a row has no per-trace sums."""
    dense = per_trace([20, 18, 22, 16, 20, 19, 21, 17], [0] * 8)
    close = per_trace([19, 18, 21, 16, 19, 19, 20, 17], [0.005] * 8)  # a point ratio of 0.968
    far = per_trace([12, 18, 22, 4, 20, 9, 21, 17], [0.001, 0.02] * 4)
    ci = paired_interval(close, dense, quote_ratio)
    assert ci[0] <= 149 / 153 <= ci[1] and ci[1] - ci[0] < 0.05
    wide = paired_interval(far, dense, quote_ratio)
    assert wide[1] - wide[0] > 2 * (ci[1] - ci[0])
    assert paired_interval(close, dense, quote_ratio) == ci  # seeded: the same rows give the same interval
    assert paired_interval(close, dense, kl_difference) == [0.005, 0.005]
    shifted = per_trace([19, 18, 21, 16], [0.005] * 4, traces=[4, 5, 6, 7])  # pairs with dense's traces 4-7 alone
    assert paired_interval(shifted, dense, quote_ratio) == paired_interval(shifted, per_trace([20, 19, 21, 17], [0] * 4, traces=[4, 5, 6, 7]),
                                                                           quote_ratio)
    assert paired_interval(None, dense, quote_ratio) is None and paired_interval(per_trace([1], [0], traces=[99]), dense, quote_ratio) is None
    assert paired_interval(close, per_trace([0] * 8, [0] * 8), quote_ratio) is None  # never defined (dense hits no quote): no interval
    policies = {**POLICIES, "dense": {**row(0.69, 0.0), "per_trace": dense}, "kvpop_mlp_pool": {**row(0.974, 0.0059), "per_trace": close},
                "dbtrimkv": {**row(0.69, 0.0097), "per_trace": per_trace([20] * 8, [0.0097] * 8)}}
    b = bars(policies, OTHER, 0.95)
    assert b["quote_ratio_ci95"] == ci and b["kl_minus_dbtrimkv_ci95"] == [-0.0047, -0.0047]
    assert "quote_ratio_ci95" not in bars(POLICIES, OTHER, 0.95)


def test_a_configuration_replaces_its_namesake(tmp_path):
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"policies": POLICIES, "other_text": OTHER, "budget": 512}))
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "dbtrimkv.json").write_text(json.dumps({"kl": 0.009, "steps": 300, "seconds": 160.0, "policy": "dbtrimkv"}))
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"budget": 512, "sinks": 4, "window": 256, "train": {"policies": ["dbtrimkv", "kvpop_mlp_pool"], "seq_len": 4096,
                                                                                          "steps": 300}}))
    out = tmp_path / "q.json"

    def run(config):
        args = [sys.executable, "bench/quality_report.py", "--config", config, "--eval", str(ev), "--train", str(tmp_path / "train"),
                "--params", str(params), "--out", str(out)]
        proc = subprocess.run(args, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ["PATH"]}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return json.loads(out.read_text())

    run("4k")
    run("8k")
    doc = run("4k")
    assert [c["config"] for c in doc["configurations"]] == ["8k", "4k"]
    c = doc["configurations"][1]
    assert c["train"] == {"dbtrimkv": {"kl": 0.009, "seconds": 160.0, "steps": 300}} and c["bars"]["quote_bar"] == 0.95
    assert doc["configurations"][0]["bars"]["quote_bar"] == 0.90 and doc["provenance"]["git_commit"]


def test_metrics_without_policies_are_refused(tmp_path):
    ev = tmp_path / "eval.json"
    ev.write_text("{}")
    proc = subprocess.run([sys.executable, "bench/quality_report.py", "--config", "4k", "--eval", str(ev), "--params", "params.yaml",
                           "--out", str(tmp_path / "q.json")], cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ["PATH"]},
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "holds no 'policies'" in proc.stderr and not (tmp_path / "q.json").exists()


def test_malformed_per_trace_sums_are_refused(tmp_path):
    """Per-trace lists of unequal length (a hand-edited metrics file): a clear error, the result file left as it was."""
    bad = per_trace([20, 18], [0, 0])
    bad["quote_hits"] = [20]
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"policies": {"dense": {**row(0.69, 0.0), "per_trace": per_trace([20, 18], [0, 0])},
                                           "kvpop_mlp_pool": {**row(0.6, 0.005), "per_trace": bad}}}))
    out = tmp_path / "q.json"
    out.write_text("{}")
    proc = subprocess.run([sys.executable, "bench/quality_report.py", "--config", "4k", "--eval", str(ev), "--params", "params.yaml",
                           "--out", str(out)], cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ["PATH"]},
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "per_trace must hold equally long lists" in proc.stderr and out.read_text() == "{}"


def test_a_run_of_some_policies_merges_into_its_configuration(tmp_path):
    """--merge: a later run that trained only kvpop_pool adds its rows to the file's 4k configuration (the untrained rows,
    settings and held-out tokens agree), keeps both runs' provenance and takes the bars again; a run whose untrained rows
    differ, or a configuration not in the file, is refused with nothing written."""
    out = tmp_path / "q.json"

    def run(tag: str, policies: dict, trained: list[str], *extra: str) -> subprocess.CompletedProcess:
        ev = tmp_path / f"eval_{tag}.json"
        ev.write_text(json.dumps({"policies": policies, "other_text": OTHER, "budget": 512, "eval_tokens": 1000}))
        params = tmp_path / f"params_{tag}.yaml"
        params.write_text(yaml.safe_dump({"budget": 512, "sinks": 4, "window": 256, "train": {"policies": trained, "seq_len": 4096, "steps": 300}}))
        args = [sys.executable, "bench/quality_report.py", "--config", "4k", "--eval", str(ev), "--train", str(tmp_path), "--params", str(params),
                "--out", str(out), *extra]
        return subprocess.run(args, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ["PATH"]}, capture_output=True, text=True)

    assert run("alone", POLICIES, [], "--merge").returncode == 2 and not out.exists()  # nothing to merge into
    assert run("first", POLICIES, ["dbtrimkv", "kvpop_mlp_pool", "kvpop_mlp"]).returncode == 0
    later = {n: POLICIES[n] for n in ("dense", "streaming_llm")} | {"kvpop_pool": row(0.68, 0.005)}
    proc = run("later", later, ["kvpop_pool"], "--merge")
    assert proc.returncode == 0, proc.stderr
    (c,) = json.loads(out.read_text())["configurations"]
    assert set(c["policies"]) == set(POLICIES) | {"kvpop_pool"} and c["policies"]["kvpop_pool"]["quote_accuracy"] == 0.68
    assert [r["policies"] for r in c["runs"]] == [sorted(POLICIES), ["kvpop_pool"]] and all(r["provenance"]["git_commit"] for r in c["runs"])
    assert c["bars"]["policy"] == "kvpop_pool" and c["bars"]["met"]["quotes"] is True  # 0.68 / 0.69 >= 0.95
    before = out.read_text()
    moved = dict(later, dense=row(0.70, 0.0))
    proc = run("moved", moved, ["kvpop_pool"], "--merge")
    assert proc.returncode == 2 and "not the same rows: dense's quote_accuracy" in proc.stderr and out.read_text() == before


def test_evaluates_of_parts_of_one_run_are_joined(tmp_path):
    """--eval repeated: the untrained policies' evaluate and each trained policy's own (scripts/device/job.sh, FINAL=0)
    make one configuration; parts on other held-out data, or disagreeing on a row both hold, are refused, nothing written."""
    out = tmp_path / "q.json"
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"budget": 512, "sinks": 4, "window": 256, "train": {"policies": ["dbtrimkv", "kvpop_mlp_pool"],
                                                                                          "seq_len": 4096, "steps": 300}}))

    def part(tag: str, names: list[str], **over) -> str:
        ev = tmp_path / f"eval_{tag}.json"
        other = {kind: {n: rows[n] for n in names if n in rows} for kind, rows in OTHER.items()}
        ev.write_text(json.dumps({"policies": {n: POLICIES[n] for n in names}, "other_text": other, "budget": 512, "eval_tokens": 1000,
                                  "eval_traces": 16, **over}))
        return str(ev)

    def run(*evals: str) -> subprocess.CompletedProcess:
        args = [sys.executable, "bench/quality_report.py", "--config", "4k", "--params", str(params), "--train", str(tmp_path), "--out", str(out)]
        for ev in evals:
            args += ["--eval", ev]
        return subprocess.run(args, cwd=ROOT, env={"PYTHONPATH": str(ROOT / "src"), "PATH": os.environ["PATH"]}, capture_output=True, text=True)

    early, db, pool = part("early", ["dense", "streaming_llm"]), part("db", ["dbtrimkv"]), part("pool", ["kvpop_mlp_pool"])
    assert run(early, part("other", ["dbtrimkv"], eval_tokens=999)).returncode == 2 and not out.exists()
    moved = tmp_path / "eval_moved.json"
    moved.write_text(json.dumps({"policies": {"dense": row(0.70, 0.0)}, "budget": 512, "eval_tokens": 1000}))
    proc = run(early, str(moved))
    assert proc.returncode == 2 and "dense's quote_accuracy" in proc.stderr and not out.exists()
    proc = run(early, db, pool)
    assert proc.returncode == 0, proc.stderr
    (c,) = json.loads(out.read_text())["configurations"]
    assert set(c["policies"]) == {"dense", "streaming_llm", "dbtrimkv", "kvpop_mlp_pool"} and c["eval"]["eval_tokens"] == 1000
    assert set(c["other_text"]["code"]) == {"streaming_llm", "dbtrimkv", "kvpop_mlp_pool"}
    assert c["bars"]["policy"] == "kvpop_mlp_pool" and c["bars"]["met"] == {"quotes": False, "kl": True, "code": True, "prose": False}
