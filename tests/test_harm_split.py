"""bench/harm_split.py on the tiny model: the three candidates are what they claim, and bad inputs are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from kvpop.export import export
from kvpop.geometry import CacheLayout
from kvpop.modeling import load_model
from kvpop.policies import make_policy

from conftest import bench_script

LAYOUT = {"budget": 24, "sinks": 2, "window": 8}
PARAMS = {**LAYOUT, "train": {"policies": ["kvpop_mlp_pool"], "scorer_hidden": 8, "seq_len": 96},
          "evaluate": {"max_traces": 2, "other_text": {"code": 1, "prose": 0}}}


@pytest.fixture
def checkout(tiny_llama_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """A folder laid out as the pipeline leaves it: params, the base model, held-out traces, an export whose
    model differs from the base (one weight moved) and whose scorer is random."""
    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(yaml.safe_dump(PARAMS))
    tuned = load_model(tiny_llama_dir)
    with torch.no_grad():
        tuned.lm_head.weight.add_(0.05 * torch.randn_like(tuned.lm_head.weight))
    torch.manual_seed(3)
    policy = make_policy("kvpop_mlp_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    export(tuned, tiny_tokenizer, policy, Path("models/export/kvpop_mlp_pool"), layout=CacheLayout(**LAYOUT))
    g = torch.Generator().manual_seed(5)
    vocab = tuned.config.vocab_size
    rows = []
    for i in range(3):
        S = 60 + 8 * i
        rows.append({"id": f"t{i}", "input_ids": torch.randint(0, vocab, (S,), generator=g).tolist(), "loss_mask": [0] * 4 + [1] * (S - 4),
                     "quote_source_positions": [6, 7], "quote_positions": [S - 3, S - 2]})
    Path("data/filtered").mkdir(parents=True)
    Path("data/filtered/eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tiny_llama_dir


def test_the_three_candidates_and_the_merge(checkout, capsys):
    main = bench_script("harm_split").main
    base = ["--policy", "kvpop_mlp_pool", "--base", str(checkout)]
    assert main([*base, "--name", "first", "--out", "first.json"]) == 0
    doc = json.loads(Path("first.json").read_text())
    assert list(doc)[:2] == ["provenance", "what"] and doc["policy"] == "kvpop_mlp_pool" and doc["budget"] == 24
    run = doc["runs"]["first"]
    t = run["traces"]
    assert run["eval_traces"] == 2 and set(t) == {"trained", "finetuned_dense", "base_scores"}
    # each candidate differs from dense by what it claims: the moved weight, the evictions, or both
    assert t["finetuned_dense"]["kl"] > 0 and t["base_scores"]["kl"] > 0 and t["trained"]["kl"] > 0
    assert t["trained"]["kl"] != t["base_scores"]["kl"] and t["trained"]["kl"] != t["finetuned_dense"]["kl"]
    assert set(run["other_text"]) == {"code"} and set(run["other_text"]["code"]) == set(t)
    assert main([*base, "--name", "second", "--merge", "first=first.json", "--out", "both.json"]) == 0
    both = json.loads(Path("both.json").read_text())["runs"]
    assert list(both) == ["first", "second"] and both["first"] == run and both["second"]["traces"] == t  # same inputs, same figures
    assert "| first | base_scores |" in capsys.readouterr().out


def test_bad_inputs_are_named(checkout, capsys):
    main = bench_script("harm_split").main
    assert main(["--policy", "kvpop_mlp", "--base", str(checkout), "--out", "x.json"]) == 2
    assert "not in train.policies" in capsys.readouterr().err
    Path("other.json").write_text(json.dumps({"runs": {"a": {"traces": {}}, "b": {}}}))
    assert main(["--policy", "kvpop_mlp_pool", "--merge", "o=other.json", "--out", "x.json"]) == 2
    assert "2 runs" in capsys.readouterr().err
    assert main(["--policy", "kvpop_mlp_pool", "--merge", "o", "--out", "x.json"]) == 2
    assert "NAME=RESULT" in capsys.readouterr().err
    assert main(["--policy", "kvpop_mlp_pool", "--base", str(checkout), "--exports", "nowhere", "--out", "x.json"]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["--policy", "kvpop_mlp_pool", "--base", "no_base_here", "--out", "x.json"]) == 2
    assert "no_base_here" in capsys.readouterr().err
    assert not Path("x.json").exists()


def test_a_frozen_export_is_scored_as_the_base_model(checkout, tiny_tokenizer):
    """An export whose model is the base (trained with model_lr 0): base_scores is the trained row, finetuned_dense
    is dense itself, and the trained row equals what the three-candidate run gives the same scorer on the base."""
    main = bench_script("harm_split").main
    assert main(["--policy", "kvpop_mlp_pool", "--base", str(checkout), "--name", "tuned", "--out", "tuned.json"]) == 0
    tuned = json.loads(Path("tuned.json").read_text())["runs"]["tuned"]
    torch.manual_seed(3)  # the fixture's scorer, exported with the base model's own weights
    policy = make_policy("kvpop_mlp_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    export(load_model(checkout), tiny_tokenizer, policy, Path("frozen/kvpop_mlp_pool"), layout=CacheLayout(**LAYOUT))
    assert main(["--policy", "kvpop_mlp_pool", "--base", str(checkout), "--exports", "frozen", "--name", "frozen", "--out", "frozen.json"]) == 0
    run = json.loads(Path("frozen.json").read_text())["runs"]["frozen"]
    assert run["frozen"] is True and tuned["frozen"] is False
    for rows, before in ((run["traces"], tuned["traces"]), (run["other_text"]["code"], tuned["other_text"]["code"])):
        assert rows["base_scores"] == rows["trained"] == before["base_scores"]
        assert rows["finetuned_dense"]["kl"] == 0 and rows["finetuned_dense"]["top1_agreement"] == 1
