"""What every stage script shares: params loading, atomic JSON writes, the console."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # run from a checkout without install

from kvpop.config import Params, ParamsError, load_params  # noqa: E402

console = Console(stderr=True)


def params(path: str = "params.yaml") -> Params:
    """Validated params, or exit with the error naming the key (before any work)."""
    try:
        return load_params(path)
    except ParamsError as err:
        console.print(f"[bold red]{err}")
        raise SystemExit(2) from None


def write_text(path: str | Path, text: str) -> None:
    """Write a file atomically: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str | Path, obj) -> None:
    """Write JSON atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fail(msg: str, code: int = 1):
    console.print(f"[bold red]error:[/] {msg}")
    raise SystemExit(code)
