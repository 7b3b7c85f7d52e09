"""Stage validate: params.yaml is checked before any stage whose outputs DVC would clear.

DVC deletes a stage's outputs just before it runs the stage's command, so a stage that finds a bad
param itself has already lost the previous run's outputs. This stage comes first: ``base_model``
(and through it every stage) depends on its marker ``data/params.valid``, so a bad value stops
``dvc repro`` here with the key named, before anything is deleted. The marker is persistent and its
content never changes, so a valid change of params re-runs only the stages that read it. Where an
earlier run left a base model, the budget is also checked against each trained policy's needs.

Inside ``dvc exp run -S key=value`` DVC has written the experiment's values into params.yaml before
this runs, and leaves them there when the run fails. When they are invalid, this stage puts the
keys the command line set back to their values at the experiment's baseline commit, so params.yaml
is as it was (byte for byte when nothing else in it had changed since that commit).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
from pathlib import Path

import yaml

from kvpop.config import ParamsError, load_params

from common import console, write_text

MARKER = "params.yaml is valid (kvpop.config.Params)\n"


def policy_errors(p, base: Path) -> list[str]:
    """What params.yaml alone cannot tell: whether the budget leaves each trained policy a long-range
    slot, which for ``kvpop`` depends on the model's head dim (its mLSTM state takes slots). Read from
    the base model of an earlier run (``models/base/config.json``); without one there is no output
    to lose yet, and the train stage checks it itself."""
    if not (base / "config.json").is_file():
        return []
    from types import SimpleNamespace

    from transformers import AutoConfig

    from kvpop.modeling import model_shape
    from kvpop.policies import make_policy

    shape = model_shape(SimpleNamespace(config=AutoConfig.from_pretrained(base)))
    errors = []
    for name in p.train.policies:
        pol = make_policy(name, **{k: shape[k] for k in ("num_layers", "num_kv_heads", "head_dim")}, scorer_hidden=p.train.scorer_hidden)
        try:
            k = pol.long_range_slots(p.layout, head_dim=shape["head_dim"])
        except ValueError as err:
            errors.append(f"  budget: {err} (train.policies: {name})")
            continue
        if k <= 0:
            errors.append(f"  budget: {p.budget} leaves {name} no long-range slot (sinks {p.sinks}, window {p.window})")
    return errors


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
    """The ``-S`` keys of the ``dvc exp run`` that started this process (its nearest ancestor that
    is one), or None outside one (or where /proc does not tell)."""
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
            return keys
        pid = int(stat.rpartition(")")[2].split()[1])  # the field after the state: the parent
        if pid <= 1:
            return None
    return None


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


def restore_params(path: Path, baseline_rev: str, keys: list[str]) -> str:
    """Put the keys an experiment set back to ``baseline_rev``'s values; returns what was done."""
    from ruamel.yaml import YAML  # DVC's own YAML library: keeps comments and layout

    git = subprocess.run(["git", "show", f"{baseline_rev}:./{path.name}"], capture_output=True, text=True, cwd=path.parent)
    if git.returncode != 0:
        return f"params.yaml keeps the experiment's values (no {path.name} at the baseline {baseline_rev[:7]})"
    baseline_text = git.stdout
    baseline = yaml.safe_load(baseline_text) or {}
    ry = YAML()
    doc = ry.load(path.read_text()) or {}
    revert_in_place(doc, baseline, keys)
    buf = io.StringIO()
    ry.dump(doc, buf)
    if yaml.safe_load(buf.getvalue()) == baseline:  # nothing else had changed: the committed text, byte for byte
        write_text(path, baseline_text)
        return f"params.yaml restored as at the baseline {baseline_rev[:7]}"
    write_text(path, buf.getvalue())  # the user's other edits stay
    return f"the keys {', '.join(keys)} of params.yaml set back to their values at the baseline {baseline_rev[:7]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="data/params.valid")
    ap.add_argument("--base", default="models/base", help="an earlier run's base model, if any (for policy_errors)")
    args = ap.parse_args()
    path = Path(args.params).resolve()
    try:
        errors = policy_errors(load_params(path), Path(args.base))
        if errors:
            raise ParamsError("invalid params for the trained policies:\n" + "\n".join(errors))
    except ParamsError as err:
        console.print(f"[bold red]{err}")
        rev = os.environ.get("DVC_EXP_BASELINE_REV")
        keys = exp_run_overrides() if rev else None
        if keys:
            console.print(restore_params(path, rev, keys))
        elif rev:
            console.print("params.yaml keeps the experiment's values (its dvc exp run command line could not be read): "
                          f"git diff {rev[:7]} -- params.yaml shows them")
        console.print("nothing else was run or deleted")
        raise SystemExit(2) from None
    out = Path(args.out)
    if not out.is_file() or out.read_text() != MARKER:
        write_text(out, MARKER)
    console.print(f"{args.params}: valid")


if __name__ == "__main__":
    main()
