"""Time to the first decoded token: compiling cold, compiling from a warm cache, and eager, each in
a fresh process.

The engine's compiled step (``torch.compile`` + one CUDA graph) is the fast decode path, and its
compile is what a user waits for before the first token. Three modes, each a fresh Python process
(``--child MODE``), timed from the moment that process starts:

* ``cold``: ``DecodeEngine(compile=True)`` with an empty compile cache folder
  (:func:`kvpop.decode.engine.use_compile_cache`, here ``--cache``, emptied first);
* ``warm``: the same again, reusing the folder ``cold`` filled (what a second ``kvpop generate
  --compile`` on the same machine gets);
* ``eager``: ``compile=False`` (``kvpop generate`` without ``--compile``): starts at once, slower
  per token.

``--compile-modes layer,step`` runs ``cold`` and ``warm`` for each of the engine's compile modes
(:data:`kvpop.decode.engine.COMPILE_MODES`: one layer reused by every layer, the default, or the
whole step as one graph), each with its own cache folder under ``--cache``.

Each child builds the Qwen3-4B architecture (random weights, bf16; ``--small``: a tiny Qwen3),
prefills a ``--prompt``-token prompt into a bounded cache (``kvpop_mlp``, random scorer, budget
``--budget``), decodes ``--steps`` tokens and reports: seconds to import torch and kvpop, to build
the model, to prefill, for the first and the second step (compiled: the compile, then the CUDA
graph's capture), the steady ms per step, and the time to the first token from process start.
The parent prints the table with the ratios against ``cold`` and writes ``--out`` (default
``results/bench_ttft/<device>[_small].json``) through :func:`kvpop.provenance.write_result`.

    PYTHONPATH=src python3 bench/bench_ttft.py                # -> results/bench_ttft/h200.json
    PYTHONPATH=src python3 bench/bench_ttft.py --small --modes eager --out /tmp/ttft.json   # CPU smoke test

Compiling needs CUDA: on a CPU only ``eager`` runs.
"""

from __future__ import annotations

import time

START = time.time()  # the child's clock starts before the heavy imports

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

MODES = ("cold", "warm", "eager")


def child(args) -> dict:
    """One mode, in this (fresh) process -> its timings."""
    if args.child != "eager":
        os.environ["KVPOP_COMPILE_CACHE"] = str(args.cache)
    import torch

    from kvpop.benchmarking import qwen3_4b_config, random_ids, sync
    from kvpop.decode.engine import DecodeEngine
    from kvpop.geometry import CacheLayout
    from kvpop.policies import make_policy

    t = {"import_s": time.time() - START}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = qwen3_4b_config(args.small)
    t0 = time.time()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    policy = make_policy("kvpop_mlp", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    for layer in policy.scorer.layers:
        torch.nn.init.normal_(layer.w2, std=0.5)
    policy.to(dev)
    sync(dev)
    t["model_s"] = time.time() - t0
    eng = DecodeEngine(model, policy, layout=CacheLayout(args.budget, 4, 256), batch_size=1, compile=args.child != "eager",
                       compile_mode=args.compile_mode)
    ids = random_ids(1, args.prompt, cfg.vocab_size, 1, dev)
    t0 = time.time()
    logits = eng.prefill(ids)
    sync(dev)
    t["prefill_s"] = time.time() - t0
    eng.tok.copy_(logits.argmax(-1, keepdim=True))
    for name in ("first_step_s", "second_step_s"):
        t0 = time.time()
        eng.step()
        sync(dev)
        t[name] = time.time() - t0
        if name == "first_step_s":
            t["to_first_token_s"] = time.time() - START
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        sync(dev)
        steps.append(time.perf_counter() - t0)
    steps.sort()
    t["steady_ms_per_step"] = 1e3 * steps[len(steps) // 2]
    return {k: round(v, 3) for k, v in t.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="default: results/bench_ttft/<device>[_small].json")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (warm needs cold first)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/kvpop-ttft-cache"), help="the compile cache folder (emptied by cold)")
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="a tiny Qwen3 (smoke test)")
    ap.add_argument("--compile-modes", default="layer", help="comma list of DecodeEngine compile modes (layer, step): cold and warm "
                    "run for each, each with its own cache folder under --cache")
    ap.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compile-mode", default="layer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    if args.small:
        args.prompt, args.budget, args.steps = 512, 384, 8
    import torch

    from kvpop.benchmarking import default_out, run_script
    from kvpop.provenance import device_name, write_result

    cuda = torch.cuda.is_available()
    args.out = args.out or default_out(__file__, small=args.small)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    if not cuda and any(m != "eager" for m in modes):
        print("no CUDA device: compiling is CUDA-only, so only the eager mode runs", flush=True)
        modes = [m for m in modes if m == "eager"]
    cmodes = args.compile_modes.split(",")
    rows = {}
    for mode, cm in [(m, c) for c in cmodes for m in modes if m != "eager"] + [(m, None) for m in modes if m == "eager"]:
        cache = args.cache / cm if cm else args.cache
        if mode == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        elif mode == "warm" and not cache.is_dir():
            raise SystemExit(f"warm needs the folder a cold run filled ({cache}); run cold first")
        cmd = ["--child", mode, "--cache", cache, "--prompt", args.prompt, "--budget", args.budget, "--steps", args.steps,
               "--compile-mode", cm or "layer", *(["--small"] if args.small else [])]
        t0 = time.time()
        # the cache folder is the one under test
        proc = run_script(__file__, cmd, drop_env=("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"))
        wall = time.time() - t0
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            raise SystemExit(f"mode {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        name = f"{mode}, {cm}" if cm else mode
        rows[name] = {**json.loads(line.removeprefix("RESULT ")), "process_wall_s": round(wall, 1), **({"compile_mode": cm} if cm else {})}
        print(f"{name}: {rows[name]}", flush=True)
    info = {"model": "qwen3-small" if args.small else "Qwen3-4B architecture (random weights)", "prompt": args.prompt,
            "budget": args.budget, "policy": "kvpop_mlp (random scorer)", "cache": str(args.cache), "compile_modes": cmodes}
    print(f"\n{device_name()}, {info['model']}, prompt {args.prompt}, budget {args.budget}")
    print(f"{'mode':<14}{'to first token s':>18}{'import s':>10}{'first step s':>14}{'prefill s':>11}{'ms/step':>10}{'vs cold':>9}")
    cold = next((r for n, r in rows.items() if n.startswith("cold")), None)  # the first compile mode's
    for mode, r in rows.items():
        ratio = f"{cold['to_first_token_s'] / r['to_first_token_s']:.1f}x" if cold else ""
        print(f"{mode:<14}{r['to_first_token_s']:>18.1f}{r['import_s']:>10.1f}{r['first_step_s']:>14.1f}{r['prefill_s']:>11.2f}"
              f"{r['steady_ms_per_step']:>10.2f}{ratio:>9}")
    write_result(args.out, {"info": info, "modes": rows})


if __name__ == "__main__":
    main()
