"""results/: every file has a complete envelope and a one-line "what", and results/README.md is exactly
what ``python -m kvpop.results_index`` writes from them (so no file is missing from the index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpop.results_index import INDEX, collect, main, render

RESULTS = Path(__file__).resolve().parents[1] / "results"
FILES = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p != RESULTS / INDEX)


def test_every_file_is_complete():
    _, problems = collect(RESULTS)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("rel", FILES)
def test_file_is_in_the_index(rel):
    assert f"]({rel})" in (RESULTS / INDEX).read_text(), f"results/{rel} is not in results/{INDEX}: run python -m kvpop.results_index"


def test_index_is_what_the_generator_writes():
    entries, _ = collect(RESULTS)
    assert (RESULTS / INDEX).read_text() == render(entries), f"results/{INDEX} is stale: run python -m kvpop.results_index"


def _doc(what="decode rows", **env):
    prov = {"command": "bench/bench_x.py", "git_commit": "0" * 40, "device": "cpu", "versions": {"torch": "2"}, "date": "2026-12-02"}
    return {"provenance": {**prov, **env}, "what": what, "rows": []}


def test_the_checks_fail_on_bad_files(tmp_path):
    """The twin of the real walk on a toy folder: each kind of bad file is named, and --check fails."""
    (tmp_path / "bench_x").mkdir()
    (tmp_path / "bench_x" / "cpu.json").write_text(json.dumps(_doc()))
    assert main(["--root", str(tmp_path)]) == 0 and main(["--root", str(tmp_path), "--check"]) == 0

    (tmp_path / "bench_x" / "cpu_new.json").write_text(json.dumps(_doc()))  # not in the index yet
    assert main(["--root", str(tmp_path), "--check"]) == 1
    main(["--root", str(tmp_path)])
    assert "](bench_x/cpu_new.json)" in (tmp_path / INDEX).read_text()

    bad = {
        "bench_x/cpu_nocommit.json": json.dumps(_doc(git_commit="")),
        "bench_x/cpu_shortcommit.json": json.dumps(_doc(git_commit="abc123")),
        "bench_x/cpu_nowhat.json": json.dumps(_doc(what="")),
        "bench_x/cpu_noenv.json": json.dumps({"configurations": []}),
        "bench_x/cpu_broken.json": "{",
        "bench_x/profile.txt": "a table",
        "flat.json": json.dumps(_doc()),  # at the top, but no issue names it
    }
    for rel, text in bad.items():
        (tmp_path / rel).write_text(text)
    (tmp_path / "ruler_h200.json").write_text(json.dumps(_doc()))  # a file an issue names at the top: indexed
    entries, problems = collect(tmp_path)
    assert {e.path for e in entries} == {"bench_x/cpu.json", "bench_x/cpu_new.json", "ruler_h200.json"}
    for rel in bad:
        assert any(p.startswith(rel + ":") for p in problems), rel
    assert any("git_commit" in p for p in problems) and any('"what"' in p for p in problems)
    assert main(["--root", str(tmp_path), "--check"]) == 1


def test_the_index_names_each_folders_script_where_it_lies():
    from kvpop.results_index import script_of

    assert script_of("bench_decode") == "`bench/bench_decode.py`"
    assert script_of("profile_pool_train") == "`bench/kernels/profile_pool_train.py`"
    assert (RESULTS.parent / "bench" / "kernels" / "profile_pool_train.py").exists()


def test_envelope_names_the_tracked_files_that_differ_from_the_commit(tmp_path, monkeypatch):
    """A result written from a tree with edits says so: ``uncommitted`` lists the changed tracked files (untracked
    ones left out); a clean tree, no checkout or ``KVPOP_GIT_COMMIT`` give none, and a clean envelope has no such key."""
    import subprocess

    from kvpop import provenance

    monkeypatch.delenv("KVPOP_GIT_COMMIT", raising=False)
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 1\n")
    subprocess.run([*git, "add", "a.py", "b.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)
    assert provenance.uncommitted(tmp_path) == []
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "new.py").write_text("z = 0\n")  # untracked: not listed
    assert provenance.uncommitted(tmp_path) == ["b.py"]
    monkeypatch.setenv("KVPOP_GIT_COMMIT", "0" * 40)
    assert provenance.uncommitted(tmp_path) == []
    monkeypatch.delenv("KVPOP_GIT_COMMIT")
    assert provenance.uncommitted(tmp_path / "missing") == []
    monkeypatch.setattr(provenance, "uncommitted", lambda root=None: [])
    assert "uncommitted" not in provenance.envelope("cmd")
    monkeypatch.setattr(provenance, "uncommitted", lambda root=None: ["src/kvpop/x.py"])
    env = provenance.envelope("cmd")
    assert env["uncommitted"] == ["src/kvpop/x.py"] and not provenance.check_envelope({"provenance": env})
