"""The delayed mLSTM scorer (policy ``kvpop``): chunkwise vs parallel vs recurrent, delay, gradients, accounting."""

from __future__ import annotations

import time

import pytest
import torch

from kvpop.boundary import boundary_loss
from kvpop.geometry import CacheLayout
from kvpop.mlstm import MLSTMScorer, kvpop_k, readout_times, state_numbers
from kvpop.policies import Kvpop
from kvpop.selection import document_spans

from conftest import packed_toy

B, HK, D = 2, 3, 8


def _kv(B, Hk, S, D, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(B, Hk, S, D, generator=g), scale * torch.randn(B, Hk, S, D, generator=g)


def _scorer(seed=0, forget_gate="sigmoid", layers=2, chunk=16, gate_std=0.2, **kw):
    torch.manual_seed(seed)
    sc = MLSTMScorer(layers, HK, D, d_k=4, d_v=5, forget_gate=forget_gate, chunk=chunk, **kw)
    with torch.no_grad():  # data-dependent gates: the xLSTM init has zero gate weights
        for cell in sc.layers:
            cell.w_gate.normal_(0.0, gate_std)
    return sc


def recurrent_reference(scorer: MLSTMScorer, layer: int, k, v, doc_ids, window: int):
    """Reference twin: the recurrent form token by token, restarting at every document (and padding
    run), reading token t out of the state after step tau_t = min(t + window, doc_end - 1)."""
    Bn, Hk, S, _ = k.shape
    start, end = document_spans(doc_ids)
    out = torch.empty(Bn, Hk, S, dtype=k.dtype)
    for b in range(Bn):
        state = scorer.init_state(1)
        states = []
        for t in range(S):
            reset = torch.tensor([bool(start[b, t] == t)])
            state = scorer.step(layer, state, k[b : b + 1, :, t], v[b : b + 1, :, t], reset=reset)
            states.append(state)
        for t in range(S):
            tau = min(t + window, int(end[b, t]) - 1)
            out[b, :, t] = scorer.readout(layer, states[tau], k[b : b + 1, :, t], v[b : b + 1, :, t])[0]
    return out


# float32: gates of moderate spread (the xLSTM read-out h = C^T q / max(|n^T q|, 1) is itself
# ill-conditioned where |n^T q| nearly cancels, for either form alike; with gate weights N(0, 0.5) both
# forms drift ~2e-5 from float64). float64, wide gates: the two forms agree to rounding.
@pytest.mark.parametrize(("dtype", "gate_std", "tol"), [(torch.float32, 0.2, 1e-5), (torch.float64, 1.0, 1e-10)])
@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("window", [0, 3, 7, 100])
@pytest.mark.parametrize("form", ["chunkwise", "parallel"])
def test_training_forms_equal_recurrent(form, forget_gate, window, dtype, gate_std, tol):
    """raw_scores, by either training form (chunk 16 < S = 48), equals the recurrent form on packed rows."""
    _, doc, _ = packed_toy(B=B, S=48, seed=1)
    k, v = _kv(B, HK, 48, D, seed=2)
    k, v = k.to(dtype), v.to(dtype)
    sc = _scorer(forget_gate=forget_gate, gate_std=gate_std, form=form).to(dtype)
    with torch.no_grad():
        for layer in range(2):
            par = sc.raw_scores(layer, k, v, doc_ids=doc, window=window)
            ref = recurrent_reference(sc, layer, k, v, doc, window)
            assert par.shape == (B, HK, 48) and par.dtype == dtype
            torch.testing.assert_close(par, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("form", ["chunkwise", "parallel"])
def test_chunking_and_checkpoint_do_not_change_scores(form):
    _, doc, _ = packed_toy(B=B, S=64, seed=3)
    k, v = _kv(B, HK, 64, D, seed=4)
    sc = _scorer(chunk=64, form=form)
    full = sc.raw_scores(0, k, v, doc_ids=doc, window=5)
    for chunk in (1, 7, 16, 100):
        sc.chunk = chunk
        torch.testing.assert_close(sc.raw_scores(0, k, v, doc_ids=doc, window=5), full, atol=1e-5, rtol=1e-5)
    # activation checkpointing per chunk: same values, same gradients
    start, tau = readout_times(doc, B, 64, window=5)
    grads = []
    for ckpt in (False, True):
        sc.zero_grad()
        r = getattr(sc.layers[0], form)(k, v, start, tau, chunk=16, use_checkpoint=ckpt)
        (r * torch.linspace(-1, 1, 64)).sum().backward()
        grads.append([p.grad.clone() for p in sc.layers[0].parameters()])
    for g0, g1 in zip(*grads):
        torch.testing.assert_close(g0, g1)


def test_no_doc_ids_means_one_document():
    k, v = _kv(1, HK, 20, D, seed=5)
    sc = _scorer()
    one = torch.zeros(1, 20, dtype=torch.long)
    torch.testing.assert_close(sc.raw_scores(0, k, v, window=4), sc.raw_scores(0, k, v, doc_ids=one, window=4))


def test_readout_times():
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1, -1]])
    start, tau = readout_times(doc, 1, 9, window=2)
    assert start.tolist() == [[0, 0, 0, 0, 4, 4, 4, 7, 7]]
    assert tau.tolist() == [[2, 3, 3, 3, 6, 6, 6, 8, 8]]


@pytest.mark.parametrize("form", ["chunkwise", "parallel"])
def test_long_row_is_finite_and_matches_float64(form):
    """Float64 cumulative forget gates: a long row stays accurate in float32."""
    S = 3000
    k, v = _kv(1, HK, S, D, seed=6)
    sc = _scorer(chunk=512 if form == "parallel" else 256, gate_std=0.1, form=form)
    with torch.no_grad():
        for cell in sc.layers:  # strong forgetting: |F| grows to ~2000 over the row
            cell.b_gate[:, 1] = 0.0
        r32 = sc.raw_scores(0, k, v, window=64)
        r64 = sc.double().raw_scores(0, k.double(), v.double(), window=64)
    assert torch.isfinite(r32).all()
    torch.testing.assert_close(r32.double(), r64, atol=1e-4, rtol=1e-4)


def test_delay_semantics():
    """Scores used at query q depend on tokens <= q only; a token inside t's window does count."""
    S, w = 40, 6
    _, doc, _ = packed_toy(B=B, S=S, seed=7)
    k, v = _kv(B, HK, S, D, seed=8)
    sc = _scorer()
    start, end = document_spans(doc)
    with torch.no_grad():
        base = sc.raw_scores(0, k, v, doc_ids=doc, window=w)
        for q in (w, 15, 27, S - 2):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, q + 1 :] += torch.randn_like(k2[:, :, q + 1 :])
            v2[:, :, q + 1 :] -= 1.0
            r = sc.raw_scores(0, k2, v2, doc_ids=doc, window=w)
            torch.testing.assert_close(r[..., : q - w + 1], base[..., : q - w + 1], atol=0, rtol=0)
            assert not torch.allclose(r[..., q + 1 :], base[..., q + 1 :])
        # a token s in (t, t + w] of t's document changes r_hat_t (for every head)
        for b in range(B):
            for t in range(S):
                s_max = min(t + w, int(end[b, t]) - 1)
                if s_max <= t or doc[b, t] < 0:
                    continue
                s = int(torch.randint(t + 1, s_max + 1, (1,)))
                k2, v2 = k.clone(), v.clone()
                k2[b, :, s] += 2.0
                v2[b, :, s] += 2.0
                r = sc.raw_scores(0, k2, v2, doc_ids=doc, window=w)
                assert (r[b, :, t] - base[b, :, t]).abs().min() > 1e-6, (b, t, s)
                # ... but a token past tau_t, or of another document, does not
                if s_max + 1 < S:
                    k3 = k.clone()
                    k3[b, :, s_max + 1] += 2.0
                    r3 = sc.raw_scores(0, k3, v, doc_ids=doc, window=w)
                    assert torch.equal(r3[b, :, t], base[b, :, t])


def test_boundary_loss_gradients_reach_every_parameter_and_no_input():
    S = 64
    _, doc, pos = packed_toy(B=B, S=S, seed=9)
    torch.manual_seed(10)
    proj = torch.nn.Linear(D, 2 * HK * D)  # stands in for the model producing k and v
    x = torch.randn(B, S, D)
    kv = proj(x).view(B, S, 2, HK, D).permute(2, 0, 3, 1, 4)  # (2, B, Hk, S, D)
    k, v = kv[0], kv[1]
    pol = Kvpop(MLSTMScorer(1, HK, D, d_k=4, d_v=4, chunk=16))
    scores = pol.scores(0, k, v, pos, doc_ids=doc, window=4)
    r_tgt = torch.randn(B, HK, S)
    loss, stats = boundary_loss(scores.r_hat, r_tgt, scores.log_gamma, doc, pos, layout=CacheLayout.of(sinks=1, window=4, long_range=3))
    assert stats["decisions"] > 0
    loss.backward()
    for name, p in pol.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert proj.weight.grad is None and proj.bias.grad is None
    assert scores.prio.dtype == torch.float64 and not scores.prio.requires_grad


def test_policy_bind_and_keywords_agree():
    _, doc, pos = packed_toy(B=B, S=32, seed=11)
    k, v = _kv(B, HK, 32, D, seed=12)
    pol = Kvpop(_scorer())
    assert (pol.name, pol.learned, pol.layer_independent, pol.evicts) == ("kvpop", True, False, True)
    with pytest.raises(RuntimeError, match="window"):
        pol.scores(1, k, v, pos)
    a = pol.scores(1, k, v, pos, doc_ids=doc, window=5)
    b = pol.bind(doc_ids=doc, window=5).scores(1, k, v, pos)
    torch.testing.assert_close(a.r_hat, b.r_hat)
    torch.testing.assert_close(a.prio, b.prio)
    assert pol.scorer.config["kind"] == "mlstm"
    keys = set(pol.state_dict())
    assert "scorer.layers.1.w_gate" in keys and "scorer.decay.logit" in keys


# SmolLM2-135M: head_dim 64; Qwen3-4B: head_dim 128. State 16 x 16 + 16 + 1 = 273 numbers.
ACCOUNTING = {
    (64, 384): 121, (64, 1024): 761, (64, 2048): 1785, (64, 4096): 3833,
    (128, 384): 122, (128, 1024): 762, (128, 2048): 1786, (128, 4096): 3834,
}


@pytest.mark.parametrize(("head_dim", "budget"), sorted(ACCOUNTING))
def test_memory_accounting(head_dim, budget):
    sinks, window = 4, 256
    k = kvpop_k(CacheLayout(budget, sinks, window), head_dim, d_k=16, d_v=16)
    assert k == ACCOUNTING[head_dim, budget]
    k_mlp = budget - sinks - window
    # cache + state never exceeds the MLP variant's memory, and one slot more would
    mlstm_mem = 2 * head_dim * (sinks + window + k) + state_numbers(16, 16)
    assert mlstm_mem <= 2 * head_dim * budget < mlstm_mem + 2 * head_dim
    print(f"head_dim={head_dim} budget={budget}: k_mlp={k_mlp} k_kvpop={k} (state {state_numbers(16, 16)} numbers)")


def test_kvpop_k_rejects_a_budget_without_slots():
    with pytest.raises(ValueError):
        kvpop_k(CacheLayout(262, 4, 256), 64)


# S = 16384 (Hk 8, D 128) is timed by bench/kernels/bench_cpu_scale.py, out of the default suite
@pytest.mark.parametrize(("S", "Hk", "Dh", "chunk"), [(1024, 3, 64, 256)])
def test_timing_raw_scores(S, Hk, Dh, chunk):
    """CPU time of one layer's raw_scores (printed, not asserted): forward, and forward + backward."""
    torch.manual_seed(0)
    sc = MLSTMScorer(1, Hk, Dh, chunk=chunk)
    k, v = torch.randn(1, Hk, S, Dh), torch.randn(1, Hk, S, Dh)
    doc = torch.zeros(1, S, dtype=torch.long)  # one document: the worst case (full key range)
    reps = 3 if S <= 4096 else 1  # best of `reps`: the CPU is shared

    def best(fn):
        """(fastest of `reps` runs in seconds, the last result)."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return min(times), out

    with torch.no_grad():
        sc.raw_scores(0, k[..., :64, :], v[..., :64, :], window=256)  # warm-up
        fwd, r = best(lambda: sc.raw_scores(0, k, v, doc_ids=doc, window=256))
    assert r.shape == (1, Hk, S) and torch.isfinite(r).all()
    msg = f"raw_scores S={S} Hk={Hk} D={Dh} chunk={chunk} threads={torch.get_num_threads()}: forward {fwd:.2f}s"
    if S <= 4096:
        fb, _ = best(lambda: sc.raw_scores(0, k, v, doc_ids=doc, window=256).sum().backward())
        msg += f", forward+backward (checkpointed) {fb:.2f}s"
    print(msg)


def test_trains_inside_sparse_context(tiny_llama_dir):
    """End to end with today's SparseContext (policy bound before the forward): per-layer boundary
    losses reach the mLSTM scorers of every layer."""
    from kvpop.attention import ScorerTraining, SparseContext
    from kvpop.modeling import load_model, model_shape

    model = load_model(tiny_llama_dir)
    shape = model_shape(model)
    pol = Kvpop(MLSTMScorer(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], chunk=16))
    ids, doc, pos = packed_toy(B=2, S=48, seed=13)
    sinks, window = 2, 6
    k = kvpop_k(CacheLayout(sinks + window + 16, sinks, window), shape["head_dim"], d_k=16, d_v=16)
    assert 0 < k < 16
    pol.bind(doc_ids=doc, window=window)
    ctx = SparseContext.for_rows(pol, doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), scorer_training=ScorerTraining())
    model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    assert len(ctx.losses) == shape["num_layers"]
    torch.stack(ctx.losses).sum().backward()
    for layer in range(shape["num_layers"]):
        assert pol.scorer.layers[layer].w_q.grad.abs().sum() > 0


@pytest.mark.parametrize(("dtype", "gate_std", "tol"), [(torch.float32, 0.2, 1e-5), (torch.float64, 1.0, 1e-10)])
@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("carried", [0, 20])
def test_chunk_equals_recurrent(forget_gate, carried, dtype, gate_std, tol):
    """The chunk form (carried state + C new tokens, read-outs at any tau) equals step-by-step."""
    S, window = 50, 10
    k, v = (t.to(dtype) for t in _kv(B, HK, S, D, seed=4))
    cell = _scorer(forget_gate=forget_gate, gate_std=gate_std).to(dtype).layers[0]
    with torch.no_grad():
        state = cell.init_state(B, dtype=dtype)
        for t in range(carried):
            state = cell.step(state, k[:, :, t], v[:, :, t])
        states, s = [], state
        for t in range(carried, S):
            s = cell.step(s, k[:, :, t], v[:, :, t])
            states.append(s)
        readers = torch.arange(max(0, carried - window), S - window)  # positions leaving during the chunk
        tau = readers + window - carried
        ref = torch.stack([cell.readout(states[int(ta)], k[:, :, int(p)], v[:, :, int(p)]) for p, ta in zip(readers, tau)], -1)
        got, end = cell.chunk(state, k[:, :, carried:], v[:, :, carried:], k[:, :, readers], v[:, :, readers], tau)
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        probe_k, probe_v = _kv(B, HK, 1, D, seed=5)
        probe_k, probe_v = probe_k[:, :, 0].to(dtype), probe_v[:, :, 0].to(dtype)
        torch.testing.assert_close(cell.readout(end, probe_k, probe_v), cell.readout(s, probe_k, probe_v), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------------
# chunkwise form (raw_scores' default): the parallel form's scores in time linear in S

# Two rows of S = 80 with different layouts (-1: padding). Row 0: documents of 5, 13, 2, 44, 16
# tokens (starts 0, 5, 18, 20, 64: 64 on a boundary of chunk 64); row 1: 14, 1, 7, 40, 12 tokens and
# 6 of padding (starts 0, 14, 15, 22, 62, 74: 14 on a boundary of chunk 7). Documents of 1
# and 2 tokens are shorter than the windows 3 and 6; chunk 100 and window 100 exceed S.
LAYOUT = ([5, 13, 2, 44, 16], [14, 1, 7, 40, 12, 6])
CHUNKS = (1, 7, 64, 100)


def _layout() -> torch.Tensor:
    """doc_ids (2, 80) of LAYOUT; row 1 ends with a padding run (-1)."""
    rows = []
    for r, lens in enumerate(LAYOUT):
        ids = [torch.full((n,), d if (r == 0 or d < len(lens) - 1) else -1) for d, n in enumerate(lens)]
        rows.append(torch.cat(ids))
    return torch.stack(rows).long()


def _cell_grads(cell, r, proj):
    """Gradients of sum(r * proj) w.r.t. every parameter of ``cell`` (each one must be reached)."""
    return torch.autograd.grad((r * proj).sum(), list(cell.parameters()))


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
@pytest.mark.parametrize("window", [0, 3, 6, 100])
def test_chunkwise_equals_parallel_and_recurrent_with_gradients(forget_gate, window):
    """float64, wide gates: chunkwise (chunk 1, 7, 64, 100 > S; checkpointed or not) == parallel ==
    recurrent, values and gradients w.r.t. every parameter, on two rows of different packed layouts."""
    doc = _layout()
    S = doc.shape[1]
    k, v = (t.double() for t in _kv(B, HK, S, D, seed=21))
    proj = torch.randn(B, HK, S, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    sc = _scorer(forget_gate=forget_gate, gate_std=1.0, layers=1).double()
    cell = sc.layers[0]
    start, tau = readout_times(doc, B, S, window)
    ref = recurrent_reference(sc, 0, k, v, doc, window)
    g_ref = _cell_grads(cell, ref, proj)
    runs = {"parallel": cell.parallel(k, v, start, tau, chunk=16)}
    for chunk in CHUNKS:
        for ckpt in (False, True):
            runs[f"chunkwise chunk={chunk} checkpoint={ckpt}"] = cell.chunkwise(k, v, start, tau, chunk=chunk, use_checkpoint=ckpt)
    for name, r in runs.items():
        assert r.shape == (B, HK, S) and r.dtype == torch.float64, name
        torch.testing.assert_close(r, ref.detach(), atol=1e-10, rtol=1e-10, msg=lambda m, name=name: f"{name}: {m}")
        for p_name, g, g0 in zip([n for n, _ in cell.named_parameters()], _cell_grads(cell, r, proj), g_ref):
            torch.testing.assert_close(g, g0, atol=1e-9, rtol=1e-9, msg=lambda m, name=name, p_name=p_name: f"{name}, d/d{p_name}: {m}")


@pytest.mark.parametrize("forget_gate", ["sigmoid", "exp"])
def test_chunkwise_is_stable_at_extreme_gates(forget_gate):
    """Input-gate biases of +60, -60 and +800 per head (exp(800) overflows float32 and float64 alike, and
    exp(-m) underflows both) and wide gate weights, with fast forgetting (sigmoid, bias -4) or a memory
    that grows (exp, bias +1: log f ~ 1 +- 4): no NaN or inf in values or gradients, float64 chunkwise ==
    parallel (values and gradients), and float32 close to float64."""
    doc = _layout()
    S = doc.shape[1]
    k, v = _kv(B, HK, S, D, seed=23)
    proj = torch.randn(B, HK, S, generator=torch.Generator().manual_seed(24))
    sc = _scorer(forget_gate=forget_gate, gate_std=1.0, layers=1)
    with torch.no_grad():
        sc.layers[0].b_gate[:, 0] = torch.tensor([60.0, -60.0, 800.0])
        sc.layers[0].b_gate[:, 1] = -4.0 if forget_gate == "sigmoid" else 1.0
    out = {}
    for dtype in (torch.float32, torch.float64):
        cell = sc.to(dtype).layers[0]
        start, tau = readout_times(doc, B, S, 6)
        kk, vv, pp = k.to(dtype), v.to(dtype), proj.to(dtype)
        for form, chunk in (("chunkwise", 7), ("chunkwise", 64), ("parallel", 16)):
            r = getattr(cell, form)(kk, vv, start, tau, chunk=chunk)
            grads = _cell_grads(cell, r, pp)
            assert torch.isfinite(r).all(), (dtype, form, chunk)
            assert all(torch.isfinite(g).all() for g in grads), (dtype, form, chunk)
            out[dtype, form, chunk] = r.detach().double(), grads
    r64, g64 = out[torch.float64, "parallel", 16]
    for (dtype, _, _), (r, grads) in out.items():
        # float32 is off by up to ~5e-3 relative here, for either form alike: i~ ~ 800 carries an ulp of
        # 6e-5 into every log-weight, and the read-out's |n^T q| nearly cancels for some tokens
        tol = 1e-10 if dtype == torch.float64 else 1e-2
        torch.testing.assert_close(r, r64, atol=tol, rtol=tol)
        if dtype == torch.float64:
            for g, g0 in zip(grads, g64):
                torch.testing.assert_close(g, g0, atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunkwise_is_blind_to_later_tokens_and_other_documents(chunk):
    """A score is unchanged when any token after its tau_t changes: bitwise (torch.equal, float32).
    It is unchanged when any token of another document (earlier or later) changes: up to rounding
    (float64, 1e-12): the chunk-local cumulative forget gates start at the chunk's start, not at the
    document's, so an earlier document in the same chunk moves their last bits (as the parallel form's
    row-wide ones do). The changes do reach the scores that read them."""
    doc = _layout()
    S, w = doc.shape[1], 6
    k, v = _kv(B, HK, S, D, seed=25)
    cell = _scorer(gate_std=0.5, layers=1).layers[0]
    start, end = document_spans(doc)
    _, tau = readout_times(doc, B, S, w)
    with torch.no_grad():
        base = cell.chunkwise(k, v, start, tau, chunk=chunk)
        for q in (0, 4, 13, 14, 21, 40, 63, 64, 70, 78):
            k2, v2 = k.clone(), v.clone()
            k2[:, :, q + 1 :] = 3.0 * torch.randn_like(k2[:, :, q + 1 :])
            v2[:, :, q + 1 :] -= 1.0
            r = cell.chunkwise(k2, v2, start, tau, chunk=chunk)
            seen = (tau <= q)[:, None].expand_as(r)  # (B, Hk, S): scores read out by q
            assert torch.equal(r[seen], base[seen]), q
            assert (r[~seen] != base[~seen]).all(), q
        cell, k, v = cell.double(), k.double(), v.double()
        base = cell.chunkwise(k, v, start, tau, chunk=chunk)
        for b in range(B):
            for s0 in start[b].unique().tolist():
                e0 = int(end[b, s0])
                k2, v2 = k.clone(), v.clone()
                k2[b, :, s0:e0] *= -2.0
                v2[b, :, s0:e0] += 1.0
                r = cell.chunkwise(k2, v2, start, tau, chunk=chunk)
                inside = torch.zeros(B, S, dtype=torch.bool)
                inside[b, s0:e0] = True
                inside = inside[:, None].expand_as(r)
                torch.testing.assert_close(r[~inside], base[~inside], atol=1e-12, rtol=1e-12)
                assert ((r[inside] - base[inside]).abs() > 1e-6).all(), (b, s0)


@pytest.mark.parametrize("w", [2, 5])
def test_chunkwise_carries_the_state_and_restarts_it_at_documents(w):
    """Documents longer than the chunk (4): the read-outs need the state carried over chunk boundaries,
    and a document starting inside (row 0, at 21) or at (row 1, at 8) a chunk must not see the previous
    one, whose tokens are scaled up so that a leak is large: neither through the state handed to the
    next chunk, nor, with a window (2) below the chunk, in the chunk where it starts (t = 21 reads at 23).
    Each document's scores equal the recurrent form and the same document scored alone (other chunk
    offsets)."""
    S, chunk = 60, 4
    doc = torch.tensor([[0] * 21 + [1] * 39, [0] * 8 + [1] * 52])
    k, v = (t.double() for t in _kv(B, HK, S, D, seed=26))
    k[0, :, :21] *= 4.0
    v[1, :, :8] *= 4.0
    sc = _scorer(gate_std=0.5, layers=1).double()
    with torch.no_grad():
        sc.layers[0].b_gate[:, 1] = 6.0  # long memory: a leaked or a dropped state shows
        start, tau = readout_times(doc, B, S, w)
        got = sc.layers[0].chunkwise(k, v, start, tau, chunk=chunk)
        torch.testing.assert_close(got, recurrent_reference(sc, 0, k, v, doc, w), atol=1e-10, rtol=1e-10)
        for b, s0 in ((0, 0), (0, 21), (1, 0), (1, 8)):
            e0 = int(document_spans(doc)[1][b, s0])
            n = e0 - s0
            st, ta = readout_times(None, 1, n, w)
            alone = sc.layers[0].chunkwise(k[b : b + 1, :, s0:e0], v[b : b + 1, :, s0:e0], st, ta, chunk=chunk)
            torch.testing.assert_close(got[b : b + 1, :, s0:e0], alone, atol=1e-10, rtol=1e-10)


def test_chunkwise_rejects_a_layout_it_cannot_carry():
    """``start, tau`` must be readout_times' layout (contiguous documents, tau non-decreasing)."""
    k, v = _kv(1, HK, 6, D, seed=27)
    cell = _scorer(layers=1).layers[0]
    start, tau = readout_times(torch.tensor([[0, 0, 0, 1, 1, 1]]), 1, 6, window=1)
    cell.chunkwise(k, v, start, tau, chunk=2)
    assert start.tolist() == [[0, 0, 0, 3, 3, 3]] and tau.tolist() == [[1, 2, 2, 4, 5, 5]]
    bad = [
        (start, torch.tensor([[2, 1, 2, 4, 5, 5]])),  # tau decreasing
        (start, torch.tensor([[1, 2, 3, 4, 5, 5]])),  # tau_2 = 3 leaves document 0
        (torch.tensor([[0, 0, 1, 3, 3, 3]]), tau),  # start 1 is not a document start (start[1] = 0)
        (torch.tensor([[0, 0, 0, 3, 3, 2]]), tau),  # start decreasing
    ]
    for st, ta in bad:
        with pytest.raises(ValueError, match="readout_times"):
            cell.chunkwise(k, v, st, ta, chunk=2)
