"""The engine's pooled kind (kvpop.decode.pooled): one pool for every layer and KV head at engine speed.

Twins: :class:`kvpop.decode.OnePoolCache` decoding token by token (logits, tokens and the entries each
layer and head holds) against the engine's chunked prefill and static step, for ``dbtrimkv`` (decaying
retention; a tie-heavy gate too), ``OnePool(kvpop_mlp)``, ``OnePool`` of a tie-heavy rule and
``kvpop_mlp_pool``; :func:`kvpop.decode.pooled.select_lowest` against :func:`kvpop.selection.pool_leavers`;
a prefill chunk's competitions in one pass (:meth:`PoolStore.compete_static`, :meth:`PoolStore.compete_decaying`)
against their per-query replay on the store (:meth:`PoolStore.update`), chunk by chunk and over a whole prefill.
The compiled (FlexAttention, CUDA-graphed) step against the eager one: tests/test_gpu.py.
"""

import pytest
import torch

from kvpop.decode import DecodeEngine, OnePoolCache, choose_path, enable, engine_refusal, generate, teacher_forced_logits
from kvpop.decode.pooled import PoolStore, select_lowest, select_lowest_set
from kvpop.geometry import CacheLayout
from kvpop.policies import OnePool, make_policy
from kvpop.selection import NEVER, pool_leavers
from test_engine import engine_logits
from test_engine import ids as random_ids

SINKS, WINDOW, K = 4, 16, 12
BUDGET = SINKS + WINDOW + K
LAYOUT = CacheLayout(BUDGET, SINKS, WINDOW)
S = 120


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tiny_model):
    return enable(tiny_model(request.param))


def random_weights(policy, seed: int, std: float = 0.5):
    torch.manual_seed(seed)
    for p in policy.parameters():
        torch.nn.init.normal_(p, std=std)
    return policy


def make(name: str, tie_policy):
    """The one-pool policies on the tiny models (2 layers, 2 KV heads, head dim 16)."""
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    if name == "dbtrimkv":
        policy = random_weights(make_policy("dbtrimkv", **shape), 1)
        policy.scorer.b2.data.fill_(2.0)  # log beta around logsigmoid(2): some tokens decay fast, some slowly
        policy.scorer.w1.data *= 3.0
        return policy
    if name == "dbtrimkv_tied":  # every token retains at one rate: every decision is a tie (older, then the higher pair)
        policy = make_policy("dbtrimkv", **shape)
        policy.scorer.b2.data.fill_(2.0)
        return policy
    if name == "kvpop_mlp_pool":
        return random_weights(make_policy("kvpop_mlp_pool", **shape), 2)
    if name == "kvpop_pool":  # the delayed mLSTM: read out at j + d, d = window // 4 (prefill chunks of window - d)
        policy = make_policy("kvpop_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_dk=4, scorer_dv=4)
        torch.manual_seed(4)
        with torch.no_grad():
            for cell in policy.scorer.layers:  # gates and read-out that depend on the tokens
                cell.w_gate.normal_(std=0.3)
                cell.w_o.mul_(3.0)
        return policy
    if name == "one_pool_ties":  # static priorities with three levels: ties broken by the newer token, then the lower pair
        rule = tie_policy(per_head_shift=True, name="ties")
        type(rule).learned = True  # OnePool ranks learned (or oracle) priorities
        return OnePool(rule)
    return OnePool(random_weights(make_policy("kvpop_mlp", **shape), 3))


NAMES = ["dbtrimkv", "dbtrimkv_tied", "one_pool_mlp", "one_pool_ties", "kvpop_mlp_pool", "kvpop_pool"]


def ids(B=2, n=S, seed=1):
    return random_ids(B, n, seed)


def reference_cache(model, policy, tokens: torch.Tensor) -> OnePoolCache:
    """OnePoolCache after teacher-forcing ``tokens`` one at a time."""
    cache = OnePoolCache(model.config, policy, LAYOUT)
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            model(input_ids=tokens[:, t : t + 1], past_key_values=cache)
    return cache


def held(eng: DecodeEngine) -> list[list[list[list[int]]]]:
    """The engine's entries: [row][layer][head] -> sorted positions (rings and pool)."""
    st = eng.store
    out = []
    for b in range(eng.B):
        rows = [[[] for _ in range(eng.Hk)] for _ in range(len(eng.layers))]
        for tag, pos in zip(st.tag[b].tolist(), st.pos[b].tolist(), strict=True):
            if tag >= 0:
                rows[tag // eng.Hk][tag % eng.Hk].append(pos)
        out.append([[sorted(h) for h in layer] for layer in rows])
    return out


def reference_held(cache: OnePoolCache) -> list[list[list[list[int]]]]:
    Hk = cache.num_kv_heads
    B = cache.pool_pos.shape[0]
    out = []
    for b in range(B):
        rows = [[[p for p in layer.pos[b, h].tolist() if p >= 0] for h in range(Hk)] for layer in cache.layers]
        for p, f in zip(cache.pool_pos[b].tolist(), cache.pool_f[b].tolist(), strict=True):
            if p >= 0:
                rows[f // Hk][f % Hk].append(p)
        out.append([[sorted(h) for h in layer] for layer in rows])
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("prefill,page", [(1, 4), (30, 4), (100, 4), (120, 16), (100, 16)])
def test_engine_equals_the_one_pool_cache(model, name, prefill, page, tie_policy):
    """Prompts shorter and longer than the budget (chunks of ``window`` tokens), then steps: the logits of
    token-by-token decoding with OnePoolCache, two rows with pools of their own. Pages of 4 slots: the
    layers' lists take and return pages as they grow and shrink."""
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=page)
    assert eng.kind == "pooled"
    got = engine_logits(eng, x, prefill)
    assert (got - ref[:, prefill - 1 :]).abs().max() < 1e-4
    assert eng.seen == S


@pytest.mark.parametrize("name", ["dbtrimkv", "one_pool_mlp", "kvpop_mlp_pool"])
def test_every_layers_leavers_scored_in_one_call_as_layer_by_layer(model, name, tie_policy):
    """The engine scores a static rule's leavers of every layer with one call of the rule's all_layers view
    (engine.STACKED_LEAVERS): bitwise the priorities of its twin, each layer's rule on its own leavers, for a step's
    one leaver and a chunk's many (the engine == OnePoolCache tests run the stacked form)."""
    eng = DecodeEngine(model, make(name, tie_policy), layout=LAYOUT, batch_size=2, page=4)
    assert eng._stacked is not None
    eng.prefill(ids(n=60))
    with torch.no_grad():
        for j in (torch.tensor([30]), torch.arange(20, 44)):
            got = eng._leaver_prio(j)
            stacked, eng._stacked = eng._stacked, None
            want = eng._leaver_prio(j)
            eng._stacked = stacked
            assert got.shape == (2, eng.store.F, j.numel()) and got.dtype == torch.float64
            assert torch.equal(got, want)
            assert (got[:, : eng.Hk] - got[:, eng.Hk :]).abs().max() > 1e-6  # the layers score differently: the test tells them apart


@pytest.mark.parametrize("name", ["dbtrimkv", "one_pool_ties", "kvpop_mlp_pool"])
@pytest.mark.parametrize("prefill", [96, 100])
def test_chunk_layers_on_static_buffers_equal_the_one_pool_cache(model, name, prefill, tie_policy):
    """``chunk_graphs=True`` (on CUDA each full chunk's layer one CUDA graph; here the same static buffers run
    eagerly): each layer's entries padded to a multiple of :attr:`DecodeEngine.chunk_bucket` places per head,
    x passed between two buffers, the chunk's keys and values gathered in one; prompts of whole chunks and
    a last partial one (the plain path) or not (the prefill's logits from the static buffers), then steps: the
    reference's logits."""
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4, chunk_graphs=True)
    assert eng.chunk_bucket == 16
    got = engine_logits(eng, x, prefill)  # chunks of 16: six whole (and one of 4)
    assert (got - ref[:, prefill - 1 :]).abs().max() < 1e-4
    assert set(eng._cg["ehl"]) >= {16, 32}  # layers of more than one width bucket
    with pytest.raises(ValueError, match="chunk_graphs"):
        DecodeEngine(model, make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16), layout=LAYOUT, batch_size=2, chunk_graphs=True)


@pytest.mark.parametrize(("name", "graphs"), [("dbtrimkv", False), ("dbtrimkv", True), ("one_pool_ties", False), ("one_pool_ties", True),
                                               ("kvpop_pool", False)])  # a delayed rule has no static buffers
def test_the_chunks_flex_attention_equals_the_one_pool_cache(model, name, graphs, tie_policy, monkeypatch):
    """The prefill chunk's FlexAttention (the compiled engine's, :func:`kvpop.decode.engine.chunk_attention_flex`: the
    visibility rule as a mask_mod, each head's padding skipped by the block mask; run eagerly here, blocks of a page)
    in place of its SDPA twin in every chunk: the reference's logits, whole chunks on the plain path and on static
    buffers (widths doubling), a last partial one, the delayed rule's shorter chunks (no static buffers). The two
    executors agree on a chunk's raw output too."""
    import kvpop.decode.engine as engine

    calls, flex = [], engine.chunk_attention_flex

    def counted(*args, **kw):
        calls.append((args[0].shape[2], kw["entries"], kw["block"]))
        return flex(*args, **kw)

    monkeypatch.setattr(engine, "chunk_attention_flex", counted)
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4, chunk_graphs=graphs)
    assert eng.chunk_attention == "sdpa"  # the uncompiled engine's
    eng.chunk_attention = "flex"
    got = engine_logits(eng, x, 100)
    assert (got - ref[:, 99:]).abs().max() < 1e-4
    assert len(calls) >= 2 * len(eng.layers) and max(c for c, _, _ in calls) == eng.pool_chunk and min(c for c, _, _ in calls) < eng.pool_chunk
    assert all(b == 4 and e % 4 == 0 for _, e, b in calls) and max(e for _, e, _ in calls) > 0
    if graphs:
        widths = set(eng._cg["ehl"])
        assert all(w // eng.chunk_bucket & (w // eng.chunk_bucket - 1) == 0 for w in widths) and len(widths) >= 2  # bucket x 2^k
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g), *torch.randn(2, 2, 2, 40, 8, generator=g))  # (B, H, C, D); (B, Hk, N, D)
    lo = torch.randint(0, 30, (2, 2, 40), generator=g)
    lo[..., -5:] = torch.arange(30, 35)  # the chunk's own tokens at positions 30..34: each query sees itself
    hi = torch.where(torch.rand(2, 2, 40, generator=g) < 0.3, torch.randint(31, 36, (2, 2, 40), generator=g), NEVER)
    qpos = torch.arange(30, 35)
    want = torch.nn.functional.scaled_dot_product_attention(  # every query head over its KV head's visible places
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.3,
        attn_mask=((lo[:, :, None] <= qpos[:, None]) & (qpos[:, None] < hi[:, :, None])).repeat_interleave(2, 1))
    for attend in (flex, engine.chunk_attention_sdpa):
        assert (attend(q, k, v, lo, hi, qpos, 0.3) - want).abs().max() < 1e-5


def test_the_chunks_block_mask_visits_every_visible_place_and_skips_the_padding():
    """:func:`kvpop.decode.engine.chunk_block_mask` (what the GPU kernel visits; eager FlexAttention on the CPU reads
    only the mask_mod): every place a query sees lies in a block its query head visits; a head's padding blocks
    past its entries and the chunk's blocks after the query block's own are not visited; the flex executor over
    it equals the SDPA twin. Heads holding 0, 5, 17 and 32 of 32 entry places, blocks of 16, a chunk of 20."""
    from kvpop.decode.engine import chunk_attention_flex, chunk_attention_sdpa, chunk_block_mask

    g = torch.Generator().manual_seed(3)
    B, Hk, G, n, C, blk, c0 = 2, 4, 2, 32, 20, 16, 40
    qpos = torch.arange(c0, c0 + C)
    lo = torch.full((B, Hk, n + C), NEVER)
    hi = torch.full((B, Hk, n + C), NEVER)
    lo[..., n:] = qpos  # the chunk's own tokens, each from its position on
    for b in range(B):
        for h, held in enumerate([0, 5, 17, 32]):
            lo[b, h, :held] = torch.randint(0, c0, (held,), generator=g)
            hi[b, h, :held] = torch.where(torch.rand(held, generator=g) < 0.3, torch.randint(c0 + 1, c0 + C, (held,), generator=g), NEVER)

    def mask_mod(b, h, q_idx, kv_idx):
        p = qpos[q_idx]
        return (lo[b, h // G, kv_idx] <= p) & (p < hi[b, h // G, kv_idx])

    bm = chunk_block_mask(mask_mod, lo, n, C, G, blk)
    dense = bm.to_dense().bool()  # (B, H, Qb, Kb)
    visited = dense.repeat_interleave(blk, 2).repeat_interleave(blk, 3)[:, :, :C, : n + C]  # (B, H, C, N)
    sees = ((lo[:, :, None] <= qpos[:, None]) & (qpos[:, None] < hi[:, :, None])).repeat_interleave(G, 1)  # (B, H, C, N)
    assert sees.any() and not (sees & ~visited).any()
    for h, held in enumerate([0, 5, 17, 32]):
        want = [*range(-(-held // blk)), n // blk]  # entry blocks, then the chunk's first
        assert torch.equal(dense[:, h * G, 0].nonzero()[:, 1].unique(), torch.tensor(want)), h
        assert dense[:, h * G, 1, n // blk + 1].all()  # query block 1 reaches the chunk's second block, query block 0 does not
        assert not dense[:, h * G, 0, n // blk + 1].any()
    q, k, v = (torch.randn(B, Hk * G, C, 8, generator=g), *torch.randn(2, B, Hk, n + C, 8, generator=g))
    want = chunk_attention_sdpa(q, k, v, lo, hi, qpos, 0.3)
    assert (chunk_attention_flex(q, k, v, lo, hi, qpos, 0.3, entries=n, block=blk) - want).abs().max() < 1e-5
    # entry places not a whole number of blocks: every block for every query block (engine.block_mask's, broadcast)
    full = chunk_block_mask(mask_mod, lo, None, C, G, blk).to_dense().bool()
    assert full.all() and full.shape[-2:] == (-(-C // blk), -(-(n + C) // blk))
    assert (chunk_attention_flex(q, k, v, lo, hi, qpos, 0.3, entries=n - 1, block=blk) - want).abs().max() < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_the_engine_holds_the_reference_entries(model, name, tie_policy):
    """After a chunked prefill and after steps, every layer and head holds the positions OnePoolCache holds,
    and the pool is full (its split between layers and heads the policy's, not k each)."""
    policy = make(name, tie_policy)
    x = ids(n=140, seed=4)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4)
    eng.prefill(x[:, :100])
    assert held(eng) == reference_held(reference_cache(model, policy, x[:, :100]))
    for t in range(100, 140):
        eng.tok.copy_(x[:, t : t + 1])
        eng.step()
    want = reference_held(reference_cache(model, policy, x))
    assert held(eng) == want
    occ = eng.store.occupancy()  # (B, L, Hk)
    assert (occ.sum((1, 2)) == 2 * 2 * eng.layout.slots).all()  # kvpop_pool: a slot of each head holds its state
    assert torch.equal(occ, torch.tensor([[[len(h) for h in layer] for layer in row] for row in want]))
    st = eng.store  # the lists are dense: layer l's entries at logical [0, n_l), on its pages
    for b in range(2):
        for layer in range(2):
            n = int(st.count[b, layer])
            s = torch.arange(n)
            slots = st.PS0 + st.ptab[b, layer, s // st.page] * st.page + s % st.page
            assert (st.tag[b, slots] // 2 == layer).all() and torch.equal(st.lidx[b, slots], s)
            assert n == (st.tag[b, st.PS0 :] // 2 == layer).sum()


def check_candidate_list(st: PoolStore) -> None:
    """The candidate list's bookkeeping: each listed slot holds a pool entry and knows its place, and no other
    slot claims one."""
    for b in range(st.B):
        cand, lpos = st.cand[b, : st.C], st.lpos[b]
        at = torch.nonzero(cand != st.dump).flatten()
        assert (st.tag[b, cand[at]] >= 0).all() and (cand[at] >= st.PS0).all()
        assert torch.equal(lpos[cand[at]].long(), at)
        claim = torch.nonzero(lpos >= 0).flatten()
        assert torch.equal(cand[lpos[claim].long()], claim)
        assert int(st.ccount[b]) <= st.C and (cand[int(st.ccount[b]) :] == st.dump).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("list_steps", [1, 3])
def test_the_step_over_its_candidate_list(model, name, list_steps, tie_policy):
    """The decode step competes over a candidate list refreshed every ``list_steps`` steps (the pool entries
    that can go in them, and the leavers that enter): OnePoolCache's logits and entries, as over the whole
    pool. Where ties put more than the list's room at its bound (the tie-heavy rules), a refresh says so and
    those steps compete over the whole pool: both kinds of step occur here."""
    policy = make(name, tie_policy)
    x = ids(n=150, seed=7)
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4, list_steps=list_steps)
    st = eng.store
    assert st.list_steps == list_steps and st.C < st.NP
    modes = []
    got = [eng.prefill(x[:, :40])]
    for t in range(40, 150):
        eng.tok.copy_(x[:, t : t + 1])
        got.append(eng.step().clone())
        modes.append(st.listed)
        check_candidate_list(st)
    assert (torch.stack(got, 1) - ref[:, 39:]).abs().max() < 1e-4
    assert held(eng) == reference_held(reference_cache(model, policy, x))
    assert any(modes), "no step ran over the list"
    if name in ("dbtrimkv", "one_pool_mlp", "kvpop_mlp_pool"):  # distinct ranks: the list always has room
        assert all(modes)


def test_a_negative_list_steps_is_refused(model, tie_policy):
    with pytest.raises(ValueError, match="list_steps must be >= 0"):
        DecodeEngine(model, make("dbtrimkv", tie_policy), layout=LAYOUT, batch_size=1, page=4, list_steps=-1)


def test_a_full_candidate_list_falls_back_to_the_whole_pool(model, tie_policy):
    """A refresh that finds more candidates than the list holds (here: every rank equal) answers False, and
    the steps it serves compete over the whole pool."""
    eng = DecodeEngine(model, make("one_pool_ties", tie_policy), layout=LAYOUT, batch_size=2, page=4, list_steps=2)
    st = eng.store
    eng.prefill(ids(n=100, seed=8))
    st.prio[:, st.PS0 :] = 0.0
    assert not st.refresh_list(eng.p)
    st.prio[:, st.PS0 :] = torch.arange(st.NS - st.PS0, dtype=torch.float64)
    assert st.refresh_list(eng.p)
    assert int(st.ccount.max()) <= st.C0 and (st.ccount == st.F + st.F * st.list_steps).all()


def pool_entries(st: PoolStore, orig: torch.Tensor) -> list[list[tuple]]:
    """The pool's entries of each row, layout aside: sorted (position, pair, priority, chunk-start slot)."""
    out = []
    for b in range(st.B):
        s = torch.nonzero(st.tag[b, st.PS0 :] >= 0).flatten() + st.PS0
        out.append(sorted(zip(st.pos[b, s].tolist(), st.tag[b, s].tolist(), st.prio[b, s].tolist(), orig[b, s].tolist(), strict=True)))
    return out


def check_lists(st: PoolStore) -> None:
    """The store's invariants: each layer's list dense at logical [0, n_l) on its own pages, pages in use marked."""
    for b in range(st.B):
        pages = []
        for layer in range(st.L):
            n = int(st.count[b, layer])
            s = torch.arange(n)
            slots = st.PS0 + st.ptab[b, layer, s // st.page] * st.page + s % st.page
            assert (st.tag[b, slots] // st.Hk == layer).all() and torch.equal(st.lidx[b, slots], s)
            assert n == (st.tag[b, st.PS0 :] // st.Hk == layer).sum()
            pages += st.ptab[b, layer, : -(-n // st.page)].tolist()
        assert len(set(pages)) == len(pages) and all(st.used[b, pages])
        assert int(st.used[b, : st.NPP - 1].sum()) == len(pages) and st.used[b, st.NPP - 1]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("page,long_range,n", [(4, K, 110), (16, K, 110), (4, 60, 300)])
def test_closed_form_competitions_equal_the_replay(model, name, page, long_range, n, tie_policy):
    """A prefill chunk's competitions without the per-query store updates: :meth:`PoolStore.compete_static` (a
    static rule, one pass) or :meth:`PoolStore.compete_decaying` (dbtrimkv, a candidate list) against the
    query-by-query replay (:meth:`PoolStore.update`) from the same store, chunk after chunk of a prompt longer
    than the budget (two rows; the first chunks' pool not yet full; chunks of 1 to ``window`` queries, so that
    both lists leave pool entries out; a pool of 60 a head, so that the decaying list leaves out leavers too):
    the same eviction time for every entry present at the chunk's start, the same pool entries after it (each
    with the same chunk-start slot: the same keys), and lists the later steps can update."""
    import copy
    import itertools

    policy = make(name, tie_policy)
    x = ids(n=n, seed=8)
    eng = DecodeEngine(model, policy, layout=CacheLayout(SINKS + WINDOW + long_range, SINKS, WINDOW), batch_size=2, page=page)
    st = eng.store
    st.decay_block = 5  # the decaying chunk: several candidate lists in a chunk
    eng.prefill(x[:, : SINKS + WINDOW])  # nothing has left the windows yet
    evicted, pruned, blocks, chunk_pruned = 0, False, False, False
    c0 = SINKS + WINDOW
    for size in itertools.cycle([1, 2, 5, WINDOW, 3, WINDOW, 1, 2, WINDOW, 4, 7, WINDOW, WINDOW]):
        c1 = min(c0 + size, n)
        if c0 >= c1:
            break
        prio = eng._leaver_prio(torch.arange(c0 - WINDOW, c1 - WINDOW))  # (B, F, n)
        twin = copy.deepcopy(st)
        orig = torch.arange(st.NS).expand(2, -1).clone()
        e = torch.full((2, st.NS), NEVER, dtype=torch.int64)
        for q in range(c0, c1):
            twin.update(torch.tensor(q), prio[:, :, q - c0], move_kv=False, track=(orig, e))
        before = copy.deepcopy(st)
        got_orig, got_e = (st.compete_decaying if st.decays else st.compete_static)(c0, prio)
        pruned |= st.decays or st.chunk_lists[0][0] < int((before.tag[:, st.PS0 :] >= 0).sum(1).min())  # the list left pool entries out
        if st.decays:  # the chunk's list, then its blocks' out of it
            chunk_pruned |= st.chunk_lists[0][0] < st.chunk_lists[0][1]  # the chunk's list left candidates out
            blocks |= len(st.chunk_lists) > 2 and any(m < h for m, h in st.chunk_lists[1:])  # blocks whose lists left some out
        assert torch.equal(got_e[:, : st.dump], e[:, : st.dump]), c0  # the replay writes its no-ops' times to the dump slot
        assert pool_entries(st, got_orig) == pool_entries(twin, orig), c0
        assert torch.equal(st.count.sum(1), twin.count.sum(1))
        check_lists(st)
        evicted += int((e < NEVER).sum())
        st.__dict__.update(before.__dict__)  # the engine's own prefill moves on (the keys follow the bookkeeping)
        eng.pool_closed_form = c0 % 2 == 0  # either path leaves a state the other continues from
        eng.prefill(x[:, c0:c1])
        check_lists(st)
        c0 = c1
    assert evicted > 0 and c0 == n
    assert pruned and ((blocks and chunk_pruned) or not st.decays)


@pytest.mark.parametrize("name", ["dbtrimkv", "one_pool_ties", "kvpop_mlp_pool"])
def test_closed_form_prefill_equals_the_replayed_prefill(model, name, tie_policy):
    """The whole prefill, closed form against replay (the twin), then decode steps: the same logits and the same
    entries in every layer and head."""
    policy = make(name, tie_policy)
    x = ids(n=130, seed=2)
    out = []
    for closed in (True, False):
        eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4)
        eng.pool_closed_form = closed
        logits = [eng.prefill(x[:, :100])]
        for t in range(100, 130):
            eng.tok.copy_(x[:, t : t + 1])
            logits.append(eng.step().clone())
        out.append((torch.stack(logits, 1), held(eng)))
    assert (out[0][0] - out[1][0]).abs().max() < 1e-5
    assert out[0][1] == out[1][1]


@pytest.mark.parametrize("name", ["dbtrimkv", "one_pool_mlp"])
def test_prefill_after_decode_steps(model, name, tie_policy):
    """Decode steps, then another prefill (a second turn), then steps: the logits of the reference."""
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4)
    first = engine_logits(eng, x[:, :70], prefill=35)
    assert first[:, 1:].sub(ref[:, 35:70]).abs().max() < 1e-4
    last = eng.prefill(x[:, 70:100])  # 30 tokens: a chunk of 16, then 14
    assert (last - ref[:, 99]).abs().max() < 1e-4
    for t in range(100, S):
        eng.tok.copy_(x[:, t : t + 1])
        assert (eng.step() - ref[:, t]).abs().max() < 1e-4


def test_generate_takes_the_engine_with_the_reference_tokens(model, tiny_tokenizer, tie_policy):
    """``path="auto"`` now decodes one-pool policies on the engine; greedy tokens as on OnePoolCache."""
    policy = make("dbtrimkv", tie_policy)
    assert engine_refusal(model, policy) is None and choose_path(model, policy) == "engine"
    prompt = ids(n=70, seed=9)
    fast, stats = generate(model, tiny_tokenizer, policy, prompt, layout=LAYOUT, max_new_tokens=12)
    slow, ref_stats = generate(model, tiny_tokenizer, policy, prompt, layout=LAYOUT, max_new_tokens=12, path="reference")
    assert stats.path == "engine" and ref_stats.path == "reference"
    assert torch.equal(fast, slow)


def test_memory_is_flat_and_sized_for_short_generations(model, tie_policy):
    policy = make("dbtrimkv", tie_policy)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=1, page=4)
    before = eng.cache_bytes()
    engine_logits(eng, ids(B=1, n=200), 150)
    assert eng.cache_bytes() == before
    L, Hk, page = 2, 2, eng.store.page
    # slots: the budget's entries, room for one step's leavers, a partial page per layer's rings and list, the dump page
    assert eng.store.NS <= L * Hk * BUDGET + L * Hk + (2 * L + 2) * page
    short = DecodeEngine(model, policy, layout=LAYOUT, batch_size=1, max_len=SINKS + WINDOW + 3, page=4)
    assert short.store.P == L * Hk * 3 and short.cache_bytes() < before
    x = ids(B=1, n=SINKS + WINDOW + 3)
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    assert (engine_logits(short, x, 10) - ref[:, 9:]).abs().max() < 1e-4


@pytest.mark.parametrize("select", [select_lowest, select_lowest_set])
@pytest.mark.parametrize("levels", [None, 3])
def test_select_lowest_is_pool_leavers(levels, select):
    """The engine's selections (two topk, sorted or not) against the reference's (kthvalue): the same n candidates."""
    g = torch.Generator().manual_seed(7)
    B, N, pairs = 3, 200, 8
    for n in (1, 5, 8, 12, 40):
        combo = torch.stack([torch.randperm(60 * pairs, generator=g)[:N] for _ in range(B)])  # distinct (position, pair) entries
        pos, pair = combo // pairs, combo % pairs
        if n > 10:
            pos[:, :10] = -1  # empty entries go first (pool_leavers ties them all: take more than there are)
        lb = -torch.rand(B, N, generator=g, dtype=torch.float64) if levels is None else -torch.randint(1, levels + 1, (B, N), generator=g).double() / 7
        want = pool_leavers(pos, pair, lb, 70, pairs, n)
        score = torch.where(pos >= 0, (70 - pos).double() * lb, float("-inf"))
        tie = torch.where(pos >= 0, pos * pairs + (pairs - 1 - pair), -1)
        sel = select(score, tie, n)
        got = torch.zeros_like(want).scatter_(1, sel, True)
        assert torch.equal(got, want), n
        assert (sel.sort(1).values.diff(1) > 0).all()  # n distinct candidates


def test_small_ranks_are_a_stable_sort():
    """small_ranks (pairwise, the decode step's) is the inverse of a stable sort, many equal keys included; order_of its
    indices."""
    from kvpop.decode.pooled import order_of, small_ranks

    g = torch.Generator().manual_seed(3)
    for n, hi in ((1, 5), (7, 3), (288, 40), (300, 10**12)):
        key = torch.randint(-hi, hi, (4, n), generator=g)
        want = key.sort(dim=1, stable=True).indices
        assert torch.equal(order_of(key), want)
        assert torch.equal(torch.empty_like(want).scatter_(1, want, torch.arange(n).expand(4, -1)), small_ranks(key))


def test_row_groups_keep_each_flex_call_in_int32s_range():
    """The compiled step reads the store in row groups of at most GROUP_ELEMENTS elements (torch 2.11's FlexAttention
    templates do not compile with 64-bit indexing): as few as fit, near-equal, 4-row multiples where they can be."""
    from kvpop.decode.pooled import GROUP_ELEMENTS, row_groups

    row = 598_400 * 128  # Qwen3-4B, budget 2,048: a row's keys
    assert row_groups(64, row) == [(0, 24), (24, 48), (48, 64)]
    assert row_groups(1, row) == [(0, 1)] and row_groups(28, row) == [(0, 28)] and row_groups(29, row) == [(0, 16), (16, 29)]
    for B in range(1, 80):
        for elems in (row, 10**9, 3 * 10**9):
            groups = row_groups(B, elems)
            assert groups[0][0] == 0 and groups[-1][1] == B and all(a[1] == b[0] for a, b in zip(groups, groups[1:], strict=False))
            assert all((r1 - r0) * elems <= GROUP_ELEMENTS or r1 - r0 == 1 for r0, r1 in groups)
            assert len(groups) == -(-B // max(1, GROUP_ELEMENTS // elems))


@pytest.mark.parametrize("name", ["dbtrimkv", "kvpop_mlp_pool", "kvpop_pool"])
def test_a_store_in_row_groups_equals_the_one_pool_cache(model, name, tie_policy, monkeypatch):
    """Each row its own group (a store past GROUP_ELEMENTS, small): the keys and values the competition moves, the
    leavers' scores and the delayed read-out go through the groups' views; the reference's logits all the same."""
    import kvpop.decode.pooled as pooled

    monkeypatch.setattr(pooled, "GROUP_ELEMENTS", 1)
    policy = make(name, tie_policy)
    x = ids()
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4)
    assert eng.store.groups == [(0, 1), (1, 2)]
    assert all(g.data_ptr() == eng.store.keys[r0].data_ptr() for g, (r0, _) in zip(eng.store.key_groups, eng.store.groups, strict=True))
    got = engine_logits(eng, x, 30)
    assert (got - ref[:, 29:]).abs().max() < 1e-4


def test_a_page_holds_one_entry_per_kv_head():
    with pytest.raises(ValueError, match="one entry per KV head"):
        PoolStore(batch=1, layers=2, kv_heads=8, head_dim=16, layout=LAYOUT, dtype=torch.float32, device=torch.device("cpu"), page=4,
                  decays=True)


@pytest.mark.parametrize("page,grouped", [(4, False), (128, False), (4, True)])
def test_the_compiled_steps_attention_on_the_cpu(model, page, grouped, tie_policy, monkeypatch):
    """What the compiled step reads, checked on the CPU: each layer's block list (its ring pages, then its own
    pool pages, ``kv_num_blocks`` of them) covers exactly the slots of its heads' entries; and the step's
    FlexAttention form (query heads as the queries of one head over the store, the layer's block mask, the
    tag mask_mod; run eagerly here) gives the eager gather's output; also with the store read in row groups, one call
    each (a store past :data:`kvpop.decode.pooled.GROUP_ELEMENTS`; here each row its own group)."""
    import kvpop.decode.pooled as pooled

    if grouped:
        monkeypatch.setattr(pooled, "GROUP_ELEMENTS", 1)
    policy = make("dbtrimkv", tie_policy)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=page)
    st = eng.store
    assert st.bm_num[0].dtype == st.bm_idx.dtype == torch.int32 and len(st.groups) == (2 if grouped else 1)
    st.flex = True  # keep the block masks, as a compiled engine does
    x = ids(n=90, seed=5)
    engine_logits(eng, x[:, :80], 60)
    for layer in range(2):
        for b in range(2):
            blocks = st.bm_idx[layer, b, 0, 0, : int(st.bm_num[layer][b])].long()
            listed = (blocks[:, None] * page + torch.arange(page)).flatten()
            tags = st.tag[b, listed]
            assert sorted(listed[tags >= 0].tolist()) == sorted(torch.nonzero(st.tag[b] // 2 == layer).flatten().tolist())
            assert ((tags < 0) | (tags // 2 == layer)).all()
    eng.tok.copy_(x[:, 80:81])
    eng.seen += 1
    xs, h, cos, sin, at = eng._step_head(eng)
    layer = eng.layers[0]
    args = (eng, layer, layer.input_layernorm, eng._wqkv[0], eng._wgu[0], eng._layer_index[0], st.bm_num[0], st.bm_idx[0], xs, h, cos, sin, at)
    with torch.no_grad():
        eager = eng._layer_step(*args)[0]
        eng.compiled = True  # the compiled step's branch, run eagerly
        try:
            flex = eng._layer_step(*args)[0]
        finally:
            eng.compiled = False
    assert (flex - eager).abs().max() < 1e-5


def test_a_competition_without_a_leaver_changes_nothing(model, tie_policy):
    """The graphed step runs the competition at every token (static control flow); before a token leaves the
    window (its leaver a sink, or before the first token) it must leave every buffer as it was."""
    eng = DecodeEngine(model, make("dbtrimkv", tie_policy), layout=LAYOUT, batch_size=2, page=4)
    st = eng.store
    st.flex = True
    eng.prefill(ids(n=50, seed=3))
    st.tag[:, st.dump], st.pos[:, st.dump] = -1, -1
    names = ("keys", "values", "pos", "tag", "prio", "lidx", "count", "ptab", "used", "bm_idx", "_bm_num")
    before = {n: getattr(st, n).clone() for n in names}
    for q in (0, SINKS + WINDOW - 1):
        st.update(torch.tensor(q), torch.randn(2, st.F, dtype=torch.float64))
        for n in names:
            a, b = getattr(st, n), before[n]
            if n in ("ptab", "used"):  # their last column is where the writes that change nothing go
                a, b = a[..., :-1], b[..., :-1]
            if n in ("keys", "values", "prio", "lidx"):  # the dump slot
                a, b = a[:, : st.dump], b[:, : st.dump]
            assert torch.equal(a, b), (q, n)


@pytest.mark.parametrize("name", ["dbtrimkv", "one_pool_mlp"])
def test_the_compiled_steps_control_flow_on_the_cpu(tiny_model, name, tie_policy):
    """The step as the compiled engine runs it (the competition at every token, FlexAttention over each
    layer's block list; eager here, neither compiled nor graphed: about 20 s, eager flex on the CPU) from a
    short prompt on: OnePoolCache's logits."""
    model = enable(tiny_model("qwen3"))
    policy = make(name, tie_policy)
    x = ids(n=60, seed=6)
    ref = teacher_forced_logits(model, policy, x, layout=LAYOUT, prefill=1)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=8)
    eng.store.flex = True
    eng.prefill(x[:, :10])  # before any token leaves the window
    eng.compiled = True  # the pieces stay the eager functions: only their control flow changes
    try:
        for t in range(10, 60):
            eng.tok.copy_(x[:, t : t + 1])
            eng.seen += 1
            with torch.no_grad():
                got = eng._eager_step(eng)
            assert (got - ref[:, t]).abs().max() < 1e-4, t
    finally:
        eng.compiled = False


@pytest.mark.parametrize("name", ["dbtrimkv", "dbtrimkv_tied"])
def test_the_compiled_decaying_query_equals_the_eager_one(model, name, tie_policy, monkeypatch):
    """A decaying prefill chunk's query body compiled by Inductor (pooled.COMPILED_QUERIES, the CUDA graph's body;
    here the CPU's code of the same graph): chunk after chunk, the same eviction times and pool as the eager body,
    with every decision a tie in ``dbtrimkv_tied``."""
    import copy

    from kvpop.decode.pooled import PoolStore

    policy = make(name, tie_policy)
    x = ids(n=110, seed=9)
    eng = DecodeEngine(model, policy, layout=LAYOUT, batch_size=2, page=4)
    st = eng.store
    st.decay_block = 5
    eng.prefill(x[:, : SINKS + WINDOW + 20])
    torch._dynamo.reset()
    compiled = torch.compile(PoolStore._decaying_query, fullgraph=True)  # as the store compiles it: lists of any length
    calls = []

    def body(self, b):
        calls.append(b["pos"].shape)
        return compiled(self, b)

    evicted = 0
    for c0 in range(SINKS + WINDOW + 20, 110, WINDOW):
        c1 = min(c0 + WINDOW, 110)
        prio = eng._leaver_prio(torch.arange(c0 - WINDOW, c1 - WINDOW))
        twin = copy.deepcopy(st)
        want = twin.compete_decaying(c0, prio)
        with monkeypatch.context() as m:
            m.setattr(PoolStore, "_decaying_query", body)
            got = st.compete_decaying(c0, prio)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), c0
        assert pool_entries(st, got[0]) == pool_entries(twin, want[0])
        evicted += int((got[1] < NEVER).sum())
        st.__dict__.update(twin.__dict__)
        eng.prefill(x[:, c0:c1])
    assert evicted > 0 and len(set(calls)) > 1  # lists of several lengths


def test_listed_first_is_the_sorted_places():
    """listed_first (a decaying prefill block's list: running counts and a scatter) against its definition, the first m
    of where(can, place, N + place) sorted: lists shorter and longer than m, none and all listed, m up to N."""
    from kvpop.decode.pooled import listed_first

    g = torch.Generator().manual_seed(21)
    for N, share in [(1, 0.5), (7, 0.0), (7, 1.0), (50, 0.1), (50, 0.6), (300, 0.3)]:
        can = torch.rand(3, N, generator=g) < share
        ar = torch.arange(N)
        for m in sorted({1, N // 2 or 1, N}):
            want = torch.where(can, ar, N + ar).sort(dim=1).values[:, :m]
            assert torch.equal(listed_first(can, m), want), (N, share, m)
    with pytest.raises(ValueError, match="the first m of 7 places, got m = 8"):
        listed_first(torch.ones(1, 7, dtype=torch.bool), 8)


def test_list_width_pads_to_few_shapes_on_cuda_only():
    """pooled.list_width: a list's length as it is on the CPU (at least 1), on CUDA a power of two from 1024, capped."""
    from kvpop.decode.pooled import list_width

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [list_width(m, 10_000, cpu) for m in (0, 1, 3000)] == [1, 1, 3000]
    assert [list_width(m, 100_000, cuda) for m in (0, 1, 1024, 1025, 3000, 70_000)] == [1024, 1024, 1024, 2048, 4096, 100_000]
    assert list_width(5, 300, cuda) == 300
