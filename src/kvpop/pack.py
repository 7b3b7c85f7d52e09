"""Pack variable-length token records into fixed-length training rows.

Documents (the records of :mod:`kvpop.filter`) are bin-packed into rows of
``seq_len`` tokens by deterministic first-fit-decreasing; a document is never
split, and documents longer than ``seq_len`` are skipped (and counted).

Shapes: ``N`` rows, ``S`` = ``seq_len`` tokens per row. Every tensor is int64.

* ``input_ids (N, S)``: tokens; ``pad_id`` on padding.
* ``doc_ids (N, S)``: 0, 1, 2, ... for the documents of a row, -1 on padding.
  Attention must not cross documents (block-diagonal causal mask).
* ``position_ids (N, S)``: restart at 0 at each document start; 0 on padding.
* ``loss_mask (N, S)``: the records' ``loss_mask``, forced to 0 on each
  document's first token (nothing predicts it) and on padding.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

FORMAT = "kvpop.packed.v1"
_TENSORS = ("input_ids", "doc_ids", "position_ids", "loss_mask")


@dataclass(frozen=True)
class PackStats:
    rows: int
    documents: int
    tokens: int  # document tokens packed
    pad_tokens: int
    fill_ratio: float  # tokens / (rows * seq_len); 0.0 when there are no rows
    skipped_too_long: int
    seq_len: int


@dataclass
class PackedRows:
    """Fixed-length rows; see the module docstring for the tensors' meaning."""

    input_ids: torch.Tensor  # (N, S)
    doc_ids: torch.Tensor  # (N, S)
    position_ids: torch.Tensor  # (N, S)
    loss_mask: torch.Tensor  # (N, S)
    stats: PackStats
    record_index: list[list[int]] = field(default_factory=list)  # per row: indices into the input records


class _MaxTree:
    """Segment tree over bin capacities: find the first bin with room >= n in O(log B)."""

    def __init__(self, size: int, capacity: int) -> None:
        self.size = 1
        while self.size < max(size, 1):
            self.size *= 2
        # Leaves: one per potential bin (remaining room); padding leaves never fit.
        self.tree = [0] * self.size + [capacity] * size + [-1] * (self.size - size)
        for i in range(self.size - 1, 0, -1):
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def first_fit(self, n: int) -> int:
        """Index of the first leaf with value >= n (callers guarantee one exists)."""
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= n else 2 * i + 1
        return i - self.size

    def take(self, leaf: int, n: int) -> None:
        i = leaf + self.size
        self.tree[i] -= n
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin-pack items (all ``<= capacity``) by first-fit-decreasing.

    Items are placed longest first (ties by index), each into the lowest-index
    bin with room. Returns the item indices of each bin, in placement order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    tree = _MaxTree(len(lengths), capacity)
    bins: list[list[int]] = []
    for i in order:
        b = tree.first_fit(lengths[i])
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        tree.take(b, lengths[i])
    return bins


def pack_records(records: Sequence[dict], *, seq_len: int, pad_id: int) -> PackedRows:
    """Pack ``records`` (``{"input_ids": [...], "loss_mask": [...]}``) into ``(N, seq_len)`` rows.

    Deterministic for a given input order. Empty documents are ignored;
    documents longer than ``seq_len`` are skipped and counted in
    ``stats.skipped_too_long``, never truncated.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be > 0, got {seq_len}")
    for k, r in enumerate(records):
        if len(r["input_ids"]) != len(r["loss_mask"]):
            raise ValueError(
                f"record {k} ({r.get('id', '?')}): input_ids and loss_mask lengths differ "
                f"({len(r['input_ids'])} != {len(r['loss_mask'])})"
            )

    keep = [k for k, r in enumerate(records) if 0 < len(r["input_ids"]) <= seq_len]
    too_long = sum(len(r["input_ids"]) > seq_len for r in records)
    bins = [[keep[j] for j in b] for b in first_fit_decreasing([len(records[k]["input_ids"]) for k in keep], seq_len)]

    n = len(bins)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.int64)
    doc_ids = torch.full((n, seq_len), -1, dtype=torch.int64)
    position_ids = torch.zeros((n, seq_len), dtype=torch.int64)
    loss_mask = torch.zeros((n, seq_len), dtype=torch.int64)
    tokens = 0
    for row, members in enumerate(bins):
        start = 0
        for doc, k in enumerate(members):
            ids, mask = records[k]["input_ids"], records[k]["loss_mask"]
            end = start + len(ids)
            input_ids[row, start:end] = torch.tensor(ids, dtype=torch.int64)
            doc_ids[row, start:end] = doc
            position_ids[row, start:end] = torch.arange(len(ids))
            loss_mask[row, start:end] = torch.tensor(mask, dtype=torch.int64).clamp_(0, 1)
            loss_mask[row, start] = 0
            start = end
        tokens += start

    stats = PackStats(
        rows=n,
        documents=len(keep),
        tokens=tokens,
        pad_tokens=n * seq_len - tokens,
        fill_ratio=tokens / (n * seq_len) if n else 0.0,
        skipped_too_long=too_long,
        seq_len=seq_len,
    )
    return PackedRows(input_ids, doc_ids, position_ids, loss_mask, stats, bins)


def save_packed(packed: PackedRows, path: str | Path) -> None:
    """Save to a safetensors file; stats and record indices go in its metadata."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: getattr(packed, name).contiguous() for name in _TENSORS}
    metadata = {
        "format": FORMAT,
        "stats": json.dumps(asdict(packed.stats)),
        "record_index": json.dumps(packed.record_index),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(stable_safetensors(tensors, metadata))
    tmp.replace(path)


def stable_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """safetensors bytes of ``tensors`` with ``metadata`` that are the same on every call: the library writes the
    metadata map in a hash map's order, which changes from call to call (so the same rows gave another file, and DVC
    another hash for ``data/packed``); here the header is written again with the metadata's keys sorted (the same JSON
    reordered, so the same length, and the tensors' offsets unchanged)."""
    raw = save(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    text = json.dumps({"__metadata__": dict(sorted(meta.items())), **dict(sorted(header.items()))}, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > n:  # cannot happen for the library's compact JSON; kept as it came rather than moving the data
        return raw
    return raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :]  # the library pads its header with spaces too


def load_packed(path: str | Path) -> PackedRows:
    """Load a file written by :func:`save_packed`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid packed-rows file (names the file).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"packed rows file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        if metadata.get("format") != FORMAT:
            raise ValueError(f"format is {metadata.get('format')!r}, expected {FORMAT!r}")
        missing = [name for name in _TENSORS if name not in tensors]
        if missing:
            raise ValueError(f"missing tensors {missing}")
        stats = PackStats(**json.loads(metadata["stats"]))
        record_index = json.loads(metadata.get("record_index", "[]"))
    except (SafetensorError, ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"corrupt or invalid packed rows file {path}: {e}") from e
    return PackedRows(**{name: tensors[name] for name in _TENSORS}, stats=stats, record_index=record_index)
