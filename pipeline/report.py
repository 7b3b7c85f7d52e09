"""The quality table of an evaluate run (``metrics/eval.json``): one row per policy.

    python pipeline/report.py [metrics/eval.json]

``scripts/repro.sh`` ends with it; the evaluate stage prints it too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

COLUMNS = ("quote_accuracy", "kl", "top1_agreement", "occupancy", "pass_at_1", "pass_at_1_relative", "peak_cache_mb", "tokens_per_s")


def print_table(ev: dict) -> None:
    """Print ``ev`` (the evaluate stage's JSON) as a table to stdout."""
    title = (f"budget {ev['budget']}: quote accuracy and KL to dense on {ev['eval_traces']} held-out traces "
             f"({ev['eval_tokens']} scored tokens), {ev['rollout_problems']} x {ev['rollouts_per_problem']} rollouts")
    table = Table(title=title)
    table.add_column("policy")
    for col in COLUMNS:
        table.add_column(col, justify="right")
    for name, m in ev["policies"].items():
        table.add_row(name, *(f"{m[c]:.4g}" if c in m else "-" for c in COLUMNS))
    Console(width=150).print(table)


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "metrics/eval.json")
    try:
        ev = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read the evaluate stage's metrics {path}: {err}") from None
    print_table(ev)


if __name__ == "__main__":
    main()
