"""Stage evaluate: every policy at the run's budget on held-out data.

1. teacher-forced fidelity against the dense teacher (KL, top-1 agreement, long-range quote accuracy),
   with the ceilings ``oracle_target`` (the dense teacher's ranking by ``train.target``) and
   ``oracle_sources`` (keeps the definitions the quotes copy) beside the trained policies;
2. sampled rollouts on held-out problems (pass@1, absolute and relative to dense);
3. cost: peak cache memory and decode tokens/s, and the cache-memory curve over generated length;
4. competition benchmarks (evaluate.benchmarks) where reachable;
5. held-out code and prose (evaluate.other_text): KL and top-1 agreement to the base model's dense attention;
6. RULER (evaluate.benchmarks.ruler, the kvpop[ruler] extra): generated answers and teacher-forced answer accuracy per task.

Everything goes to ``--out`` (``metrics/eval.json``); per policy the few numbers that matter go to
``--summary`` (``metrics/summary/<policy>.json``, :func:`kvpop.summary.summary`), the metrics
``dvc metrics show`` and ``dvc exp show`` read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvpop import tracking
from kvpop.data.other_text import held_out_records, token_ids
from kvpop.evaluate import (
    OTHER_TEXT_ORACLES,
    Candidate,
    evaluate_fidelity,
    evaluate_other_text,
    floor_twin,
    keep_map,
    one_pool_twin,
    pad_records,
    ranked_policy,
    score_positions,
)
from kvpop.export import CheckpointError, load_export
from kvpop.filter import read_jsonl
from kvpop.geometry import CacheLayout
from kvpop.io import atomic_dir
from kvpop.modeling import load_model, model_shape
from kvpop.plots import plot_keep_map, plot_memory_curve, plot_occupancy
from kvpop.policies import make_policy, policy_class
from kvpop.rollouts import BenchmarkUnavailable, Problem, chat_prompt_ids, load_benchmark, memory_curve, pass_at_1, rollout_problems
from kvpop.ruler import missing as ruler_missing
from kvpop.summary import summary
from report import print_table

from common import Progress, console, fail, params, write_json


def candidates(p, base: str, exports: Path, precision: str, device: str, only: set[str] | None = None):
    """(teacher, tokenizer, [Candidate]) for every evaluated policy, on ``device`` (``only``: those named, and no
    other export loaded)."""
    from transformers import AutoTokenizer

    teacher = load_model(base, precision).to(device).eval()
    tok = AutoTokenizer.from_pretrained(base)
    shape = {k: v for k, v in model_shape(teacher).items() if k != "num_heads"}
    out = []
    wanted = None if only is None else {ranked_policy(n) for n in only}  # the exports to load
    for name in p.evaluate.policies:
        # rules that need each step's attention are decoded token by token: a few traces only
        decode_only = policy_class(name).needs_attention
        pol = make_policy(name, **shape)
        if name == "oracle_target":  # the ceiling of the configured training target
            pol.configure(target=p.train.target)
        out.append(Candidate(name, teacher, pol, max_traces=p.evaluate.decode_traces if decode_only else None))
    for name in p.train.policies:
        if wanted is not None and name not in wanted:
            continue
        try:
            model, _, pol, meta = load_export(exports / name, precision)
        except (CheckpointError, FileNotFoundError, RuntimeError) as err:
            fail(f"trained policy {name!r}: {err}")
        if (meta["budget"], meta["sinks"], meta["window"]) != (p.budget, p.sinks, p.window):
            fail(f"{name} was exported for budget/sinks/window {meta['budget']}/{meta['sinks']}/{meta['window']}, "
                 f"params say {p.budget}/{p.sinks}/{p.window}")
        if pol.name != name:
            fail(f"{exports / name} holds policy {pol.name!r}, not {name!r}")
        out.append(Candidate(name, model.to(device).eval(), pol.to(device)))
        if p.evaluate.one_pool and (twin := one_pool_twin(out[-1])):  # its own priorities, one pool for the whole model
            out.append(twin)
    out += [floor_twin(c, f) for c in list(out) if c.policy.one_pool for f in p.evaluate.pool_floors]  # no head below f long-range entries
    return teacher, tok, out if only is None else [c for c in out if c.name in only]


def plot_keep_maps(cands, record: dict, path: Path, *, layout: CacheLayout) -> None:
    """The per-head keep map of every policy with a full-sequence pattern (dense, the rules without
    attention, the trained ones; not the oracles, which read the trace's future) on one trace."""
    ids = torch.tensor(record["input_ids"], device=next(cands[0].model.parameters()).device)[None]
    maps = {}
    for c in cands:
        if c.policy.oracle or c.policy.needs_attention:
            continue
        maps[c.name] = keep_map(c.model, c.policy, ids, layout=layout.for_policy(c.policy, head_dim=model_shape(c.model)["head_dim"]))
    marks = {"definitions": record.get("quote_source_positions", []), "quotes": record.get("quote_positions", [])}
    plot_keep_map(maps, path, marks={k: v for k, v in marks.items() if v},
                  title=f"KV entries kept per layer and head over one held-out trace ({ids.shape[1]} tokens, budget {layout.budget})\n"
                        "colour: share of the rest of the trace a token stays cached")


def other_text(p, tok, teacher, cands, say, device: str) -> dict:
    """``evaluate.other_text``: held-out code and prose pieces of at most ``train.seq_len`` tokens, every
    candidate (an oracle where it applies) scored against the base model's dense attention (:func:`kvpop.evaluate.evaluate_other_text`)."""
    want = p.evaluate.other_text.model_dump()
    pieces = {kind: held_out_records(token_ids(tok), kind, n, max_tokens=p.train.seq_len) for kind, n in want.items() if n}
    for kind, recs in pieces.items():
        if len(recs) < want[kind]:
            say(f"[yellow]evaluate.other_text.{kind}: {want[kind]} pieces asked, {len(recs)} found of "
                f"{p.train.seq_len // 2}-{p.train.seq_len} tokens (train.seq_len)")
    if any(c.policy.oracle for c in cands):
        say(f"other text: {OTHER_TEXT_ORACLES}")
    offset, total = {}, 0
    for kind, recs in pieces.items():
        offset[kind], total = total, total + len(recs)
    if device == "cuda":  # one shape, as the fidelity traces
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        pieces = {kind: pad_records(recs, p.train.seq_len, pad_id) for kind, recs in pieces.items()}
    with Progress("other text: pieces", total) as bar:
        other = evaluate_other_text(pieces, teacher, cands, layout=p.layout, device=device,
                                    progress=lambda kind, i, n: bar.update(offset[kind] + i, kind=kind))
    for kind, by_policy in other.items():
        say(f"other text, {kind} ({len(pieces[kind])} pieces), KL to the base model's dense attention: "
            + ", ".join(f"{n} {m['kl']:.4f}" for n, m in by_policy.items()))
    return other


def ruler_benchmark(p, base: str, exports: Path, tok, teacher, cands, say, device: str) -> dict:
    """``evaluate.benchmarks.ruler``: RULER's samples (:func:`kvpop.ruler.generate_samples`, from the base
    model's tokenizer) on every candidate (:func:`kvpop.ruler.evaluate_ruler`, one policy at a time; with ``workers``
    > 1 split between that many processes, :func:`ruler_in_workers`), with how they were made. Each task of a policy
    is kept in :data:`RULER_CACHE` as soon as it ends (:func:`ruler_policy`), the policy's whole result when all have,
    and taken from there when its key matches."""
    from kvpop import ruler

    rc, seq_len = p.evaluate.benchmarks.ruler, p.ruler_seq_len
    limit = getattr(teacher.config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        say(f"[yellow]evaluate.benchmarks.ruler: context {seq_len} is past the model's {limit} positions")
    say(f"RULER: generating {rc.samples} samples of {len(rc.tasks)} tasks at {seq_len} tokens (seed {rc.seed})")
    try:
        samples = ruler.generate_samples(base, tasks=rc.tasks, seq_len=seq_len, samples=rc.samples, seed=rc.seed, tokenizer=tok)
    except (ruler.RulerUnavailable, ValueError) as err:
        fail(f"evaluate.benchmarks.ruler: {err}")
    names = [c.name for c in cands if not c.policy.oracle] + [c.name for c in cands if c.policy.oracle]  # the costly first
    keys = ruler_keys(p, names, base, exports, device, samples)
    try:
        RULER_CACHE.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        fail(f"evaluate.benchmarks.ruler: cannot keep the results in {RULER_CACHE}: {err}")
    kept = [n for n in names if keys[n].is_file()]
    if kept:
        say(f"RULER: {', '.join(kept)} from {RULER_CACHE} (the same samples, options, code and weights)")
    todo = [n for n in names if n not in kept]
    if rc.workers > 1 and todo:  # one policy left too: its tasks split between the workers
        ruler_in_workers(samples, todo, rc.workers, keys, base=base, exports=exports, say=say)
    elif todo:
        by_name, opts = {c.name: c for c in cands}, ruler_options(p, tok, device)
        with Progress("RULER: policies", len(todo)) as bar:
            for j, name in enumerate(todo):
                def run(sub, on_task, j=j, name=name):
                    ruler.evaluate_ruler({t: samples[t] for t in sub}, tok, teacher, [by_name[name]], **opts, on_task=on_task,
                                         progress=lambda stage, i, n: bar.update(j, policy=f"{name}, {stage} {i}/{n}"))
                if again := ruler_policy(list(samples), keys[name], task_folder(keys[name]), run):
                    say(f"RULER {name}: {again} of {len(samples)} tasks from a run before")
                shutil.rmtree(task_folder(keys[name]), ignore_errors=True)
            bar.update(len(todo))
    res = {n: json.loads(keys[n].read_text()) for n in names}
    for name, m in res.items():
        say(f"RULER {name}: " + ", ".join(f"{k} {m[k]['mean']:.3f}" for k in ("accuracy", "teacher_forced") if m[k]))
    return {"tasks": rc.tasks, "seq_len": seq_len, "samples": rc.samples, "reference_samples": rc.reference_samples, "seed": rc.seed,
            "budget": p.budget,
            "fingerprint": ruler.fingerprint(samples),
            "prompt_tokens": {t: sum(len(s.prompt_ids) for s in ss) / len(ss) for t, ss in samples.items()}, "policies": res}


def ruler_options(p, tok, device: str) -> dict:
    """:func:`kvpop.ruler.evaluate_ruler`'s options from the params (the stage's process and its workers alike)."""
    rc = p.evaluate.benchmarks.ruler
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    return dict(layout=p.layout, device=device, reference_samples=rc.reference_samples, batch=rc.batch,
                pad_to=p.ruler_seq_len if device == "cuda" else None, pad_id=pad_id, compile=device == "cuda")


#: where the stage keeps each policy's RULER result (:func:`ruler_keys`), so that a stage stopped part of the way
#: (a time limit) or run again with some policies changed redoes only the policies whose result is not there
RULER_CACHE = Path(".cache/ruler")


def ruler_keys(p, names: list[str], base: str, exports: Path, device: str, samples: dict) -> dict[str, Path]:
    """Policy -> the file of its RULER result in :data:`RULER_CACHE`, named by a sha256 of everything the result
    depends on: the samples, the RULER and evaluate options that change answers (not ``workers``), the budget, the
    device and torch's version, kvpop's source, the base model's files and, for a trained policy (its one-pool twin
    too), its export's files."""
    import hashlib

    import kvpop
    from kvpop import ruler

    def files(folder: Path, h) -> None:
        for f in sorted(x for x in folder.rglob("*") if x.is_file()):
            h.update(f.relative_to(folder).as_posix().encode())
            with open(f, "rb") as fh:
                while block := fh.read(1 << 24):
                    h.update(block)

    common = hashlib.sha256()
    opts = {"ruler": p.evaluate.benchmarks.ruler.model_dump(exclude={"workers"}), "seq_len": p.ruler_seq_len, "layout": [p.budget, p.sinks, p.window],
            "precision": p.evaluate.precision, "matmul_precision": p.evaluate.matmul_precision, "decode_traces": p.evaluate.decode_traces,
            "target": p.train.target.model_dump(),
            "device": device, "torch": torch.__version__, "samples": ruler.fingerprint(samples)}
    common.update(json.dumps(opts, sort_keys=True, default=str).encode())
    src = Path(kvpop.__file__).parent
    for f in sorted(src.rglob("*.py")):
        common.update(f.relative_to(src).as_posix().encode() + f.read_bytes())
    files(Path(base), common)
    weights = {}  # a trained policy's export, hashed once (its one-pool twin shares it)
    for t in {ranked_policy(n) for n in names} & set(p.train.policies):
        weights[t] = hashlib.sha256()
        files(exports / t, weights[t])
    out = {}
    for name in names:
        h = common.copy()
        h.update(name.encode() + (weights[ranked_policy(name)].digest() if ranked_policy(name) in weights else b""))
        out[name] = RULER_CACHE / f"{h.hexdigest()[:32]}.json"
    return out


def ruler_in_workers(samples: dict, todo: list[str], workers: int, keys: dict[str, Path], *, base: str, exports: Path, say) -> None:
    """RULER's policies ``todo`` split between up to ``workers`` processes of this script (``--ruler-worker``), round
    robin: each loads the teacher and the exports, reads the samples this process made and evaluates its share one
    part at a time. Each task of a policy is written as soon as it ends (:func:`task_folder`), so a run stopped part of
    the way (a time limit) goes on from the tasks not yet written, however the next run splits the work. Where the
    workers outnumber the policies, each policy's tasks are split into that many parts (round robin over the tasks) and
    its parts merged into its ``keys`` file at the end (:func:`kvpop.ruler.merge_parts`; a part already on disk is not redone).
    What a part gets does not depend on the others (one GPU holds several such processes; the GPU, mostly idle under
    one at batch 1, serves them side by side). A worker that runs out of GPU memory stops the others, and the parts
    not yet written run again in half as many processes (down to one); a worker that fails otherwise, or alone, stops
    the stage, naming its policies and the end of its log; the results written before stay."""
    from kvpop import ruler

    tasks = [t for t in samples if samples[t]]
    split = max(1, min(len(tasks), workers // max(1, len(todo))))  # parts per policy
    task_groups = [tasks[i::split] for i in range(split)]

    def part_file(name: str, i: int) -> Path:
        return keys[name] if split == 1 else keys[name].with_name(f"{keys[name].stem}.part{i}of{split}.json")

    jobs = [(name, group, part_file(name, i), task_folder(keys[name])) for name in todo for i, group in enumerate(task_groups)]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # this process's cached blocks from the fidelity passes, for the workers (23 GB at 4k)
    with tempfile.TemporaryDirectory(prefix="kvpop-ruler-") as tmp:
        tmp = Path(tmp)
        torch.save(samples, tmp / "samples.pt")
        while left_jobs := [j for j in jobs if not j[2].is_file()]:
            if done := sum(len(g) for _, g, out, _ in jobs if out.is_file()) + sum(tasks_kept(f, g) for _, g, out, f in left_jobs):
                say(f"RULER: {done} of {sum(len(g) for _, g, _, _ in jobs)} policy tasks already kept")
            workers = min(workers, len(left_jobs))
            failed = _ruler_round(tmp, left_jobs, jobs, workers, split, len(todo), base=base, exports=exports, say=say)
            if failed is None:
                if missing := [f"{name} [{' '.join(group)}]" for name, group, out, _ in left_jobs if not out.is_file()]:
                    fail(f"evaluate.benchmarks.ruler: the workers ended well without writing {', '.join(missing)}")
                continue
            group, rc, tail = failed
            if "OutOfMemoryError" in tail and workers > 1:
                say(f"[yellow]RULER: a worker ({', '.join(group)}) ran out of GPU memory: the {sum(not j[2].is_file() for j in jobs)} "
                    f"parts not written run again in {workers // 2} processes")
                workers //= 2
                continue
            hint = ("\n(the GPU ran out of memory in a single process: evaluate.benchmarks.ruler.batch prefills fewer prompts at once)"
                    if "OutOfMemoryError" in tail else "")
            fail(f"evaluate.benchmarks.ruler: the worker for {', '.join(group)} failed (exit {rc}):\n{tail}{hint}")
    if split > 1:
        for name in todo:
            files = [part_file(name, i) for i in range(split)]
            write_json(keys[name], ruler.merge_parts([json.loads(f.read_text()) for f in files], tasks))
            for f in files:
                f.unlink()
    for name in todo:
        shutil.rmtree(task_folder(keys[name]), ignore_errors=True)  # its tasks are in its keys file now


def task_folder(key: Path) -> Path:
    """Where :func:`ruler_worker` keeps each task of a policy as it ends (``<key>.tasks/<task>.json``), until its
    result is whole."""
    return key.with_name(f"{key.stem}.tasks")


def tasks_kept(folder: Path, tasks: list[str]) -> int:
    return sum((folder / f"{t}.json").is_file() for t in tasks)


def _ruler_round(tmp: Path, left_jobs: list, jobs: list, workers: int, split: int, policies: int, *, base: str, exports: Path, say):
    """One round of :func:`ruler_in_workers`: ``left_jobs`` shared out between ``workers`` processes, waited for ->
    None when every one ended well, else (its policies, exit status, the end of its log) of the first that failed,
    the others stopped."""
    shares = [left_jobs[k::workers] for k in range(workers)]

    def label(job) -> str:
        return job[0] if split == 1 else f"{job[0]} [{' '.join(job[1])}]"

    procs = []
    for k, share in enumerate(shares):
        write_json(tmp / f"job_{k}.json", {"parts": [[name, group, str(out.resolve()), str(folder.resolve())] for name, group, out, folder in share]})
        log = open(tmp / f"worker_{k}.log", "w")  # noqa: SIM115 - closed when the worker ends
        cmd = [sys.executable, __file__, "--base", base, "--exports", str(exports), "--ruler-worker", str(tmp), "--ruler-part", str(k)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log, sorted({name for name, *_ in share})))
    what = f"{policies} policies" + (f", each in {split} parts of its tasks," if split > 1 else "")
    say(f"RULER: {what} in {workers} processes: " + "; ".join(", ".join(label(j) for j in share) for share in shares))
    def tasks_done() -> int:  # a part's tasks are done when its file is there, or each one's file in its task folder
        return sum(len(group) if out.is_file() else tasks_kept(folder, group) for _, group, out, folder in jobs)

    left = list(procs)
    try:
        with Progress("RULER: policy tasks", sum(len(group) for _, group, _, _ in jobs)) as bar:
            shown = -1
            while left:
                if (done := tasks_done()) != shown:
                    shown = done
                    bar.update(done, workers=len(left))
                for item in list(left):
                    proc, log, group = item
                    if proc.poll() is None:
                        continue
                    log.close()
                    left.remove(item)
                    w = procs.index(item)
                    text = (tmp / f"worker_{w}.log").read_text(errors="replace")
                    if proc.returncode != 0:
                        return group, proc.returncode, "\n".join(text.splitlines()[-20:])
                    # its timings (loading, each teacher-forced stage, each task kept) into the stage's own log: the
                    # worker's log goes with the temporary folder
                    for line in text.splitlines():
                        if line.startswith("RULER "):
                            say(f"  worker {w}: {line}")
                time.sleep(0.5)
            bar.update(tasks_done(), workers=0)
    finally:  # a worker failed, or this process is stopped (an exception, Ctrl-C): no worker outlives the round
        for proc, log, _ in left:
            proc.kill()
            proc.wait()
            log.close()
    return None


def ruler_worker(args) -> None:
    """``--ruler-worker DIR --ruler-part K``: one of :func:`ruler_in_workers`' processes: the parts of
    ``DIR/job_K.json`` (a policy and the tasks to run it on) on the samples of ``DIR/samples.pt``, one at a time,
    each result to its file."""
    from kvpop import ruler

    t_load = time.monotonic()
    p = params()
    folder = Path(args.ruler_worker)
    job = json.loads((folder / f"job_{args.ruler_part}.json").read_text())
    device = eval_device(p.evaluate)
    torch.manual_seed(p.seed)
    names = {name for name, *_ in job["parts"]}
    teacher, tok, cands = candidates(p, args.base, Path(args.exports), p.evaluate.precision, device, only=names)
    by_name = {c.name: c for c in cands}
    if missing := sorted(n for n in names if n not in by_name):
        fail(f"RULER worker: policies {missing} are not among the evaluated ones")
    samples = torch.load(folder / "samples.pt", weights_only=False)
    opts = ruler_options(p, tok, device)
    t_start = time.monotonic()
    console.print(f"RULER worker {args.ruler_part}: policies and samples loaded in {t_start - t_load:.0f} s", highlight=False)
    for name, tasks, out, kept in job["parts"]:
        def stage(what: str, done: int, total: int, name=name) -> None:  # the teacher-forced passes come first, each task's answers after
            console.print(f"RULER {name}: {what} {done}/{total}, {time.monotonic() - t_start:.0f} s into the worker", highlight=False)

        def run(sub, on_task, name=name, stage=stage):
            ruler.evaluate_ruler({t: samples[t] for t in sub}, tok, teacher, [by_name[name]], **opts, on_task=on_task, progress=stage)
        again = ruler_policy(tasks, Path(out), Path(kept), run)
        again = f", {again} of them from a run before" if again else ""
        console.print(f"RULER worker {args.ruler_part}: {name} ({', '.join(tasks)}{again}) done", highlight=False)


def ruler_policy(tasks: list[str], out: Path, kept: Path, run) -> int:
    """One policy's RULER result over ``tasks`` into ``out``: ``run(task names, on_task)`` (evaluate_ruler of that
    policy on those tasks' samples) over the tasks not yet in the folder ``kept``, each written there as it ends, then all of them merged
    (:func:`kvpop.ruler.merge_parts`) -> how many were there from a run before."""
    from kvpop import ruler

    if left := [t for t in tasks if not (kept / f"{t}.json").is_file()]:
        kept.mkdir(parents=True, exist_ok=True)
        t0 = [time.monotonic()]

        def keep(name: str, task: str, entry: dict) -> None:
            write_json(kept / f"{task}.json", entry)
            console.print(f"RULER {name}: {task} kept, {time.monotonic() - t0[0]:.0f} s", highlight=False)  # where a policy's time goes
            t0[0] = time.monotonic()

        run(left, keep)
    write_json(out, ruler.merge_parts([json.loads((kept / f"{t}.json").read_text()) for t in tasks], tasks))
    return len(tasks) - len(left)


def eval_device(cfg) -> str:
    """``evaluate.device`` resolved (auto: CUDA where visible), with CUDA's settings for the stage: float32 products
    at ``evaluate.matmul_precision``, and room for a compiled FlexAttention per policy."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    if device == "cuda" and not torch.cuda.is_available():
        fail("evaluate.device is 'cuda' but no CUDA device is visible")
    torch.set_float32_matmul_precision(cfg.matmul_precision)  # CUDA's float32 products (TF32 at 'high'); no effect on the CPU
    if device == "cuda":
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)  # a mask per policy
    return device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", default="models/base")
    ap.add_argument("--data", default="data/filtered/eval.jsonl")
    ap.add_argument("--exports", default="models/export")
    ap.add_argument("--out", default="metrics/eval.json")
    ap.add_argument("--summary", default="metrics/summary", help="a folder: one compact JSON file per policy")
    ap.add_argument("--plots", default="plots")
    ap.add_argument("--ruler-worker", help=argparse.SUPPRESS)  # internal: a process of evaluate.benchmarks.ruler.workers
    ap.add_argument("--ruler-part", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ruler_worker:
        ruler_worker(args)
        return
    p = params()
    cfg = p.evaluate
    try:
        records = read_jsonl(args.data)
    except (FileNotFoundError, ValueError) as err:
        fail(f"{err} (run the filter stage)")
    if not records:
        fail(f"{args.data} holds no traces")
    if cfg.benchmarks.ruler.enabled and (why := ruler_missing()):
        fail(why)
    torch.manual_seed(p.seed)
    device = eval_device(cfg)
    teacher, tok, cands = candidates(p, args.base, Path(args.exports), cfg.precision, device)
    fid_records = records[: cfg.max_traces]
    eval_tokens = sum(score_positions(r)[0].numel() for r in fid_records)
    lengths = [len(r["input_ids"]) for r in fid_records]
    common = dict(budget=p.budget, sinks=p.sinks, window=p.window)
    logged = {"seed": p.seed, **common, "evaluate": cfg.model_dump(), "train.policies": p.train.policies}
    plots = Path(args.plots)
    with tracking.stage_run("evaluate", logged) as run:
        say = lambda msg: console.print(msg, highlight=False)  # noqa: E731
        say(f"[bold]evaluate[/]: budget {p.budget}, policies {[c.name for c in cands]}")
        say(f"fidelity on {len(fid_records)} traces ({min(lengths)}-{max(lengths)} tokens)")
        scored_records = fid_records
        if device == "cuda":  # one shape: compiled FlexAttention compiles once (kvpop.evaluate.pad_records)
            pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
            scored_records = pad_records(fid_records, max(p.train.seq_len, *lengths), pad_id)
        with Progress("fidelity: traces", len(fid_records)) as bar:
            results = evaluate_fidelity(scored_records, teacher, cands, layout=p.layout, device=device, progress=lambda i, n: bar.update(i))
        other = other_text(p, tok, teacher, cands, say, device) if cfg.other_text.code or cfg.other_text.prose else None

        rc = cfg.rollouts
        # prefer prompts longer than the budget (eviction happens); a budget above every prompt uses them all
        problems = []
        if rc.problems:
            problems = rollout_problems(records, tok, n_problems=rc.problems, min_prompt_tokens=p.budget) or rollout_problems(
                records, tok, n_problems=rc.problems
            )
        curve_prompt = problems[0].prompt_ids if problems else records[0]["input_ids"]
        curves = {}
        decoded = [c for c in cands if not c.policy.oracle]  # ceilings read the trace's future: teacher-forced metrics only
        with Progress(f"rollouts ({len(problems)} problems x {rc.n}) and memory: policies", len(decoded)) as bar:
            for i, c in enumerate(decoded):
                bar.update(i, policy=c.name)
                if problems:
                    r = pass_at_1(c.model, tok, c.policy, problems, n=rc.n, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                  max_new_tokens=rc.max_new_tokens, seed=p.seed, layout=p.layout)
                    results[c.name].update(pass_at_1=r["pass_at_1"], peak_cache_mb=r["peak_cache_mb"], tokens_per_s=r["tokens_per_s"])
                if cfg.memory_lengths:
                    curves[c.name] = memory_curve(c.model, tok, c.policy, curve_prompt, lengths=cfg.memory_lengths, rows=rc.n, layout=p.layout)
            bar.update(len(decoded))
        dense_p1 = results.get("dense", {}).get("pass_at_1")
        for m in results.values():
            if "pass_at_1" in m:
                m["pass_at_1_relative"] = m["pass_at_1"] / dense_p1 if dense_p1 else float("nan")

        benchmarks = {}
        for bench, source in cfg.benchmarks.competition().items():
            try:
                rows = load_benchmark(source)
            except BenchmarkUnavailable as err:
                say(f"[yellow]benchmark {bench} skipped (unreachable): {err}")
                benchmarks[bench] = {"skipped": str(err)}
                continue
            probs = [Problem(id=str(r["id"]), prompt_ids=chat_prompt_ids(tok, r["problem"]), gold=str(r["answer"])) for r in rows]
            benchmarks[bench] = {
                c.name: pass_at_1(c.model, tok, c.policy, probs, n=rc.n, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                  max_new_tokens=rc.max_new_tokens, seed=p.seed, layout=p.layout)["pass_at_1"]
                for c in cands
                if not c.policy.oracle
            }

        out = {"policies": results, "budget": p.budget, "eval_tokens": eval_tokens, "eval_traces": len(fid_records),
               "mean_trace_tokens": sum(lengths) / len(lengths), "rollout_problems": len(problems), "rollouts_per_problem": rc.n}
        if benchmarks:
            out["benchmarks"] = benchmarks
        if other is not None:
            out["other_text"] = other
        if cfg.benchmarks.ruler.enabled:
            out["ruler"] = ruler_benchmark(p, args.base, Path(args.exports), tok, teacher, cands, say, device)
        write_json(args.out, out)
        with atomic_dir(args.summary) as tmp:  # whole: no policy's file left from an earlier run
            for stem, numbers in summary(out).items():
                write_json(tmp / f"{stem}.json", numbers)
        points = [{"budget": p.budget, "policy": n, **{k: v for k, v in m.items() if k not in ("occupancy_map", "per_trace")}}
                  for n, m in results.items()]
        # this run's points only: across budgets, DVC compares experiments (dvc plots diff <exp>...), from their own files
        write_json(plots / "budget_points.json", points)
        plot_memory_curve(curves, plots / "cache_memory.png")  # no lines where evaluate.memory_lengths is []
        say("keep map: which positions each layer's KV heads keep over the first held-out trace")
        plot_keep_maps(cands, fid_records[0], plots / "keep_map.png", layout=p.layout)
        by_name = {c.name: c.policy for c in cands}
        plot_occupancy({n: m["occupancy_map"] for n, m in results.items() if "occupancy_map" in m and by_name[n].evicts},
                       plots / "occupancy.png", title=f"entries held per layer and KV head at the traces' end, over the budget {p.budget}")
        # one child run per policy, same metric names in each: MLflow charts a metric across policies
        # and budgets; the parent keeps the stage's own figures and the artifacts
        for name, m in results.items():
            pol = by_name[name]
            kind = "ceiling" if pol.oracle else "trained" if pol.trained else "rule" if pol.evicts else "reference"
            with run.child(name, {"policy": name, **common}, tags={"policy": name, "kind": kind}) as child:
                child.metrics(m)
                for kind, by_policy in (other or {}).items():
                    if name in by_policy:
                        child.metrics(by_policy[name], prefix=f"other_text/{kind}/")
                if name in out.get("ruler", {}).get("policies", {}):  # ruler/<task>, ruler/mean, ruler/teacher_forced/<task>
                    r = out["ruler"]["policies"][name]
                    child.metrics(r["accuracy"], prefix="ruler/")
                    child.metrics(r["teacher_forced"], prefix="ruler/teacher_forced/")
        run.metrics({"budget": p.budget, "eval_tokens": eval_tokens})
        run.artifact(args.out)
        run.artifact(plots)

    print_table(out)  # the table goes to stdout, progress to stderr


if __name__ == "__main__":
    main()
