"""Stage base_model: a hub-style source through from_pretrained (a tiny local Qwen3), offline."""

import json

import pytest
import torch

from kvpop.base_model import ModelSourceError, materialize
from kvpop.modeling import load_model


def test_materialize_local_qwen3(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "base"
    summary = materialize(str(tiny_qwen3_dir), out)
    assert summary["model_type"] == "qwen3" and summary["num_kv_heads"] == 2
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    m = load_model(out)
    assert m.config._attn_implementation == "kvpop"
    ref = load_model(tiny_qwen3_dir)
    for (k, a), (_, b) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), k


def test_bad_source_is_a_clear_error_and_keeps_old_output(tmp_path):
    out = tmp_path / "base"
    out.mkdir()
    (out / "keep.txt").write_text("previous good output")
    with pytest.raises(ModelSourceError, match="cannot load model source"):
        materialize(str(tmp_path / "no-such-model"), out)
    assert (out / "keep.txt").read_text() == "previous good output"


def test_load_model_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
