"""A quality configuration's result (results/quality/): an evaluate stage's metrics and its trainings' figures.

The pipeline measures (``metrics/eval.json``: quote accuracy, KL and top-1 agreement of every policy on the
held-out traces, and ``other_text``: KL and top-1 agreement on held-out code and prose; ``metrics/train/<policy>.json``:
each training's last figures); this script gathers one run as a configuration of a result file (replacing a
configuration of the same name), with the quality issue's bars for the best policy whose name starts with ``kvpop``:

    python pipeline/profiles.py 4k --write params.yaml && KVPOP_TRACKING=off python pipeline/run_stages.py --parallel train --skip-done
    python bench/quality_report.py --config 4k --eval metrics/eval.json --train metrics/train --out results/quality/h200_pipeline.json

``--eval`` repeated: one run evaluated in parts (scripts/device/job.sh with ``FINAL=0``: each trained policy's own evaluate
beside the untrained policies' one), joined into one set of rows (the parts must agree on the held-out data).

``--merge``: the run trained only some policies (one too slow to train beside the others, say) and adds them to the
configuration of the same name already in the file, made by an earlier run of the same settings: the rows both runs
hold without training them (dense, streaming_llm, the ceilings) must agree, as must the settings and the held-out
tokens, or nothing is written; each run's provenance is kept in the configuration's ``"runs"``.

The bars (the quality issue): quote accuracy >= 0.95 x dense at 4k (0.90 x at 8k), KL no worse than ``dbtrimkv``'s,
code and prose KL no worse than ``streaming_llm``'s (the aim: ``dbtrimkv``'s).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
from pathlib import Path

import yaml

from kvpop.evaluate import PER_TRACE_KEYS, ranked_policy
from kvpop.provenance import envelope, read_provenance, write_result

QUOTE_BAR = {"4k": 0.95, "8k": 0.90}


def quote_bar(config: str) -> float:
    """The quote bar of a configuration (``4k``, ``8k``, or a variant ``4k+...``; others 0.95)."""
    return QUOTE_BAR.get(config.split("+")[0], 0.95)


#: resamples and seed of :func:`paired_interval` (fixed: the same rows give the same interval)
RESAMPLES, SEED = 2000, 0


def paired_interval(a: dict, b: dict, stat, *, level: float = 0.95, resamples: int = RESAMPLES, seed: int = SEED) -> list[float] | None:
    """A paired bootstrap interval over held-out traces: ``a``, ``b`` two policies' ``per_trace`` lists (the evaluate stage's:
    trace index, quote hits and tokens, KL sum and tokens); the traces both scored are resampled with replacement and
    ``stat(sums_a, sums_b)`` (each a dict of the lists' sums over the resample) taken each time -> ``[lo, hi]`` at ``level``,
    rounded to 4 digits; None where either lacks per-trace sums or they share no trace. A resample where ``stat`` is
    undefined (it returns None: no quote token in it, say) is drawn again, up to ten times ``resamples`` draws in all;
    None where fewer than ``resamples`` were defined (the traces hold no quote, say)."""
    if not a or not b:
        return None
    for side in (a, b):
        lengths = {k: len(v) if isinstance(v, list) else None for k, v in side.items()}
        if set(lengths) != set(PER_TRACE_KEYS) or None in lengths.values() or len(set(lengths.values())) != 1:
            raise ValueError(f"per_trace must hold equally long lists {', '.join(PER_TRACE_KEYS)}; got lengths {lengths}")
    ia, ib = {t: i for i, t in enumerate(a["trace"])}, {t: i for i, t in enumerate(b["trace"])}
    common = sorted(set(ia) & set(ib))
    if not common:
        return None
    keys = [k for k in a if k != "trace"]
    rows = [({k: a[k][ia[t]] for k in keys}, {k: b[k][ib[t]] for k in keys}) for t in common]
    rng = random.Random(seed)
    vals: list[float] = []
    for _ in range(10 * resamples):
        pick = [rows[rng.randrange(len(rows))] for _ in rows]
        v = stat({k: sum(r[0][k] for r in pick) for k in keys}, {k: sum(r[1][k] for r in pick) for k in keys})
        if v is not None:
            vals.append(v)
            if len(vals) == resamples:
                break
    if len(vals) < resamples:
        return None
    vals.sort()
    lo, hi = vals[int((1 - level) / 2 * resamples)], vals[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return [round(lo, 4), round(hi, 4)]


def quote_ratio(x: dict, y: dict) -> float | None:
    """Quote accuracy of ``x`` over ``y``'s (per-trace sums), None where undefined."""
    if not x["quote_tokens"] or not y["quote_tokens"] or not y["quote_hits"]:
        return None
    return (x["quote_hits"] / x["quote_tokens"]) / (y["quote_hits"] / y["quote_tokens"])


def kl_difference(x: dict, y: dict) -> float | None:
    """Mean KL of ``x`` less ``y``'s (per-trace sums)."""
    return x["kl_sum"] / x["tokens"] - y["kl_sum"] / y["tokens"] if x["tokens"] and y["tokens"] else None


def bars(policies: dict, other: dict, quote_bar: float) -> dict:
    """The quality issue's bars for the ``kvpop*`` policy of highest quote accuracy. Where the rows hold per-trace sums,
    also 95% paired bootstrap intervals over the held-out traces: ``quote_ratio_ci95`` (its quote accuracy over dense's:
    a bar inside it is met or missed within the noise of these traces) and ``kl_minus_dbtrimkv_ci95``."""
    kv = {n: m for n, m in policies.items() if n.startswith("kvpop")}
    if not kv or "dense" not in policies:
        return {}
    best = max(kv, key=lambda n: kv[n]["quote_accuracy"])
    out = {"policy": best, "quote_accuracy_vs_dense": round(kv[best]["quote_accuracy"] / policies["dense"]["quote_accuracy"], 4),
           "quote_bar": quote_bar, "kl": kv[best]["kl"]}
    met = {"quotes": out["quote_accuracy_vs_dense"] >= quote_bar}
    if (ci := paired_interval(kv[best].get("per_trace"), policies["dense"].get("per_trace"), quote_ratio)) is not None:
        out["quote_ratio_ci95"] = ci
    if "dbtrimkv" in policies:
        out["kl_bar_dbtrimkv"] = policies["dbtrimkv"]["kl"]
        met["kl"] = kv[best]["kl"] <= policies["dbtrimkv"]["kl"]
        if (ci := paired_interval(kv[best].get("per_trace"), policies["dbtrimkv"].get("per_trace"), kl_difference)) is not None:
            out["kl_minus_dbtrimkv_ci95"] = ci
    for kind in ("code", "prose"):
        rows = other.get(kind, {})
        if best in rows and "streaming_llm" in rows:
            out[f"{kind}_kl"] = rows[best]["kl"]
            out[f"{kind}_bar_streaming_llm"] = rows["streaming_llm"]["kl"]
            met[kind] = rows[best]["kl"] <= rows["streaming_llm"]["kl"]
            if "dbtrimkv" in rows:
                out[f"{kind}_aim_dbtrimkv"] = rows["dbtrimkv"]["kl"]
    return {**out, "met": met}


#: how far a row both runs hold without training it (dense, streaming_llm, the ceilings) may differ between them
SAME_ROW_TOL = 1e-4


def check_same_rows(a: dict, b: dict, names, a_from: str, b_from: str) -> None:
    """ValueError where a row of ``names`` (policy -> metrics, held by both ``a`` and ``b``) differs by more than
    :data:`SAME_ROW_TOL` in quote accuracy, KL or top-1 agreement; ``a_from``, ``b_from`` say where each came from."""
    for name in names:
        for key in ("quote_accuracy", "kl", "top1_agreement"):
            x, y = a[name].get(key), b[name].get(key)
            if x is not None and y is not None and abs(x - y) > SAME_ROW_TOL:
                raise ValueError(f"not the same rows: {name}'s {key} is {y} {b_from}, {x} {a_from}")


def merged(earlier: dict, new: dict, *, trained: set[str], run: dict) -> dict:
    """``earlier`` (a configuration of the file) with ``new``'s trained policies added (rows, other text, training
    figures, ``per_policy``) and the bars taken again over all; ValueError where the two runs are not the same
    comparison: other settings, other held-out tokens, or an untrained row that moved by more than :data:`SAME_ROW_TOL`."""
    for key in ("seq_len", "budget", "sinks", "window", "steps"):
        if earlier.get(key) != new.get(key):
            raise ValueError(f"{key} is {new.get(key)} in this run, {earlier.get(key)} in the file's")
    if earlier.get("eval", {}).get("eval_tokens") != new.get("eval", {}).get("eval_tokens"):
        raise ValueError(f"other held-out data: {new.get('eval', {}).get('eval_tokens')} scored tokens, the file's "
                         f"{earlier.get('eval', {}).get('eval_tokens')}")
    if not trained & set(new["policies"]):
        raise ValueError("this run evaluated none of its trained policies")
    check_same_rows(earlier["policies"], new["policies"], sorted(set(earlier["policies"]) & set(new["policies"]) - trained),
                    "in the file", "here")
    out = copy.deepcopy(earlier)
    for name in set(out["policies"]) & set(new["policies"]) - trained:  # the same untrained rows: their per-trace sums where the file's lack them
        if "per_trace" in new["policies"][name]:
            out["policies"][name].setdefault("per_trace", new["policies"][name]["per_trace"])
    add = {n for n in new["policies"] if ranked_policy(n) in trained}  # the one-pool twins too
    out["policies"] = dict(sorted({**out["policies"], **{n: new["policies"][n] for n in add}}.items()))
    for kind, rows in new.get("other_text", {}).items():
        out.setdefault("other_text", {}).setdefault(kind, {}).update({n: m for n, m in rows.items() if n in add})
    out["train"] = {**out.get("train", {}), **new.get("train", {})}
    out["per_policy"] = {**(out.get("per_policy") or {}), **{n: v for n, v in (new.get("per_policy") or {}).items() if n in trained}}
    out["runs"] = [*out.get("runs", []), run]
    out["bars"] = bars(out["policies"], out.get("other_text", {}), out["bars"]["quote_bar"] if out.get("bars") else quote_bar(out["config"]))
    return out


def combined(evals: list[tuple[str, dict]]) -> dict:
    """One evaluate run's metrics from several evaluates of it over parts of its policies (scripts/device/job.sh's per-policy
    evaluates beside the untrained policies' one): rows and other text joined; ValueError where they are not the same run's
    (other held-out data or budget) or a policy both hold differs by more than :data:`SAME_ROW_TOL`."""
    (first, out), *rest = evals
    out = copy.deepcopy(out)
    for path, ev in rest:
        for key in ("budget", "eval_tokens", "eval_traces"):
            if key in out and key in ev and out[key] != ev[key]:
                raise ValueError(f"{path}: {key} is {ev[key]}, {out[key]} in {first}: not the same run's data")
        for key in ("eval_tokens", "eval_traces", "mean_trace_tokens", "budget"):
            out.setdefault(key, ev.get(key))
        rows = out.setdefault("policies", {})
        check_same_rows(rows, ev.get("policies", {}), sorted(set(rows) & set(ev.get("policies", {}))), f"in {first}", f"in {path}")
        rows.update(ev.get("policies", {}))
        for kind, by_policy in ev.get("other_text", {}).items():
            out.setdefault("other_text", {}).setdefault(kind, {}).update(by_policy)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the configuration's name (a profile: 4k, 8k, ...)")
    ap.add_argument("--eval", action="append", default=[], help="the evaluate stage's metrics (default metrics/eval.json); repeated: "
                    "evaluates of one run over parts of its policies, joined (scripts/device/job.sh with FINAL=0)")
    ap.add_argument("--train", default="metrics/train", help="the folder of the trainings' metrics (<policy>.json)")
    ap.add_argument("--params", default="params.yaml", help="the params the run used (budget, train.*)")
    ap.add_argument("--note", help="how the run was made, kept in the configuration (e.g. what did not finish)")
    ap.add_argument("--provenance", help="a JSON file: the provenance of the run that made the metrics, where it ran on another machine "
                    "(command, git_commit, device, versions, date); default: this process's")
    ap.add_argument("--out", required=True, help="the result file; a configuration of the same name in it is replaced")
    ap.add_argument("--merge", action="store_true", help="add this run's trained policies to the configuration of the same name instead "
                    "(its untrained rows, settings and held-out tokens must match)")
    args = ap.parse_args(argv)
    try:
        evals = [(path, json.loads(Path(path).read_text())) for path in args.eval or ["metrics/eval.json"]]
        params = yaml.safe_load(Path(args.params).read_text())
        prov = read_provenance(args.provenance) if args.provenance else None
        for path, ev in evals:
            if "policies" not in ev:
                raise ValueError(f"{path} holds no 'policies': not an evaluate stage's metrics")
        ev = combined(evals)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tr = params.get("train", {})
    train = {}
    for name in tr.get("policies", []):
        f = Path(args.train) / f"{name}.json"
        if f.is_file():
            m = json.loads(f.read_text())
            train[name] = {k: m[k] for k in ("kl", "score_loss", "boundary_agreement", "beta_mean", "seconds", "steps", "resumed_from_step") if k in m}
    policies = {n: {k: m[k] for k in ("quote_accuracy", "kl", "top1_agreement", "occupancy", "traces", "quote_tokens", "per_trace") if k in m}
                for n, m in sorted(ev["policies"].items())}
    other = ev.get("other_text", {})
    config = {"config": args.config, "profile": f"profiles/{args.config}.yaml", "seq_len": tr.get("seq_len"), "budget": params.get("budget"),
              "sinks": params.get("sinks"), "window": params.get("window"), "steps": tr.get("steps"), "per_policy": tr.get("per_policy", {}),
              "target": tr.get("target"), **({"note": args.note} if args.note else {}), "policies": policies, "other_text": other,
              "train": train, "eval": {k: ev[k] for k in ("budget", "eval_tokens", "eval_traces", "mean_trace_tokens") if k in ev},
              "bars": {}}
    try:
        config["bars"] = bars(policies, other, quote_bar(args.config))
    except ValueError as err:
        print(f"error: {err}; nothing written", file=sys.stderr)
        return 2
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {}
    old = doc.get("configurations", [])
    for c in old:  # a configuration written before "runs" existed: the file's provenance is its run's
        c.setdefault("runs", [{"policies": sorted(c.get("policies", {})), "provenance": doc.get("provenance")}])
    ran = sorted(n for n in policies if ranked_policy(n) in tr.get("policies", [])) if args.merge else sorted(policies)  # this run's rows (twins too)
    run = {"policies": ran, "provenance": prov or envelope(), **({"note": args.note} if args.note else {})}
    if args.merge:
        earlier = next((c for c in old if c.get("config") == args.config), None)
        if earlier is None:
            print(f"error: --merge: {out} holds no configuration {args.config!r} to add to", file=sys.stderr)
            return 2
        try:
            config = merged(earlier, config, trained=set(tr.get("policies", [])), run=run)
        except ValueError as err:
            print(f"error: --merge into {args.config!r}: {err}; nothing written", file=sys.stderr)
            return 2
    else:
        config["runs"] = [run]
    configs = [c for c in old if c.get("config") != args.config] + [config]
    what = ("the quality configurations of profiles/ run by the pipeline's own stages: every policy trained on the same rows, quote "
            "accuracy, KL, top-1 agreement, and KL on held-out code and prose: " + ", ".join(c["config"] for c in configs))
    write_result(out, {"what": what, "configurations": configs}, provenance=prov)
    b = config["bars"]
    if b:
        ci = f" (95% paired interval over the traces {b['quote_ratio_ci95']})" if "quote_ratio_ci95" in b else ""
        print(f"{args.config}: best kvpop policy {b['policy']}: quotes {b['quote_accuracy_vs_dense']:.3f} x dense{ci} (bar {b['quote_bar']}), "
              f"KL {b['kl']:.5f}; met: {b['met']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
