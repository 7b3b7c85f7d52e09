"""kvpop.probe and its CLI (bench/scorer_fit.py) on tiny random models: the teacher cache, the fit, the rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpop.attention import register
from kvpop.boundary import boundary_loss, calibration_loss
from kvpop.config import parse_params
from kvpop.modeling import model_shape
from kvpop.probe import (
    CACHE_VERSION,
    ROW_KEYS,
    CacheError,
    ProbeError,
    fit_scorer,
    load_cache,
    make_variant,
    run_probe,
    save_cache,
    scorer_loss,
    split_overrides,
    target_key,
    teacher_cache,
)
from kvpop.target import scope_targets
from kvpop.train import TrainSettings, training_policy

from conftest import bench_script

GEOMETRY = {"budget": 24, "sinks": 2, "window": 8}  # 14 long-range slots
PARAMS = {**GEOMETRY, "train": {"policies": ["kvpop_mlp"], "scorer_hidden": 8, "target": "max", "scorer_lr": 0.03}}


def records(n: int, seed: int, vocab: int, *, quotes: bool = False, lengths: tuple[int, int] = (56, 80)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        S = int(torch.randint(*lengths, (1,), generator=g))
        r = {"id": f"t{seed}-{i}", "input_ids": torch.randint(0, vocab, (S,), generator=g).tolist(), "loss_mask": [0] * 8 + [1] * (S - 8)}
        if quotes:  # a copied definition: oracle_sources has something to keep
            r["quote_source_positions"], r["quote_positions"] = [10, 11], [S - 3, S - 2]
        out.append(r)
    return out


@pytest.fixture(scope="module")
def teacher(tiny_model):
    return tiny_model(attn_implementation=register())


@pytest.fixture(scope="module")
def params():
    return parse_params(PARAMS)


@pytest.fixture(scope="module")
def traces(teacher):
    return teacher_cache(teacher, records(4, 0, teacher.config.vocab_size), window=GEOMETRY["window"], kinds=[("max", 8.0)])


def test_cache_round_trip_reuse_and_rebuild(teacher, tmp_path):
    recs, path, logs = records(2, 1, teacher.config.vocab_size), tmp_path / "c.pt", []
    first = teacher_cache(teacher, recs, window=8, kinds=[("max", 8.0)], path=path, log=logs.append)
    L, Hk, D = teacher.config.num_hidden_layers, teacher.config.num_key_value_heads, teacher.config.head_dim
    assert first[0].k.shape == (L, Hk, len(recs[0]["input_ids"]), D) and first[0].k.dtype == torch.bfloat16
    assert first[0].targets[("max", 8.0)].shape == (L, Hk, len(recs[0]["input_ids"]))
    again = teacher_cache(teacher, recs, window=8, kinds=[("max", 8.0)], path=path, log=logs.append)
    assert "reused" in logs[-1]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.targets[("max", 8.0)], b.targets[("max", 8.0)])
        assert a.source == b.source
    teacher_cache(teacher, recs, window=6, kinds=[("max", 8.0)], path=path, log=logs.append)  # other inputs: rebuilt, not reused
    assert any("other inputs, rebuilt" in s for s in logs[-3:]) and load_cache(path)[0]["window"] == 6
    teacher_cache(teacher, recs, window=6, kinds=[("mean", 8.0)], path=path, log=logs.append)  # a missing kind: rebuilt with both
    assert any("missing, rebuilt" in s for s in logs[-3:]) and set(load_cache(path)[1][0].targets) == {("max", 8.0), ("mean", 8.0)}


def test_cache_refuses_another_version_and_a_damaged_file(teacher, tmp_path):
    recs, path = records(1, 2, teacher.config.vocab_size), tmp_path / "old.pt"
    ident, traces = load_cache(save_cache(path, {"x": 1}, teacher_cache(teacher, recs, window=8, kinds=[("max", 8.0)])))
    doc = torch.load(path, weights_only=True)
    torch.save({**doc, "version": CACHE_VERSION - 1}, path)
    with pytest.raises(CacheError, match=rf"{path}.*version {CACHE_VERSION - 1}.*reads version {CACHE_VERSION}"):
        teacher_cache(teacher, recs, window=8, kinds=[("max", 8.0)], path=path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(CacheError, match=rf"{path} cannot be read"):
        load_cache(path)
    torch.save({"something": "else"}, path)
    with pytest.raises(CacheError, match=rf"{path} is not a kvpop probe teacher cache"):
        load_cache(path)


@pytest.mark.parametrize("overrides", [[], ["train.target=max.model", "train.scorer_calibration=0.5", "train.boundary_weight=regret"]])
def test_scorer_loss_is_the_boundary_loss_of_training(teacher, params, traces, overrides):
    """The probe's loss on a trace equals the library's boundary (and calibration) loss called directly on the
    same scores and scoped targets, mean over layers."""
    v = make_variant(params, overrides)
    p, cfg, shape = v.params, v.params.train, model_shape(teacher)
    torch.manual_seed(0)
    policy = training_policy("kvpop_mlp", shape, cfg)
    settings = TrainSettings.from_config(cfg, layout=p.layout, seed=p.seed)
    got, stats = scorer_loss(policy, traces[0], settings, target=target_key(p))
    t = traces[0]
    S = t.k.shape[2]
    pos = torch.arange(S)[None]
    doc = torch.zeros_like(pos)
    scores = [policy.scores(i, t.k[i][None].float(), t.v[i][None].float(), pos, doc_ids=doc, window=p.window) for i in range(t.k.shape[0])]
    tgts = scope_targets([t.targets[("max", 8.0)][i][None] for i in range(t.k.shape[0])], cfg.target.scope, cfg.target.blend)
    want = []
    for sc, tg in zip(scores, tgts, strict=True):
        loss, _ = boundary_loss(sc.r_hat, tg, sc.log_gamma, doc, pos, layout=p.layout, tau=cfg.tau,
                                tie_margin=cfg.tie_margin, weighting=cfg.boundary_weight, share=policy.scorer.decay.share)
        if cfg.scorer_calibration > 0:
            loss = loss + cfg.scorer_calibration * calibration_loss(sc.r_hat, tg, doc, pos, sinks=p.sinks)
        want.append(loss.float())
    assert stats["decisions"] > 0
    torch.testing.assert_close(got, torch.stack(want).mean(), rtol=0, atol=0)


def test_a_fit_lowers_the_boundary_loss(teacher, params, traces):
    fit = fit_scorer(make_variant(params), "kvpop_mlp", traces, shape=model_shape(teacher), epochs=3)
    assert fit.name == "kvpop_mlp [params]" and not fit.policy.training
    assert fit.log["steps"] == 12 and fit.log["score_loss_after"] < fit.log["score_loss_before"]


def test_run_probe_rows(teacher, params, tmp_path):
    vocab = teacher.config.vocab_size
    variants = [make_variant(params), make_variant(params, ["train.target=max.layer", "train.scorer_calibration=1"])]
    other = {"code": records(2, 7, vocab, lengths=(40, 48)), "prose": records(1, 8, vocab, lengths=(40, 48))}
    doc = run_probe(teacher, params, variants, records(3, 3, vocab), records(2, 4, vocab, quotes=True, lengths=(36, 44)), one_pool=True,
                    cache=tmp_path / "c.pt", other_text=other)
    fits = ["kvpop_mlp [params]", "kvpop_mlp [train.target=max.layer, train.scorer_calibration=1]"]
    ranked = ["oracle_sources", "oracle_target (max)", "oracle_target (max.layer)", *fits]  # static priorities: OnePool takes them
    want = {"dense", "streaming_llm", *ranked, *(f"{f}, one pool" for f in ranked)}
    assert set(doc["rows"]) == want
    for row in doc["rows"].values():
        assert set(row) == set(ROW_KEYS) and row["traces"] == 2
    assert set(doc["fits"]) == set(fits) and doc["fits"][fits[1]]["target"] == "max.layer"
    assert doc["rows"]["dense"]["kl"] == 0
    # the held-out code and prose: every row but oracle_sources (no quote sources there), against the dense teacher;
    # oracle_target's rows are the ceilings of the targets on that text
    assert set(doc["other_text"]) == {"code", "prose"}
    for kind, n in (("code", 2), ("prose", 1)):
        rows = doc["other_text"][kind]
        assert set(rows) == {r for r in want if not r.startswith("oracle_sources")} and all(m["pieces"] == n for m in rows.values())
        assert rows["dense"]["kl"] == 0 and rows["streaming_llm"]["kl"] > 0


def test_bad_overrides_name_the_key(params):
    cases = {
        "train.nope=1": "train.nope: unknown key",
        "train.boundary_weight=bogus": "train.boundary_weight",
        "train.tau=-1": "train.tau",
        "train.target=max.galaxy": "train.target",
        "budget=99": "budget is not a variant's to set",
        "train.tau": "expected KEY=VALUE",
        "train.policies=[dms]": "train.policies",
        "train.scorer_lr.x=1": "train.scorer_lr is a value",
    }
    for item, message in cases.items():
        with pytest.raises(ProbeError, match=message.replace(".", r"\.").replace("[", r"\[")):
            make_variant(params, [item])
    assert split_overrides("train.policies=[kvpop_mlp, kvpop],train.target=max") == ["train.policies=[kvpop_mlp, kvpop]", "train.target=max"]


def _cli():
    return bench_script("scorer_fit")


def test_cli_writes_the_result_and_names_bad_inputs(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    import yaml

    monkeypatch.chdir(tmp_path)
    Path("params.yaml").write_text(yaml.safe_dump(PARAMS))
    data = Path("data/filtered")
    data.mkdir(parents=True)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_llama_dir).vocab_size
    for name, seed in (("train", 5), ("eval", 6)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(3, seed, vocab)))
    main = _cli().main
    base = ["--base", str(tiny_llama_dir), "--device", "cpu", "--train-traces", "2", "--eval-traces", "1"]
    assert main([*base, "--variant", "train.tau=-1"]) == 2
    assert "train.tau" in capsys.readouterr().err
    assert main([*base, "--params", "nope.yaml"]) == 2
    assert "nope.yaml" in capsys.readouterr().err
    assert main([*base, "--variant", "train.target=max.model", "--out", "tiny", "--other-text", "1"]) == 0
    files = {str(p) for p in Path(".").rglob("*") if p.is_file()} - {"params.yaml", "data/filtered/train.jsonl", "data/filtered/eval.jsonl"}
    assert len(files) == 2 and "results/scorer_fit/tiny.json" in files and any(f.startswith(".cache/scorer_fit/teacher-") for f in files)
    doc = json.loads(Path("results/scorer_fit/tiny.json").read_text())
    assert list(doc)[0] == "provenance" and "kvpop_mlp [train.target=max.model]" in doc["rows"]
    assert doc["other_text_pieces"] == 1 and all(m["pieces"] == 1 for kind in ("code", "prose") for m in doc["other_text"][kind].values())
    assert "KL, code" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main([*base, "--epochs", "0"])
    assert exc.value.code == 2 and "--epochs" in capsys.readouterr().err
