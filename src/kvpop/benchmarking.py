"""What the scripts under ``bench/`` share: timers, the benchmark model, the default result path and
running another script in a fresh process.

A bench script imports the library, never another bench script (``tests/test_bench_house.py``
checks it); what two scripts need lives here. Nothing here reads params.yaml or writes a result:
results go through :func:`kvpop.provenance.write_result`.

* :func:`time_calls`: seconds of each call of a function (CUDA events on CUDA, the host clock on
  the CPU), with :attr:`Timing.median` and :attr:`Timing.best`;
* :func:`cuda_graph_seconds`: one call captured in a CUDA graph and timed over its replays (what an
  engine's compiled step replays: no launch overhead);
* :func:`copy_bandwidth`: the card's device-to-device copy bandwidth (the floor of a memory-bound step);
* :func:`qwen3_4b_config`, :func:`random_ids`, :func:`fill_cache`: the decode benchmarks' model (the
  Qwen3-4B architecture, random weights), prompt and a cache put straight into its state at a context;
* :func:`default_out`: ``results/<script stem>/<device tag>.json``;
* :func:`run_script`: ``python <script> <args>`` in a fresh process with this checkout's ``src/`` on
  ``PYTHONPATH`` (a first token timed from a process's start, a rank of its own, a clean CUDA context).
"""

from __future__ import annotations

import collections
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

#: the folder every result goes under (relative to the repository root, where the scripts run)
RESULTS = Path("results")
#: this checkout's ``src/`` (the folder that holds the ``kvpop`` package)
SRC = Path(__file__).resolve().parents[1]


class OpCount(TorchDispatchMode):
    """Counts the aten operations that run under it, views aside, by the part of the chunk they run in
    (:meth:`part`: the methods of the code under study wrapped to name their part; the rest is ``"other"``; a
    profiling tool for the eager CPU path, where a GPU would launch one kernel per operation)."""

    VIEWS = {"view", "_unsafe_view", "expand", "reshape", "slice", "select", "t", "transpose", "permute", "unsqueeze", "squeeze",
             "alias", "as_strided", "detach", "split", "split_with_sizes", "unbind", "lift_fresh", "_reshape_alias"}

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.stack = ["other"]
        self._patched: list[tuple[object, str, object]] = []  # (obj, name, what obj.__dict__ held: _ABSENT if nothing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in self.VIEWS:
            self.counts[self.stack[-1]] += 1
        return func(*args, **(kwargs or {}))

    def part(self, obj, name: str, label: str) -> None:
        """Count what ``obj.name`` runs (an instance attribute shadows the method; a class's or module's attribute is
        replaced) under ``label``, until :meth:`restore`."""
        fn = getattr(obj, name)
        self._patched.append((obj, name, vars(obj).get(name, _ABSENT)))

        @functools.wraps(fn)
        def counted(*a, **k):
            self.stack.append(label)
            try:
                return fn(*a, **k)
            finally:
                self.stack.pop()

        setattr(obj, name, counted)

    def restore(self) -> None:
        """Undo every :meth:`part`: each object's own attribute as it was (or none, where it had none)."""
        for obj, name, old in reversed(self._patched):
            if old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._patched.clear()


_ABSENT = object()


def sync(dev: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Timing:
    """Seconds of each timed call, and the last call's result."""

    seconds: list[float]
    out: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        """The fastest call (the figure least disturbed by a shared CPU)."""
        return min(self.seconds)


def time_calls(fn: Callable[[], Any], *, reps: int, warmup: int = 0, cuda: bool = False) -> Timing:
    """``warmup`` untimed calls of ``fn``, then ``reps`` timed ones: on CUDA with CUDA events around
    each call (the device's time, synchronized after each), else with the host clock."""
    if reps < 1:
        raise ValueError(f"time_calls: reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    seconds, out = [], None
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            torch.cuda.synchronize()
            seconds.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            out = fn()
            seconds.append(time.perf_counter() - t0)
    return Timing(seconds, out)


def cuda_graph_seconds(fn: Callable[[], Any], *, replays: int, warmup: int = 3) -> tuple[float, Any]:
    """Seconds per replay of one call of ``fn`` captured in a CUDA graph -> (seconds, ``fn``'s result
    from the last replay, its tensors cloned out of the graph's memory).

    ``fn`` runs ``warmup`` times first (compiling, autotuning), once more on a side stream (as capture
    wants), then once under capture; the graph is replayed once untimed and ``replays`` times between
    two CUDA events. To time a short kernel, let ``fn`` launch it many times and divide."""
    if replays < 1:
        raise ValueError(f"cuda_graph_seconds: replays must be >= 1, got {replays}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / replays
    out = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
    del graph
    return seconds, out


def copy_bandwidth(dev: torch.device | str, nbytes: int) -> float:
    """Bytes per second moved by a device-to-device copy of ``nbytes`` (read + write), over 20 copies."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(dev)
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        y.copy_(x)
    sync(dev)
    return 2 * nbytes * n / (time.perf_counter() - t0)


def qwen3_4b_config(small: bool = False, narrow: bool = False):
    """The decode benchmarks' model: the Qwen3-4B architecture (36 layers, 32 query / 8 KV heads,
    head_dim 128, hidden 2560, intermediate 9728, vocabulary 151,936, tied embeddings); ``small``: a
    4-layer Qwen3 of width 256 for smoke runs (also on the CPU); ``narrow``: Qwen3-4B's 36 layers and
    32 / 8 heads at width 256, head dim 16 and a vocabulary of 1,024: the pooled engine's bookkeeping at
    full size (its pool has as many entries), the model's arithmetic small (the CPU)."""
    from transformers import Qwen3Config

    if small and narrow:
        raise ValueError("small and narrow are two different models: pick one")
    if narrow:
        return Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=36, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=16, max_position_embeddings=1 << 18, tie_word_embeddings=True,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6)
    if small:
        return Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 18, tie_word_embeddings=True)
    return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 18, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6)


def smollm2_config(layers: int = 30):
    """The embedded model's architecture (SmolLM2-135M-Instruct: hidden 576, 9 query / 3 KV heads, head dim 64,
    intermediate 1536, vocabulary 49,152, tied embeddings) with ``layers`` decoder layers (the model's 30, or fewer
    for smoke runs): the benches that time work at the embedded model's shapes with random weights."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=100000.0)


def random_ids(B: int, S: int, vocab: int, seed: int, dev: torch.device | str) -> torch.Tensor:
    """(B, S) token ids drawn uniformly from ``vocab`` by a CPU generator seeded ``seed`` (the same ids on any device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g).to(dev)


@torch.no_grad()
def fill_cache(eng, ctx: int, seed: int) -> float:
    """Put a :class:`kvpop.decode.DecodeEngine`'s cache directly into the state it has after ``ctx``
    tokens (random keys, values and priorities; the positions a bounded cache holds then: the sinks,
    the last ``window`` tokens in their ring slots, ``k`` long-range tokens) -> seconds. A step does
    the same work whatever the entries hold, so this times decoding at ``ctx`` without prefilling
    B * ctx tokens."""
    if eng.delayed:
        raise ValueError("fill_cache: a delayed rule's recurrent state cannot be filled at random; prefill instead")
    if ctx > eng.slots and eng.kind == "dense":
        raise ValueError(f"fill_cache: the dense cache holds {eng.slots} tokens, not {ctx}")
    t0 = time.perf_counter()
    g = torch.Generator(eng.device).manual_seed(seed)
    B, Hk, dev = eng.B, eng.Hk, eng.device
    if eng.kind == "pooled":  # one pool for the whole model: kvpop.decode.pooled.PoolStore.fill
        eng.store.fill(ctx, g)
        held = slots = None
    elif eng.kind == "dense":
        held = slots = torch.arange(ctx, device=dev).expand(B, Hk, ctx)  # (B, Hk, n) positions, and their slots
    else:
        fixed = torch.cat([torch.arange(min(ctx, eng.sinks), device=dev), torch.arange(max(eng.sinks, ctx - eng.window), ctx, device=dev)])
        older = max(0, ctx - eng.window - eng.sinks)  # tokens that have left the window
        lr_n = min(eng.long_range, older)
        lr = torch.rand(B * Hk, older, generator=g, device=dev).argsort(-1)[:, :lr_n].sort(-1).values + eng.sinks  # random survivors
        held = torch.cat([fixed.expand(B * Hk, -1), lr], -1).view(B, Hk, -1)  # (B, Hk, n)
        slots = torch.cat([eng.home_slot(fixed), torch.arange(eng.first_long_range, eng.first_long_range + lr_n, device=dev)]).expand(B, Hk, -1)  # (B, Hk, n)
    n = held.shape[-1] if held is not None else 0
    for i in range(len(eng.keys)):
        eng.pos[i].fill_(-1).scatter_(2, slots, held)
        for buf in (eng.keys[i], eng.values[i]):
            x = torch.randn(B, Hk, n, eng.D, generator=g, device=dev, dtype=torch.float32).to(buf.dtype)  # (B, Hk, n, D)
            buf.zero_().scatter_(2, slots[..., None].expand(-1, -1, -1, eng.D), x)
        if eng.prio:
            eng.prio[i].fill_(float("-inf")).scatter_(2, slots, torch.randn(B, Hk, n, generator=g, device=dev, dtype=torch.float64))
    eng.p.fill_(ctx)
    eng.seen = ctx
    eng.tok.copy_(torch.randint(0, min(1000, eng.model.config.vocab_size), (B, 1), generator=g, device=dev))  # (B, 1) the next input
    sync(dev)
    return time.perf_counter() - t0


def pooled_policy(name: str, model, kvpop_mlp, dev):
    """The one-pool policy ``name`` on the bench model: ``dbtrimkv`` with a random gate (retentions that
    differ per token), or ``kvpop_mlp``: the bench's scorer ranked with one pool."""
    from kvpop.policies import OnePool, make_policy

    cfg = model.config
    if name == "kvpop_mlp":
        return OnePool(kvpop_mlp)
    pol = make_policy(name, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    if not pol.one_pool:
        raise ValueError(f"policy {name!r} does not rank with one pool")
    if name == "dbtrimkv":
        torch.manual_seed(1)
        torch.nn.init.normal_(pol.scorer.w2, std=0.5)
    return pol.to(dev)


def device_tag(cuda: bool | None = None) -> str:
    """A short name for the machine in a file name: the accelerator's model (``NVIDIA H200`` -> ``h200``),
    else ``cpu``. ``cuda=False`` names the CPU even where a GPU is present (a run that stayed on the CPU)."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().removeprefix("nvidia").strip()
    return "-".join(name.split()) or "cuda"


def default_out(script: str | Path, *, small: bool = False, cuda: bool | None = None, suffix: str = "") -> Path:
    """``results/<script stem>/<device tag>[_<suffix>][_small].json``: where a bench script writes
    unless told otherwise (``script``: its ``__file__``)."""
    name = "_".join([device_tag(cuda), *([suffix] if suffix else []), *(["small"] if small else [])])
    return RESULTS / Path(script).stem / f"{name}.json"


def run_script(script: str | Path, args: Iterable[object] = (), *, env: dict[str, str] | None = None,
               drop_env: Iterable[str] = ()) -> subprocess.CompletedProcess:
    """``python <script> <args>`` in a fresh process (this interpreter), its output captured as text,
    with this checkout's ``src/`` first on ``PYTHONPATH``; ``env`` adds variables, ``drop_env`` removes
    some. Running another script is not importing it: each bench script stays a whole program."""
    child = {**os.environ, **(env or {})}
    for var in drop_env:
        child.pop(var, None)
    child["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), child.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(script), *map(str, args)], env=child, capture_output=True, text=True)
