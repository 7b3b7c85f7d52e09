"""Exports load without Lightning and reproduce the trained student and scorer; bad ones fail clearly."""

import pytest
import torch

from kvpop.export import CheckpointError, export, load_export
from kvpop.modeling import load_model
from kvpop.policies import make_policy


@pytest.fixture
def exported(tiny_llama_dir, tiny_tokenizer, tmp_path):
    model = load_model(tiny_llama_dir)
    torch.manual_seed(3)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    out = tmp_path / "export"
    export(model, tiny_tokenizer, policy, out, budget=40, sinks=2, window=8)
    return out, model, policy


def test_roundtrip(exported):
    out, model, policy = exported
    m2, tok, p2, meta = load_export(out)
    assert meta == {"policy": "kvpop_mlp", "budget": 40, "sinks": 2, "window": 8, "scorer": policy.scorer.config}
    for (k, a), b in zip(policy.state_dict().items(), p2.state_dict().values()):
        assert torch.equal(a, b), k
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    assert "lightning" not in str(type(m2)).lower()


def test_corrupt_scorer(exported):
    out, *_ = exported
    (out / "scorer.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="scorer.safetensors"):
        load_export(out)


def test_missing_and_corrupt_meta(exported, tmp_path):
    out, *_ = exported
    (out / "kvpop.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_export(out)
    with pytest.raises(CheckpointError, match="missing"):
        load_export(tmp_path / "nowhere")
