import re

import pytest

from kvpop.data.sources import validate_row
from kvpop.data.synthetic import DATA_SOURCE_TAG, generate_traces

N = 24
ROWS = generate_traces(N, seed=7)

_ARITH = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)\.")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _content(row: dict) -> str:
    return row["messages"][-1]["content"]


def test_deterministic_and_seed_dependent():
    assert generate_traces(N, seed=7) == ROWS
    assert generate_traces(5, seed=7) == ROWS[:5]  # trace i depends only on (seed, i)
    other = generate_traces(N, seed=8)
    assert all(a["messages"] != b["messages"] for a, b in zip(ROWS, other, strict=True))
    assert len({r["uuid"] for r in ROWS + other}) == 2 * N


def test_schema_and_validation():
    for row in ROWS:
        assert set(row) == {"uuid", "problem", "expected_answer", "messages", "tools", "metadata", "data_source"}
        assert row["data_source"] == DATA_SOURCE_TAG
        assert row["messages"][0] == {"role": "user", "content": row["problem"]}
        messages, reason = validate_row(row)
        assert reason is None and messages == row["messages"]


def test_arithmetic_is_correct():
    for row in ROWS:
        text = _content(row)
        statements = _ARITH.findall(text)
        assert len(statements) >= 6
        for a, op, b, result in statements:
            assert _OPS[op](int(a), int(b)) == int(result), f"{a} {op} {b} = {result}"
        # The final line sums two recalled values: "So x + y = X + Y = Z."
        (x, y, xv, yv, total), = re.findall(r"So (\w+) \+ (\w+) = (\d+) \+ (\d+) = (\d+)\.", text)
        assert int(xv) + int(yv) == int(total)
        assert x in row["problem"] and y in row["problem"]


def test_boxed_answer_is_expected_answer_and_depends_on_quotes():
    for row in ROWS:
        text = _content(row)
        assert re.findall(r"\\boxed\{(\d+)\}", text) == [row["expected_answer"]]
        q = row["metadata"]["quotes"]
        last_two = [int(text[s:e]) for s, e in q[-2:]]
        assert sum(last_two) == int(row["expected_answer"])


def test_quotes_point_at_earlier_definitions():
    for row in ROWS:
        text, meta = _content(row), row["metadata"]
        values = {d["name"]: d["value"] for d in meta["values"]}
        assert len(values) == 24 and len(set(values.values())) == 24
        assert len(meta["quotes"]) == len(meta["quote_names"]) == len(meta["quote_sources"]) == 4
        for (qs, qe), (ds, de), name, dist in zip(
            meta["quotes"], meta["quote_sources"], meta["quote_names"], meta["quote_distance_chars"], strict=True
        ):
            quoted = text[qs:qe]
            assert quoted.isdigit() and len(quoted) == 3  # exactly the digits
            assert quoted == text[ds:de] == str(values[name])
            assert text[:qs].endswith(f"Recall {name} = ")
            assert text[:ds].endswith(f"Let {name} = ")
            assert dist == qs - ds and dist > 0
            # The definition is the only earlier mention of the name.
            assert text.find(f" {name} ") == ds - len(f" {name} = ")


def test_quotes_are_far_and_lengths_spread():
    lengths = [len(_content(r)) for r in ROWS]
    assert max(lengths) - min(lengths) > 300
    rows = generate_traces(8, seed=0, min_chars=1400, max_chars=1450)
    distances = [d for r in rows for d in r["metadata"]["quote_distance_chars"]]
    assert min(distances) >= 700  # DEFAULT_MIN_QUOTE_DISTANCE_CHARS (~450 SmolLM2 tokens)
    assert all(1400 <= len(_content(r)) < 1450 + 16 for r in rows)


@pytest.mark.slow
def test_real_tokenizer_lengths_and_quote_distance(smollm2_tokenizer):
    from kvpop.filter import format_and_tokenize

    tok = smollm2_tokenizer
    lengths, distances = [], []
    for row in generate_traces(40, seed=3):
        trace = format_and_tokenize(row["messages"], tok, quotes=row["metadata"]["quotes"])
        lengths.append(len(trace.input_ids))
        # Each quote is 3 digit tokens; distance from the definition's first digit token.
        text = tok.apply_chat_template(row["messages"], tokenize=False)
        base = text.index(_content(row))
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        first = {s: i for i, (s, _) in enumerate(enc["offset_mapping"])}
        for (qs, _), (ds, _) in zip(row["metadata"]["quotes"], row["metadata"]["quote_sources"], strict=True):
            distances.append(first[base + qs] - first[base + ds])
        assert len(trace.quote_positions) == 3 * len(row["metadata"]["quotes"])
    assert 380 <= min(lengths) and max(lengths) <= 1024 and max(lengths) - min(lengths) > 300
    assert sum(d >= 300 for d in distances) / len(distances) > 0.7


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_chars"):
        generate_traces(1, 0, min_chars=500, max_chars=400)
    with pytest.raises(ValueError, match="num_recalls"):
        generate_traces(1, 0, num_recalls=1)
    assert generate_traces(0, 0) == []
