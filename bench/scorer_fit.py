"""Scorer fit against a frozen teacher, in minutes on a CPU: target ceiling vs fit vs baselines, same rows.

``bench/gpu_quality.py`` trains the scorer *and* fine-tunes the model (KL distillation), 300 steps
on a GPU. This isolates the scorer: the dense teacher runs once per trace and its keys, values and
training targets (:class:`kvpop.evaluate.TargetCapture`, every layer) are cached; each label then
trains only a fresh scorer on the cache, with the same boundary loss as training
(:func:`kvpop.boundary.boundary_loss`, through the policy's own ``scores``), for ``--epochs``
passes at the pipeline's scorer learning rate. The model is never fine-tuned, so the figures
separate what the *target* allows (``oracle_target@<target>``: the teacher's own ranking by it,
the ceiling of a perfect fit) from what a scorer *fits* of it, on the same held-out traces,
beside dense, streaming_llm and ``oracle_sources``. ``--no-harm N`` also scores the fitted scorers
on N pieces each of Python source and prose (``bench/bench_no_harm.py``'s files, row-length pieces):
KL to the dense teacher beside streaming_llm's and the targets' ceilings (is a harm the target's, or
the fit's?), the ranking's own harm on text it never saw. ``--mix N`` adds N pieces each of code and prose
(:mod:`kvpop.data.other_text`, as the pipeline's ``filter.other_text``) to the scorers' training rows
(does training on other text remove that harm? ``results/scorer_fit_mix_cpu.json`` was made with an
earlier choice of pieces, standard-library modules and installed packages' descriptions; its
``mix_pieces`` lists them).

Labels are ``gpu_quality.py``'s: ``name[@kind[:beta][.pool]][+regret][~recency:R | ~share:R][~calib:W]``, e.g. ``kvpop_mlp@max``,
``kvpop_mlp@max.model+regret``, ``kvpop@mean``. Each label's ceiling is reported once per target.

    PYTHONPATH=src:bench .venv/bin/python bench/scorer_fit.py --config 4k --model-dir models/base \\
        --labels kvpop_mlp@max,kvpop_mlp@max.model,kvpop_mlp@max.model+regret --out results/scorer_fit_cpu.json

The cache (``--cache``, default ``.quality/scorer_fit-<config>.pt``; 4k: about 180 MB per trace)
is reused by later calls with the same configuration, traces and seeds.

On a GPU (``--device``, default ``cuda`` where there is one) the teacher, the cache and the fits stay
there, and the evaluated traces are right-padded to the row length (one FlexAttention compile; the
padding is never scored). On an H200 a 4k fit of 48 traces x 3 epochs takes about 50 s; a label under
one pool (``--fit-shared-pool``, ``--shared-pool``) adds its fixed point, 35-45 s for 16 traces.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

import torch

from bench_no_harm import default_files, pieces, recency_label, recency_list
from gpu_embedded_run import make_records
from gpu_quality import CONFIGS, data_args, pad_records, parse_label, split_pool, split_scorer, target_name
from kvpop.attention import ScorerTraining
from kvpop.boundary import boundary_loss, calibration_loss
from kvpop.data.other_text import KINDS, other_text_records, token_ids
from kvpop.evaluate import Candidate, TargetCapture, evaluate_fidelity
from kvpop.modeling import load_model, model_shape
from kvpop.policies import Dense, Policy, Scores, make_policy, one_pool
from kvpop.scorer import with_recency
from kvpop.target import pool_targets
from kvpop.train import scorer_schedule

CACHE_VERSION = 1


def capture(teacher, ids: torch.Tensor, *, window: int, kinds: tuple) -> dict:
    """One dense teacher forward of a trace (1, S): per-layer keys and values (L, Hk, S, D) bf16 and
    targets {(kind, beta): (L, Hk, S) float32}."""

    class _Capture(TargetCapture):
        def attend(self, layer, q, k, v, scale):
            kv[layer] = (k[0].to(torch.bfloat16), v[0].to(torch.bfloat16))
            return super().attend(layer, q, k, v, scale)

    kv: dict[int, tuple] = {}
    S = ids.shape[1]
    pos = torch.arange(S, device=ids.device)[None]
    doc = torch.zeros_like(pos)
    ctx = _Capture.for_rows(Dense(), doc, pos, sinks=0, window=window, long_range=S, executor="sdpa", kinds=kinds, target_doc_ids=doc)
    with torch.no_grad():
        teacher(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    L = len(kv)
    return {
        "k": torch.stack([kv[i][0] for i in range(L)]), "v": torch.stack([kv[i][1] for i in range(L)]),
        "targets": {key: torch.cat([t[i] for i in range(L)]) for key, t in ctx.targets.items()},
    }


def build_cache(args, teacher, tok, kinds: tuple) -> dict:
    path = Path(args.cache or f".quality/scorer_fit-{args.config}.pt")
    ident = {"version": CACHE_VERSION, "model": str(Path(args.model_dir).resolve()), "config": args.config,
             "train": (args.train_traces, args.seed), "eval": (args.eval_traces, args.eval_seed)}
    if path.is_file():
        cache = torch.load(path, weights_only=False, map_location=args.device)
        if cache["ident"] == ident and set(kinds) <= set(cache["kinds"]):
            print(f"[cache] {path}: reused", flush=True)
            return cache
    cache = {"ident": ident, "kinds": kinds}
    w = args.cfg["window"]
    for split, train in (("train", True), ("eval", False)):
        d = data_args(args, train=train)
        recs, *_ = make_records(tok, d.n, args.seed if train else args.eval_seed, d)
        rows, t0 = [], time.time()
        for i, r in enumerate(recs):
            rows.append({"record": r, **capture(teacher, torch.tensor([r["input_ids"]], device=args.device), window=w, kinds=kinds)})
            print(f"[cache] {split} trace {i + 1}/{len(recs)} ({time.time() - t0:.0f}s)", flush=True)
        cache[split] = rows
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(cache, tmp)
    tmp.replace(path)
    return cache


def mix_cache(args, teacher, tok, kinds: tuple) -> list[dict]:
    """``--mix N`` rows: N pieces each of Python source and prose (:mod:`kvpop.data.other_text`, the
    pipeline's ``filter.other_text``: never the files the no-harm check reads), cached under their own file."""
    path = Path(args.cache or f".quality/scorer_fit-{args.config}.pt").with_name(f"scorer_fit-{args.config}-mix{args.mix}.pt")
    ident = {"version": CACHE_VERSION, "model": str(Path(args.model_dir).resolve()), "config": args.config, "mix": args.mix,
             "source": "kvpop.data.other_text"}
    if path.is_file():
        cache = torch.load(path, weights_only=False, map_location=args.device)
        if cache["ident"] == ident and set(kinds) <= set(cache["kinds"]):
            return cache["rows"]
    rows = []
    for kind in KINDS:
        for r in other_text_records(token_ids(tok), kind, args.mix, max_tokens=args.cfg["seq_len"]):
            rows.append({"record": r, **capture(teacher, torch.tensor([r["input_ids"]], device=args.device), window=args.cfg["window"],
                                                kinds=kinds)})
            print(f"[cache] mix {kind} piece {len(rows)} ({r['source']})", flush=True)
    torch.save({"ident": ident, "kinds": kinds, "rows": rows}, path)
    return rows


def fit(label: str, cache: dict, shape: dict, args) -> tuple:
    """A fresh scorer of ``label``'s policy trained on the cached train traces; (policy, log). The label's
    ``~`` suffixes (:func:`gpu_quality.split_scorer`) set its age decay, the decay's scale (the boundary
    loss then ranks on it) and the weight of :func:`kvpop.boundary.calibration_loss`."""
    name, kind, beta, pool, weighting = parse_label(label)
    pool_name, blend = split_pool(pool)
    c = args.cfg
    torch.manual_seed(args.seed)
    opts = split_scorer(label)[1]
    calibrate = opts.pop("scorer_calibration")
    policy = make_policy(name, **{x: shape[x] for x in ("num_layers", "num_kv_heads", "head_dim")}, scorer_hidden=args.scorer_hidden,
                         **opts).to(args.device)
    if not policy.learned:
        raise SystemExit(f"label {label!r}: {name} has no scorer to fit")
    k_slots = policy.long_range_slots(budget=c["budget"], sinks=c["sinks"], window=c["window"], head_dim=shape["head_dim"])
    st = ScorerTraining()  # the training's boundary-loss settings (tau, tie margin)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.scorer_lr, weight_decay=0.0)
    rows = cache["train"] + cache.get("mix", [])  # the traces and any pieces of other text (--mix), interleaved:
    rows = [rows[i] for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed)).tolist()] if "mix" in cache else rows
    total = args.epochs * len(rows)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, scorer_schedule(0, total))  # the pipeline's scorer schedule
    t0, losses = time.time(), []
    for _ in range(args.epochs):
        for row in rows:
            L, Hk, S, _ = row["k"].shape
            pos = torch.arange(S, device=args.device)[None]
            doc = torch.zeros_like(pos)
            targets = pool_targets([t[None] for t in row["targets"][(kind, beta)]], pool_name, blend)  # per layer (1, Hk, S)
            loss = 0.0
            for layer in range(L):
                sc = policy.scores(layer, row["k"][layer][None].float(), row["v"][layer][None].float(), pos, doc_ids=doc, window=c["window"])
                part, _ = boundary_loss(sc.r_hat, targets[layer], sc.log_gamma, doc, pos, sinks=c["sinks"], window=c["window"],
                                        long_range=k_slots, tau=st.tau, tie_margin=st.tie_margin, weighting=weighting,
                                        share=policy.scorer.decay.share)
                if calibrate > 0:
                    part = part.float() + calibrate * calibration_loss(sc.r_hat, targets[layer], doc, pos, sinks=c["sinks"])
                loss = loss + part.float() / L
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
    policy.eval()
    log = {"label": label, "target": target_name(kind, beta, pool), "boundary_weight": weighting, "calibrate": calibrate,
           "share": policy.scorer.decay.share,
           "epochs": args.epochs,
           "steps": total, "score_loss_first": round(losses[0], 5), "score_loss_last": round(sum(losses[-len(rows):]) / len(rows), 5),
           "seconds": round(time.time() - t0, 1), "k": k_slots}
    print(f"[fit] {log}", flush=True)
    return policy, log


class ShareRanked(Policy):
    """A probe, not a policy: a fitted scorer ranked on the share's scale, ``exp(r_hat) + recency * pos``
    (``--fit-share-recency``; the scorer's own decay left out). ``r_hat``'s offset only rescales
    ``recency``; its slope against the log target is whatever the boundary loss left it."""

    layer_independent = False

    def __init__(self, fitted: Policy, recency: float):
        super().__init__()
        self.fitted, self.recency, self.name = fitted, recency, f"{fitted.name}~share"

    def scores(self, layer, keys, values, pos, **kw):
        r_hat = self.fitted.scores(layer, keys, values, pos, **kw).r_hat.detach().double()  # (B, Hk, S)
        return Scores(prio=r_hat.exp() + self.recency * pos[:, None, :].double())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=sorted(CONFIGS), default="4k")
    ap.add_argument("--model-dir", default="models/base")
    ap.add_argument("--labels", default="kvpop_mlp@max,kvpop_mlp@max.model,kvpop_mlp@max.model+regret")
    ap.add_argument("--train-traces", type=int, default=14)
    ap.add_argument("--eval-traces", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=777)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--scorer-lr", type=float, default=0.01)
    ap.add_argument("--scorer-hidden", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--no-harm", type=int, default=0, help="also score N pieces each of code and prose (0: skip)")
    ap.add_argument("--mix", type=int, default=0, help="also train on N pieces each of code and prose (kvpop.data.other_text: never what --no-harm reads)")
    ap.add_argument("--recency", type=recency_list, default=[], help="also score every fit with these fixed age decays "
                    "(comma-separated, per token; kvpop.scorer), as '<label>, recency <r>'")
    ap.add_argument("--share-recency", type=recency_list, default=[], help="also rank by each target's exp (the attention share) "
                    "plus these age decays per token, as 'oracle_target@<target>~share_recency:<r>'")
    ap.add_argument("--fit-share-recency", type=recency_list, default=[], help="also rank every fit by exp(r_hat) plus these age "
                    "decays per token (a probe of the share-space fallback), as '<label>, share recency <r>'")
    ap.add_argument("--shared-pool", action="store_true", help="also rank by each target with one pool of slots for the whole "
                    "model (oracle_target's shared: as dbtrimkv's budget), as 'oracle_target@<target>, one pool'")
    ap.add_argument("--fit-shared-pool", action="store_true", help="also rank every fit with one pool of slots for the whole "
                    "model (kvpop.policies.one_pool), as '<label>, one pool'")
    ap.add_argument("--ceilings-only", action="store_true", help="fit nothing: the labels only name the targets whose ceilings to score")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the teacher, the cache and the fits live (default: cuda where there is one)")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible here (use --device cpu)")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.cfg = dict(CONFIGS[args.config], sinks=4, window=64 if args.config == "tiny" else 256)
    c = args.cfg
    labels = args.labels.split(",")
    parsed = {lb: parse_label(lb) for lb in labels}
    kinds = tuple(sorted({(p[1], p[2]) for p in parsed.values()}))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    teacher = load_model(args.model_dir, "float32").eval().to(args.device)
    shape = model_shape(teacher)
    cache = build_cache(args, teacher, tok, kinds)
    harm_recs = {kind: pieces(tok, files, c["seq_len"], args.no_harm, c["seq_len"] // 2) if args.no_harm else []
                 for kind, files in default_files().items()}
    if args.mix:
        cache = {**cache, "mix": mix_cache(args, teacher, tok, kinds)}
    cands = [Candidate("dense", teacher, make_policy("dense")), Candidate("streaming_llm", teacher, make_policy("streaming_llm"))]
    # each target's ceiling, also with every fixed age decay a label trains with or --recency adds
    recencies = sorted({0.0, *args.recency, *(o["scorer_recency"] for o in map(lambda lb: split_scorer(lb)[1], labels)
                                               if o["scorer_recency_space"] == "log")})
    for kind, beta, pool in sorted({p[1:4] for p in parsed.values()}):
        pool_name, blend = split_pool(pool)
        for r in recencies:
            cands.append(Candidate(f"oracle_target@{target_name(kind, beta, pool)}" + ("" if r == 0 else f"~recency:{r:g}"), teacher,
                                   make_policy("oracle_target").configure(target=kind, target_beta=beta, pool=pool_name, blend=blend, recency=r)))
        if args.shared_pool:  # the same ranking under one budget for the whole model
            cands.append(Candidate(f"oracle_target@{target_name(kind, beta, pool)}, one pool", teacher,
                                   make_policy("oracle_target").configure(target=kind, target_beta=beta, pool=pool_name, blend=blend, shared=True)))
        for r in args.share_recency:  # the decay against the attention share, exp(target): a ceiling probe
            cands.append(Candidate(f"oracle_target@{target_name(kind, beta, pool)}~share_recency:{r:g}", teacher,
                                   make_policy("oracle_target").configure(target=kind, target_beta=beta, pool=pool_name, blend=blend,
                                                                          recency=r, space="share")))
    cands.append(Candidate("oracle_sources", teacher, make_policy("oracle_sources")))
    logs = {}
    for lb in [] if args.ceilings_only else labels:
        pol, logs[lb] = fit(lb, cache, shape, args)
        cands.append(Candidate(lb, teacher, pol))
        cands += [Candidate(recency_label(lb, r), teacher, with_recency(pol, r)) for r in args.recency]
        cands += [Candidate(f"{lb}, share recency {r:g}", teacher, ShareRanked(pol, r)) for r in args.fit_share_recency]
        if args.fit_shared_pool:
            cands.append(Candidate(f"{lb}, one pool", teacher, one_pool(pol)))
    recs = [row["record"] for row in cache["eval"]]
    if args.device != "cpu":  # one shape for FlexAttention's compile (the CPU runs SDPA: no padding, no waste)
        recs = pad_records(recs, c["seq_len"], tok)
        harm_recs = {kind: pad_records(r, c["seq_len"], tok) for kind, r in harm_recs.items()}
    t0 = time.time()
    res = evaluate_fidelity(recs, teacher, cands, budget=c["budget"], sinks=c["sinks"], window=c["window"], device=args.device,
                            progress=lambda i, n: print(f"  eval trace {i}/{n} ({time.time() - t0:.0f}s)", flush=True))
    print(f"\n{args.config}: budget {c['budget']} of {c['seq_len']}-token rows; scorers fitted on {len(cache['train'])} traces "
          f"x {args.epochs} epochs, frozen model; {len(recs)} held-out traces")
    print(f"{'policy':<34}{'quote acc':>10}{'KL':>10}{'top-1':>8}")
    for n, m in res.items():
        print(f"{n:<34}{m['quote_accuracy']:>10.3f}{m['kl']:>10.4f}{m['top1_agreement']:>8.3f}")
    harm = {}

    def save() -> None:  # after the held-out traces and again after each kind of other text: a cut-off call keeps what it has
        if not args.out:
            return
        doc = {"config": args.config, "seq_len": c["seq_len"], "budget": c["budget"], "window": c["window"], "model": "frozen (no fine-tune)",
               "train_traces": len(cache["train"]), "mix_pieces": [r["record"]["source"] for r in cache.get("mix", [])],
               "eval_traces": len(recs), "epochs": args.epochs,
               "policies": {n: {k: m[k] for k in ("quote_accuracy", "kl", "top1_agreement", "traces")} for n, m in res.items()},
               "fits": logs, "no_harm": harm, "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
               "torch": torch.__version__, "threads": torch.get_num_threads(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")

    save()
    for kind, recs_k in harm_recs.items() if args.no_harm else ():
        r = evaluate_fidelity(recs_k, teacher, cands, budget=c["budget"], sinks=c["sinks"], window=c["window"], device=args.device)
        harm[kind] = {n: {"kl": m["kl"], "top1_agreement": m["top1_agreement"]} for n, m in r.items()}
        print(f"\n{kind}: {len(recs_k)} pieces, {sum(x.get('trace_tokens', len(x['input_ids'])) for x in recs_k)} tokens, KL to the dense teacher")
        for n, m in r.items():
            print(f"  {n:<34}KL {m['kl']:.4f}  top-1 {m['top1_agreement']:.3f}")
        save()


if __name__ == "__main__":
    main()
