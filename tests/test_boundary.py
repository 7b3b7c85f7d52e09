"""Teacher labels at the eviction boundary vs a brute-force per-query top-k; loss gradients."""

import pytest
import torch

from kvpop.boundary import boundary_labels, boundary_loss
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
    lab = boundary_labels(r, log_gamma, doc, pos, sinks=sinks, window=window, long_range=k)
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
    loss, stats = boundary_loss(r_hat, r_tgt, log_gamma, doc, pos, sinks=2, window=4, long_range=3)
    loss.backward()
    assert stats["decisions"] > 0
    assert r_hat.grad.abs().sum() > 0 and theta.grad.abs().sum() > 0


def test_loss_is_small_when_student_matches_teacher():
    B, Hk, S = 1, 2, 80
    _, doc, pos = packed_toy(B, S)
    r_tgt = torch.randn(B, Hk, S)
    lg = torch.full((Hk,), -1e-4, dtype=torch.float64)
    good, s_good = boundary_loss(r_tgt * 50, r_tgt, lg, doc, pos, sinks=2, window=4, long_range=3, tie_margin=0.0)
    bad, s_bad = boundary_loss(-r_tgt * 50, r_tgt, lg, doc, pos, sinks=2, window=4, long_range=3, tie_margin=0.0)
    assert s_good["agreement"] > 0.95 and s_bad["agreement"] < 0.05
    assert good < 0.05 < bad
