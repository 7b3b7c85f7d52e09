"""How many CPU threads torch uses: chosen, not inherited.

On a CPU, a decode step of a small model is a chain of small matrix products whose threads meet at
a barrier every operation. With every core free, more threads are faster; with a core busy
elsewhere, a thread that waits for it stalls all the others. Measured on this project's 2-core
workplace (``bench/bench_threads.py``, greedy decoding of the CPU pipeline's ``kvpop_mlp`` export,
``results/bench_threads/cpu.json``): idle, 2 threads decode 1.60x faster than 1; with one core
busy elsewhere, 2 threads run at 0.17x of 1 thread (6x slower).

Pipeline stages do not use ``auto``: a stage's results must not depend on how busy the machine
was (float reductions, and so a training run's trajectory, change with the thread count), so they
take every usable core (:func:`stage_threads`), or ``KVPOP_THREADS``.

The CLI's ``auto`` takes the cores this process may run on minus the ones busy right now (sampled
from ``/proc/stat`` over a quarter second, before this process starts its own work; where that
cannot be read, all of them), at least 1. ``KVPOP_THREADS`` or an explicit count overrides it. (The
load average would not do: it still counts a process that just finished.)
"""

from __future__ import annotations

import os

ENV = "KVPOP_THREADS"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def busy_cores(interval: float = 0.25) -> float | None:
    """How many cores' worth of CPU time the machine spent busy over ``interval`` seconds (Linux
    ``/proc/stat``), or None where it cannot be read."""
    import time

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]  # noqa: SIM115 - one line
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = t1 - t0
    return (os.cpu_count() or 1) * (1.0 - (i1 - i0) / total) if total > 0 else 0.0


def auto_threads(cores: int | None = None, busy: float | None = None) -> int:
    """Free cores: ``cores`` (default: usable) minus ``busy`` (default: :func:`busy_cores`), rounded; at least 1."""
    cores = usable_cores() if cores is None else cores
    if busy is None:
        busy = busy_cores() or 0.0
    return max(1, min(cores, cores - int(busy + 0.5)))


def choose_threads(requested: int | str | None = None) -> int:
    """The thread count for ``requested`` (an int, ``"auto"`` or None = ``$KVPOP_THREADS`` or auto)."""
    if requested is None:
        requested = os.environ.get(ENV, "auto")
    if isinstance(requested, str):
        if requested.strip().lower() == "auto":
            return auto_threads()
        try:
            requested = int(requested)
        except ValueError:
            raise ValueError(f"threads must be a positive integer or 'auto', got {requested!r}") from None
    if requested < 1:
        raise ValueError(f"threads must be a positive integer or 'auto', got {requested}")
    return requested


def set_threads(requested: int | str | None = None) -> int:
    """Set torch's intra-op thread count (see :func:`choose_threads`); returns it."""
    import torch

    n = choose_threads(requested)
    torch.set_num_threads(n)
    return n


def stage_threads() -> int:
    """A pipeline stage's thread count: ``$KVPOP_THREADS``, else every usable core (never the load:
    the same machine gives the same results)."""
    env = os.environ.get(ENV)
    return choose_threads(env) if env is not None and env.strip().lower() != "auto" else usable_cores()
