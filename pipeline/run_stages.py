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
from its checkpoint when run again (``pipeline/train.py``).
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


def commands(dvc: dict, params: dict) -> list[tuple[str, str | None, str]]:
    """``(stage, item or None, command)`` for every stage of ``dvc.yaml`` in order, foreach stages expanded."""
    out = []
    for name, stage in (dvc.get("stages") or {}).items():
        if "foreach" in stage:
            m = _VAR.fullmatch(str(stage["foreach"]).strip())
            items = lookup(params, m.group(1)) if m else stage["foreach"]
            if not isinstance(items, list):
                raise ValueError(f"stage {name}: foreach must expand to a list, got {items!r}")
            for item in items:
                cmd = stage["do"]["cmd"].replace("${item}", str(item))
                out.append((name, str(item), _VAR.sub(lambda v: str(lookup(params, v.group(1))), cmd)))
        else:
            out.append((name, None, _VAR.sub(lambda v: str(lookup(params, v.group(1))), stage["cmd"])))
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
    args = ap.parse_args()
    params = yaml.safe_load((ROOT / args.params).read_text()) or {}
    cmds = commands(yaml.safe_load((ROOT / "dvc.yaml").read_text()), params)
    names = list(dict.fromkeys(stage for stage, _, _ in cmds))
    for flag, stage in (("--from", args.start), ("--to", args.stop), *(("--parallel", s) for s in args.parallel)):
        if stage is not None and stage not in names:
            raise SystemExit(f"{flag} {stage!r}: no such stage in dvc.yaml ({', '.join(names)})")
    lo = names.index(args.start) if args.start else 0
    hi = names.index(args.stop) if args.stop else len(names) - 1
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    for stage in names[lo : hi + 1]:
        group = [(item, cmd) for s, item, cmd in cmds if s == stage]
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
