"""Where one prefill chunk of the pooled engine spends its time (Qwen3-4B architecture, budget 2048, batch 1).

    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py                       # dbtrimkv -> results/profile_pool_prefill/h200.json
    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py --policy kvpop_mlp    # OnePool(kvpop_mlp): the static closed form
    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py --small --out /tmp/p.json   # a tiny Qwen3, runs on the CPU too
    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py --narrow --ops --policy kvpop_mlp   # the CPU: operations per chunk at 36 layers
    PYTHONPATH=src python3 bench/kernels/profile_pool_prefill.py --context 32768 --chunk-graphs --timeline   # bench_decode.py's 32K prompt

The engine is prefilled to ``--context`` tokens (chunks of ``window``), then ``--chunks`` more chunks run under
the profiler with host and device activities: the table (sorted by the host's total, which holds the waits of
every host synchronization, and by the device's) says what a chunk costs besides its attention and GEMMs.
Prints the seconds per chunk (mean over the profiled ones) and writes them, the settings and both tables
(text, under ``"table_host"`` and ``"table_device"``) through :func:`kvpop.provenance.write_result`, with the
chunk's phases (the engine's ``kvpop.prefill.*`` ranges: competitions, entry lists, layers, store), host and
device milliseconds of each per chunk (``"phases"``).
``--timeline``: the prompt up to ``--context`` (bench_decode.py's prompt of that length) is prefilled chunk by chunk,
synchronized after each: every chunk's seconds and the CUDA graphs it captured (``--chunk-graphs``: a layer's graph
per width of its fullest head, :meth:`DecodeEngine._pool_chunk_layers_static`), ``"first_s"`` their sum; then again
whole from an empty cache, as bench_decode.py times it (``"prefill_s"``: the same widths, no new graph).
``--ops``: one more chunk counted operation by operation (:class:`OpCount`: the aten operations that do work,
views not counted; eagerly each is about one kernel launch on CUDA, the host's cost there), by part of the chunk
(``"ops_per_chunk"``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from kvpop.benchmarking import OpCount, default_out, pooled_policy, qwen3_4b_config, random_ids, sync
from kvpop.decode import engine
from kvpop.decode.engine import DecodeEngine
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.provenance import write_result


def count_ops(eng: DecodeEngine, ids: torch.Tensor) -> dict[str, int]:
    """Operations of one prefill chunk ids (B, window), by part: the competitions, the entries' preparation,
    each layer's projections, attention and MLP, the leavers' scores, the rest (embedding, ring writes)."""
    counter = OpCount()
    st = eng.store
    for obj, name, label in [(st, "compete_static", "competitions"), (st, "compete_decaying", "competitions"),
                             (eng, "_pool_competitions", "competitions"), (eng, "_pool_chunk_entries", "entries"),
                             (eng, "_pool_chunk_attend", "attention"), (eng, "_chunk_qkv", "projections"),
                             (eng, "_finish_layer", "mlp"), (eng, "_leaver_prio", "leaver_scores")]:
        counter.part(obj, name, label)
    try:
        with counter:
            eng.prefill(ids)
    finally:
        counter.restore()
    return {**dict(counter.counts), "total": sum(counter.counts.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None, help="default: results/profile_pool_prefill/<device>[_small].json")
    ap.add_argument("--small", action="store_true", help="a tiny Qwen3 and a short context (smoke test; CPU or CUDA)")
    ap.add_argument("--narrow", action="store_true", help="Qwen3-4B's 36 layers and 32 / 8 heads at width 256, head dim 16: the pool at "
                    "full size, the model's arithmetic small (the CPU)")
    ap.add_argument("--ops", action="store_true", help="also count one more chunk's operations by part (views aside)")
    ap.add_argument("--policy", default="dbtrimkv", help="dbtrimkv (a random gate: decaying ranks) or kvpop_mlp (OnePool of a random scorer)")
    ap.add_argument("--context", type=int, default=4096, help="tokens prefilled before the profiled chunks")
    ap.add_argument("--chunks", type=int, default=2, help="chunks of `window` tokens profiled")
    ap.add_argument("--replay", action="store_true", help="the chunk's competitions replayed query by query (the closed form's twin)")
    ap.add_argument("--chunk-graphs", action="store_true", help="each whole chunk's layers as CUDA graphs (DecodeEngine(chunk_graphs=True), "
                    "bench_decode.py --chunk-graphs)")
    ap.add_argument("--chunk-attention", choices=("flex", "sdpa"), default="flex",
                    help="the compiled engine's chunk attention (kvpop.decode.engine.POOL_CHUNK_ATTENTION; the uncompiled engine's: sdpa)")
    ap.add_argument("--timeline", action="store_true", help="time the prefill to --context chunk by chunk (graphs captured in each), "
                    "then whole again")
    ap.add_argument("--decay-block", type=int, default=None, help="decaying ranks (dbtrimkv): queries per candidate list of a chunk's "
                    "competitions (PoolStore.decay_block; default: the store's)")
    args = ap.parse_args()
    if args.decay_block is not None and args.decay_block < 1:
        ap.error(f"--decay-block must be >= 1, got {args.decay_block}")
    if args.chunks < 1 or args.context < 0:
        ap.error(f"--chunks must be >= 1 and --context >= 0, got {args.chunks} and {args.context}")
    if args.small and args.narrow:
        ap.error("--small and --narrow are two different models: pick one")
    out = args.out or default_out(__file__, small=args.small, suffix="narrow" if args.narrow else "")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.ops and dev.type == "cuda":
        ap.error("--ops counts the eager engine's operations (a compiled piece would not be counted as it runs): run it on the CPU")
    cfg = qwen3_4b_config(args.small, args.narrow)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    scorer = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim).to(dev)
    policy = pooled_policy(args.policy, model, scorer, dev)
    budget, window = (2048, 256) if not args.small else (96, 32)
    context = args.context if not args.small else min(args.context, 256)
    engine.POOL_CHUNK_ATTENTION = args.chunk_attention
    eng = DecodeEngine(model, policy, layout=CacheLayout(budget, 4, window), batch_size=1, chunk_graphs=args.chunk_graphs)
    eng.pool_closed_form = not args.replay
    if args.decay_block is not None:
        eng.store.decay_block = args.decay_block
    seed = context if args.timeline else 0  # bench_decode.py's prompt of that length
    ids = random_ids(1, context + (args.chunks + args.ops) * window, cfg.vocab_size, seed, dev)
    extra = {}
    if args.timeline:
        eng.prefill(random_ids(1, min(1024, context), cfg.vocab_size, 0, dev))  # compiled pieces warm (bench_decode.py's warm-up)
        eng.reset()
        secs, graphs = [], []
        for c0 in range(0, context, eng.pool_chunk):
            n0, t0 = len(eng._layer_graphs), time.perf_counter()
            eng.prefill(ids[:, c0 : min(context, c0 + eng.pool_chunk)])
            sync(dev)
            secs.append(round(time.perf_counter() - t0, 4))
            graphs.append(len(eng._layer_graphs) - n0)
        eng.reset()
        extra = {"first_s": round(sum(secs), 3), "graphs_captured": sum(graphs), "timeline": {"s": secs, "graphs": graphs}}
    t0 = time.perf_counter()
    eng.prefill(ids[:, :context])
    sync(dev)
    warm_s = time.perf_counter() - t0
    if args.timeline:
        extra["prefill_s"] = round(warm_s, 3)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for c in range(args.chunks):
            eng.prefill(ids[:, context + c * window : context + (c + 1) * window])
        sync(dev)
        chunk_s = (time.perf_counter() - t0) / args.chunks
    avg = prof.key_averages()
    dev_total = lambda e: getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)  # noqa: E731
    extra["phases"] = {e.key: {"host_ms": round(e.cpu_time_total / 1e3 / args.chunks, 3), "device_ms": round(dev_total(e) / 1e3 / args.chunks, 3)}
                       for e in avg if e.key.startswith("kvpop.prefill.")}  # per chunk
    host = avg.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    device = avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70) if dev.type == "cuda" else ""
    head = (f"{args.policy} ({'replayed' if args.replay else 'one pass'}{', chunk graphs' if args.chunk_graphs else ''}, "
            f"{args.chunk_attention if eng.compiled else 'sdpa'} attention): {chunk_s:.3f} s per "
            f"{window}-token chunk after {context} tokens (the prefill to there: {warm_s:.1f} s, {context / window:.0f} chunks"
            + (f"; the first time {extra['first_s']:.1f} s, {extra['graphs_captured']} graphs captured)" if args.timeline else ")"))
    print(head + "\n" + host + "\n" + device)
    for name, p in extra["phases"].items():
        print(f"  {name:<24} host {p['host_ms']:8.2f} ms  device {p['device_ms']:8.2f} ms per chunk")
    if args.ops:
        c0 = context + args.chunks * window
        extra["ops_per_chunk"] = count_ops(eng, ids[:, c0 : c0 + window])
        print("operations of one more chunk, by part (views aside):", extra["ops_per_chunk"])
    model_name = "qwen3-small" if args.small else "Qwen3-4B's layers and heads at width 256, head dim 16" if args.narrow else "Qwen3-4B architecture"
    write_result(out, {"what": f"one prefill chunk of the pooled engine ({args.policy}) under the profiler, host and device",
                       "model": model_name + " (random weights)", "policy": args.policy,
                       "one_pass": not args.replay, "chunk_graphs": args.chunk_graphs, "chunk_attention": args.chunk_attention if eng.compiled else "sdpa",
                       "budget": budget, "window": window, "context": context, "decay_block": eng.store.decay_block if eng.store.decays else None,
                       "chunks": args.chunks,
                       "s_per_chunk": round(chunk_s, 4), "prefill_to_context_s": round(warm_s, 2), "summary": head,
                       "table_host": host, "table_device": device, **extra})


if __name__ == "__main__":
    main()
