"""Triton kernels against their tensor twins, on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter runs a kernel's program with NumPy, so its logic (indexing, masks, reductions, tie
rules) is checked here on every run; tests/test_gpu.py checks the compiled kernels on CUDA. The
interpreter is chosen when a kernel's module is imported, so each check runs in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")

SRC = Path(__file__).resolve().parents[1] / "src"


def run_interpreted(code: str) -> str:
    """Run ``ENGINE`` (the setup) and then ``code`` in a fresh interpreted process -> its stdout."""
    code = ENGINE + textwrap.dedent(code)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


ENGINE = f"""
import sys
import torch
import triton.runtime.interpreter as _interp

# Triton 3.6's interpreter turns a scalar argument into a one-element array and a loop bound into an
# int with int(array), which NumPy >= 2.4 refuses for arrays that are not 0-d: take the element.
_patch_tensor = _interp._patch_lang_tensor
def _patch_lang_tensor(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patch_lang_tensor
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from conftest import build_tiny_model as model  # the tiny models of every test: 2 layers, 2 KV heads, head_dim 16
from kvpop.geometry import CacheLayout
from kvpop.decode.engine import DecodeEngine
from kvpop.policies import make_policy

SINKS, WINDOW, K = 4, 16, 12
BUDGET = SINKS + WINDOW + K
LAYOUT = CacheLayout(BUDGET, SINKS, WINDOW)  # K long-range slots

def policy(name):
    torch.manual_seed(3)
    pol = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for p in pol.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return pol

def buffers(eng):
    return [torch.stack([b.float() for b in bufs]) for bufs in (eng.keys, eng.values, eng.pos, eng.prio)]
"""


@pytest.mark.slow  # 140 interpreted decode steps x 8 engines: minutes; the fast tier decodes fused in the compile test below
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fused_insert_decodes_as_the_tensor_code(kind):
    """The engine with the fused insert kernel and with its tensor code, the same prompt and tokens:
    after every step the same slots hold the same tokens (keys, values, positions equal), priorities
    agree to float32 rounding, and the logits match; from a one-token prompt (the window filling, the
    first leavers) and from a prompt past the window, for ``streaming_llm`` and ``kvpop_mlp``."""
    out = run_interpreted(f"""
    m = model({kind!r})
    ids = torch.randint(0, 96, (2, 140), generator=torch.Generator().manual_seed(1))
    for name in ("streaming_llm", "kvpop_mlp"):
        pol = policy(name)
        for prompt in (1, 40):
            ref = DecodeEngine(m, pol, layout=LAYOUT, batch_size=2, fused=False)
            fz = DecodeEngine(m, pol, layout=LAYOUT, batch_size=2, fused=True)
            assert fz.fused and not ref.fused
            for e in (ref, fz):
                e.prefill(ids[:, :prompt])
            for t in range(prompt, ids.shape[1]):
                got = []
                for e in (ref, fz):
                    e.tok.copy_(ids[:, t : t + 1])
                    got.append(e.step().clone())
                assert (got[0] - got[1]).abs().max() < 1e-4, (name, prompt, t)
                (k0, v0, p0, r0), (k1, v1, p1, r1) = buffers(ref), buffers(fz)
                assert torch.equal(p0, p1) and torch.equal(k0, k1) and torch.equal(v0, v1), (name, prompt, t)
                assert torch.allclose(r0, r1, rtol=1e-6, atol=1e-6, equal_nan=True), (name, prompt, t)
    print("OK")
    """)
    assert out.strip().endswith("OK")


def test_fused_insert_breaks_ties_as_the_tensor_code():
    """Long-range slots full of tied priorities and empty (-inf) slots: the kernel picks the same victim
    as the tensor code (lowest priority, then the oldest, then the first slot), and a leaver that ties
    the lowest slot wins it (it is the newest), at random states of one layer."""
    out = run_interpreted("""
    m = model("llama")
    pol = policy("streaming_llm")  # the leaver's priority is its position: set below to tie the slots
    ref = DecodeEngine(m, pol, layout=LAYOUT, batch_size=2, fused=False)
    fz = DecodeEngine(m, pol, layout=LAYOUT, batch_size=2, fused=True)
    g = torch.Generator().manual_seed(0)
    wins = 0
    for trial in range(40):
        p = 200 + trial
        at = ref.home_slot(torch.tensor(p)).expand(4)
        lr, T = ref.first_long_range, ref.T
        keys, values = torch.randn(2, 2, T, 16, generator=g), torch.randn(2, 2, T, 16, generator=g)
        pos = torch.randint(0, p - WINDOW, (2, 2, T), generator=g)
        # two levels per trial, the leaver's priority (its position p - window) below, equal to or above the lowest
        level = torch.randint(0, 2, (2, 2, T), generator=g).double() + (p - WINDOW) + trial % 3 - 1
        empty = torch.rand(2, 2, T, generator=g) < (0.2 if trial % 4 == 0 else 0.0)
        prio = torch.where(empty, float("-inf"), level)
        pos = torch.where(prio == float("-inf"), -1, pos)
        pos[..., at[0]] = p - WINDOW  # the ring slot's occupant leaves the window
        k, v = torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g)
        bufs = {}
        for name, e in (("ref", ref), ("fz", fz)):
            b = [keys.clone(), values.clone(), pos.clone(), prio.clone()]
            e._insert(pol, 0, *b, (), k, v, torch.tensor(p), at, True, False)
            bufs[name] = b
        for a, b in zip(bufs["ref"], bufs["fz"]):
            assert torch.equal(a, b) or torch.allclose(a, b, equal_nan=True), trial
        entered = (bufs["ref"][2][:, :, lr:] == p - WINDOW).any(-1)  # (2, 2)
        wins += int(entered.sum())
        if trial % 4 and trial % 3 == 1:  # no slot is empty, the lowest ties the leaver: the leaver (newer) wins
            assert entered.all(), trial
        if trial % 4 and trial % 3 == 2:  # no slot is empty, every slot ranks above the leaver: it is dropped
            assert not entered.any(), trial
    assert wins > 0
    print("OK", wins)
    """)
    assert out.strip().startswith("OK")


def test_fused_insert_compiles_into_the_one_layer_graph():
    """Traced by dynamo (the per-layer compile, backend "eager" here), the kernel is one opaque op in
    the one graph that serves every layer, and the logits equal the tensor code's."""
    out = run_interpreted("""
    m = model("qwen3")
    pol = policy("kvpop_mlp")
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(1))
    ref = DecodeEngine(m, pol, layout=LAYOUT, batch_size=2)
    fz = DecodeEngine(m, pol, layout=LAYOUT, batch_size=2, fused=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fz._layer_step = torch.compile(DecodeEngine._layer, backend=backend, fullgraph=True, dynamic=False)
    for e in (ref, fz):
        e.prefill(ids[:, :30])
    fz.compiled = True  # the graphed step's path, without the graph
    for t in range(30, 70):
        ref.tok.copy_(ids[:, t : t + 1])
        fz.tok.copy_(ids[:, t : t + 1])
        fz.seen += 1
        assert (ref.step() - fz._decode_step()).abs().max() < 1e-4, t
    ops = [n.target for n in graphs[0].graph.nodes if "insert_token" in str(n.target)]
    assert len(graphs) == 1 and len(ops) == 1, (len(graphs), ops)
    print("OK")
    """)
    assert out.strip() == "OK"


def wavelet(block: int) -> str:
    """The setup of a wavelet-kernel check: kvpop.kernels.order with blocks of ``block`` values, a seeded generator."""
    return textwrap.dedent(f"""
    import kvpop.kernels.order as ko
    from kvpop.order import prefix_kth_smallest_reference
    ko.launch_config = lambda n: {{"BLOCK": min({block}, ko.triton.next_power_of_2(max(n, 16))), "BQ": 16, "num_warps": 4}}
    g = torch.Generator().manual_seed(0)
    """)


BLOCKS = pytest.mark.parametrize("block", [16, 4096])  # 16: smaller than a row (the carried prefix counts across blocks); 4096: one block


@pytest.mark.parametrize("split", [False, True])
@BLOCKS
def test_wavelet_kernels_answer_as_the_tensor_twin(block, split):
    """kvpop.kernels.order (build + query) against kvpop.order.prefix_kth_smallest_reference, on the
    same random cases as tests/test_order.py (duplicates, empty and full prefixes, ranks out of range); the levels
    built by one program per sequence and by a grid over blocks (``split``: up to 17 blocks of 16)."""
    out = run_interpreted(wavelet(block) + f"split = {split}\n" + textwrap.dedent("""
    cases = 0
    for N, n, m, vmax in [(3, 1, 4, 0), (2, 37, 50, 5), (4, 64, 64, 63), (2, 100, 33, 1000), (1, 257, 300, 256), (2, 0, 5, 0)]:
        values = torch.randint(0, vmax + 1, (N, n), generator=g)
        prefix = torch.randint(0, n + 1, (N, m), generator=g)
        inside = 1 + (torch.rand(N, m, generator=g) * prefix).long()
        kth = torch.where(torch.rand(N, m, generator=g) < 0.5, inside, torch.randint(-1, n + 3, (N, m), generator=g))
        bits = max(1, vmax.bit_length())
        want = prefix_kth_smallest_reference(values, prefix, kth, bits=bits)
        got = ko.wavelet_kth_smallest(values, prefix, kth, bits, split=split)
        assert torch.equal(got, want), (N, n, m, vmax, (got != want).sum())
        cases += 1
    print("OK", cases)
    """))
    assert out.strip() == "OK 6"


@pytest.mark.slow  # 40,401 interpreted queries: over a minute each
@BLOCKS
def test_wavelet_kernels_answer_eviction_times_queries(block):
    """The same kernels on eviction_times' own queries of a packed row: every prefix and every rank of a
    permutation of 200 values (the order statistic it asks for), against the reference."""
    out = run_interpreted(wavelet(block) + textwrap.dedent("""
    perm = torch.randperm(200, generator=g)[None]
    p = torch.arange(201).repeat_interleave(201)[None]
    k = torch.arange(201).repeat(201)[None]
    assert torch.equal(ko.wavelet_kth_smallest(perm, p, k, 8), prefix_kth_smallest_reference(perm, p, k, bits=8))
    print("OK")
    """))
    assert out.strip() == "OK"


def test_block_lists_kernel_equals_the_tensor_twin():
    """kvpop.kernels.blockmask against kvpop.masks.block_lists_reference: packed rows with several
    documents, padding, sinks and random eviction times (so empty, partial and full blocks all occur),
    lengths that are and are not a multiple of the block, 1 and 3 query heads per KV head."""
    out = run_interpreted('''
    from conftest import packed_toy
    from kvpop.kernels.blockmask import block_lists
    from kvpop.masks import block_bounds, block_lists_reference
    g = torch.Generator().manual_seed(0)
    kinds = set()
    for B, Hk, S, bs, group, seed in [(2, 2, 64, 16, 3, 0), (1, 3, 100, 16, 1, 1), (2, 1, 37, 8, 2, 2), (1, 2, 200, 32, 4, 3)]:
        _, doc, pos = packed_toy(B, S, seed=seed)
        evict = torch.randint(0, 2 * S, (B, Hk, S), generator=g)
        evict = torch.where(torch.rand(B, Hk, S, generator=g) < 0.3, torch.arange(S) + 4, evict)
        evict[:, 0, : S // 2] = 10 * S  # the first head keeps the first half: whole blocks kept (full)
        bounds = block_bounds(doc, pos, evict, sinks=2, block_size=bs)
        want = block_lists_reference(*bounds, S=S, block_size=bs, group=group)
        got = block_lists(*bounds, S=S, block_size=bs, group=group)
        for w, x, name in zip(want, got, ("kv_num", "kv_idx", "full_num", "full_idx")):
            assert w.dtype == x.dtype and torch.equal(w, x), (B, Hk, S, bs, group, name)
        kinds.add((int(want[0].sum()) > 0, int(want[2].sum()) > 0))
    assert (True, True) in kinds, kinds  # partial and full blocks were both exercised
    print("OK")
    ''')
    assert out.strip() == "OK"


# every kernel the library launches: (module, kernel, argument types, constexpr specializations)
GPU_KERNELS = [
    ("insert", "_insert_kernel",
     dict(keys_ptr="*bf16", values_ptr="*bf16", pos_ptr="*i64", prio_ptr="*fp64", newk_ptr="*bf16", newv_ptr="*bf16", p_ptr="*i64",
          at_ptr="*i64", w1_ptr="*fp32", b1_ptr="*fp32", w2_ptr="*fp32", b2_ptr="*fp32", lg_ptr="*fp64", Hk="i32", T="i32", lr="i32",
          k="i32", leave_from="i32", window="i32"),
     [{"D": 128, "F": 64, "K": 2048, "MLP": mlp, "EVICT": evict, "BD": 128} for mlp, evict in ((True, True), (False, True), (True, False))]),
    ("order", "_build_kernel", dict(values_ptr="*i64", buf_ptr="*i32", zeros_ptr="*i32", n="i32", bits="i32"), [{"BLOCK": 4096}]),
    ("order", "_query_kernel", dict(zeros_ptr="*i32", prefix_ptr="*i64", kth_ptr="*i64", out_ptr="*i64", n="i32", m="i32", bits="i32"),
     [{"BQ": 1024}]),
    ("order", "_level_count_kernel", dict(buf_ptr="*i32", cnt_ptr="*i32", n="i32", src_half="i32", level="i32", nblk="i32"), [{"BLOCK": 4096}]),
    ("order", "_level_write_kernel", dict(buf_ptr="*i32", cnt_ptr="*i32", zeros_ptr="*i32", n="i32", src_half="i32", level="i32", bits="i32",
                                          nblk="i32"), [{"BLOCK": 4096, "NB": 64}]),
    ("blockmask", "_block_lists_kernel",
     dict(d_min_ptr="*i64", d_max_ptr="*i64", e_min_ptr="*i64", e_max_ptr="*i64", kv_num_ptr="*i32", kv_idx_ptr="*i32",
          full_num_ptr="*i32", full_idx_ptr="*i32", Hk="i32", nb="i32", S="i32", block_size="i32", group="i32"), [{"NB": 128}]),
    ("decay", "_decaying_times_kernel",
     dict(lb_ptr="*fp64", doc_ptr="*i64", pos_ptr="*i64", e_ptr="*i64", S="i32", Hk="i32", sinks="i32", window="i32", k="i32"),
     [{"K": 2048}]),
]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("module,kernel,types,specializations", GPU_KERNELS, ids=[k[1] for k in GPU_KERNELS])
def test_kernels_compile_for_the_gpu(module, kernel, types, specializations, arch):
    """Each kernel, in each specialization the library launches, compiled down to a cubin for sm_80
    (A100) and sm_90 (H100/H200) by Triton's front end and bundled ptxas, without a GPU: the
    interpreter runs what a GPU compile rejects (the fused insert kernel once read a non-constexpr
    global: the interpreter passed it, the H200 refused it)."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    fn = getattr(importlib.import_module(f"kvpop.kernels.{module}"), kernel)
    names = fn.arg_names
    for consts in specializations:
        assert set(names) == set(types) | set(consts), names
        src = ASTSource(fn, {n: types.get(n, "constexpr") for n in names}, {(names.index(n),): v for n, v in consts.items()})
        assert compile(src, target=GPUTarget("cuda", arch, 32)).asm["cubin"], (kernel, consts)



def test_the_selection_kernels_switch(monkeypatch):
    """kvpop.kernels.order and .blockmask run on CUDA by default (their GPU tests ran green on an
    H200); KVPOP_SELECTION_KERNELS=0 takes the tensor twins, and any other value is refused by name."""
    from kvpop.kernels import selection_kernels_enabled

    monkeypatch.delenv("KVPOP_SELECTION_KERNELS", raising=False)
    assert selection_kernels_enabled()  # triton is installed wherever this file runs (importorskip above)
    monkeypatch.setenv("KVPOP_SELECTION_KERNELS", "1")
    assert selection_kernels_enabled()
    monkeypatch.setenv("KVPOP_SELECTION_KERNELS", "0")
    assert not selection_kernels_enabled()
    monkeypatch.setenv("KVPOP_SELECTION_KERNELS", "yes")
    with pytest.raises(ValueError, match="KVPOP_SELECTION_KERNELS must be 0"):
        selection_kernels_enabled()
