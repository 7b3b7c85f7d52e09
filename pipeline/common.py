"""What every stage script shares: params loading, atomic JSON writes, the console."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without install

from kvpop.config import Params, ParamsError, load_params  # noqa: E402
from kvpop.io import atomic_file  # noqa: E402

console = Console(stderr=True)


def params(path: str = "params.yaml") -> Params:
    """Validated params, or exit with the error naming the key (before any work); also sets the CPU
    thread count (``$KVPOP_THREADS``, else every usable core: :func:`kvpop.threads.stage_threads`)."""
    try:
        p = load_params(path)
    except ParamsError as err:
        console.print(f"[bold red]{err}")
        raise SystemExit(2) from None
    from kvpop.threads import set_threads, stage_threads

    try:
        set_threads(stage_threads())  # fixed per machine: results never depend on its load
    except ValueError as err:
        fail(f"KVPOP_THREADS: {err}", 2)
    return p


class Progress:
    """Progress of one stage step with elapsed time and ETA: a rich bar on a terminal, else (DVC
    under CI, a log file) one line per ``every`` updates and at the end. ``update(done, **fields)``."""

    def __init__(self, description: str, total: int, every: int = 1):
        self.description, self.total, self.every = description, max(1, total), max(1, every)
        self.t0 = time.monotonic()
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                    TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=console)
            self.task = self.bar.add_task(description, total=self.total, info="")

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, done: int, **fields) -> None:
        info = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=info)
        elif done % self.every == 0 or done >= self.total:
            elapsed = time.monotonic() - self.t0
            eta = elapsed / max(done, 1) * (self.total - done)
            console.print(f"{self.description} {done}/{self.total} [{_clock(elapsed)} elapsed, eta {_clock(eta)}] {info}".rstrip(),
                          highlight=False)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


def write_text(path: str | Path, text: str) -> None:
    """Write a file atomically: a reader never sees a half-written file."""
    with atomic_file(path) as f:
        f.write(text)


def write_json(path: str | Path, obj) -> None:
    """Write JSON atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fail(msg: str, code: int = 1):
    console.print(f"[bold red]error:[/] {msg}")
    raise SystemExit(code)
