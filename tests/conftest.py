"""Shared fixtures: a tiny byte-level tokenizer with a chat template, tiny random models, a
tie-heavy test policy, and the real SmolLM2 tokenizer where the pipeline put it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
#: where the base_model stage writes the teacher, and where it keeps the embedded GGUF (pipeline/base_model.py --out, --cache)
BASE_DIR, EMBEDDED_CACHE = ROOT / "models" / "base", ROOT / ".cache" / "embedded"
SMOLLM2_VOCAB = 49152  # every SmolLM2 size shares this tokenizer

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bench_script(name: str):
    """``bench/<name>.py`` loaded as a module (the bench folder is no package): its ``main`` called as a user runs it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}_cli", Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Let v1 = 381. Recall v1 = 381. So 381 + 42 = 423. The answer is \\boxed{423}.",
        "Compute the sum of the values. Step 3: 17 * 4 = 68. Therefore the result follows.",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    return fast


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


def _save_tiny(path, model_type, tokenizer):
    from transformers import AutoModelForCausalLM

    from kvpop.modeling import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(model_type, vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer):
    """A 2-layer random Llama (4 query / 2 KV heads) saved with the tiny tokenizer."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_llama"), "llama", tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer):
    """A 2-layer random Qwen3 saved locally: stands in for a hub id, offline."""
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tiny_tokenizer)


def build_tiny_model(model_type: str = "llama", *, seed: int = 0, attn_implementation=None, **overrides):
    """A random 2-layer model from ``kvpop.modeling.tiny_config(model_type, **overrides)``, in eval mode.

    ``torch.manual_seed(seed)`` runs right before the config is built, so equal arguments give equal
    weights. ``attn_implementation`` (e.g. ``kvpop.attention.register()``) is set on the config before
    the model is built; callers wrap the model (``enable``) and move it to a device themselves.
    """
    from transformers import AutoModelForCausalLM

    from kvpop.modeling import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config(model_type, **overrides)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="session")
def tiny_model():
    """Factory fixture: ``tiny_model(model_type="llama", *, seed=0, attn_implementation=None, **config_overrides)``
    gives a fresh random tiny model (see :func:`build_tiny_model`)."""
    return build_tiny_model


def build_tie_policy(*, per_head_shift: bool, name: str = "ties"):
    """A Policy whose priorities have many exact ties: ``(pos + shift) % 3`` in float64, where ``shift``
    is the KV-head index when ``per_head_shift`` (different ties per head) and 0 otherwise. Ties are
    broken by recency (newer wins), so these exercise that rule."""
    from kvpop.policies import Policy, Scores

    class TiePolicy(Policy):
        def scores(self, layer, k, v, pos, **_):
            B, Hk = k.shape[:2]
            shift = torch.arange(Hk, device=k.device).view(1, Hk, 1) if per_head_shift else 0
            return Scores(prio=((pos[:, None, :] + shift) % 3).to(torch.float64).expand(B, Hk, -1))

    TiePolicy.name = name
    return TiePolicy()


@pytest.fixture(scope="session")
def tie_policy():
    """Factory fixture: ``tie_policy(per_head_shift=..., name="ties")`` (see :func:`build_tie_policy`)."""
    return build_tie_policy


def packed_toy(B: int = 2, S: int = 48, seed: int = 0):
    """Random packed rows with several documents and trailing padding: (ids, doc_ids, pos)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((B, S), -1, dtype=torch.long)
    pos = torch.zeros((B, S), dtype=torch.long)
    for b in range(B):
        t, d = 0, 0
        while t < S - 3:
            n = int(torch.randint(3, S // 2, (1,), generator=g))
            n = min(n, S - 3 - t) if b == 1 else min(n, S - t)
            doc[b, t : t + n] = d
            pos[b, t : t + n] = torch.arange(n)
            t, d = t + n, d + 1
    ids = torch.randint(0, 96, (B, S), generator=g)
    return ids, doc, pos


def find_smollm2() -> tuple[Path, str | None] | None:
    """(folder, gguf file name or None) of the embedded teacher's tokenizer, or None: ``models/base``
    after a repro when it holds a SmolLM2 (``base_model.source`` may name another model), else the
    GGUF the base_model stage keeps in ``.cache/embedded``."""
    from kvpop.base_model import EMBEDDED_GGUF

    cfg = BASE_DIR / "config.json"
    if cfg.is_file() and (BASE_DIR / "tokenizer.json").is_file() and json.loads(cfg.read_text()).get("vocab_size") == SMOLLM2_VOCAB:
        return BASE_DIR, None
    gguf = EMBEDDED_CACHE / Path(EMBEDDED_GGUF).name
    return (EMBEDDED_CACHE, gguf.name) if gguf.is_file() else None


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (see :func:`find_smollm2`); the test is skipped, saying how
    to get it, where the pipeline has not put it here. From the GGUF it takes ~20 s: mark its tests ``slow``."""
    found = find_smollm2()
    if found is None:
        pytest.skip(f"the SmolLM2 tokenizer is in neither {BASE_DIR.relative_to(ROOT)} nor {EMBEDDED_CACHE.relative_to(ROOT)}: "
                    "run the base_model stage (`.venv/bin/dvc repro base_model`)")
    from transformers import AutoTokenizer

    folder, gguf = found
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(folder)
    assert len(tok) == SMOLLM2_VOCAB and tok.chat_template is not None, folder
    return tok
