"""Experiment profiles (pipeline/profiles.py) and the DVC-less stage runner (pipeline/run_stages.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvpop.config import parse_params

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipeline"))
import profiles  # noqa: E402
import run_stages  # noqa: E402
from validate import budget_warning, slot_errors  # noqa: E402


def run_profiles(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pipeline" / "profiles.py"), *args], cwd=cwd, capture_output=True, text=True)


@pytest.mark.parametrize("name", ["4k", "8k", "paper", "paper-cpu"])
def test_a_profile_is_valid_params_and_its_arguments_read_back(name):
    """Every shipped profile merges over params.yaml into valid params, and the printed -S arguments, read
    the way DVC reads them (YAML values), set exactly the profile's leaves."""
    res = run_profiles(name)
    assert res.returncode == 0, res.stderr
    words = shlex.split(res.stdout)
    assert words[::2] == ["-S"] * (len(words) // 2)
    printed = dict(w.split("=", 1) for w in words[1::2])
    leaves = dict(profiles.leaves(yaml.safe_load((ROOT / "profiles" / f"{name}.yaml").read_text())))
    assert {k: yaml.safe_load(v) for k, v in printed.items()} == leaves
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    p = parse_params(profiles.merged(base, list(leaves.items())))
    assert p.budget < p.train.seq_len  # a quality profile evicts: the budget is below the row length


QWEN3_4B = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 128}  # Qwen/Qwen3-4B-Instruct-2507's config.json


def profile_params(name: str, *extra: tuple[str, object]):
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    return parse_params(profiles.merged(base, profiles.leaves(profiles.read_yaml(profiles.profile_path(name))) + list(extra)))


def test_paper_profiles_budget_4096_of_16k_rows_and_its_cpu_twin():
    """``paper``: the paper's setting (Qwen3-4B from the hub, Nemotron traces, rows of 16,384 tokens) in
    which budget 4096 is a quarter of a row, and ``-S budget=4096`` / ``2048`` are the paper's budgets;
    ``paper-cpu``: the same quarter of the default's rows on the embedded model. Each evicts (no budget
    warning) and leaves every trained policy long-range slots on its model."""
    paper, cpu = profile_params("paper"), profile_params("paper-cpu")
    assert (paper.base_model.source, paper.filter.source) == ("Qwen/Qwen3-4B-Instruct-2507", "nemotron")
    assert paper.train.seq_len == paper.filter.max_tokens == 16384 and paper.budget == 4096
    assert profile_params("paper", ("budget", 4096)) == paper and profile_params("paper", ("budget", 2048)).budget == 2048
    default = parse_params(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert cpu.base_model.source == default.base_model.source and cpu.train.seq_len == default.train.seq_len
    assert cpu.budget / min(cpu.train.seq_len, cpu.filter.max_tokens) == paper.budget / paper.train.seq_len == 0.25
    embedded = json.loads((ROOT / "metrics" / "base_model.json").read_text())  # the committed run's teacher shape
    assert embedded["source"] == "embedded"
    for p, shape in ((paper, QWEN3_4B), (cpu, embedded)):
        assert budget_warning(p) is None
        slots, errors = slot_errors(p, shape)
        assert not errors and min(slots.values()) > 0, errors
    assert budget_warning(profile_params("paper-cpu", ("budget", 4096))) is not None  # -S budget=4096 on CPU rows: the warning


def test_write_gives_the_merged_params(tmp_path):
    out = tmp_path / "params.yaml"
    res = run_profiles("4k", "--write", str(out))
    assert res.returncode == 0, res.stderr
    p = parse_params(yaml.safe_load(out.read_text()))
    assert (p.budget, p.train.seq_len, p.filter.synthetic.eval_seed, str(p.train.target)) == (512, 4096, 1, "mean")


def test_a_bad_profile_names_the_key_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  stepz: 3\n")
    out = tmp_path / "params.yaml"
    res = run_profiles(str(bad), "--write", str(out))
    assert res.returncode == 2 and "train.stepz" in res.stderr and not out.exists()
    res = run_profiles("no_such_profile")
    assert res.returncode == 2 and "profile not found" in res.stderr and "4k" in res.stderr


def test_commands_expand_foreach_items_and_outputs():
    dvc = {"stages": {
        "a": {"cmd": "echo a ${budget}", "outs": ["out/a"]},
        "t": {"foreach": "${train.policies}", "do": {"cmd": "echo ${item} ${train.steps}", "outs": ["out/${item}", {"m/${item}.json": {"cache": False}}]}},
    }}
    params = {"budget": 7, "train": {"policies": ["x", "y"], "steps": 3}}
    assert run_stages.commands(dvc, params) == [
        ("a", None, "echo a 7", ["out/a"]),
        ("t", "x", "echo x 3", ["out/x", "m/x.json"]),
        ("t", "y", "echo y 3", ["out/y", "m/y.json"]),
    ]
    with pytest.raises(KeyError, match="train.nope"):
        run_stages.commands({"stages": {"a": {"cmd": "echo ${train.nope}"}}}, params)


def test_the_runner_runs_in_order_in_parallel_and_skips_what_is_done(tmp_path, monkeypatch):
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "first": {"cmd": "echo first >> log.txt", "outs": ["first.out"]},
        "each": {"foreach": "${items}", "do": {"cmd": "echo ${item} >> log.txt && touch ${item}.out", "outs": ["${item}.out"]}},
        "last": {"cmd": "echo last >> log.txt"},
    }}, sort_keys=False))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"items": ["p", "q"]}))
    (tmp_path / "p.out").write_text("")  # p is done
    monkeypatch.setattr(run_stages, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["run_stages.py", "--skip-done", "--parallel", "each"])
    run_stages.main()
    lines = (tmp_path / "log.txt").read_text().split()
    assert lines == ["first", "q", "last"]  # first has no first.out, so it runs; p is skipped
    monkeypatch.setattr(sys, "argv", ["run_stages.py", "--from", "nope"])
    with pytest.raises(SystemExit, match="no such stage"):
        run_stages.main()
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"bad": {"cmd": "exit 3"}, "after": {"cmd": "echo after >> log.txt"}}}, sort_keys=False))
    monkeypatch.setattr(sys, "argv", ["run_stages.py"])
    with pytest.raises(SystemExit, match="stage bad failed"):
        run_stages.main()
    assert (tmp_path / "log.txt").read_text().split() == lines  # nothing after the failure ran


@pytest.mark.parametrize("name", ["4k", "8k", "paper"])
def test_gpu_profiles_fine_tune_the_pool_policy_over_the_frozen_cpu_default(name):
    """A profile's leaves merge over params.yaml: a per-policy key it leaves out keeps the CPU default's value.
    The CPU default freezes kvpop_mlp_pool's model (model_lr 0); the profiles at scale fine-tune it (frozen lost
    on every column at 4k), so they must say model_lr themselves."""
    base = parse_params(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert base.train.for_policy("kvpop_mlp_pool").model_lr == 0
    p = profile_params(name)
    assert p.train.for_policy("kvpop_mlp_pool").model_lr == p.train.model_lr > 0
