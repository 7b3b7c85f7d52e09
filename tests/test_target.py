"""Tests of kvpop.target against a float64 dense reference, for every kind of target."""

import math
import time

import pytest
import torch

from kvpop.target import TARGET_KINDS, TargetSpec, future_attention_target, scope_targets

B, H, HK, S, D = 2, 6, 2, 70, 16
WINDOW = 5
SCALE = 0.6
EPS = 1e-6
# (kind, beta) pairs covered by the reference tests; beta only matters for "power".
KINDS = [("mean", 8.0), ("power", 2.0), ("power", 16.0), ("max", 8.0)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def packed_docs():
    """Two rows: several documents (one shorter than the window) then padding."""
    lens = [[20, 3, 30, 10], [45, 4, 15]]  # rows sum to 63 and 64: 7 and 6 padding tokens
    doc_ids = torch.full((B, S), -1, dtype=torch.long)
    for b, row in enumerate(lens):
        t = 0
        for d, n in enumerate(row):
            doc_ids[b, t : t + n] = d
            t += n
    return doc_ids


def true_lse(q, k, doc_ids, scale):
    """Natural-log normalizer of causal same-document attention, ``(B, H, S)``."""
    G = q.shape[1] // k.shape[1]
    logits = scale * q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2)
    i = torch.arange(q.shape[2])
    mask = (i[None, :, None] >= i[None, None, :]) & (doc_ids[:, :, None] == doc_ids[:, None, :])
    lse = torch.where(mask[:, None], logits, -math.inf).logsumexp(-1)
    return lse.float()


def doc_end(doc_ids, b, t):
    """Exclusive end of token ``t``'s document in row ``b``, found by walking."""
    d, end = int(doc_ids[b, t]), t
    while end < doc_ids.shape[1] and int(doc_ids[b, end]) == d:
        end += 1
    return end


def dense_reference(q, k, lse, doc_ids, window, scale, eps, kind="mean", beta=8.0):
    """Obviously-right float64 target: full probability matrix, explicit doc ends, each kind literally.

    ``col`` holds ``p_{u -> t}`` for ``u = t + w .. S_d - 1``; mean ``sum(col) / n``, power
    ``(sum(col^beta) / n)^(1/beta)``, max ``max(col)`` (0 for an empty column).
    """
    Bq, Hq, Sq, _ = q.shape
    Hk = k.shape[1]
    G = Hq // Hk
    logits = scale * q.double() @ k.double().repeat_interleave(G, dim=1).transpose(-1, -2)
    p = torch.exp(logits - lse.double()[..., None])  # (B, H, u, t)
    out = torch.empty(Bq, Hk, Sq, dtype=torch.float64)
    for b in range(Bq):
        for t in range(Sq):
            d = int(doc_ids[b, t])
            end = doc_end(doc_ids, b, t)
            n = max(1, end - t - window)
            for h in range(Hk):
                best = -math.inf
                for g in range(h * G, (h + 1) * G):
                    col = p[b, g, t + window : end, t] if d >= 0 else p.new_zeros(0)
                    if kind == "mean":
                        m = float(col.sum()) / n
                    elif kind == "power":
                        m = (float((col**beta).sum()) / n) ** (1 / beta)
                    else:
                        m = float(col.max()) if col.numel() else 0.0
                    best = max(best, math.log(eps + m))
                out[b, h, t] = best
    return out


def n_queries(doc_ids, window):
    """``N_t = max(1, S_d - t - w)``, ``(B, S)`` float64, by walking the documents."""
    return torch.tensor(
        [[max(1, doc_end(doc_ids, b, t) - t - window) for t in range(doc_ids.shape[1])] for b in range(doc_ids.shape[0])],
        dtype=torch.float64,
    )


def make_inputs(seed, heads=(H, HK)):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads[0], S, D, generator=gen)
    k = torch.randn(B, heads[1], S, D, generator=gen)
    return q, k, packed_docs()


def floor_value(eps=EPS):
    return torch.tensor(math.log(eps)).float()


def flex_on_cpu_ok(kind):
    """Torch refuses flex_attention's max_scores for CPU inputs: flex "max" runs on CUDA only."""
    return kind != "max"


@pytest.mark.parametrize("impl", ["chunked", "flex"])
@pytest.mark.parametrize("lse_kind", ["random", "true"])
@pytest.mark.parametrize("kind, beta", KINDS)
def test_matches_dense_reference(impl, lse_kind, kind, beta):
    """Both executors equal the literal float64 definition: B=2, G=3, several documents per row
    (one shorter than the window), padding, chunk 16 not dividing S=70."""
    if impl == "flex" and not flex_on_cpu_ok(kind):
        pytest.skip("flex max needs CUDA (test_cuda_flex_matches_reference)")
    q, k, doc_ids = make_inputs(0)
    if lse_kind == "true":
        lse = true_lse(q, k, doc_ids, SCALE)
    else:
        lse = 2.0 + torch.randn(B, H, S, generator=torch.Generator().manual_seed(1))
    ref = dense_reference(q, k, lse, doc_ids, WINDOW, SCALE, EPS, kind, beta)
    got = future_attention_target(q, k, lse, doc_ids, window=WINDOW, scale=SCALE, eps=EPS, impl=impl, chunk=16, kind=kind, beta=beta)
    assert got.shape == (B, HK, S) and got.dtype == torch.float32
    # The targets are informative (not all at the floor) ...
    assert (ref > math.log(EPS) + 1.0).float().mean() > 0.5
    # ... and match the reference.
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)
    # Padding and empty sums sit at the floor.
    assert torch.all(got[(doc_ids < 0)[:, None].expand_as(got)] == floor_value())


@pytest.mark.parametrize("window", [0, 1, 80])
@pytest.mark.parametrize("kind, beta", KINDS)
def test_executors_agree_edge_windows(window, kind, beta):
    """Window 0 (a token's own query counts), 1, and 80 (> every document: all at the floor)."""
    q, k, doc_ids = make_inputs(2)
    lse = true_lse(q, k, doc_ids, SCALE)
    kw = dict(window=window, scale=SCALE, kind=kind, beta=beta)
    a = future_attention_target(q, k, lse, doc_ids, impl="chunked", chunk=9, **kw)
    if flex_on_cpu_ok(kind):
        b = future_attention_target(q, k, lse, doc_ids, impl="flex", **kw)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    if window == 0:
        ref = dense_reference(q, k, lse, doc_ids, window, SCALE, 1e-6, kind, beta)
        torch.testing.assert_close(a.double(), ref, atol=1e-5, rtol=0)
    if window == 80:
        assert torch.all(a == floor_value())


@pytest.mark.parametrize("heads", [(4, 4), (6, 1)])
@pytest.mark.parametrize("chunk", [1, 13, 100])
@pytest.mark.parametrize("kind, beta", KINDS)
def test_chunked_head_layouts_and_chunks(heads, chunk, kind, beta):
    """G = 1 and G = H (one KV head); chunks of one row, not dividing S, and larger than S."""
    q, k, doc_ids = make_inputs(3, heads)
    lse = true_lse(q, k, doc_ids, SCALE)
    ref = dense_reference(q, k, lse, doc_ids, WINDOW, SCALE, EPS, kind, beta)
    got = future_attention_target(q, k, lse, doc_ids, window=WINDOW, scale=SCALE, impl="chunked", chunk=chunk, kind=kind, beta=beta)
    assert got.shape == (B, heads[1], S)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["chunked", "flex"])
def test_power_beta_one_is_mean_and_default_is_mean(impl):
    """power with beta = 1 is the mean; the default kind is the paper's mean."""
    q, k, doc_ids = make_inputs(4)
    lse = true_lse(q, k, doc_ids, SCALE)
    kw = dict(window=WINDOW, scale=SCALE, impl=impl, chunk=16)
    mean = future_attention_target(q, k, lse, doc_ids, kind="mean", **kw)
    assert torch.equal(future_attention_target(q, k, lse, doc_ids, **kw), mean)
    power = future_attention_target(q, k, lse, doc_ids, kind="power", beta=1.0, **kw)
    torch.testing.assert_close(power, mean, atol=2e-6, rtol=0)


@pytest.mark.parametrize("lse_kind", ["random", "true"])
def test_power_between_mean_and_max(lse_kind):
    """Power-mean inequality and the limit: mean <= power(beta) <= power(beta') <= max for
    1 <= beta <= beta', and max - power(beta) <= log(N_t) / beta for every token (exactly,
    per query head; log(eps + .) and the max over the group are 1-Lipschitz and monotone)."""
    q, k, doc_ids = make_inputs(5)
    lse = true_lse(q, k, doc_ids, SCALE) if lse_kind == "true" else 1.0 + torch.randn(B, H, S, generator=torch.Generator().manual_seed(6))
    kw = dict(window=WINDOW, scale=SCALE, impl="chunked", chunk=16)
    mean = future_attention_target(q, k, lse, doc_ids, kind="mean", **kw).double()
    mx = future_attention_target(q, k, lse, doc_ids, kind="max", **kw).double()
    log_n = n_queries(doc_ids, WINDOW).log()[:, None, :]  # (B, 1, S)
    tol = 1e-5
    prev = mean
    for beta in [1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 1024.0]:
        power = future_attention_target(q, k, lse, doc_ids, kind="power", beta=beta, **kw).double()
        assert torch.all(power >= prev - tol) and torch.all(power <= mx + tol)
        assert torch.all(mx - power <= log_n / beta + tol)
        prev = power
    assert (mx - mean).amax() > 1.0  # the kinds do differ here
    assert (mx - prev).abs().amax() < 0.01  # beta = 1024: log(58) / 1024 < 0.004


@pytest.mark.parametrize("impl", ["chunked", "flex", pytest.param("flex-cuda", marks=cuda)])
@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_log_space_survives_tiny_attention(impl, kind):
    """Scaling every p by e^-c (lse + c) scales every kind's m_t by e^-c exactly, so with a
    floor eps far below, r shifts by -c.  At c = 30 and beta = 16, p^beta ~ e^-500 underflows
    float32 (and nearly float64): only a log-space computation keeps this."""
    if impl == "flex" and not flex_on_cpu_ok(kind):
        pytest.skip("flex max needs CUDA")
    q, k, doc_ids = make_inputs(7)
    lse = true_lse(q, k, doc_ids, SCALE)
    c, eps = 30.0, 1e-300
    dev = "cuda" if impl == "flex-cuda" else "cpu"
    kw = dict(window=WINDOW, scale=SCALE, impl=impl.removesuffix("-cuda"), chunk=16, kind=kind, beta=16.0, eps=eps)

    def target(lse):
        return future_attention_target(q.to(dev), k.to(dev), lse.to(dev), doc_ids.to(dev), **kw).cpu()

    base = target(lse)
    shifted = target(lse + c)
    real = (doc_ids >= 0)[:, None].expand_as(base) & (base > -100)  # not padding, not empty
    assert real.float().mean() > 0.6  # the rest: padding, the last w tokens of each document
    torch.testing.assert_close(shifted[real], base[real] - c, atol=1e-4, rtol=0)
    assert torch.all(shifted[~real] == floor_value(eps)) and torch.all(base[~real] == floor_value(eps))
    ref = dense_reference(q, k, lse, doc_ids, WINDOW, SCALE, eps, kind, 16.0)
    torch.testing.assert_close(base[real].double(), ref[real], atol=1e-5, rtol=0)  # (the floor -690.8 is not within 1e-5 in float32)


def test_rejects_bad_arguments():
    q, k, doc_ids = make_inputs(0)
    lse = torch.zeros(B, H, S)
    kw = dict(window=WINDOW, scale=SCALE, impl="chunked")
    with pytest.raises(ValueError, match="unknown target kind"):
        future_attention_target(q, k, lse, doc_ids, kind="median", **kw)
    for beta in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="beta"):
            future_attention_target(q, k, lse, doc_ids, kind="power", beta=beta, **kw)
    with pytest.raises(ValueError, match="needs CUDA"):  # torch refuses max_scores on the CPU
        future_attention_target(q, k, lse, doc_ids, window=WINDOW, scale=SCALE, impl="flex", kind="max")


@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_chunked_timing(kind):
    """S = 2048, H = 9 on CPU (no speed assertion)."""
    gen = torch.Generator().manual_seed(0)
    Bt, Ht, Hkt, St, Dt = 1, 9, 3, 2048, 64
    q = torch.randn(Bt, Ht, St, Dt, generator=gen)
    k = torch.randn(Bt, Hkt, St, Dt, generator=gen)
    doc_ids = torch.zeros(Bt, St, dtype=torch.long)
    doc_ids[:, 1500:] = 1
    lse = torch.randn(Bt, Ht, St, generator=gen) + 5
    t0 = time.perf_counter()
    r = future_attention_target(q, k, lse, doc_ids, window=64, scale=Dt**-0.5, impl="chunked", kind=kind)
    print(f"chunked {kind} target S={St} H={Ht}: {time.perf_counter() - t0:.3f}s")
    assert r.shape == (Bt, Hkt, St) and torch.isfinite(r).all()


@pytest.fixture
def many_compiles():
    """Each (shape, kind) is one compilation of the same flex function: lift dynamo's recompile limit."""
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


@cuda
@pytest.mark.parametrize("kind, beta", KINDS)
def test_cuda_flex_matches_reference(kind, beta, many_compiles):
    """Compiled flex on CUDA (max: through AuxRequest(max_scores=True)) equals the float64 definition."""
    q, k, doc_ids = make_inputs(0)
    lse = true_lse(q, k, doc_ids, SCALE)
    ref = dense_reference(q, k, lse, doc_ids, WINDOW, SCALE, EPS, kind, beta)
    got = future_attention_target(
        q.cuda(), k.cuda(), lse.cuda(), doc_ids.cuda(), window=WINDOW, scale=SCALE, eps=EPS, impl="flex", kind=kind, beta=beta
    )
    torch.testing.assert_close(got.cpu().double(), ref, atol=1e-5, rtol=0)
    assert torch.all(got.cpu()[(doc_ids < 0)[:, None].expand_as(got)] == floor_value())


@cuda
@pytest.mark.parametrize("kind", TARGET_KINDS)
@pytest.mark.parametrize(
    "shape", [(2, 6, 2, 300, 16, torch.float32), (1, 8, 2, 4096, 64, torch.bfloat16), (2, 32, 8, 2048, 128, torch.bfloat16)]
)
def test_cuda_flex_matches_chunked(shape, kind, many_compiles):
    """Compiled flex executor on CUDA agrees with the chunked one (and with CPU)."""
    Bc, Hc, Hkc, Sc, Dc, dtype = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(Bc, Hc, Sc, Dc, generator=gen).to("cuda", dtype)
    k = torch.randn(Bc, Hkc, Sc, Dc, generator=gen).to("cuda", dtype)
    doc_ids = torch.zeros(Bc, Sc, dtype=torch.long)
    doc_ids[:, Sc // 3 :] = 1
    doc_ids[:, Sc // 3 + 7 :] = 2  # a 7-token document, shorter than the window
    doc_ids[0, Sc - 50 :] = -1
    doc_ids = doc_ids.cuda()
    lse = (torch.randn(Bc, Hc, Sc, generator=gen) + 3).cuda()
    kw = dict(window=16, scale=Dc**-0.5, kind=kind, beta=8.0)
    for _ in range(2):  # the first call compiles
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        flex = future_attention_target(q, k, lse, doc_ids, impl="flex", **kw)
        torch.cuda.synchronize()
        t_flex = time.perf_counter() - t0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    chunked = future_attention_target(q, k, lse, doc_ids, impl="chunked", **kw)
    torch.cuda.synchronize()
    t_chunked = time.perf_counter() - t0
    cpu = future_attention_target(q.cpu(), k.cpu(), lse.cpu(), doc_ids.cpu(), impl="chunked", **kw)
    print(f"{shape} {kind}: flex {t_flex:.4f}s chunked {t_chunked:.4f}s")
    torch.testing.assert_close(flex, chunked, atol=1e-4, rtol=0)
    torch.testing.assert_close(chunked.cpu(), cpu, atol=1e-4, rtol=0)


def test_scope_targets():
    """group: unchanged; layer: max over the layer's KV heads; model: max over every layer and head; a scope or weight
    no TargetSpec takes is refused with the spec's message."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(2, 3, 7, generator=g) for _ in range(4)]  # 4 layers of (B, Hk, S)
    assert all(a is b for a, b in zip(scope_targets(ts, "group"), ts, strict=True))
    for L, t in enumerate(scope_targets(ts, "layer")):
        for b in range(2):
            for h in range(3):
                for s in range(7):
                    assert t[b, h, s] == max(ts[L][b, g2, s] for g2 in range(3))
    for t in scope_targets(ts, "model"):
        for b in range(2):
            for h in range(3):
                for s in range(7):
                    assert t[b, h, s] == max(ts[L2][b, g2, s] for L2 in range(4) for g2 in range(3))
    with pytest.raises(ValueError, match="(?s)scope.*'group', 'layer', 'model' or 'blend'"):
        scope_targets(ts, "heads")
    # blend: weight 0 is the group's targets, 1 the model's; 0.25 a quarter of the way
    for w, ends in ((0.0, ts), (1.0, scope_targets(ts, "model"))):
        assert all(torch.equal(a, b.expand_as(a)) for a, b in zip(scope_targets(ts, "blend", w), ends, strict=True))
    model = scope_targets(ts, "model")
    for L, t in enumerate(scope_targets(ts, "blend", 0.25)):
        assert torch.allclose(t, 0.75 * ts[L] + 0.25 * model[L])
    with pytest.raises(ValueError, match="(?s)blend.*less than or equal to 1"):
        scope_targets(ts, "blend", 1.5)


# Canonical compact forms: str(parse(text)) == text, and the fields each one sets.
CANONICAL = {
    "mean": dict(kind="mean"),
    "max": dict(kind="max"),
    "power:16": dict(kind="power", beta=16.0),
    "power:0.5": dict(kind="power", beta=0.5),
    "power:1e-05": dict(kind="power", beta=1e-5),
    "max.layer": dict(kind="max", scope="layer"),
    "max.model": dict(kind="max", scope="model"),
    "mean.model": dict(kind="mean", scope="model"),
    "max.blend:0.75": dict(kind="max", scope="blend", blend=0.75),
    "max.blend:0": dict(kind="max", scope="blend", blend=0.0),
    "power:4.blend:0.5": dict(kind="power", beta=4.0, scope="blend", blend=0.5),
    "power:2.5.layer": dict(kind="power", beta=2.5, scope="layer"),
    "max.value": dict(kind="max", value=True),
    "power:16.value": dict(kind="power", beta=16.0, value=True),
}


@pytest.mark.parametrize("text", CANONICAL)
def test_target_spec_round_trip(text):
    """Every canonical form parses to the spec of its fields (the rest at their defaults) and prints back as itself."""
    spec = TargetSpec.parse(text)
    assert spec == TargetSpec(**CANONICAL[text])
    assert str(spec) == text
    assert TargetSpec.parse(str(spec)) == spec
    assert TargetSpec.model_validate(text) == spec  # the compact string wherever pydantic validates a spec
    assert TargetSpec.model_validate(spec.model_dump()) == spec  # and the mapping of fields


def test_target_spec_default_and_shorthands():
    """One default (params.yaml's: max, beta 8, group, blend 0.5); shorthands print their canonical form."""
    assert TargetSpec() == TargetSpec(kind="max", beta=8.0, scope="group", blend=0.5) == TargetSpec.parse("max")
    for text, canonical in (("max.group", "max"), ("power", "power:8"), ("max.blend", "max.blend:0.5"),
                            (" power:16.0 ", "power:16"), ("power:1e1.model", "power:10.model")):
        assert str(TargetSpec.parse(text)) == canonical
    # str drops what the target does not read: beta off power, blend off scope blend
    assert str(TargetSpec(kind="max", beta=3.0, blend=0.9)) == "max"
    assert str(TargetSpec(kind="power", beta=3.0, scope="model", blend=0.9)) == "power:3.model"
    assert [TargetSpec.parse(t).spans_layers for t in ("max", "max.layer", "max.model", "max.blend")] == [False, False, True, True]
    spec = TargetSpec()
    with pytest.raises(Exception, match="frozen"):
        spec.kind = "mean"
    assert len({TargetSpec(), TargetSpec.parse("max"), TargetSpec.parse("max.model")}) == 2  # hashable, by value


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty target spec"),
        ("maxx", "unknown target kind 'maxx'"),
        ("max.pool", "unknown target scope 'pool'"),
        ("max.model.layer", "at most two"),
        ("mean:3", "kind 'mean' takes no number"),
        ("max.group:0.3", "scope 'group' takes no number"),
        ("power:x", "beta of 'power:x' .* not a number"),
        ("power:0", "beta of 'power:0' .* finite number > 0"),
        ("power:-2", "finite number > 0"),
        ("power:inf", "finite number > 0"),
        ("power:nan", "finite number > 0"),
        ("max.blend:1.5", "blend weight of 'blend:1.5' .* \\[0, 1\\]"),
        ("max.blend:w", "blend of 'blend:w' .* not a number"),
        ("max.value.model", "at most two"),
        ("max.value.value", "unknown target scope 'value'"),
        ("value", "unknown target kind 'value'"),
    ],
)
def test_target_spec_rejects(text, match):
    """Bad text: a ValueError naming the bad part and listing the accepted forms."""
    with pytest.raises(ValueError, match=match) as err:
        TargetSpec.parse(text)
    assert "KIND[.SCOPE]" in str(err.value) and "power[:BETA]" in str(err.value) and "blend[:W]" in str(err.value)


def test_target_spec_fields_are_checked():
    """The fields themselves are validated like the text: beta finite > 0, blend in [0, 1], known kind and scope."""
    for bad in (dict(beta=0.0), dict(beta=float("inf")), dict(blend=1.5), dict(blend=float("nan")),
                dict(kind="min"), dict(scope="pool"), dict(window=3)):
        with pytest.raises(ValueError):
            TargetSpec(**bad)
    with pytest.raises(ValueError, match="a target spec is text"):
        TargetSpec.parse(3)


def test_value_weighting_needs_scope_group_and_reads_back():
    """``.value`` comes last and only with scope group (a wider scope's maximum would mix heads' values)."""
    assert str(TargetSpec.parse("max.group.value")) == "max.value"
    assert TargetSpec.parse("max").value is False
    for bad in ("max.model.value", "max.blend:0.5.value", "max.layer.value"):
        with pytest.raises(ValueError, match="value weighting needs scope 'group'"):
            TargetSpec.parse(bad)
    with pytest.raises(ValueError, match="value weighting needs scope 'group'"):
        TargetSpec(value=True, scope="model")


def test_weigh_adds_the_log_value_norm_per_token_and_head():
    """``weigh``: the target plus log(||v|| / sqrt(D)) of the same (row, KV head, token), read literally; no weighting
    leaves the target as it is (the same tensor); values of another shape are refused by name."""
    g = torch.Generator().manual_seed(0)
    B, Hk, S, D = 2, 3, 7, 16
    r = torch.randn(B, Hk, S, generator=g)
    v = torch.randn(B, Hk, S, D, generator=g) * torch.rand(B, Hk, S, 1, generator=g) * 4
    assert TargetSpec.parse("max").weigh(r, v) is r
    out = TargetSpec.parse("max.value").weigh(r, v)
    for b in range(B):
        for h in range(Hk):
            for t in range(S):
                norm = math.sqrt(sum(float(x) ** 2 for x in v[b, h, t]))
                assert out[b, h, t].item() == pytest.approx(r[b, h, t].item() + math.log(norm / math.sqrt(D)), abs=1e-5)
    # a head whose values are twice as large gains log 2 on every token: the pool's order moves toward it
    torch.testing.assert_close(TargetSpec.parse("max.value").weigh(r, 2 * v) - out, torch.full_like(r, math.log(2)))
    with pytest.raises(ValueError, match="do not match the target"):
        TargetSpec.parse("max.value").weigh(r, v[:, :2])
