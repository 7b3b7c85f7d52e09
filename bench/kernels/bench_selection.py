"""Benchmark of the selection, the BlockMask build, sparse attention and the target pass on a GPU.

Qwen3-4B attention shapes (32 query heads, 8 KV heads, head_dim 128), bf16, B=1, one document per
row, budget 12.5% of S (sinks 4 + window 256 + learned top-k with random priorities, the worst case
for block sparsity). Times are medians of several reps after warm-ups, measured with CUDA events.

    PYTHONPATH=src python3 bench/kernels/bench_selection.py           # -> results/bench_selection/h200.json
    PYTHONPATH=src python3 bench/kernels/bench_selection.py --small   # CPU smoke test, tiny sizes -> results/bench_selection/cpu_small.json

Written through :func:`kvpop.provenance.write_result` after every size (a partial run leaves numbers).

Rows (ratio = baseline / ours, > 1 means ours is faster, except (iv) where it is target / sparse):
  (i)   eviction_times (wavelet matrix)          vs brute-force per-query top-k (chunked); on CUDA with
        Triton also vs the same call with the order statistic's tensor twin (kernels vs twin; the
        library's default on CUDA is the kernels, KVPOP_SELECTION_KERNELS=0 runs the twins)
  (ii)  block_mask_from_eviction_times           vs create_block_mask(_compile=True), same mask_mod; on CUDA
        with Triton also vs the same call with the block lists' tensor twin
  (iii) flex + our BlockMask, fwd+bwd            vs SDPA is_causal, flex causal (fwd+bwd)
  (iv)  future_attention_target (flex, chunked)  vs the sparse fwd+bwd
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from unittest import mock

import torch
from torch.nn import functional as F

from kvpop.attention import flex_execute
from kvpop.benchmarking import default_out, time_calls
from kvpop.kernels import SELECTION_KERNELS_ENV, selection_kernels_enabled
from kvpop.masks import block_mask_from_eviction_times, make_eviction_mask_mod
from kvpop.provenance import device_name, versions, write_result
from kvpop.selection import eviction_times
from kvpop.target import future_attention_target

# the library's selection on its tensor twins inside the block (its own switch, read at every call)
TENSOR_TWINS = mock.patch.dict(os.environ, {SELECTION_KERNELS_ENV: "0"})


def timeit(fn, *, warmup: int, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` (:func:`kvpop.benchmarking.time_calls`: CUDA events on CUDA)."""
    return time_calls(fn, warmup=warmup, reps=reps, cuda=cuda).median


def brute_force_topk(prio, pos, *, sinks: int, window: int, k: int, q_chunk: int, chunks: list[int]):
    """Per-query top-k over the eligible tokens (pos >= sinks, t <= q - window), for the given query chunks."""
    S = prio.shape[2]
    t = torch.arange(S, device=prio.device)
    elig_t = pos[0] >= sinks
    out = []
    for c in chunks:
        q = torch.arange(c * q_chunk, min(S, (c + 1) * q_chunk), device=prio.device)
        ok = (t[None, :] <= q[:, None] - window) & elig_t[None, :]  # (Qc, S)
        sc = prio[0][:, None, :].masked_fill(~ok[None], float("-inf"))  # (Hk, Qc, S)
        out.append(sc.topk(k, dim=-1).indices)
    return out


def bench_size(S: int, args, dev: str, res: dict) -> dict:
    cuda = dev == "cuda"
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    dtype = torch.bfloat16 if cuda else torch.float32
    sinks, window = 4, args.window
    budget = S // 8
    k = budget - sinks - window
    W, R = args.warmup, args.reps
    g = torch.Generator(device="cpu").manual_seed(0)
    doc = torch.zeros(1, S, dtype=torch.int64, device=dev)
    pos = torch.arange(S, device=dev)[None]
    prio = torch.rand(1, Hk, S, generator=g).to(dev)
    row = {"S": S, "budget": budget, "sinks": sinks, "window": window, "k": k}
    print(f"--- S={S}: budget {budget} (sinks {sinks}, window {window}, k {k}), H={H} Hk={Hk} D={D} {dtype}", flush=True)

    # (i) cutoffs; on CUDA with Triton the order statistic runs as two kernels (kvpop.kernels.order),
    # timed here beside its tensor twin (the same call under KVPOP_SELECTION_KERNELS=0)
    t_ours = timeit(lambda: eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k), warmup=W, reps=R, cuda=cuda)
    row["i_order_statistic"] = "triton kernels" if cuda and selection_kernels_enabled() else "tensor twin"
    if row["i_order_statistic"] == "triton kernels":
        with TENSOR_TWINS:
            t_twin = timeit(lambda: eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k), warmup=W, reps=R, cuda=cuda)
            e_twin = eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k)
        row["i_kernels_equal_twin"] = torch.equal(e_twin, eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k))
        row["i_eviction_times_tensor_twin_s"] = t_twin
        row["i_kernel_speedup"] = t_twin / t_ours
        print(f"(i) eviction_times with the order statistic's tensor twin {t_twin * 1e3:.2f} ms: the kernels {t_twin / t_ours:.2f}x", flush=True)
    n_chunks = math.ceil(S / args.q_chunk)
    if n_chunks > args.max_bf_chunks:  # time an evenly spread subset of chunks and extrapolate
        step = n_chunks / args.max_bf_chunks
        sub = sorted({int(i * step) for i in range(args.max_bf_chunks)})
    else:
        sub = list(range(n_chunks))
    t_sub = timeit(lambda: brute_force_topk(prio, pos, sinks=sinks, window=window, k=k, q_chunk=args.q_chunk, chunks=sub),
                   warmup=1, reps=max(1, R // 2), cuda=cuda)
    t_bf = t_sub * n_chunks / len(sub)
    row["i_eviction_times_s"] = t_ours
    row["i_bruteforce_topk_s"] = t_bf
    row["i_bruteforce_chunks_timed"] = f"{len(sub)}/{n_chunks} of {args.q_chunk} queries" + (" (extrapolated)" if len(sub) < n_chunks else "")
    row["i_ratio"] = t_bf / t_ours
    print(f"(i) eviction_times {t_ours * 1e3:.2f} ms, brute force {t_bf * 1e3:.1f} ms ({row['i_bruteforce_chunks_timed']})", flush=True)

    evict = eviction_times(prio, doc, pos, sinks=sinks, window=window, long_range=k)

    # (ii) BlockMask build
    t_bm = timeit(lambda: block_mask_from_eviction_times(doc, pos, evict, sinks=sinks, num_heads=H), warmup=W, reps=R, cuda=cuda)
    bm = block_mask_from_eviction_times(doc, pos, evict, sinks=sinks, num_heads=H)
    row["ii_blockmask_ours_s"] = t_bm
    if cuda and selection_kernels_enabled():  # the block lists from the kernel (kvpop.kernels.blockmask) vs its tensor twin
        with TENSOR_TWINS:
            t_twin = timeit(lambda: block_mask_from_eviction_times(doc, pos, evict, sinks=sinks, num_heads=H), warmup=W, reps=R, cuda=cuda)
            twin = block_mask_from_eviction_times(doc, pos, evict, sinks=sinks, num_heads=H)
        row["ii_blockmask_kernel_equal_twin"] = all(torch.equal(getattr(twin, n), getattr(bm, n)) for n in ("kv_num_blocks", "kv_indices",
                                                                                                           "full_kv_num_blocks", "full_kv_indices"))
        row["ii_blockmask_tensor_twin_s"] = t_twin
        row["ii_kernel_speedup"] = t_twin / t_bm
        print(f"(ii) BlockMask with the block lists' tensor twin {t_twin * 1e3:.2f} ms: the kernel {t_twin / t_bm:.2f}x", flush=True)
    row["block_sparsity_pct"] = float(bm.sparsity()) if hasattr(bm, "sparsity") else None
    if not args.skip_create_block_mask:
        from torch.nn.attention.flex_attention import create_block_mask

        mm = make_eviction_mask_mod(doc, pos, evict, sinks=sinks, group=H // Hk)
        t_cbm = timeit(lambda: create_block_mask(mm, 1, H, S, S, device=dev, _compile=cuda), warmup=1, reps=3, cuda=cuda)
        ref = create_block_mask(mm, 1, H, S, S, device=dev, _compile=cuda)
        same = torch.equal(ref.to_dense(), bm.to_dense())
        row["ii_create_block_mask_s"] = t_cbm
        row["ii_ratio"] = t_cbm / t_bm
        row["ii_same_blocks"] = same
        print(f"(ii) ours {t_bm * 1e3:.2f} ms, create_block_mask {t_cbm * 1e3:.1f} ms, same non-empty blocks: {same}", flush=True)
    else:
        print(f"(ii) ours {t_bm * 1e3:.2f} ms", flush=True)
    print(f"     block sparsity of our BlockMask (percent of blocks skipped): {row['block_sparsity_pct']}", flush=True)

    # (iii) attention forward+backward
    scale = D**-0.5
    q = torch.randn(1, H, S, D, device=dev, dtype=dtype, requires_grad=True)
    kk = torch.randn(1, Hk, S, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, Hk, S, D, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn(1, H, S, D, device=dev, dtype=dtype)

    def zero():
        q.grad = kk.grad = v.grad = None

    def sparse_fb():
        zero()
        out, _ = flex_execute(q, kk, v, bm, scale, need_lse=False)
        out.backward(do)

    if cuda:
        t_sp = timeit(sparse_fb, warmup=W, reps=R, cuda=cuda)
        row["iii_sparse_flex_fwd_bwd_s"] = t_sp

        def sdpa_fb():
            zero()
            F.scaled_dot_product_attention(q, kk, v, is_causal=True, scale=scale, enable_gqa=True).backward(do)

        t_sdpa = timeit(sdpa_fb, warmup=W, reps=R, cuda=cuda)
        from torch.nn.attention.flex_attention import create_block_mask

        causal_bm = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, S, S, device=dev)

        def flex_causal_fb():
            zero()
            out, _ = flex_execute(q, kk, v, causal_bm, scale, need_lse=False)
            out.backward(do)

        t_fc = timeit(flex_causal_fb, warmup=W, reps=R, cuda=cuda)
        row["iii_sdpa_causal_fwd_bwd_s"] = t_sdpa
        row["iii_flex_causal_fwd_bwd_s"] = t_fc
        row["iii_ratio_vs_sdpa"] = t_sdpa / t_sp
        row["iii_ratio_vs_flex_causal"] = t_fc / t_sp
        print(f"(iii) sparse {t_sp * 1e3:.2f} ms, SDPA causal {t_sdpa * 1e3:.2f} ms, flex causal {t_fc * 1e3:.2f} ms", flush=True)
    else:  # FlexAttention has no backward on CPU: forward only
        t_sp = timeit(lambda: flex_execute(q.detach(), kk.detach(), v.detach(), bm, scale, need_lse=False), warmup=1, reps=1, cuda=False)
        row["iii_sparse_flex_fwd_only_cpu_s"] = t_sp
        print(f"(iii) CPU: sparse flex forward only {t_sp * 1e3:.1f} ms", flush=True)

    # (iv) target pass
    with torch.no_grad():
        _, lse = flex_execute(q.detach(), kk.detach(), v.detach(), bm, scale, need_lse=True)
    for impl in (["flex", "chunked"] if cuda else ["chunked"]):
        t_t = timeit(lambda impl=impl: future_attention_target(q.detach(), kk.detach(), lse, doc, window=window, scale=scale, impl=impl),
                     warmup=max(1, W - 1), reps=max(2, R // 2), cuda=cuda)
        row[f"iv_target_{impl}_s"] = t_t
        row[f"iv_ratio_{impl}_over_sparse"] = t_t / t_sp
        print(f"(iv) target {impl} {t_t * 1e3:.2f} ms = {t_t / t_sp:.2f}x the sparse fwd+bwd", flush=True)
    res["sizes"].append(row)
    return row


def print_table(res: dict) -> None:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.2f} ms"

    def rx(x):
        return "-" if x is None else f"{x:.1f}x"

    lines = [f"{'comparison':<58}" + "".join(f"{'S=' + str(r['S']):>34}" for r in res["sizes"])]

    def line(label, f):
        lines.append(f"{label:<58}" + "".join(f"{f(r):>34}" for r in res["sizes"]))

    g = lambda r, key: r.get(key)  # noqa: E731
    line("(i) brute-force top-k / eviction_times", lambda r: f"{rx(g(r, 'i_ratio'))} ({ms(g(r, 'i_bruteforce_topk_s'))} / {ms(g(r, 'i_eviction_times_s'))})")
    def ratio(key: str, num: str, den: str):
        return lambda r: f"{rx(g(r, key))} ({ms(g(r, num))} / {ms(g(r, den))})"

    line("(ii) create_block_mask(compiled) / ours", ratio("ii_ratio", "ii_create_block_mask_s", "ii_blockmask_ours_s"))
    line("(iii) SDPA causal / sparse flex (fwd+bwd)", ratio("iii_ratio_vs_sdpa", "iii_sdpa_causal_fwd_bwd_s", "iii_sparse_flex_fwd_bwd_s"))
    line("(iii) flex causal / sparse flex (fwd+bwd)", ratio("iii_ratio_vs_flex_causal", "iii_flex_causal_fwd_bwd_s", "iii_sparse_flex_fwd_bwd_s"))
    line("(iv) target flex / sparse fwd+bwd", lambda r: f"{rx(g(r, 'iv_ratio_flex_over_sparse'))} ({ms(g(r, 'iv_target_flex_s'))})")
    line("(iv) target chunked / sparse fwd+bwd", lambda r: f"{rx(g(r, 'iv_ratio_chunked_over_sparse'))} ({ms(g(r, 'iv_target_chunked_s'))})")
    line("block sparsity of our BlockMask (% skipped)", lambda r: "-" if g(r, "block_sparsity_pct") is None else f"{g(r, 'block_sparsity_pct'):.1f}%")
    print(f"\n{device_name()}, torch {versions().get('torch')}; Qwen3-4B shapes H={res['config']['heads']} "
          f"Hk={res['config']['kv_heads']} D={res['config']['head_dim']} {res['config']['dtype']} B=1, budget S/8")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--q-chunk", type=int, default=512, help="queries per brute-force top-k chunk")
    ap.add_argument("--max-bf-chunks", type=int, default=32, help="time at most this many chunks, extrapolate the rest")
    ap.add_argument("--skip-create-block-mask", action="store_true")
    ap.add_argument("--small", action="store_true", help="CPU smoke test: tiny sizes")
    ap.add_argument("--out", default=None, help="default: results/bench_selection/<device>[_small].json")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.small:
        args.sizes, args.heads, args.kv_heads, args.head_dim = [1024, 2048], 4, 2, 16
        args.window, args.warmup, args.reps, args.q_chunk, args.max_bf_chunks = 64, 1, 2, 256, 4
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    res = {
        "config": {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "dtype": "bfloat16" if dev == "cuda" else "float32", "batch": 1, "budget": "S/8",
                   "priorities": "uniform random (worst case for block sparsity)", "warmup": args.warmup,
                   "reps": args.reps, "statistic": "median", "timer": "CUDA events" if dev == "cuda" else "perf_counter"},
        "sizes": [],
    }
    out = Path(args.out) if args.out else default_out(__file__, small=args.small)
    for S in args.sizes:
        bench_size(S, args, dev, res)
        write_result(out, res)  # after every size, so partial runs leave numbers
        if dev == "cuda":
            torch.cuda.empty_cache()
    print_table(res)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
