"""The decode engine (static-shape step, chunked prefill) against its slow twins on CPU.

Twins: the HF model with :class:`kvpop.decode.BoundedCache` (token-by-token reference of the bounded
layout and its eviction rule), the training-time masked forward (one definition of the pattern),
and the plain dense forward. The compiled/CUDA-graph step is checked against the eager step on a
GPU in tests/test_gpu.py.
"""

import os

import pytest
import torch

from kvpop.decode import BoundedCache, enable, teacher_forced_logits
from kvpop.decode.engine import DecodeEngine, kv_bytes_per_token, weight_bytes
from kvpop.geometry import CacheLayout
from kvpop.policies import TOVA, make_policy
from kvpop.selection import candidate_eviction_times, eviction_times

SINKS, WINDOW, K = 4, 16, 12
BUDGET = SINKS + WINDOW + K
LAYOUT = CacheLayout(BUDGET, SINKS, WINDOW)  # K long-range slots
S = 160


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_model):
    return enable(tiny_model(request.param))


def trained_like(name: str):
    """A policy whose scorer ranks tokens (random weights instead of the zero-initialized output)."""
    torch.manual_seed(3)
    policy = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for p in policy.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return policy


def make(name: str, tie_policy):
    if name == "tied":  # three priority levels by position: most decisions are ties, broken by recency (newer wins)
        return tie_policy(per_head_shift=False, name="tied")
    if name == "streaming_llm":
        return make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16)
    return trained_like(name)


def ids(B=2, n=S, seed=1):
    return torch.randint(0, 96, (B, n), generator=torch.Generator().manual_seed(seed))


def engine_logits(eng: DecodeEngine, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then teacher-force the rest one step at a time -> (B, n - prefill + 1, V)."""
    out = [eng.prefill(tokens[:, :prefill])]
    for t in range(prefill, tokens.shape[1]):
        eng.tok.copy_(tokens[:, t : t + 1])
        out.append(eng.step().clone())
    return torch.stack(out, 1)


@pytest.mark.parametrize("name", ["streaming_llm", "tied", "kvpop_mlp", "kvpop", "dms"])
@pytest.mark.parametrize("prefill,chunk", [(1, 128), (30, 128), (100, 128), (160, 128), (100, 256)])
def test_engine_equals_bounded_cache(model, name, prefill, chunk, tie_policy):
    """(30: a first chunk that fits the cache attends causally on the CPU, unless a gate evicts in it.)"""
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, chunk=chunk)
    got = engine_logits(eng, x, prefill)
    assert (got - ref[:, prefill - 1 :]).abs().max() < 1e-4
    assert eng.seen == S


@pytest.mark.parametrize("name", ["streaming_llm", "tied", "kvpop_mlp", "kvpop", "dms"])
def test_prefill_after_decode_steps(model, name, tie_policy):
    """Decode steps, then another prefill (a second turn), then steps: the same logits as teacher-forcing
    the whole sequence through the reference cache. The steps leave the window's tokens unscored (a rule
    scores a token when it leaves); the second prefill must score them itself."""
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, chunk=128)
    first = engine_logits(eng, x[:, :90], prefill=50)  # the window is full and tokens leave it during the steps
    assert first[:, 1:].sub(ref[:, 50:90]).abs().max() < 1e-4
    last = eng.prefill(x[:, 90:130])  # second turn: 40 tokens at once
    assert (last - ref[:, 129]).abs().max() < 1e-4
    for t in range(130, S):
        eng.tok.copy_(x[:, t : t + 1])
        assert (eng.step() - ref[:, t]).abs().max() < 1e-4


@pytest.mark.parametrize("name", ["tied", "kvpop_mlp", "dms"])
def test_chunked_prefill_keeps_the_cache_contents(model, name, tie_policy):
    """After a chunked prefill the engine stores, per KV head, exactly the tokens BoundedCache keeps."""
    policy = make(name, tie_policy)
    x = ids()
    cache = BoundedCache(model.config, policy, layout=LAYOUT)
    with torch.no_grad():
        model(input_ids=x[:, :1], past_key_values=cache)
        for t in range(1, S):
            model(input_ids=x[:, t : t + 1], past_key_values=cache)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, chunk=128)
    eng.prefill(x)  # a 128-token chunk, then a 32-token one
    for i, layer in enumerate(cache.layers):
        want = layer.pos.sort(-1).values
        got = eng.pos[i][..., : eng.slots].sort(-1).values
        assert torch.equal(got, want)
        # slot for slot the same layout: sinks first, the ring by position
        assert torch.equal(eng.pos[i][..., : eng.first_long_range], layer.pos[..., : eng.first_long_range])


def test_dense_engine_equals_the_full_forward(model):
    x = ids()
    with torch.no_grad():
        full = model(input_ids=x).logits
    eng = DecodeEngine(model, None, max_len=256, batch_size=2, chunk=128)
    got = engine_logits(eng, x, 100)
    assert (got - full[:, 99:]).abs().max() < 1e-4


def test_generate_and_reset(model):
    policy = trained_like("kvpop_mlp")
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, chunk=128)
    a = eng.generate(ids(n=60), 8)
    b = eng.generate(ids(n=60), 8)  # generate resets: the same prompt gives the same tokens
    assert a.shape == (2, 8) and torch.equal(a, b)
    with torch.no_grad():
        ref = model.generate(ids(n=60), max_new_tokens=8, do_sample=False,
                             past_key_values=BoundedCache(model.config, policy, layout=LAYOUT))[:, 60:]
    assert torch.equal(a, ref)


def test_the_eager_step_restores_the_thread_count(model):
    """The eager CPU step runs the rule's per-token arithmetic on one thread (module docstring) and
    leaves the process's thread count as it was; the CPU's default prefill chunk is about the cache."""
    policy = trained_like("kvpop_mlp")
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2)
    assert eng.chunk == 256  # 32 slots: the smallest CPU chunk
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng.prefill(ids(n=40))
        seen = []

        def spy(score):
            def scored(*a, **k):
                seen.append(torch.get_num_threads())
                return score(*a, **k)
            return scored

        for rule in eng._rules:  # each layer's rule (the one-layer views)
            rule.token_scores = spy(rule.token_scores)
        eng.step()
        assert seen == [1, 1] and torch.get_num_threads() == 2  # one leaver per layer
    finally:
        torch.set_num_threads(was)


def test_memory_is_flat_and_counted(model):
    policy = trained_like("kvpop_mlp")
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, chunk=128)
    before = eng.cache_bytes()
    engine_logits(eng, ids(n=300), 200)
    assert eng.cache_bytes() == before
    cfg = model.config
    assert kv_bytes_per_token(model) == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert weight_bytes(model) == sum(p.numel() * 4 for p in model.parameters())  # tied: counted once


@pytest.mark.parametrize("name", ["dense", "kvpop_mlp", "kvpop", "dms"])
def test_an_engine_is_freed_with_its_last_reference(model, name, tie_policy):
    """No reference cycle holds an engine (a cycle would keep its cache, gigabytes on a GPU, until the
    cyclic collector happens to run; bench_decode's engines, one after another, ran out of memory so):
    with the collector off, dropping the engine frees its buffers."""
    import gc
    import weakref

    policy = None if name == "dense" else make(name, tie_policy)
    kw = dict(max_len=S + 8) if name == "dense" else dict(layout=LAYOUT)
    was = gc.isenabled()
    gc.disable()
    try:
        eng = DecodeEngine(model, policy, batch_size=2, **kw)
        engine_logits(eng, ids(n=WINDOW + SINKS + 20), WINDOW + SINKS + 8)
        alive, buf = weakref.ref(eng), weakref.ref(eng.keys[0])
        del eng
        assert alive() is None and buf() is None
    finally:
        if was:
            gc.enable()


def test_candidate_eviction_times_equal_the_sequence_formula():
    """Over a full prefix (any order), candidate eviction times are the selection's eviction times."""
    torch.manual_seed(0)
    B, Hk, n = 2, 3, 200
    prio = torch.randn(B, Hk, n, dtype=torch.float64)
    prio[..., 10:20] = prio[..., 10:11]  # ties: the newer token wins
    prio[..., 40:200:3] = float("-inf")  # gated out (dms): they leave with the window
    pos = torch.arange(n).expand(B, n)
    ref = eviction_times(prio, torch.zeros(B, n, dtype=torch.long), pos, sinks=SINKS, window=WINDOW, long_range=K).long()
    perm = torch.randperm(n)
    got = candidate_eviction_times(prio[..., perm], pos[:, None, perm].expand(B, Hk, n).contiguous(), sinks=SINKS, window=WINDOW, long_range=K)
    assert torch.equal(got, ref[..., perm])
    assert (ref[..., :SINKS] == torch.iinfo(torch.int32).max).all()


def test_bad_use_is_refused(model):
    with pytest.raises(ValueError, match="max_len"):
        DecodeEngine(model, None)
    with pytest.raises(NotImplementedError, match="attention weights"):
        DecodeEngine(model, TOVA(), layout=LAYOUT)
    with pytest.raises(ValueError, match="budget"):
        DecodeEngine(model, make_policy("streaming_llm", num_layers=2, num_kv_heads=2, head_dim=16), layout=CacheLayout(10, SINKS, WINDOW))
    with pytest.raises(ValueError, match="compile=True"):
        DecodeEngine(model, None, max_len=64, compile=True)
    with pytest.raises(ValueError, match="no fused form"):  # a delayed rule (kvpop's mLSTM) has no fused insert
        DecodeEngine(model, trained_like("kvpop"), layout=LAYOUT, fused=True)
    eng = DecodeEngine(model, None, max_len=64, batch_size=2, chunk=128)
    with pytest.raises(ValueError, match="overflow"):
        eng.prefill(ids(n=80))
    with pytest.raises(ValueError, match="shape"):
        eng.prefill(ids(B=3, n=8))


def test_the_fused_insert_needs_a_power_of_two_head_dim():
    """The fused insert kernel spans the head dim with one Triton arange (a power of two): with a head
    dim of 24 no rule has a fused form (fused=True is refused by name; the CUDA default falls back to
    the tensor code), with 16 streaming_llm has one."""
    from transformers import AutoModelForCausalLM

    from kvpop.modeling import tiny_config

    for head_dim, fusable in ((24, False), (16, True)):
        torch.manual_seed(0)
        m = enable(AutoModelForCausalLM.from_config(tiny_config("llama", head_dim=head_dim)).eval())
        pol = make_policy("streaming_llm", num_layers=2, num_kv_heads=2, head_dim=head_dim)
        if fusable:  # the rule has a form: refused on the CPU only for want of a GPU (or Triton / its interpreter)
            with pytest.raises(ValueError, match="Triton|CUDA"):
                DecodeEngine(m, pol, layout=LAYOUT, fused=True)
        else:
            with pytest.raises(ValueError, match="head dim that is a power of two: 24"):
                DecodeEngine(m, pol, layout=LAYOUT, fused=True)
        assert not DecodeEngine(m, pol, layout=LAYOUT).fused  # the CPU default: the tensor code


def test_packed_projections_are_views_and_compute_the_same():
    """The engine packs q/k/v (with Qwen2's biases) and gate/up into one matrix each: the modules
    become views of it (no weight held twice), the model's outputs do not change, and a second
    engine on the same model reuses the packed storage."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    x = ids(n=40)
    with torch.no_grad():
        want = m(input_ids=x).logits
    before = weight_bytes(m)
    attn, mlp = m.model.layers[1].self_attn, m.model.layers[1].mlp
    with pytest.raises(ValueError, match="budget"):  # a refused engine leaves the model as it was
        DecodeEngine(m, make_policy("streaming_llm", num_layers=2, num_kv_heads=2, head_dim=16), layout=CacheLayout(10, SINKS, WINDOW))
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    eng = DecodeEngine(m, None, max_len=64, batch_size=2, chunk=128)
    attn, mlp = m.model.layers[1].self_attn, m.model.layers[1].mlp
    w, b = eng._wqkv[1]
    assert w.shape == (64 + 2 * 32, 64) and b.shape == (128,)
    assert w.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(w[64:96], attn.k_proj.weight) and torch.equal(b[96:], attn.v_proj.bias)
    gu, none = eng._wgu[1]
    assert none is None and torch.equal(gu[128:], mlp.up_proj.weight)
    old = gu[128, 0].item()
    with torch.no_grad():
        gu[128, 0] = old + 1.0  # one storage: the module sees the write
        assert mlp.up_proj.weight[0, 0] == old + 1.0
        gu[128, 0] = old
        assert torch.equal(m(input_ids=x).logits, want)
    assert weight_bytes(m) == before
    eng2 = DecodeEngine(m, None, max_len=64, batch_size=2, chunk=128)
    assert eng2._wqkv[1][0].data_ptr() == w.data_ptr() and eng2._wgu[0][0].data_ptr() == eng._wgu[0][0].data_ptr()
    got = engine_logits(eng2, x, 20)
    assert (got - want[:, 19:]).abs().max() < 1e-4


def test_compile_cache_folder(monkeypatch, tmp_path):
    """use_compile_cache: the argument, else $KVPOP_COMPILE_CACHE, else ~/.cache/kvpop/compile; a
    TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR already set (the user's, or an earlier compile's) wins."""
    from kvpop.decode.engine import use_compile_cache

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "KVPOP_COMPILE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert use_compile_cache() == tmp_path / "home" / ".cache" / "kvpop" / "compile"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home" / ".cache" / "kvpop" / "compile" / "triton")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("KVPOP_COMPILE_CACHE", str(tmp_path / "env"))
    assert use_compile_cache() == tmp_path / "env"
    assert use_compile_cache(tmp_path / "arg") == tmp_path / "env"  # already chosen in this process: kept
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(var)
    assert use_compile_cache(tmp_path / "arg") == tmp_path / "arg"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "arg" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "user"))  # the user's folder wins
    assert use_compile_cache(tmp_path / "arg") == tmp_path


def test_compile_cache_folder_after_importing_dynamo(tmp_path):
    """A fresh process that has imported torch._dynamo (as transformers and the engine do) holds
    torch's default folder in TORCHINDUCTOR_CACHE_DIR, written by that import: the compile cache
    still goes to kvpop's folder, not to /tmp (which the morning's cold-start measurements reused)."""
    import subprocess
    import sys

    code = (
        "import os, torch._dynamo\n"
        "from torch._inductor.runtime.cache_dir_utils import default_cache_dir\n"
        "assert os.environ['TORCHINDUCTOR_CACHE_DIR'] == default_cache_dir(), os.environ.get('TORCHINDUCTOR_CACHE_DIR')\n"
        "from kvpop.decode.engine import use_compile_cache\n"
        "print(use_compile_cache(), os.environ['TORCHINDUCTOR_CACHE_DIR'], os.environ['TRITON_CACHE_DIR'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["KVPOP_COMPILE_CACHE"] = str(tmp_path / "kv")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "kv"), str(tmp_path / "kv" / "inductor"), str(tmp_path / "kv" / "triton")]


@pytest.mark.parametrize("name", ["dense", "streaming_llm", "kvpop_mlp", "kvpop", "dms"])
def test_per_layer_compile_traces_one_layer_for_all(model, name, tie_policy):
    """compile_mode "layer": every layer's modules, weights, buffers and one-layer rule are arguments of
    one function, so the compiler traces one layer and every layer reuses it; the logits equal the
    eager step's. (The CUDA graph around it is tested in tests/test_gpu.py; here the layer function is
    traced by dynamo on the CPU, on the graphed step's path: masked attention over the whole buffer.)"""
    policy = None if name == "dense" else make(name, tie_policy)
    kw = dict(max_len=S + 8) if name == "dense" else dict(layout=LAYOUT)
    x = ids()
    ref = DecodeEngine(model, policy, batch_size=2, **kw)
    eng = DecodeEngine(model, policy, batch_size=2, **kw)
    assert eng._rule_index == [0, 0] or name == "dense"
    graphs = []

    def backend(gm, example_inputs):  # counts the graphs dynamo hands to a compiler
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()  # compiled code is cached per code object: forget other engines' (other shapes)
    eng._layer_step = torch.compile(DecodeEngine._layer, backend=backend, fullgraph=True, dynamic=False)
    prompt = WINDOW + SINKS + 8  # beyond the window: a delayed rule's state is read whole by the prefill
    want = engine_logits(ref, x, prompt)
    got = [eng.prefill(x[:, :prompt])]
    eng.compiled = True  # the graphed step's path, without the graph
    for t in range(prompt, x.shape[1]):
        eng.tok.copy_(x[:, t : t + 1])
        eng.seen += 1
        got.append(eng._decode_step().clone())
    assert (torch.stack(got, 1) - want).abs().max() < 1e-4
    assert len(graphs) == 1, f"{len(graphs)} graphs for {len(eng.layers)} layers"


def test_a_last_chunk_attends_padded_to_the_chunk_and_compiles_once(tiny_model):
    """A prompt's last chunk on the compiled path (``DecodeEngine._attend_any_length``, CUDA's route; FlexAttention
    compiled with symbolic lengths runs on the CPU too) is padded to the full chunk's queries: equal to SDPA under the
    same mask_mod for last chunks of 1, 77, 128 and 200 queries over two KV lengths, and one compile serves them all
    once the first has run. Unpadded, a chunk of one query (dynamo specializes sizes 0 and 1) and one query block
    compiled apart: the H200 recompiled for last chunks of 1 and 128 (tests/test_gpu.py, any_length)."""
    from kvpop.decode.engine import slot_mask_mod
    from kvpop.masks import dense_mask

    model = enable(tiny_model("qwen3"))
    eng = DecodeEngine(model, None, layout=LAYOUT, batch_size=1, max_len=800, chunk=256, compile=False)
    B, H, Hk, D = 1, eng.H, eng.Hk, eng.D
    g = torch.Generator().manual_seed(0)
    for i, (Q, N) in enumerate([(88, 300), (1, 300), (77, 250), (128, 500), (200, 900), (1, 129)]):
        q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, Q), (Hk, N), (Hk, N)))
        kv_pos = torch.arange(N).expand(B, Hk, N).clone()
        kv_pos[:, :, N - Q - 3 : N - Q] = -1  # empty slots
        q0 = N - Q
        mm = slot_mask_mod(kv_pos, q0, eng.G)
        Qb = -(-Q // 128)
        kv_blocks = torch.full((Qb,), -(-N // 128), dtype=torch.int32)
        with torch._dynamo.config.patch(error_on_recompile=i >= 1):
            got = eng._attend_any_length(q, k, v, mm, kv_blocks, None)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(mm, B, H, Q, q.device, kv_len=N, group=eng.G),
                                                               scale=eng.scale, enable_gqa=True)
        assert got.shape == (B, H, Q, D)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
