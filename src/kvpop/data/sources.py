"""Data sources: Nemotron-Math-v2 field mapping, local JSONL reading, row validation.

This is the one place that knows the row schema. Everything downstream
consumes ``validate_row``'s normalized messages (a list of
``{"role", "content"}`` dicts ending with an assistant turn).

Nemotron-Math-v2 (``nvidia/Nemotron-Math-v2``) rows have the fields ``uuid``,
``problem``, ``expected_answer``, ``messages`` (list of ``{role, content}``),
``tools``, ``metadata`` and ``data_source``; the synthetic source
(:mod:`kvpop.data.synthetic`) emits rows in the same schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

NEMOTRON_ID = "nvidia/Nemotron-Math-v2"
NEMOTRON_HIGH_SPLITS: tuple[str, ...] = ("high_part00", "high_part01", "high_part02")
NEMOTRON_SPLITS: tuple[str, ...] = (*NEMOTRON_HIGH_SPLITS, "medium", "low")

ALLOWED_ROLES = frozenset({"system", "user", "assistant"})

# Skip reasons: stable strings, used as metric keys.
NOT_A_DICT = "not_a_dict"
MISSING_MESSAGES = "missing_messages"
MESSAGES_NOT_A_LIST = "messages_not_a_list"
BAD_MESSAGE = "bad_message"
BAD_ROLE = "bad_role"
NO_ASSISTANT = "no_assistant"
NO_USER = "no_user"
EMPTY_CONTENT = "empty_content"
NON_TEXT_CONTENT = "non_text_content"
UNDECODABLE = "undecodable"
BAD_JSON = "bad_json"

SKIP_REASONS: tuple[str, ...] = (
    NOT_A_DICT,
    MISSING_MESSAGES,
    MESSAGES_NOT_A_LIST,
    BAD_MESSAGE,
    BAD_ROLE,
    NO_ASSISTANT,
    NO_USER,
    EMPTY_CONTENT,
    NON_TEXT_CONTENT,
    UNDECODABLE,
    BAD_JSON,
)
"""Every reason ``validate_row`` / ``read_jsonl_rows`` can report."""


@dataclass(frozen=True)
class SkippedRow:
    """A row that could not even be parsed; ``reason`` is one of ``SKIP_REASONS``."""

    reason: str
    line: int | None = None  # 1-based line number in the source file, if known
    detail: str = ""


def iter_nemotron(
    splits: str | Iterable[str] = NEMOTRON_HIGH_SPLITS,
    *,
    data_files: str | None = None,
    streaming: bool = True,
    limit: int | None = None,
) -> Iterator[dict]:
    """Yield raw rows of Nemotron-Math-v2, split after split.

    Args:
        splits: one split name or several (see ``NEMOTRON_SPLITS``); ignored
            when ``data_files`` is given.
        data_files: a local JSONL file in the same schema; read instead of the
            hub dataset (this is how tests and offline runs work), line by line
            with :func:`read_jsonl_rows`, so a malformed line becomes a
            :class:`SkippedRow` instead of stopping the read (the ``datasets``
            JSON loader infers one schema for the file and fails on rows that
            differ).
        streaming: stream rows rather than downloading whole splits first.
        limit: stop after this many rows in total (``None``: no limit).

    Hub rows are yielded as the ``datasets`` library decodes them; validate
    them with :func:`validate_row`.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if data_files is not None:
        if not Path(data_files).is_file():
            raise FileNotFoundError(f"data_files not found: {data_files}")
        streams = [read_jsonl_rows(data_files)]
    else:
        import datasets  # heavy import, deferred

        names = (splits,) if isinstance(splits, str) else tuple(splits)
        unknown = [s for s in names if s not in NEMOTRON_SPLITS]
        if unknown:
            raise ValueError(f"unknown {NEMOTRON_ID} split(s) {unknown}; expected some of {NEMOTRON_SPLITS}")
        streams = [datasets.load_dataset(NEMOTRON_ID, split=s, streaming=streaming) for s in names]

    emitted = 0
    for stream in streams:
        for row in stream:
            if limit is not None and emitted >= limit:
                return
            yield row
            emitted += 1


def read_jsonl_rows(path: str | Path) -> Iterator[dict | SkippedRow]:
    """Read a local JSONL file robustly, one row per non-blank line.

    Lines are read as bytes, so a line that is not valid UTF-8 yields
    ``SkippedRow("undecodable")`` and a line that is not valid JSON yields
    ``SkippedRow("bad_json")``, instead of aborting the whole file. A JSON
    value that is not an object is yielded as is (``validate_row`` reports it
    as ``not_a_dict``).
    """
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield SkippedRow(UNDECODABLE, lineno, str(e))
                continue
            try:
                yield json.loads(text)
            except json.JSONDecodeError as e:
                yield SkippedRow(BAD_JSON, lineno, str(e))


def _is_undecodable(text: str) -> bool:
    """True for text damaged by bad decoding: lone surrogates or U+FFFD."""
    return "\ufffd" in text or any("\ud800" <= ch <= "\udfff" for ch in text)


def _normalize_turn(turn: object) -> tuple[dict | None, str | None]:
    """Validate one message; return ``({"role", "content"}, None)`` or ``(None, reason)``."""
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or "content" not in turn:
        return None, BAD_MESSAGE
    role, content = turn["role"], turn["content"]
    if role not in ALLOWED_ROLES:
        return None, BAD_ROLE
    if isinstance(content, bytes | bytearray):
        try:
            content = bytes(content).decode("utf-8")
        except UnicodeDecodeError:
            return None, UNDECODABLE
    if not isinstance(content, str):
        return None, NON_TEXT_CONTENT
    if _is_undecodable(content):
        return None, UNDECODABLE
    if not content.strip():
        return None, EMPTY_CONTENT
    return {"role": role, "content": content}, None


def validate_row(row: object) -> tuple[list[dict] | None, str | None]:
    """Check a row and return ``(messages, None)`` or ``(None, reason)``.

    ``messages`` is a new list of ``{"role": str, "content": str}`` dicts
    (extra keys dropped, UTF-8 ``bytes`` content decoded) whose last turn is
    the assistant's. ``reason`` is one of ``SKIP_REASONS``; the first problem
    found is reported. Never raises.
    """
    if not isinstance(row, dict):
        return None, NOT_A_DICT
    raw = row.get("messages")
    if raw is None or (isinstance(raw, list | tuple) and len(raw) == 0):
        return None, MISSING_MESSAGES
    if not isinstance(raw, list | tuple):
        return None, MESSAGES_NOT_A_LIST

    messages = []
    for turn in raw:
        message, reason = _normalize_turn(turn)
        if message is None:
            return None, reason
        messages.append(message)

    if messages[-1]["role"] != "assistant":
        return None, NO_ASSISTANT
    if not any(m["role"] == "user" for m in messages):
        return None, NO_USER
    return messages, None
