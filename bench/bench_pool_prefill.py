"""Prefill of the pooled engine (issue 33): a chunk's competitions in one pass against the per-query replay.

The pooled :class:`kvpop.decode.DecodeEngine` (``--policies``: ``OnePool(kvpop_mlp)`` with random scorer
weights, ``dbtrimkv`` with a random gate) prefills one prompt of ``--context`` tokens from an empty cache,
batch 1, twice in the same run: with the chunk's competitions in one pass
(:meth:`kvpop.decode.pooled.PoolStore.compete_static` for the static rule, ``compete_decaying``'s candidate
list for dbtrimkv) and with the per-query replay (:meth:`PoolStore.update`, one CUDA graph per query when
compiled), then times one chunk's competitions alone both ways. Prints the seconds, their ratios and the
largest logit difference between the two paths (the same decisions: float noise only). The bounded
engine's prefill of the same prompt is the goal's reference (``bench_decode.py --parts pooled``:
``prefill_ratio``).

    PYTHONPATH=src python bench/bench_pool_prefill.py --replay-context 8192      # CUDA: Qwen3-4B arch, 32K tokens, budget 2,048
    PYTHONPATH=src python bench/bench_pool_prefill.py --small --context 2048     # CPU: the 4-layer Qwen3, budget 384

``--out`` defaults to ``results/bench_pool_prefill/<device>[_small].json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvpop.benchmarking import default_out, pooled_policy, qwen3_4b_config, random_ids, sync
from kvpop.decode import DecodeEngine
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.provenance import write_result
from kvpop.selection import NEVER


def timed_prefill(eng: DecodeEngine, ids: torch.Tensor, closed: bool) -> tuple[float, torch.Tensor]:
    eng.reset()
    eng.pool_closed_form = closed
    sync(eng.device)
    t0 = time.perf_counter()
    logits = eng.prefill(ids)
    sync(eng.device)
    return time.perf_counter() - t0, logits


def time_competitions(eng: DecodeEngine) -> tuple[float, float]:
    """Seconds of one chunk's competitions alone (the next ``window`` queries' leavers, from the engine's
    state after its prefill): closed form, then the replay (the engine's own, CUDA-graphed when compiled)."""
    import copy

    st, w, q0 = eng.store, eng.window, eng.seen
    prio = eng._leaver_prio(torch.arange(q0 - w, q0, device=eng.device))  # (B, F, window)
    twin = copy.deepcopy(st)  # the closed form's copy; the replay runs on the engine's own store (its CUDA graph's buffers)
    sync(eng.device)
    t0 = time.perf_counter()
    (twin.compete_decaying if twin.decays else twin.compete_static)(q0, prio)
    sync(eng.device)
    t1 = time.perf_counter()
    orig = torch.arange(st.NS, device=eng.device).expand(eng.B, -1).clone()
    eng._pool_competitions(q0, prio, orig, torch.full_like(orig, NEVER))
    sync(eng.device)
    return t1 - t0, time.perf_counter() - t1


def chunk_list(st) -> tuple[int, int, str]:
    """The last chunk's candidate list: ``(listed, of, what)``: a static rule's pool entries of the pool's slots
    (its leavers all listed), decaying ranks' longest list of one block, of the candidates of the chunk's list present in it."""
    if st.decays:
        (m0, total), blocks = st.chunk_lists[0], st.chunk_lists[1:]
        m, of = max(blocks)
        return m, of, (f"candidates present of the chunk's list (the longest of {len(blocks)} blocks of {st.decay_block} queries; "
                       f"the chunk's list: {m0} of {total} candidates)")
    m, of = max(st.chunk_lists)
    return m, of, "pool slots, and every leaver"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--budget", type=int, default=None, help="default: 2,048 (384 with --small)")
    ap.add_argument("--small", action="store_true", help="the 4-layer Qwen3 of width 256 (also on the CPU)")
    ap.add_argument("--narrow", action="store_true", help="Qwen3-4B's 36 layers and 32 / 8 heads at width 256, head dim 16: the pool's "
                    "bookkeeping at full size (budget 2,048: 515,808 pool slots), the model's arithmetic small (the CPU)")
    ap.add_argument("--replay-context", type=int, default=None, help="the replay's prompt, if shorter (it is slow): a prefix; "
                    "both paths then time that prefix, and the closed form the whole prompt too")
    ap.add_argument("--policies", default="kvpop_mlp,dbtrimkv", help="one-pool policies (kvpop_mlp: OnePool(kvpop_mlp))")
    ap.add_argument("--decay-block", type=int, default=None, help="decaying ranks (dbtrimkv): queries per candidate list of a chunk "
                    "(PoolStore.decay_block; default: the store's)")
    ap.add_argument("--chunk-graphs", action="store_true", help="each whole chunk's layers on static buffers, CUDA graphs when compiled "
                    "(DecodeEngine(chunk_graphs=True))")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.decay_block is not None and args.decay_block < 1:
        ap.error(f"--decay-block must be >= 1, got {args.decay_block}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.small and args.narrow:
        ap.error("--small and --narrow are two different models: pick one")
    cfg = qwen3_4b_config(args.small, args.narrow)
    budget = args.budget or (384 if args.small else 2048)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, attn_implementation="sdpa").eval()
    mlp = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    for layer in mlp.scorer.layers:  # a scorer that ranks tokens (as bench_decode.py's)
        torch.nn.init.normal_(layer.w2, std=0.5)
    mlp.to(dev)
    layout = CacheLayout(budget, 4, 256)
    ids = random_ids(1, args.context, cfg.vocab_size, 0, dev)
    short = ids[:, : args.replay_context or args.context]
    arch = "qwen3-small" if args.small else "Qwen3-4B's layers and heads at width 256, head dim 16" if args.narrow else "Qwen3-4B arch"
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "model": arch,
           "budget": budget, "window": layout.window, "tokens": short.shape[1], "rows": []}
    for name in args.policies.split(","):
        eng = DecodeEngine(model, pooled_policy(name, model, mlp, dev), layout=layout, batch_size=1, chunk_graphs=args.chunk_graphs)
        if args.decay_block is not None:
            eng.store.decay_block = args.decay_block
        for closed in (True, False):  # warm-up: compiled pieces, the replay's CUDA graph
            timed_prefill(eng, short[:, : 2 * layout.sinks + 4 * layout.window], closed)
        t_closed, l_closed = timed_prefill(eng, short, True)
        listed = chunk_list(eng.store)
        t_replay, l_replay = timed_prefill(eng, short, False)
        diff = (l_closed - l_replay).abs().max().item()
        c_closed, c_replay = time_competitions(eng)
        row = {"policy": name, "closed_form_s": round(t_closed, 3), "replay_s": round(t_replay, 3), "replay_over_closed": round(t_replay / t_closed, 2),
               "max_logit_diff": diff, "chunk_competitions_closed_s": round(c_closed, 4), "chunk_competitions_replay_s": round(c_replay, 4),
               "competitions_replay_over_closed": round(c_replay / c_closed, 1), "last_chunk_list": listed,
               "decay_block": eng.store.decay_block if eng.store.decays else None, "chunk_graphs": args.chunk_graphs}
        print(f"{name}, {short.shape[1]} tokens, budget {budget}: prefill closed form {t_closed:.2f} s, replay {t_replay:.2f} s "
              f"({t_replay / t_closed:.1f}x; logits differ by {diff:.1e}); one chunk's {layout.window} competitions alone "
              f"{c_closed * 1e3:.1f} ms vs {c_replay * 1e3:.1f} ms ({c_replay / c_closed:.1f}x)"
              + f"; the last chunk listed {listed[0]:,} of {listed[1]:,} {listed[2]}", flush=True)
        if short.shape[1] < ids.shape[1]:
            t_full, _ = timed_prefill(eng, ids, True)
            row["closed_form_full_s"], row["full_tokens"] = round(t_full, 3), ids.shape[1]
            print(f"{name}, closed form, the whole {ids.shape[1]} tokens: {t_full:.2f} s", flush=True)
        out["rows"].append(row)
        del eng
    write_result(args.out or default_out(__file__, small=args.small, suffix="narrow" if args.narrow else ""), out)


if __name__ == "__main__":
    main()
