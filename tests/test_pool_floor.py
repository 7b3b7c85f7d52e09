"""A per-head floor under one pool (``CacheLayout.floor``, ``Policy.with_floor``, ``evaluate.pool_floors``):
no (layer, KV head) pair keeps fewer than ``floor`` long-range entries.

Twins: the simulation (:func:`kvpop.selection.global_decaying_eviction_times`, static and decaying ranks)
against the rule read literally (the lowest entry of the pairs above their floor goes, one at a time);
the closed form (:func:`kvpop.selection.global_eviction_times`, two competitions in a row) against the
simulation; ``floor = k`` against the per-head rule; the chunked forward against the fixed point and
token-by-token decoding with :class:`kvpop.decode.one_pool.OnePoolCache`. Plus what refuses a floor, by name.
"""

import pytest
import torch

from kvpop.boundary import pool_boundary_labels, priority_labels
from kvpop.config import Params
from kvpop.decode import engine_refusal, teacher_forced_logits
from kvpop.evaluate import Candidate, evaluate_fidelity, floor_twin, pool_fixed_point, ranked_policy
from kvpop.geometry import CacheLayout
from kvpop.policies import OnePool, make_policy
from kvpop.pool import pool_chunked
from kvpop.selection import eviction_times, global_decaying_eviction_times, global_eviction_times
from test_dbtrimkv import LAYOUT, SINKS, WINDOW, K, literal_global_eviction_times, tied_log_beta
from test_one_pool import scorer
from test_pool_chunked import dbtrimkv
from test_selection import random_packing


def held_per_pair(e, S):
    """(L, B, Hk) long-range entries held after the last query of one-document rows: evicted never (sinks too) less the sinks and window."""
    return (e.long() >= S).sum(-1) - SINKS - WINDOW


@pytest.mark.parametrize("decays", [False, True])
@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("floor", [1, 3, K])
def test_the_simulation_is_the_literal_rule(decays, levels, floor):
    L, B, Hk, S = 2, 2, 2, 64
    g = torch.Generator().manual_seed(31 + floor + 7 * decays + (levels or 0))
    doc_ids, pos = random_packing(B, S, [12, 30, S], 5, g)
    lb = tied_log_beta(L, B, Hk, S, g, levels)
    if not decays:
        lb = lb * 40 + 3  # any real: static priorities
    lb[1, :, 1] = lb[1, :, 1] + 30 if not decays else 0.0  # one pair outranks the rest (decaying: keeps forever); no floor: it starves them
    got = global_decaying_eviction_times(lb, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=K, decays=decays, floor=floor)
    want = literal_global_eviction_times(lb, doc_ids, pos, SINKS, WINDOW, K, decays=decays, floor=floor)
    assert torch.equal(got.long(), want)
    assert not torch.equal(got, global_decaying_eviction_times(lb, doc_ids, pos, sinks=SINKS, window=WINDOW, long_range=K, decays=decays))


@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("packed", [False, True])
def test_the_closed_form_is_the_simulation_at_every_floor(levels, packed):
    L, B, Hk, S = 3, 2, 2, 90
    g = torch.Generator().manual_seed(19 + (levels or 0))
    prio = torch.randn(L, B, Hk, S, generator=g, dtype=torch.float64) if levels is None else torch.randint(0, levels, (L, B, Hk, S), generator=g).double()
    if packed:
        doc, pos = random_packing(B, S, [20, 45, S], 6, g)
    else:
        doc, pos = torch.zeros(B, S, dtype=torch.long), torch.arange(S).expand(B, S)
    for k, floor in [(1, 1), (4, 0), (4, 1), (4, 3), (4, 4), (6, 2)]:
        kw = dict(sinks=2, window=7, long_range=k, floor=floor)
        want = global_decaying_eviction_times(prio, doc, pos, decays=False, **kw).long()
        got = global_eviction_times(prio, doc, pos, **kw).long()
        assert torch.equal(got, want), (k, floor)
        assert (want < S).any()


@pytest.mark.parametrize("floor", [0, 2, K])
def test_no_pair_falls_below_its_floor(floor):
    """After every query of a one-document row each pair holds at least ``floor`` long-range entries, and the pool is full."""
    L, B, Hk, S = 2, 1, 3, 80
    prio = torch.randn(L, B, Hk, S, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    prio[1, :, 2] += 4.0  # one pair outranks the others: without a floor it takes their places
    pos = torch.arange(S)[None]
    e = global_eviction_times(prio, torch.zeros_like(pos), pos, sinks=SINKS, window=WINDOW, long_range=K, floor=floor).long()
    for q in range(SINKS + WINDOW + K, S):
        held = (e[..., : q - WINDOW + 1] > q).sum(-1) - SINKS  # long-range entries held at query q
        assert held.min() >= floor and held.sum() == L * Hk * K, q
    low = held_per_pair(e, S).min()
    assert low == floor if floor < K else low == K  # the raised pair took every place above the others' floors


def test_a_floor_of_k_is_the_per_head_rule():
    L, B, Hk, S = 2, 2, 2, 70
    g = torch.Generator().manual_seed(11)
    prio = torch.randint(0, 4, (L, B, Hk, S), generator=g).double()  # ties: the newer token stays in both
    pos = torch.arange(S).expand(B, S)
    doc = torch.zeros(B, S, dtype=torch.long)
    got = global_eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K, floor=K).long()
    for layer in range(L):
        want = eviction_times(prio[layer], doc, pos, sinks=SINKS, window=WINDOW, long_range=K).long()
        assert torch.equal(got[layer].clamp(max=S), want.clamp(max=S)), layer  # at or past S: never, in the row


FLOORED = {"kvpop_mlp, one pool": lambda: OnePool(scorer(seed=4)).with_floor(2), "dbtrimkv": lambda: dbtrimkv().with_floor(3)}


@pytest.mark.parametrize("name", FLOORED)
def test_the_chunked_forward_is_the_fixed_point_and_decoding_under_a_floor(llama, name):
    policy = FLOORED[name]()
    layout = LAYOUT.for_policy(policy, head_dim=16)
    assert layout.floor == policy.pool_floor > 0
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(5))
    want, want_logits = pool_fixed_point(llama, policy, ids, layout=layout, keep_logits=True)
    got, logits = pool_chunked(llama, policy, ids, layout=layout, chunk=3, keep_logits=True)
    assert torch.equal(got, want.long())
    assert (logits - want_logits).abs().max() < 1e-4
    decoded = teacher_forced_logits(llama, policy, ids[:1], layout=LAYOUT, prefill=LAYOUT.budget)
    assert (decoded - logits[:1]).abs().max() < 1e-4
    free, _ = pool_chunked(llama, policy.with_floor(0), ids, layout=LAYOUT)
    assert not torch.equal(got, free)  # the floor changed the pattern: the test says something
    with pytest.raises(ValueError, match=r"runs with long_range 5 and floor [23], the layout has 5 and 0"):
        pool_chunked(llama, policy, ids, layout=LAYOUT)
    assert held_per_pair(got, 70).min() >= policy.pool_floor


@pytest.fixture(scope="module")
def llama(tiny_model):
    from kvpop.decode import enable

    return enable(tiny_model("llama"))


def test_a_floor_twin_shares_the_weights_and_names_its_row(llama):
    base = OnePool(scorer(seed=2))
    twin = floor_twin(Candidate("kvpop_mlp, one pool", llama, base), 3)
    assert twin.name == "kvpop_mlp, one pool, floor 3" and ranked_policy(twin.name) == "kvpop_mlp"
    assert ranked_policy("kvpop_mlp_pool, floor 12") == "kvpop_mlp_pool" and ranked_policy("kvpop_mlp_pool") == "kvpop_mlp_pool"
    assert twin.policy.pool_floor == 3 and base.pool_floor == 0
    assert next(twin.policy.parameters()) is next(base.parameters())
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(4))
    recs = [{"input_ids": r.tolist(), "loss_mask": [0] + [1] * 69} for r in ids]
    res = evaluate_fidelity(recs, llama, [Candidate("pool", llama, base), twin], layout=LAYOUT)
    assert res[twin.name]["kl"] != pytest.approx(res["pool"]["kl"], rel=1e-3)
    occupancy = torch.tensor(res[twin.name]["occupancy_map"])  # (L, Hk) entries held over the budget
    assert occupancy.min() * LAYOUT.budget >= SINKS + WINDOW + 3 - 1e-6


def test_what_refuses_a_floor_names_it(llama):
    with pytest.raises(ValueError, match="keeps k per head"):
        make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16).with_floor(2)
    with pytest.raises(ValueError, match=">= 0"):
        dbtrimkv().with_floor(-1)
    with pytest.raises(ValueError, match="floor of 9 long-range entries, more than its 5"):
        LAYOUT.for_policy(dbtrimkv().with_floor(9), head_dim=16)
    with pytest.raises(ValueError, match="floor"):
        CacheLayout(LAYOUT.budget, SINKS, WINDOW, floor=K + 1)
    assert "per-head floor (3)" in engine_refusal(llama, dbtrimkv().with_floor(3))
    assert engine_refusal(llama, dbtrimkv()) is None
    with pytest.raises(ValueError, match=r"floor must be in \[0, long_range = 5\]"):
        global_eviction_times(torch.zeros(1, 1, 1, 20), torch.zeros(1, 20, dtype=torch.long), torch.arange(20)[None], sinks=2, window=6,
                              long_range=5, floor=6)


def test_params_check_the_floors():
    base = {"train": {"policies": ["kvpop_mlp_pool"]}}
    assert Params.model_validate({**base, "evaluate": {"pool_floors": [8, 32]}}).evaluate.pool_floors == [8, 32]
    k = Params().budget - Params().sinks - Params().window
    with pytest.raises(ValueError, match=rf"pool_floors \[{k + 1}\].*\[1, budget - sinks - window = {k}\]"):
        Params.model_validate({**base, "evaluate": {"pool_floors": [k + 1]}})
    with pytest.raises(ValueError, match="names a floor twice"):
        Params.model_validate({**base, "evaluate": {"pool_floors": [4, 4]}})
    with pytest.raises(ValueError, match="neither train.policies nor evaluate.policies"):
        Params.model_validate({"train": {"policies": ["kvpop"]}, "evaluate": {"pool_floors": [4]}})


# --- the pool's boundary labels under a floor (training as it runs) ---------------------------------------
def brute_floored_labels(prio, S, layout):
    """Every decision literally, one document: at query q = j + window each pair's leaver j meets its pair's best
    ``f`` (key ("own", pair, j): kept iff among them, competitor the f-th best without it); an entry its pair's best
    ``f`` drops then joins the shared places (key ("shared", pair, token): kept iff among the best M of every entry
    that has joined by q, competitor the M-th best of them without it). Order: priority desc, token desc, pair asc."""
    Fp, f = prio.shape[0], layout.floor
    M = Fp * (layout.long_range - f)
    rank = lambda e: (-float(prio[e[0], e[1]]), -e[1], e[0])  # noqa: E731
    out, best, joined = {}, {p: [] for p in range(Fp)}, []
    for j in range(layout.sinks, S - layout.window):
        now = []
        for p in range(Fp):
            cand = sorted(best[p] + [(p, j)], key=rank)
            if len(cand) > f:
                rest = [e for e in cand if e != (p, j)]
                out[("own", p, j)] = (1.0 if cand.index((p, j)) < f else -1.0, rest[f - 1])
            best[p], dropped = cand[:f], cand[f:]
            now += dropped
        joined += now
        if M and len(joined) > M:
            order = sorted(joined, key=rank)
            for x in now:
                rest = [e for e in order if e != x]
                out[("shared", *x)] = (1.0 if order.index(x) < M else -1.0, rest[M - 1])
    return out


@pytest.mark.parametrize("levels", [None, 3])
@pytest.mark.parametrize("floor", [1, 2, 3])
def test_floored_pool_labels_are_the_literal_competitions(levels, floor):
    layout = CacheLayout(2 + 4 + 3, 2, 4, floor=floor)  # k = 3
    S, Fp = 34, 4
    g = torch.Generator().manual_seed(40 + floor)
    prio = torch.randn(Fp, S, generator=g, dtype=torch.float64) if levels is None else torch.randint(0, levels, (Fp, S), generator=g).double()
    pos = torch.arange(S)[None]
    lab = pool_boundary_labels(prio[None], torch.zeros_like(pos), pos, layout=layout)
    want = brute_floored_labels(prio, S, layout)
    got = {}
    for p, j, y, bp, bt in zip(lab.pair.tolist(), lab.t_new.tolist(), lab.y.tolist(), lab.bnd_pair.tolist(), lab.t_bnd.tolist(), strict=True):
        kind = "own" if (("own", p, j) in want and ("own", p, j) not in got) else "shared"
        got[(kind, p, j)] = (y, (bp, bt))
    shared = sum(key[0] == "shared" for key in want)
    assert got == want and (shared > 10 if floor < 3 else shared == 0)  # floor = k: the per-head labels alone


def test_floored_pool_labels_agree_with_the_floored_simulation():
    """Packed rows: a shared-place entry the teacher keeps survives the query it joins at in the simulation with the floor."""
    L, Hk, S = 2, 2, 80
    layout = CacheLayout(2 + 5 + 4, 2, 5, floor=2)
    g = torch.Generator().manual_seed(44)
    doc, pos = random_packing(1, S, [30, 50], 4, g)
    prio = torch.randn(L, 1, Hk, S, generator=g, dtype=torch.float64)
    e = global_eviction_times(prio, doc, pos, sinks=2, window=5, long_range=4, floor=2).long().permute(1, 0, 2, 3).reshape(L * Hk, S)
    own = eviction_times(prio.permute(1, 0, 2, 3).reshape(1, L * Hk, S), doc, pos, sinks=2, window=5, long_range=2).long()[0]  # per pair, k = f
    flat = prio.permute(1, 0, 2, 3).reshape(1, L * Hk, S)
    lab = pool_boundary_labels(flat, doc, pos, layout=layout)
    n_own = priority_labels(flat, doc, pos, sinks=2, window=5, k=2).y.numel()  # the pairs' own decisions come first
    pair, t, y = lab.pair[n_own:], lab.t_new[n_own:], lab.y[n_own:]
    survives = e[pair, t] > own[pair, t]  # still held after the query it joined at
    assert torch.equal(survives, y > 0) and bool((y > 0).any()) and bool((y < 0).any())


def test_kvpop_mlp_pool_trains_exports_and_loads_with_its_floor(tiny_tokenizer, tmp_path):
    """train.pool_floor: the training forward runs under the floored pool's times (pool_chunked with the floor), the scorer
    learns from both competitions' decisions, and the export keeps the floor, which the loaded policy runs with."""
    from kvpop.config import TrainConfig
    from kvpop.export import export, load_export, read_meta
    from kvpop.train import PackedDataset, build_training
    from test_train import tiny_pair

    from conftest import packed_toy

    teacher, _ = tiny_pair()
    ids, doc, pos = packed_toy(4, 64)
    cfg = TrainConfig(steps=2, batch_size=2, top_logits=16, model_lr=1e-3, target="max", boundary_weight="uniform", pool_floor=2,
                      precision="32-true", accelerator="cpu")
    training = build_training(teacher, "kvpop_mlp_pool", PackedDataset(ids, doc, pos, (doc >= 0).long()), cfg=cfg, layout=LAYOUT, seed=0)
    assert training.policy.pool_floor == 2 and training.module.s.layout.floor == 2
    trainer = training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    m = trainer.callback_metrics
    assert trainer.global_step == 2 and torch.isfinite(m["train/score_loss"]) and m["train/decisions"] > 0
    out = tmp_path / "export"
    export(training.student, tiny_tokenizer, training.policy, out, layout=LAYOUT)
    assert read_meta(out)["pool_floor"] == 2
    _, _, policy, _ = load_export(out)
    assert policy.pool_floor == 2 and LAYOUT.for_policy(policy, head_dim=16).floor == 2


def test_params_take_a_training_floor_only_where_the_pool_trains_with_it():
    ok = Params.model_validate({"train": {"policies": ["kvpop_mlp_pool", "kvpop"], "per_policy": {"kvpop_mlp_pool": {"pool_floor": 16}}}})
    assert ok.train.for_policy("kvpop_mlp_pool").pool_floor == 16 and ok.train.for_policy("kvpop").pool_floor == 0
    with pytest.raises(ValueError, match="for kvpop: .*keeps k long-range slots per head"):
        Params.model_validate({"train": {"policies": ["kvpop_mlp_pool", "kvpop"], "pool_floor": 16}})
    with pytest.raises(ValueError, match="for dbtrimkv: .*gate learns through a relaxation"):
        Params.model_validate({"train": {"policies": ["dbtrimkv"], "per_policy": {"dbtrimkv": {"pool_floor": 16}}}})
    with pytest.raises(ValueError, match="more than the budget's"):
        Params.model_validate({"train": {"policies": ["kvpop_mlp_pool"], "per_policy": {"kvpop_mlp_pool": {"pool_floor": 10_000}}}})


def test_a_per_policy_scorer_width_trains_exports_and_loads(tiny_tokenizer, tmp_path):
    """train.per_policy.<name>.scorer_hidden: the one policy gets its own MLP width (the others keep train.scorer_hidden),
    the params check builds it at that width, and the export reloads it at that width."""
    from kvpop.export import export, load_export
    from kvpop.train import PackedDataset, build_training
    from test_train import tiny_pair

    from conftest import packed_toy

    p = Params.model_validate({"train": {"policies": ["kvpop_mlp_pool", "kvpop_mlp"], "scorer_hidden": 8,
                                         "per_policy": {"kvpop_mlp_pool": {"scorer_hidden": 24}}}})
    assert p.train.for_policy("kvpop_mlp_pool").scorer_hidden == 24 and p.train.for_policy("kvpop_mlp").scorer_hidden == 8
    cfg = p.train.for_policy("kvpop_mlp_pool").model_copy(update=dict(steps=1, batch_size=2, top_logits=16, precision="32-true", accelerator="cpu"))
    teacher, _ = tiny_pair()
    ids, doc, pos = packed_toy(2, 64)
    training = build_training(teacher, "kvpop_mlp_pool", PackedDataset(ids, doc, pos, (doc >= 0).long()), cfg=cfg, layout=LAYOUT, seed=0)
    widths = {layer.w2.shape[-1] for layer in training.policy.scorer.layers}
    assert widths == {24}
    training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    export(training.student, tiny_tokenizer, training.policy, tmp_path / "export", layout=LAYOUT)
    _, _, policy, _ = load_export(tmp_path / "export")
    assert {layer.w2.shape[-1] for layer in policy.scorer.layers} == {24}
