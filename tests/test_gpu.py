"""GPU checks: the CUDA executor (compiled FlexAttention + BlockMask) against the CPU one (SDPA +
dense boolean mask), forward and backward, at the embedded model's shapes; a whole tiny model
through both executors with a learned scorer in training; and CPU == CUDA for the selection and
the boundary labels.

Run on a CUDA machine: ``PYTHONPATH=src python3 -m pytest -q -s tests/test_gpu.py`` (``-s`` shows
the printed max differences). Skipped where CUDA is not available.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvpop.attention import ScorerTraining, SparseContext, flex_execute, sdpa_execute
from kvpop.boundary import boundary_labels
from kvpop.geometry import CacheLayout
from kvpop.masks import block_mask_from_eviction_times, dense_mask, make_eviction_mask_mod
from kvpop.selection import NEVER, eviction_times

from conftest import packed_toy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# the embedded model's attention shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64)
S, H, HK, D, B = 2048, 9, 3, 64, 2
SINKS, WINDOW, K = 4, 256, 124
LAYOUT = CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=K)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()


def executor_inputs(S: int = S, seed: int = 0):
    """Packed rows (several documents, padding), random-priority eviction times, q/k/v, grad."""
    _, doc, pos = packed_toy(B, S, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    prio = torch.rand(B, HK, S, generator=g)
    evict = eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, HK, S, D, generator=g)
    v = torch.randn(B, HK, S, D, generator=g)
    dout = torch.randn(B, H, S, D, generator=g)
    return doc, pos, evict, q, k, v, dout


def run_executor(kind: str, device, doc, pos, evict, q, k, v, dout, backward: bool = True):
    """One executor ("sdpa": dense boolean mask; "flex": our BlockMask) -> (out, lse, grads, pattern)."""
    doc, pos, evict = doc.to(device), pos.to(device), evict.to(device)
    qq, kk, vv = (t.detach().to(device).clone().requires_grad_(backward) for t in (q, k, v))
    if kind == "sdpa":
        pattern = dense_mask(make_eviction_mask_mod(doc, pos, evict, sinks=SINKS, group=H // HK), B, H, q.shape[2], device)
        out, lse = sdpa_execute(qq, kk, vv, pattern, D**-0.5, need_lse=True)
    else:
        pattern = block_mask_from_eviction_times(doc, pos, evict, sinks=SINKS, num_heads=H)
        out, lse = flex_execute(qq, kk, vv, pattern, D**-0.5, need_lse=True)
    grads = None
    if backward:
        out.backward(dout.to(device))
        grads = (qq.grad, kk.grad, vv.grad)
    return out.detach(), lse, grads, pattern


def run_sdpa(device, *args, **kw):
    return run_executor("sdpa", device, *args, **kw)


def run_flex(device, *args, **kw):
    return run_executor("flex", device, *args, **kw)


def compare_executors(sdpa_device, flex_device, backward: bool = True, S_: int = S, atol: float = 2e-3):
    """Returns the max abs differences {out, lse, dq, dk, dv}; asserts they are below ``atol``."""
    inputs = executor_inputs(S_)
    o1, l1, g1, allowed = run_sdpa(sdpa_device, *inputs, backward=backward)
    o2, l2, g2, bm = run_flex(flex_device, *inputs, backward=backward)
    # the BlockMask, materialized, is exactly the dense mask
    from torch.nn.attention.flex_attention import create_mask

    dense_from_bm = create_mask(bm.mask_mod, B, H, S_, S_, device=flex_device)
    assert torch.equal(dense_from_bm.cpu(), allowed.cpu())
    doc = inputs[0]
    real = (doc >= 0)[:, None, :]  # padding queries attend only to themselves; compare all the same
    diffs = {"out": _maxdiff(o1, o2), "lse": _maxdiff(l1 * real.to(l1.device), l2 * real.to(l2.device))}
    if backward:
        for name, a, b in zip(("dq", "dk", "dv"), g1, g2, strict=True):
            diffs[name] = _maxdiff(a, b)
    print(f"\n[executors] sdpa on {sdpa_device} vs flex on {flex_device}, S={S_} float32: "
          + ", ".join(f"max|d{n}|={d:.2e}" for n, d in diffs.items()))
    for n, d in diffs.items():
        assert d < atol, f"{n}: max abs difference {d:.3e} >= {atol}"
    return diffs


@pytest.fixture(autouse=True)
def _fp32_exact():
    """Keep float32 matmuls in IEEE precision (no TF32) so both executors compute the same thing."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_flex_matches_sdpa_cuda():
    compare_executors("cuda", "cuda")


def test_flex_cuda_matches_sdpa_cpu():
    compare_executors("cpu", "cuda")


# --- (b) a whole tiny model through SparseContext, sdpa vs flex, learned scorer in training ------

def tiny_model_case(model_dir, device: str, S_: int = 512, sinks: int = 4, window: int = 64, k: int = 32, flex_backward: bool = True):
    """Logits, per-layer boundary losses and grads of a tiny Llama under kvpop_mlp, per executor."""
    from kvpop.modeling import load_model, model_shape
    from kvpop.policies import make_policy

    model = load_model(model_dir).to(device)
    shape = model_shape(model)
    torch.manual_seed(0)
    policy0 = make_policy("kvpop_mlp", **{n: shape[n] for n in ("num_layers", "num_kv_heads", "head_dim")}, scorer_hidden=16).to(device)
    ids, doc, pos = packed_toy(2, S_, seed=3)
    ids = ids % model.config.vocab_size
    ids, doc, pos = ids.to(device), doc.to(device), pos.to(device)
    results = {}
    for executor in ("sdpa", "flex"):
        m = copy.deepcopy(model)
        pol = copy.deepcopy(policy0)
        backward = executor == "sdpa" or flex_backward
        ctx = SparseContext.for_rows(pol, doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), executor=executor,
                                     scorer_training=ScorerTraining(tau=1.0, tie_margin=0.5))
        with torch.set_grad_enabled(backward):
            logits = m(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
        losses = torch.stack(ctx.losses)
        if backward:
            (logits.float().pow(2).mean() + losses.mean()).backward()
        results[executor] = dict(
            logits=logits.detach(),
            losses=losses.detach(),
            decisions=torch.stack([s["decisions"] for s in ctx.stats]),
            scorer_grads={n: p.grad for n, p in pol.named_parameters()} if backward else {},
            model_grads={n: p.grad for n, p in m.named_parameters() if p.grad is not None} if backward else {},
        )
    return results


def compare_tiny_model(res, rtol: float = 2e-2) -> dict[str, float]:
    a, b = res["sdpa"], res["flex"]
    out = {"logits": _maxdiff(a["logits"], b["logits"]), "losses": _maxdiff(a["losses"], b["losses"])}
    assert torch.equal(a["decisions"], b["decisions"])
    rel = 0.0
    for kind in ("scorer_grads", "model_grads"):
        # per parameter, relative to max(its norm, 1e-3 x the norm of all grads of this kind): the
        # last bias of each scorer MLP gets only cancellation noise (the loss sees r_hat differences)
        total = torch.sqrt(sum(g.double().pow(2).sum() for g in a[kind].values())).item()
        worst = 0.0
        for n, ga in a[kind].items():
            gb = b[kind][n]
            worst = max(worst, ((ga - gb).norm() / max(ga.norm().item(), 1e-3 * total, 1e-30)).item())
        out[f"{kind} (max rel. norm err)"] = worst
        rel = max(rel, worst)
    print("\n[tiny model] sdpa vs flex: " + ", ".join(f"{n}={d:.2e}" for n, d in out.items())
          + f"; losses sdpa={a['losses'].tolist()} flex={b['losses'].tolist()}")
    assert out["logits"] < 1e-3
    assert out["losses"] < 1e-3 * max(1.0, a["losses"].abs().max().item())
    assert rel < rtol
    return out


def test_tiny_model_sdpa_vs_flex(tiny_llama_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    compare_tiny_model(tiny_model_case(tiny_llama_dir, "cuda"))


# --- (c) selection and boundary labels: CUDA == CPU ------------------------------------------------

def test_eviction_times_cuda_equals_cpu(monkeypatch):
    """On CUDA the order statistic runs as Triton kernels (kvpop.kernels.order; the default, set
    here explicitly), on the CPU as its tensor twin: the same eviction times, up to the training lengths (16K and 32K)."""
    monkeypatch.setenv("KVPOP_SELECTION_KERNELS", "1")
    for seed, S_ in ((0, 2048), (1, 4096), (2, 16384), (3, 32768)):
        _, doc, pos = packed_toy(B, S_, seed=seed)
        prio = torch.rand(B, HK, S_, generator=torch.Generator().manual_seed(seed))
        for k in (0, 1, K, 700, 1788):
            cpu = eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=k)
            gpu = eviction_times(prio.cuda(), doc.cuda(), pos.cuda(), sinks=SINKS, window=WINDOW, long_range=k)
            assert torch.equal(cpu, gpu.cpu()), (seed, S_, k)
        # ties: quantized priorities, broken by recency on both devices
        prio_t = (prio * 8).floor()
        cpu = eviction_times(prio_t, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
        gpu = eviction_times(prio_t.cuda(), doc.cuda(), pos.cuda(), sinks=SINKS, window=WINDOW, long_range=K)
        assert torch.equal(cpu, gpu.cpu())


def test_block_mask_cuda_equals_cpu(monkeypatch):
    """On CUDA the BlockMask's block lists come from a Triton kernel (kvpop.kernels.blockmask; the
    default, set here explicitly), on the CPU from its tensor twin: the same KV-block counts and
    index lists, and the same transposed (query-side) lists BlockMask derives from them, at training
    lengths."""
    monkeypatch.setenv("KVPOP_SELECTION_KERNELS", "1")
    for seed, S_ in ((0, 2048), (1, 16384)):
        _, doc, pos = packed_toy(B, S_, seed=seed)
        prio = torch.rand(B, HK, S_, generator=torch.Generator().manual_seed(seed))
        evict = eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K if S_ < 4096 else 1788)
        cpu = block_mask_from_eviction_times(doc, pos, evict, sinks=SINKS, num_heads=H)
        gpu = block_mask_from_eviction_times(doc.cuda(), pos.cuda(), evict.cuda(), sinks=SINKS, num_heads=H)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices"):
            assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), (S_, name)


@pytest.mark.parametrize("k", [0, 3, K, 252, 1788])
def test_decaying_eviction_times_kernel_equals_reference(k):
    """The Triton kernel of the decaying cache (trimkv) against its tensor twin on the CPU: packed
    documents, a 4,096-token row, distinct and tied (quantized) retention rates, k up to Qwen3-4B's
    1,788 slots at budget 2,048."""
    import time

    from kvpop.kernels import triton_available
    from kvpop.selection import decaying_eviction_times, decaying_eviction_times_reference

    assert triton_available()  # else the CUDA call below would run the reference, not the kernel

    S_ = 4096
    _, doc, pos = packed_toy(B, S_, seed=k)
    g = torch.Generator().manual_seed(k)
    for lb in (-torch.rand(B, HK, S_, generator=g) * 0.01, -torch.randint(1, 4, (B, HK, S_), generator=g).float() * 1e-3):
        ref = decaying_eviction_times_reference(lb, doc, pos, sinks=SINKS, window=WINDOW, long_range=k)
        t0 = time.perf_counter()
        got = decaying_eviction_times(lb.cuda(), doc.cuda(), pos.cuda(), sinks=SINKS, window=WINDOW, long_range=k)
        torch.cuda.synchronize()
        print(f"decaying times k={k}: kernel {1e3 * (time.perf_counter() - t0):.1f} ms (first call compiles)")
        assert torch.equal(ref, got.cpu()), (k, (ref != got.cpu()).sum().item())
    if k <= K:
        assert (ref != NEVER).any()  # the rule evicted something, so the comparison had content


def test_boundary_labels_cuda_equal_cpu():
    _, doc, pos = packed_toy(B, S, seed=5)
    g = torch.Generator().manual_seed(5)
    r_tgt = torch.randn(B, HK, S, generator=g)
    log_gamma = torch.log(torch.tensor([0.9999, 0.99999, 0.9995], dtype=torch.float64))
    cpu = boundary_labels(r_tgt, log_gamma, doc, pos, layout=LAYOUT)
    gpu = boundary_labels(r_tgt.cuda(), log_gamma.cuda(), doc.cuda(), pos.cuda(), layout=LAYOUT)
    assert cpu.row.numel() > 0
    for f in ("row", "t_new", "t_bnd", "y"):
        assert torch.equal(getattr(cpu, f), getattr(gpu, f).cpu()), f


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("policy_name", ["streaming_llm", "kvpop_mlp", "kvpop", "dms", "trimkv"])
def test_bounded_cache_decoding_equals_flex_training_forward(model_type, policy_name, tiny_model):
    """Token-by-token decoding with the bounded cache on CUDA equals the CUDA (FlexAttention) training forward."""
    from kvpop.attention import SparseContext
    from kvpop.decode import enable, teacher_forced_logits
    from kvpop.policies import make_policy, resolve_policy

    dev = torch.device("cuda")
    model = enable(tiny_model(model_type).to(dev))
    policy = make_policy(policy_name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8).to(dev)
    for p in policy.parameters():  # a scorer past its initialization (moderate weights)
        torch.nn.init.normal_(p, std=0.2)
    sinks, window, budget, S = 2, 8, 20, 160
    k = policy.long_range_slots(layout=CacheLayout(budget, sinks, window), head_dim=16)
    ids = torch.randint(0, 96, (2, S), generator=torch.Generator().manual_seed(1)).to(dev)
    pos = torch.arange(S, device=dev).expand(2, S)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), executor="flex")
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    trained = policy if policy_name != "streaming_llm" else None
    got = teacher_forced_logits(model, resolve_policy(policy_name, trained), ids, layout=CacheLayout(budget, sinks, window), prefill=40)
    diff = (got - ref).abs().max().item()
    print(f"{model_type} {policy_name}: decode vs flex training forward max |diff| = {diff:.2e}")
    assert diff < 1e-3


@pytest.mark.parametrize("policy_name", ["dbtrimkv", "kvpop_mlp, one pool"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_one_pool_decoding_equals_the_flex_fixed_point(model_type, policy_name, tiny_model):
    """The one-pool policies on CUDA (dbtrimkv's decaying retentions, OnePool's static priorities):
    the fixed-point forward (FlexAttention under the pool's eviction times) equals token-by-token
    decoding through the pool (kvpop.decode.one_pool), and the pool really moved slots between heads."""
    from kvpop.decode import enable, teacher_forced_logits
    from kvpop.evaluate import captured_forward
    from kvpop.policies import OnePool, make_policy

    dev = torch.device("cuda")
    model = enable(tiny_model(model_type).to(dev))
    torch.manual_seed(0)
    if policy_name == "dbtrimkv":
        policy = make_policy("dbtrimkv", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
        with torch.no_grad():  # drawn on the CPU, then moved: the same weights on every machine
            policy.scorer.w1.normal_(std=0.3)
            policy.scorer.w1[1] *= 3  # the layers' retention rates differ: the pool splits unevenly
            policy.scorer.w2.normal_(std=0.5)
            policy.scorer.b2.fill_(2.0)
    else:
        scorer = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
        with torch.no_grad():
            for mlp in scorer.scorer.layers:
                mlp.w2.normal_(std=1.0)
            scorer.scorer.layers[1].b2[1] += 3.0  # one head's tokens score higher: it takes slots from the others
        policy = OnePool(scorer)
    policy.to(dev)
    sinks, window, budget, S = 2, 8, 20, 160
    ids = torch.randint(0, 96, (1, S), generator=torch.Generator().manual_seed(1)).to(dev)
    ref, evict = captured_forward(model, policy, ids, layout=CacheLayout.of(sinks=sinks, window=window, long_range=budget - sinks - window))
    got = teacher_forced_logits(model, policy, ids, layout=CacheLayout(budget, sinks, window), prefill=budget)[0]
    diff = (got - ref).abs().max().item()
    held = (evict > S - 1).sum(-1)  # (L, Hk) entries at the last query
    print(f"{model_type} {policy_name}: decode vs flex fixed point max |diff| = {diff:.2e}; held {held.tolist()}")
    assert diff < 1e-3
    assert int(held.sum()) == 2 * 2 * budget and int(held.max()) > budget


@pytest.mark.parametrize("policy_name", ["dbtrimkv", "kvpop_mlp, one pool", "kvpop_mlp_pool"])
def test_chunked_pool_forward_equals_the_flex_fixed_point_and_the_training_forward(policy_name, tiny_model):
    """On CUDA: the chunked pool forward (kvpop.pool, SDPA per chunk) reaches the fixed point's times (FlexAttention
    full forwards), with equal logits; the training forward (FlexAttention under those times, as
    kvpop_mlp_pool trains) gives the same logits."""
    from kvpop.attention import SparseContext
    from kvpop.decode import enable
    from kvpop.evaluate import pool_fixed_point
    from kvpop.policies import OnePool, make_policy
    from kvpop.pool import pool_chunked

    dev = torch.device("cuda")
    model = enable(tiny_model("llama").to(dev))
    torch.manual_seed(0)
    base = "dbtrimkv" if policy_name == "dbtrimkv" else "kvpop_mlp" if policy_name.startswith("kvpop_mlp,") else policy_name
    policy = make_policy(base, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    with torch.no_grad():
        if base == "dbtrimkv":
            policy.scorer.w1.normal_(std=0.3)
            policy.scorer.w2.normal_(std=0.5)
            policy.scorer.b2.fill_(2.0)
        else:
            for mlp in policy.scorer.layers:
                mlp.w2.normal_(std=1.0)
    if policy_name.startswith("kvpop_mlp,"):
        policy = OnePool(policy)
    policy.to(dev)
    layout = CacheLayout(20, 2, 8)
    ids = torch.randint(0, 96, (3, 160), generator=torch.Generator().manual_seed(2)).to(dev)
    want, want_logits = pool_fixed_point(model, policy, ids, layout=layout, keep_logits=True)
    got, logits = pool_chunked(model, policy, ids, layout=layout, keep_logits=True)
    assert torch.equal(got, want.long()) and bool((got < 160).any())
    assert _maxdiff(logits, want_logits) < 1e-3
    pos = torch.arange(160, device=dev).expand(3, 160)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout, global_evict=got, executor="flex")
    with torch.no_grad():
        train_logits = model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits.float()
    assert _maxdiff(train_logits, logits) < 1e-3


@pytest.mark.parametrize("delay", [0, 4, 7])
def test_delayed_mlstm_pool_chunked_equals_the_flex_fixed_point_decoding_and_the_training_forward(delay, tiny_model):
    """kvpop_pool on CUDA (the mLSTM read out at j + delay, kvpop.policies.kvpop_pool): the chunked pool forward
    (chunks of window - delay, the mLSTM streamed over them) reaches the fixed point's times (FlexAttention full
    forwards) with equal logits; token-by-token decoding through OnePoolCache and the training forward
    (FlexAttention under those times, on packed rows too) give the same logits, and the training forward's
    priorities give the same times back."""
    from kvpop.decode import enable, teacher_forced_logits
    from kvpop.evaluate import pool_fixed_point
    from kvpop.policies import make_policy
    from kvpop.pool import pool_chunked
    from kvpop.selection import global_eviction_times

    dev = torch.device("cuda")
    model = enable(tiny_model("llama").to(dev))
    torch.manual_seed(0)
    policy = make_policy("kvpop_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_dk=4, scorer_dv=4, scorer_delay=delay)
    with torch.no_grad():  # drawn on the CPU, then moved
        for cell in policy.scorer.layers:
            cell.w_gate.normal_(std=0.3)
            cell.w_o.mul_(3.0)
    policy.to(dev)
    nominal = CacheLayout(21, 2, 8)  # one slot for the mLSTM state (21 numbers at head dim 16)
    layout = nominal.for_policy(policy, head_dim=16)
    assert layout.long_range == 10
    ids = torch.randint(0, 96, (3, 160), generator=torch.Generator().manual_seed(2)).to(dev)
    want, want_logits = pool_fixed_point(model, policy, ids, layout=layout, keep_logits=True)
    got, logits = pool_chunked(model, policy, ids, layout=layout, keep_logits=True)
    assert torch.equal(got, want.long()) and bool((got < 160).any())
    d_fixed = _maxdiff(logits, want_logits)
    decoded = teacher_forced_logits(model, policy, ids, layout=nominal, prefill=layout.slots)
    d_decode = _maxdiff(decoded, logits)
    pos = torch.arange(160, device=dev).expand(3, 160)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout, global_evict=got, executor="flex")
    with torch.no_grad():
        train_logits = model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits.float()
    d_train = _maxdiff(train_logits, logits)
    ids_p, doc, pos_p = (t.to(dev) for t in packed_toy(2, 160, seed=3))
    got_p, logits_p = pool_chunked(model, policy, ids_p, layout=layout, doc_ids=doc, pos=pos_p, keep_logits=True)
    ctx = SparseContext.for_rows(policy, doc, pos_p, layout, global_evict=got_p, executor="flex")
    with torch.no_grad():
        train_p = model(input_ids=ids_p, position_ids=pos_p, kvpop_ctx=ctx).logits.float()
    prio = torch.stack([ctx.global_prio[i] for i in sorted(ctx.global_prio)])
    again = global_eviction_times(prio, doc, pos_p, sinks=layout.sinks, window=layout.window, long_range=layout.long_range)
    d_packed = _maxdiff(train_p[doc >= 0], logits_p[doc >= 0])
    print(f"kvpop_pool delay {delay}: chunked vs flex fixed point {d_fixed:.2e}, vs decoding {d_decode:.2e}, "
          f"flex training forward {d_train:.2e}, packed {d_packed:.2e}")
    assert max(d_fixed, d_decode, d_train, d_packed) < 1e-3
    assert torch.equal(again.long(), got_p) and bool((got_p < 160).any())


def pool_policy_case(policy_name: str, tiny_model):
    """A tiny llama on CUDA and ``policy_name`` (kvpop_mlp_pool, or kvpop_pool at delay 3) with random weights, seeded,
    and its layout (budget 21, sinks 2, window 8): (device, model, policy, layout)."""
    from kvpop.decode import enable
    from kvpop.policies import make_policy

    dev = torch.device("cuda")
    model = enable(tiny_model("llama").to(dev))
    torch.manual_seed(0)
    extra = dict(scorer_dk=4, scorer_dv=4, scorer_delay=3) if policy_name == "kvpop_pool" else dict(scorer_hidden=8)
    policy = make_policy(policy_name, num_layers=2, num_kv_heads=2, head_dim=16, **extra)
    with torch.no_grad():
        policy.scorer.decay.logit.normal_()
        for cell in policy.scorer.layers:
            for p in cell.parameters():
                p.normal_(std=0.3)
    policy.to(dev)
    return dev, model, policy, CacheLayout(21, 2, 8).for_policy(policy, head_dim=16)


@pytest.mark.parametrize("policy_name", ["kvpop_mlp_pool", "kvpop_pool"])
def test_stacked_scorers_equal_the_layer_by_layer_twins_on_cuda(policy_name, tiny_model):
    """On CUDA, as training runs them (FlexAttention, bf16 autocast): the chunked pass that scores a chunk's every
    layer in one call (Policy.all_layers) gives its layer-by-layer twin's times on packed rows, and the training
    forward whose scorers run once after the forward (SparseContext.stack_scorers) its twin's logits, loss and
    gradients."""
    from kvpop.pool import pool_chunked

    dev, model, policy, layout = pool_policy_case(policy_name, tiny_model)
    ids, doc, pos = (t.to(dev) for t in packed_toy(2, 160, seed=4))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        evict, _ = pool_chunked(model, policy, ids, layout=layout, doc_ids=doc, pos=pos)
        twin, _ = pool_chunked(model, policy, ids, layout=layout, doc_ids=doc, pos=pos, stack_layers=False)
    assert torch.equal(evict, twin) and bool((evict < 160).any())
    runs = []
    for stack in (True, False):
        policy.zero_grad(set_to_none=True)
        ctx = SparseContext.for_rows(policy, doc, pos, layout, executor="flex", scorer_training=ScorerTraining(weighting="uniform"),
                                     global_evict=evict, stack_scorers=stack)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False).logits.float()
            (loss,) = ctx.finish_scorer_losses()
        loss.backward()
        runs.append((logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}))
    (lg, ls, gr), (lg2, ls2, gr2) = runs
    assert torch.equal(lg, lg2)
    assert abs(float(ls - ls2)) <= 1e-5 * max(1.0, abs(float(ls2)))
    for name in gr:
        assert _maxdiff(gr[name], gr2[name]) <= 1e-4 * max(1.0, float(gr2[name].abs().max())), name


@pytest.mark.parametrize("policy_name", ["kvpop_mlp_pool", "kvpop_pool"])
def test_chunked_graphs_replay_the_eager_pass(policy_name, tiny_model):
    """kvpop.pool.ChunkedGraphs (train.pool_graphs): the chunked pool pass captured once per row shape and replayed
    gives the eager pass's times under bf16 autocast as training runs it: on the rows it was captured with, on new
    packed rows, and after the scorer's and the model's weights change in place (an optimizer step); a new shape
    is a second graph. Both must be captured (a fallback fails here, naming why): the delayed mLSTM's stream reads
    each chunk's readers over a range fixed by the chunk and the delay (kvpop.mlstm.ChunkwiseStream's ``delay``), not
    over the rows' document spans read on the host."""
    from kvpop.pool import ChunkedGraphs, pool_chunked

    dev, model, policy, layout = pool_policy_case(policy_name, tiny_model)
    run = ChunkedGraphs(model, policy, layout=layout)

    def both(ids, doc, pos):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = run(ids, doc_ids=doc, pos=pos)
            want, _ = pool_chunked(model, policy, ids, layout=layout, doc_ids=doc, pos=pos)
        assert run.fallback is None, run.fallback
        return got, want

    rows = [tuple(t.to(dev) for t in packed_toy(2, 160, seed=s)) for s in (4, 5)]
    for ids, doc, pos in rows:
        got, want = both(ids, doc, pos)
        assert torch.equal(got, want) and bool((want < 160).any())
    with torch.no_grad():  # an optimizer step: the weights change where they are
        for p in [*policy.parameters(), *model.parameters()]:
            p.add_(torch.randn_like(p) * 0.05)
    got, want = both(*rows[0])
    assert torch.equal(got, want)
    got, want = both(*(t.to(dev) for t in packed_toy(1, 96, seed=6)))
    assert torch.equal(got, want) and len(run.graphs) == 2
    held = [p.data for p in policy.parameters()]  # their memory stays taken, so the weights come back elsewhere (else the
    policy.cpu()  # caching allocator may hand back the same addresses: the graphs stay right, and are kept)
    policy.to(dev)  # the weights move (to the CPU and back, as a fit's end does): the graphs are captured again
    del held
    got, want = both(*rows[1])
    assert torch.equal(got, want) and len(run.graphs) == 1


def random_policy(name: str):
    """``name`` on the tiny models (2 layers, 2 KV heads, head dim 16) with random weights, seeded; dbtrimkv's
    retentions around logsigmoid(2), so that some tokens decay fast and some slowly."""
    from kvpop.policies import make_policy

    torch.manual_seed(0)
    policy = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    with torch.no_grad():
        for p in policy.parameters():
            p.normal_(std=0.5)
        if name == "dbtrimkv":
            policy.scorer.b2.fill_(2.0)
    return policy


# --- the decode engine: compiled (CUDA graph) step == eager step == BoundedCache on CUDA ---------------
@pytest.mark.parametrize("policy_name", ["streaming_llm", "kvpop_mlp", "kvpop", "dms", "dense"])
def test_compiled_engine_equals_bounded_cache(policy_name, tiny_model):
    from kvpop.decode import enable, teacher_forced_logits
    from kvpop.decode.engine import DecodeEngine
    from kvpop.policies import make_policy

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    model = enable(tiny_model("qwen3").cuda())
    sinks, window, budget, S, pre = 4, 32, 4 + 32 + 48, 400, 300
    policy = make_policy(policy_name, num_layers=2, num_kv_heads=2, head_dim=16)
    for p in policy.parameters():
        torch.nn.init.normal_(p, std=0.3)
    policy.cuda()
    ids = torch.randint(0, 96, (2, S), generator=torch.Generator().manual_seed(1)).cuda()
    if policy_name == "dense":
        with torch.no_grad():
            ref = model(input_ids=ids).logits
    else:
        ref = teacher_forced_logits(model, policy, ids, layout=CacheLayout(budget, sinks, window), prefill=pre)
    kw = dict(layout=CacheLayout(budget, sinks, window), batch_size=2, chunk=128) if policy_name != "dense" else dict(max_len=512, batch_size=2, chunk=128)
    got = {}
    fusable = policy_name in ("streaming_llm", "kvpop_mlp")  # static rules: the fused insert kernel (kvpop.kernels.insert)
    for mode in (None, "layer", "step"):  # eager, then both compile modes (each captured as one CUDA graph)
        for fused in (False, True) if fusable else (False,):
            eng = DecodeEngine(model, None if policy_name == "dense" else policy, compile=mode is not None, compile_mode=mode or "layer",
                               fused=fused, **kw)
            assert eng.compile_mode == mode and eng.fused == fused
            logits = [eng.prefill(ids[:, :pre]).clone()]
            for t in range(pre, S):
                eng.tok.copy_(ids[:, t : t + 1])
                logits.append(eng.step().clone())
            got[mode, fused] = torch.stack(logits, 1)
    d_ref = _maxdiff(got[None, False], ref[:, pre - 1 :])
    diffs = {key: _maxdiff(x, got[None, False]) for key, x in got.items()}
    print(f"engine {policy_name}: eager vs reference {d_ref:.2e}; vs eager tensor code: "
          + ", ".join(f"{m or 'eager'}{' fused' if f else ''} {d:.2e}" for (m, f), d in diffs.items()))
    assert d_ref < 1e-4 and max(diffs.values()) < 1e-4


@pytest.mark.parametrize("policy_name", ["kvpop_mlp", "dense"])
def test_compiled_engine_prefills_prompts_of_any_length_without_recompiling(policy_name, tiny_model):
    """A prompt's last prefill chunk has a new length for almost every prompt (RULER's samples, ``kvpop generate``):
    FlexAttention compiled with symbolic lengths serves them all. Chunks of 256: the first two prompts compile every shape (a full
    chunk on an empty and on a filled cache; a last chunk, padded to the chunk's 256 queries, over each KV block count the
    rule's candidates take), then 12 more lengths run under ``error_on_recompile``: among them last chunks of a single token
    and of 128 (one query block), which compiled anew before the padding (H200, 2026-12-05); every prompt's last logits
    equal the reference cache's, and the symbolic compile never fell back to the per-shape one."""
    from kvpop.attention import ANY_LENGTH_FAILED
    from kvpop.decode import enable, teacher_forced_logits
    from kvpop.decode.engine import DecodeEngine
    from kvpop.policies import make_policy

    model = enable(tiny_model("qwen3").cuda())
    sinks, window, budget = 4, 32, 4 + 32 + 48
    layout = CacheLayout(budget, sinks, window)
    policy = None
    if policy_name != "dense":
        policy = make_policy(policy_name, num_layers=2, num_kv_heads=2, head_dim=16)
        for p in policy.parameters():
            torch.nn.init.normal_(p, std=0.3)
        policy.cuda()
    lengths = [600, 700, 333, 402, 419, 450, 477, 499, 515, 530, 261, 640, 777, 769]  # 769: a last chunk of 1
    eng = DecodeEngine(model, policy, layout=layout, max_len=None if policy else 800, batch_size=1, chunk=256, compile=True)
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for j, S in enumerate(lengths):
        ids = torch.randint(0, 96, (1, S), generator=gen).cuda()
        with torch.no_grad():
            ref = (model(input_ids=ids).logits if policy is None else teacher_forced_logits(model, policy, ids, layout=layout, prefill=S))[:, -1]
        eng.reset()
        with torch._dynamo.config.patch(error_on_recompile=j >= 2):
            got = eng.prefill(ids)
        worst = max(worst, _maxdiff(got, ref))
    print(f"engine {policy_name}: {len(lengths)} prompt lengths, max |logits - reference| {worst:.2e}")
    assert not ANY_LENGTH_FAILED, ANY_LENGTH_FAILED
    assert worst < 1e-4


def test_pooled_chunk_flex_attention_equals_its_sdpa_twin_on_cuda():
    """The compiled engine's chunk attention (FlexAttention compiled for any length over chunk_block_mask: each head's
    entry blocks and the chunk's causal blocks, padding skipped) against its SDPA twin, bf16, widths of 1, 3 and 4
    blocks of entries, heads holding none, a block and one, and all of them; the chunk's 256 queries in 2 blocks."""
    from kvpop.decode.engine import chunk_attention_flex, chunk_attention_sdpa

    g = torch.Generator().manual_seed(5)
    B, Hk, G, C, D, c0 = 2, 4, 4, 256, 64, 5000
    qpos = torch.arange(c0, c0 + C).cuda()
    for n in (128, 384, 512):
        lo = torch.full((B, Hk, n + C), NEVER)
        hi = torch.full((B, Hk, n + C), NEVER)
        lo[..., n:] = torch.arange(c0, c0 + C)
        for h, held in enumerate([0, 128, 129, n]):
            held = min(held, n)
            lo[:, h, :held] = torch.randint(0, c0, (B, held), generator=g)
            hi[:, h, :held] = torch.where(torch.rand(B, held, generator=g) < 0.2, torch.randint(c0 + 1, c0 + C, (B, held), generator=g), NEVER)
        lo, hi = lo.cuda(), hi.cuda()
        q = torch.randn(B, Hk * G, C, D, generator=g).cuda().bfloat16()
        k, v = (torch.randn(B, Hk, n + C, D, generator=g).cuda().bfloat16() for _ in range(2))
        want = chunk_attention_sdpa(q, k, v, lo, hi, qpos, D**-0.5)
        got = chunk_attention_flex(q, k, v, lo, hi, qpos, D**-0.5, entries=n)
        assert _maxdiff(got, want) < 2e-2, n


@pytest.mark.parametrize("policy_name", ["dbtrimkv", "kvpop_mlp, one pool", "kvpop_pool"])
def test_compiled_pooled_engine_equals_one_pool_cache(policy_name, tiny_model, monkeypatch):
    """The pooled engine (kvpop.decode.pooled) on CUDA: the compiled step (FlexAttention's decoding kernel over
    each layer's pages, the pool's competition inside the CUDA graph) and the prefill's competitions (in one pass
    per chunk, and their twin: one graph replayed per query) equal the eager engine and token-by-token OnePoolCache; two rows, a prompt
    longer than the budget (six whole chunks, then a partial one), then steps; both hold the same entries. With
    ``chunk_graphs`` each whole chunk's layers run as CUDA graphs on static buffers (one per layer and width). The step's
    attention split into 3 parts (engine.POOL_SPLIT_KV), the selection by sorts (pooled.RANKED_SELECTION off) and the store
    read in row groups, each row its own (pooled.GROUP_ELEMENTS: what batch 64 of Qwen3-4B needs) too."""
    import kvpop.decode.engine
    import kvpop.decode.pooled
    from kvpop.decode import enable, teacher_forced_logits
    from kvpop.decode.engine import DecodeEngine
    from kvpop.policies import OnePool

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    model = enable(tiny_model("qwen3").cuda())
    base = policy_name if policy_name in ("dbtrimkv", "kvpop_pool") else "kvpop_mlp"
    policy = random_policy(base)
    policy = (OnePool(policy) if base == "kvpop_mlp" else policy).cuda()  # kvpop_pool: each layer's mLSTM read out at j + d
    layout = CacheLayout(4 + 32 + 48, 4, 32)
    S, pre = 300, 200
    ids = torch.randint(0, 96, (2, S), generator=torch.Generator().manual_seed(1)).cuda()
    ref = teacher_forced_logits(model, policy, ids, layout=layout, prefill=1)
    got, held = {}, {}
    # (compiled, one pass, list steps, chunk graphs): the prefill chunks' competitions in one pass (PoolStore.compete_static,
    # a static rule; compete_decaying, dbtrimkv's candidate lists) and their twin, the graphed per-query replay; the step
    # over its candidate list (every 8 steps, PoolStore.refresh_list) and over the whole pool (list_steps=0); the
    # whole chunks' layers as CUDA graphs; (split, sorted): the step's attention in 3 parts, the sorted selection
    modes = [(False, True, 8, False, None), (True, True, 8, False, None), (True, False, 8, False, None), (True, True, 0, False, None),
             (True, True, 8, False, "split"), (True, True, 8, False, "sorted"), (True, True, 8, False, "grouped")]
    group_elements = kvpop.decode.pooled.GROUP_ELEMENTS
    if base != "kvpop_pool":  # prefill chunks of window - d = 24 (192: eight whole ones); no chunk graphs for a recurrent state
        modes.append((True, True, 8, True, None))
    for compiled, closed, list_steps, graphs, variant in modes:
        monkeypatch.setattr(kvpop.decode.engine, "POOL_SPLIT_KV", 3 if variant == "split" else None)
        monkeypatch.setattr(kvpop.decode.pooled, "RANKED_SELECTION", variant != "sorted")
        monkeypatch.setattr(kvpop.decode.pooled, "GROUP_ELEMENTS", 1 if variant == "grouped" else group_elements)
        eng = DecodeEngine(model, policy, layout=layout, batch_size=2, compile=compiled, list_steps=list_steps, chunk_graphs=graphs)
        eng.pool_closed_form = closed
        assert eng.kind == "pooled" and eng.store.page == 128 and eng.store.list_steps == list_steps
        assert len(eng.store.groups) == (2 if variant == "grouped" else 1)
        logits = [eng.prefill(ids[:, :192]).clone(), eng.prefill(ids[:, 192:pre]).clone()]
        if graphs:
            assert len(eng._layer_graphs) >= len(eng.layers)  # every layer captured (a graph per width bucket it met)
        for t in range(pre, S):
            eng.tok.copy_(ids[:, t : t + 1])
            logits.append(eng.step().clone())
        if compiled:
            assert (True in eng._graphs) == bool(list_steps)  # the graph over the list ran
        got[compiled, closed, list_steps, graphs, variant] = torch.stack(logits, 1)
        st = eng.store
        held[compiled, closed, list_steps, graphs, variant] = sorted(h for h in zip(st.tag.flatten().tolist(), st.pos.flatten().tolist(),
                                                       [b for b in range(2) for _ in range(st.NS)]) if h[0] >= 0)
    eager = got[modes[0]]
    d_ref = _maxdiff(eager, ref[:, [191, *range(pre - 1, S)]])
    d_comp = {m: _maxdiff(x, eager) for m, x in got.items() if m != modes[0]}
    print(f"pooled engine {policy_name}: eager vs OnePoolCache {d_ref:.2e}; vs eager: "
          + ", ".join(f"compiled{' one pass' if c else ' replay'}{'' if n else ' whole pool'}{' chunk graphs' if g else ''} {v or ''} {d:.2e}"
                      for (_, c, n, g, v), d in d_comp.items()))
    assert d_ref < 1e-4 and max(d_comp.values()) < 1e-4
    assert all(h == held[modes[0]] for h in held.values())


@pytest.mark.parametrize("policy_name", ["dense", "kvpop_mlp", "kvpop", "dbtrimkv", "kvpop_mlp_pool", "kvpop_pool"])
def test_ragged_prompts_on_compiled_engines_get_the_answers_they_get_alone(policy_name, tiny_model):
    """RULER's path on CUDA: prompts of different lengths prefilled together on a compiled engine of batch 4, each row
    then loaded into a compiled (CUDA-graphed) engine of batch 1 (kvpop.decode.generate.engine_generate_ragged):
    the answers each prompt gets alone on the compiled engine of batch 1 (tests/test_ragged.py on the CPU)."""
    from kvpop.decode import enable
    from kvpop.decode.engine import DecodeEngine
    from kvpop.decode.generate import engine_generate, engine_generate_ragged

    model = enable(tiny_model("qwen3").cuda())
    policy = None if policy_name == "dense" else random_policy(policy_name).cuda()
    layout = CacheLayout(4 + 32 + 48, 4, 32)
    gen = torch.Generator().manual_seed(4)
    lengths, new = [300, 261, 333, 261, 290, 371], [9, 4, 12, 6, 3, 8]
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]
    kw = dict(layout=layout, max_len=400, compile=True)
    many, single = DecodeEngine(model, policy, batch_size=4, **kw), DecodeEngine(model, policy, batch_size=1, **kw)
    none = torch.tensor([], dtype=torch.long, device="cuda")
    got = engine_generate_ragged(many, single, prompts, max_new_tokens=new, eos=none, pad=0)
    want = [engine_generate(single, torch.tensor([p], device="cuda"), max_new_tokens=n, eos=none, pad=0)[0].tolist() for p, n in zip(prompts, new)]
    agree = sum(a == b for a, b in zip(got, want))
    print(f"ragged {policy_name}: {agree} of {len(prompts)} answers equal")
    assert got == want


# --- dms: the gate's training forward (compiled flex + score_mod) against the SDPA float mask ----------
@pytest.mark.parametrize("policy_name", ["dms", "trimkv_joint"])
def test_gated_training_flex_equals_sdpa(tiny_model, policy_name):
    """A whole tiny model in training under a gated policy (dms: straight-through gate, noise off;
    trimkv: the age-scaled retention bias): logits and the gradients of the gate and of the student,
    compiled FlexAttention on CUDA vs SDPA on the CPU."""
    from kvpop.attention import GateTraining
    from kvpop.policies import make_policy

    ids, doc, pos = packed_toy(2, 384, seed=7)
    results = {}
    for device, executor in (("cpu", "sdpa"), ("cuda", "flex")):
        torch.manual_seed(0)
        from kvpop.attention import register

        model = tiny_model("llama", attn_implementation=register()).to(device)
        policy = make_policy(policy_name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
        for p in policy.parameters():
            torch.nn.init.normal_(p, std=0.3)
        if policy.decays:  # retention near 0.998: the age-scaled bias matters and its gradient survives
            for mlp in policy.scorer.layers:
                mlp.b2.data.fill_(6.0)
        policy.to(device)
        ctx = SparseContext.for_rows(policy, doc.to(device), pos.to(device), layout=CacheLayout.of(sinks=4, window=32, long_range=24), executor=executor,
                                     gate_training=GateTraining(noise=False))
        logits = model(input_ids=ids.to(device), position_ids=pos.to(device), kvpop_ctx=ctx).logits
        (logits.float().square() * (doc >= 0).to(device)[..., None]).mean().backward()
        results[executor] = (logits.detach(), [p.grad for p in policy.parameters()], [p.grad for p in model.parameters() if p.grad is not None])
    (l1, g1, m1), (l2, g2, m2) = results["sdpa"], results["flex"]
    real = (doc >= 0)[..., None]
    d_logits = _maxdiff(l1 * real, l2.cpu() * real)
    d_gate = max(_maxdiff(a, b) / max(a.abs().max().item(), 1e-12) for a, b in zip(g1, g2, strict=True))
    d_model = max(_maxdiff(a, b) / max(a.abs().max().item(), 1e-12) for a, b in zip(m1, m2, strict=True))
    print(f"{policy_name} training: flex vs sdpa logits {d_logits:.2e}, gate grads (rel) {d_gate:.2e}, model grads (rel) {d_model:.2e}")
    assert d_logits < 1e-3 and d_gate < 1e-2 and d_model < 1e-2
    assert all(g.abs().sum() > 0 for g in g1)
