"""Other kinds of text to mix into the training rows: Python source and English prose.

The scorers learn which tokens later queries attend to. Trained on one kind of text only (math
reasoning traces), a scorer learns that kind's cues, and can rank other text (code, prose) worse
than the recency rule does. Mixing pieces of other text into the training rows teaches the
target on text of other shapes (``filter.other_text``; ``bench/scorer_fit.py --mix``; the measured
effect is in BENCHMARKS.md, quality).

Sources that ship with every CPython, so nothing is downloaded:

* ``code``: the standard library's top-level modules, in name order, except ``HELD_OUT_CODE``;
* ``prose``: the Python documentation's topic texts (``pydoc_data.topics``), in key order.

The other-text check (``evaluate.other_text``) reads ``HELD_OUT_CODE`` and installed packages'
descriptions (``*.dist-info/METADATA``), which are never mixed in, so a harm measured there stays a
measurement on text the policy never saw; :func:`held_out_records` cuts them into evaluation pieces
(``evaluate.other_text``, :func:`kvpop.evaluate.evaluate_other_text`). ``exclude`` drops further sources.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

KINDS: tuple[str, ...] = ("code", "prose")

#: standard-library modules held out of training for the no-harm check
HELD_OUT_CODE: tuple[str, ...] = ("argparse.py", "dataclasses.py", "functools.py", "heapq.py", "shutil.py", "textwrap.py")


def code_documents(exclude: Iterable[str | Path] = ()) -> Iterator[tuple[str, str]]:
    """(source name, text) of the standard library's top-level modules, in name order, except
    ``HELD_OUT_CODE``, private modules (``_*.py``) and ``exclude``."""
    skip = {Path(p).resolve() for p in exclude}
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.glob("*.py")):
        if f.resolve() not in skip and not f.name.startswith("_") and f.name not in HELD_OUT_CODE:
            yield str(f), f.read_text(errors="replace")


def prose_documents(exclude: Iterable[str | Path] = ()) -> Iterator[tuple[str, str]]:
    """(source name, text) of the Python documentation's topics (``pydoc_data.topics``), in key order."""
    from pydoc_data.topics import topics

    skip = {str(p) for p in exclude}
    for key in sorted(topics):
        name = f"pydoc_data.topics:{key}"
        if name not in skip:
            yield name, topics[key]


def token_ids(tokenizer) -> Callable[[str], list[int]]:
    """A Hugging Face tokenizer as :func:`other_text_records`'s ``tokenize``: ids without special
    tokens (a piece is cut from the middle of a document)."""
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids


def other_text_records(
    tokenize: Callable[[str], Sequence[int]],
    kind: str,
    n: int,
    *,
    max_tokens: int,
    min_tokens: int | None = None,
    exclude: Iterable[str | Path] = (),
) -> list[dict]:
    """Up to ``n`` training records of ``kind`` (``code`` or ``prose``), each a piece of one document
    of ``min_tokens``..``max_tokens`` tokens (default min: ``max_tokens // 2``), in source order.

    Records have the packer's fields: ``input_ids``, ``loss_mask`` (all ones: every token is
    trained on, as in pretraining), and ``source`` (``path`` or ``pydoc_data.topics:<key>``) and
    ``kind``. Short documents (prose topics) are joined with blank lines until a piece is full.

    Raises:
        ValueError: an unknown kind, or ``max_tokens``/``min_tokens`` out of order.
    """
    if kind not in KINDS:
        raise ValueError(f"other text kind {kind!r}: expected one of {', '.join(KINDS)}")
    min_tokens = max_tokens // 2 if min_tokens is None else min_tokens
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"other text: need 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    docs = code_documents(exclude) if kind == "code" else prose_documents(exclude)
    out: list[dict] = []
    if n <= 0:
        return out
    if kind == "code":  # one file per piece source: cut each file on its own
        return _cut(docs, tokenize, kind, n, max_tokens=max_tokens, min_tokens=min_tokens)
    buf: list[int] = []  # prose: topics joined until a piece is full
    names: list[str] = []
    for name, text in docs:
        buf += list(tokenize(text + "\n\n"))
        names.append(name)
        while len(buf) >= max_tokens:
            chunk, buf = buf[:max_tokens], buf[max_tokens:]
            out.append({"input_ids": chunk, "loss_mask": [1] * len(chunk), "source": f"{names[0]}..{names[-1]}", "kind": kind})
            names = [name]
            if len(out) == n:
                return out
    return out


def _cut(docs: Iterable[tuple[str, str]], tokenize, kind: str, n: int, *, max_tokens: int, min_tokens: int) -> list[dict]:
    """Up to ``n`` records: each document cut on its own into pieces of ``max_tokens`` tokens, in
    order, a piece shorter than ``min_tokens`` (a document's tail) left out."""
    out: list[dict] = []
    for name, text in docs:
        ids = list(tokenize(text))
        for s in range(0, len(ids), max_tokens):
            chunk = ids[s : s + max_tokens]
            if len(chunk) >= min_tokens:
                out.append({"input_ids": chunk, "loss_mask": [1] * len(chunk), "source": name, "kind": kind})
                if len(out) == n:
                    return out
    return out


def held_out_documents(kind: str) -> Iterator[tuple[str, str]]:
    """(source name, text) of the text the no-harm check reads, never mixed into training: ``code``,
    the standard-library modules ``HELD_OUT_CODE``; ``prose``, installed packages' long descriptions
    (``*.dist-info/METADATA`` after its headers), in path order."""
    if kind not in KINDS:
        raise ValueError(f"other text kind {kind!r}: expected one of {', '.join(KINDS)}")
    paths = sysconfig.get_paths()
    if kind == "code":
        for name in HELD_OUT_CODE:
            f = Path(paths["stdlib"]) / name
            if f.is_file():
                yield str(f), f.read_text(errors="replace")
        return
    for f in sorted(Path(paths["purelib"]).glob("*.dist-info/METADATA")):
        yield str(f), f.read_text(errors="replace").partition("\n\n")[2]


def held_out_records(tokenize: Callable[[str], Sequence[int]], kind: str, n: int, *, max_tokens: int, min_tokens: int | None = None) -> list[dict]:
    """Up to ``n`` evaluation records of ``kind`` from :func:`held_out_documents`, each document cut on
    its own into pieces of ``min_tokens``..``max_tokens`` tokens (default min: ``max_tokens // 2``; the
    no-harm bench's 768..1536), with the fields of :func:`other_text_records` (every token scored).

    Raises:
        ValueError: an unknown kind, or ``max_tokens``/``min_tokens`` out of order.
    """
    min_tokens = max_tokens // 2 if min_tokens is None else min_tokens
    if not 0 < min_tokens <= max_tokens:
        raise ValueError(f"other text: need 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    docs = held_out_documents(kind)
    return _cut(docs, tokenize, kind, n, max_tokens=max_tokens, min_tokens=min_tokens) if n > 0 else []
