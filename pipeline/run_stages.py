"""Run the pipeline's stages where DVC is not installed (a GPU host): dvc.yaml's own commands, in order.

``dvc repro`` is the way to run the pipeline: it caches every stage and re-runs only what changed.
A machine without DVC (and often without MLflow: set ``KVPOP_TRACKING=off``) can still run exactly
the same stage scripts with this runner. It reads ``dvc.yaml``, expands each ``foreach`` stage over
its list in ``--params`` (``${train.policies}``, ``${item}``), and runs every command from the
repository root, in the file's order, stopping at the first failure. There is no caching and no
dependency tracking: every selected stage runs.

    python pipeline/run_stages.py                              # every stage
    python pipeline/run_stages.py --from train --parallel train  # train (its policies side by side), then the rest

``--parallel STAGE`` runs the items of a foreach stage at the same time (several trainings fit on one
GPU); their output goes to ``<log-dir>/<stage>@<item>.log``. A train stage killed part-way resumes
from its checkpoint when run again (``pipeline/train.py``); ``--skip-done`` skips every command whose
declared outputs (dvc.yaml ``outs``) all exist already, so a second call continues an interrupted
run instead of training the finished policies again.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
_VAR = re.compile(r"\$\{([^}]+)\}")


def lookup(params: dict, dotted: str):
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"dvc.yaml refers to ${{{dotted}}}, which params.yaml does not hold")
        node = node[part]
    return node


def expand(text: str, params: dict, item: str | None) -> str:
    """``${item}`` and ``${dotted.key}`` of a dvc.yaml string, from the foreach item and the params."""
    if item is not None:
        text = text.replace("${item}", item)
    return _VAR.sub(lambda v: str(lookup(params, v.group(1))), text)


def commands(dvc: dict, params: dict) -> list[tuple[str, str | None, str, list[str]]]:
    """``(stage, item or None, command, outs)`` for every stage of ``dvc.yaml`` in order, foreach stages
    expanded; ``outs`` the stage's declared output paths."""
    out = []
    for name, stage in (dvc.get("stages") or {}).items():
        items: list[str | None] = [None]
        body = stage
        if "foreach" in stage:
            m = _VAR.fullmatch(str(stage["foreach"]).strip())
            found = lookup(params, m.group(1)) if m else stage["foreach"]
            if not isinstance(found, list):
                raise ValueError(f"stage {name}: foreach must expand to a list, got {found!r}")
            items, body = [str(i) for i in found], stage["do"]
        for item in items:
            outs = [expand(o if isinstance(o, str) else next(iter(o)), params, item) for o in body.get("outs") or []]
            out.append((name, item, expand(body["cmd"], params, item), outs))
    return out


def run_one(cmd: str, env: dict) -> int:
    print(f"$ {cmd}", flush=True)
    return subprocess.run(cmd, shell=True, cwd=ROOT, env=env).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--from", dest="start", help="first stage to run (the earlier ones are taken as done)")
    ap.add_argument("--to", dest="stop", help="last stage to run")
    ap.add_argument("--parallel", action="append", default=[], help="a foreach stage whose items run side by side (repeatable)")
    ap.add_argument("--log-dir", default="logs", help="logs of the items of a --parallel stage")
    ap.add_argument("--skip-done", action="store_true", help="skip a command whose declared outputs all exist")
    args = ap.parse_args()
    params = yaml.safe_load((ROOT / args.params).read_text()) or {}
    cmds = commands(yaml.safe_load((ROOT / "dvc.yaml").read_text()), params)
    names = list(dict.fromkeys(stage for stage, *_ in cmds))
    for flag, stage in (("--from", args.start), ("--to", args.stop), *(("--parallel", s) for s in args.parallel)):
        if stage is not None and stage not in names:
            raise SystemExit(f"{flag} {stage!r}: no such stage in dvc.yaml ({', '.join(names)})")
    lo = names.index(args.start) if args.start else 0
    hi = names.index(args.stop) if args.stop else len(names) - 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for stage in names[lo : hi + 1]:
        group = []
        for s, item, cmd, outs in cmds:
            if s != stage:
                continue
            if args.skip_done and outs and all((ROOT / o).exists() for o in outs):
                print(f"[run] {stage}{'@' + item if item else ''}: outputs exist, skipped (--skip-done)", flush=True)
                continue
            group.append((item, cmd))
        t0 = time.time()
        if stage in args.parallel and len(group) > 1:
            logs = ROOT / args.log_dir
            logs.mkdir(parents=True, exist_ok=True)
            procs = []
            for item, cmd in group:
                log = open(logs / f"{stage}@{item}.log", "w")  # noqa: SIM115 - closed below
                print(f"$ {cmd}  > {log.name}", flush=True)
                procs.append((item, subprocess.Popen(cmd, shell=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
            failed = []
            for item, proc, log in procs:
                if proc.wait() != 0:
                    failed.append(item)
                log.close()
            if failed:
                raise SystemExit(f"stage {stage} failed for {failed} (logs in {args.log_dir}/)")
        else:
            for _, cmd in group:
                if (rc := run_one(cmd, env)) != 0:
                    raise SystemExit(f"stage {stage} failed (exit {rc}): {cmd}")
        print(f"[run] {stage}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
