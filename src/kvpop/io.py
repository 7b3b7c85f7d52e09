"""Atomic outputs: a stage's file or folder appears whole or not at all, with the permissions a new one gets
under the process's umask (not the 0600 / 0700 of the temp file or folder it was written as)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _beside(path: Path, make):
    """``(tmp, make(tmp))``: a new temp name beside ``path``, created by ``make`` (FileExistsError if it exists: another name).

    ``make`` creates with mode 0o666 / 0o777, so the kernel applies the umask as for any new file: unlike
    tempfile's 0600 / 0700, and without reading the umask (``os.umask`` sets it, process-wide, to read it)."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return tmp, make(tmp)
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", **open_kw) -> Iterator[IO]:
    """Yield a file opened (``mode``, ``open_kw``) beside ``path``; on success it replaces ``path``.

    On failure the temp file is removed and a previous ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp, fd = _beside(path, lambda t: os.open(t, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        with os.fdopen(fd, mode, **open_kw) as f:
            yield f
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a temp folder beside ``out_dir``; on success it replaces ``out_dir``.

    On failure the temp folder is removed and a previous ``out_dir`` is left untouched.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp, _ = _beside(out_dir, lambda t: t.mkdir(0o777))
    try:
        yield tmp
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
