import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvpop.data.sources import SKIP_REASONS, SkippedRow, iter_nemotron, read_jsonl_rows, validate_row
from kvpop.data.synthetic import generate_traces
from kvpop.filter import TOO_LONG, FilterStats, filter_rows, format_and_tokenize, read_jsonl, write_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "nemotron_sample.jsonl"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# One good row of each kind in the fixture, plus one row per bad kind.
FIXTURE_EXPECTED_SKIPS = {reason: 1 for reason in SKIP_REASONS} | {"undecodable": 3, TOO_LONG: 1}


@pytest.fixture(scope="module")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer with single-digit tokens and a ChatML template."""
    corpus = [r["messages"][-1]["content"] + " " + r["problem"] for r in generate_traces(4, seed=0)]
    corpus += [line.decode("utf-8", "replace") for line in FIXTURE.read_bytes().splitlines()]
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def tokenizer(request, tiny_tokenizer):
    """The word-level toy tokenizer, and the real SmolLM2 one where the pipeline put it (conftest.find_smollm2)."""
    return tiny_tokenizer if request.param == "tiny" else request.getfixturevalue("smollm2_tokenizer")


# ----------------------------------------------------------------------------- sources


def test_read_jsonl_rows_skips_undecodable_and_bad_json():
    items = list(read_jsonl_rows(FIXTURE))
    skipped = [x for x in items if isinstance(x, SkippedRow)]
    assert [(s.reason, s.line) for s in skipped] == [("undecodable", 15), ("bad_json", 16)]
    assert len(items) == 16


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("text", "not_a_dict"),
        ({"messages": None}, "missing_messages"),
        ({"messages": []}, "missing_messages"),
        ({"messages": {"role": "user"}}, "messages_not_a_list"),
        ({"messages": [{"role": 1, "content": "x"}]}, "bad_message"),
        ({"messages": [{"role": "user"}]}, "bad_message"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "bad_role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant"),
        ({"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]}, "no_user"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": " \t"}]}, "empty_content"),
        ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}, "non_text_content"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "non_text_content"),
        ({"messages": [{"role": "user", "content": b"\xff"}, {"role": "assistant", "content": "y"}]}, "undecodable"),
        ({"messages": [{"role": "user", "content": "a\udc80"}, {"role": "assistant", "content": "y"}]}, "undecodable"),
    ],
)
def test_validate_row_reasons(row, reason):
    assert validate_row(row) == (None, reason)


def test_validate_row_normalizes():
    row = {"messages": [{"role": "user", "content": b"caf\xc3\xa9"}, {"role": "assistant", "content": "ok", "x": 1}]}
    messages, reason = validate_row(row)
    assert reason is None
    assert messages == [{"role": "user", "content": "café"}, {"role": "assistant", "content": "ok"}]


def test_iter_nemotron_local_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = generate_traces(3, seed=1)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = list(iter_nemotron("high_part00", data_files=str(path), limit=2))
    assert [r["uuid"] for r in loaded] == [r["uuid"] for r in rows[:2]]
    assert loaded[0]["messages"] == rows[0]["messages"]
    assert loaded[0]["metadata"]["quotes"] == rows[0]["metadata"]["quotes"]
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        next(iter_nemotron(data_files=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="unknown"):
        next(iter_nemotron("train"))


def test_iter_nemotron_local_file_with_bad_lines():
    """A local file whose rows differ in shape or are broken is read line by line: every bad line is a
    SkippedRow with its reason, the good rows come through (the datasets JSON loader would stop)."""
    loaded = list(iter_nemotron(data_files=str(FIXTURE)))
    assert loaded == list(read_jsonl_rows(FIXTURE))
    skipped = [r for r in loaded if isinstance(r, SkippedRow)]
    assert skipped and {r.reason for r in skipped} <= set(SKIP_REASONS)
    assert any(isinstance(r, dict) and validate_row(r)[0] is not None for r in loaded)


# ----------------------------------------------------------------------------- filter


def test_filter_rows_counts_every_skip(tokenizer):
    records, stats = filter_rows(read_jsonl_rows(FIXTURE), tokenizer, max_tokens=200)
    assert [r["id"] for r in records] == ["good-1", "good-2"]
    assert stats.skipped == FIXTURE_EXPECTED_SKIPS
    assert stats.seen == 16 and stats.kept == 2
    assert stats.seen == stats.kept + sum(stats.skipped.values())
    assert records[1]["expected_answer"] == "24" and records[1]["problem"] == "What is 4 * 6?"


def test_too_long_is_counted_not_truncated(tokenizer):
    rows = generate_traces(6, seed=2)
    records, _ = filter_rows(rows, tokenizer, max_tokens=10_000)
    lengths = sorted(len(r["input_ids"]) for r in records)
    cut = lengths[2]
    kept, stats = filter_rows(rows, tokenizer, max_tokens=cut)
    assert stats.kept == 3 and stats.skipped == {TOO_LONG: 3}
    assert all(len(r["input_ids"]) <= cut for r in kept)
    with pytest.raises(ValueError, match="max_tokens"):
        filter_rows(rows, tokenizer, max_tokens=0)


def _token_text(tokenizer, ids: list[int]) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids))


def test_loss_mask_covers_exactly_assistant_content(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 4 * 6?"},
        {"role": "assistant", "content": "4 * 6 = 24."},
    ]
    trace = format_and_tokenize(messages, tokenizer)
    assert len(trace.loss_mask) == len(trace.input_ids) and trace.quote_positions == []
    on = [i for i, m in enumerate(trace.loss_mask) if m]
    assert on == list(range(on[0], on[-1] + 1))  # one contiguous span
    # Exactly the assistant content followed by its end-of-turn token.
    assert tokenizer.decode(trace.input_ids[on[0] : on[-1]]).replace(" ", "") == "4*6=24."
    assert tokenizer.convert_ids_to_tokens(trace.input_ids[on[-1]]) == "<|im_end|>"
    assert tokenizer.convert_ids_to_tokens(trace.input_ids[on[0] - 1]).strip("Ċ\n") in ("", "assistant")


def test_multi_turn_masks_every_assistant_turn(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "2 + 3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "4 * 6"},
        {"role": "assistant", "content": "24"},
    ]
    trace = format_and_tokenize(messages, tiny_tokenizer)
    tokens = tiny_tokenizer.convert_ids_to_tokens(trace.input_ids)
    trained = [t for t, m in zip(tokens, trace.loss_mask, strict=True) if m]
    assert trained == ["5", "<|im_end|>", "2", "4", "<|im_end|>"]


def test_quote_positions_decode_to_quoted_digits(tokenizer):
    for row in generate_traces(4, seed=5):
        content = row["messages"][-1]["content"]
        quotes = row["metadata"]["quotes"]
        trace = format_and_tokenize(row["messages"], tokenizer, quotes=quotes)
        assert len(trace.quote_positions) == 3 * len(quotes)  # digits are single tokens
        groups = [trace.quote_positions[k : k + 3] for k in range(0, len(trace.quote_positions), 3)]
        assert [_token_text(tokenizer, [trace.input_ids[i] for i in g]) for g in groups] == [
            content[s:e] for s, e in quotes
        ]
        assert all(trace.loss_mask[i] == 1 for i in trace.quote_positions)


def test_quote_source_positions_decode_to_the_definitions(tokenizer):
    """The filter's records map each quote's source span (the definition's digits) onto tokens."""
    rows = generate_traces(3, seed=7)
    records, _ = filter_rows(rows, tokenizer, max_tokens=10**6)
    for row, rec in zip(rows, records, strict=True):
        content = row["messages"][-1]["content"]
        sources = row["metadata"]["quote_sources"]
        src = rec["quote_source_positions"]
        groups = [src[k : k + 3] for k in range(0, len(src), 3)]
        want = sorted({content[s:e] for s, e in sources})  # a value recalled twice has one source
        assert sorted(_token_text(tokenizer, [rec["input_ids"][i] for i in g]) for g in groups) == want
        assert max(src) < min(rec["quote_positions"])  # definitions come before their quotes


def test_bad_quotes_are_skipped(tiny_tokenizer):
    row = generate_traces(1, seed=0)[0]
    row["metadata"]["quotes"] = [[0, 10**6]]
    records, stats = filter_rows([row, {"messages": "x"}], tiny_tokenizer, max_tokens=4096)
    assert records == [] and stats.skipped == {"bad_quotes": 1, "messages_not_a_list": 1}


def test_template_error_is_counted(tiny_tokenizer):
    strict = PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer.backend_tokenizer, unk_token="[UNK]")
    strict.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" + CHATML
    )
    records, stats = filter_rows(read_jsonl_rows(FIXTURE), strict, max_tokens=4096)
    assert [r["id"] for r in records] == ["good-1", "toolong"]
    assert stats.skipped["template_error"] == 1


def test_records_roundtrip_and_atomic_write(tmp_path, tiny_tokenizer):
    records, stats = filter_rows(generate_traces(3, seed=4), tiny_tokenizer, max_tokens=4096)
    assert isinstance(stats, FilterStats) and stats.to_dict() == {"seen": 3, "kept": 3, "skipped": {}}
    path = tmp_path / "out" / "records.jsonl"
    assert write_jsonl(records, path) == 3
    assert read_jsonl(path) == records

    def exploding():
        yield records[0]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_jsonl(exploding(), path)
    assert read_jsonl(path) == records  # the old file is intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["records.jsonl"]  # no temp left behind

    path.write_text('{"ok": 1}\n{not json\n')
    with pytest.raises(ValueError, match="records.jsonl:2"):
        read_jsonl(path)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_jsonl(tmp_path / "nope.jsonl")
