import random

import pytest
import torch

from kvpop.pack import PackedRows, first_fit_decreasing, load_packed, pack_records, save_packed

PAD = 0
S = 16


def _records(lengths: list[int], seed: int = 0) -> list[dict]:
    """Documents of distinct, nonzero tokens (token = 1000 * doc + position + 1)."""
    rng = random.Random(seed)
    return [
        {
            "id": f"doc{d}",
            "input_ids": [1000 * d + i + 1 for i in range(n)],
            "loss_mask": [rng.randint(0, 1) for _ in range(n)],
        }
        for d, n in enumerate(lengths)
    ]


LENGTHS = [5, 16, 3, 9, 20, 7, 1, 12, 4, 17, 8]
RECORDS = _records(LENGTHS)


@pytest.fixture(scope="module")
def packed() -> PackedRows:
    return pack_records(RECORDS, seq_len=S, pad_id=PAD)


def test_shapes_and_stats(packed):
    n = packed.stats.rows
    for t in (packed.input_ids, packed.doc_ids, packed.position_ids, packed.loss_mask):
        assert t.shape == (n, S) and t.dtype == torch.int64
    fitting = [n for n in LENGTHS if n <= S]
    assert packed.stats.skipped_too_long == 2
    assert packed.stats.documents == len(fitting)
    assert packed.stats.tokens == sum(fitting) == int((packed.doc_ids >= 0).sum())
    assert packed.stats.pad_tokens == n * S - sum(fitting) == int((packed.input_ids == PAD).sum())
    assert packed.stats.fill_ratio == pytest.approx(sum(fitting) / (n * S))
    assert n == 5  # 16 | 12+4 | 9+7 | 8+5+3 | 1: optimal, ceil(65 / 16)


def test_every_document_token_appears_exactly_once_in_order(packed):
    seen: dict[int, list[int]] = {}
    for row in range(packed.stats.rows):
        for doc in packed.doc_ids[row].unique().tolist():
            if doc < 0:
                continue
            sel = packed.doc_ids[row] == doc
            cols = sel.nonzero().flatten()
            assert (cols.diff() == 1).all()  # contiguous
            ids = packed.input_ids[row, sel].tolist()
            d = (ids[0] - 1) // 1000
            assert d not in seen
            seen[d] = ids
            assert packed.position_ids[row, sel].tolist() == list(range(len(ids)))
            expected_mask = RECORDS[d]["loss_mask"].copy()
            expected_mask[0] = 0
            assert packed.loss_mask[row, sel].tolist() == expected_mask
    assert seen == {d: r["input_ids"] for d, r in enumerate(RECORDS) if len(r["input_ids"]) <= S}
    assert sorted(k for idx in packed.record_index for k in idx) == sorted(seen)


def test_doc_ids_positions_and_padding(packed):
    for row in range(packed.stats.rows):
        doc = packed.doc_ids[row]
        real = doc >= 0
        n_real = int(real.sum())
        assert real[:n_real].all() and not real[n_real:].any()  # padding only at the end
        assert doc[:n_real].tolist() == sorted(doc[:n_real].tolist()) and doc[0] == 0
        starts = torch.cat([torch.tensor([True]), doc[1:] != doc[:-1]]) & real
        assert (packed.position_ids[row][starts] == 0).all()
        assert (packed.loss_mask[row][starts] == 0).all()
        pad = ~real
        assert (packed.input_ids[row][pad] == PAD).all()
        assert (packed.position_ids[row][pad] == 0).all()
        assert (packed.loss_mask[row][pad] == 0).all()


def test_first_fit_decreasing():
    assert first_fit_decreasing([5, 3, 7, 2, 4, 1], 8) == [[2, 5], [0, 1], [4, 3]]
    assert first_fit_decreasing([], 8) == []
    lengths = [random.Random(1).randint(1, 50) for _ in range(300)]
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # Replay the placements (longest first): no earlier bin had room (first fit).
    where = {i: b for b, items in enumerate(bins) for i in items}
    room = [64] * len(bins)
    for i in sorted(range(300), key=lambda i: (-lengths[i], i)):
        assert all(r < lengths[i] for r in room[: where[i]])
        room[where[i]] -= lengths[i]


def test_deterministic():
    a = pack_records(RECORDS, seq_len=S, pad_id=PAD)
    b = pack_records(RECORDS, seq_len=S, pad_id=PAD)
    assert torch.equal(a.input_ids, b.input_ids) and a.record_index == b.record_index


def test_bad_inputs():
    with pytest.raises(ValueError, match="seq_len"):
        pack_records(RECORDS, seq_len=0, pad_id=PAD)
    with pytest.raises(ValueError, match="doc0"):
        pack_records([{"id": "doc0", "input_ids": [1, 2], "loss_mask": [1]}], seq_len=S, pad_id=PAD)
    empty = pack_records([], seq_len=S, pad_id=PAD)
    assert empty.input_ids.shape == (0, S) and empty.stats.fill_ratio == 0.0


def test_save_load_roundtrip(tmp_path, packed):
    path = tmp_path / "sub" / "train.safetensors"
    save_packed(packed, path)
    loaded = load_packed(path)
    for name in ("input_ids", "doc_ids", "position_ids", "loss_mask"):
        assert torch.equal(getattr(loaded, name), getattr(packed, name))
    assert loaded.stats == packed.stats
    assert loaded.record_index == packed.record_index


def test_the_same_rows_give_the_same_bytes(tmp_path, packed):
    """The library writes the metadata map in a hash map's order, different from call to call (5 byte patterns in 20
    saves of one map, 2026-12-07): save_packed's file is the same every time (DVC's hash of data/packed with it),
    and the library reads it as its own."""
    from safetensors.torch import load, save

    assert len({save({"a": torch.zeros(3)}, metadata={"format": "x", "stats": "{}", "record_index": "[]"}) for _ in range(20)}) > 1
    files = []
    for i in range(8):
        save_packed(packed, tmp_path / f"{i}.safetensors")
        files.append((tmp_path / f"{i}.safetensors").read_bytes())
    assert len(set(files)) == 1
    assert all(torch.equal(t, getattr(packed, n)) for n, t in load(files[0]).items())
    assert load_packed(tmp_path / "0.safetensors").record_index == packed.record_index


def test_load_errors_name_the_file(tmp_path, packed):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_packed(tmp_path / "missing.safetensors")
    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    with pytest.raises(ValueError, match="corrupt.safetensors"):
        load_packed(bad)
    truncated = tmp_path / "truncated.safetensors"
    save_packed(packed, truncated)
    truncated.write_bytes(truncated.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated.safetensors"):
        load_packed(truncated)
