"""params.yaml validation: impossible settings stop before any work, naming the key."""

from pathlib import Path

import pytest
import yaml

from kvpop.config import TRAIN_KEYS_NOT_IN_RESULT, ParamsError, TrainConfig, load_params, parse_params

ROOT = Path(__file__).resolve().parents[1]


def raw():
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_repo_params_are_valid():
    p = load_params(ROOT / "params.yaml")
    assert p.layout.long_range == p.budget - p.sinks - p.window > 0


def test_train_stage_depends_on_every_key_that_changes_a_training():
    """dvc.yaml's train stage lists its params key by key, so that adding a policy to train.policies trains
    that policy alone; a train key missing from the list would leave a stale training cached."""
    listed = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["do"]["params"]
    expected = {"seed", "budget", "sinks", "window"} | {f"train.{k}" for k in TrainConfig.model_fields if k not in TRAIN_KEYS_NOT_IN_RESULT}
    assert sorted(listed) == sorted(expected)
    assert set(raw()["train"]) == set(TrainConfig.model_fields)  # DVC needs every listed key in params.yaml


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda r: r.update(budget=r["sinks"] + r["window"]), "budget"),
        (lambda r: r.update(window=0), "window"),
        (lambda r: r.update(window=-3), "window"),
        (lambda r: r["train"].update(stepz=3), "train.stepz"),
        (lambda r: r.update(extra_key=1), "extra_key"),
        (lambda r: r["base_model"].update(source="not a model id!"), "base_model.source"),
        (lambda r: r["train"].update(policies=["kvpop_transformer"]), "train.policies"),
        (lambda r: r["evaluate"].update(policies=["oracle"]), "evaluate.policies"),
        (lambda r: r["filter"].update(max_tokens=0), "filter.max_tokens"),
        (lambda r: r["train"].update(devices=0), "train.devices"),
        (lambda r: r["train"].update(devices=2), "train.devices"),  # several devices need ddp or fsdp
        (lambda r: r["train"].update(strategy="fsdp", accelerator="cpu"), "train.strategy"),
        (lambda r: r["train"].update(strategy="deepspeed"), "train.strategy"),
        (lambda r: r["train"].update(checkpoint_format="sharded", strategy="ddp", devices=2), "train.checkpoint_format"),
        (lambda r: r["train"].update(checkpoint_every=0), "train.checkpoint_every"),
        (lambda r: r["train"].update(target="median"), "train.target"),
        (lambda r: r["train"].update(target_beta=0), "train.target_beta"),
        (lambda r: r["train"].update(target_beta=-2.0), "train.target_beta"),
        (lambda r: r["train"].update(target_beta=float("inf")), "train.target_beta"),
        (lambda r: r["train"].update(boundary_weight="margin"), "train.boundary_weight"),
        (lambda r: (r["evaluate"].update(one_pool=True), r["train"].update(policies=["streaming_llm_plus", "kvpop", "dms"])), "evaluate.one_pool"),
    ],
)
def test_bad_params_name_the_key(edit, key):
    r = raw()
    edit(r)
    with pytest.raises(ParamsError, match=key.replace(".", r"\.")):
        parse_params(r)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "nope.yaml")
    f = tmp_path / "p.yaml"
    f.write_text("budget: [unclosed")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(f)


@pytest.mark.parametrize("target, beta", [("mean", None), ("power", 16.0), ("max", None)])
def test_target_reaches_scorer_training(target, beta):
    """train.target / train.target_beta (default: the paper's mean, beta 8) reach the ScorerTraining of the run."""
    from kvpop.train import TrainSettings

    r = raw()
    r["train"].pop("target"), r["train"].pop("target_beta")
    assert (parse_params(r).train.target, parse_params(r).train.target_beta) == ("mean", 8.0)  # defaults
    r["train"]["target"] = target
    if beta is not None:
        r["train"]["target_beta"] = beta
    p = parse_params(r)
    st = TrainSettings.from_config(p.train, layout=p.layout, seed=0).scorer_training
    assert (st.target, st.target_beta) == (target, beta if beta is not None else 8.0)


@pytest.mark.parametrize("weighting", ["tie", "regret", "uniform"])
def test_boundary_weight_reaches_scorer_training(weighting):
    """train.boundary_weight (default: the paper's tie/class-balance weights) reaches the boundary loss's settings."""
    from kvpop.train import TrainSettings

    r = raw()
    r["train"].pop("boundary_weight", None)
    assert parse_params(r).train.boundary_weight == "tie"
    r["train"]["boundary_weight"] = weighting
    p = parse_params(r)
    st = TrainSettings.from_config(p.train, layout=p.layout, seed=0).scorer_training
    assert st.weighting == weighting


@pytest.mark.parametrize("pool", ["group", "layer", "model"])
def test_target_pool_reaches_scorer_training(pool):
    """train.target_pool (default: the paper's per-query-group target) reaches the boundary loss's settings."""
    from kvpop.train import TrainSettings

    r = raw()
    r["train"].pop("target_pool", None)
    assert parse_params(r).train.target_pool == "group"
    r["train"]["target_pool"] = pool
    p = parse_params(r)
    st = TrainSettings.from_config(p.train, layout=p.layout, seed=0).scorer_training
    assert st.pool == pool
    r["train"]["target_pool"] = "heads"
    with pytest.raises(Exception, match="target_pool"):
        parse_params(r)


def test_target_blend_reaches_scorer_training_and_is_bounded():
    """train.target_blend (pool "blend": the weight of the model-wide target) reaches the settings; outside [0, 1] it is refused."""
    from kvpop.train import TrainSettings

    r = raw()
    r["train"].update(target_pool="blend", target_blend=0.8)
    p = parse_params(r)
    assert TrainSettings.from_config(p.train, layout=p.layout, seed=0).scorer_training.blend == 0.8
    for bad in (-0.1, 1.5):
        r["train"]["target_blend"] = bad
        with pytest.raises(Exception, match="target_blend"):
            parse_params(r)
