"""Rows to chat-formatted token sequences, with loss masks and quote positions.

A row's messages are rendered with the tokenizer's chat template and the text
is tokenized once with character offsets, so that character-level facts
(where the assistant content is, where the long-range quotes are) map exactly
onto token indices:

* ``loss_mask[i] == 1`` iff token ``i`` overlaps the content of an assistant
  turn, or is that turn's end-of-turn token (the first token starting at or
  after the content's end, e.g. ``<|im_end|>`` in ChatML).
* ``quote_positions`` are the tokens ``i`` overlapping a quote span; evaluation
  scores them as "predict token ``i`` from the prefix ``[0, i)``".
* ``quote_source_positions`` are the tokens overlapping the quotes' source spans
  (the definitions, ``metadata["quote_sources"]``); the ``oracle_sources``
  ceiling keeps exactly these.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2

from kvpop.data.sources import SkippedRow, validate_row
from kvpop.io import atomic_file

TOO_LONG = "too_long"
BAD_QUOTES = "bad_quotes"
TEMPLATE_ERROR = "template_error"


@dataclass(frozen=True)
class TokenizedTrace:
    """One chat-formatted, tokenized conversation (all lists have the same length)."""

    input_ids: list[int]
    loss_mask: list[int]
    quote_positions: list[int]
    quote_source_positions: list[int] = field(default_factory=list)


@dataclass
class FilterStats:
    """Counts of a :func:`filter_rows` pass; ``seen == kept + sum(skipped.values())``."""

    seen: int = 0
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "kept": self.kept, "skipped": dict(sorted(self.skipped.items()))}


class ChatFormatError(ValueError):
    """The conversation cannot be rendered by the chat template or located in its output."""


def _locate_contents(text: str, messages: Sequence[dict]) -> list[tuple[int, int, int]]:
    """Locate each message's content in the rendered ``text``.

    Returns ``(start, end, lead)`` per message: the character span in ``text``,
    and ``lead``, the offset of that span's first character within the
    original content (non-zero only for templates that strip content, which
    are handled by falling back to the stripped content). Contents are
    searched in order, each after the previous one.
    """
    spans = []
    cursor = 0
    for m in messages:
        content, lead = m["content"], 0
        start = text.find(content, cursor)
        if start < 0:
            lead = len(content) - len(content.lstrip())
            content = content.strip()
            start = text.find(content, cursor)
        if start < 0:
            raise ChatFormatError(f"{m['role']} content not found verbatim in the chat-template output")
        spans.append((start, start + len(content), lead))
        cursor = start + len(content)
    return spans


def format_and_tokenize(
    messages: Sequence[dict],
    tokenizer: Any,
    *,
    quotes: Sequence[Sequence[int]] | None = None,
    sources: Sequence[Sequence[int]] | None = None,
) -> TokenizedTrace:
    """Render ``messages`` with the chat template and tokenize it.

    Args:
        messages: validated ``{"role", "content"}`` turns (see ``validate_row``).
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        quotes: ``[start, end)`` character spans into the content of the *last*
            assistant turn (as in ``metadata["quotes"]`` of synthetic rows).
        sources: the quotes' source spans, likewise (``metadata["quote_sources"]``).

    Raises:
        ChatFormatError: the chat template rejects the conversation, or a
            content is not found verbatim in the rendered text.
        ValueError: a quote span is malformed or lies outside the assistant
            content, or the tokenizer cannot return offsets.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("format_and_tokenize needs a fast tokenizer (character offsets)")
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    except jinja2.TemplateError as e:  # e.g. a template's raise_exception on role order
        raise ChatFormatError(f"chat template rejected the conversation: {e}") from e
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]

    def overlapping(lo: int, hi: int) -> list[int]:
        return [i for i, (s, e) in enumerate(offsets) if s < hi and e > lo]

    located = _locate_contents(text, messages)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]

    loss_mask = [0] * len(input_ids)
    for k in assistant:
        lo, hi, _ = located[k]
        for i in overlapping(lo, hi):
            loss_mask[i] = 1
        end_of_turn = next((i for i, (s, _) in enumerate(offsets) if s >= hi), None)
        if end_of_turn is not None:
            loss_mask[end_of_turn] = 1

    def span_tokens(spans: Sequence[Sequence[int]] | None) -> list[int]:
        if not spans:
            return []
        if not assistant:
            raise ValueError("quotes given but there is no assistant turn")
        content = messages[assistant[-1]]["content"]
        base, _, lead = located[assistant[-1]]
        out: set[int] = set()
        for q in spans:
            lo, hi = _parse_span(q, len(content))
            out.update(overlapping(base + lo - lead, base + hi - lead))
        return sorted(out)

    return TokenizedTrace(input_ids, loss_mask, span_tokens(quotes), span_tokens(sources))


def _parse_span(span: object, length: int) -> tuple[int, int]:
    """Check a ``[start, end)`` quote span against a content of ``length`` characters."""
    if not (isinstance(span, Sequence) and len(span) == 2 and all(type(x) is int for x in span)):
        raise ValueError(f"quote span must be a pair of ints [start, end], got {span!r}")
    lo, hi = span
    if not 0 <= lo < hi <= length:
        raise ValueError(f"quote span [{lo}, {hi}) outside assistant content of length {length}")
    return lo, hi


def _quotes_of(row: dict, key: str = "quotes") -> list | None:
    metadata = row.get("metadata")
    quotes = metadata.get(key) if isinstance(metadata, dict) else None
    return quotes if isinstance(quotes, list) and quotes else None


def filter_rows(
    rows: Iterable[dict | SkippedRow],
    tokenizer: Any,
    *,
    max_tokens: int,
) -> tuple[list[dict], FilterStats]:
    """Validate, format and tokenize rows; drop (and count) the unusable ones.

    ``rows`` may contain :class:`SkippedRow` items (from ``read_jsonl_rows``);
    they are counted under their reason. Other skip reasons are those of
    ``validate_row`` plus ``too_long`` (more than ``max_tokens`` tokens),
    ``bad_quotes`` (malformed ``metadata["quotes"]``) and ``template_error``
    (the chat template rejected the conversation). Nothing is dropped silently.

    Returns:
        ``(records, stats)``; each record is ``{"id", "input_ids", "loss_mask",
        "quote_positions", "quote_source_positions", "expected_answer", "problem"}``.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("filter_rows needs a tokenizer with a chat template (tokenizer.chat_template is not set)")
    records: list[dict] = []
    skipped: Counter[str] = Counter()
    seen = 0
    for row in rows:
        seen += 1
        if isinstance(row, SkippedRow):
            skipped[row.reason] += 1
            continue
        messages, reason = validate_row(row)
        if messages is None:
            skipped[str(reason)] += 1
            continue
        quotes = _quotes_of(row)
        try:
            trace = format_and_tokenize(messages, tokenizer, quotes=quotes, sources=_quotes_of(row, "quote_sources"))
        except ChatFormatError:
            skipped[TEMPLATE_ERROR] += 1
            continue
        except ValueError:  # malformed metadata["quotes"]
            skipped[BAD_QUOTES] += 1
            continue
        if len(trace.input_ids) > max_tokens:
            skipped[TOO_LONG] += 1
            continue
        uid = row.get("uuid")
        records.append(
            {
                "id": uid if isinstance(uid, str) and uid else f"row-{seen - 1}",
                "input_ids": trace.input_ids,
                "loss_mask": trace.loss_mask,
                "quote_positions": trace.quote_positions,
                "quote_source_positions": trace.quote_source_positions,
                "expected_answer": str(row.get("expected_answer") or ""),
                "problem": str(row.get("problem") or ""),
            }
        )
    stats = FilterStats(seen=seen, kept=len(records), skipped=dict(skipped))
    return records, stats


def write_jsonl(records: Iterable[dict], path: str | Path) -> int:
    """Write ``records`` as JSONL atomically (temp file + rename); return the count.

    An existing file at ``path`` is replaced only once the new one is complete.
    """
    count = 0
    with atomic_file(path, encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
            f.write("\n")
            count += 1
    return count


def iter_jsonl(path: str | Path) -> Iterator[dict]:
    """Yield the records of a JSONL file written by :func:`write_jsonl`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not valid JSON (names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"records file not found: {path}")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON record ({e.msg})") from e


def read_jsonl(path: str | Path) -> list[dict]:
    """Read all records of a JSONL file written by :func:`write_jsonl`."""
    return list(iter_jsonl(path))
