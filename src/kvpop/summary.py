"""The compact metrics of an evaluate run: per policy the few numbers that matter, and what marks a row.

The evaluate stage's full result (``metrics/eval.json``: every policy's fidelity, occupancy per layer
and head, rollouts, other text) is too wide to compare experiments in (``dvc exp show`` had 277
columns). :func:`summary` keeps, per policy, :data:`SUMMARY_METRICS` and the budget; the stage
writes each policy's as ``metrics/summary/<summary_name(policy)>.json``, the metrics DVC shows by
default, so that ``dvc metrics show`` prints one row per policy.

:func:`row_notes` says what each row of the quality table is, where it differs from the others:
scored on fewer held-out traces (``evaluate.decode_traces``: rules decoded token by token), or a gate
that evicts below its budget (``fill`` < 1, ``dms``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: per policy, in this order: quality (teacher-forced), then decoding (rollouts, cost), then how many
#: held-out traces the quality figures average over
SUMMARY_METRICS = ("quote_accuracy", "kl", "top1_agreement", "pass_at_1", "peak_cache_mb", "tokens_per_s", "traces")

#: below this ``fill`` a policy holds fewer entries at a trace's end than a cache that evicts only when
#: full (a rounding margin: every top-k rule holds exactly that many)
FULL = 0.995


def summary_name(policy: str) -> str:
    """A policy's file stem: its name with ``", "`` as ``.`` and spaces as ``_`` (``"kvpop_mlp, one pool"``
    -> ``kvpop_mlp.one_pool``)."""
    return policy.replace(", ", ".").replace(" ", "_")


def summary(ev: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{summary_name(policy): {"budget", *SUMMARY_METRICS}}`` of an evaluate result (the stage's
    ``metrics/eval.json``); a metric a policy has not (an oracle is never decoded) is left out."""
    out = {}
    for name, m in ev["policies"].items():
        stem = summary_name(name)
        if stem in out:
            raise ValueError(f"policies {name!r} and another share the summary file name {stem!r}")
        out[stem] = {"budget": ev["budget"], **{k: m[k] for k in SUMMARY_METRICS if k in m}}
    return out


def row_notes(ev: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """``(name marks, occupancy marks, footnotes)`` of an evaluate result: ``*`` after a policy scored
    on fewer held-out traces than ``eval_traces``, ``†`` after the occupancy of one whose ``fill`` is
    below :data:`FULL` (its gate evicts below the budget), each explained by a footnote line."""
    total = ev["eval_traces"]
    fewer: dict[int, list[str]] = {}
    below = {n: m["fill"] for n, m in ev["policies"].items() if m.get("fill", 1.0) < FULL}
    for name, m in ev["policies"].items():
        if m.get("traces", total) < total:
            fewer.setdefault(m["traces"], []).append(name)
    names = {n: "*" for ns in fewer.values() for n in ns}
    notes = [f"* scored on the first {n} of the {total} held-out traces only (evaluate.decode_traces: "
             f"decoded token by token): {', '.join(ns)}" for n, ns in sorted(fewer.items())]
    if below:
        notes.append("† a gate that evicts below the budget: at a trace's end it holds this share of what a cache that "
                     "evicts only when full holds (fill): " + ", ".join(f"{n} {f:.2f}" for n, f in below.items()))
    return names, {n: "†" for n in below}, notes
