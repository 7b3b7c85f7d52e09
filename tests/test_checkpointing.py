"""Activation checkpointing under the sparse context: the same step, loss and gradients as without.

With ``gradient_checkpointing_enable(use_reentrant=False)`` every decoder layer runs twice (forward,
then recomputation in backward). The context must record each layer once (one boundary loss per
layer, the query-sample generator advanced once), rerun the executor on the recorded pattern and
give exactly the gradients of the plain step, for the student and the scorer.
"""

import copy
from dataclasses import dataclass, field

import pytest
import torch

from kvpop.attention import ScorerTraining, SparseContext, register
from kvpop.geometry import CacheLayout
from kvpop.policies import Dense, make_policy
from kvpop.train import prediction_mask, teacher_topk, topk_kl

from conftest import packed_toy

SINKS, WINDOW, K = 2, 6, 5
LAYOUT = CacheLayout.of(sinks=SINKS, window=WINDOW, long_range=K)


@dataclass
class CountingContext(SparseContext):
    """A SparseContext that records which layers attend, in order."""

    calls: list = field(default_factory=list)

    def attend(self, layer, q, k, v, scale):
        self.calls.append(layer)
        return super().attend(layer, q, k, v, scale)


@pytest.fixture
def tiny_models(tiny_model):
    """``tiny_models(model_type)`` -> (frozen teacher, trainable student copy), kvpop attention."""

    def make(model_type: str):
        teacher = tiny_model(model_type, attn_implementation=register()).requires_grad_(False)
        return teacher, copy.deepcopy(teacher).train().requires_grad_(True)

    return make


def tiny_policy(name: str):
    torch.manual_seed(1)
    pol = make_policy(name, num_layers=2, num_kv_heads=2, head_dim=16, scorer_hidden=8)
    for p in pol.parameters():  # a scorer past its zero-initialized start
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.3)
    return pol


def train_step(teacher, student, policy, ids, doc, pos, *, checkpointing: bool):
    """The DistillModule step (teacher top-k, student under the policy, KL + mean boundary loss) and backward.

    On CUDA the contexts use the FlexAttention executor (compiled), as training does there.
    """
    executor = "flex" if ids.is_cuda else "sdpa"
    if checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    scorer_calls = []
    scores = policy.scores

    def counted_scores(layer, *a, **kw):
        scorer_calls.append(layer)
        return scores(layer, *a, **kw)

    policy.scores = counted_scores
    mask = prediction_mask((doc >= 0).long(), doc)
    with torch.no_grad():
        t_ctx = SparseContext.for_rows(Dense(), doc, pos, layout=LAYOUT, executor=executor)
        top_vals, top_idx = teacher_topk(teacher(input_ids=ids, position_ids=pos, kvpop_ctx=t_ctx).logits, 16)
    gen = torch.Generator().manual_seed(7)
    st = ScorerTraining(query_samples=3, generator=gen) if policy.learned else None
    ctx = CountingContext.for_rows(policy, doc, pos, layout=LAYOUT, scorer_training=st, executor=executor)
    logits = student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    loss = topk_kl(logits, top_vals, top_idx, mask)
    if ctx.losses:
        loss = loss + torch.stack(ctx.losses).mean()
    loss.backward()
    del policy.scores
    grads = {f"student.{n}": p.grad.clone() for n, p in student.named_parameters()}
    grads |= {f"policy.{n}": p.grad.clone() for n, p in policy.named_parameters()}
    return dict(loss=loss.detach(), losses=[x.detach() for x in ctx.losses], grads=grads, calls=ctx.calls,
                scorer_calls=scorer_calls, generator_state=gen.get_state(), decisions=[float(s["decisions"]) for s in ctx.stats])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [("cpu", m, p) for m in ("qwen3", "llama") for p in ("kvpop_mlp", "kvpop", "streaming_llm_plus")]
CASES += [pytest.param("cuda", "qwen3", p, marks=CUDA) for p in ("kvpop_mlp", "kvpop", "streaming_llm_plus")]


@pytest.mark.parametrize(("device", "model_type", "policy_name"), CASES)
def test_checkpointing_gives_the_same_loss_and_gradients(device, model_type, policy_name, tiny_models):
    """CPU: SDPA executor on 64-token rows; CUDA: compiled FlexAttention on 256-token rows (several blocks)."""
    ids, doc, pos = (t.to(device) for t in packed_toy(2, 64 if device == "cpu" else 256, seed=4))
    teacher, student = (m.to(device) for m in tiny_models(model_type))
    policy = tiny_policy(policy_name).to(device)
    plain = train_step(teacher, copy.deepcopy(student), copy.deepcopy(policy), ids, doc, pos, checkpointing=False)
    ckpt = train_step(teacher, copy.deepcopy(student), copy.deepcopy(policy), ids, doc, pos, checkpointing=True)
    n_layers = student.config.num_hidden_layers

    assert plain["calls"] == list(range(n_layers))
    assert sorted(ckpt["calls"]) == sorted(2 * list(range(n_layers)))  # checkpointing recomputed every layer
    tol = dict(rtol=1e-6, atol=1e-7) if device == "cpu" else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ckpt["loss"], plain["loss"], **tol)
    if policy.learned:
        assert len(ckpt["losses"]) == len(plain["losses"]) == n_layers  # one boundary loss per layer
        for a, b in zip(ckpt["losses"], plain["losses"]):
            torch.testing.assert_close(a, b, **tol)
        assert ckpt["decisions"] == plain["decisions"]
        assert ckpt["scorer_calls"] == plain["scorer_calls"] == list(range(n_layers))  # scored once per layer
        assert torch.equal(ckpt["generator_state"], plain["generator_state"])  # query samples drawn once per layer
    else:
        assert ckpt["losses"] == plain["losses"] == []
    assert ckpt["grads"].keys() == plain["grads"].keys()
    for name, g in plain["grads"].items():
        gtol = dict(rtol=1e-5, atol=1e-7) if device == "cpu" else dict(rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(ckpt["grads"][name], g, **gtol, msg=lambda m, n=name: f"{n}: {m}")
    # the comparison is not vacuous: the student and (for learned policies) the scorer get gradients
    assert all(g.abs().sum() > 0 for n, g in plain["grads"].items() if n.startswith("student.") and "norm" not in n)
    if policy.learned:
        assert sum(g.abs().sum() for n, g in plain["grads"].items() if n.startswith("policy.")) > 0


def test_a_context_serves_one_forward(tiny_models):
    ids, doc, pos = packed_toy(2, 32, seed=5)
    teacher, _ = tiny_models("qwen3")
    ctx = SparseContext.for_rows(tiny_policy("kvpop_mlp"), doc, pos, layout=LAYOUT)
    with torch.no_grad():
        teacher(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)
        with pytest.raises(RuntimeError, match="one forward pass"):
            teacher(input_ids=ids, position_ids=pos, kvpop_ctx=ctx)


def test_reentrant_checkpointing_is_refused(tiny_models):
    ids, doc, pos = packed_toy(2, 32, seed=6)
    _, student = tiny_models("qwen3")
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    policy = tiny_policy("kvpop_mlp")
    ctx = SparseContext.for_rows(policy, doc, pos, layout=LAYOUT, scorer_training=ScorerTraining())
    logits = student(input_ids=ids, position_ids=pos, kvpop_ctx=ctx).logits
    with pytest.raises(RuntimeError, match="use_reentrant"):
        (logits.float().pow(2).mean() + torch.stack(ctx.losses).mean()).backward()
