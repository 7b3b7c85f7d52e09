"""dms (kvpop.policies.dms): the relaxed gate's limits, its executors, the budget's eviction ratio,
the compression loss, and the policy through export and decoding.

Twins: the straight-through training forward against the hard pattern that evaluation and both
decode caches run (tests/test_cache.py and tests/test_engine.py run dms through the bounded cache
and the engine); the relaxation at tau -> 0 against the hard gate; the FlexAttention score_mod
against the SDPA float mask; the budget ratio and leaving tokens against plain loops.
"""

import math

import pytest
import torch

from kvpop.attention import GateTraining, SparseContext, gate_bias_mask, sdpa_execute
from kvpop.geometry import CacheLayout
from kvpop.masks import dense_mask, make_eviction_mask_mod
from kvpop.policies import make_policy
from kvpop.policies.dms import EVICTED_BIAS, budget_evict_ratio, compression_loss, gate_priority, leaving_tokens, ramp_factor
from kvpop.selection import eviction_times
from test_train import tiny_pair

from conftest import packed_toy

SINKS, WINDOW, K = 2, 6, 5
LAYOUT = CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=K)


def random_gate(seed: int = 0):
    """A dms policy whose gate evicts some tokens and keeps others (the trained gate starts at w = 0)."""
    torch.manual_seed(seed)
    policy = make_policy("dms", num_layers=2, num_kv_heads=2, head_dim=16)
    for p in policy.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return policy


def forward(student, policy, ids, doc, pos, gate_training=None):
    ctx = SparseContext.for_rows(policy, doc, pos, layout=LAYOUT, gate_training=gate_training)
    return student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits, ctx


def test_capabilities_and_parameter_count():
    p = make_policy("dms", num_layers=30, num_kv_heads=3, head_dim=64)
    assert (p.learned, p.trained, p.gated, p.layer_independent, p.scores_on_exit) == (True, True, True, False, False)
    assert sum(x.numel() for x in p.parameters()) == 30 * 3 * (2 * 64 + 1) == 11_610  # stated in the module docstring
    q = make_policy("dms", num_layers=36, num_kv_heads=8, head_dim=128)
    assert sum(x.numel() for x in q.parameters()) == 74_016
    assert not make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16).gated


def test_untrained_gate_keeps_everything_and_ranks_by_recency():
    """w = 0, b < 0: no token is gated out, all priorities tie, so the pattern is streaming_llm's."""
    p = make_policy("dms", num_layers=2, num_kv_heads=2, head_dim=16)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    pos = torch.arange(40)[None]
    prio = p.scores(0, k, v, pos).prio
    assert torch.isfinite(prio).all() and (prio == prio[0, 0, 0]).all()
    doc = torch.zeros_like(pos)
    recency = eviction_times(pos[:, None].expand(1, 2, 40).double(), doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    assert torch.equal(eviction_times(prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K), recency)


def test_straight_through_training_forward_equals_the_hard_pattern():
    """Without noise, the training forward (relaxed gate, straight-through) gives exactly the logits of
    the hard pattern that evaluation and decoding run; the KL's gradient reaches the gate."""
    _, student = tiny_pair()
    ids, doc, pos = packed_toy(2, 64)
    policy = random_gate()
    got, ctx = forward(student, policy, ids, doc, pos, GateTraining(noise=False))
    with torch.no_grad():
        ref, _ = forward(student, policy, ids, doc, pos)
        dense, _ = forward(student, make_policy("dense"), ids, doc, pos)
    assert (got - ref).abs().max() < 1e-5
    assert (ref - dense).abs().max() > 1e-2  # the gate evicts something
    assert len(ctx.gate_relaxations) == 2 and ctx.losses == []  # no boundary loss
    got.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    # with noise the decisions move: another pattern
    noisy, _ = forward(student, policy, ids, doc, pos, GateTraining(noise=True, generator=torch.Generator().manual_seed(0)))
    assert (noisy - ref).abs().max() > 1e-3


def relaxed_attention(q, k, v, x, pos, tau):
    """Attention with the *soft* relaxed mask log(1 - sigmoid(x / tau)) on tokens past the window, under
    the training pattern's cap (the relaxation's finite priorities -x)."""
    doc = torch.zeros_like(pos)
    B, H, S, _ = q.shape
    evict = eviction_times((-x).double(), doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    allowed = dense_mask(make_eviction_mask_mod(doc, pos, evict, sinks=SINKS, group=H // k.shape[1]), B, H, S, "cpu")
    soft = torch.nn.functional.logsigmoid(-x / tau)
    return sdpa_execute(q, k, v, gate_bias_mask(allowed, soft, pos, sinks=SINKS, window=WINDOW), 0.25, False)[0]


def test_temperature_to_zero_gives_the_hard_gate():
    g = torch.Generator().manual_seed(1)
    B, H, Hk, S, D = 2, 4, 2, 48, 16
    q, k, v = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64) for n in (H, Hk, Hk))
    x = torch.randn(B, Hk, S, generator=g, dtype=torch.float64)
    x = torch.where(x.abs() < 0.05, 0.05 * x.sign(), x)  # no logit at the boundary itself
    pos = torch.arange(S)[None].expand(B, S)
    doc = torch.zeros_like(pos)
    evict = eviction_times(gate_priority(x), doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    hard = sdpa_execute(q, k, v, dense_mask(make_eviction_mask_mod(doc, pos, evict, sinks=SINKS, group=H // Hk), B, H, S, "cpu"), 0.25, False)[0]
    errs = [(relaxed_attention(q, k, v, x, pos, tau) - hard).abs().max().item() for tau in (1.0, 0.1, 0.01, 0.001)]
    assert errs[0] > 1e-2 and errs[-1] < 1e-6
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False))
    # the relaxation's eviction probabilities become the hard decisions
    relax = make_policy("dms", num_layers=1, num_kv_heads=Hk, head_dim=D).relax(x, tau=1e-4, noise=False)
    assert torch.equal(relax.evict_prob > 0.5, x > 0) and ((relax.evict_prob - (x > 0).double()).abs() < 1e-12).all()
    assert torch.equal(relax.bias, torch.where(x > 0, EVICTED_BIAS, 0.0).to(x.dtype))  # forward: hard


def test_flex_gate_bias_equals_the_sdpa_mask():
    """The FlexAttention executor (eager on CPU, forward) adds the same bias as the SDPA float mask."""
    g = torch.Generator().manual_seed(2)
    B, H, Hk, S, D = 2, 4, 2, 64, 16
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (H, Hk, Hk))
    _, doc, pos = packed_toy(B, S, seed=3)
    bias = torch.randn(B, Hk, S, generator=g) * 3
    evict = eviction_times(torch.randn(B, Hk, S, generator=g), doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    outs = {}
    for executor in ("sdpa", "flex"):
        ctx = SparseContext.for_rows(make_policy("streaming_llm"), doc, pos, layout=LAYOUT, executor=executor)
        outs[executor] = ctx.run(q, k, v, evict, 0.25, False, layer_key=0, gate_bias=bias)[0]
    real = (doc >= 0)[:, None, :, None]
    assert ((outs["flex"] - outs["sdpa"]).abs() * real).max() < 1e-5
    plain = SparseContext.for_rows(make_policy("streaming_llm"), doc, pos, layout=LAYOUT).run(q, k, v, evict, 0.25, False, 0)[0]
    assert ((plain - outs["sdpa"]).abs() * real).max() > 1e-2


def test_gate_bias_applies_past_the_window_to_non_sinks_only():
    S = 12
    pos = torch.arange(S)[None]
    allowed = torch.ones(1, 2, S, S, dtype=torch.bool).tril()
    m = gate_bias_mask(allowed, torch.full((1, 1, S), -3.0), pos, sinks=SINKS, window=WINDOW)
    for qi in range(S):
        for kv in range(S):
            want = float("-inf") if kv > qi else (-3.0 if qi - kv >= WINDOW and kv >= SINKS else 0.0)
            assert m[0, 1, qi, kv].item() == want, (qi, kv)


def test_leaving_tokens_and_the_budget_ratio_match_loops():
    _, doc, pos = packed_toy(3, 90, seed=4)
    leaves = leaving_tokens(doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=0))
    counts = []
    for b in range(3):
        for d in sorted(set(doc[b].tolist()) - {-1}):
            idx = (doc[b] == d).nonzero().squeeze(-1).tolist()
            want = [i for i in idx if pos[b, i] >= SINKS and i + WINDOW <= idx[-1]]
            assert leaves[b, idx].nonzero().squeeze(-1).add(idx[0]).tolist() == want
            counts.append(len(want))
        assert not leaves[b, doc[b] < 0].any()
    for k in (0, 3, 10, 1000):
        want = 1 - sum(min(k, n) for n in counts) / sum(counts)
        assert math.isclose(budget_evict_ratio(doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)), want)
    assert budget_evict_ratio(doc, pos, layout=CacheLayout.of(sinks=SINKS, window=10**6, long_range=3)) == 0.0  # nothing leaves


def test_compression_loss_is_one_sided_and_pushes_toward_eviction():
    leaves = torch.tensor([[False, True, True, True]])
    b = torch.zeros(1, requires_grad=True)
    probs = [torch.sigmoid(b + torch.tensor([[[9.0, 0.0, 1.0, -1.0]]])) for _ in range(2)]  # (1, Hk=1, 4) per layer
    loss, evicted = compression_loss(probs, leaves, target=0.9)
    assert math.isclose(evicted.item(), torch.sigmoid(torch.tensor([0.0, 1.0, -1.0])).mean().item(), rel_tol=1e-6)  # not token 0
    loss.backward()
    assert loss > 0 and b.grad < 0  # raising the logits (evicting more) lowers the loss
    low, _ = compression_loss([p.detach() for p in probs], leaves, target=0.1)
    assert low == 0  # already evicting more than the target: no pull back
    assert [ramp_factor(p, 0.5) for p in (0, 0.25, 0.5, 0.8)] == [0.0, 0.5, 1.0, 1.0] and ramp_factor(0, 0.0) == 1.0


def test_export_round_trip_and_decode(tmp_path, tiny_tokenizer):
    from kvpop.decode import teacher_forced_logits
    from kvpop.export import export, load_export

    _, student = tiny_pair()
    policy = random_gate(5)
    export(student, tiny_tokenizer, policy, tmp_path / "exp", layout=CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW))
    model, _, loaded, meta = load_export(tmp_path / "exp")
    assert loaded.name == "dms" and meta["scorer"]["kind"] == "gate"
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), loaded.state_dict().values(), strict=True))
    from kvpop.decode import enable

    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(50)[None]
    with torch.no_grad():
        ref, _ = forward(model, loaded, ids, torch.zeros_like(pos), pos)
    got = teacher_forced_logits(enable(model), loaded, ids, layout=CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW), prefill=1)
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("bad", [{"gate_tau": 0}, {"compression_ramp": 1.5}, {"compression_weight": -1}])
def test_bad_gate_settings_name_the_key(bad):
    from pydantic import ValidationError

    from kvpop.config import TrainConfig

    with pytest.raises(ValidationError, match=next(iter(bad))):
        TrainConfig(**bad)


def test_evaluation_reports_occupancy(tiny_model):
    """occupancy: 1 for a top-k rule (and an attention rule) on a trace longer than its budget, below 1
    for a gate that evicts more than the budget needs, S / budget for dense."""
    from kvpop.attention import register
    from kvpop.evaluate import Candidate, evaluate_fidelity

    model = tiny_model(attn_implementation=register())
    rec = {"input_ids": torch.randint(0, model.config.vocab_size, (60,)).tolist(), "loss_mask": [1] * 60}
    evicting = make_policy("dms", num_layers=2, num_kv_heads=2, head_dim=16)
    with torch.no_grad():
        evicting.scorer.b.fill_(5.0)  # every token gated out: only sinks and the window stay
    keeping = make_policy("dms", num_layers=2, num_kv_heads=2, head_dim=16)  # the untrained gate keeps all: capped at k
    cands = [Candidate(n, model, p) for n, p in (("dense", make_policy("dense")), ("h2o", make_policy("h2o")),
                                                 ("streaming_llm", make_policy("streaming_llm")), ("gate_out", evicting), ("gate_in", keeping))]
    budget = SINKS + WINDOW + K
    res = evaluate_fidelity([rec], model, cands, layout=CacheLayout(budget, SINKS, WINDOW))
    assert res["dense"]["occupancy"] == pytest.approx(60 / budget)
    assert res["streaming_llm"]["occupancy"] == res["gate_in"]["occupancy"] == res["h2o"]["occupancy"] == 1.0
    assert res["gate_out"]["occupancy"] == pytest.approx((SINKS + WINDOW) / budget)
