"""Teacher labels at the eviction boundary vs a brute-force per-query top-k; loss gradients."""

import pytest
import torch

from kvpop.boundary import boundary_labels, boundary_loss
from kvpop.geometry import CacheLayout
from kvpop.scorer import static_priority

from conftest import packed_toy


def brute_labels(r_tgt, log_gamma, doc, pos, sinks, window, k):
    B, Hk, S = r_tgt.shape
    prio = static_priority(r_tgt, pos, log_gamma)
    out = {}
    for b in range(B):
        for h in range(Hk):
            for t_new in range(S):
                q = t_new + window
                if q >= S or doc[b, t_new] < 0 or doc[b, q] != doc[b, t_new] or pos[b, t_new] < sinks:
                    continue
                rest = [t for t in range(t_new) if doc[b, t] == doc[b, t_new] and pos[b, t] >= sinks]
                if len(rest) < k or k == 0:
                    continue  # E(q) holds at most k tokens: nothing to decide
                key = lambda t, b=b, h=h: (prio[b, h, t].item(), t)  # higher priority, then newer, ranks first
                rest.sort(key=key, reverse=True)
                t_bnd = rest[k - 1]
                out[(b * Hk + h, t_new)] = (t_bnd, 1.0 if key(t_new) > key(t_bnd) else -1.0)
    return out


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_labels_match_brute_force(ties, k):
    B, Hk, S, sinks, window = 2, 3, 64, 2, 5
    _, doc, pos = packed_toy(B, S, seed=k)
    g = torch.Generator().manual_seed(k)
    r = torch.randint(0, 3, (B, Hk, S), generator=g).float() if ties else torch.randn(B, Hk, S, generator=g)
    log_gamma = torch.log(torch.tensor([0.999, 0.9999, 0.999999], dtype=torch.float64))
    if ties:
        log_gamma = torch.zeros(3, dtype=torch.float64)  # keep exact ties in the priority
    lab = boundary_labels(r, log_gamma, doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k))
    got = {(int(a), int(t)): (int(bd), float(y)) for a, t, bd, y in zip(lab.row, lab.t_new, lab.t_bnd, lab.y)}
    ref = brute_labels(r, log_gamma, doc, pos, sinks, window, k)
    assert ref, "the toy must have decided queries"
    assert got == ref


def test_loss_gradients_reach_only_scorer_inputs_and_decay():
    B, Hk, S = 1, 2, 80
    _, doc, pos = packed_toy(B, S)
    r_hat = torch.randn(B, Hk, S, requires_grad=True)
    theta = torch.zeros(Hk, dtype=torch.float64, requires_grad=True)
    log_gamma = torch.log(0.999 + 0.000999 * torch.sigmoid(theta))
    r_tgt = torch.randn(B, Hk, S)
    loss, stats = boundary_loss(r_hat, r_tgt, log_gamma, doc, pos, layout=CacheLayout.of(sinks=2, window=4, long_range=3))
    loss.backward()
    assert stats["decisions"] > 0
    assert r_hat.grad.abs().sum() > 0 and theta.grad.abs().sum() > 0


def test_loss_is_small_when_student_matches_teacher():
    B, Hk, S = 1, 2, 80
    _, doc, pos = packed_toy(B, S)
    r_tgt = torch.randn(B, Hk, S)
    lg = torch.full((Hk,), -1e-4, dtype=torch.float64)
    good, s_good = boundary_loss(r_tgt * 50, r_tgt, lg, doc, pos, layout=CacheLayout.of(sinks=2, window=4, long_range=3), tie_margin=0.0)
    bad, s_bad = boundary_loss(-r_tgt * 50, r_tgt, lg, doc, pos, layout=CacheLayout.of(sinks=2, window=4, long_range=3), tie_margin=0.0)
    assert s_good["agreement"] > 0.95 and s_bad["agreement"] < 0.05
    assert good < 0.05 < bad


def test_regret_weights_are_the_attention_mass_a_wrong_decision_costs():
    """``weighting="regret"``: each decision's logistic loss weighted by |exp(r_new) - exp(r_bnd)|
    (the competitor's score at t_new's age), normalized to mean 1 per head; brute force over the
    brute-force labels."""
    B, Hk, S, sinks, window, k = 2, 2, 48, 2, 4, 3
    _, doc, pos = packed_toy(B, S, seed=3)
    g = torch.Generator().manual_seed(3)
    r_tgt = torch.randn(B, Hk, S, generator=g) - 3
    r_hat = torch.randn(B, Hk, S, generator=g)
    log_gamma = torch.log(torch.tensor([0.99, 0.999], dtype=torch.float64))
    loss, _ = boundary_loss(r_hat, r_tgt, log_gamma, doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), tau=0.7, weighting="regret")
    lab = brute_labels(r_tgt, log_gamma, doc, pos, sinks, window, k)
    per_head: dict[int, list[tuple[float, float]]] = {}
    for (row, t_new), (t_bnd, y) in lab.items():
        b, h = divmod(row, Hk)
        age = (t_bnd - t_new) * log_gamma[h].item()  # < 0 for an older competitor: its score decays
        regret = abs(torch.tensor(r_tgt[b, h, t_new].item(), dtype=torch.float64).exp() - torch.tensor(r_tgt[b, h, t_bnd].item() - age,
                                                                                                    dtype=torch.float64).exp()).item()
        delta = r_hat[b, h, t_new].item() - r_hat[b, h, t_bnd].item() + age
        per_head.setdefault(h, []).append((regret, torch.nn.functional.softplus(torch.tensor(-y * delta / 0.7, dtype=torch.float64)).item()))
    terms = [w / (sum(x for x, _ in v) / len(v)) * f for v in per_head.values() for w, f in v]
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_uniform_weights_are_the_plain_mean_of_the_logistic_losses():
    """``weighting="uniform"``: the mean of softplus(-y Delta / tau) over every brute-force decision."""
    B, Hk, S, sinks, window, k = 2, 2, 48, 2, 4, 3
    _, doc, pos = packed_toy(B, S, seed=5)
    g = torch.Generator().manual_seed(5)
    r_tgt, r_hat = torch.randn(B, Hk, S, generator=g), torch.randn(B, Hk, S, generator=g)
    log_gamma = torch.log(torch.tensor([0.99, 0.999], dtype=torch.float64))
    loss, _ = boundary_loss(r_hat, r_tgt, log_gamma, doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), tau=0.7, weighting="uniform")
    terms = []
    for (row, t_new), (t_bnd, y) in brute_labels(r_tgt, log_gamma, doc, pos, sinks, window, k).items():
        b, h = divmod(row, Hk)
        delta = r_hat[b, h, t_new].item() - r_hat[b, h, t_bnd].item() + (t_bnd - t_new) * log_gamma[h].item()
        terms.append(torch.nn.functional.softplus(torch.tensor(-y * delta / 0.7, dtype=torch.float64)).item())
    assert len(terms) > 10 and loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    paper = boundary_loss(r_hat, r_tgt, log_gamma, doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k), tau=0.7)[0].item()
    assert loss.item() != pytest.approx(paper, rel=1e-3)  # not the paper's weights


@pytest.mark.parametrize("weighting, direction", [("tie", -1), ("regret", +1)])
def test_regret_weighting_keeps_a_rarely_but_badly_needed_token(weighting, direction):
    """Tokens of kind A are needed badly but rarely (target log 0.5 for a tenth of them, else log
    1e-4); kind B always a little (log 0.01), so keeping A keeps more attention mass on average
    (0.05 against 0.01).
    A scorer that shifts A by ``a`` gets a gradient that lowers A under the paper's tie/class-balance
    weights (labels only count how often A wins) and raises it under regret weights."""
    S, sinks, window, k = 600, 2, 8, 20
    g = torch.Generator().manual_seed(0)
    is_a = torch.rand(S, generator=g) < 0.2
    big = torch.rand(S, generator=g) < 0.1
    r_tgt = torch.where(is_a, torch.where(big, torch.tensor(0.5).log(), torch.tensor(1e-4).log()), torch.tensor(0.01).log())[None, None]
    doc, pos = torch.zeros(1, S, dtype=torch.long), torch.arange(S)[None]
    a = torch.zeros((), requires_grad=True)
    r_hat = a * is_a.float()[None, None]
    loss, _ = boundary_loss(r_hat, r_tgt, torch.zeros(1, dtype=torch.float64), doc, pos, layout=CacheLayout.of(sinks=sinks, window=window, long_range=k),
                            weighting=weighting)
    loss.backward()
    assert torch.sign(-a.grad).item() == direction  # gradient descent moves a this way
