"""Where a measured result comes from: one envelope for every file under ``results/``.

Every result file is a JSON object whose first key is ``"provenance"``::

    {"provenance": {"command": "...", "git_commit": "<40 hex>", "device": "NVIDIA H200",
                    "versions": {"python": "3.12.3", "torch": "2.11.0+cu130", ...}, "date": "<UTC ISO 8601>"},
     ...the payload...}

``command`` is the command line that wrote the file, ``git_commit`` the commit of the code that ran
(``KVPOP_GIT_COMMIT`` where the machine has no git checkout, as on the device; ``git rev-parse HEAD``
otherwise; where tracked files differ from it, ``"uncommitted"`` lists them: the figures then came from
that commit plus those edits), ``device`` the accelerator (or the CPU's model name), ``versions`` the packages that shape
the figures. :func:`write_result` writes payload and envelope atomically; :func:`check_envelope`
names what an envelope lacks (``tests/test_results.py`` walks ``results/`` with it).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from kvpop.io import atomic_file

#: the keys every envelope holds
ENVELOPE_KEYS = ("command", "git_commit", "device", "versions", "date")
#: packages whose versions travel in the envelope (those installed)
VERSIONED = ("torch", "transformers", "triton", "lightning")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _git(root: str | Path | None, *args: str) -> str | None:
    """``git ARGS`` in ``root`` (default: this package's checkout): its output, or None where ``KVPOP_GIT_COMMIT``
    names the code (checked there), git is missing or the folder is no checkout."""
    env = os.environ.get("KVPOP_GIT_COMMIT", "").strip()
    if env:
        if not _COMMIT.match(env):
            raise ValueError(f"KVPOP_GIT_COMMIT must be a 40-digit hex commit, got {env!r}")
        return None
    root = Path(root) if root is not None else Path(__file__).resolve().parent
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(root: str | Path | None = None) -> str | None:
    """The commit of the code that runs: ``KVPOP_GIT_COMMIT``, else ``git rev-parse HEAD`` in ``root``
    (default: this package's checkout), else None."""
    env = os.environ.get("KVPOP_GIT_COMMIT", "").strip()
    out = _git(root, "rev-parse", "HEAD")
    sha = env or (out or "").strip()
    return sha if _COMMIT.match(sha) else None


def uncommitted(root: str | Path | None = None) -> list[str]:
    """Tracked files of the checkout that differ from its HEAD (``git status --porcelain``, untracked files
    left out), sorted; empty where the tree is clean, there is no checkout, or ``KVPOP_GIT_COMMIT`` names the code."""
    out = _git(root, "status", "--porcelain", "--untracked-files=no") or ""
    return sorted(line[3:].strip() for line in out.splitlines() if len(line) > 3)


def device_name() -> str:
    """The accelerator that ran (``torch.cuda.get_device_name``; ``"<n> x <name>"`` for several), else the CPU."""
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            name = torch.cuda.get_device_name(0)
            return name if n == 1 else f"{n} x {name}"
    except ImportError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def versions() -> dict[str, str]:
    """Python and the installed packages of :data:`VERSIONED`."""
    out = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:  # the torch that runs, with its build tag (+cpu, +cu130), over the distribution's metadata
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def envelope(command: str | None = None) -> dict:
    """The provenance of a result written now by this process (module docstring)."""
    env = {
        "command": command if command is not None else shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "git_commit": git_commit(),
        "device": device_name(),
        "versions": versions(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    if changed := uncommitted():
        env["uncommitted"] = changed
    return env


def check_envelope(doc: object) -> list[str]:
    """What a result document's envelope lacks, as messages (empty: complete)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("provenance"), dict):
        return ['no "provenance" object at the top level']
    env = doc["provenance"]
    problems = [f"provenance.{k} missing or empty" for k in ENVELOPE_KEYS if not env.get(k)]
    if env.get("git_commit") and not _COMMIT.match(str(env["git_commit"])):
        problems.append(f"provenance.git_commit {env['git_commit']!r} is not a 40-digit hex commit")
    if env.get("versions") and not isinstance(env["versions"], dict):
        problems.append("provenance.versions must be an object of package -> version")
    return problems


def read_provenance(path: str | Path) -> dict:
    """The provenance in a JSON file (a run made on another machine: ``command``, ``git_commit``, ``device``,
    ``versions``, ``date``), checked as :func:`check_envelope` checks a result's; ValueError naming the file and
    what it lacks (OSError where it cannot be read)."""
    try:
        env = json.loads(Path(path).read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not JSON ({err})") from err
    if problems := check_envelope({"provenance": env}):
        raise ValueError(f"{path}: not a provenance: " + "; ".join(problems))
    return env


def script_summary() -> str | None:
    """The first line of the running script's docstring (``__main__``), or None."""
    doc = getattr(sys.modules.get("__main__"), "__doc__", None) or ""
    line = doc.strip().splitlines()[0].strip() if doc.strip() else ""
    return line or None


def write_result(path: str | Path, payload: dict, *, what: str | None = None, command: str | None = None,
                 provenance: dict | None = None) -> Path:
    """Write ``{"provenance": ..., "what": ..., **payload}`` to ``path`` atomically (a temp file, then a
    rename): an interrupted write leaves the previous file whole. ``provenance`` defaults to
    :func:`envelope`; ``what`` (one line: what the file measures, read by ``results/README.md``'s index,
    :mod:`kvpop.results_index`) to the payload's own ``"what"``, else the first line of the running
    script's docstring."""
    if "provenance" in payload:
        raise ValueError("the payload has its own 'provenance' key; pass it as provenance=")
    what = what or payload.get("what") or script_summary()
    if not what or "\n" in what:
        raise ValueError(f"a result needs a one-line 'what' (what it measures), got {what!r}")
    path = Path(path)
    doc = {"provenance": provenance if provenance is not None else envelope(command), "what": what,
           **{k: v for k, v in payload.items() if k != "what"}}
    with atomic_file(path) as f:
        f.write(json.dumps(doc, indent=2) + "\n")
    return path
