"""kvpop.ruler: RULER's 13 tasks generated offline by RULER's own generators (the kvpop[ruler] extra), RULER's
metric on hand-made answers, every policy on the same samples (against plain twins), and
evaluate.benchmarks.ruler. Tests that need the extra skip without it.

The samples come from a tokenizer built like conftest's tiny one (byte-level BPE, digits one by one, the
ChatML template) but trained on RULER's own text to 2,048 tokens: conftest's, trained on two sentences to
320, spends about 4 tokens per English word, and RULER's vt generator, whose in-context example must fit
in 500 tokens, would loop forever with it (:func:`kvpop.ruler.vt_example_tokens`: refused, tested below)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpop import ruler
from kvpop.config import ParamsError, parse_params

#: qa's first 10 documents take about 2,800 tokens of the test tokenizer (SmolLM2: 1,700)
SEQ_LEN = 4096
SAMPLES = 2
#: references per sample of each task (synthetic.yaml's needle counts, vt's 1 + 4 hops, cwe's 10 words, fwe's 3)
REFERENCES = {"niah_single_1": 1, "niah_single_2": 1, "niah_single_3": 1, "niah_multikey_1": 1, "niah_multikey_2": 1, "niah_multikey_3": 1,
              "niah_multivalue": 4, "niah_multiquery": 4, "vt": 5, "cwe": 10, "fwe": 3}


@pytest.fixture(scope="module")
def lce():
    return pytest.importorskip("long_context_eval", reason=f"RULER needs the '{ruler.EXTRA}' extra: {ruler.INSTALL}")


@pytest.fixture(scope="module")
def rtok(lce, tmp_path_factory):
    """(tokenizer, its folder): conftest's recipe trained on RULER's templates and 300,000 characters of its essays."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from conftest import CHATML

    essay = json.loads((ruler.require() / "data/synthetic/json/PaulGrahamEssays.json").read_text())["text"][:300_000]
    corpus = [ruler.task_spec(t).template for t in ruler.TASKS] + [essay[i : i + 2000] for i in range(0, len(essay), 2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>")
    fast.chat_template = CHATML
    folder = tmp_path_factory.mktemp("ruler_tokenizer")
    fast.save_pretrained(folder)
    return fast, folder


@pytest.fixture(scope="module")
def generated(rtok):
    """Every task, 2 samples each, at SEQ_LEN tokens (about a minute on two cores: each niah generator
    builds RULER's 6 M word pairs)."""
    tok, folder = rtok
    return ruler.generate_samples(folder, tasks=ruler.TASKS, seq_len=SEQ_LEN, samples=SAMPLES, tokenizer=tok, workers=2)


def test_the_task_list_is_the_packages(lce):
    assert ruler.package_tasks() == list(ruler.TASKS)
    specs = {t: ruler.task_spec(t) for t in ruler.TASKS}
    assert {t for t, s in specs.items() if s.metric == "string_match_part"} == {"qa_1", "qa_2"}
    assert all(s.metric == "string_match_all" for t, s in specs.items() if not t.startswith("qa_"))
    assert [specs[t].tokens_to_generate for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")] == [128, 30, 120, 50, 32]
    assert all(s.script.is_file() for s in specs.values())
    with pytest.raises(ValueError, match="unknown RULER task 'niah'"):
        ruler.task_spec("niah")


@pytest.mark.slow
def test_every_task_generates_offline(generated, rtok):
    tok = rtok[0]
    assert list(generated) == list(ruler.TASKS)
    wrap = ruler.chat_wrap(tok)
    for task, samples in generated.items():
        spec = ruler.task_spec(task)
        assert [s.index for s in samples] == list(range(SAMPLES)), task
        for s in samples:
            n = len(s.prompt_ids) + s.max_new_tokens
            assert SEQ_LEN // 2 < n <= SEQ_LEN, (task, n)  # RULER fills the context, prompt and answer
            text = tok.decode(s.prompt_ids)
            assert text.startswith(wrap[0]) and wrap[1] in text, task
            prefix = text.rpartition(wrap[1])[2]  # the assistant's turn: RULER's answer prefix
            assert prefix.startswith(spec.answer_prefix.split("{")[0].strip()), (task, prefix)
            assert len(s.outputs) == REFERENCES.get(task, len(s.outputs)) and all(s.outputs), task
            if not task.startswith("qa_"):  # every reference is in the context, and those are its sources
                assert all(o in text for o in s.outputs), task
                spelled = tok.decode([s.prompt_ids[i] for i in s.source_positions])
                assert all(o in spelled for o in s.outputs), task
            # the gold rendering scores 1 under the task's own metric, nothing scores 0
            gold = tok.decode(s.answer_ids)
            assert ruler.score([gold, ""], [s.outputs, s.outputs], s.metric) == [1.0, 0.0], task
    assert generated["niah_single_1"][0].outputs != generated["niah_single_1"][1].outputs  # samples differ
    assert generated["qa_1"][0].outputs != generated["qa_2"][0].outputs  # SQuAD and HotpotQA


@pytest.mark.slow
def test_samples_are_deterministic_by_seed(generated, rtok):
    """A task alone in its own child gives the samples it gave beside the other twelve; another seed others."""
    tok, folder = rtok
    alone = ruler.generate_samples(folder, tasks=["fwe", "vt"], seq_len=SEQ_LEN, samples=SAMPLES, tokenizer=tok, workers=1)
    assert alone == {t: generated[t] for t in ("fwe", "vt")}
    assert ruler.fingerprint(alone) == ruler.fingerprint({t: generated[t] for t in ("vt", "fwe")})
    other = ruler.generate_samples(folder, tasks=["vt"], seq_len=SEQ_LEN, samples=SAMPLES, seed=ruler.DEFAULT_SEED + 1, tokenizer=tok)
    assert other["vt"][0].outputs != generated["vt"][0].outputs


def test_fwe_alone_leaves_room_for_its_answer(lce):
    """RULER's fwe generator sizes its prompt alone to max_seq_length (the others size prompt plus answer): its
    answer's tokens come off (with SmolLM2's tokenizer at 4,096 a prompt of 4,083 tokens left no room for 50)."""
    assert {t: ruler.reserved_by_us(t) for t in ruler.TASKS} == {t: 50 if t == "fwe" else 0 for t in ruler.TASKS}


def test_generate_samples_gives_fwe_the_shorter_length(lce, tiny_llama_dir, tiny_tokenizer, monkeypatch):
    """generate_samples asks RULER's generators for the context minus the template, and fwe's for its answer's
    tokens less (the generators' arguments as they reach generate_raw, which runs them)."""
    asked = {}

    def generators(tasks, tokenizer_dir, *, max_seq_length, **kw):
        asked.update(max_seq_length)
        return {t: [] for t in tasks}

    monkeypatch.setattr(ruler, "generate_raw", generators)
    ruler.generate_samples(tiny_llama_dir, tasks=["fwe", "niah_single_1"], seq_len=SEQ_LEN, samples=1, tokenizer=tiny_tokenizer)
    room = SEQ_LEN - ruler.template_tokens(tiny_tokenizer)
    assert asked == {"niah_single_1": room, "fwe": room - 50}


def test_a_tokenizer_too_dense_for_vt_is_refused(lce, tiny_llama_dir, tiny_tokenizer):
    """conftest's tokenizer would make RULER's vt generator loop forever: refused before it runs."""
    assert ruler.vt_example_tokens(tiny_tokenizer) > ruler.VT_EXAMPLE_TOKENS
    with pytest.raises(ValueError, match="vt generator would loop forever"):
        ruler.generate_samples(tiny_llama_dir, tasks=["fwe", "vt"], seq_len=SEQ_LEN, samples=1, tokenizer=tiny_tokenizer)


# --- RULER's metric on hand-made answers ---------------------------------------------------------
ALL = ["4744854", "1287432", "CMBTT"]  # string_match_all: the share of the references found
PART = ["Denver Broncos", "the Broncos"]  # string_match_part (qa): whether any is


@pytest.mark.parametrize(("pred", "want"), [
    ("The numbers are 4744854, 1287432 and cmbtt.", 1.0),  # right (case-insensitive)
    ("I cannot find them.", 0.0),  # wrong
    ("4744854 and then 128 7432, and CMBTT", 2 / 3),  # partly right: two of three
    ("", 0.0),
])
def test_string_match_all(lce, pred, want):
    assert ruler.score([pred], [ALL], "string_match_all") == [pytest.approx(want)]


@pytest.mark.parametrize(("pred", "want"), [
    ("The Denver Broncos won Super Bowl 50.", 1.0),  # right
    ("Carolina Panthers", 0.0),  # wrong
    ("the broncos", 1.0),  # partly right: one reference of two suffices
    ("Denver", 0.0),  # a part of a reference is not one
])
def test_string_match_part(lce, pred, want):
    assert ruler.score([pred], [PART], "string_match_part") == [want]


def test_scores_average_to_rulers_own_aggregate(lce):
    from long_context_eval.eval.synthetic.constants import string_match_all, string_match_part

    preds = ["4744854 CMBTT", "nothing", "1287432, 4744854, cmbtt", "CMBTT"]
    refs = [ALL] * 4
    assert sum(ruler.score(preds, refs, "string_match_all")) / 4 == pytest.approx(string_match_all(preds, refs) / 100, abs=5e-5)
    preds = ["Denver Broncos", "no", "the Broncos"]
    assert sum(ruler.score(preds, [PART] * 3, "string_match_part")) / 3 == pytest.approx(string_match_part(preds, [PART] * 3) / 100, abs=5e-5)
    with pytest.raises(ValueError, match="unknown RULER metric"):
        ruler.score(["x"], [["x"]], "exact_match")


def test_predictions_are_cleaned_as_ruler_cleans_them(lce):
    assert ruler.postprocess("  4744854\x00\x1f1287432 \t") == "4744854\n\n1287432"  # control characters to newlines
    assert ruler.postprocess(None) == ""
    assert ruler.score(["1287\x004744854"], [["4744854"]], "string_match_all") == [1.0]


def test_the_answer_prefix_is_split_off():
    prefix = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
    text = "Some text. What is the special magic number for x? The special magic number for x mentioned in the provided text is"
    user, rest = ruler.split_answer_prefix(text, prefix)
    assert user == "Some text. What is the special magic number for x?" and rest.startswith(" The special magic number")
    with pytest.raises(ValueError, match="does not end with its answer prefix"):
        ruler.split_answer_prefix("no prefix here", prefix)
    assert ruler.gold_text("common_words_extraction", ["a", "b"]) == " 1. a 2. b"
    assert ruler.gold_text("variable_tracking", ["AB", "CD"]) == " AB CD"
    assert ruler.gold_text("qa", ["x", "y"]) == " x"


# --- every policy on the same samples ------------------------------------------------------------
SMALL = 1536


@pytest.fixture(scope="module")
def small(rtok):
    """vt and fwe at 1,536 tokens, 2 samples each (H2O decodes past its budget token by token)."""
    tok, folder = rtok
    return ruler.generate_samples(folder, tasks=["vt", "fwe"], seq_len=SMALL, samples=2, tokenizer=tok)


def _models(vocab: int):
    from kvpop.attention import register

    from conftest import build_tiny_model

    kw = dict(vocab_size=vocab, max_position_embeddings=SMALL + 64)
    return build_tiny_model(attn_implementation=register(), **kw), build_tiny_model(**kw)  # same weights (seed 0)


@pytest.mark.slow
def test_every_policy_on_the_same_samples(small, rtok):
    from kvpop.decode import generate
    from kvpop.evaluate import Candidate
    from kvpop.geometry import CacheLayout
    from kvpop.policies import make_policy

    tok = rtok[0]
    model, plain = _models(len(tok))
    longest = max(len(s.prompt_ids) + len(s.answer_ids) + s.max_new_tokens for ss in small.values() for s in ss)
    names = ("h2o", "dense", "streaming_llm", "oracle_target", "oracle_sources")  # h2o first: it switches the model to the cache attention
    cands = [Candidate(n, model, make_policy(n), max_traces=3 if n == "h2o" else None) for n in names]  # as the stage: decode_traces
    entries = {}  # on_task: each policy's task as soon as it ends, its figures final
    tight = ruler.evaluate_ruler(small, tok, model, cands, layout=CacheLayout(256, 4, 64), reference_samples=1,
                                 on_task=lambda name, task, entry: entries.setdefault(name, []).append((task, entry)))
    assert set(tight) == set(names)
    for name in names:
        assert [t for t, _ in entries[name]] == list(small), name
        assert ruler.merge_parts([e for _, e in entries[name]], list(small)) == tight[name], name
    for name, m in tight.items():
        assert list(m["teacher_forced"]) == ["vt", "fwe", "mean"], name
        assert all(0 <= v <= 1 for v in m["teacher_forced"].values())
        assert m["teacher_forced_samples"] == ({"vt": 1, "fwe": 1} if name == "h2o" else {"vt": 2, "fwe": 2})  # reference_samples
        if name.startswith("oracle"):  # ceilings: teacher-forced only
            assert m["accuracy"] == {} and "path" not in m
            continue
        assert m["path"] == ("reference" if name == "h2o" else "engine")
        assert m["samples"] == ({"vt": 1, "fwe": 1} if name == "h2o" else {"vt": 2, "fwe": 2})  # decoded token by token: the first only
        assert list(m["accuracy"]) == ["vt", "fwe", "mean"] and m["accuracy"]["mean"] == pytest.approx(sum(m["accuracy"][t] for t in small) / 2)
        assert [len(a) for a in m["answers"].values()] == list(m["samples"].values())
    assert tight["dense"]["kl"]["vt"] == pytest.approx(0.0, abs=1e-6) and tight["streaming_llm"]["kl"]["vt"] > 1e-6  # it evicts

    # the twins: teacher-forced accuracy from a plain forward of the same weights; greedy answers from transformers' generate
    for task, samples in small.items():
        hit = tokens = 0
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.answer_ids])
            pred = plain(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].argmax(-1)
            hit += (pred == torch.tensor(s.answer_ids)).sum().item()
            tokens += len(s.answer_ids)
        assert tight["dense"]["teacher_forced"][task] == pytest.approx(hit / tokens), task
        s = samples[0]
        new = plain.generate(torch.tensor([s.prompt_ids]), attention_mask=torch.ones(1, len(s.prompt_ids), dtype=torch.long), do_sample=False,
                             max_new_tokens=s.max_new_tokens, pad_token_id=tok.pad_token_id)[0, len(s.prompt_ids) :]
        stop = {tok.eos_token_id, tok.pad_token_id}
        ids = new.tolist()
        ids = ids[: next((i for i, t in enumerate(ids) if t in stop), len(ids))]
        assert tight["dense"]["answers"][task][0] == tok.decode(ids, skip_special_tokens=True), task
        direct, _ = generate(model, tok, make_policy("streaming_llm"), s.prompt_ids, layout=CacheLayout(256, 4, 64),
                             max_new_tokens=s.max_new_tokens)
        assert tight["streaming_llm"]["answers"][task][0] == tok.decode(direct[0].tolist(), skip_special_tokens=True)

    # each task alone, merged (the workers' split of a policy's tasks): the whole run's figures and answers
    alone = [ruler.evaluate_ruler({t: small[t]}, tok, model, cands[1:4], layout=CacheLayout(256, 4, 64)) for t in ("fwe", "vt")]
    for name in names[1:4]:
        assert ruler.merge_parts([part[name] for part in alone], list(small)) == tight[name], name

    # a budget that holds every sample whole: the bounded policy is dense
    wide = ruler.evaluate_ruler(small, tok, model, cands[1:3], layout=CacheLayout(longest, 4, 64))
    for key in ("accuracy", "teacher_forced", "answers"):
        assert wide["streaming_llm"][key] == wide["dense"][key] == {k: v for k, v in tight["dense"][key].items()}, key


def test_merge_parts_is_the_whole_run_over_disjoint_task_groups():
    """merge_parts: per-task entries united in the tasks' order, means over every task again, what is not per task
    kept where the parts agree; a task held twice, by none, or unknown, and parts that disagree, are refused by name."""
    a = {"accuracy": {"vt": 1.0, "mean": 1.0}, "teacher_forced": {"vt": 0.5, "mean": 0.5}, "kl": {"vt": 0.1},
         "samples": {"vt": 2}, "scores": {"vt": [1.0, 1.0]}, "answers": {"vt": ["x", "y"]}, "teacher_forced_samples": {"vt": 2},
         "path": "engine"}
    b = {"accuracy": {"fwe": 0.0, "cwe": 0.5, "mean": 0.25}, "teacher_forced": {"fwe": 0.25, "cwe": 0.75, "mean": 0.5},
         "kl": {"fwe": 0.2, "cwe": 0.3}, "samples": {"fwe": 2, "cwe": 2}, "scores": {"fwe": [0.0, 0.0], "cwe": [0.5, 0.5]},
         "answers": {"fwe": ["a", "b"], "cwe": ["c", "d"]}, "teacher_forced_samples": {"fwe": 2, "cwe": 2}, "path": "engine"}
    m = ruler.merge_parts([b, a], ["vt", "cwe", "fwe"])
    assert list(m["accuracy"]) == ["vt", "cwe", "fwe", "mean"] and m["accuracy"]["mean"] == pytest.approx(0.5)
    assert m["teacher_forced"]["mean"] == pytest.approx(0.5) and m["kl"] == {"vt": 0.1, "cwe": 0.3, "fwe": 0.2}
    assert m["answers"]["cwe"] == ["c", "d"] and m["path"] == "engine" and m["samples"] == {"vt": 2, "cwe": 2, "fwe": 2}
    oracle = ruler.merge_parts([{"accuracy": {}, "teacher_forced": {"vt": 0.5, "mean": 0.5}}, {"accuracy": {}, "teacher_forced": {"fwe": 1.0, "mean": 1.0}}],
                               ["vt", "fwe"])
    assert oracle["accuracy"] == {} and oracle["teacher_forced"] == {"vt": 0.5, "fwe": 1.0, "mean": 0.75}
    with pytest.raises(ValueError, match="task 'vt' in parts 0 and 1"):
        ruler.merge_parts([a, a], ["vt"])
    with pytest.raises(ValueError, match=r"no part holds task\(s\) \['qa_1'\]"):
        ruler.merge_parts([a, b], ["vt", "cwe", "fwe", "qa_1"])
    with pytest.raises(ValueError, match="task 'fwe' of part 1 is not among"):
        ruler.merge_parts([a, b], ["vt", "cwe"])
    with pytest.raises(ValueError, match="disagree on 'path'"):
        ruler.merge_parts([a, {**b, "path": "reference"}], ["vt", "cwe", "fwe"])
    # task_entry: one task of a result; a result's entries, merged, are the result
    whole = ruler.merge_parts([b, a], ["vt", "cwe", "fwe"])
    entries = [ruler.task_entry(whole, t) for t in ("fwe", "vt", "cwe")]
    assert entries[0] == {"accuracy": {"fwe": 0.0}, "teacher_forced": {"fwe": 0.25}, "kl": {"fwe": 0.2}, "samples": {"fwe": 2},
                          "scores": {"fwe": [0.0, 0.0]}, "answers": {"fwe": ["a", "b"]}, "teacher_forced_samples": {"fwe": 2}, "path": "engine"}
    assert ruler.merge_parts(entries, ["vt", "cwe", "fwe"]) == whole
    assert ruler.task_entry(oracle, "fwe") == {"accuracy": {}, "teacher_forced": {"fwe": 1.0}}


# --- params and the extra ------------------------------------------------------------------------
def test_params_key_is_validated():
    off = parse_params({}).evaluate.benchmarks.ruler
    assert not off.enabled and off.samples == 0 and off.tasks == list(ruler.TASKS) and off.seed == ruler.DEFAULT_SEED  # off by default
    assert parse_params({"evaluate": {"benchmarks": {"ruler": {"tasks": ["qa_1"]}}}}).ruler_seq_len == 1024  # off: not checked
    p = parse_params({"evaluate": {"benchmarks": {"ruler": {"samples": 2}, "aime_2024": "HuggingFaceH4/aime_2024"}}, "train": {"seq_len": 2048}})
    assert p.evaluate.benchmarks.ruler.enabled and p.ruler_seq_len == 2048
    assert p.evaluate.benchmarks.competition() == {"aime_2024": "HuggingFaceH4/aime_2024"}
    p = parse_params({"evaluate": {"benchmarks": {"ruler": {"tasks": ["vt", "cwe"], "seq_len": 1024, "samples": 3, "reference_samples": 0}}}})
    assert (p.ruler_seq_len, p.evaluate.benchmarks.ruler.samples, p.evaluate.benchmarks.competition()) == (1024, 3, {})
    bad = [
        ({"tasks": ["niah"]}, r"evaluate\.benchmarks\.ruler\.tasks: unknown RULER tasks \['niah'\]"),
        ({"tasks": []}, r"evaluate\.benchmarks\.ruler\.tasks: no task"),
        ({"tasks": ["vt", "vt"]}, r"evaluate\.benchmarks\.ruler\.tasks: a task is listed twice"),
        ({"samples": -1}, r"evaluate\.benchmarks\.ruler\.samples"),
        ({"batch": 0}, r"evaluate\.benchmarks\.ruler\.batch: Input should be greater than or equal to 1"),
        ({"workers": 0}, r"evaluate\.benchmarks\.ruler\.workers: Input should be greater than or equal to 1"),
        ({"sample": 2}, r"evaluate\.benchmarks\.ruler\.sample: unknown key"),
        ({"samples": 1, "tasks": ["qa_1"]}, r"train\.seq_len \(evaluate\.benchmarks\.ruler\.seq_len: null\) is 1024: too short .*'qa_1'"),
        ({"samples": 1, "tasks": ["vt"], "seq_len": 1000}, r"evaluate\.benchmarks\.ruler\.seq_len is 1000: too short"),
    ]
    for cfg, match in bad:
        with pytest.raises(ParamsError, match=match):
            parse_params({"evaluate": {"benchmarks": {"ruler": cfg}}})
    with pytest.raises(ParamsError, match=r"evaluate\.benchmarks\.aime: Input should be a valid string"):
        parse_params({"evaluate": {"benchmarks": {"aime": {"tasks": []}}}})


def test_a_missing_extra_is_named(monkeypatch):
    monkeypatch.setattr(ruler, "_MODULES", ("kvpop_no_such_module",))
    why = ruler.missing()
    assert "'ruler' extra" in why and ruler.INSTALL in why and "kvpop_no_such_module" in why
    with pytest.raises(ruler.RulerUnavailable, match=r"pip install -e '\.\[ruler\]'"):
        ruler.require()


def test_a_context_too_short_is_refused_before_any_work(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"too short for RULER's generators of \['qa_2'\]"):
        ruler.generate_samples(tiny_llama_dir, tasks=["vt", "qa_2"], seq_len=2000, samples=1)


def test_bench_ruler_gathers_runs_with_their_provenance(tmp_path, capsys):
    """bench/bench_ruler.py: an evaluate run's RULER section as a configuration, the provenance of the machine that ran
    it (``--provenance``), a Markdown table per run; a file without RULER, or a bad provenance file, is exit 2 naming it."""
    from conftest import bench_script

    bench = bench_script("bench_ruler")
    acc = {"accuracy": {"vt": 0.5, "mean": 0.5}, "teacher_forced": {"vt": 0.75, "mean": 0.75}}
    section = {"tasks": ["vt"], "seq_len": 4096, "budget": 512, "samples": 25, "seed": 42, "fingerprint": "f",
               "policies": {"dense": acc, "oracle_target": {"accuracy": {}, "teacher_forced": {"vt": 1.0, "mean": 1.0}}}}
    (tmp_path / "eval.json").write_text(json.dumps({"policies": {}, "ruler": section}))
    prov = {"command": "run_stages", "git_commit": "a" * 40, "device": "NVIDIA H200", "versions": {"torch": "2.11.0"}, "date": "2026-12-05"}
    (tmp_path / "prov.json").write_text(json.dumps(prov))
    out = tmp_path / "h200.json"
    assert bench.main(["--eval", f"4k={tmp_path / 'eval.json'}", "--provenance", str(tmp_path / "prov.json"), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["provenance"] == prov
    (c,) = doc["configurations"]
    assert (c["config"], c["tasks"], c["mean"], c["teacher_forced_mean"]) == ("4k", {"vt": {"dense": 0.5}}, {"dense": 0.5},
                                                                             {"dense": 0.75, "oracle_target": 1.0})
    assert "| dense | 50.0 | 50.0 |" in capsys.readouterr().out
    (tmp_path / "none.json").write_text(json.dumps({"policies": {}}))
    assert bench.main(["--eval", f"x={tmp_path / 'none.json'}", "--out", str(out)]) == 2
    assert "no 'ruler' section" in capsys.readouterr().err
    assert bench.main(["--eval", f"4k={tmp_path / 'eval.json'}", "--provenance", str(tmp_path / "missing.json"), "--out", str(out)]) == 2
    assert "--provenance" in capsys.readouterr().err and json.loads(out.read_text())["provenance"] == prov  # nothing overwritten
    (tmp_path / "partial.json").write_text(json.dumps({"device": "NVIDIA H200"}))  # not an envelope: what it lacks is named
    assert bench.main(["--eval", f"4k={tmp_path / 'eval.json'}", "--provenance", str(tmp_path / "partial.json"), "--out", str(out)]) == 2
    assert "provenance.git_commit missing" in capsys.readouterr().err and json.loads(out.read_text())["provenance"] == prov

    # two runs on the same samples under one name: one configuration, each policy's rows from the run that has it; a
    # policy whose figures differ between them, or runs on other samples, are refused by name and nothing is written
    more = {**section, "policies": {"dense": acc, "kvpop_mlp_pool": {"accuracy": {"vt": 0.25, "mean": 0.25},
                                                                      "teacher_forced": {"vt": 0.5, "mean": 0.5}}}}
    (tmp_path / "eval2.json").write_text(json.dumps({"ruler": more}))
    two = [f"4k={tmp_path / 'eval.json'}", "--eval", f"4k={tmp_path / 'eval2.json'}"]
    assert bench.main(["--eval", *two, "--provenance", str(tmp_path / "prov.json"), "--out", str(out)]) == 0
    (c,) = json.loads(out.read_text())["configurations"]
    assert c["mean"] == {"dense": 0.5, "kvpop_mlp_pool": 0.25} and set(c["teacher_forced_mean"]) == {"dense", "oracle_target", "kvpop_mlp_pool"}
    assert [(r["eval"], r["policies"], "provenance" in r) for r in c["runs"]] == [
        (str(tmp_path / "eval.json"), ["dense", "oracle_target"], False), (str(tmp_path / "eval2.json"), ["kvpop_mlp_pool"], False)]
    capsys.readouterr()
    before = out.read_text()
    (tmp_path / "eval2.json").write_text(json.dumps({"ruler": {**more, "policies": {"dense": {**acc, "answers": {"vt": ["other"]}}}}}))
    assert bench.main(["--eval", *two, "--out", str(out)]) == 2
    assert "disagree on policy 'dense'" in capsys.readouterr().err and out.read_text() == before
    (tmp_path / "eval2.json").write_text(json.dumps({"ruler": {**more, "fingerprint": "g"}}))
    assert bench.main(["--eval", *two, "--out", str(out)]) == 2
    assert "differ in 'fingerprint'" in capsys.readouterr().err and out.read_text() == before
