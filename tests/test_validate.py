"""pipeline/validate.py: which keys a `dvc exp run` set, and putting them back after a bad run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "pipeline"))

from validate import budget_warning, params_before_command, restore_params, revert_keys, set_param_keys  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "keys"),
    [
        (["dvc", "exp", "run", "-S", "budget=100"], ["budget"]),
        (["/x/bin/dvc", "exp", "run", "-Swindow=0", "--set-param", "train.steps=3", "--set-param=+train.x=1"], ["window", "train.steps", "train.x"]),
        (["dvc", "exp", "run", "-S", "params.yaml:seed=1", "-S", "other.yaml:a=1", "-S", "~train.tau"], ["seed", "train.tau"]),
        (["dvc", "exp", "run", "-S", "filter.synthetic.min_chars=1:2"], ["filter.synthetic.min_chars"]),  # a colon in the value
        (["dvc", "exp", "run"], []),
        (["dvc", "repro"], None),
        (["python", "pipeline/train.py"], None),
    ],
)
def test_set_param_keys(argv, keys):
    assert set_param_keys(argv) == keys


def test_revert_keys():
    base = {"budget": 384, "train": {"steps": 16, "tau": 1.0}, "window": 256}
    cur = {"budget": 100, "train": {"steps": 16, "tau": 2.0, "extra": 1}, "window": 256}
    assert revert_keys(cur, base, ["budget", "train.extra"]) == {"budget": 384, "train": {"steps": 16, "tau": 2.0}, "window": 256}
    assert cur["budget"] == 100  # not modified in place
    assert revert_keys(cur, base, ["no.such.key"]) == cur
    assert revert_keys(cur, base, ["budget.x"]) == cur  # a key below a scalar: nothing to revert


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}


def git_repo(tmp_path: Path, text: str) -> str:
    env = GIT_ENV
    (tmp_path / "params.yaml").write_text(text)
    for cmd in (["git", "init", "-q"], ["git", "add", "params.yaml"], ["git", "commit", "-qm", "base"]):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()


COMMITTED = "# comment kept\nbudget: 384   # per head\nwindow: 256\ntrain:\n  policies: [kvpop_mlp, kvpop]\n  steps: 16\n"


def test_restore_is_byte_exact_when_only_the_experiments_keys_changed(tmp_path):
    rev = git_repo(tmp_path, COMMITTED)
    p = tmp_path / "params.yaml"
    p.write_text("budget: 100\nwindow: 256\ntrain:\n  policies:\n  - kvpop_mlp\n  - kvpop\n  steps: 16\n  x: 1\n")  # as DVC rewrites it
    assert "as at the baseline" in restore_params(p, rev, ["budget", "train.x"])
    assert p.read_text() == COMMITTED


def test_restore_keeps_the_users_other_uncommitted_edits(tmp_path):
    rev = git_repo(tmp_path, COMMITTED)
    p = tmp_path / "params.yaml"
    p.write_text(COMMITTED.replace("steps: 16", "steps: 99").replace("budget: 384", "budget: 100"))  # steps: the user's own edit
    assert "set back" in restore_params(p, rev, ["budget"])
    got = p.read_text()
    assert yaml.safe_load(got) == {**yaml.safe_load(COMMITTED), "train": {"policies": ["kvpop_mlp", "kvpop"], "steps": 99}}
    assert "# comment kept" in got


def test_restore_without_a_baseline_file_changes_nothing(tmp_path):
    rev = git_repo(tmp_path, COMMITTED)
    other = tmp_path / "sub"
    other.mkdir()
    p = other / "params.yaml"
    p.write_text("budget: 100\n")
    assert "keeps the experiment's values" in restore_params(p, rev, ["budget"])
    assert p.read_text() == "budget: 100\n"


def stash_round_trip(repo: Path) -> None:
    """What ``dvc exp run`` does to the workspace before it writes the ``-S`` values (DVC 3.x,
    ``scm.stash_workspace``): a git stash of the workspace, popped again, its commit left unreachable."""
    for cmd in (["git", "stash", "push", "-q"], ["git", "stash", "pop", "-q"]):
        subprocess.run(cmd, cwd=repo, env=GIT_ENV, check=True, capture_output=True)


def test_restore_puts_back_the_users_uncommitted_value_of_a_key_the_command_set(tmp_path):
    """A hand edit of the very key the command set (budget 512, uncommitted; -S budget=100) comes
    back, byte for byte with the user's other edit, from the workspace stash of this command; a stash
    older than the command is not taken (the commit's values come back instead)."""
    rev = git_repo(tmp_path, COMMITTED)
    p = tmp_path / "params.yaml"
    edited = COMMITTED.replace("budget: 384", "budget: 512").replace("steps: 16", "steps: 99  # mine")
    p.write_text(edited)
    started = time.time()
    stash_round_trip(tmp_path)
    assert p.read_text() == edited
    during = "budget: 100\nwindow: 256\ntrain:\n  policies:\n  - kvpop_mlp\n  - kvpop\n  steps: 99  # mine\n"  # as DVC rewrites it
    p.write_text(during)
    text, stash = params_before_command(p, ["budget"], started)
    assert text == edited and len(stash) == 40
    assert params_before_command(p, ["window"], started) is None  # budget differs too: not this command's stash
    assert params_before_command(p, ["budget"], started + 10) is None  # the stash is older than the command
    assert "before the command" in restore_params(p, rev, ["budget"], started)
    assert p.read_text() == edited
    p.write_text(during)
    assert "set back" in restore_params(p, rev, ["budget"], started + 10)  # an older stash: the commit's budget
    assert yaml.safe_load(p.read_text())["budget"] == 384 and yaml.safe_load(p.read_text())["train"]["steps"] == 99


def params_with(**changes) -> object:
    from kvpop.config import parse_params

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        node = raw
        for part in path:
            node = node[part]
        node[last] = value
    return parse_params(raw)


def test_budget_warning_names_the_budget_and_the_rows_length():
    seq_len = params_with().train.seq_len
    assert budget_warning(params_with(budget=seq_len - 1)) is None
    for budget in (seq_len, 4096):
        msg = budget_warning(params_with(budget=budget))
        assert msg.startswith("warning:") and f"budget {budget} " in msg and f"{seq_len} tokens" in msg and "nothing will ever be evicted" in msg
    # rows bounded by the filter: traces of at most filter.max_tokens in longer training rows
    msg = budget_warning(params_with(budget=600, filter__max_tokens=512, train__seq_len=2048))
    assert "512 tokens" in msg and "filter.max_tokens 512" in msg and "nothing will ever be evicted" in msg
    # longer held-out traces than training rows: training alone never evicts
    msg = budget_warning(params_with(budget=1500, filter__max_tokens=4096, train__seq_len=1024))
    assert "training never evicts" in msg and "1024 tokens" in msg and "4096" in msg
    assert budget_warning(params_with(budget=1500, filter__max_tokens=4096, train__seq_len=4096)) is None


def test_validate_stage_warns_and_goes_on(tmp_path):
    """The stage prints the warning (both numbers) and writes its marker: a warning, not an error."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["budget"] = 4096
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    res = subprocess.run([sys.executable, str(ROOT / "pipeline" / "validate.py"), "--params", "params.yaml", "--out", "valid"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert res.returncode == 0 and (tmp_path / "valid").is_file(), res.stderr
    err = " ".join(res.stderr.split())  # rich wraps long lines
    assert "budget 4096 >=" in err and f"{raw['train']['seq_len']} tokens" in err and "nothing will ever be evicted" in err


def test_slot_errors_name_the_budget_and_the_policy():
    from kvpop.config import parse_params
    from slots import slot_errors

    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
    p = parse_params({"budget": 48, "sinks": 4, "window": 32, "train": {"policies": ["kvpop_mlp"]}})
    assert slot_errors(p, shape) == ({"kvpop_mlp": 12}, [])
    p = parse_params({"budget": 37, "sinks": 4, "window": 32, "train": {"policies": ["kvpop_mlp", "kvpop"]}})
    slots, errors = slot_errors(p, shape)
    assert slots["kvpop_mlp"] == 1 and len(errors) == 1 and errors[0].startswith("  budget:") and "kvpop" in errors[0]


def exp_repo(tmp_path: Path, base_dir: Path) -> tuple[Path, dict]:
    """A git + DVC repository with this checkout's validate and slots stages alone (a tiny model as
    ``models/base``), reproduced and committed: ``dvc exp run`` reaches both in seconds."""
    import os
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {k: stages[k] for k in ("validate", "slots")}}, sort_keys=False))
    for d in ("pipeline", "src"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(base_dir, repo / "models" / "base")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params.update(budget=48, sinks=4, window=32)
    params["train"]["policies"] = ["kvpop_mlp", "kvpop"]
    (repo / "params.yaml").write_text("# the user's comment\n" + yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(repo / "src"),
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "repro", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "base"]):
        res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        assert res.returncode == 0, (cmd, res.stdout[-2000:], res.stderr[-2000:])
    return repo, env


@pytest.mark.slow
def test_bad_exp_run_restores_params_as_before_the_command(tiny_qwen3_dir, tmp_path):
    """``dvc exp run -S`` with a value that validate (params alone) or slots (the model's head dim)
    refuses: params.yaml is as it was before the command, byte for byte, the user's uncommitted edits
    (of a key the command did not set, and of the very key it set) and comment included, and no
    output changed. A valid budget at or above the rows' length runs, with validate's warning first."""
    repo, env = exp_repo(tmp_path, tiny_qwen3_dir)
    params = repo / "params.yaml"
    edited = params.read_text().replace("steps: 16", "steps: 99  # the user's uncommitted edit")
    edited = edited.replace("budget: 48", "budget: 52  # the user's own budget, uncommitted")
    assert edited.count("uncommitted") == 2
    params.write_text(edited)
    marks = {m: (repo / m).read_bytes() for m in ("data/params.valid", "data/slots.valid")}
    dvc = str(Path(sys.executable).parent / "dvc")
    for override, stage, key in (("window=0", "validate", "window"), ("budget=40", "slots", "kvpop")):
        res = subprocess.run([dvc, "exp", "run", "-S", override], cwd=repo, env=env, capture_output=True, text=True)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and key in out and f"Running stage '{stage}'" in out, out[-3000:]
        assert "restored as it was before the command" in out, out[-3000:]
        assert params.read_text() == edited, override
        assert {m: (repo / m).read_bytes() for m in marks} == marks
    seq_len = yaml.safe_load(edited)["train"]["seq_len"]
    res = subprocess.run([dvc, "exp", "run", "-S", f"budget={2 * seq_len}"], cwd=repo, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # one stream: DVC's lines and the stages' in the order written
    out = " ".join(res.stdout.split())  # rich wraps the warning
    assert res.returncode == 0, out[-3000:]
    warning = out.find(f"warning: budget {2 * seq_len} >= the rows' length {seq_len} tokens")
    assert 0 <= warning < out.index("Running stage 'slots'"), out[-3000:]  # validate's, before any later stage
