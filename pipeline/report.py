"""The quality table of an evaluate run (``metrics/eval.json``): one row per policy.

    python pipeline/report.py [metrics/eval.json] [--md]

``scripts/repro.sh`` ends with it; the evaluate stage prints it too. A row scored on fewer held-out
traces than the others (``evaluate.decode_traces``) is marked ``*``, the occupancy of a policy whose
gate evicts below its budget ``†``, each explained under the table (:func:`kvpop.summary.row_notes`).
``--md`` prints the same table as Markdown (the README's).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without install

from kvpop.summary import row_notes  # noqa: E402

COLUMNS = ("quote_accuracy", "kl", "top1_agreement", "occupancy", "pass_at_1", "pass_at_1_relative", "peak_cache_mb", "tokens_per_s")
FORMATS = {"quote_accuracy": ".3f", "kl": ".4f", "top1_agreement": ".3f", "occupancy": ".2f", "pass_at_1": ".3f",
           "pass_at_1_relative": ".2f", "peak_cache_mb": ".1f", "tokens_per_s": ".1f"}


def title(ev: dict) -> str:
    return (f"budget {ev['budget']}: quote accuracy and KL to dense on {ev['eval_traces']} held-out traces "
            f"({ev['eval_tokens']} scored tokens), {ev['rollout_problems']} x {ev['rollouts_per_problem']} rollouts")


def rows(ev: dict) -> tuple[list[list[str]], list[str]]:
    """The table's cells (policy first, then :data:`COLUMNS`; ``-`` where a policy has no such metric)
    with the marks, and the footnotes."""
    names, occupancy, notes = row_notes(ev)
    out = []
    for name, m in ev["policies"].items():
        cells = [f"{m[c]:{FORMATS[c]}}" if c in m else "-" for c in COLUMNS]
        cells[COLUMNS.index("occupancy")] += occupancy.get(name, "")
        out.append([name + names.get(name, ""), *cells])
    return out, notes


def print_table(ev: dict) -> None:
    """Print ``ev`` (the evaluate stage's JSON) as a table to stdout, the footnotes under it."""
    table = Table(title=title(ev))
    table.add_column("policy")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    cells, notes = rows(ev)
    for row in cells:
        table.add_row(*row)
    console = Console(width=150)
    console.print(table)
    for note in notes:
        console.print(note, highlight=False)


def markdown(ev: dict) -> str:
    """The same table in Markdown, each footnote a paragraph under it."""
    cells, notes = rows(ev)
    star = lambda text: text.replace("*", "\\*")  # noqa: E731  Markdown's emphasis
    lines = ["| policy | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    lines += ["| " + " | ".join(star(c) for c in row) + " |" for row in cells]
    return "\n".join(lines + [f"\n{star(n)}" for n in notes]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("eval", nargs="?", default="metrics/eval.json", help="the evaluate stage's metrics")
    ap.add_argument("--md", action="store_true", help="print the table as Markdown")
    args = ap.parse_args()
    path = Path(args.eval)
    try:
        ev = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read the evaluate stage's metrics {path}: {err}") from None
    if args.md:
        print(markdown(ev), end="")
    else:
        print_table(ev)


if __name__ == "__main__":
    main()
