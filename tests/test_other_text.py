"""kvpop.data.other_text: pieces of code and prose to mix into the training rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpop.data.other_text import HELD_OUT_CODE, code_documents, other_text_records, prose_documents
from kvpop.pack import pack_records


def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


@pytest.mark.parametrize("kind", ["code", "prose"])
def test_pieces_are_packable_training_records(kind):
    recs = other_text_records(byte_tokens, kind, 5, max_tokens=3000, min_tokens=1000)
    assert len(recs) == 5
    for r in recs:
        assert 1000 <= len(r["input_ids"]) <= 3000 and r["loss_mask"] == [1] * len(r["input_ids"]) and r["kind"] == kind
    packed = pack_records(recs, seq_len=3000, pad_id=0)
    assert packed.stats.documents == 5 and packed.stats.skipped_too_long == 0


def test_code_pieces_are_the_files_text_in_order():
    recs = other_text_records(byte_tokens, "code", 3, max_tokens=2000, min_tokens=2000)
    first = next(code_documents())
    assert recs[0]["source"] == first[0]
    assert bytes(recs[0]["input_ids"]) == first[1].encode()[:2000]
    assert len(first[1].encode()) >= 4000  # the first module (abc.py or aifc.py) gives two full pieces
    assert recs[1]["source"] == first[0] and bytes(recs[1]["input_ids"]) == first[1].encode()[2000:4000]


def test_held_out_and_excluded_sources_are_never_used():
    names = {Path(n).name for n, _ in code_documents()}
    assert names and not names & set(HELD_OUT_CODE)
    first = next(code_documents())[0]
    assert first not in {n for n, _ in code_documents(exclude=[first])}
    topic = next(prose_documents())[0]
    assert topic not in {n for n, _ in prose_documents(exclude=[topic])}


def test_prose_joins_short_topics_into_full_pieces():
    recs = other_text_records(byte_tokens, "prose", 2, max_tokens=20_000)
    assert [len(r["input_ids"]) for r in recs] == [20_000, 20_000]
    assert ".." in recs[0]["source"]  # several topics in one piece
    text = "".join(t + "\n\n" for _, t in prose_documents())
    assert bytes(recs[0]["input_ids"] + recs[1]["input_ids"]) == text.encode()[:40_000]


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="kind 'poetry'"):
        other_text_records(byte_tokens, "poetry", 1, max_tokens=10)
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        other_text_records(byte_tokens, "code", 1, max_tokens=10, min_tokens=20)
    assert other_text_records(byte_tokens, "code", 0, max_tokens=10) == []
