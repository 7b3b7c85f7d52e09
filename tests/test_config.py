"""params.yaml validation: impossible settings stop before any work, naming the key."""

from pathlib import Path

import pytest
import yaml

from kvpop.config import TRAIN_KEYS_NOT_IN_RESULT, ParamsError, TrainConfig, load_params, parse_params
from kvpop.target import TargetSpec

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
        (lambda r: r["train"].update(target="median"), "train.target: unknown target kind 'median'"),
        (lambda r: r["train"].update(target="max.pool"), "train.target: unknown target scope 'pool'"),
        (lambda r: r["train"].update(target="power:0"), "train.target: beta of 'power:0'"),
        (lambda r: r["train"]["target"].update(kind="median"), "train.target.kind"),
        (lambda r: r["train"]["target"].update(beta=0), "train.target.beta"),
        (lambda r: r["train"]["target"].update(beta=-2.0), "train.target.beta"),
        (lambda r: r["train"]["target"].update(beta=float("inf")), "train.target.beta"),
        (lambda r: r["train"]["target"].update(scope="heads"), "train.target.scope"),
        (lambda r: r["train"]["target"].update(blend=1.5), "train.target.blend"),
        (lambda r: r["train"]["target"].update(blend=-0.1), "train.target.blend"),
        (lambda r: r["train"]["target"].update(pool="model"), "train.target.pool: unknown key"),
        (lambda r: r["train"].update(target_beta=8.0), "train.target_beta: unknown key"),  # the flat keys are gone
        (lambda r: r["train"].update(target=3), "train.target"),
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


@pytest.mark.parametrize(
    "value, spec",
    [
        ({"kind": "mean"}, TargetSpec(kind="mean")),
        ({"kind": "power", "beta": 16.0}, TargetSpec(kind="power", beta=16.0)),
        ({"kind": "max", "scope": "model"}, TargetSpec(kind="max", scope="model")),
        ({"kind": "max", "beta": 8.0, "scope": "blend", "blend": 0.8}, TargetSpec(scope="blend", blend=0.8)),
        ("mean", TargetSpec(kind="mean")),  # the compact form, as `dvc exp run -S train.target=...` writes it
        ("power:16", TargetSpec(kind="power", beta=16.0)),
        ("max.layer", TargetSpec(scope="layer")),
        ("max.blend:0.75", TargetSpec(scope="blend", blend=0.75)),
        ("power:4.blend:0.5", TargetSpec(kind="power", beta=4.0, scope="blend")),
    ],
)
def test_target_reaches_scorer_training(value, spec):
    """train.target, nested or compact (default: max, beta 8, group, blend 0.5, the repo's), reaches the ScorerTraining
    of the run as one TargetSpec."""
    from kvpop.train import TrainSettings

    r = raw()
    assert r["train"]["target"] == TargetSpec().model_dump()  # params.yaml holds the one default
    r["train"].pop("target")
    assert parse_params(r).train.target == TargetSpec() == TargetSpec(kind="max", beta=8.0, scope="group", blend=0.5)
    r["train"]["target"] = value
    p = parse_params(r)
    assert p.train.target == spec
    st = TrainSettings.from_config(p.train, layout=p.layout, seed=0).scorer_training
    assert st.target == spec
    assert p.train.model_dump()["target"] == spec.model_dump()  # the run's recorded params: the nested fields


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


def test_target_keys_of_params_yaml_are_the_spec_fields():
    """params.yaml nests train.target as the TargetSpec's fields (one dvc.yaml entry, train.target, covers them)."""
    assert set(raw()["train"]["target"]) == set(TargetSpec.model_fields) == {"kind", "beta", "scope", "blend", "value"}
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    evaluate = [k if isinstance(k, str) else next(iter(k)) for k in stages["evaluate"]["params"]]
    assert "train.target" in evaluate and not any(k.startswith("train.target_") for k in evaluate)


def test_per_policy_settings_apply_to_their_policy_alone():
    cfg = TrainConfig(target="mean", per_policy={"kvpop_mlp_pool": {"target": "max", "boundary_weight": "uniform", "scorer_lr": 0.1, "model_lr": 0.0}})
    own = cfg.for_policy("kvpop_mlp_pool")
    assert (str(own.target), own.boundary_weight, own.scorer_lr, own.model_lr) == ("max", "uniform", 0.1, 0.0)
    other = cfg.for_policy("kvpop_mlp")
    assert other is cfg and str(other.target) == "mean" and other.boundary_weight == "tie" and other.model_lr == 1e-5


@pytest.mark.parametrize("per_policy, match", [
    ({"kvpop_mlp_pool": {"seq_len": 512}}, r"\['seq_len'\] cannot differ per policy"),
    ({"tova": {"tau": 2.0}}, "unknown or training-free policies"),
    ({"kvpop_mlp_pool": {"target": "bogus"}}, "train.per_policy.kvpop_mlp_pool .*unknown target kind 'bogus'"),
    ({"kvpop_mlp_pool": {"tau": "x"}}, "train.per_policy.kvpop_mlp_pool"),
])
def test_per_policy_errors_name_the_policy_and_the_key(per_policy, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(per_policy=per_policy)
