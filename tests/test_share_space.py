"""The age decay on the attention share's scale (``scorer_recency_space="share"``, kvpop.scorer) and
the scorer's calibration term (kvpop.boundary.calibration_loss): the priority, the boundary loss on
that scale against a brute-force teacher, the calibration's mask, persistence and configuration."""

import math

import pytest
import torch

from kvpop.boundary import boundary_labels, boundary_loss, calibration_loss
from kvpop.config import TrainConfig
from kvpop.export import export, load_export
from kvpop.policies import make_policy
from kvpop.scorer import static_priority, with_recency
from kvpop.selection import eviction_times

DIMS = dict(num_layers=2, num_kv_heads=2, head_dim=16)
SINKS, WINDOW, K = 2, 4, 5
SHARE = 0.0005  # the boundary tests' decay: 0.01-0.02 over a row, as large as their shares exp(r_tgt)


def kv(S=48, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 2, S, 16, generator=g), torch.randn(B, 2, S, 16, generator=g), torch.arange(S).expand(B, S)


def share_policy(name="kvpop_mlp", recency=0.3):
    torch.manual_seed(0)
    policy = make_policy(name, **DIMS, scorer_hidden=8, scorer_recency=recency, scorer_recency_space="share")
    for p in policy.scorer.layers.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return policy


@pytest.mark.parametrize("name", ["kvpop_mlp", "kvpop"])
def test_the_priority_is_the_log_of_share_plus_decay_and_ignores_the_learned_decay(name):
    policy = share_policy(name)
    k, v, pos = kv()
    sc = policy.scores(1, k, v, pos, window=WINDOW)
    want = (sc.r_hat.detach().double().exp() + 0.3 * pos[:, None].double()).log()
    assert torch.allclose(sc.prio, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        policy.scorer.decay.logit.fill_(-3.0)  # another learned decay: no effect on this scale
    assert torch.equal(policy.scores(1, k, v, pos, window=WINDOW).prio, sc.prio)
    log_space = with_recency(policy, 0.3, space="log")  # the same scorer, the decay on the log scale
    assert log_space.scorer.config["recency_space"] == "log" and policy.scorer.config["recency_space"] == "share"
    assert not torch.allclose(log_space.scores(1, k, v, pos, window=WINDOW).prio, sc.prio)


def test_a_large_share_is_kept_where_the_log_decay_drops_it():
    """Two tokens: a rare large share (r = 0) far back and a newer small one (r = -6). On the share's
    scale the older keeps its rank unless the decay times their distance passes its share; on the log
    scale the same decay per token costs it 100 tokens' worth of its log share."""
    r = torch.tensor([[[0.0, -6.0]]])
    pos = torch.tensor([[100, 200]])
    share = static_priority(r, pos, torch.zeros(1), share=0.001)  # 1 + 0.1 vs exp(-6) + 0.2
    log = static_priority(r, pos, torch.tensor([-0.1]))  # 0 + 10 vs -6 + 20
    assert share[0, 0, 0] > share[0, 0, 1] and log[0, 0, 0] < log[0, 0, 1]
    # and where the shares are alike, the share-scale decay is the recency rule
    alike = static_priority(torch.full((1, 1, 2), -8.0), pos, torch.zeros(1), share=0.001)
    assert alike[0, 0, 1] > alike[0, 0, 0]


def test_the_oracle_and_a_scorer_that_fits_it_rank_alike():
    """A share-space scorer whose r_hat equals the target makes the eviction times of oracle_target with
    space="share" at the same decay (the ceiling that the calibration aims at)."""
    L, S = 2, 48
    policy = share_policy(recency=0.05)
    k, v, pos = kv(S, B=1)
    oracle = make_policy("oracle_target").configure(target="max", recency=0.05, space="share")
    r = [policy.scores(layer, k, v, pos).r_hat.detach() for layer in range(L)]
    oracle.fit_trace(input_ids=torch.zeros(1, S, dtype=torch.long), record={}, targets={("max", 8.0): r})
    doc = torch.zeros_like(pos)
    for layer in range(L):
        got = eviction_times(policy.scores(layer, k, v, pos).prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
        want = eviction_times(oracle.scores(layer, k, v, pos).prio, doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
        assert torch.equal(got, want)


def brute_force_labels(r_tgt, pos, share):
    """The teacher's keep/drop decision at every decided query, by sorting E(q) itself (one document)."""
    B, Hk, S = r_tgt.shape
    prio = (r_tgt.double().exp() + share * pos[:, None].double())  # (B, Hk, S)
    out = {}
    for b in range(B):
        for h in range(Hk):
            for t_new in range(SINKS, S - WINDOW):  # leaves the window at q = t_new + WINDOW
                others = list(range(SINKS, t_new))  # E(q) without t_new
                if len(others) < K:
                    continue
                # rank: higher priority first, ties to the newer token (the selection's order)
                ranked = sorted(others, key=lambda t: (-prio[b, h, t].item(), -t))
                bnd = ranked[K - 1]
                keep = (prio[b, h, t_new], t_new) > (prio[b, h, bnd], bnd)
                out[(b * Hk + h, t_new)] = (bnd, 1.0 if keep else -1.0)
    return out


def test_boundary_labels_on_the_share_scale_match_a_brute_force_teacher():
    B, Hk, S = 2, 2, 24
    g = torch.Generator().manual_seed(3)
    r_tgt = torch.randn(B, Hk, S, generator=g) * 2 - 3
    pos = torch.arange(S).expand(B, S)
    doc = torch.zeros_like(pos)
    lab = boundary_labels(r_tgt, torch.zeros(Hk), doc, pos, sinks=SINKS, window=WINDOW, long_range=K, share=SHARE)
    want = brute_force_labels(r_tgt, pos, SHARE)
    got = {(int(r), int(t)): (int(b), float(y)) for r, t, b, y in zip(lab.row, lab.t_new, lab.t_bnd, lab.y, strict=True)}
    assert got == want
    plain = boundary_labels(r_tgt, torch.zeros(Hk), doc, pos, sinks=SINKS, window=WINDOW, long_range=K)
    assert not torch.equal(plain.y, lab.y)  # the decay changed some decisions


def test_the_share_scale_loss_reads_the_level_the_log_scale_loss_does_not():
    B, Hk, S = 1, 2, 40
    g = torch.Generator().manual_seed(4)
    r_tgt = torch.randn(B, Hk, S, generator=g) - 4
    r_hat = r_tgt + 0.3 * torch.randn(B, Hk, S, generator=g)
    pos = torch.arange(S).expand(B, S)
    doc = torch.zeros_like(pos)
    kw = dict(sinks=SINKS, window=WINDOW, long_range=K, weighting="uniform")
    lg = torch.full((Hk,), -0.01, dtype=torch.float64)

    def loss(x, **extra):
        return boundary_loss(x, r_tgt, lg, doc, pos, **kw, **extra)[0].item()

    assert loss(r_hat + 5.0) == pytest.approx(loss(r_hat), rel=1e-6)  # log scale: only differences count
    assert loss(r_hat + 5.0, share=SHARE) != pytest.approx(loss(r_hat, share=SHARE), rel=1e-3)

    def agreement(x, **extra):
        return boundary_loss(x, r_tgt, lg, doc, pos, **kw, **extra)[1]["agreement"].item()

    # the target itself makes every decision right on either scale; shifted, only on the log scale
    assert agreement(r_tgt, share=SHARE) == 1.0 and agreement(r_tgt - 3.0) == 1.0
    assert agreement(r_tgt - 3.0, share=SHARE) < 0.95
    x = r_hat.clone().requires_grad_(True)
    lg_ = lg.clone().requires_grad_(True)
    boundary_loss(x, r_tgt, lg_, doc, pos, **kw, share=SHARE)[0].backward()
    assert x.grad.abs().sum() > 0 and lg_.grad.abs().sum() == 0  # the learned decay is unused on this scale


def test_calibration_loss_is_the_squared_error_over_eligible_tokens_with_a_target():
    B, Hk, S = 2, 2, 16
    g = torch.Generator().manual_seed(6)
    r_tgt = torch.randn(B, Hk, S, generator=g)
    r_tgt[:, :, -3:] = -math.inf  # tokens that no later query sees: no target
    pos = torch.arange(S).expand(B, S)
    doc = torch.zeros_like(pos)
    r_hat = r_tgt.clone()
    r_hat[:, :, -3:] = 100.0
    r_hat[:, :, :SINKS] = -100.0  # sinks are never ranked
    assert calibration_loss(r_hat, r_tgt, doc, pos, sinks=SINKS).item() == 0.0
    r_hat[:, :, SINKS:-3] += 2.0
    assert calibration_loss(r_hat, r_tgt, doc, pos, sinks=SINKS).item() == pytest.approx(4.0)
    none = torch.full_like(r_tgt, -math.inf)
    x = r_hat.clone().requires_grad_(True)
    out = calibration_loss(x, none, doc, pos, sinks=SINKS)
    out.backward()
    assert out.item() == 0.0 and x.grad is not None


def test_the_space_is_exported_configured_and_checked(tiny_llama_dir, tiny_tokenizer, tmp_path):
    from kvpop.modeling import load_model

    policy = share_policy(recency=0.02)
    export(load_model(tiny_llama_dir), tiny_tokenizer, policy, tmp_path / "exp", budget=SINKS + WINDOW + K, sinks=SINKS, window=WINDOW)
    k, v, pos = kv()
    want = policy.scores(0, k, v, pos).prio
    _, _, loaded, meta = load_export(tmp_path / "exp")
    assert meta["scorer"]["recency_space"] == "share" and loaded.scorer.decay.share == 0.02
    assert torch.allclose(loaded.scores(0, k, v, pos).prio, want, rtol=0, atol=1e-9)
    _, _, as_log, _ = load_export(tmp_path / "exp", recency_space="log")
    assert as_log.scorer.decay.share == 0.0 and as_log.scorer.decay.recency == 0.02
    with pytest.raises(ValueError, match="recency space must be one of log, share"):
        make_policy("kvpop_mlp", **DIMS, scorer_recency_space="linear")
    with pytest.raises(ValueError, match="scorer_recency_space"):
        TrainConfig(scorer_recency_space="linear")
    with pytest.raises(ValueError, match="scorer_calibration"):
        TrainConfig(scorer_calibration=-1.0)


def test_training_uses_the_space_and_logs_the_calibration(tiny_model, tmp_path):
    from kvpop.attention import register
    from kvpop.train import PackedDataset, build_training

    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(2))
    doc, pos = torch.zeros(2, 64, dtype=torch.long), torch.arange(64).expand(2, 64)
    cfg = TrainConfig(steps=2, batch_size=2, top_logits=16, scorer_hidden=8, scorer_recency=0.001, scorer_recency_space="share",
                      scorer_calibration=0.5, precision="32-true", accelerator="cpu", log_every=1)
    teacher = tiny_model("llama", attn_implementation=register())
    training = build_training(teacher, "kvpop_mlp", PackedDataset(ids, doc, pos, torch.ones_like(doc)), cfg=cfg,
                              budget=SINKS + WINDOW + K, sinks=SINKS, window=WINDOW, seed=0)
    assert training.policy.scorer.decay.share == 0.001
    assert training.module.s.scorer_training.calibration == 0.5
    before = [p.detach().clone() for p in training.policy.scorer.layers.parameters()]
    trainer = training.fit(enable_progress_bar=False, default_root_dir=tmp_path)
    assert any(not torch.equal(a, b) for a, b in zip(before, training.policy.scorer.layers.parameters(), strict=True))
    assert float(trainer.callback_metrics["train/calibration"]) > 0
