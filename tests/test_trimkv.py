"""trimkv (kvpop.policies.trimkv): the decaying cache's simulation against a literal one, beta = 1,
the executors' age-scaled bias, the capacity loss, decoding, and which parameters train.

Twins: :func:`kvpop.selection.decaying_eviction_times` against a plain-Python run of the rule;
the full-sequence pattern against token-by-token decoding with the reference cache; the FlexAttention
score_mod against the SDPA float mask; the capacity loss against a loop.
"""

import copy
import math

import pytest
import torch

from kvpop.attention import GateTraining, SparseContext
from kvpop.decode import enable, teacher_forced_logits
from kvpop.decode.engine import engine_refusal
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.policies.trimkv import capacity_loss
from kvpop.selection import NEVER, decaying_eviction_times, document_spans, eviction_times
from test_selection import random_packing
from test_train import tiny_pair

from conftest import packed_toy

SINKS, WINDOW, K = 2, 6, 5
LAYOUT = CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=K)


def literal_eviction_times(log_beta, doc_ids, pos, sinks, window, k):
    """The rule run literally, one (row, head) at a time with Python lists."""
    B, Hk, S = log_beta.shape
    e = torch.full((B, Hk, S), NEVER, dtype=torch.int64)
    for b in range(B):
        for h in range(Hk):
            lb = log_beta[b, h].double().tolist()
            slots: list[int] = []
            for q in range(S):
                if pos[b, q] == 0:
                    slots = []
                j = q - window
                if j < 0 or doc_ids[b, q] < 0 or doc_ids[b, j] != doc_ids[b, q] or pos[b, j] < sinks:
                    continue
                if len(slots) < k:
                    slots.append(j)
                    continue
                if k == 0:
                    e[b, h, j] = q
                    continue
                score = {t: (q - t) * lb[t] for t in slots}
                low = min(score.values())
                victim = min(t for t in slots if score[t] == low)  # the oldest among the lowest
                if window * lb[j] >= low:  # the leaver is the newest: it wins ties
                    slots.remove(victim)
                    slots.append(j)
                    e[b, h, victim] = q
                else:
                    e[b, h, j] = q
    return e


@pytest.mark.parametrize("case", [(97, 2, 4, 3, None), (120, 0, 1, 2, 3), (64, 1, 3, 0, None), (150, 3, 5, 6, 2)])
def test_decaying_eviction_times_match_the_literal_rule(case):
    S, sinks, window, k, levels = case
    g = torch.Generator().manual_seed(S)
    doc_ids, pos = random_packing(2, S, [10, 40, S], 7, g)
    if levels is None:
        log_beta = -torch.rand(2, 3, S, generator=g, dtype=torch.float64) * 0.2
    else:  # few levels: exact ties of age x rate
        log_beta = -torch.randint(1, levels + 1, (2, 3, S), generator=g).double() * 0.05
    got = decaying_eviction_times(log_beta, doc_ids, pos, sinks=sinks, window=window, long_range=k)
    assert torch.equal(got.long(), literal_eviction_times(log_beta, doc_ids, pos, sinks, window, k))


def test_capabilities_and_parameter_count():
    p = make_policy("trimkv", num_layers=30, num_kv_heads=3, head_dim=64, scorer_hidden=64)
    assert sum(x.numel() for x in p.parameters()) == 30 * 3 * (2 * 64 * 64 + 2 * 64 + 1) == 748_890  # in the docstring and README
    assert (p.gated, p.decays, p.trains_model, make_policy("trimkv_joint", num_layers=1, num_kv_heads=1, head_dim=4).trains_model) == (
        True, True, False, True)


def test_equal_retention_is_recency():
    """With one beta for every token the oldest always scores lowest: the streaming_llm pattern."""
    _, doc, pos = packed_toy(2, 80, seed=2)
    lb = torch.full((2, 3, 80), -0.01, dtype=torch.float64)
    recency = eviction_times(pos[:, None].expand(2, 3, 80).double(), doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    got = decaying_eviction_times(lb, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    _, end = document_spans(doc)  # a time past the document's end means the same as never
    assert torch.equal(torch.minimum(got, end[:, None].int()), torch.minimum(recency, end[:, None].int()))
    assert (got < end[:, None]).any()


def random_gate(name="trimkv", seed=0):
    torch.manual_seed(seed)
    policy = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for mlp in policy.scorer.layers:  # retention rates that differ per token: log beta in about -1.5 .. -0.005
        torch.nn.init.normal_(mlp.w2, std=0.5)
        mlp.b2.data.fill_(2.0)
    return policy


@pytest.mark.parametrize("name", ["trimkv", "dbtrimkv"])
def test_beta_one_is_standard_attention(name):
    """The untrained gate (beta = 0.99995) and, in the limit, beta = 1: the training forward is dense
    (for the one pool of dbtrimkv too: its training has the same retention bias and no eviction)."""
    from test_dbtrimkv import random_gate as one_pool_gate

    _, student = tiny_pair()
    ids, doc, pos = packed_toy(2, 64)
    policy = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    plain = SparseContext.for_rows(make_policy("dense"), doc, pos, layout=LAYOUT)
    with torch.no_grad():
        dense = student(input_ids=ids, position_ids=pos, kvpop_ctx=plain).logits
    diffs = []
    for b2 in (10.0, 40.0):
        for key, param in policy.scorer.named_parameters():  # the output bias: one per head (trimkv) or one tied (dbtrimkv)
            if key.endswith("b2"):
                param.data.fill_(b2)
        ctx = SparseContext.for_rows(policy, doc, pos, layout=LAYOUT, gate_training=GateTraining())
        diffs.append((student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits - dense).abs().max().item())
    assert diffs[1] < 1e-6 and diffs[0] < 1e-2
    gated = random_gate() if name == "trimkv" else one_pool_gate()
    ctx = SparseContext.for_rows(gated, doc, pos, layout=LAYOUT, gate_training=GateTraining())
    out = student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    assert (out - dense).abs().max() > 1e-2  # a real decay changes the output
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gated.parameters() if p.requires_grad)


def test_flex_age_scaled_bias_equals_the_sdpa_mask():
    g = torch.Generator().manual_seed(2)
    B, H, Hk, S, D = 2, 4, 2, 64, 16
    q, k, v = (torch.randn(B, n, S, D, generator=g) for n in (H, Hk, Hk))
    _, doc, pos = packed_toy(B, S, seed=3)
    bias = -torch.rand(B, Hk, S, generator=g) * 0.3
    never = torch.full((B, Hk, S), NEVER, dtype=torch.int64)
    outs = {}
    for executor in ("sdpa", "flex"):
        ctx = SparseContext.for_rows(make_policy("streaming_llm"), doc, pos, layout=LAYOUT, executor=executor)
        outs[executor] = ctx.run(q, k, v, never, 0.25, False, layer_key=0, gate_bias=bias, age_scaled=True)[0]
    real = (doc >= 0)[:, None, :, None]
    assert ((outs["flex"] - outs["sdpa"]).abs() * real).max() < 1e-5
    once = SparseContext.for_rows(make_policy("streaming_llm"), doc, pos, layout=LAYOUT).run(
        q, k, v, never, 0.25, False, 0, gate_bias=bias)[0]
    assert ((once - outs["sdpa"]).abs() * real).max() > 1e-2  # the age matters


def test_capacity_loss_matches_a_loop_and_pushes_retention_down():
    g = torch.Generator().manual_seed(4)
    _, doc, pos = packed_toy(2, 40, seed=5)
    lb = (-torch.rand(2, 3, 40, generator=g, dtype=torch.float64) * 0.05).requires_grad_(True)
    k = 3
    got = capacity_loss(lb, doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k), chunk=7)
    total, n = 0.0, 0
    for b in range(2):
        for h in range(3):
            for t in range(40):
                if doc[b, t] < 0:
                    continue
                n += 1
                mass = sum(math.exp((t - i) * lb[b, h, i].item()) for i in range(t + 1)
                           if t - i >= WINDOW and doc[b, i] == doc[b, t] and pos[b, i] >= SINKS)
                total += max(0.0, mass - k) / k
    assert math.isclose(got.item(), total / n, rel_tol=1e-9)
    got.backward()
    assert (lb.grad >= 0).all() and lb.grad.sum() > 0  # more retention (log beta up) costs more
    steep = torch.full((2, 3, 40), -30.0, dtype=torch.float32, requires_grad=True)  # future keys' terms would overflow
    capacity_loss(steep, doc, pos, layout=CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=k)).backward()
    assert torch.isfinite(steep.grad).all()


@pytest.mark.parametrize("prefill", [1, 30])
def test_decoding_equals_the_full_sequence_pattern(tiny_model, prefill):
    model = enable(tiny_model("llama"))
    policy = random_gate(seed=1)
    ids = torch.randint(0, 96, (2, 80), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(80).expand(2, 80)
    ctx = SparseContext.for_rows(policy, torch.zeros_like(pos), pos, layout=LAYOUT)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    got = teacher_forced_logits(model, policy, ids, layout=CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW), prefill=prefill)
    assert (got - ref).abs().max() < 1e-4
    recency = SparseContext.for_rows(make_policy("streaming_llm"), torch.zeros_like(pos), pos, layout=LAYOUT)
    with torch.no_grad():
        assert (model(input_ids=ids, position_ids=pos, kvpop_ctx=recency).logits - ref).abs().max() > 1e-3  # not recency
    assert "BoundedCache" in engine_refusal(model, policy)


@pytest.mark.parametrize("name", ["trimkv", "trimkv_joint"])
def test_training_updates_the_gate_and_only_the_joint_student(name, tmp_path):
    from kvpop.config import TrainConfig
    from kvpop.train import PackedDataset, build_training

    teacher, _ = tiny_pair()
    ids, doc, pos = packed_toy(4, 64)
    cfg = TrainConfig(steps=2, batch_size=2, top_logits=16, scorer_hidden=8, model_lr=1e-3, precision="32-true", accelerator="cpu")
    training = build_training(teacher, name, PackedDataset(ids, doc, pos, (doc >= 0).long()), cfg=cfg, layout=CacheLayout(13, SINKS, WINDOW), seed=0)
    before = copy.deepcopy(training.student.state_dict())
    gate_before = copy.deepcopy(training.policy.state_dict())
    trainer = training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    moved = any(not torch.equal(before[k], v) for k, v in training.student.state_dict().items())
    assert moved == (name == "trimkv_joint")  # TrimKV freezes the base model
    assert any(not torch.equal(gate_before[k], v) for k, v in training.policy.state_dict().items())
    m = trainer.callback_metrics
    assert "train/capacity_loss" in m and 0 < float(m["train/beta_mean"]) <= 1 and "train/score_loss" not in m
