"""Integration: the real stage entry points on a micro configuration (tiny Qwen3, offline).

The whole pipeline runs once for this module (the ``micro`` fixture: ``dvc repro`` of dvc.yaml's own
stage commands); the end-to-end checks and the failed ``dvc exp run`` checks read that one run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def micro_params(base_source: str) -> dict:
    p = yaml.safe_load((ROOT / "params.yaml").read_text())
    p.update(budget=48, sinks=4, window=32)
    p["base_model"]["source"] = base_source
    p["filter"]["max_tokens"] = 1024
    p["filter"]["synthetic"].update(train_traces=6, eval_traces=3, min_chars=800, max_chars=1000)
    p["train"].update(steps=2, seq_len=1024, top_logits=16, scorer_hidden=8)
    p["train"]["policies"] = list(POLICIES)
    p["evaluate"].update(max_traces=2, memory_lengths=[0, 4], one_pool=True, other_text={"code": 1, "prose": 1})
    p["evaluate"]["rollouts"].update(problems=1, n=2, max_new_tokens=2)
    return p


POLICIES = ("streaming_llm_plus", "kvpop_mlp", "kvpop")


def stage(cwd: Path, script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlflow.db'}", "DVC_EXP_NAME": "micro"}
    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / script), *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, f"{script} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


DVC = str(Path(sys.executable).parent / "dvc")


@pytest.fixture(scope="module")
def micro(tiny_qwen3_dir, tmp_path_factory) -> tuple[Path, dict, Path]:
    """The whole pipeline on the micro configuration, once: ``dvc repro`` in a git + DVC repository
    (:func:`dvc_repo`), its outputs committed -> (repository, environment, MLflow database)."""
    tmp = tmp_path_factory.mktemp("micro")
    repo, env = dvc_repo(tmp, str(tiny_qwen3_dir))
    # the name an experiment gives its runs (dvc exp run sets it; a plain repro's runs say "workspace")
    res = subprocess.run([DVC, "repro", "-q"], cwd=repo, env={**env, "DVC_EXP_NAME": "micro"}, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    subprocess.run(["git", "commit", "-qm", "repro"], cwd=repo, env=env, check=True)
    return repo, env, tmp / "mlflow.db"


@pytest.mark.slow
def test_pipeline_end_to_end(micro):
    """Every stage of dvc.yaml, in order: exactly these files written, the metrics and the MLflow runs."""
    repo, _, db = micro
    other = ("pipeline/", "src/", ".cache/", "mlruns/")  # the checkout's code copied in, the embedded-model cache, MLflow's artifacts
    written = {f for f in snapshot(repo) if not f.startswith(other) and Path(f).name not in (".gitignore", ".dvcignore")}
    expected = {
        "params.yaml", "dvc.yaml", "dvc.lock", "data/params.valid",
        "models/base/config.json", "models/base/generation_config.json", "models/base/model.safetensors",
        "models/base/tokenizer.json", "models/base/tokenizer_config.json", "models/base/chat_template.jinja",
        "metrics/base_model.json", "data/slots.valid", "data/filtered/train.jsonl", "data/filtered/eval.jsonl", "metrics/filter.json",
        "data/packed/train.safetensors", "metrics/pack.json", "metrics/eval.json",
        "plots/cache_memory.png", "plots/keep_map.png", "plots/budget_points.json",
        "plots/occupancy.png",
    }
    for pol in POLICIES:
        expected |= {f"models/train/{pol}/last.ckpt", f"metrics/train/{pol}.json"}
        files = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "kvpop.json")
        expected |= {f"models/export/{pol}/{f}" for f in files}
    expected |= {"models/export/kvpop_mlp/scorer.safetensors", "models/export/kvpop/scorer.safetensors"}
    evaluated = {"dense", "streaming_llm", "tova", "h2o", "oracle_target", "oracle_sources", *POLICIES, "kvpop_mlp.one_pool"}
    expected |= {f"metrics/summary/{stem}.json" for stem in evaluated}  # the compact metrics, one file per policy
    assert written == expected

    ev = json.loads((repo / "metrics/eval.json").read_text())
    from kvpop.summary import summary

    assert {stem: json.loads((repo / f"metrics/summary/{stem}.json").read_text()) for stem in evaluated} == summary(ev)
    assert set(ev["policies"]) == {"dense", "streaming_llm", "tova", "h2o", "oracle_target", "oracle_sources", *POLICIES, "kvpop_mlp, one pool"}
    for name, m in ev["policies"].items():
        assert {"kl", "top1_agreement", "quote_accuracy"} <= set(m), name
        decoded = {"pass_at_1", "pass_at_1_relative", "peak_cache_mb", "tokens_per_s"}
        assert decoded <= set(m) if not name.startswith("oracle_") else not decoded & set(m), name  # ceilings are never decoded
    assert ev["policies"]["streaming_llm"]["peak_cache_mb"] < ev["policies"]["dense"]["peak_cache_mb"]
    assert ev["budget"] == 48 and ev["eval_tokens"] > 0
    assert ev["policies"]["dense"]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert ev["policies"]["dense"]["top1_agreement"] == 1.0
    assert ev["policies"]["streaming_llm"]["kl"] > 0  # eviction really happens at this budget
    occ = ev["policies"]["kvpop_mlp"]["occupancy_map"]  # [layer][head], its mean is occupancy
    assert sum(map(sum, occ)) / sum(map(len, occ)) == pytest.approx(ev["policies"]["kvpop_mlp"]["occupancy"], abs=1e-3)
    assert "occupancy_map" not in ev["policies"]["tova"]  # decoded, no full-sequence pattern
    other = ev["other_text"]  # held-out code and prose, every policy but oracle_sources (no quote sources), against the base model
    assert set(other) == {"code", "prose"}
    for by_policy in other.values():
        assert set(by_policy) == set(ev["policies"]) - {"oracle_sources"}
        assert by_policy["dense"]["kl"] == pytest.approx(0.0, abs=1e-6) and by_policy["streaming_llm"]["kl"] > 0
        assert all({"kl", "top1_agreement"} <= set(m) for m in by_policy.values())
    filt = json.loads((repo / "metrics/filter.json").read_text())
    assert filt["train"]["kept"] > 0 and filt["eval"]["quote_tokens"] > 0
    train = json.loads((repo / "metrics/train/kvpop_mlp.json").read_text())
    assert train["steps"] == 2 and train["decisions"] > 0
    check_tracking(db, ev)


def check_tracking(db: Path, ev: dict) -> None:
    """The MLflow store: one child run per evaluated policy under the evaluate run, with ``policy`` and
    ``budget`` params and the same metric names, so one metric charts across policies (and budgets)."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{db}")
    runs = mlflow.search_runs(experiment_names=["kvpop"], filter_string="tags.stage = 'evaluate'", output_format="list")
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
    # the runs table tells experiments and budgets apart: both in every run's name and tags
    assert parents[0].info.run_name == f"evaluate · budget {ev['budget']} · micro" and parents[0].data.tags["budget"] == str(ev["budget"])
    assert {r.info.run_name for r in children} == {f"{name} · budget {ev['budget']} · micro" for name in ev["policies"]}
    assert {r.data.tags["dvc_exp"] for r in runs} == {"micro"}
    assert not any("." in k for k in parents[0].data.metrics)  # no flattened <policy>.<metric> columns
    logged = {a.path for a in mlflow.MlflowClient().list_artifacts(parents[0].info.run_id, "plots")}
    assert {"plots/keep_map.png", "plots/cache_memory.png", "plots/occupancy.png", "plots/budget_points.json"} == logged
    # what the UI's chart of one metric across runs reads: the runs of one budget, by policy
    chart = mlflow.search_runs(experiment_names=["kvpop"], filter_string="params.budget = '48' and tags.stage = 'evaluate'")
    chart = chart.dropna(subset=["metrics.quote_accuracy"])
    got = dict(zip(chart["params.policy"], chart["metrics.quote_accuracy"], strict=True))
    assert got == pytest.approx({n: m["quote_accuracy"] for n, m in ev["policies"].items()})
    for r in children:  # the other-text scores in each policy's own run
        name = r.data.tags["policy"]
        if name in ev["other_text"]["code"]:
            assert r.data.metrics["other_text/code/kl"] == pytest.approx(ev["other_text"]["code"][name]["kl"])
            assert "other_text/prose/top1_agreement" in r.data.metrics
        else:
            assert not any(k.startswith("other_text/") for k in r.data.metrics), name
    kinds = {r.data.tags["policy"]: r.data.tags["kind"] for r in children}
    assert kinds["dense"] == "reference" and kinds["oracle_target"] == "ceiling" and kinds["kvpop_mlp"] == "trained" and kinds["tova"] == "rule"
    assert kinds["kvpop_mlp, one pool"] == "trained"
    train = mlflow.search_runs(experiment_names=["kvpop"], filter_string="tags.stage = 'train'", output_format="list")
    assert len(train) == len(POLICIES)
    assert {r.info.run_name for r in train} == {f"train/{p} · budget {ev['budget']} · micro" for p in POLICIES}
    for r in train:  # curves and throughput as metrics; the run's bookkeeping as tags
        assert "train/kl" in r.data.metrics and "tokens_per_s" in r.data.metrics and not any(k.startswith("final/") for k in r.data.metrics)
        assert r.data.tags["devices"] == "1" and r.data.tags["steps"] == "2"


@pytest.mark.slow
def test_filter_mixes_other_text_into_training_only(tiny_qwen3_dir, tmp_path):
    p = micro_params(str(tiny_qwen3_dir))
    p["filter"]["other_text"] = {"code": 2, "prose": 1}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    stage(tmp_path, "base_model.py")
    stage(tmp_path, "filter.py")
    train = [json.loads(line) for line in (tmp_path / "data/filtered/train.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (tmp_path / "data/filtered/eval.jsonl").read_text().splitlines()]
    other = [r for r in train if r["id"].startswith("other-")]
    assert [r["kind"] for r in other] == ["code", "code", "prose"] and len(train) == 6 + 3
    assert all(512 <= len(r["input_ids"]) <= 1024 and r["loss_mask"] == [1] * len(r["input_ids"]) for r in other)
    assert not any(r["id"].startswith("other-") for r in evals)
    metrics = json.loads((tmp_path / "metrics/filter.json").read_text())
    assert metrics["train"]["other_text"] == {"code": 2, "prose": 1} and "other_text" not in metrics["eval"]


@pytest.mark.slow
def test_ruler_in_worker_processes_equals_one_process(micro, tmp_path, monkeypatch, capsys):
    """evaluate.benchmarks.ruler.workers: the evaluate stage on the micro run's exports with RULER, once in its own
    process and once shared out between two worker processes: the same RULER results for every policy (a generated
    one and a ceiling in each worker, the one-pool twin apart from the export it ranks)."""
    pytest.importorskip("long_context_eval", reason="RULER needs the 'ruler' extra")
    import shutil

    repo, _, _ = micro
    p = yaml.safe_load((repo / "params.yaml").read_text())
    p["train"]["policies"] = ["kvpop_mlp"]
    p["evaluate"].update(policies=["dense", "streaming_llm", "oracle_target"], one_pool=True, memory_lengths=[], other_text={"code": 0, "prose": 0})
    p["evaluate"]["rollouts"]["problems"] = 0
    got = {}
    for workers in (1, 2):
        run = tmp_path / f"workers{workers}"
        for d in ("models/base", "models/export/kvpop_mlp"):
            shutil.copytree(repo / d, run / d)
        (run / "data/filtered").mkdir(parents=True)
        shutil.copy(repo / "data/filtered/eval.jsonl", run / "data/filtered/eval.jsonl")
        p["evaluate"]["benchmarks"]["ruler"] = {"tasks": ["niah_single_1"], "samples": 2, "batch": 2, "workers": workers}
        (run / "params.yaml").write_text(yaml.safe_dump(p))
        res = stage(run, "evaluate.py")
        got[workers] = json.loads((run / "metrics/eval.json").read_text())["ruler"]
        assert (f"in {workers} processes" in res.stderr) == (workers > 1)  # the progress and what the stage says: stderr
    assert set(got[2]["policies"]) == {"dense", "streaming_llm", "oracle_target", "kvpop_mlp", "kvpop_mlp, one pool"}
    assert got[2] == got[1]
    # each policy's result was kept (.cache/ruler): a stage run again (stopped part of the way, say) redoes none of them,
    # and one whose weights changed is redone alone
    run = tmp_path / "workers2"
    kept = sorted((run / ".cache/ruler").glob("*.json"))
    assert len(kept) == 5
    weights = run / "models/export/kvpop_mlp/scorer.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes: the same key
    res = stage(run, "evaluate.py")
    said = " ".join(res.stderr.split())  # rich wraps lines
    assert "in 2 processes" not in said and "kvpop_mlp, kvpop_mlp, one pool, oracle_target from .cache/ruler" in said
    assert json.loads((run / "metrics/eval.json").read_text())["ruler"] == got[1]
    from safetensors.torch import load_file, save_file

    scorer = load_file(weights)
    save_file({k: v + 0.5 if v.is_floating_point() else v for k, v in scorer.items()}, weights)
    res = stage(run, "evaluate.py")
    assert "RULER: 2 policies in 2 processes: kvpop_mlp; kvpop_mlp, one pool" in " ".join(res.stderr.split())

    # a worker that fails stops the stage, naming its policies and what it said; results kept before stay
    monkeypatch.chdir(run)
    monkeypatch.syspath_prepend(str(ROOT / "pipeline"))
    import evaluate as stage_module
    from kvpop import ruler

    samples = ruler.generate_samples(run / "models/base", tasks=["niah_single_1"], seq_len=p["train"]["seq_len"], samples=1)
    keys = {"dense": run / ".cache/ruler/dense-test.json", "no_such_policy": run / ".cache/ruler/none.json"}
    with pytest.raises(SystemExit):
        stage_module.ruler_in_workers(samples, list(keys), 2, keys, base="models/base", exports=Path("models/export"), say=print)
    said = " ".join(capsys.readouterr().err.split())
    assert "the worker for no_such_policy failed (exit 1)" in said and "['no_such_policy'] are not among the evaluated ones" in said
    assert len(list((run / ".cache/ruler").glob("*.json"))) >= 5  # the kept results
    assert got[1]["policies"]["dense"]["answers"]["niah_single_1"] and got[1]["policies"]["oracle_target"]["accuracy"] == {}

    # more workers than policies: each policy's tasks split into parts, merged at the end, equal to the unsplit run;
    # a part already on disk (a stopped run) is not redone
    two = ruler.generate_samples(run / "models/base", tasks=["niah_single_1", "niah_single_2"], seq_len=p["train"]["seq_len"], samples=1)
    whole = {n: run / f".cache/ruler/whole-{n}.json" for n in ("dense", "oracle_target")}
    stage_module.ruler_in_workers(two, list(whole), 2, whole, base="models/base", exports=Path("models/export"), say=print)
    split = {n: run / f".cache/ruler/split-{n}.json" for n in whole}
    stage_module.ruler_in_workers(two, list(split), 4, split, base="models/base", exports=Path("models/export"), say=print)
    said = " ".join(capsys.readouterr().out.split())
    assert "RULER: 2 policies, each in 2 parts of its tasks, in 4 processes" in said
    # each worker's timings reach the stage's own output (its log goes with the temporary folder)
    assert "worker 0: RULER worker 0: policies and samples loaded in" in said and "niah_single_1 kept," in said
    for n in whole:
        assert json.loads(split[n].read_text()) == json.loads(whole[n].read_text()), n
    assert not list((run / ".cache/ruler").glob("split-*.part*"))  # merged, then removed
    dense = json.loads(whole["dense"].read_text())
    first = {k: ({t: v for t, v in x.items() if t == "niah_single_1"} if isinstance(x, dict) else x) for k, x in dense.items()}
    (run / ".cache/ruler/again-dense.part0of2.json").write_text(json.dumps(first))
    again = {"dense": run / ".cache/ruler/again-dense.json"}
    stage_module.ruler_in_workers(two, ["dense"], 2, again, base="models/base", exports=Path("models/export"), say=print)
    assert "in 1 processes: dense [niah_single_2]" in " ".join(capsys.readouterr().out.split())
    assert json.loads(again["dense"].read_text()) == dense
    # each task is kept as it ends (a worker stopped mid-policy): a run after it, split another way, redoes only the rest
    kept = {"dense": run / ".cache/ruler/kept-dense.json"}
    stage_module.task_folder(kept["dense"]).mkdir()
    entry = ruler.task_entry(dense, "niah_single_1")
    entry["answers"]["niah_single_1"] = ["kept"]  # marked: taken as it is, not run again
    (stage_module.task_folder(kept["dense"]) / "niah_single_1.json").write_text(json.dumps(entry))
    stage_module.ruler_in_workers(two, ["dense"], 1, kept, base="models/base", exports=Path("models/export"), say=print)
    assert "RULER: 1 of 2 policy tasks already kept" in " ".join(capsys.readouterr().out.split())
    got_kept = json.loads(kept["dense"].read_text())
    assert got_kept["answers"]["niah_single_1"] == ["kept"]
    assert {**got_kept, "answers": dense["answers"]} == dense and not stage_module.task_folder(kept["dense"]).exists()

    # a worker that runs out of GPU memory (here the first round's second process says so and exits): the others are
    # stopped and the parts not written run again in half as many processes, with the same results
    real, launched = stage_module.subprocess.Popen, []

    def popen(cmd, **kw):
        launched.append(cmd)
        if len(launched) == 2:
            cmd = [sys.executable, "-c", "import sys; print('torch.OutOfMemoryError: CUDA out of memory.'); sys.exit(1)"]
        return real(cmd, **kw)

    monkeypatch.setattr(stage_module.subprocess, "Popen", popen)
    oom = {n: run / f".cache/ruler/oom-{n}.json" for n in whole}
    stage_module.ruler_in_workers(two, list(oom), 2, oom, base="models/base", exports=Path("models/export"), say=print)
    said = " ".join(capsys.readouterr().out.split())
    assert "(oracle_target) ran out of GPU memory" in said and "run again in 1 processes" in said and len(launched) == 3
    for n in whole:
        assert json.loads(oom[n].read_text()) == json.loads(whole[n].read_text()), n


def test_bad_params_stop_before_any_work(tmp_path):
    p = micro_params("embedded")
    p["budget"] = p["sinks"] + p["window"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / "base_model.py")], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 2 and "budget" in res.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["params.yaml"]  # nothing written, nothing downloaded


def test_missing_input_is_a_clear_error(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(micro_params("embedded")))
    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / "pack.py")], cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 1 and "data/filtered/train.jsonl" in res.stderr


def dvc_repo(tmp_path: Path, base_source: str) -> tuple[Path, dict]:
    """A git + DVC repository holding this checkout's pipeline on the micro configuration, committed."""
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "dvc.yaml", repo)
    for d in ("pipeline", "src"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (repo / "params.yaml").write_text(yaml.safe_dump(micro_params(base_source), sort_keys=False))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "micro"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    return repo, env


def snapshot(repo: Path) -> dict[str, bytes]:
    """Every file of the workspace but git's and DVC's own bookkeeping."""
    skip = (".git", ".dvc")
    return {str(p.relative_to(repo)): p.read_bytes() for p in repo.rglob("*") if p.is_file() and p.relative_to(repo).parts[0] not in skip}


@pytest.mark.slow
def test_bad_exp_params_touch_nothing(micro):
    """``dvc exp run -S`` with an impossible value, a zero window or an unknown key: it fails naming the
    key, and every output and params.yaml stay exactly as they were (the validate stage runs first)."""
    repo, env, _ = micro
    before = snapshot(repo)
    assert "models/export/kvpop_mlp/model.safetensors" in before and "metrics/eval.json" in before
    # an unknown key: DVC itself refuses it without "+"; with "+" it reaches the validate stage
    # budget 40 passes params.yaml's own check (> sinks + window) but leaves kvpop's mLSTM no slot: the slots stage stops it
    cases = (("budget=30", "budget"), ("budget=40", "kvpop"), ("window=0", "window"),
             ("train.no_such_key=1", "no_such_key"), ("+train.no_such_key=1", "train.no_such_key"))
    for override, key in cases:
        res = subprocess.run([DVC, "exp", "run", "-S", override], cwd=repo, env=env, capture_output=True, text=True)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and key in out, out[-3000:]
        after = snapshot(repo)
        assert after["params.yaml"] == before["params.yaml"], override
        assert after == before, (override, sorted(k for k in after.keys() | before.keys() if after.get(k) != before.get(k)))


def test_the_dvc_cache_links_outputs_instead_of_copying(tmp_path):
    """The repository's .dvc/config: a stage's output is the cache's file (a hard link; a symlink where
    the cache is on another file system), not a second copy of a 1.6 GB checkpoint. A re-run replaces
    the output (DVC removes it first; every stage writes new files and renames them into place, here
    with kvpop.io.atomic_dir as the model stages do) and leaves the previous run's cached object intact."""
    import hashlib

    repo = tmp_path / "repo"
    (repo / ".dvc").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}
    (repo / "write.py").write_text("import os, yaml\nfrom kvpop.io import atomic_dir\n"
                                   "n = yaml.safe_load(open('params.yaml'))['n']\n"
                                   "with atomic_dir('models/out') as tmp:\n    (tmp / 'weights.bin').write_bytes(os.urandom(1 << 16) + bytes([n]))\n")
    (repo / "params.yaml").write_text("n: 1\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"w": {"cmd": "python write.py", "params": ["n"], "outs": ["models/out"]}}}))

    def run(*cmd):
        res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        assert res.returncode == 0, (cmd, res.stdout[-2000:], res.stderr[-2000:])

    def cached(path: Path) -> Path:
        md5 = hashlib.md5(path.read_bytes()).hexdigest()
        return repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]

    run("git", "init", "-q")
    run("dvc", "init", "-q", "--force")
    (repo / ".dvc" / "config").write_text((ROOT / ".dvc" / "config").read_text())
    out = repo / "models" / "out" / "weights.bin"
    run("dvc", "repro", "-q")
    first, first_bytes = cached(out), out.read_bytes()
    assert out.resolve() == first.resolve() or out.stat().st_ino == first.stat().st_ino, "the output is a copy of the cache's file"
    assert out.is_symlink() or out.stat().st_nlink == 2
    (repo / "params.yaml").write_text("n: 2\n")
    run("dvc", "repro", "-q")
    assert out.read_bytes() != first_bytes and out.stat().st_ino == cached(out).stat().st_ino or out.is_symlink()
    assert first.read_bytes() == first_bytes  # the first run's object, untouched by the re-run


def test_run_names_carry_the_budget_and_the_experiment(monkeypatch):
    """MLflow's runs table always shows a run's name: it says the budget and the DVC experiment
    (``DVC_EXP_NAME``, set by ``dvc exp run``), so two experiments' evaluate runs differ at a glance."""
    from kvpop import tracking

    monkeypatch.setenv("DVC_EXP_NAME", "lippy-taal")
    assert tracking.run_title("train/kvpop", {"budget": 384, "policy": "kvpop"}) == "train/kvpop · budget 384 · lippy-taal"
    assert tracking.run_tags("evaluate", {"budget": 384}) == {"stage": "evaluate", "dvc_exp": "lippy-taal", "budget": "384"}
    monkeypatch.delenv("DVC_EXP_NAME")
    assert tracking.run_title("pack", {"train.seq_len": 1024}) == "pack · workspace"  # a stage the budget does not reach
    assert tracking.run_tags("pack", {}) == {"stage": "pack", "dvc_exp": "workspace"}


def test_ruler_cache_keys_follow_what_a_result_depends_on(tmp_path, monkeypatch):
    """The evaluate stage's RULER result files (.cache/ruler): one key per policy, the same for the same samples,
    options, code and weights (``workers`` and a folder reached through a link do not count); changed answer-side
    options change every key, a retrained export its policy's key and its one-pool twin's, nothing else."""
    monkeypatch.syspath_prepend(str(ROOT / "pipeline"))
    import evaluate as stage_module
    from kvpop.config import parse_params

    for d in ("base", "export/kvpop_mlp", "export/kvpop"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "model.safetensors").write_bytes(d.encode() * 100)
    (tmp_path / "link").symlink_to(tmp_path / "base")
    names = ["dense", "kvpop_mlp", "kvpop_mlp, one pool", "kvpop"]

    def keys(ruler: dict | None = None, base: str = "base") -> dict:
        p = parse_params({"train": {"policies": ["kvpop_mlp", "kvpop"]}, "evaluate": {"benchmarks": {"ruler": ruler or {}}}})
        return stage_module.ruler_keys(p, names, str(tmp_path / base), tmp_path / "export", "cpu", {})

    first = keys()
    assert len(set(first.values())) == len(names) and all(k.parent == stage_module.RULER_CACHE for k in first.values())
    assert keys() == first == keys({"workers": 4}) == keys(base="link")
    assert not set(keys({"batch": 2}).values()) & set(first.values())
    (tmp_path / "export/kvpop_mlp/model.safetensors").write_bytes(b"retrained")
    after = keys()
    assert [n for n in names if after[n] != first[n]] == ["kvpop_mlp", "kvpop_mlp, one pool"]
