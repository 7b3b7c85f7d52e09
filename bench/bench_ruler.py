"""RULER accuracy per task and policy, gathered from evaluate runs with evaluate.benchmarks.ruler.

The evaluate stage measures (:mod:`kvpop.ruler`, ``metrics/eval.json``, ``"ruler"``); this script collects
one or more of its runs as the configurations of one result file (:func:`kvpop.ruler.configuration`),
written with its provenance (:func:`kvpop.provenance.write_result`), and prints each as a Markdown table:

    python pipeline/profiles.py 4k --write params.yaml && python pipeline/profiles.py ruler --write params.yaml
    KVPOP_TRACKING=off python pipeline/run_stages.py --parallel train --skip-done
    python bench/bench_ruler.py --eval 4k=metrics/eval.json --out results/bench_ruler/h200.json

``--eval NAME=PATH`` repeats (one configuration each; the name labels it; runs given the same name are one
configuration, each policy's rows from the run that has it: :func:`kvpop.ruler.merge_runs`, which refuses runs on
other samples or a policy whose figures differ between them; the configuration's ``"runs"`` then says which policies
each file gave, with the provenance that file holds, e.g. a section kept from an earlier GPU run); ``--provenance FILE`` gives the
provenance of runs made on another machine (the GPU's), else this process's is written. A file without a RULER
section exits with status 2 and says which.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpop.provenance import read_provenance, write_result
from kvpop.ruler import configuration, merge_runs, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval", action="append", default=[], metavar="NAME=PATH",
                    help="an evaluate stage's metrics with a RULER section (repeatable; default run=metrics/eval.json)")
    ap.add_argument("--note", help="how the evaluate runs were made, kept in the result (e.g. the params overrides)")
    ap.add_argument("--provenance", help="a JSON file: the provenance of the runs that made the metrics, where they ran on another machine "
                    "(command, git_commit, device, versions, date); default: this process's")
    ap.add_argument("--out", default="results/bench_ruler/cpu.json", help="the result file (results/bench_ruler/<device>[_<variant>].json)")
    args = ap.parse_args(argv)
    prov = None
    if args.provenance:
        try:
            prov = read_provenance(args.provenance)
        except (OSError, ValueError) as err:
            print(f"error: --provenance {args.provenance}: {err}", file=sys.stderr)
            return 2
    sections: dict[str, list] = {}
    for item in args.eval or ["run=metrics/eval.json"]:
        name, eq, path = item.partition("=")
        if not eq or not name or not path:
            print(f"error: --eval wants NAME=PATH, got {item!r}", file=sys.stderr)
            return 2
        try:
            doc = json.loads(Path(path).read_text())
            if "ruler" not in doc:
                raise ValueError("no 'ruler' section: run the evaluate stage with evaluate.benchmarks.ruler set")
            sections.setdefault(name, []).append((path, doc["ruler"], doc.get("provenance")))
        except (OSError, ValueError) as err:
            print(f"error: {path}: {err}", file=sys.stderr)
            return 2
    configs = []
    for name, runs in sections.items():
        try:
            config = configuration(name, merge_runs([sec for _, sec, _ in runs]))
            if len(runs) > 1:  # which run each policy's rows come from (the first that holds it), with that run's provenance where its file has one
                seen: set[str] = set()
                config["runs"] = []
                for path, sec, run_prov in runs:
                    mine = [p for p in sec["policies"] if p not in seen]
                    seen.update(mine)
                    config["runs"].append({"eval": path, "policies": mine, **({"provenance": run_prov} if run_prov else {})})
            configs.append(config)
        except ValueError as err:
            print(f"error: configuration {name}: {err}", file=sys.stderr)
            return 2
    runs = ", ".join("{config} ({seq_len} tokens, budget {budget}, {samples} samples per task)".format(**c) for c in configs)
    what = f"RULER accuracy per task of every policy's greedy answers (RULER's metric) and teacher-forced answer accuracy: {runs}"
    write_result(args.out, {"what": what, **({"note": args.note} if args.note else {}), "configurations": configs}, provenance=prov)
    for c in configs:
        print(f"\n{c['config']}: {c['seq_len']} tokens, budget {c['budget']}, {c['samples']} samples per task, RULER's metric (%)\n")
        print(table(c))
        print(f"\nteacher-forced accuracy of the gold answer's tokens (%)\n\n{table(c, key='teacher_forced')}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
