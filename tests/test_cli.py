"""The `kvpop` command on a tiny exported model: generate, score, and clear errors (exit 2)."""

import json

import pytest
import torch

from kvpop.cli import main
from kvpop.export import export
from kvpop.geometry import CacheLayout
from kvpop.modeling import load_model
from kvpop.policies import make_policy

TEXT = "Let v1 = 381. Recall v1 = 381. So 381 + 42 = 423. The answer is \\boxed{423}. Step 3: 17 * 4 = 68."


@pytest.fixture(scope="module")
def exported(tiny_llama_dir, tiny_tokenizer, tmp_path_factory):
    model = load_model(tiny_llama_dir)
    torch.manual_seed(3)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    out = tmp_path_factory.mktemp("cli") / "export"
    export(model, tiny_tokenizer, policy, out, layout=CacheLayout(24, 2, 8))
    return out


def gen(ckpt, policy, *extra):
    return main(["generate", "--checkpoint", str(ckpt), "--policy", policy, "--budget", "16", "--max-new-tokens", "12", *extra])


@pytest.mark.parametrize("policy", ["kvpop_mlp", "streaming_llm", "tova", "dense"])
def test_generate_streams_and_reports(exported, policy, capsys):
    assert gen(exported, policy, "--prompt", "Recall v1 =") == 0
    err = capsys.readouterr().err
    assert f"{policy} budget 16 (sinks 2, window 8)" in err  # sinks/window from the export
    assert " MB" in err and "tokens/s" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer to --compile")
def test_generate_compile_needs_cuda(exported, capsys):
    assert gen(exported, "kvpop_mlp", "--prompt", "x", "--compile") == 2
    assert "--compile needs a CUDA device" in capsys.readouterr().err


def test_generate_plain_folder_and_prompt_file(tiny_llama_dir, tmp_path, capsys):
    f = tmp_path / "prompt.txt"
    f.write_text(TEXT)
    assert gen(tiny_llama_dir, "h2o", "--prompt-file", str(f), "--window", "6", "--quiet", "--temperature", "0.7") == 0
    assert "sinks 4, window 6" in capsys.readouterr().err
    assert gen(tiny_llama_dir, "kvpop_mlp", "--prompt", "x") == 2
    assert "needs an export folder" in capsys.readouterr().err


def test_score_text_and_jsonl(exported, tiny_tokenizer, tmp_path, capsys):
    txt = tmp_path / "doc.txt"
    txt.write_text(TEXT * 2)
    rows = tmp_path / "rows.jsonl"
    chat = {"messages": [{"role": "user", "content": TEXT}, {"role": "assistant", "content": "423"}]}
    rows.write_text(json.dumps({"text": TEXT}) + "\n\n" + json.dumps(chat) + "\n")
    results = {}
    for policy in ("dense", "kvpop_mlp", "streaming_llm", "h2o"):
        assert main(["score", "--checkpoint", str(exported), "--policy", policy, "--budget", "16", str(txt), str(rows), "--json"]) == 0
        results[policy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["dense"]["kl"] == pytest.approx(0, abs=1e-9) and results["dense"]["top1_agreement"] == 1
    assert results["kvpop_mlp"]["documents"] == 3 and results["kvpop_mlp"]["tokens"] > 16
    for policy in ("kvpop_mlp", "streaming_llm", "h2o"):
        assert results[policy]["kl"] > 0 and 0 <= results[policy]["top1_agreement"] <= 1
    # with budget >= length nothing is evicted
    assert main(["score", "--checkpoint", str(exported), "--policy", "kvpop_mlp", "--budget", "4096", str(rows), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kl"] == pytest.approx(0, abs=1e-6)
    assert main(["score", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", str(rows)]) == 0
    assert "top1_agreement" in capsys.readouterr().out  # the rich table


def test_score_several_policies_and_exports_in_one_process(exported, tiny_llama_dir, tmp_path, capsys):
    """Rules on the checkpoint's weights and an export with its own, one process, one reference (named);
    quote accuracy where the rows record quotes (the pipeline's synthetic rows)."""
    from kvpop.data.synthetic import generate_traces

    rows = tmp_path / "traces.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in generate_traces(2, 0, min_chars=300, max_chars=400, num_values=4, num_recalls=2,
                                                                          min_quote_distance_chars=100)))
    argv = ["score", "--checkpoint", str(tiny_llama_dir), "--policy", "dense,streaming_llm,tova", "--export", str(exported),
            "--budget", "24", "--sinks", "2", "--window", "8", str(rows)]
    assert main([*argv, "--json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    by = {r["policy"]: r for r in out}
    assert list(by) == ["dense", "streaming_llm", "tova", "kvpop_mlp (export)"]
    assert by["dense"]["kl"] == pytest.approx(0, abs=1e-9) and by["dense"]["top1_agreement"] == 1
    assert all(r["quote_tokens"] > 0 and 0 <= r["quote_accuracy"] <= 1 for r in out)
    assert all(r["reference"] == f"dense attention with the weights of {tiny_llama_dir}" for r in out)
    assert by["streaming_llm"]["kl"] > 0 and by["kvpop_mlp (export)"]["kl"] > 0
    # the same export scored as --checkpoint: its own fine-tuned weights are the reference, and it says so
    assert main(["score", "--checkpoint", str(exported), "--policy", "kvpop_mlp", "--budget", "24", str(rows), "--json"]) == 0
    assert "the export's fine-tuned weights" in json.loads(capsys.readouterr().out)["reference"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "quote_accuracy" in table and "reference: dense attention" in table
    # an export trained for another geometry, an unknown policy, nothing to score: named, exit 2
    assert main(["score", "--checkpoint", str(tiny_llama_dir), "--export", str(exported), "--budget", "300", str(rows)]) == 2
    assert "sinks/window 2/8" in capsys.readouterr().err
    assert main(["score", "--checkpoint", str(tiny_llama_dir), "--policy", "dense,nope", "--budget", "24", str(rows)]) == 2
    assert "'nope'" in capsys.readouterr().err
    assert main(["score", "--checkpoint", str(tiny_llama_dir), "--budget", "24", str(rows)]) == 2
    assert "nothing to score" in capsys.readouterr().err


def test_errors_exit_2(exported, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"foo": 1}\n')
    cases = [
        (["generate", "--checkpoint", str(tmp_path / "nowhere"), "--policy", "tova", "--budget", "16", "--prompt", "x"], "no checkpoint"),
        (["generate", "--checkpoint", str(exported), "--policy", "lru", "--budget", "16", "--prompt", "x"], "unknown policy 'lru'"),
        (["generate", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", "--prompt-file", str(empty)], "empty prompt"),
        (["generate", "--checkpoint", str(exported), "--policy", "tova", "--budget", "5", "--prompt", "x"], "--budget 5"),
        # budget = sinks + window (2 + 8): no long-range slot, which params.yaml rejects too
        (["generate", "--checkpoint", str(exported), "--policy", "tova", "--budget", "10", "--prompt", "x"],
         "--budget 10 --sinks 2 --window 8: budget (10) must be >= sinks + window + 1"),
        (["score", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", "--window", "0", str(bad_rows)], "--window 0: need window >= 1"),
        (["generate", "--checkpoint", str(exported), "--policy", "streaming_llm_plus", "--budget", "16", "--prompt", "x"],
         "needs an export folder trained with it"),
        (["generate", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", "--prompt", "x", "--path", "engine"],
         "--path engine: policy 'tova' needs attention weights"),
        (["score", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", str(empty)], "is empty"),
        (["score", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", str(tmp_path / "none.txt")], "not found"),
        (["score", "--checkpoint", str(exported), "--policy", "tova", "--budget", "16", str(bad_rows)], '"text"'),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit) as exc:  # argparse usage errors
        main(["generate", "--policy", "tova"])
    assert exc.value.code == 2


@pytest.mark.parametrize("damage", ["meta", "scorer", "weights"])
def test_corrupt_checkpoint_exits_2(exported, tmp_path, damage, capsys):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported, ckpt)
    target = {"meta": "kvpop.json", "scorer": "scorer.safetensors", "weights": "model.safetensors"}[damage]
    (ckpt / target).write_bytes(b"\x00garbage")
    assert gen(ckpt, "kvpop_mlp", "--prompt", "x") == 2
    err = capsys.readouterr().err
    assert "cannot load checkpoint" in err


def test_plain_folder_geometry_defaults_are_the_pipelines():
    """A plain model folder (no export metadata) decodes with the pipeline's sinks and window."""
    from kvpop import cli
    from kvpop.config import Params

    assert (cli.DEFAULT_SINKS, cli.DEFAULT_WINDOW) == (Params.model_fields["sinks"].default, Params.model_fields["window"].default)


def test_budget_error_comes_before_the_model_loads(exported, tmp_path, capsys):
    """A wrong --budget is reported from the export's geometry alone: with damaged weights the
    message is still about the budget (the weights were never read)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(exported, ckpt)
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["generate", "--checkpoint", str(ckpt), "--policy", "tova", "--budget", "9", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--budget 9 --sinks 2 --window 8: budget (9) must be >= sinks + window + 1 = 2 + 8 + 1" in err and "model.safetensors" not in err


def test_one_pool_generate_and_score(tiny_llama_dir, tiny_tokenizer, tmp_path, capsys):
    """``--one-pool``: generate decodes the export's kvpop_mlp with one pool for the whole model (the
    engine's pooled kind), score adds a row per policy it can rank so; a policy it cannot is named, exit 2."""
    torch.manual_seed(4)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for layer in policy.scorer.layers:  # a scorer that ranks (the untrained one gives every head the same order)
        torch.nn.init.normal_(layer.w2, std=2.0)
    exported = tmp_path / "export"
    export(load_model(tiny_llama_dir), tiny_tokenizer, policy, exported, layout=CacheLayout(24, 2, 8))
    assert gen(exported, "kvpop_mlp", "--prompt", "Recall v1 =", "--one-pool") == 0
    err = capsys.readouterr().err
    assert "kvpop_mlp, one pool budget 16 (sinks 2, window 8)" in err and "engine path" in err
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"text": TEXT * 3}) + "\n")
    argv = ["score", "--checkpoint", str(exported), "--policy", "dense,streaming_llm,kvpop_mlp", "--budget", "16", str(rows), "--json"]
    assert main([*argv, "--one-pool"]) == 0
    by = {r["policy"]: r for r in map(json.loads, capsys.readouterr().out.strip().splitlines())}
    assert list(by) == ["dense", "streaming_llm", "kvpop_mlp", "kvpop_mlp, one pool"]
    assert by["kvpop_mlp, one pool"]["kl"] > 0 and by["kvpop_mlp, one pool"]["tokens"] == by["kvpop_mlp"]["tokens"]
    assert by["kvpop_mlp, one pool"]["kl"] != by["kvpop_mlp"]["kl"]  # the pool moves slots between heads
    for bad in (["generate", "--checkpoint", str(exported), "--policy", "streaming_llm", "--budget", "16", "--prompt", "x", "--one-pool"],
                ["score", "--checkpoint", str(exported), "--policy", "streaming_llm", "--budget", "16", str(rows), "--one-pool"]):
        assert main(bad) == 2
        assert "--one-pool" in capsys.readouterr().err
