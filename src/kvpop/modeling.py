"""Loading Hugging Face causal LMs with the ``kvpop`` attention, and tiny configs for tests."""

from __future__ import annotations

from pathlib import Path

import torch

from kvpop.attention import register

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(path: str | Path, dtype: str | torch.dtype = "float32"):
    """A causal LM from a local folder, running every attention layer through kvpop's executors."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face model folder at {path} (config.json missing)")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation=register())
    except (OSError, ValueError, RuntimeError) as err:
        raise RuntimeError(f"cannot load the model at {path}: {err}") from err


def head_dim_of(config) -> int:
    """The attention head dim of a (text) config: its ``head_dim``, else hidden size / heads."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def model_shape(model) -> dict[str, int]:
    """Layers, heads and head dim of a loaded model."""
    cfg = model.config
    return {
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim_of(cfg),
    }


def tiny_config(model_type: str = "llama", **overrides):
    """A 2-layer model config for fast offline tests (4 query / 2 KV heads, head_dim 16)."""
    from transformers import LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_type]
    kw = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
    )
    kw.update(overrides)
    return cls(**kw)
