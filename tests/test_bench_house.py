"""bench/ is a house of whole programs over the library, not a second pipeline.

* no bench script imports another (by module name, relative import, ``importlib``, ``__import__``,
  ``runpy``) or edits ``sys.path`` to reach one: what two scripts share lives in ``kvpop.benchmarking``;
* no bench script takes a policy label apart (a function of a ``label`` argument that splits it or
  matches it with ``re``): the label grammar has one parser, in the library;
* a few scripts, run as a user runs them in a fresh process (CPU, smoke sizes), write one result
  whose envelope (:func:`kvpop.provenance.check_envelope`) is complete.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpop.provenance import check_envelope

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
SCRIPTS = sorted(BENCH.rglob("*.py"))
STEMS = {p.stem for p in SCRIPTS}
#: scripts on their way out, and the checks each still fails (drop each name with its file)
RETIRING: dict[str, set[str]] = {}
SPLITTERS = {"split", "rsplit", "partition", "rpartition"}


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def cases(check: str):
    """One param per script; a retiring one that fails ``check`` is expected to (strictly: fixed, it says so)."""
    xfail = pytest.mark.xfail(strict=True, reason="retired by the integrator")
    return [pytest.param(p, id=rel(p), marks=[xfail] if check in RETIRING.get(p.name, ()) else []) for p in SCRIPTS]


def bench_module(name: str | None) -> bool:
    """Whether a dotted module name reaches a bench script (or the bench folder as a package)."""
    parts = (name or "").split(".")
    return parts[0] in ("bench", "kernels") or any(part in STEMS for part in parts)


def string_arg(call: ast.Call) -> str | None:
    return call.args[0].value if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str) else None


def dotted(node: ast.AST) -> str:
    """``a.b.c`` of an attribute chain (empty where it is not one)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def bench_imports(path: Path) -> list[str]:
    """Every place ``path`` imports a bench script or edits ``sys.path``, as ``line: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if bench_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level or bench_module(node.module) or any(n in STEMS for n in names):
                found.append(f"{node.lineno}: from {'.' * node.level}{node.module or ''} import {', '.join(names)}")
        elif isinstance(node, ast.Call):
            fn = dotted(node.func)
            if fn in ("importlib.import_module", "import_module", "__import__") and bench_module(string_arg(node)):
                found.append(f"{node.lineno}: {fn}({string_arg(node)!r})")
            elif fn.startswith("runpy."):
                found.append(f"{node.lineno}: {fn}(...)")
            elif fn in ("sys.path.insert", "sys.path.append", "sys.path.extend"):
                found.append(f"{node.lineno}: {fn}(...)")
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{node.lineno}: sys.path assigned" for t in targets if dotted(t) == "sys.path"]
    return found


def label_parsers(path: Path) -> list[str]:
    """Functions of ``path`` that take a ``*label*`` argument apart (``.split``/``.partition``/... on
    it, or a ``re`` call on it), as ``line: name``."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = fn.args
        params = {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if "label" in p.arg.lower()}
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            f = call.func
            splits = isinstance(f, ast.Attribute) and f.attr in SPLITTERS and isinstance(f.value, ast.Name) and f.value.id in params
            regex = dotted(f).startswith("re.") and any(isinstance(x, ast.Name) and x.id in params for x in call.args)
            if splits or regex:
                found.append(f"{fn.lineno}: {fn.name}")
                break
    return found


def test_the_house_is_found():
    assert len(SCRIPTS) >= 10 and (BENCH / "kernels").is_dir(), SCRIPTS
    gone = set(RETIRING) - {p.name for p in SCRIPTS}
    assert not gone, f"RETIRING names files that are gone, drop them from the list: {sorted(gone)}"
    assert len(STEMS) == len(SCRIPTS), "two bench scripts share a file name"


def test_the_checks_catch_what_they_mean(tmp_path):
    """The two detectors on a script that does both things (and on one that does neither)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, 'bench')\nfrom bench_decode import fill\nimport importlib\n"
                   "m = importlib.import_module('bench_ttft')\n\n"
                   "def parse_label(label):\n    name, _, tgt = label.partition('@')\n    return name, tgt\n")
    assert len(bench_imports(bad)) == 3 and label_parsers(bad) == ["7: parse_label"]
    good = tmp_path / "good.py"
    good.write_text("from kvpop.benchmarking import run_script\n\ndef title(label):\n    return f'{label}, recency'\n")
    assert bench_imports(good) == [] and label_parsers(good) == []


@pytest.mark.parametrize("path", cases("imports"))
def test_no_bench_script_imports_another(path):
    assert bench_imports(path) == [], f"{rel(path)} reaches another bench script; share through kvpop.benchmarking instead"


@pytest.mark.parametrize("path", cases("labels"))
def test_no_bench_script_parses_labels(path):
    assert label_parsers(path) == [], f"{rel(path)} takes a label apart; parse labels with the library's parser"


def run_bench(script: str, *args: str, out: Path, timeout: int = 300) -> dict:
    """Run a bench script as a user does (a fresh process at the repository root, src/ on PYTHONPATH,
    no GPU) -> its result document."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, script, *args, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


SMOKE = [  # (script, args, payload keys), each under ~20 s on one shared CPU core
    ("bench/kernels/bench_cpu_scale.py", ["--small"], {"threads", "selection", "mlstm"}),
    ("bench/kernels/bench_mlstm.py", ["--small", "--no-parallel"], {"device", "threads", "rows"}),
]
SLOW = [  # each 15-25 s on two shared cores
    ("bench/kernels/bench_selection.py", ["--small"], {"config", "sizes"}),
    ("bench/bench_decode.py", ["--small", "--parts", "b1"], {"info", "rows"}),
    ("bench/bench_ttft.py", ["--small", "--modes", "eager"], {"info", "modes"}),
    ("bench/kernels/profile_pool_prefill.py", ["--small", "--ops"], {"s_per_chunk", "table_host", "table_device", "ops_per_chunk"}),
    ("bench/kernels/profile_pool_prefill.py", ["--small", "--timeline", "--chunk-graphs"], {"timeline", "first_s", "prefill_s", "phases"}),
    ("bench/bench_pool_prefill.py", ["--small", "--context", "1024", "--decay-block", "16"], {"rows", "budget", "tokens"}),
    ("bench/kernels/profile_pool_train.py", ["--small"], {"pass_s", "ranges", "table_host"}),
    ("bench/bench_pool_step.py", ["--cpu-smoke", "--scorer-kl", "30", "--delays", "16", "--graphs"], {"config", "variants"}),
    ("bench/bench_ruler_decode.py", ["--small", "--prompts", "3", "--context", "300", "--budget", "96", "--new", "4", "--batch", "2",
                                     "--policies", "dense", "kvpop_mlp", "dbtrimkv"], {"config", "policies"}),
]


@pytest.mark.parametrize(("script", "args", "keys"), [pytest.param(*c, id=c[0]) for c in SMOKE]
                         + [pytest.param(*c, id=c[0], marks=pytest.mark.slow) for c in SLOW])
def test_smoke_run_writes_one_enveloped_result(tmp_path, script, args, keys):
    out = tmp_path / "r.json"
    doc = run_bench(script, *args, out=out)
    assert check_envelope(doc) == []
    assert next(iter(doc)) == "provenance" and keys <= set(doc), sorted(doc)
    assert Path(doc["provenance"]["command"].split()[0]).name == Path(script).name
    for stale in ("date", "torch", "transformers", "device_name"):  # the envelope holds these now
        assert stale not in doc and stale not in doc.get("info", {}), stale
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # the atomic write leaves no temp file


@pytest.mark.slow
def test_bench_decode_goals_write_their_scripts_results_beside_out(tmp_path):
    """``--parts goals`` runs bench_ttft.py and bench_train_step.py in fresh processes (about 90 s on
    two cores); each writes its own enveloped result beside ``--out``."""
    doc = run_bench("bench/bench_decode.py", "--small", "--parts", "goals", out=tmp_path / "d.json", timeout=600)
    assert check_envelope(doc) == [] and {g["goal"] for g in doc["goals"]} >= {"selection_share", "ttft_warm_s"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "d_train_step.json", "d_ttft.json"]
    for name in ("ttft", "train_step"):
        assert doc["goal_scripts"][name]["rc"] == 0, doc["goal_scripts"][name]["error"]
        assert check_envelope(json.loads((tmp_path / f"d_{name}.json").read_text())) == []
