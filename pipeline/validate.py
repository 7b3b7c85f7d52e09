"""Stage validate: params.yaml is checked before any stage whose outputs DVC would clear.

DVC deletes a stage's outputs just before it runs the stage's command, so a stage that finds a bad
param itself has already lost the previous run's outputs. This stage comes first: ``base_model``
(and through it every stage) depends on its marker ``data/params.valid``, so a bad value stops
``dvc repro`` here with the key named, before anything is deleted. The marker is persistent and its
content never changes, so a valid change of params re-runs only the stages that read it. It reads
params.yaml alone; what needs the base model (each trained policy's long-range slots) is checked
by the ``slots`` stage, which declares the model as its input and stops the run the same way.

Inside ``dvc exp run -S key=value`` DVC has written the experiment's values into params.yaml before
any stage runs, and leaves them there when the run fails. When they are invalid, :func:`stop` puts
params.yaml back as it was before the command (:func:`restore_params`), the user's uncommitted edits
included, also of the keys the command set (:func:`params_before_command` finds that text).

A valid budget at or above the rows' length evicts nothing; the stage then warns, naming both numbers
(:func:`budget_warning`), and the run goes on.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
from pathlib import Path

import yaml

from kvpop.config import ParamsError, load_params
from kvpop.ruler import missing as ruler_missing

from common import console, write_text

MARKER = "params.yaml is valid (kvpop.config.Params)\n"


def set_param_keys(argv: list[str]) -> list[str] | None:
    """The params keys a ``dvc exp run`` command line sets (``-S``/``--set-param``), or None if argv
    is not one. ``params.yaml:a.b=1``, ``+a.b=1``, ``~a.b`` -> ``a.b``."""
    try:
        i = argv.index("exp")
    except ValueError:
        return None
    if argv[i + 1 : i + 2] != ["run"]:
        return None
    values, it = [], iter(argv[i + 2 :])
    for arg in it:
        if arg in ("-S", "--set-param"):
            values.append(next(it, ""))
        elif arg.startswith("--set-param="):
            values.append(arg.partition("=")[2])
        elif arg.startswith("-S"):
            values.append(arg[2:])
    keys = []
    for v in values:
        file, colon, rest = v.partition(":")
        if colon and "=" not in file and file != "params.yaml":
            continue  # another params file
        override = rest if colon and "=" not in file else v
        keys.append(override.partition("=")[0].lstrip("+~"))
    return keys


def exp_run_overrides() -> list[str] | None:
    """The ``-S`` keys of the ``dvc exp run`` that started this process (:func:`exp_run_process`), or
    None outside one (or where /proc does not tell)."""
    found = exp_run_process()
    return found[1] if found else None


def exp_run_process() -> tuple[int, list[str]] | None:
    """``(pid, -S keys)`` of the ``dvc exp run`` that started this process (its nearest ancestor that
    is one), or None outside one (or where /proc does not tell).

    Why the parent processes' command lines: DVC records the ``-S`` overrides nowhere a stage can
    read. It hands the stage ``DVC_EXP_BASELINE_REV``, ``DVC_EXP_NAME`` and ``DVC_ROOT`` only, and
    the experiment's commit (``refs/exps/exec/EXEC_MERGE``) holds params.yaml after the overrides,
    with the user's uncommitted edits merged in (DVC 3.x, ``BaseStashQueue._stash_exp``): a diff
    against the baseline cannot tell an override from a user's edit. So this reads the command
    lines of this process's own ancestors (``/proc/<pid>/cmdline`` and ``stat``, at most 16
    levels) and nothing else; on a system without /proc, params.yaml keeps the experiment's values
    and :func:`stop` says so."""
    pid = os.getppid()
    for _ in range(16):
        proc = Path(f"/proc/{pid}")
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
            stat = (proc / "stat").read_text()
        except OSError:
            return None
        keys = set_param_keys(argv)
        if keys is not None:
            return pid, keys
        pid = int(stat.rpartition(")")[2].split()[1])  # the field after the state: the parent
        if pid <= 1:
            return None
    return None


def process_start(pid: int) -> float | None:
    """When process ``pid`` started, in seconds since the epoch (to the second: /proc's boot time is
    whole seconds), or None where /proc does not tell."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])  # field 22, starttime
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _git(cwd: Path, *args: str) -> str | None:
    res = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd)
    return res.stdout if res.returncode == 0 else None


def params_before_command(path: Path, keys: list[str], since: float) -> tuple[str, str] | None:
    """``(text, commit)``: params.yaml as the workspace held it before a ``dvc exp run`` started at
    ``since`` (epoch seconds) on the checked-out commit ``head`` (during the run, HEAD), uncommitted
    edits included; None where no trace of it is left (then the workspace had no uncommitted change,
    or git cannot tell).

    Where DVC keeps it (DVC 3.x, ``BaseStashQueue._stash_exp``): before it writes the ``-S`` values,
    ``scm.stash_workspace`` stashes the workspace as a git stash commit (``WIP on <branch>``, parents
    ``head`` and its index) and, once the experiment is queued, pops and drops it: the commit stays in
    the object store, unreachable. The experiment's own commit (``refs/exps/exec/EXEC_MERGE``) holds
    the file with the ``-S`` values already in, and its second parent (``Index stash``) too. So this
    takes the newest unreachable (or ``refs/stash``) commit with two or more parents, the first one
    ``head``, made no earlier than the command started (2 s of slack for /proc's whole-second boot
    time) and no later than ``EXEC_MERGE`` where that exists, and keeps it only if ``path`` now
    differs from its params.yaml in ``keys`` alone. The time is what tells this command's stash from
    an older one: a workspace without uncommitted edits leaves no stash."""
    cwd = path.parent
    head = (_git(cwd, "rev-parse", "HEAD") or "").strip()
    fsck = _git(cwd, "fsck", "--unreachable", "--no-reflogs", "--no-progress")
    if not head or fsck is None:
        return None
    shas = [w[2] for line in fsck.splitlines() if len(w := line.split()) == 3 and w[:2] == ["unreachable", "commit"]]
    if (stash := _git(cwd, "rev-parse", "-q", "--verify", "refs/stash")) is not None:
        shas.append(stash.strip())
    if not shas:
        return None
    merge = _git(cwd, "show", "-s", "--format=%ct", "refs/exps/exec/EXEC_MERGE")
    until = int(merge) if merge else float("inf")
    shown = _git(cwd, "show", "-s", "--format=%H %ct %P%x00%s", *shas) or ""
    found = []
    for line in shown.splitlines():
        fields, _, subject = line.partition("\0")
        sha, ct, *parents = fields.split()
        if len(parents) >= 2 and parents[0] == head and since - 2 <= int(ct) <= until and not subject.startswith("dvc-exp:"):
            found.append((int(ct), sha))
    if not found:
        return None
    sha = max(found)[1]
    text = _git(cwd, "show", f"{sha}:./{path.name}")
    if text is None:
        return None
    before = yaml.safe_load(text) or {}
    if revert_keys(yaml.safe_load(path.read_text()) or {}, before, keys) != before:
        return None  # more than the command's keys differ: not this command's stash
    return text, sha


def revert_in_place(doc: dict, baseline: dict, keys: list[str]) -> None:
    """Set each dotted key of ``doc`` (any mapping, e.g. ruamel's, which keeps comments) back to its
    value in ``baseline``, or remove it where the baseline has none."""
    for key in keys:
        *parents, last = key.split(".")
        src, dst = baseline, doc
        for part in parents:
            src = src.get(part, {}) if isinstance(src, dict) else {}
            dst = dst.get(part) if isinstance(dst, dict) else None
        if not isinstance(dst, dict):
            continue
        if isinstance(src, dict) and last in src:
            dst[last] = src[last]
        else:
            dst.pop(last, None)


def revert_keys(current: dict, baseline: dict, keys: list[str]) -> dict:
    """A copy of ``current`` with ``keys`` reverted to ``baseline`` (:func:`revert_in_place`)."""
    out = yaml.safe_load(yaml.safe_dump(current))  # a deep copy
    revert_in_place(out, baseline, keys)
    return out


def _as_dvc_writes(text: str, baseline: dict | None = None, keys: list[str] = ()) -> str:
    """``text`` loaded and dumped the way DVC rewrites params.yaml for ``-S`` (ruamel's round trip,
    every collection in block style), with ``keys`` reverted to ``baseline`` first."""
    from ruamel.yaml import YAML  # DVC's own YAML library: keeps comments and layout
    from ruamel.yaml.comments import CommentedBase

    ry = YAML()
    ry.default_flow_style = False
    doc = ry.load(text) or {}
    if keys:
        revert_in_place(doc, baseline or {}, keys)

    def block(node) -> None:
        if isinstance(node, CommentedBase):
            node.fa.set_block_style()
        for child in node.values() if isinstance(node, dict) else node if isinstance(node, list) else ():
            block(child)

    block(doc)
    buf = io.StringIO()
    ry.dump(doc, buf)
    return buf.getvalue()


def _apply_edits(committed: str, rewritten: str, edited: str, cwd: Path) -> str | None:
    """``committed`` with the edits that turn ``rewritten`` (``committed`` as DVC rewrites it) into
    ``edited``: a three-way merge (``git merge-file``), so the user's uncommitted lines come back into
    the committed text and DVC's reformatting of the others goes; None on a conflict."""
    import tempfile

    with tempfile.TemporaryDirectory(dir=cwd) as tmp:
        files = []
        for name, text in (("committed", committed), ("rewritten", rewritten), ("edited", edited)):
            (Path(tmp) / name).write_text(text)
            files.append(str(Path(tmp) / name))
        res = subprocess.run(["git", "merge-file", "-p", "--quiet", *files], capture_output=True, text=True, cwd=cwd)
    return res.stdout if res.returncode == 0 else None


def restore_params(path: Path, baseline_rev: str, keys: list[str], since: float | None = None) -> str:
    """Put params.yaml back as it was before the ``dvc exp run`` (started at ``since``, epoch seconds)
    that set ``keys`` on ``baseline_rev``; returns what was done.

    Where the workspace DVC stashed is found (:func:`params_before_command`), that text comes back
    byte for byte: the user's uncommitted edits, also of the keys the command set. Else the workspace
    had no uncommitted edit, or it cannot be found: ``keys`` go back to their values at
    ``baseline_rev`` and every other line stays as the user had it. DVC rewrote the whole file
    (ruamel, flow collections as blocks, ``null`` as nothing), so the user's other edits are the
    difference between the committed file and the current one, both as DVC writes them, merged back
    into the committed text; where that merge conflicts or reads differently, the file as DVC wrote
    it, keys reverted, is written instead (same values, DVC's layout)."""
    if since is not None and (found := params_before_command(path, keys, since)) is not None:
        text, stash = found
        write_text(path, text)
        return f"params.yaml restored as it was before the command (the workspace DVC stashed, {stash[:7]})"
    baseline_text = _git(path.parent, "show", f"{baseline_rev}:./{path.name}")
    if baseline_text is None:
        return f"params.yaml keeps the experiment's values (no {path.name} at the baseline {baseline_rev[:7]})"
    baseline = yaml.safe_load(baseline_text) or {}
    reverted = _as_dvc_writes(path.read_text(), baseline, keys)
    want = yaml.safe_load(reverted)
    if want == baseline:  # nothing else had changed: the committed text, byte for byte
        write_text(path, baseline_text)
        return f"params.yaml restored as at the baseline {baseline_rev[:7]}"
    merged = _apply_edits(baseline_text, _as_dvc_writes(baseline_text), reverted, path.parent)
    write_text(path, merged if merged is not None and yaml.safe_load(merged) == want else reverted)  # the user's other edits stay
    return f"the keys {', '.join(keys)} of params.yaml set back to their values at the baseline {baseline_rev[:7]}"


def stop(message: str, params_path: str | Path = "params.yaml"):
    """Print ``message`` (a params error naming the key), put the keys a failing ``dvc exp run -S``
    set back in ``params_path`` (outside one: nothing to put back), and exit with status 2. Every
    stage that checks params before DVC clears an output ends this way (``validate``, ``slots``)."""
    path = Path(params_path).resolve()
    console.print(f"[bold red]{message}")
    rev = os.environ.get("DVC_EXP_BASELINE_REV")
    pid, keys = (exp_run_process() or (None, None)) if rev else (None, None)
    if keys:
        console.print(restore_params(path, rev, keys, process_start(pid)))
    elif rev:
        console.print("params.yaml keeps the experiment's values (its dvc exp run command line could not be read): "
                      f"git diff {rev[:7]} -- params.yaml shows them")
    console.print("nothing else was run or deleted")
    raise SystemExit(2)


def write_marker(path: str | Path, text: str) -> None:
    """A stage's constant marker, rewritten only when missing or different (its timestamp then stays)."""
    out = Path(path)
    if not out.is_file() or out.read_text() != text:
        write_text(out, text)


def slot_errors(p, shape: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """({policy: its long-range slots k}, errors naming the params key) of every entry of
    ``train.policies`` at ``budget``/``sinks``/``window`` on a model of ``shape`` (:func:`kvpop.modeling.model_shape`)."""
    from kvpop.policies import make_policy  # torch: only when a model shape is known

    dims = {k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")}
    slots, errors = {}, []
    for name in p.train.policies:
        try:
            k = make_policy(name, **dims, scorer_hidden=p.train.for_policy(name).scorer_hidden).long_range_slots(p.layout, head_dim=shape["head_dim"])
        except ValueError as err:
            errors.append(f"  budget: {err} (train.policies: {name})")
            continue
        if k <= 0:
            errors.append(f"  budget: {p.budget} leaves {name} no long-range slot (sinks {p.sinks}, window {p.window}, "
                          f"head dim {shape['head_dim']}; train.policies: {name})")
        slots[name] = k
    return slots, errors


def folder_source_errors(p) -> list[str]:
    """:func:`slot_errors` already here when ``base_model.source`` is a local model folder (a value of
    params.yaml, which the base_model stage reads too): a budget that leaves a policy no slot then
    stops before any stage runs, so not even dvc.lock's entry of this stage changes. Other sources
    (the embedded GGUF, a hub id) are checked by the slots stage on ``models/base``."""
    config = Path(p.base_model.source) / "config.json"
    if p.base_model.source == "embedded" or not config.is_file():
        return []
    from types import SimpleNamespace

    from transformers import AutoConfig

    from kvpop.modeling import model_shape

    return slot_errors(p, model_shape(SimpleNamespace(config=AutoConfig.from_pretrained(config.parent))))[1]


def budget_warning(p) -> str | None:
    """A warning when ``budget`` is at least the longest sequence a cache ever holds, else None.

    Training rows hold documents of at most ``min(train.seq_len, filter.max_tokens)`` tokens (pack
    never splits a document; the filter drops longer traces) and attention stays within a document;
    the held-out traces hold at most ``filter.max_tokens``. A budget at or above that length evicts
    nothing: every policy is the dense model, and training and evaluation buy nothing."""
    seq_len, max_tokens = p.train.seq_len, p.filter.max_tokens
    rows = min(seq_len, max_tokens)
    if p.budget < rows:
        return None
    bound = f"train.seq_len {seq_len}" if seq_len <= max_tokens else f"filter.max_tokens {max_tokens}, below train.seq_len {seq_len}"
    fix = (f"set budget below {rows} (profile paper-cpu: 256 of 1,024-token rows, the paper's 25%) or make the rows longer "
           "(profile paper: 4096 of 16,384-token rows; python pipeline/profiles.py paper)")
    if p.budget >= max_tokens:
        return (f"warning: budget {p.budget} >= the rows' length {rows} tokens ({bound}): nothing will ever be evicted, "
                f"every policy is dense (training and evaluation measure no eviction); {fix}")
    return (f"warning: budget {p.budget} >= the training rows' length {rows} tokens ({bound}): training never evicts, "
            f"so the trained policies learn no eviction (only the held-out traces of up to filter.max_tokens {max_tokens} evict); {fix}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="data/params.valid")
    args = ap.parse_args()
    try:
        p = load_params(args.params)
    except ParamsError as err:
        stop(str(err), args.params)
    if errors := folder_source_errors(p):
        stop("invalid params for the trained policies on this base model:\n" + "\n".join(errors), args.params)
    if p.evaluate.benchmarks.ruler.enabled and (why := ruler_missing()):  # before training, not at the evaluate stage
        stop(why, args.params)
    write_marker(args.out, MARKER)
    console.print(f"{args.params}: valid")
    if warning := budget_warning(p):  # before any other stage runs: a warning, the run goes on
        console.print(f"[bold yellow]{warning}", highlight=False)


if __name__ == "__main__":
    main()
