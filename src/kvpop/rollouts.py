"""Generation-based evaluation: pass@1 of sampled rollouts under a decode policy.

Problems (:class:`Problem`) are built by :func:`rollout_problems` from held-out records of two kinds:

* **Synthetic "complete the value" prompts** (records with long-range quotes, i.e. the traces of
  :mod:`kvpop.data.synthetic`). The prompt is the *chat-formatted trace itself* (user turn +
  assistant turn, as rendered by :func:`kvpop.filter.format_and_tokenize`) cut right before the
  first token of the **last long-range quote**: the value of the last ``Recall <name> = VVV.``
  line of the recall block. The prompt therefore ends with ``... Recall <name> =`` (and the space,
  when the tokenizer keeps it apart from the digits), and the gold answer is ``VVV``, the value
  that ``Let <name> = VVV.`` defined near the start of the trace, typically 400+ tokens back
  (the generator picks the recalled names among values defined at least
  ``min_quote_distance_chars`` before the recall block). Everything after the cut (the value,
  ``So a + b = ...``, the ``\\boxed{}`` sum) is dropped. We cut before the recalled *value*, not
  before the final ``\\boxed{``: the boxed sum is stated verbatim one line above it, so it is a
  short-range copy that any policy with a recent window answers. The answer kind is ``"value"``:
  the first number of the continuation (:func:`extract_answer`). With the default trace lengths
  (450-1,000 tokens with SmolLM2) the prompts are ~400-950 tokens, longer than the default
  budget of 384; ``min_prompt_tokens`` drops shorter ones.
* **Real problems** (records with no quotes: a ``problem`` and an ``expected_answer`` or
  ``answer``, e.g. benchmark rows from :func:`load_benchmark`). The prompt is the chat-templated
  user turn (problem + :data:`BOXED_INSTRUCTION` unless it already mentions ``\\boxed``) with
  ``add_generation_prompt=True``; the answer kind is ``"boxed"`` (last ``\\boxed{}``).

Inputs accepted by :func:`rollout_problems`: the records of the filter stage (``input_ids`` +
``quote_positions``; the raw text is not needed: the cut is a token index and the gold is decoded
from the quote's own tokens), raw rows (``messages`` + ``metadata["quotes"]``, tokenized here with
the same function the filter stage uses, so both give identical prompts), or plain
``{"problem", "answer"}`` rows.

Scoring (:func:`is_correct`) goes through ``math_verify`` (``parse`` + ``verify``), with both sides
wrapped in ``\\boxed{}``; its signal-based timeouts are used only in the main thread (elsewhere
they are disabled, as ``signal.alarm`` works only there), and any failure counts as wrong.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpop.decode import cache_bytes, enable, feed, generate, model_device, new_cache
from kvpop.geometry import CacheLayout
from kvpop.policies import Policy

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
ANSWER_KINDS = ("boxed", "value")
VERIFY_TIMEOUT_S = 5

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# --- answers -------------------------------------------------------------------------------------
def extract_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced;
    None if there is none or the last one is never closed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        # unclosed (e.g. a rollout cut by max_new_tokens): fall back to an earlier, closed box
    return None


def extract_answer(text: str, kind: str) -> str | None:
    """The predicted answer of a rollout.

    * ``"boxed"``: the content of the last ``\\boxed{}`` (:func:`extract_boxed`), else None;
    * ``"value"`` (synthetic "complete the value" prompts): the first number of the continuation
      (``" 381.\\nSo ..."`` -> ``"381"``). A ``\\boxed{}`` later in the continuation is *not* used:
      in these traces it holds the final sum, not the recalled value."""
    if kind == "boxed":
        return extract_boxed(text)
    if kind == "value":
        m = _NUMBER.search(text)
        return m.group(0) if m else None
    raise ValueError(f"unknown answer kind {kind!r}; known: {', '.join(ANSWER_KINDS)}")


def _wrap(answer: str) -> str:
    s = answer.strip()
    if "\\boxed" in s or (s.startswith("$") and s.endswith("$")):
        return s
    return f"\\boxed{{{s}}}"


def is_correct(pred: str | None, gold: str) -> bool:
    """Whether ``pred`` equals ``gold`` per ``math_verify`` (``1/2 == 0.5 == \\frac{1}{2}``,
    ``1,000 == 1000``...). None, empty, unparsable or timed-out predictions are wrong. Safe to
    call from any thread (math-verify's signal timeouts only run in the main thread)."""
    if pred is None or not str(pred).strip() or not str(gold).strip():
        return False
    from math_verify import parse, verify

    main = threading.current_thread() is threading.main_thread()
    t = VERIFY_TIMEOUT_S if main else None
    try:
        g = parse(_wrap(str(gold)), parsing_timeout=t)
        p = parse(_wrap(str(pred)), parsing_timeout=t)
        if not g or not p:
            return False
        return bool(verify(g, p, timeout_seconds=t))
    except BaseException as err:  # math-verify's TimeoutException derives from BaseException
        if isinstance(err, KeyboardInterrupt | SystemExit):
            raise
        return False


# --- problems ------------------------------------------------------------------------------------
@dataclass
class Problem:
    """One rollout problem: the prompt's token ids, the gold answer and how to extract a prediction."""

    id: str
    prompt_ids: list[int]
    gold: str
    kind: str = "boxed"  # see extract_answer


def _runs(positions: Sequence[int]) -> list[list[int]]:
    """Sorted token positions -> maximal runs of consecutive positions (one per quote)."""
    runs: list[list[int]] = []
    for p in sorted(positions):
        if runs and p == runs[-1][-1] + 1:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _trace_of(rec: dict, tokenizer) -> tuple[list[int], list[int]] | None:
    """(input_ids, quote_positions) of a filter record or of a raw row with quotes; None if neither."""
    if "input_ids" in rec:
        return list(rec["input_ids"]), list(rec.get("quote_positions") or [])
    meta = rec.get("metadata")
    quotes = meta.get("quotes") if isinstance(meta, dict) else None
    if rec.get("messages") and quotes:
        from kvpop.data.sources import validate_row
        from kvpop.filter import format_and_tokenize

        messages, reason = validate_row(rec)
        if messages is None:
            raise ValueError(f"row {rec.get('uuid')!r}: {reason}")
        trace = format_and_tokenize(messages, tokenizer, quotes=quotes)
        return trace.input_ids, trace.quote_positions
    return None


def _value_problem(pid: str, ids: list[int], quotes: list[int], tokenizer) -> Problem | None:
    """Cut before the last quote's first token; gold = the number its tokens spell."""
    last = _runs(quotes)[-1]
    m = _NUMBER.search(tokenizer.decode(ids[last[0] : last[-1] + 1]))
    if m is None or last[0] == 0:
        return None
    return Problem(pid, ids[: last[0]], m.group(0), "value")


def _problem_text(rec: dict) -> str:
    text = rec.get("problem")
    if not text and rec.get("messages"):
        text = next((m.get("content") for m in rec["messages"] if m.get("role") == "user"), None)
    return str(text or "")


def chat_prompt_ids(tokenizer, problem: str, instruction: str | None = BOXED_INSTRUCTION) -> list[int]:
    """Token ids of the chat-templated user turn ``problem`` (+ instruction) with the generation prompt."""
    content = problem if (not instruction or "\\boxed" in problem) else f"{problem}\n\n{instruction}"
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def rollout_problems(
    records: Iterable[dict],
    tokenizer,
    *,
    n_problems: int,
    min_prompt_tokens: int = 0,
    instruction: str | None = BOXED_INSTRUCTION,
) -> list[Problem]:
    """The first ``n_problems`` usable problems of held-out ``records`` (order kept; see the module
    docstring for the construction). Records whose prompt has fewer than ``min_prompt_tokens``
    tokens, or with no gold answer, are skipped."""
    problems: list[Problem] = []
    for i, rec in enumerate(records):
        if len(problems) >= n_problems:
            break
        pid = str(rec.get("id") or rec.get("uuid") or f"problem-{i}")
        trace = _trace_of(rec, tokenizer)
        if trace is not None and trace[1]:
            p = _value_problem(pid, *trace, tokenizer)
        else:
            gold = str(rec.get("expected_answer") or rec.get("answer") or "").strip()
            text = _problem_text(rec)
            p = Problem(pid, chat_prompt_ids(tokenizer, text, instruction), gold, "boxed") if gold and text else None
        if p is not None and len(p.prompt_ids) >= min_prompt_tokens:
            problems.append(p)
    return problems


# --- rollouts ------------------------------------------------------------------------------------
def _stop_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for x in (tokenizer.eos_token_id, tokenizer.pad_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, list | tuple):
            ids.update(int(y) for y in x)
    return ids


def _text_of(row: list[int], stop: set[int], tokenizer) -> str:
    """Decode a generated row up to (excluding) its first stop token."""
    end = next((i for i, t in enumerate(row) if t in stop), len(row))
    return tokenizer.decode(row[:end], skip_special_tokens=True)


def pass_at_1(
    model,
    tokenizer,
    policy: Policy,
    problems: Sequence[Problem],
    *,
    n: int,
    layout: CacheLayout,
    temperature: float,
    top_p: float,
    top_k: int,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 8,
    keep_texts: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """pass@1 of ``n`` rollouts per problem under ``policy`` (:func:`kvpop.decode.generate`).

    A rollout ends at EOS or after ``max_new_tokens``; its prediction is
    ``extract_answer(text, problem.kind)``, scored by :func:`is_correct`. The rollouts of a problem
    run as batches of up to ``batch_size`` copies of its prompt (seeded ``seed + 1000 * problem +
    batch``). Greedy decoding (``temperature <= 0``) is deterministic, so it runs one rollout per
    problem instead of ``n`` identical ones.

    Returns ``pass_at_1`` (mean accuracy over all rollouts, every problem weighted equally),
    ``per_problem`` ({id: accuracy}), ``tokens_per_s`` (mean decode throughput of the generate
    calls), ``peak_cache_mb`` (max over calls), ``n_problems``, ``rollouts_per_problem``,
    ``n_rollouts``, ``path`` (the decode path of :func:`kvpop.decode.generate`), and with ``keep_texts``
    ``samples`` ([{id, text, pred, gold, correct}])."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    per_row = 1 if temperature <= 0 else n
    stop = _stop_ids(model, tokenizer)
    per_problem: dict[str, float] = {}
    speeds: list[float] = []
    paths: set[str] = set()
    peak = 0.0
    samples: list[dict] = []
    for pi, prob in enumerate(problems):
        correct = 0
        done = 0
        for bi, start in enumerate(range(0, per_row, batch_size)):
            rows = min(batch_size, per_row - start)
            prompt = torch.tensor([prob.prompt_ids] * rows, dtype=torch.long)
            new, stats = generate(
                model, tokenizer, policy, prompt, layout=layout,
                max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                seed=seed + 1000 * pi + bi,
            )
            speeds.append(stats.tokens_per_s)
            paths.add(stats.path)
            peak = max(peak, stats.peak_cache_mb)
            for row in new.tolist():
                text = _text_of(row, stop, tokenizer)
                pred = extract_answer(text, prob.kind)
                ok = is_correct(pred, prob.gold)
                correct += ok
                done += 1
                if keep_texts:
                    samples.append({"id": prob.id, "text": text, "pred": pred, "gold": prob.gold, "correct": ok})
        per_problem[prob.id] = correct / done
        if progress:
            progress(pi + 1, len(problems))
    out = {
        "pass_at_1": sum(per_problem.values()) / max(1, len(per_problem)),
        "per_problem": per_problem,
        "tokens_per_s": sum(speeds) / max(1, len(speeds)),
        "peak_cache_mb": peak,
        "n_problems": len(per_problem),
        "rollouts_per_problem": per_row,
        "n_rollouts": per_row * len(per_problem),
        "path": "+".join(sorted(paths)),
    }
    if keep_texts:
        out["samples"] = samples
    return out


@torch.no_grad()
def memory_curve(
    model,
    tokenizer,
    policy: Policy,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    layout: CacheLayout,
    lengths: Iterable[int],
    rows: int = 1,
) -> list[tuple[int, float]]:
    """Allocated cache memory (MiB) after generating each of ``lengths`` tokens (0: after the
    prefill): one greedy decode of ``max(lengths)`` tokens (no EOS stop) of ``rows`` copies of the
    prompt (a batch, as :func:`pass_at_1` decodes its rollouts, so the two report the same memory)
    on the policy's reference cache (a DynamicCache for dense, which allocates as it grows). Dense
    grows linearly with the sequence; a bounded cache stays flat."""
    lengths = sorted(set(int(x) for x in lengths))
    if not lengths or lengths[0] < 0:
        raise ValueError(f"lengths must be non-negative and non-empty, got {lengths}")
    enable(model)
    device = model_device(model)
    policy.to(device)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = (ids[None] if ids.dim() == 1 else ids[:1]).expand(rows, -1)
    cache = new_cache(model, policy, layout)
    logits = feed(model, cache, ids, prefill=ids.shape[1])[:, -1]  # one pool takes the prompt past its budget token by token
    want = set(lengths)
    curve = []
    for step in range(lengths[-1] + 1):
        if step in want:
            curve.append((step, cache_bytes(cache) / 2**20))
        if step == lengths[-1]:
            break
        nxt = logits.argmax(-1, keepdim=True)
        logits = model(input_ids=nxt, past_key_values=cache).logits[:, -1]
    return curve


# --- competition benchmarks ----------------------------------------------------------------------
BENCHMARK_FIELDS: dict[str, dict[str, str]] = {
    # hub id -> {our field: dataset column}
    "HuggingFaceH4/aime_2024": {"problem": "problem", "answer": "answer"},
    "math-ai/aime25": {"problem": "problem", "answer": "answer"},
    "MathArena/hmmt_feb_2025": {"problem": "problem", "answer": "answer"},
}
_FALLBACK_FIELDS = {"problem": ("problem", "question", "Problem", "Question"), "answer": ("answer", "expected_answer", "Answer", "solution")}
_ID_FIELDS = ("id", "ID", "problem_idx", "uuid", "url")


class BenchmarkUnavailable(RuntimeError):
    """A benchmark could not be loaded (hub unreachable, unknown id, bad file); report as skipped."""


def _column(row: dict, ours: str, mapping: dict[str, str] | None) -> object:
    if mapping is not None:
        return row.get(mapping[ours])
    return next((row[c] for c in _FALLBACK_FIELDS[ours] if row.get(c) not in (None, "")), None)


def _local_rows(path: Path, split: str | None) -> list[dict]:
    if path.is_file() and path.suffix in (".jsonl", ".json"):
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json" and text.lstrip().startswith("["):
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if path.is_file() and path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.is_file():
        raise ValueError(f"unsupported benchmark file {path.name!r} (want .jsonl, .json or .parquet)")
    import datasets

    return _split_rows(datasets.load_dataset(str(path)), split)  # a dataset folder


def _split_rows(ds, split: str | None) -> list[dict]:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            if len(ds) != 1 and "test" not in ds:
                raise BenchmarkUnavailable(f"several splits ({', '.join(ds)}): pass split=")
            split = "test" if "test" in ds else next(iter(ds))
        ds = ds[split]
    return [dict(r) for r in ds]


def load_benchmark(hub_id_or_path: str | Path, *, split: str | None = None) -> list[dict]:
    """Competition problems as ``[{"id", "problem", "answer"}]`` from a hub dataset id
    (``datasets.load_dataset``; the columns come from :data:`BENCHMARK_FIELDS`, or the usual
    names for other ids) or a local JSONL/JSON/Parquet file or dataset folder in the same schema.

    Raises :class:`BenchmarkUnavailable` (a ``RuntimeError``) when the hub cannot be reached, the
    id or split does not exist, or the file cannot be read; the message says which."""
    name = str(hub_id_or_path)
    local = Path(name).expanduser()
    try:
        if local.exists():
            rows = _local_rows(local, split)
        else:
            import datasets

            ds = datasets.load_dataset(name, split=split) if split else datasets.load_dataset(name)
            rows = _split_rows(ds, split)
    except BenchmarkUnavailable:
        raise
    except Exception as err:  # ConnectionError, DatasetNotFoundError, FileNotFoundError, JSON errors...
        where = "local file" if local.exists() else "hub (unreachable or unknown id)"
        raise BenchmarkUnavailable(f"cannot load benchmark {name!r} from the {where}: {type(err).__name__}: {err}") from err
    mapping = BENCHMARK_FIELDS.get(name)
    out = []
    for i, row in enumerate(rows):
        problem, answer = _column(row, "problem", mapping), _column(row, "answer", mapping)
        if problem in (None, "") or answer in (None, ""):
            want = mapping or _FALLBACK_FIELDS
            raise BenchmarkUnavailable(f"benchmark {name!r} row {i}: no problem/answer (expected columns {want}, got {sorted(row)})")
        rid = next((row[c] for c in _ID_FIELDS if row.get(c) not in (None, "")), None)
        out.append({"id": str(rid) if rid is not None else f"{Path(name).stem}-{i}", "problem": str(problem), "answer": str(answer).strip()})
    return out
