"""Prefill of the pooled engine (issue 33): a static rule's chunks in closed form against the per-query replay.

The pooled :class:`kvpop.decode.DecodeEngine` (``OnePool(kvpop_mlp)``, random scorer weights; ``dbtrimkv``
with ``--dbtrimkv``, replay only: its ranks decay) prefills one prompt of ``--context`` tokens from an empty
cache, batch 1, twice in the same run: with :meth:`kvpop.decode.pooled.PoolStore.compete_static` (one pass per
chunk of ``window`` tokens) and with the per-query replay (:meth:`PoolStore.update`, CUDA-graphed when
compiled). Prints the seconds of each, their ratio and the largest logit difference between the two
(the same decisions: float noise only). The bounded engine's prefill of the same prompt is the goal's
reference (``bench_decode.py --parts pooled``: ``prefill_ratio``).

    PYTHONPATH=src python bench/bench_pool_prefill.py                            # CUDA: Qwen3-4B arch, 32K tokens, budget 2,048
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
    twin.compete_static(q0, prio)
    sync(eng.device)
    t1 = time.perf_counter()
    orig = torch.arange(st.NS, device=eng.device).expand(eng.B, -1).clone()
    eng._pool_competitions(q0, prio, orig, torch.full_like(orig, NEVER))
    sync(eng.device)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens")
    ap.add_argument("--budget", type=int, default=None, help="default: 2,048 (384 with --small)")
    ap.add_argument("--small", action="store_true", help="the 4-layer Qwen3 of width 256 (also on the CPU)")
    ap.add_argument("--replay-context", type=int, default=None, help="the replay's prompt, if shorter (it is slow): a prefix; "
                    "both paths then time that prefix, and the closed form the whole prompt too")
    ap.add_argument("--dbtrimkv", action="store_true", help="also time dbtrimkv's prefill (the replay: decaying ranks)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = qwen3_4b_config(args.small)
    budget = args.budget or (384 if args.small else 2048)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, attn_implementation="sdpa").eval()
    mlp = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    for layer in mlp.scorer.layers:  # a scorer that ranks tokens (as bench_decode.py's)
        torch.nn.init.normal_(layer.w2, std=0.5)
    mlp.to(dev)
    layout = CacheLayout(budget, 4, 256)
    eng = DecodeEngine(model, pooled_policy("kvpop_mlp", model, mlp, dev), layout=layout, batch_size=1)
    ids = random_ids(1, args.context, cfg.vocab_size, 0, dev)
    short = ids[:, : args.replay_context or args.context]
    for closed in (True, False):  # warm-up: compiled pieces, the replay's CUDA graph
        timed_prefill(eng, short[:, : 2 * layout.sinks + 4 * layout.window], closed)
    t_closed, l_closed = timed_prefill(eng, short, True)
    t_replay, l_replay = timed_prefill(eng, short, False)
    diff = (l_closed - l_replay).abs().max().item()
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "model": "qwen3-small" if args.small else "Qwen3-4B arch",
           "budget": budget, "window": layout.window, "tokens": short.shape[1], "closed_form_s": round(t_closed, 3),
           "replay_s": round(t_replay, 3), "replay_over_closed": round(t_replay / t_closed, 2), "max_logit_diff": diff}
    print(f"OnePool(kvpop_mlp), {short.shape[1]} tokens, budget {budget}: closed form {t_closed:.2f} s, replay {t_replay:.2f} s "
          f"({t_replay / t_closed:.1f}x); logits differ by {diff:.1e}", flush=True)
    c_closed, c_replay = time_competitions(eng)
    out.update(chunk_competitions_closed_s=round(c_closed, 4), chunk_competitions_replay_s=round(c_replay, 4),
               competitions_replay_over_closed=round(c_replay / c_closed, 1))
    print(f"one chunk's {layout.window} competitions alone: closed form {c_closed * 1e3:.1f} ms, replay {c_replay * 1e3:.1f} ms "
          f"({c_replay / c_closed:.1f}x)", flush=True)
    if short.shape[1] < ids.shape[1]:
        t_full, _ = timed_prefill(eng, ids, True)
        out["closed_form_full_s"], out["full_tokens"] = round(t_full, 3), ids.shape[1]
        print(f"closed form, the whole {ids.shape[1]} tokens: {t_full:.2f} s", flush=True)
    if args.dbtrimkv:
        db = DecodeEngine(model, pooled_policy("dbtrimkv", model, mlp, dev), layout=layout, batch_size=1)
        timed_prefill(db, short[:, : 2 * layout.sinks + 4 * layout.window], False)
        out["dbtrimkv_replay_s"] = round(timed_prefill(db, short, False)[0], 3)
        print(f"dbtrimkv (replay), {short.shape[1]} tokens: {out['dbtrimkv_replay_s']:.2f} s", flush=True)
    write_result(args.out or default_out(__file__, small=args.small), out)


if __name__ == "__main__":
    main()
