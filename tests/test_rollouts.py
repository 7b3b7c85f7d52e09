"""Generation-based evaluation: answer extraction and scoring, rollout prompts, pass@1, memory, benchmarks."""

import json
import threading

import pytest

from kvpop.data.synthetic import generate_traces
from kvpop.filter import filter_rows
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy, resolve_policy
from kvpop.rollouts import (
    BOXED_INSTRUCTION,
    BenchmarkUnavailable,
    Problem,
    _stop_ids,
    _text_of,
    extract_answer,
    extract_boxed,
    is_correct,
    load_benchmark,
    memory_curve,
    pass_at_1,
    rollout_problems,
)


# --- answers -------------------------------------------------------------------------------------
def test_extract_boxed():
    assert extract_boxed("so \\boxed{42}.") == "42"
    assert extract_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # nested braces
    assert extract_boxed("\\boxed{\\{1, {2}\\}}") == "\\{1, {2}\\}"
    assert extract_boxed("first \\boxed{1}, then \\boxed{2}; final \\boxed{ 3 }") == "3"  # the last one
    assert extract_boxed("\\boxed{7} and a cut-off \\boxed{\\frac{1}{") == "7"  # unclosed last box
    assert extract_boxed("\\fbox{5}") == "5"
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed{") is None


def test_extract_answer_kinds():
    assert extract_answer(" 381.\nSo apple + river = 381 + 200 = 581.\nThe answer is \\boxed{581}.", "value") == "381"
    assert extract_answer("-12.5 and 3", "value") == "-12.5"
    assert extract_answer("no digits", "value") is None
    assert extract_answer("x \\boxed{12} y \\boxed{\\frac{3}{4}}", "boxed") == "\\frac{3}{4}"
    assert extract_answer("answer 12", "boxed") is None  # boxed problems need a box
    with pytest.raises(ValueError, match="unknown answer kind"):
        extract_answer("1", "nope")


@pytest.mark.parametrize(
    "pred, gold, ok",
    [
        ("381", "381", True),
        ("382", "381", False),
        ("0.5", "1/2", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac{3}{4}", "\\frac{3}{4}", True),
        ("1,000", "1000", True),
        ("\\sqrt{8}", "2\\sqrt{2}", True),
        ("033", "33", True),  # AIME-style zero padding
        ("\\boxed{12}", "12", True),  # already boxed
        ("", "12", False),
        (None, "12", False),
        ("12", "", False),
        ("\\frac{", "12", False),  # unparsable
        ("hello", "12", False),
    ],
)
def test_is_correct(pred, gold, ok):
    assert is_correct(pred, gold) is ok


def test_is_correct_off_the_main_thread():
    out = {}
    t = threading.Thread(target=lambda: out.update(a=is_correct("0.5", "1/2"), b=is_correct("3", "1/2")))
    t.start()
    t.join()
    assert out == {"a": True, "b": False}


def test_scoring_of_fixed_rollout_texts(tiny_tokenizer):
    """The exact path pass_at_1 takes from generated ids to a verdict, on fixed texts."""
    tok = tiny_tokenizer
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id}
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def verdict(text, kind, gold, tail=()):
        ids = tok(text, add_special_tokens=False)["input_ids"] + list(tail)
        return is_correct(extract_answer(_text_of(ids, stop, tok), kind), gold)

    assert verdict(" 381.\nSo", "value", "381")
    assert not verdict(" 318.\nSo", "value", "381")
    # text after EOS (and padding of a finished batch row) is ignored
    assert not verdict(" 7.", "value", "381", tail=[eos, *tok(" 381", add_special_tokens=False)["input_ids"]])
    assert verdict("Step 3: 17 * 4 = 68. \\boxed{68}", "boxed", "68", tail=[eos, tok.pad_token_id])
    assert verdict("\\boxed{1/2}", "boxed", "0.5")
    assert not verdict("The answer is 68", "boxed", "68")  # no box, no credit


# --- problems ------------------------------------------------------------------------------------
def _value_of_last_quote(row):
    meta = row["metadata"]
    return str({v["name"]: v["value"] for v in meta["values"]}[meta["quote_names"][-1]])


def test_rollout_problems_synthetic(tiny_tokenizer):
    tok = tiny_tokenizer
    rows = generate_traces(6, seed=3)
    records, _ = filter_rows(rows, tok, max_tokens=100_000)
    problems = rollout_problems(records, tok, n_problems=4, min_prompt_tokens=384)
    assert len(problems) == 4 and all(isinstance(p, Problem) for p in problems)
    by_id = {r["uuid"]: r for r in rows}
    for p, rec in zip(problems, records, strict=False):
        row = by_id[p.id]
        name = row["metadata"]["quote_names"][-1]
        assert p.kind == "value" and p.gold == _value_of_last_quote(row)
        assert len(p.prompt_ids) >= 384 and p.prompt_ids == rec["input_ids"][: len(p.prompt_ids)]
        text = tok.decode(p.prompt_ids)
        # the prompt ends right before the recalled value, which is not in the recall block
        assert text.rstrip().endswith(f"Recall {name} =")
        assert f"Recall {name} = {p.gold}" not in text and "\\boxed" not in text
        # ... but its definition is far back in the prompt
        define = text.index(f"Let {name} = {p.gold}.")
        assert len(tok(text[define:], add_special_tokens=False)["input_ids"]) > 150
    # raw rows give the very same problems (tokenized like the filter stage does)
    raw = rollout_problems(rows, tok, n_problems=4, min_prompt_tokens=384)
    assert [(p.id, p.prompt_ids, p.gold) for p in raw] == [(p.id, p.prompt_ids, p.gold) for p in problems]
    # prompts shorter than min_prompt_tokens are skipped; n_problems caps the count
    assert rollout_problems(records, tok, n_problems=10, min_prompt_tokens=100_000) == []
    assert len(rollout_problems(records, tok, n_problems=2)) == 2


def test_rollout_problems_real_rows(tiny_tokenizer):
    tok = tiny_tokenizer
    rows = [
        {"id": "a", "problem": "Compute 17 * 4.", "expected_answer": "68", "input_ids": [1, 2, 3], "quote_positions": []},
        {"id": "b", "problem": "What is 1/2 + 0?", "answer": "\\frac{1}{2}"},
        {"id": "c", "problem": "No answer here."},  # skipped: no gold
        {"id": "d", "problem": "Put it in \\boxed{} please: 2 + 2.", "answer": "4"},
    ]
    problems = rollout_problems(rows, tok, n_problems=5)
    assert [(p.id, p.gold, p.kind) for p in problems] == [("a", "68", "boxed"), ("b", "\\frac{1}{2}", "boxed"), ("d", "4", "boxed")]
    text = tok.decode(problems[0].prompt_ids)
    assert text == f"<|im_start|>user\nCompute 17 * 4.\n\n{BOXED_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    assert BOXED_INSTRUCTION not in tok.decode(problems[2].prompt_ids)  # already asks for a box
    bare = rollout_problems(rows[:1], tok, n_problems=1, instruction=None)[0]
    assert tok.decode(bare.prompt_ids) == "<|im_start|>user\nCompute 17 * 4.<|im_end|>\n<|im_start|>assistant\n"


# --- rollouts with a tiny model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_tokenizer, tiny_model):
    return tiny_model("llama", vocab_size=len(tiny_tokenizer))


@pytest.fixture(scope="module")
def short_problems(tiny_tokenizer):
    rows = generate_traces(3, seed=1, min_chars=250, max_chars=300, num_values=6, num_recalls=2, min_quote_distance_chars=100)
    return rollout_problems(rows, tiny_tokenizer, n_problems=3)


def test_pass_at_1_runs(model, tiny_tokenizer, short_problems):
    kw = dict(layout=CacheLayout(64, 4, 16), top_p=0.95, top_k=20, max_new_tokens=4, seed=0)
    res = pass_at_1(model, tiny_tokenizer, resolve_policy("streaming_llm"), short_problems, n=3, temperature=0.8, batch_size=2, keep_texts=True, **kw)
    assert 0.0 <= res["pass_at_1"] <= 1.0 and res["n_problems"] == 3
    assert res["rollouts_per_problem"] == 3 and res["n_rollouts"] == 9 and len(res["samples"]) == 9
    assert set(res["per_problem"]) == {p.id for p in short_problems}
    assert all(v in (0.0, 1 / 3, 2 / 3, 1.0) for v in res["per_problem"].values())
    assert res["pass_at_1"] == pytest.approx(sum(s["correct"] for s in res["samples"]) / 9)
    assert res["tokens_per_s"] > 0 and res["peak_cache_mb"] > 0
    # greedy: one deterministic rollout per problem, and the dense cache is larger
    dense = pass_at_1(model, tiny_tokenizer, resolve_policy("dense"), short_problems, n=3, temperature=0.0, **kw)
    assert dense["n_rollouts"] == 3 and dense["rollouts_per_problem"] == 1
    assert dense["peak_cache_mb"] > res["peak_cache_mb"]
    # sampling is reproducible from the seed
    again = pass_at_1(model, tiny_tokenizer, resolve_policy("streaming_llm"), short_problems, n=3, temperature=0.8, batch_size=2, keep_texts=True, **kw)
    assert [s["text"] for s in again["samples"]] == [s["text"] for s in res["samples"]]
    with pytest.raises(ValueError, match="n must be"):
        pass_at_1(model, tiny_tokenizer, resolve_policy("dense"), short_problems, n=0, temperature=0.0, **kw)


def test_stop_ids_include_generation_config(model, tiny_tokenizer):
    ids = _stop_ids(model, tiny_tokenizer)
    assert tiny_tokenizer.eos_token_id in ids and tiny_tokenizer.pad_token_id in ids


def test_memory_curve_dense_grows_bounded_flat(model, tiny_tokenizer):
    prompt = list(range(3, 43))  # 40 tokens
    lengths = [0, 8, 16, 24]
    kw = dict(layout=CacheLayout(24, 2, 8), lengths=lengths)
    dense = memory_curve(model, tiny_tokenizer, resolve_policy("dense"), prompt, **kw)
    bounded = memory_curve(model, tiny_tokenizer, resolve_policy("streaming_llm"), prompt, **kw)
    tova = memory_curve(model, tiny_tokenizer, resolve_policy("tova"), prompt, **kw)
    assert [x for x, _ in dense] == lengths == [x for x, _ in bounded]
    mb = [y for _, y in dense]
    assert all(a < b for a, b in zip(mb, mb[1:], strict=False))
    assert mb[-1] / mb[0] == pytest.approx(64 / 40)  # linear in the sequence length
    assert len({y for _, y in bounded}) == 1 and len({y for _, y in tova}) == 1
    assert bounded[0][1] < dense[0][1]
    cfg = model.config  # one pool for all layers: its 40-token prompt goes past the budget token by token
    pool = make_policy("dbtrimkv", num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    one_pool = memory_curve(model, tiny_tokenizer, pool, prompt, **kw)
    assert [x for x, _ in one_pool] == lengths and len({y for _, y in one_pool}) == 1 and one_pool[0][1] < dense[0][1]
    with pytest.raises(ValueError):
        memory_curve(model, tiny_tokenizer, resolve_policy("dense"), prompt, layout=CacheLayout(24, 2, 8), lengths=[])


# --- benchmarks ----------------------------------------------------------------------------------
BENCH = [
    {"id": 60, "problem": "Find $x$ if $x + 1 = 3$.", "answer": "2", "url": "u"},
    {"id": 61, "problem": "Compute $1/2 + 1/4$.", "answer": " \\frac{3}{4} "},
]


def test_load_benchmark_local_jsonl(tmp_path, tiny_tokenizer):
    path = tmp_path / "aime.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in BENCH) + "\n")
    rows = load_benchmark(path)
    assert rows == [
        {"id": "60", "problem": "Find $x$ if $x + 1 = 3$.", "answer": "2"},
        {"id": "61", "problem": "Compute $1/2 + 1/4$.", "answer": "\\frac{3}{4}"},
    ]
    problems = rollout_problems(rows, tiny_tokenizer, n_problems=5)
    assert [(p.id, p.gold, p.kind) for p in problems] == [("60", "2", "boxed"), ("61", "\\frac{3}{4}", "boxed")]
    # other column names (question / expected_answer), no id, a JSON array file
    alt = tmp_path / "alt.json"
    alt.write_text(json.dumps([{"question": "1 + 1?", "expected_answer": "2"}]))
    assert load_benchmark(str(alt)) == [{"id": "alt-0", "problem": "1 + 1?", "answer": "2"}]


def test_load_benchmark_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "hmmt.parquet"
    pq.write_table(pa.Table.from_pylist(BENCH), path)
    assert [r["answer"] for r in load_benchmark(path)] == ["2", "\\frac{3}{4}"]


def test_load_benchmark_errors(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    # offline mode makes the failure immediate (the real "unreachable" path retries for ~20 s)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(BenchmarkUnavailable, match="kvpop-no-such-org/no-such-benchmark.*hub") as err:
        load_benchmark("kvpop-no-such-org/no-such-benchmark")
    assert isinstance(err.value, RuntimeError)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "x"\n')
    with pytest.raises(BenchmarkUnavailable, match="local file"):
        load_benchmark(bad)
    cols = tmp_path / "cols.jsonl"
    cols.write_text(json.dumps({"text": "x", "label": "1"}) + "\n")
    with pytest.raises(BenchmarkUnavailable, match="no problem/answer"):
        load_benchmark(cols)
