"""The KL's straight-through signal to a one-pool scorer (``train.scorer_kl``, ``ScorerTraining.kl_signal``).

``kl_signal * (r_hat - r_hat.detach())`` on the attention logits of tokens past the window: the training forward
is the forward without it (logits, pattern, the pool's boundary loss), the model's gradients are unchanged, and
the loss's gradient reaches the scorer, linearly in ``kl_signal``; at 0 the scorer gets the boundary loss alone.
The stacked (deferred) scorers and the per-layer ones give the same loss without the signal; with it, each layer is
scored before its attention. The setting is a validated param that one policy may set apart.
"""

import pytest
import torch

from kvpop.attention import ScorerTraining, SparseContext
from kvpop.config import TrainConfig
from kvpop.decode import enable
from kvpop.geometry import CacheLayout
from kvpop.policies import make_policy
from kvpop.pool import pool_chunked

SINKS, WINDOW, K = 2, 8, 5
LAYOUT = CacheLayout(SINKS + WINDOW + K, SINKS, WINDOW)


@pytest.fixture(scope="module")
def llama(tiny_model):
    return enable(tiny_model("llama"))


@pytest.fixture(scope="module")
def rows(llama):
    torch.manual_seed(5)
    policy = make_policy("kvpop_mlp_pool", num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    with torch.no_grad():
        for p in policy.parameters():
            p.normal_(std=0.3)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(6))
    pos = torch.arange(40).expand(2, 40)
    doc = torch.zeros_like(pos)
    evict, _ = pool_chunked(llama, policy, ids, layout=LAYOUT)
    return policy, ids, pos, doc, evict


def forward(llama, rows, signal: float, stack: bool = True):
    """(logits (B, S, V), the pool's scorer loss, the context) of one training forward under the pool's times."""
    policy, ids, pos, doc, evict = rows
    st = ScorerTraining(weighting="uniform", kl_signal=signal)
    ctx = SparseContext.for_rows(policy, doc, pos, LAYOUT, scorer_training=st, global_evict=evict, stack_scorers=stack)
    logits = llama(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    (loss,) = ctx.finish_scorer_losses()
    return logits, loss, ctx


def grads(module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def zero(*modules) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def some_loss(logits: torch.Tensor) -> torch.Tensor:
    """A fixed function of the logits standing for the KL (its gradient to the logits is not uniform)."""
    w = torch.linspace(-1, 1, logits.shape[-1])
    return (torch.log_softmax(logits.float(), -1) * w).sum(-1).mean()


def test_the_forward_and_the_boundary_loss_are_unchanged(llama, rows):
    base_logits, base_loss, _ = forward(llama, rows, 0.0)
    per_layer_logits, per_layer_loss, _ = forward(llama, rows, 0.0, stack=False)
    for signal in (0.5, 4.0):
        logits, loss, ctx = forward(llama, rows, signal)
        assert ctx.scored_layers == 2
        torch.testing.assert_close(logits, base_logits, rtol=0, atol=1e-6)
        torch.testing.assert_close(loss, base_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(per_layer_logits, base_logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(per_layer_loss, base_loss, rtol=1e-6, atol=1e-7)


def test_the_kl_reaches_the_scorer_linearly_and_leaves_the_models_gradients(llama, rows):
    policy = rows[0]
    scorer_grads, model_grads = {}, {}
    for signal in (0.0, 1.0, 2.0):
        zero(llama, policy)
        logits, _, _ = forward(llama, rows, signal)
        some_loss(logits).backward()
        scorer_grads[signal], model_grads[signal] = grads(policy), grads(llama)
    # no signal: the loss of the logits has no path to the scorer (its pattern is given, its scores detached)
    assert all(g is None or not g.any() for g in scorer_grads[0.0])
    one, two = scorer_grads[1.0], scorer_grads[2.0]
    assert sum(float(g.abs().sum()) for g in one if g is not None) > 0
    for a, b in zip(one, two, strict=True):
        if a is not None:
            torch.testing.assert_close(b, 2 * a, rtol=1e-4, atol=1e-8)
    for a, b in zip(model_grads[0.0], model_grads[2.0], strict=True):
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_with_the_boundary_loss_the_signal_adds_to_its_gradient(llama, rows):
    policy = rows[0]
    zero(llama, policy)
    logits, loss, _ = forward(llama, rows, 0.0)
    loss.backward()
    boundary = grads(policy)
    zero(llama, policy)
    logits, _, _ = forward(llama, rows, 1.0)
    some_loss(logits).backward()
    signal = grads(policy)
    zero(llama, policy)
    logits, loss, _ = forward(llama, rows, 1.0)
    (loss + some_loss(logits)).backward()
    for b, s, both in zip(boundary, signal, grads(policy), strict=True):
        if both is not None:
            torch.testing.assert_close(both, (0 if b is None else b) + (0 if s is None else s), rtol=1e-4, atol=1e-7)


def test_scorer_kl_is_a_validated_param_one_policy_may_set():
    cfg = TrainConfig(per_policy={"kvpop_mlp_pool": {"scorer_kl": 2.0}})
    assert cfg.for_policy("kvpop_mlp_pool").scorer_kl == 2.0 and cfg.for_policy("kvpop_mlp").scorer_kl == 0.0
    with pytest.raises(ValueError, match="scorer_kl"):
        TrainConfig(scorer_kl=-1.0)
