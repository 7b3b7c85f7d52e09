"""Where one decode step's extra time goes: two ``profile_decode.py`` results (their ``kernels`` lists) side by side.

The kernels are grouped by what they are (the attention, the GEMMs, ``topk`` and sorts, the fused elementwise
kernels, copies and the rest) and by how often they run per step (once per layer or otherwise: the pooled step's
competition and the head run a fixed number of times a step, whatever the layers). Prints, per group, microseconds
and launches per step in each profile and their difference, then the kernels whose time differs most, and the wall
time against the GPU's busy time (the gaps between kernels). Reads files only; no GPU needed.

    python bench/kernels/compare_profiles.py profile_bounded.json profile_pooled_dbtrimkv.json
    python bench/kernels/compare_profiles.py profile_pooled.json profile_split32.json --layers 36 --top 15
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: what a kernel is, by a part of its name (first match wins)
GROUPS = (
    ("attention", ("flex_attention", "flash", "fmha", "sdpa")),
    ("gemm", ("nvjet", "gemm", "gemv", "cublas", "cutlass", "splitkreduce", "bmm", "mm_")),
    ("topk / sort", ("topk", "sort", "radix", "scan_by_key", "digitcumsum", "digitcounts", "withinkcounts")),
    ("fused (triton)", ("triton_",)),
    ("copy / fill", ("memcpy", "memset", "copy", "fill", "cat")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: cannot read a profile_decode.py result ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list) or "ms_per_step" not in data:
        raise SystemExit(f"{path}: not a profile_decode.py result with a kernel list (its 'kernels' and 'ms_per_step')")
    return data


def summarize(kernels: list[dict], layers: int) -> dict[tuple[str, str], tuple[float, float]]:
    """(group, "per layer" | "per step") -> (us per step, launches per step)."""
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for k in kernels:
        calls = float(k["calls_per_step"])
        where = "per layer" if layers and calls >= layers and calls % layers == 0 else "per step"
        key = (group_of(k["name"]), where)
        us, n = out.get(key, (0.0, 0.0))
        out[key] = (us + float(k["us_per_step"]), n + calls)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path, help="the reference profile (e.g. the bounded engine's)")
    ap.add_argument("other", type=Path, help="the profile compared with it (e.g. the pooled engine's)")
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (a kernel run a multiple of this many times a step counts as per layer)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed whose time differs most")
    args = ap.parse_args()
    if args.layers < 0 or args.top < 0:
        ap.error(f"--layers and --top must be >= 0, got {args.layers} and {args.top}")
    a, b = load(args.base), load(args.other)
    sa, sb = summarize(a["kernels"], args.layers), summarize(b["kernels"], args.layers)
    print(f"{'':28} {args.base.name:>24} {args.other.name:>24} {'difference':>22}")
    print(f"{'ms per step (wall)':28} {a['ms_per_step']:>24.3f} {b['ms_per_step']:>24.3f} {b['ms_per_step'] - a['ms_per_step']:>+22.3f}")
    busy = [sum(k["us_per_step"] for k in d["kernels"]) / 1e3 for d in (a, b)]
    print(f"{'GPU busy ms per step':28} {busy[0]:>24.3f} {busy[1]:>24.3f} {busy[1] - busy[0]:>+22.3f}")
    gaps = [d["ms_per_step"] - x for d, x in zip((a, b), busy, strict=True)]
    print(f"{'gaps ms per step':28} {gaps[0]:>24.3f} {gaps[1]:>24.3f} {gaps[1] - gaps[0]:>+22.3f}")
    print(f"\n{'group (us / launches a step)':28} {'':>24} {'':>24}")
    for key in sorted(set(sa) | set(sb), key=lambda k: -abs(sb.get(k, (0, 0))[0] - sa.get(k, (0, 0))[0])):
        (ua, na), (ub, nb) = sa.get(key, (0.0, 0.0)), sb.get(key, (0.0, 0.0))
        label = f"{key[0]}, {key[1]}"
        print(f"{label:28} {ua:>15.1f} / {na:>6.0f} {ub:>15.1f} / {nb:>6.0f} {ub - ua:>+13.1f} / {nb - na:>+6.0f}")
    ka = {k["name"]: k for k in a["kernels"]}
    kb = {k["name"]: k for k in b["kernels"]}
    diffs = sorted(set(ka) | set(kb), key=lambda n: -abs(kb.get(n, {}).get("us_per_step", 0) - ka.get(n, {}).get("us_per_step", 0)))
    print(f"\nkernels whose time differs most (us per step: {args.base.name} -> {args.other.name})")
    for name in diffs[: args.top]:
        ua, ub = ka.get(name, {}).get("us_per_step", 0.0), kb.get(name, {}).get("us_per_step", 0.0)
        na, nb = ka.get(name, {}).get("calls_per_step", 0), kb.get(name, {}).get("calls_per_step", 0)
        print(f"  {ua:9.1f} ({na:5.1f}x) -> {ub:9.1f} ({nb:5.1f}x)  {name[:100]}")


if __name__ == "__main__":
    main()
