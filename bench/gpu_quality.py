"""Quality at the paper's compression: trained policies vs their ceilings vs the baselines, same rows.

The embedded SmolLM2-135M-Instruct on the synthetic long-range testbed, scaled the way
``bench/gpu_embedded_run.py`` scales it (the definitions first, the quotes thousands of tokens
later), at two configurations of 88% compression:

* ``4k``: 4,096-token rows, budget 512 (traces of 3,000-4,900 characters, 32 values, 8 recalls,
  quotes at least 2,000 characters after their definitions);
* ``8k``: 8,192-token rows, budget 1,024 (6,200-9,600 characters, 40 values, 8 recalls, 4,000).

Every trained policy is a *label* ``name[@target]``: ``kvpop_mlp`` trains against the paper's target
(log mean future attention), ``kvpop_mlp@max`` against the max future attention, ``kvpop@power:16``
against the power mean with beta 16 (:func:`kvpop.target.future_attention_target`); a ``.pool`` after
the target pools it over more heads (``kvpop_mlp@max.model``: over every layer and KV head,
``train.target_pool``, :func:`kvpop.target.pool_targets`; ``.blend:0.75`` weighs the model's target
0.75 against the head's own, ``train.target_blend``, plain ``.blend`` 0.5); a ``+regret`` (``+uniform``) suffix
trains with the regret-weighted (unweighted) boundary loss (``train.boundary_weight``, :func:`kvpop.boundary.boundary_loss`); a
``~recency:R`` suffix, last, trains and runs the scorer with a fixed age decay R per token on top of the learned one
(``train.scorer_recency``, :mod:`kvpop.scorer`; ``eval --recency`` instead adds one to finished exports without
retraining), ``~share:R`` with the decay on the attention share's scale instead (``train.scorer_recency_space``),
and ``~calib:W`` adds the scorer's calibration term with weight W (``train.scorer_calibration``), e.g.
``kvpop_mlp@max.blend:0.75+uniform~share:1e-4~calib:0.1``. All labels get the same rows in the same order and the same step count (``--steps``, also the
scorers' cosine length).

``--mix N`` adds up to N pieces each of code and prose (:mod:`kvpop.data.other_text`) to every label's
training rows; its results are the configuration ``<config>+mix<N>`` (e.g. ``4k+mix64``).

Phases, so that one device call can train several labels side by side, one process per GPU, and a
long training can continue in the next call:

* ``train``: trains the given labels one after another into ``--work/<config>/<label>``; a run that
  reaches ``--time-limit`` saves a Lightning checkpoint (``resume.ckpt``: weights, optimizer, schedule,
  loader position) and the next ``train`` call with the same arguments resumes it; a finished one is
  exported (safetensors, :func:`kvpop.export.export`) with its training log.
* ``eval``: teacher-forced evaluation (:func:`kvpop.evaluate.evaluate_fidelity`, float32) of dense,
  streaming_llm, every finished export, ``oracle_target`` under each of ``--oracle-targets`` (same syntax, e.g. ``max,mean,max.model``; the dense
  teacher's own ranking by that target, a ceiling; the first is named plain ``oracle_target``, the
  others ``oracle_target@<target>``) and ``oracle_sources`` (keeps the recorded definitions, name and digits;
  ``oracle_sources@digits``: the digits alone), on the
  same held-out traces; merges the configuration into ``--out`` in the schema
  ``{"configurations": [{"seq_len", "budget", "steps", "target", "policies": {name: {...}}}]}``.

Device call (four GPUs; the model and wheels as in ``bench/gpu_embedded_run.py``'s docstring)::

    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python3 bench/gpu_quality.py train --config 4k \\
        --labels ${LABELS[$i]} --steps 300 --time-limit 420 & done; wait
    python3 bench/gpu_quality.py eval --config 4k --oracle-targets max,mean,power:8 --out $OUT/quality_h200.json

CPU smoke test: ``PYTHONPATH=src .venv/bin/python bench/gpu_quality.py all --config tiny --model-dir models/base``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from bench_no_harm import recency_label, recency_list
from gpu_embedded_run import StopAfter, convert_gguf, length_stats, make_records, step_timer
from kvpop.boundary import BOUNDARY_WEIGHTS
from kvpop.config import TrainConfig
from kvpop.data.other_text import KINDS, other_text_records, token_ids
from kvpop.evaluate import Candidate, evaluate_fidelity, one_pool_twin, score_positions
from kvpop.export import export, load_export
from kvpop.modeling import load_model, model_shape
from kvpop.pack import pack_records
from kvpop.policies import make_policy
from kvpop.scorer import has_recency, with_recency
from kvpop.target import TARGET_KINDS, check_pool
from kvpop.train import build_training, resolve_precision

#: data and geometry of each configuration (the testbed of the quality issue)
CONFIGS = {
    "4k": dict(seq_len=4096, budget=512, min_chars=3_000, max_chars=4_900, num_values=32, num_recalls=8, min_quote_distance_chars=2_000),
    "8k": dict(seq_len=8192, budget=1024, min_chars=6_200, max_chars=9_600, num_values=40, num_recalls=8, min_quote_distance_chars=4_000),
    "tiny": dict(seq_len=768, budget=160, min_chars=700, max_chars=900, num_values=24, num_recalls=4, min_quote_distance_chars=500),
}


SCORER_SUFFIXES = {"recency": ("scorer_recency", "log"), "share": ("scorer_recency", "share"), "calib": ("scorer_calibration", None)}


def split_scorer(label: str) -> tuple[str, dict]:
    """``<label>[~recency:R | ~share:R][~calib:W]`` -> (label, TrainConfig settings of the scorer): a fixed
    age decay R per token on the log scale (``~recency``) or on the attention share's (``~share``;
    ``train.scorer_recency`` and ``train.scorer_recency_space``, :mod:`kvpop.scorer`), and the weight W
    of the calibration term (``train.scorer_calibration``); 0 and "log" without them."""
    base, *parts = label.split("~")
    out = {"scorer_recency": 0.0, "scorer_recency_space": "log", "scorer_calibration": 0.0}
    seen = set()
    for part in parts:
        key, sep, value = part.partition(":")
        if key not in SCORER_SUFFIXES or not sep:
            raise SystemExit(f"label {label!r}: unknown suffix ~{part} (~recency:R, ~share:R, ~calib:W)")
        field, space = SCORER_SUFFIXES[key]
        if field in seen:
            raise SystemExit(f"label {label!r}: ~recency and ~share exclude each other, and each suffix comes once")
        seen.add(field)
        try:
            out[field] = float(value)
        except ValueError:
            raise SystemExit(f"label {label!r}: ~{key}: needs a number") from None
        if not out[field] >= 0:
            raise SystemExit(f"label {label!r}: ~{key} must be >= 0")
        if space is not None:
            out["scorer_recency_space"] = space
    return base, out


def split_recency(label: str) -> tuple[str, float, str]:
    """``<label>[~recency:R | ~share:R]`` -> (label, R, its space): :func:`split_scorer`'s age decay alone."""
    base, opts = split_scorer(label)
    return base, opts["scorer_recency"], opts["scorer_recency_space"]


def parse_label(label: str) -> tuple[str, str, float, str, str]:
    """``name[@kind[:beta][.pool]][+regret|+uniform][~recency:R|~share:R][~calib:W]`` -> (policy name, target kind, beta, target
    pool, boundary weighting); no target = the paper's mean, no pool = the paper's (each KV head's query
    group), no ``+regret`` = the paper's tie/class-balance weights; the ``~`` suffixes: :func:`split_scorer`."""
    label, plus, weighting = split_scorer(label)[0].partition("+")
    suffixes = [w for w in BOUNDARY_WEIGHTS if w != "tie"]  # tie: the default, no suffix
    if plus and weighting not in suffixes:
        raise SystemExit(f"label {label!r}: unknown suffix +{weighting} ({', '.join('+' + w for w in suffixes)})")
    name, _, tgt = label.partition("@")
    tgt, _, pool = (tgt or "mean").partition(".")
    kind, _, beta = tgt.partition(":")
    if kind not in TARGET_KINDS:
        raise SystemExit(f"label {label!r}: unknown target {kind!r} (mean, power[:beta], max)")
    try:
        split_pool(pool or "group")
    except ValueError as e:
        raise SystemExit(f"label {label!r}: {e}") from None
    return name, kind, float(beta) if beta else 8.0, pool or "group", weighting or "tie"


def split_pool(pool: str) -> tuple[str, float]:
    """A label's pool, ``group`` / ``layer`` / ``model`` / ``blend[:w]`` -> (``train.target_pool``,
    ``train.target_blend``)."""
    name, _, w = pool.partition(":")
    if w and name != "blend":
        raise ValueError(f"target pool {pool!r}: only blend takes a weight (blend:<weight>)")
    try:
        blend = float(w) if w else 0.5
    except ValueError:
        raise ValueError(f"target pool {pool!r}: the blend weight must be a number") from None
    check_pool(name, blend)
    return name, blend


def target_name(kind: str, beta: float, pool: str = "group") -> str:
    return (f"power:{beta:g}" if kind == "power" else kind) + ("" if pool == "group" else f".{pool}")


def setup(args):
    """(device, tokenizer, teacher, shape, geometry dict) for ``args.config``."""
    args.cfg = dict(CONFIGS[args.config], sinks=4, window=args.window or (64 if args.config == "tiny" else 256))
    cuda = torch.cuda.is_available()
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    torch.backends.cuda.matmul.allow_tf32 = True
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        if not args.gguf:
            raise SystemExit(f"{model_dir} has no config.json and no --gguf was given")
        convert_gguf(Path(args.gguf), model_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    dev = "cuda" if cuda else "cpu"
    teacher = load_model(model_dir, "float32").to(dev)
    return dev, tok, teacher, model_shape(teacher)


def data_args(args, *, train: bool) -> argparse.Namespace:
    c = args.cfg
    n = args.train_traces if train else args.eval_traces
    return argparse.Namespace(seq_len=c["seq_len"], min_chars=c["min_chars"], max_chars=c["max_chars"], num_values=c["num_values"],
                              num_recalls=c["num_recalls"], min_quote_distance_chars=c["min_quote_distance_chars"], n=n)


def run_name(args) -> str:
    """The configuration's name in --work and --out: ``4k``; ``4k+w384`` with --window 384 (the same
    budget, fewer long-range slots); ``4k+mix64`` with --mix 64; ``4k+seed1`` with --seed 1 (a replicate:
    other training rows, order and initialization, the same held-out traces)."""
    return (args.config + (f"+w{args.window}" if args.window else "") + (f"+mix{args.mix}" if args.mix else "")
            + (f"+seed{args.seed}" if args.seed else ""))


def mix_records(args, tok) -> list[dict]:
    """--mix N: up to N pieces each of code and prose (:mod:`kvpop.data.other_text`), one row long at most."""
    if not args.mix:
        return []
    n = args.cfg["seq_len"]
    recs = [r for kind in KINDS for r in other_text_records(token_ids(tok), kind, args.mix, max_tokens=n)]
    counts = {k: sum(r["kind"] == k for r in recs) for k in KINDS}
    print(f"[{run_name(args)}] mixed in pieces of other text: {counts}", flush=True)
    return recs


def train_phase(args) -> None:
    dev, tok, teacher, shape = setup(args)
    c = args.cfg
    d = data_args(args, train=True)
    recs, stats, _, _ = make_records(tok, d.n, args.seed, d)
    mixed = mix_records(args, tok)
    recs = recs + mixed
    packed = pack_records(recs, seq_len=c["seq_len"], pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    print(f"[{args.config}] train data: {stats}, {packed.stats.rows} rows (fill {packed.stats.fill_ratio:.2f})", flush=True)
    accelerator = "cuda" if dev == "cuda" else "cpu"
    t_start = time.time()
    for label in args.labels.split(","):
        name, kind, beta, pool, weighting = parse_label(label)
        pool_name, blend = split_pool(pool)
        run_dir = Path(args.work) / run_name(args) / label
        if (run_dir / "export").is_dir():  # written atomically: present means complete
            print(f"[{label}] already exported, skipped", flush=True)
            continue
        left = args.time_limit - (time.time() - t_start)
        if left < 60:
            print(f"[{label}] no time left in this call ({left:.0f}s); run train again to continue", flush=True)
            continue
        cfg = TrainConfig(steps=args.steps, seq_len=c["seq_len"], batch_size=1, model_lr=args.model_lr, scorer_lr=args.scorer_lr,
                          scorer_hidden=args.scorer_hidden, top_logits=256, precision=resolve_precision("auto", accelerator),
                          accelerator=accelerator, target=kind, target_beta=beta, target_pool=pool_name,
                          target_blend=blend, boundary_weight=weighting, **split_scorer(label)[1])
        training = build_training(teacher, name, packed, cfg=cfg, budget=c["budget"], sinks=c["sinks"], window=c["window"], seed=args.seed)
        ckpt = run_dir / "resume.ckpt"
        timer = step_timer()
        t0 = time.time()
        trainer = training.fit(ckpt_path=ckpt if ckpt.is_file() else None, callbacks=[timer, StopAfter.make(left - 45)], enable_progress_bar=False)
        final = {k.removeprefix("train/"): round(float(v), 5) for k, v in trainer.callback_metrics.items() if k.startswith("train/")}
        log = {"label": label, "policy": name, "target": target_name(kind, beta, pool), "boundary_weight": weighting, "steps": trainer.global_step,
               "mix": {k: sum(r["kind"] == k for r in mixed) for k in KINDS} if mixed else None,
               "k": training.long_range, "seconds_this_call": round(time.time() - t0, 1), "precision": training.precision, **timer.summary(), **final}
        run_dir.mkdir(parents=True, exist_ok=True)
        logs = json.loads((run_dir / "log.json").read_text()) if (run_dir / "log.json").is_file() else []
        (run_dir / "log.json").write_text(json.dumps(logs + [log], indent=2))
        print(f"[{label}] {log}", flush=True)
        if trainer.global_step < args.steps:
            trainer.save_checkpoint(ckpt)
            print(f"[{label}] stopped at step {trainer.global_step}/{args.steps}: saved {ckpt}", flush=True)
            continue
        policy = training.policy
        if not policy.learned:
            policy = make_policy(name, **{x: shape[x] for x in ("num_layers", "num_kv_heads", "head_dim")})
        export(training.student.float(), tok, policy.float(), run_dir / "export", budget=c["budget"], sinks=c["sinks"], window=c["window"],
               extra={"label": label, "target": target_name(kind, beta, pool), "steps": trainer.global_step})
        ckpt.unlink(missing_ok=True)
        del training, trainer
        if dev == "cuda":
            torch.cuda.empty_cache()


def uneven(metrics: dict) -> bool:
    """Whether a policy's per-(layer, head) occupancy differs from 1 somewhere (a gate that evicts more than
    it must, a pool that moves slots between layers): then its ``occupancy_map`` is worth keeping."""
    return any(abs(x - 1) > 1e-9 for row in metrics.get("occupancy_map", []) for x in row)


def pad_records(recs: list[dict], seq_len: int, tok) -> list[dict]:
    """Records right-padded to ``seq_len``: one shape, one FlexAttention compile on CUDA (a compile per
    length would hit dynamo's recompile limit). Padding is never scored (``loss_mask`` 0), and
    ``trace_tokens`` tells oracle_target where the trace ends."""
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    return [{**r, "input_ids": r["input_ids"] + [pad_id] * (seq_len - len(r["input_ids"])),
             "loss_mask": r["loss_mask"] + [0] * (seq_len - len(r["input_ids"])), "trace_tokens": len(r["input_ids"])} for r in recs]


def eval_phase(args) -> None:
    dev, tok, teacher, shape = setup(args)
    c = args.cfg
    d = data_args(args, train=False)
    recs, stats, qd, _ = make_records(tok, d.n, args.eval_seed, d)
    padded = pad_records(recs, c["seq_len"], tok)
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.is_file() else {"configurations": []}
    prev = next((e for e in doc["configurations"] if e.get("config") == run_name(args)), None)
    # --incremental: keep the policies an earlier call evaluated on the same traces; run only the new ones
    done = set(prev["policies"]) if prev and args.incremental and prev["eval"].get("seed") == args.eval_seed else set()
    cands = [Candidate("dense", teacher, make_policy("dense")), Candidate("streaming_llm", teacher, make_policy("streaming_llm"))]
    steps, logs = {}, {}
    root = Path(args.work) / run_name(args)
    for run_dir in sorted(root.iterdir()) if root.is_dir() else []:
        if not (run_dir / "export").is_dir():
            print(f"[eval] {run_dir.name}: not finished, left out", flush=True)
            continue
        model, _, pol, meta = load_export(run_dir / "export")
        cands.append(Candidate(run_dir.name, model.to(dev).eval(), pol.to(dev)))
        if args.shared_pool and (twin := one_pool_twin(cands[-1])):  # its own priorities, one pool for the whole model
            cands.append(twin)
        if args.recency and has_recency(pol):
            cands += [Candidate(recency_label(run_dir.name, r), cands[-1].model, with_recency(pol, r)) for r in args.recency]
        steps[run_dir.name] = meta.get("steps")
        logs[run_dir.name] = json.loads((run_dir / "log.json").read_text())
    oracles = args.oracle_targets.split(",")  # kind[:beta][.pool][~recency:R | ~share:R]
    targets = [parse_label(f"x@{t}")[1:4] for t in oracles]
    for i, ((kind, beta, pool), (_, recency, space)) in enumerate(zip(targets, map(split_recency, oracles), strict=True)):
        suffix = "" if recency == 0 else f"~{'recency' if space == 'log' else 'share'}:{recency:g}"
        label = "oracle_target" if i == 0 else f"oracle_target@{target_name(kind, beta, pool)}{suffix}"
        pool_name, blend = split_pool(pool)
        for shared in (False, True) if args.shared_pool else (False,):
            cands.append(Candidate(label + (", one pool" if shared else ""), teacher, make_policy("oracle_target").configure(
                target=kind, target_beta=beta, pool=pool_name, blend=blend, recency=recency, space=space, shared=shared)))
    cands.append(Candidate("oracle_sources", teacher, make_policy("oracle_sources")))  # definitions: name and digits
    cands.append(Candidate("oracle_sources@digits", teacher, make_policy("oracle_sources").configure(lead=0)))  # the digits alone
    cands = [cd for cd in cands if cd.name not in done or cd.name == "dense"]  # dense: the reference of every KL
    t0 = time.time()
    res = evaluate_fidelity(padded, teacher, cands, budget=c["budget"], sinks=c["sinks"], window=c["window"], device=dev,
                            progress=lambda i, n: print(f"  eval trace {i}/{n} ({time.time() - t0:.0f}s)", flush=True))
    if done:
        res = {**prev["policies"], **res}
        steps = {**prev.get("steps_per_policy", {}), **steps}
        logs = {**prev.get("train_logs", {}), **logs}
    distinct = sorted(set(steps.values()), key=str)
    entry = {
        "config": run_name(args), "seq_len": c["seq_len"], "budget": c["budget"], "sinks": c["sinks"], "window": c["window"],
        "steps": distinct[0] if len(distinct) == 1 else None,  # every trained policy's, when they agree
        "steps_per_policy": steps,
        "target": target_name(*targets[0]),
        "policies": {n: {k: m[k] for k in ("quote_accuracy", "kl", "top1_agreement", "occupancy", "traces") if k in m}
                     | ({"occupancy_map": m["occupancy_map"]} if uneven(m) else {}) for n, m in res.items()},
        "k": {**(prev.get("k", {}) if done else {}),
              **{cd.name: cd.policy.long_range_slots(budget=c["budget"], sinks=c["sinks"], window=c["window"], head_dim=shape["head_dim"])
                 for cd in cands}},
        "train_logs": logs,
        "eval": {"traces": len(recs), "filter": stats, "trace_tokens": length_stats([len(r["input_ids"]) for r in recs], c["seq_len"]),
                 "quote_distance_chars": length_stats(qd, None), "scored_tokens": sum(score_positions(r)[0].numel() for r in recs),
                 "quote_tokens": sum(len(r["quote_positions"]) for r in recs), "seconds": round(time.time() - t0, 1), "seed": args.eval_seed},
        "data": {k: c[k] for k in ("min_chars", "max_chars", "num_values", "num_recalls", "min_quote_distance_chars")},
        "mix": next((lg[-1].get("mix") for lg in logs.values() if lg), None),  # other text the trained labels saw (their logs)
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    doc["configurations"] = [e for e in doc["configurations"] if e.get("config") != run_name(args)] + [entry]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\n{run_name(args)}: budget {c['budget']} of {c['seq_len']}-token rows, steps {entry['steps']}, "
          f"{entry['eval']['quote_tokens']} quote tokens on {len(recs)} held-out traces")
    print(f"{'policy':<28}{'quote acc':>10}{'KL':>10}{'top-1':>8}")
    for n, m in res.items():
        print(f"{n:<28}{m['quote_accuracy']:>10.3f}{m['kl']:>10.4f}{m['top1_agreement']:>8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["train", "eval", "all"])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="4k")
    ap.add_argument("--labels", default="streaming_llm_plus,kvpop_mlp,kvpop", help="trained labels name[@target], in order")
    ap.add_argument("--oracle-targets", default="max,mean,max.model", help="targets of oracle_target (kind[:beta][.pool][~recency:R]); "
                    "the first is the headline")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for this call's training (then a resume checkpoint)")
    ap.add_argument("--train-traces", type=int, default=None, help="default 320 (tiny: 4)")
    ap.add_argument("--eval-traces", type=int, default=None, help="default 16 (tiny: 2)")
    ap.add_argument("--model-lr", type=float, default=1e-5)
    ap.add_argument("--scorer-lr", type=float, default=3e-3)
    ap.add_argument("--scorer-hidden", type=int, default=64)
    ap.add_argument("--window", type=int, default=0, help="recent tokens always kept (default 256; tiny: 64); the budget stays the "
                    "configuration's, so a longer window leaves fewer long-range slots (results under <config>+w<N>)")
    ap.add_argument("--mix", type=int, default=0, help="add up to N pieces each of code and prose to the training rows "
                    "(kvpop.data.other_text; results under <config>+mix<N>)")
    ap.add_argument("--seed", type=int, default=0, help="training rows, their order and the initialization; "
                    "non-zero: a replicate, results under <config>+seed<N> (its spread is the noise of one training run)")
    ap.add_argument("--eval-seed", type=int, default=1)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--model-dir", default="/tmp/smol-hf")
    ap.add_argument("--work", default=".quality", help="exports and resume checkpoints, per configuration and label")
    ap.add_argument("--out", default="results/quality_h200.json")
    ap.add_argument("--shared-pool", action="store_true", help="eval: also rank by each --oracle-targets target, and every kvpop_mlp "
                    "export by its own priorities, with one pool of slots for the whole model (oracle_target's shared, "
                    "kvpop.policies.one_pool; dbtrimkv's budget), as '<label>, one pool'")
    ap.add_argument("--recency", type=recency_list, default=[], help="eval: also score every export whose scorer has an age decay "
                    "with these fixed extra decays (comma-separated, per token; kvpop.scorer), as '<label>, recency <r>'")
    ap.add_argument("--incremental", action="store_true", help="keep the policies --out already holds for this config; evaluate the rest")
    args = ap.parse_args()
    if args.seed == args.eval_seed:
        raise SystemExit(f"--seed {args.seed} equals --eval-seed: the training rows would be the held-out traces; pick another")
    tiny = args.config == "tiny"
    args.train_traces = args.train_traces or (4 if tiny else 320)
    args.eval_traces = args.eval_traces or (2 if tiny else 16)
    if args.phase in ("train", "all"):
        train_phase(args)
    if args.phase in ("eval", "all"):
        eval_phase(args)


if __name__ == "__main__":
    main()
