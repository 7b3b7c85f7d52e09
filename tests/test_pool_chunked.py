"""The chunked pool forward (kvpop.pool.pool_chunked) against its twins: the fixed point of
kvpop.evaluate.pool_fixed_point and token-by-token decoding with OnePoolCache; for a one-pool
kvpop_mlp (static priorities) and dbtrimkv (decaying retentions), chunks of every size up to the
window, packed rows, and what it refuses."""

import pytest
import torch

from kvpop.decode import enable, teacher_forced_logits
from kvpop.evaluate import pool_fixed_point
from kvpop.policies import OnePool, make_policy
from kvpop.pool import pool_chunked
from kvpop.selection import global_decaying_eviction_times
from test_dbtrimkv import LAYOUT, WINDOW
from test_one_pool import scorer


@pytest.fixture(scope="module")
def llama(tiny_model):
    return enable(tiny_model("llama"))


def dbtrimkv(seed=0):
    torch.manual_seed(seed)
    policy = make_policy("dbtrimkv", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    with torch.no_grad():
        policy.scorer.w2.normal_(std=2.0)
        policy.scorer.b2.fill_(1.0)  # retentions well below 1: the pool's ranks cross as tokens age
    return policy


POLICIES = {"kvpop_mlp, one pool": lambda: OnePool(scorer(seed=4)), "dbtrimkv": dbtrimkv}


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("chunk", [3, WINDOW])  # 3: chunks that do not divide the row
def test_the_chunked_forward_is_the_fixed_point(llama, name, chunk):
    policy = POLICIES[name]()
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(5))
    want, want_logits = pool_fixed_point(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    got, logits = pool_chunked(llama, policy, ids, layout=LAYOUT, chunk=chunk, keep_logits=True)
    assert torch.equal(got, want.long())
    assert (logits - want_logits).abs().max() < 1e-4
    assert (got < 70).any()  # the pool evicted: the test says something


@pytest.mark.parametrize("name", POLICIES)
def test_the_chunked_forward_is_decoding(llama, name):
    policy = POLICIES[name]()
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(6))
    _, logits = pool_chunked(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    decoded = teacher_forced_logits(llama, policy, ids, layout=LAYOUT, prefill=LAYOUT.budget)
    assert (decoded - logits).abs().max() < 1e-4


def test_the_times_are_the_pools_rule_on_the_priorities_it_recorded(llama):
    """Its recorded priorities, run through the simulation once more, give its times (no stale placeholder)."""
    from kvpop.pool import ChunkContext

    policy = OnePool(scorer(seed=7))
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(8))
    got, _ = pool_chunked(llama, policy, ids, layout=LAYOUT)
    pos = torch.arange(50)[None]
    ctx = ChunkContext(policy, torch.zeros_like(pos), pos, LAYOUT, num_layers=2, evict=got[:, :, :, :])
    with torch.no_grad():
        llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False)  # one chunk of the whole row, under those times
    want = global_decaying_eviction_times(ctx.prio, torch.zeros_like(pos), pos, sinks=LAYOUT.sinks, window=LAYOUT.window,
                                          long_range=LAYOUT.long_range, decays=False)
    assert torch.equal(got, want.long())


def test_packed_rows_start_each_document_with_an_empty_pool(llama):
    """Two documents packed in one row: each gets the times it gets alone."""
    policy = OnePool(scorer(seed=9))
    a = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(10))
    b = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(11))
    row = torch.cat([a, b], 1)
    doc = torch.tensor([[0] * 40 + [1] * 30])
    pos = torch.cat([torch.arange(40), torch.arange(30)])[None]
    got, _ = pool_chunked(llama, policy, row, layout=LAYOUT, doc_ids=doc, pos=pos)
    ea, _ = pool_chunked(llama, policy, a, layout=LAYOUT)
    eb, _ = pool_chunked(llama, policy, b, layout=LAYOUT)
    never_a = ea >= 40
    assert torch.equal(torch.where(never_a, -1, ea), torch.where(got[..., :40] >= 40, -1, got[..., :40]))
    assert torch.equal(torch.where(eb >= 30, -1, eb), torch.where(got[..., 40:] >= 70, -1, got[..., 40:] - 40))


def test_it_refuses_a_chunk_longer_than_the_window_and_a_per_head_policy(llama):
    ids = torch.zeros(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk"):
        pool_chunked(llama, OnePool(scorer()), ids, layout=LAYOUT, chunk=WINDOW + 1)
    with pytest.raises(ValueError, match="one_pool"):
        pool_chunked(llama, scorer(), ids, layout=LAYOUT)


def mlp_pool(seed=12):
    """A kvpop_mlp_pool with test_one_pool's scorer weights (scores that differ per token)."""
    policy = make_policy("kvpop_mlp_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    policy.load_state_dict(scorer(seed=seed).state_dict())
    return policy


def delayed_pool():
    from test_pool_mlstm import LAYOUT as MLSTM_LAYOUT
    from test_pool_mlstm import mlstm_pool

    return mlstm_pool(delay=3, seed=13), MLSTM_LAYOUT


STACKED = {"kvpop_mlp, one pool": lambda: (OnePool(scorer(seed=4)), LAYOUT), "dbtrimkv": lambda: (dbtrimkv(), LAYOUT),
           "kvpop_mlp_pool": lambda: (mlp_pool(), LAYOUT), "kvpop_pool": delayed_pool}


@pytest.mark.parametrize("name", STACKED)
def test_every_layer_stacked_scores_as_each_layer_alone(name):
    """Policy.all_layers: layer 0 of the view on every layer's keys and values stacked along the heads gives each
    layer's own priorities (the delayed mLSTM: its stream, fed in chunks)."""
    policy, layout = STACKED[name]()
    g = torch.Generator().manual_seed(14)
    decay = getattr(getattr(getattr(policy, "policy", policy), "scorer", None), "decay", None)
    if decay is not None:  # a decay per (layer, head): the view must keep each head's own
        decay.logit.data.normal_(generator=g)
    L, B, Hk, S, D = 2, 2, 2, 30, 16
    k, v = torch.randn(L, B, Hk, S, D, generator=g), torch.randn(L, B, Hk, S, D, generator=g)
    doc = torch.tensor([[0] * 18 + [1] * 12, [0] * 30])
    pos = torch.stack([torch.cat([torch.arange(18), torch.arange(12)]), torch.arange(30)])
    view = policy.all_layers()
    stack = lambda t: t.transpose(0, 1).reshape(B, L * Hk, *t.shape[3:])  # noqa: E731  (L, B, Hk, ..) -> (B, L x Hk, ..)
    with torch.no_grad():
        if policy.read_delay(layout.window) is None:
            want = torch.stack([policy.scores(i, k[i], v[i], pos, doc_ids=doc, window=layout.window).prio for i in range(L)])
            got = view.scores(0, stack(k), stack(v), pos, doc_ids=doc, window=layout.window).prio
        else:  # each layer's stream and the stacked one, fed the same chunks

            def streamed(pol, layer, kk, vv):
                stream, out = pol.score_stream(layer, doc, pos, window=layout.window), torch.zeros(*kk.shape[:-1], dtype=torch.float64)
                for c in range(0, S, 4):
                    p, r0, read = stream.feed(kk[..., c : c + 4, :], vv[..., c : c + 4, :])
                    dst = out[..., r0 : r0 + p.shape[-1]]
                    dst.copy_(torch.where(read[:, None], p, dst))
                return out

            want = torch.stack([streamed(policy, i, k[i], v[i]) for i in range(L)])
            got = streamed(view, 0, stack(k), stack(v))
    assert got.shape == (B, L * Hk, S)
    assert torch.equal(got, stack(want))  # bitwise here; the chunked forward needs equal ties
    assert (want[0] - want[1]).abs().max() > 1e-3  # the layers score differently: the test tells them apart


@pytest.mark.parametrize("name", STACKED)
def test_the_stacked_chunked_forward_is_the_layer_by_layer_one(llama, name):
    """pool_chunked's every-layer scoring (stack_layers, the default) against its twin that scores each layer as
    it runs: the same times and logits, on two packed rows."""
    from conftest import packed_toy

    policy, layout = STACKED[name]()
    ids, doc, pos = packed_toy(B=2, S=48, seed=15)
    want, want_logits = pool_chunked(llama, policy, ids, layout=layout, doc_ids=doc, pos=pos, keep_logits=True, stack_layers=False)
    got, logits = pool_chunked(llama, policy, ids, layout=layout, doc_ids=doc, pos=pos, keep_logits=True)
    assert torch.equal(got, want)
    assert (logits - want_logits).abs().max() < 1e-5
    assert (got[..., 4:] < 48).any()  # the pool evicted: the test says something


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("name", ["kvpop_mlp_pool", "kvpop_pool"])
def test_the_training_forwards_deferred_scorers_are_each_layers_own(tiny_model, name, checkpointing):
    """A pool policy's training forward under given times scores every layer once after the forward
    (SparseContext.stack_scorers, the default) against its twin that scores each layer as it runs: the same
    logits, recorded priorities, loss, statistics and gradients of every scorer parameter, with activation
    checkpointing too."""
    from kvpop.attention import ScorerTraining, SparseContext

    model = enable(tiny_model("llama"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    policy, layout = STACKED[name]()
    policy.scorer.decay.logit.data.normal_(generator=torch.Generator().manual_seed(18))  # each (layer, head) its own decay
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(17))
    pos = torch.arange(48).expand(2, 48)
    doc = torch.zeros_like(pos)
    evict, _ = pool_chunked(model, policy, ids, layout=layout)
    runs = []
    for stack in (True, False):
        policy.zero_grad(set_to_none=True)
        ctx = SparseContext.for_rows(policy, doc, pos, layout, scorer_training=ScorerTraining(weighting="uniform"), global_evict=evict,
                                     stack_scorers=stack)
        logits = model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False).logits
        (loss,) = ctx.finish_scorer_losses()
        (loss + logits.float().square().mean()).backward()  # the model's backward too: checkpointing recomputes the layers
        grads = {n: p.grad.clone() for n, p in policy.named_parameters()}
        prio = torch.stack([ctx.global_prio[i] for i in range(2)])
        runs.append((logits.detach(), prio, loss.detach(), ctx.stats[0], grads, ctx.scored_layers))
    (lg, pr, ls, st, gr, n), (lg2, pr2, ls2, st2, gr2, n2) = runs
    assert torch.equal(lg, lg2) and torch.equal(pr, pr2) and n == n2 == 2
    torch.testing.assert_close(ls, ls2, rtol=1e-6, atol=1e-9)
    assert st["decisions"] == st2["decisions"] > 0
    assert gr.keys() == gr2.keys() and len(gr) > 2
    for key in gr:
        torch.testing.assert_close(gr[key], gr2[key], rtol=1e-5, atol=1e-9, msg=key)
        assert gr[key].abs().sum() > 0, key


# --- the pool's boundary labels --------------------------------------------------------------------
def brute_pool_labels(prio, S, layout):
    """Every decision literally: at query j + window, E = every (pair, token <= j) past the sinks, ordered by
    (priority desc, token desc, pair asc); a leaver is kept iff among the first P; competitor: the P-th of E without it."""
    from kvpop.selection import NEVER  # noqa: F401  (the simulation's convention, for the reader)

    Fp = prio.shape[0]
    P = Fp * layout.long_range
    out = {}
    for j in range(layout.sinks, S - layout.window):
        E = [(f, t) for t in range(layout.sinks, j + 1) for f in range(Fp)]
        if len(E) <= P:
            continue
        order = sorted(E, key=lambda e: (-float(prio[e[0], e[1]]), -e[1], e[0]))
        for f in range(Fp):
            rank = order.index((f, j))
            rest = [e for e in order if e != (f, j)]
            out[(f, j)] = (1.0 if rank < P else -1.0, rest[P - 1])
    return out


@pytest.mark.parametrize("levels", [None, 3])  # continuous priorities, and many exact ties
def test_pool_labels_are_the_literal_competition(levels):
    from kvpop.boundary import pool_boundary_labels
    from kvpop.geometry import CacheLayout

    layout = CacheLayout(2 + 4 + 3, 2, 4)  # k = 3
    S, Fp = 30, 4
    g = torch.Generator().manual_seed(12)
    prio = torch.randn(Fp, S, generator=g, dtype=torch.float64) if levels is None else torch.randint(0, levels, (Fp, S), generator=g).double()
    pos = torch.arange(S)[None]
    lab = pool_boundary_labels(prio[None], torch.zeros_like(pos), pos, layout=layout)
    want = brute_pool_labels(prio, S, layout)
    got = {(int(f), int(j)): (float(y), (int(bf), int(bt))) for f, j, y, bf, bt in
           zip(lab.pair, lab.t_new, lab.y, lab.bnd_pair, lab.t_bnd, strict=True)}
    assert got == want and len(want) > 20


def test_pool_labels_agree_with_the_pools_simulation():
    """A leaver the teacher keeps survives its query in the simulation run on the teacher's priorities."""
    from kvpop.boundary import pool_boundary_labels
    from kvpop.geometry import CacheLayout

    layout = CacheLayout(2 + 5 + 4, 2, 5)
    S, L, Hk = 60, 2, 3
    prio = torch.randn(L, 1, Hk, S, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    pos = torch.arange(S)[None]
    e = global_decaying_eviction_times(prio, torch.zeros_like(pos), pos, sinks=2, window=5, long_range=layout.long_range, decays=False)
    lab = pool_boundary_labels(prio.permute(1, 0, 2, 3).reshape(1, L * Hk, S), torch.zeros_like(pos), pos, layout=layout)
    e_flat = e.permute(1, 0, 2, 3).reshape(1, L * Hk, S)[0]
    survives = e_flat[lab.pair, lab.t_new] > lab.t_new + 5
    assert torch.equal(survives, lab.y > 0) and bool((lab.y > 0).any()) and bool((lab.y < 0).any())


def test_one_pair_gives_the_per_head_labels():
    from kvpop.boundary import boundary_labels, pool_boundary_labels
    from kvpop.geometry import CacheLayout

    layout = CacheLayout(2 + 4 + 3, 2, 4)
    prio = torch.randn(2, 1, 40, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    doc = torch.tensor([[0] * 25 + [1] * 15] * 2)
    pos = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, 40)
    per_head = boundary_labels(prio, torch.zeros(1, dtype=torch.float64), doc, pos, layout=layout)
    pool = pool_boundary_labels(prio, doc, pos, layout=layout)
    assert torch.equal(per_head.row, pool.row) and torch.equal(per_head.t_new, pool.t_new)
    assert torch.equal(per_head.t_bnd, pool.t_bnd) and torch.equal(per_head.y, pool.y)


def test_training_runs_under_the_pools_pattern_with_one_loss_for_the_model(llama):
    """kvpop_mlp_pool in training: the differentiable forward under pool_chunked's times gives its logits; the
    scorer loss is one (the pool's), and its gradient reaches every layer's scorer, not the model."""
    from kvpop.attention import ScorerTraining, SparseContext

    torch.manual_seed(15)
    policy = make_policy("kvpop_mlp_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for mlp in policy.scorer.layers:
        torch.nn.init.normal_(mlp.w2)
    ids = torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(16))
    pos = torch.arange(48).expand(2, 48)
    evict, want = pool_chunked(llama, policy, ids, layout=LAYOUT, keep_logits=True)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, LAYOUT, scorer_training=ScorerTraining(weighting="uniform"), global_evict=evict)
    logits = llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    assert (logits - want).abs().max() < 1e-4
    losses = ctx.finish_scorer_losses()
    assert len(losses) == 1 and ctx.scored_layers == 2 and ctx.stats[0]["decisions"] > 0
    losses[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for mlp in policy.scorer.layers for p in (mlp.w1, mlp.w2))
    assert all(p.grad is None for p in llama.parameters())


@pytest.mark.parametrize("attention", ["kvpop", "kvpop_cache"])
def test_the_forwards_read_nothing_back_from_the_gpu(attention, llama, tiny_model, monkeypatch):
    """Neither the chunked pass nor the training forward (a SparseContext over packed rows) makes transformers look for
    packed rows in ``position_ids``: that check reads its answer on the host, a synchronization per forward that
    CUDA-graph capture skips (train.pool_graphs refused both pool policies on an H100, 2026-12-07). The "kvpop"
    attention (training) registers no mask function, so transformers prepares none; "kvpop_cache" (decoding, and the
    chunked pass in evaluation) keeps its mask function, and the chunked pass gives it a 4-D mask to pass through
    (kvpop.pool.PATTERN_IN_CONTEXT). With the check reached instead, the times and logits are the same."""
    import transformers.masking_utils as masking

    import kvpop.pool
    from kvpop.attention import SparseContext, register

    model = llama if attention == "kvpop_cache" else tiny_model("llama", attn_implementation=register())
    policy = OnePool(scorer(seed=12))
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(13))
    doc = torch.tensor([[0] * 40 + [1] * 30, [0] * 70])
    pos = torch.cat([torch.cat([torch.arange(40), torch.arange(30)])[None], torch.arange(70)[None]])
    seen = []
    find = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: seen.append(1) or find(*a, **k))

    def forwards():
        got = pool_chunked(model, policy, ids, layout=LAYOUT, doc_ids=doc, pos=pos, keep_logits=True)
        ctx = SparseContext(policy=make_policy("streaming_llm"), doc_ids=doc, pos=pos, layout=LAYOUT)
        return got, model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx, use_cache=False).logits

    with monkeypatch.context() as m:  # the check reached: a mask function for "kvpop", no pass-through mask for the chunks
        m.setitem(masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "kvpop", lambda *a, **k: None)
        m.setattr(kvpop.pool, "PATTERN_IN_CONTEXT", None)
        (want, want_logits), want_dense = forwards()
    assert len(seen) > 1  # the check above can fail
    seen.clear()
    (got, logits), dense = forwards()
    assert seen == ([] if attention == "kvpop" else [1])  # kvpop_cache: its training-style forward still checks (not used in training)
    assert torch.equal(got, want) and torch.equal(logits, want_logits) and (want < 70).any()
    assert torch.equal(dense, want_dense)


def test_chunked_graphs_off_the_gpu_are_the_eager_pass(llama):
    """kvpop.pool.ChunkedGraphs (train.pool_graphs) off a GPU, or asked for no graphs: the eager pass's times, on
    packed rows; it captures nothing and says why it runs eagerly only where graphs were asked off (the CUDA
    graphs against the eager pass: tests/test_gpu.py -k chunked_graphs)."""
    from kvpop.pool import ChunkedGraphs

    policy = OnePool(scorer(seed=8))
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(9))
    doc = torch.tensor([[0] * 40 + [1] * 30, [0] * 70])
    pos = torch.cat([torch.cat([torch.arange(40), torch.arange(30)])[None], torch.arange(70)[None]])
    want, _ = pool_chunked(llama, policy, ids, layout=LAYOUT, doc_ids=doc, pos=pos)
    for graphs in (True, False):
        run = ChunkedGraphs(llama, policy, layout=LAYOUT, graphs=graphs)
        assert torch.equal(run(ids, doc_ids=doc, pos=pos), want) and not run.graphs
        assert run.fallback == (None if graphs else "graphs off")
    assert (want < 70).any()


@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_the_closed_form_is_the_pools_simulation(levels, packed):
    from kvpop.selection import global_eviction_times

    L, B, Hk, S = 3, 2, 2, 90
    g = torch.Generator().manual_seed(17)
    prio = torch.randn(L, B, Hk, S, generator=g, dtype=torch.float64) if levels is None else torch.randint(0, levels, (L, B, Hk, S), generator=g).double()
    if packed:
        doc = torch.tensor([[0] * 50 + [1] * 35 + [-1] * 5, [0] * 20 + [1] * 70])
        pos = torch.stack([torch.cat([torch.arange(50), torch.arange(35), torch.zeros(5, dtype=torch.long)]),
                           torch.cat([torch.arange(20), torch.arange(70)])])
    else:
        doc, pos = torch.zeros(B, S, dtype=torch.long), torch.arange(S).expand(B, S)
    for k in (0, 1, 4):
        kw = dict(sinks=2, window=7, long_range=k)
        want = global_decaying_eviction_times(prio, doc, pos, decays=False, **kw).long()
        got = global_eviction_times(prio, doc, pos, **kw).long()
        assert torch.equal(got, want), k
        assert (want < S).any()
