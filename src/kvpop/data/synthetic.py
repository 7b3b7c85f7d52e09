"""Seeded synthetic long-range arithmetic traces in the Nemotron-Math-v2 row schema.

Each trace is a step-by-step "reasoning" in which the assistant first *defines*
about two dozen named three-digit values (``Let apple = 381.``), interleaved with
filler arithmetic, then does more filler, and finally *quotes* some of those
values again (``Recall apple = 381.``) hundreds of tokens later. The final answer
is the sum of two recalled values, so a model whose KV cache lost the
definitions cannot produce it. Every arithmetic statement is correct.

Rows look like Nemotron-Math-v2 rows::

    {"uuid": str, "problem": str, "expected_answer": str,
     "messages": [{"role": "user", "content": problem},
                  {"role": "assistant", "content": reasoning}],
     "tools": [], "metadata": {...}, "data_source": "kvpop-synthetic"}

``metadata["quotes"]`` lists ``[start, end]`` character spans into the assistant
content that cover exactly the digits of each long-range quote (the value, not
the name); ``metadata["quote_sources"]`` holds the matching spans of the
definitions, and ``metadata["quote_distance_chars"]`` their distance.

Length is controlled in characters of assistant content. Digits are single
tokens in the SmolLM2 (Llama-style) tokenizer, and the format runs at roughly
``CHARS_PER_TOKEN`` characters per token, so the defaults
(``DEFAULT_MIN_CHARS``/``DEFAULT_MAX_CHARS``) give chat-formatted traces of
about 450 to 1,000 tokens, spread evenly (the floor is what the definitions
and recalls need), with about three quarters of the quotes 400+ tokens after
their definition.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

SYNTHETIC_SOURCE = "synthetic"
"""Name of this data source (for configs / CLI ``--source``)."""

DATA_SOURCE_TAG = "kvpop-synthetic"
"""Value of the ``data_source`` field of generated rows."""

CHARS_PER_TOKEN = 1.65
"""Approximate characters of assistant content per SmolLM2 token for this format."""

DEFAULT_MIN_CHARS = 700
DEFAULT_MAX_CHARS = 1_380
DEFAULT_NUM_VALUES = 24
DEFAULT_NUM_RECALLS = 4
DEFAULT_MIN_QUOTE_DISTANCE_CHARS = 700

_VALUE_RANGE = range(200, 1000)  # defined values; disjoint from filler results (< 200)
# Names are single, distinctive SmolLM2 tokens (" apple"), so that a quote
# ("Recall apple = ") identifies its definition unambiguously; names made of
# digits ("v17") collide with the surrounding arithmetic and are recalled far worse.
NAME_POOL: tuple[str, ...] = (
    "apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "forest",
    "candle", "silver", "garden", "rocket", "piano", "lemon", "violet", "falcon",
    "harbor", "meadow", "copper", "winter", "desert", "marble", "comet", "willow",
    "banana", "castle", "dragon", "eagle", "island", "jungle", "kettle", "lantern",
    "mirror", "orange", "pepper", "rabbit", "saddle", "thunder", "valley", "wizard",
)
_DEFINE_FILLER_PROB = 0.25  # chance of a filler line before each definition
_RECALL_PREFIX = "Recall "
_RECALL_BLOCK_ESTIMATE = 60  # approximate characters of the recall block per recall


@dataclass
class _Builder:
    """Accumulates newline-separated lines and tracks character offsets."""

    lines: list[str] = field(default_factory=list)
    length: int = 0  # length of "\n".join(lines)

    def add(self, line: str) -> int:
        """Append ``line``; return the offset of its first character."""
        start = self.length + (1 if self.lines else 0)
        self.lines.append(line)
        self.length = start + len(line)
        return start

    def text(self) -> str:
        return "\n".join(self.lines)


def _filler(rng: random.Random) -> str:
    """A small, correct arithmetic statement whose result is below 200."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randint(2, 9), rng.randint(10, 20)
        return f"{a} * {b} = {a * b}."
    a, b = rng.randint(50, 99), rng.randint(10, 49)
    return f"{a} - {b} = {a - b}."


def _recall_line(name: str, value: int) -> tuple[str, int]:
    """``Recall vN = VVV.``; returns the line and the offset of the value in it."""
    head = f"{_RECALL_PREFIX}{name} = "
    return f"{head}{value}.", len(head)


def _generate_one(
    rng: random.Random,
    *,
    target_chars: int,
    num_values: int,
    num_recalls: int,
    min_quote_distance_chars: int,
) -> tuple[str, str, str, dict]:
    """Build one trace; returns (problem, reasoning, answer, metadata)."""
    names = list(rng.sample(NAME_POOL, num_values))
    values = dict(zip(names, rng.sample(_VALUE_RANGE, num_values), strict=True))

    body = _Builder()
    body.add("We work step by step and keep track of every named value.")

    # 1. Definitions, with some filler in between.
    def_value_start: dict[str, int] = {}
    for name in names:
        if rng.random() < _DEFINE_FILLER_PROB:
            body.add(_filler(rng))
        line_start = body.add(f"Let {name} = {values[name]}.")
        def_value_start[name] = line_start + len(f"Let {name} = ")

    # 2. Choose what to recall: prefer values defined far before the recall block.
    recall_start = max(target_chars - _RECALL_BLOCK_ESTIMATE * num_recalls, body.length)
    far = [n for n in names if recall_start - def_value_start[n] >= min_quote_distance_chars]
    if len(far) >= num_recalls:
        recalled = rng.sample(far, num_recalls)
    else:  # short trace: fall back to the earliest definitions
        recalled = names[:num_recalls]
    *intermediate, final_a, final_b = recalled

    # 3. The recall block: intermediate recalls feed a small computation, the
    #    last two the answer. Quotes are recorded relative to the block.
    block = _Builder()
    block_quotes: list[tuple[str, int]] = []

    def recall(name: str) -> None:
        line, value_offset = _recall_line(name, values[name])
        block_quotes.append((name, block.add(line) + value_offset))

    for name in intermediate:
        recall(name)
        delta = rng.randint(11, 99)
        if rng.random() < 0.5:
            block.add(f"Then {values[name]} + {delta} = {values[name] + delta}.")
        else:
            block.add(f"Then {values[name]} - {delta} = {values[name] - delta}.")
        block.add(_filler(rng))
    recall(final_a)
    recall(final_b)
    x, y = values[final_a], values[final_b]
    answer = x + y
    block.add(f"So {final_a} + {final_b} = {x} + {y} = {answer}.")
    block.add("")
    block.add(f"The answer is \\boxed{{{answer}}}.")

    # 4. Middle filler so that the whole text reaches the target length.
    while body.length + 1 + block.length < target_chars:
        body.add(_filler(rng))
    offset = body.length + 1
    for line in block.lines:
        body.add(line)
    quote_names = [name for name, _ in block_quotes]
    quotes = [[offset + at, offset + at + len(str(values[name]))] for name, at in block_quotes]

    problem = (
        f"Work through a long chain of arithmetic in which named values are "
        f"defined along the way. At the end, recall {final_a} and {final_b} and "
        f"give {final_a} + {final_b}."
    )
    sources = [[def_value_start[n], def_value_start[n] + len(str(values[n]))] for n in quote_names]
    metadata = {
        "generator": "kvpop.data.synthetic",
        "target_chars": target_chars,
        "values": [{"name": n, "value": values[n]} for n in names],  # Arrow-friendly
        "quotes": quotes,
        "quote_names": quote_names,
        "quote_sources": sources,
        "quote_distance_chars": [q[0] - s[0] for q, s in zip(quotes, sources, strict=True)],
    }
    return problem, body.text(), str(answer), metadata


def generate_traces(
    n: int,
    seed: int,
    *,
    min_chars: int = DEFAULT_MIN_CHARS,
    max_chars: int = DEFAULT_MAX_CHARS,
    num_values: int = DEFAULT_NUM_VALUES,
    num_recalls: int = DEFAULT_NUM_RECALLS,
    min_quote_distance_chars: int = DEFAULT_MIN_QUOTE_DISTANCE_CHARS,
) -> list[dict]:
    """Generate ``n`` synthetic traces, deterministically for ``seed``.

    Args:
        n: number of traces (>= 0).
        seed: RNG seed. Trace ``i`` depends only on ``(seed, i)``, so
            ``generate_traces(k, s)`` is a prefix of ``generate_traces(k + m, s)``.
        min_chars, max_chars: the target length of each assistant content is
            drawn uniformly from ``[min_chars, max_chars]``; the actual length
            overshoots the target by less than one filler line (< 16 chars).
            Targets below the minimum that fits all definitions and recalls
            (about 700 characters with the defaults) are lengthened to it.
        num_values: how many named values are defined (<= len(NAME_POOL)).
        num_recalls: how many values are quoted later (>= 2; the last two are
            summed for the final answer).
        min_quote_distance_chars: quoted values are drawn among those defined at
            least this many characters before the recall block when possible
            (the earliest definitions are used otherwise).

    Returns:
        Rows in the Nemotron-Math-v2 schema (see the module docstring).
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"need 0 < min_chars <= max_chars, got min_chars={min_chars}, max_chars={max_chars}")
    if not 1 <= num_values <= len(NAME_POOL):
        raise ValueError(f"num_values must be in [1, {len(NAME_POOL)}], got {num_values}")
    if not 2 <= num_recalls <= num_values:
        raise ValueError(f"num_recalls must be in [2, num_values={num_values}], got {num_recalls}")

    rows = []
    for i in range(n):
        rng = random.Random(f"kvpop-synthetic:{seed}:{i}")
        target = rng.randint(min_chars, max_chars)
        problem, reasoning, answer, metadata = _generate_one(
            rng,
            target_chars=target,
            num_values=num_values,
            num_recalls=num_recalls,
            min_quote_distance_chars=min_quote_distance_chars,
        )
        rows.append(
            {
                "uuid": str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                "problem": problem,
                "expected_answer": answer,
                "messages": [
                    {"role": "user", "content": problem},
                    {"role": "assistant", "content": reasoning},
                ],
                "tools": [],
                "metadata": {"seed": seed, "index": i, **metadata},
                "data_source": DATA_SOURCE_TAG,
            }
        )
    return rows
