"""KL distillation and the scorer loss: values, gradient isolation, one Lightning step."""

import copy
import math

import pytest
import torch

from kvpop.attention import ScorerTraining, SparseContext, register
from kvpop.geometry import CacheLayout
from kvpop.modeling import tiny_config
from kvpop.policies import make_policy
from kvpop.target import TargetSpec
from kvpop.train import DistillModule, PackedDataset, TrainSettings, make_loader, prediction_mask, teacher_topk, topk_kl

from conftest import packed_toy


def tiny_pair():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg._attn_implementation = register()
    teacher = AutoModelForCausalLM.from_config(cfg)
    return teacher, copy.deepcopy(teacher)


def test_topk_kl_equals_full_kl_when_k_is_vocab():
    g = torch.Generator().manual_seed(0)
    t, s = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    vals, idx = teacher_topk(t, 11)
    mask = torch.ones(2, 5)
    full = torch.nn.functional.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    assert torch.allclose(topk_kl(s, vals, idx, mask), full, atol=1e-6)
    assert topk_kl(t, vals, idx, mask).abs() < 1e-6


@pytest.mark.parametrize("k", [1, 4, 16])
def test_topk_kl_is_the_kl_over_the_top_k_and_the_rest(k):
    """K < V: zero for a student equal to the teacher (distillation of a model toward itself moves nothing), and
    otherwise the KL of both distributions coarsened to the K tokens plus one outcome for the rest, computed
    here from the full softmaxes."""
    g = torch.Generator().manual_seed(k)
    t, s = 3 * torch.randn(2, 6, 40, generator=g), 3 * torch.randn(2, 6, 40, generator=g)
    logp, idx = teacher_topk(t, k)
    mask = torch.ones(2, 6)
    assert topk_kl(t, logp, idx, mask).abs() < 1e-5
    assert topk_kl(t + 5.0, logp, idx, mask).abs() < 1e-5  # logits are shift-invariant
    pt, ps = t.double().softmax(-1), s.double().softmax(-1)
    ct = torch.cat([pt.gather(-1, idx), 1 - pt.gather(-1, idx).sum(-1, keepdim=True)], -1)  # (B, S, K + 1)
    cs = torch.cat([ps.gather(-1, idx), 1 - ps.gather(-1, idx).sum(-1, keepdim=True)], -1)
    want = (ct * (ct.log() - cs.log())).sum(-1).mean()
    assert torch.allclose(topk_kl(s, logp, idx, mask).double(), want, rtol=1e-4, atol=1e-6)


def test_topk_kl_refuses_logits_in_place_of_log_probabilities():
    t = torch.randn(1, 3, 20) + 4.0
    vals, idx = t.topk(5, -1)
    with pytest.raises(ValueError, match="log-probabilities"):
        topk_kl(torch.randn(1, 3, 20), vals, idx, torch.ones(1, 3))


def test_prediction_mask_stops_at_document_ends():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    lm = torch.tensor([[0, 1, 1, 0, 1, 0]])
    assert prediction_mask(lm, doc).tolist() == [[True, True, False, True, False, False]]


def test_gradients_are_isolated():
    """L_score leaves every model parameter without gradient; KL leaves every scorer parameter without."""
    teacher, student = tiny_pair()
    ids, doc, pos = packed_toy(2, 64)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for layer in policy.scorer.layers:  # a scorer past its zero-initialized start
        torch.nn.init.normal_(layer.w2)
    ctx = SparseContext.for_rows(policy, doc, pos, layout=CacheLayout(13, 2, 6), scorer_training=ScorerTraining())
    logits = student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    assert len(ctx.losses) == 2  # one boundary loss per layer
    torch.stack(ctx.losses).mean().backward(retain_graph=True)
    assert all(p.grad is None for p in student.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.parameters())
    policy.zero_grad(set_to_none=True)
    with torch.no_grad():
        ctx = SparseContext.for_rows(make_policy("dense"), doc, pos, layout=CacheLayout(13, 2, 6))
        vals, idx = teacher_topk(teacher(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits, 16)
    topk_kl(logits, vals, idx, torch.ones(2, 64)).backward()
    assert all(p.grad is None for p in policy.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())


@pytest.mark.parametrize("policy_name, model_lr", [("streaming_llm_plus", 1e-3), ("kvpop_mlp", 1e-3), ("kvpop_mlp_pool", 1e-3), ("kvpop_mlp_pool", 0.0)])
def test_lightning_fit_updates_the_right_parameters(policy_name, model_lr, tmp_path):
    """The scorer learns; the student learns unless model_lr is 0 (the frozen model: the scorer alone); the teacher never."""
    import lightning as L

    teacher, student = tiny_pair()
    before = copy.deepcopy(student.state_dict())
    t_before = copy.deepcopy(teacher.state_dict())
    policy = make_policy(policy_name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    p_before = copy.deepcopy(policy.state_dict())
    ids, doc, pos = packed_toy(4, 64)
    ds = PackedDataset(ids, doc, pos, (doc >= 0).long())
    s = TrainSettings(layout=CacheLayout(13, 2, 6), steps=2, model_lr=model_lr, scorer_lr=1e-2, top_logits=16, scorer_training=ScorerTraining())
    module = DistillModule(student, teacher, policy, s)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, make_loader(ds, 2, 0))
    assert trainer.global_step == 2
    moved = [k for k, v in student.state_dict().items() if not torch.equal(before[k], v)]
    assert moved if model_lr > 0 else not moved, moved[:3]
    if policy.learned:
        assert any(not torch.equal(p_before[k], v) for k, v in policy.state_dict().items())
        assert "train/score_loss" in trainer.callback_metrics
    assert all(torch.equal(t_before[k], v) for k, v in teacher.state_dict().items())  # the teacher stays frozen


def test_chunked_topk_kl_equals_the_whole_computation():
    """Chunks (with recomputation in backward) give the same KL and the same gradient."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 37, 50, generator=g, requires_grad=True)
    t = torch.randn(2, 37, 50, generator=g)
    vals, idx = teacher_topk(t, 8)
    mask = torch.rand(2, 37, generator=g) > 0.3
    whole = topk_kl(logits, vals, idx, mask, chunk=10**6)
    (g_whole,) = torch.autograd.grad(whole, logits)
    chunked = topk_kl(logits, vals, idx, mask, chunk=7)
    (g_chunked,) = torch.autograd.grad(chunked, logits)
    assert torch.allclose(whole, chunked, atol=1e-6) and torch.allclose(g_whole, g_chunked, atol=1e-7)
    assert g_whole.abs().sum() > 0


@pytest.mark.parametrize(
    ("precision", "accelerator", "cuda", "flags", "expected"),
    [
        ("auto", "cuda", False, set(), "bf16-mixed"),  # asked for CUDA: bf16 is native there
        ("auto", "auto", True, set(), "bf16-mixed"),
        ("auto", "auto", False, set(), "32-true"),
        ("auto", "cpu", True, set(), "32-true"),  # a visible GPU does not count for a CPU run
        ("auto", "cpu", False, {"avx512f", "avx512_bf16"}, "bf16-mixed"),
        ("auto", "auto", False, {"amx_bf16", "amx_tile"}, "bf16-mixed"),
        ("auto", "cpu", False, {"avx512f", "amx_int8"}, "32-true"),
        ("32-true", "cuda", True, set(), "32-true"),  # explicit values pass through
        ("bf16-true", "cpu", False, set(), "bf16-true"),
    ],
)
def test_resolve_precision(monkeypatch, precision, accelerator, cuda, flags, expected):
    import kvpop.train as train

    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(train, "cpu_flags", lambda: set(flags))
    assert train.resolve_precision(precision, accelerator) == expected


def test_cpu_flags_reads_cpuinfo_and_tolerates_its_absence(tmp_path):
    from kvpop.train import cpu_flags

    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx512_bf16 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(f) == {"fpu", "avx512_bf16", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert cpu_flags(tmp_path / "arm") == set()


@pytest.mark.parametrize("policy_name", ["streaming_llm_plus", "kvpop_mlp", "kvpop_mlp_pool", "dms"])
def test_build_training_trains_two_steps(policy_name, tmp_path):
    """One config -> module, loader and trainer: two steps on a tiny model, settings taken from the config."""
    from kvpop.config import TrainConfig
    from kvpop.train import build_training

    teacher, _ = tiny_pair()
    t_before = copy.deepcopy(teacher.state_dict())
    ids, doc, pos = packed_toy(4, 64)
    cfg = TrainConfig(steps=2, batch_size=2, top_logits=16, scorer_hidden=8, model_lr=1e-3, tau=0.5, query_samples=3,
                      precision="32-true", accelerator="cpu")
    training = build_training(teacher, policy_name, PackedDataset(ids, doc, pos, (doc >= 0).long()), cfg=cfg,
                              layout=CacheLayout(13, 2, 6), seed=0)
    assert training.precision == "32-true" and training.long_range == 5
    assert training.policy.name == policy_name and training.student is not teacher
    s = training.module.s
    assert (s.steps, s.top_logits, s.model_lr, s.layout.long_range) == (2, 16, 1e-3, 5)
    assert (s.scorer_training.tau, s.scorer_training.query_samples) == (0.5, 3)
    before = copy.deepcopy(training.student.state_dict())
    trainer = training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    assert trainer.global_step == 2 and trainer.max_steps == 2 and trainer.gradient_clip_val == cfg.grad_clip
    assert any(not torch.equal(before[k], v) for k, v in training.student.state_dict().items())
    assert all(torch.equal(t_before[k], v) for k, v in teacher.state_dict().items())  # the teacher stays frozen
    if training.policy.gated:  # no boundary loss: the gate learns from the KL and the compression loss
        assert "train/score_loss" not in trainer.callback_metrics
        m = trainer.callback_metrics
        assert 0 < float(m["train/gate_evicted"]) < 1 and float(m["train/compression_target"]) > 0
        assert s.gate_training.tau == cfg.gate_tau
    elif training.policy.learned:
        assert "train/score_loss" in trainer.callback_metrics


@pytest.mark.parametrize("spec", ["mean", "mean.layer", "mean.model", "mean.blend", "mean.blend:0.8"])
def test_scoped_target_losses_equal_the_boundary_loss_on_scoped_targets(spec):
    """train.target's scope: each layer's boundary loss is the one of its target maximized over the heads
    (layer) or over every layer and head (model, computed after the forward); reference: the
    per-head targets recorded by a "group" forward, maximized by hand (a plain loop, not scope_targets)."""
    from kvpop.boundary import boundary_loss

    _, student = tiny_pair()
    ids, doc, pos = packed_toy(2, 64)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for layer in policy.scorer.layers:
        torch.nn.init.normal_(layer.w2)
    recorded = []  # (r_hat, r_tgt, log_gamma) per layer, from the group forward

    import kvpop.attention as attention

    real = attention.boundary_loss

    def spy(r_hat, r_tgt, log_gamma, *a, **kw):
        recorded.append((r_hat.detach(), r_tgt.clone(), log_gamma.detach()))
        return real(r_hat, r_tgt, log_gamma, *a, **kw)

    attention.boundary_loss = spy
    try:
        ctx = SparseContext.for_rows(policy, doc, pos, layout=CacheLayout(13, 2, 6), scorer_training=ScorerTraining(target=TargetSpec(kind="mean")))
        student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    finally:
        attention.boundary_loss = real
    target = TargetSpec.parse(spec)
    scope, blend = target.scope, target.blend  # blend: 0.5 unless written (mean.blend:0.8)
    ctx = SparseContext.for_rows(policy, doc, pos, layout=CacheLayout(13, 2, 6),
                                 scorer_training=ScorerTraining(target=target))
    student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    if scope in ("model", "blend"):
        assert ctx.losses == []  # waits for every layer
    losses = ctx.finish_scorer_losses()
    assert len(losses) == 2 and ctx.finish_scorer_losses() is losses and len(losses) == 2  # idempotent
    B, Hk, S = recorded[0][1].shape
    for L, (r_hat, _, log_gamma) in enumerate(recorded):
        want = torch.empty(B, Hk, S)
        for b in range(B):
            for h in range(Hk):
                for t in range(S):
                    heads = [(L, g) for g in range(Hk)] if scope == "layer" else [(L, h)]
                    if scope in ("model", "blend"):
                        heads = [(l2, g) for l2 in range(len(recorded)) for g in range(Hk)]
                    want[b, h, t] = max(recorded[l2][1][b, g, t].item() for l2, g in heads)
                    if scope == "blend":  # the head's own target and the model's maximum, weighed
                        want[b, h, t] = blend * want[b, h, t] + (1 - blend) * recorded[L][1][b, h, t].item()
        ref, _ = boundary_loss(r_hat, want, log_gamma, doc, pos, layout=CacheLayout(13, 2, 6))
        assert torch.allclose(losses[L].detach().double(), ref.double(), atol=1e-6), (scope, L)
    if scope != "group":  # the scope changes the labels on this toy: the test can tell the scopes apart
        plain, _ = boundary_loss(recorded[0][0], recorded[0][1], recorded[0][2], doc, pos, layout=CacheLayout(13, 2, 6))
        assert not torch.allclose(losses[0].detach().double(), plain.double(), atol=1e-6)
    losses[0].backward()  # the deferred loss still reaches the scorer
    assert policy.scorer.layers[0].w2.grad is not None and policy.scorer.layers[0].w2.grad.abs().sum() > 0


def test_value_weighted_target_adds_each_layers_log_value_norm_in_training():
    """train.target ``max.value``: the boundary loss of every layer gets the plain ``max`` target plus
    log(||v|| / sqrt(D)) of that layer's values (those its scorer reads), token by token."""
    import kvpop.attention as attention

    _, student = tiny_pair()
    ids, doc, pos = packed_toy(2, 64)
    policy = make_policy("kvpop_mlp", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    recorded, values = {}, []
    real_loss, real_scores = attention.boundary_loss, policy.scores

    def spy_scores(layer, keys, vals, *a, **kw):
        values.append(vals.detach().float().clone())
        return real_scores(layer, keys, vals, *a, **kw)

    policy.scores = spy_scores
    try:
        for spec in ("max", "max.value"):
            recorded[spec] = []

            def spy(r_hat, r_tgt, log_gamma, *a, _out=recorded[spec], **kw):
                _out.append(r_tgt.clone())
                return real_loss(r_hat, r_tgt, log_gamma, *a, **kw)

            attention.boundary_loss = spy
            values.clear()
            ctx = SparseContext.for_rows(policy, doc, pos, layout=CacheLayout(13, 2, 6), scorer_training=ScorerTraining(target=TargetSpec.parse(spec)))
            with torch.no_grad():
                student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
    finally:
        attention.boundary_loss = real_loss
        del policy.scores
    assert len(recorded["max"]) == len(recorded["max.value"]) == len(values) == 2
    for plain, weighted, v in zip(recorded["max"], recorded["max.value"], values, strict=True):
        D = v.shape[-1]
        torch.testing.assert_close(weighted, plain + (v.norm(dim=-1) / math.sqrt(D)).log(), atol=1e-5, rtol=1e-5)
